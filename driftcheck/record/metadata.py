"""Run metadata for the manifest: who recorded, where, with which versions and settings."""
from __future__ import annotations

import datetime
import os
import platform
import socket
import uuid
from typing import Any

import torch
from torch import nn

from driftcheck.version import __version__


def run_metadata(*, model: nn.Module, device: torch.device, mode: str, steps: int,
                 **extra: Any) -> dict[str, Any]:
    """Run metadata for the manifest: who, where, with which versions and settings."""
    params = sum(p.numel() for p in model.parameters())
    meta: dict[str, Any] = {
        "run_id": uuid.uuid4().hex,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "driftcheck": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "device": str(device),
        "device_type": device.type,
        "mode": mode,
        "steps": steps,
        "parameters": params,
        "model_class": type(model).__name__,
        "rank": int(os.environ.get("RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        # str/bytes hashes (the order of a set of strings): "random" where each process draws one
        "python_hash_seed": os.environ.get("PYTHONHASHSEED") or "random",
    }
    try:
        from driftcheck.targets import precision

        meta["precision"] = precision.capture_settings(device, extra.get("dtype_obj", torch.float32),
                                                       autocast=extra.get("autocast"),
                                                       fp8=extra.get("fp8"))
    except ImportError:
        meta["precision"] = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                             "threads": torch.get_num_threads()}
    extra.pop("dtype_obj", None)
    meta.update(extra)
    return meta

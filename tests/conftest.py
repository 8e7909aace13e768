"""Shared fixtures: traces of the built-in models, recorded once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
torch.set_num_threads(1)  # CI has 2 cores; keep records deterministic and cheap

BUILTINS = ("mlp", "resnet", "llama", "vit")


def record_builtin(name: str, out: Path, *, dtype: str = "fp32", replay: Path | None = None,
                   **kwargs) -> Path:
    from driftcheck.loader import load_scenario
    from driftcheck.runner import record

    return record(load_scenario(name), out, dtype=dtype, replay=replay, force=True,
                  model_id=name, **kwargs)


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{model: {"fp32": ref, "fp32b": re-record, "bf16": target}} for every built-in."""
    root = tmp_path_factory.mktemp("traces")
    out: dict[str, dict[str, Path]] = {}
    for name in BUILTINS:
        ref = record_builtin(name, root / f"{name}-fp32")
        out[name] = {
            "fp32": ref,
            "fp32b": record_builtin(name, root / f"{name}-fp32b", replay=ref),
            "bf16": record_builtin(name, root / f"{name}-bf16", dtype="bf16", replay=ref),
        }
    return out

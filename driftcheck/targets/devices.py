"""Devices: parse ``--device``, prepare the process before torch loads, open and describe a device.

Names: ``cpu``, ``cuda``, ``cuda:N``, ``tpu``, ``tpu:N`` (torch_tpu), ``mps``, ``xpu``, ``lazy``
(PyTorch's lazy-tensor backend, TorchScript-lowered: in every CPU wheel), ``xla`` (torch_xla), and
the name of any PrivateUse1 backend. Availability goes through ``torch.accelerator``, never the legacy
per-backend calls: on torch >= 2.11 ``torch.tpu.is_available()`` raises unless
``TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1``.

Order matters: :func:`parse_device` and :func:`prepare_environment` run *before* ``import torch``
(torch_tpu is autoloaded by ``import torch`` and replaces the fp32 matmul precision, so a CPU/CUDA
reference must run in a process where it never loads); :func:`open_device` imports torch.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from typing import TYPE_CHECKING, Any

from driftcheck.errors import DriftcheckError
from driftcheck.targets import deferred

if TYPE_CHECKING:
    import torch

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"
TPU_FIX = 'pip install torch-tpu==0.2.0 (Linux x86_64; from a driftcheck checkout: pip install -e ".[tpu]")'
# Backends that never need an out-of-tree plugin: for them the autoload is switched off.
BUILTIN_TYPES = ("cpu", "cuda", "mps", "xpu", "lazy")
KNOWN_TYPES = ("cpu", "cuda", "tpu", "mps", "xpu", "lazy", "xla")
_NO_STORAGE = frozenset(deferred.DEFERRED_TYPES)
# Device types torch knows that cannot run a recorded training step.
_NOT_COMPUTE = {"meta": "'meta' tensors hold no data", "gpu": "did you mean 'cuda'?"}
_SPEC = re.compile(r"^([a-z][a-z0-9_]*)(?::(\d+))?$")


def parse_device(spec: str) -> tuple[str, int | None]:
    """Split a device string into ``(type, index)`` without importing torch.

    Args:
        spec: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"tpu"``, ``"tpu:0"``, ``"mps"``, ``"xpu"`` or a
            PrivateUse1 backend name, optionally with ``:N``. Case and outer spaces are ignored.

    Returns:
        The device type and the index, or None when no index was given.

    Raises:
        DriftcheckError: the string is not of the form ``type`` or ``type:N``.

    Example:
        >>> parse_device("cuda:1")
        ('cuda', 1)
    """
    text = spec.strip().lower() if isinstance(spec, str) else ""
    match = _SPEC.match(text)
    if not match:
        raise DriftcheckError(
            f"bad device {spec!r}: expected TYPE or TYPE:N, e.g. 'cpu', 'cuda:0', 'tpu'"
        )
    device_type, index = match.group(1), match.group(2)
    if device_type in _NOT_COMPUTE:
        raise DriftcheckError(f"bad device {spec!r}: {_NOT_COMPUTE[device_type]}")
    return device_type, (int(index) if index is not None else None)


def prepare_environment(device_type: str) -> None:
    """Set the environment for a run on ``device_type``; call it before ``import torch``.

    For ``cpu``/``cuda``/``mps``/``xpu``/``lazy`` this sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` unless the
    user already set it, so that an installed torch_tpu is not loaded into the process: it would
    change the fp32 matmul precision of the reference, and an incomplete install makes
    ``import torch`` fail. ``tpu`` and other PrivateUse1 backends need the autoload and keep it.
    """
    if device_type in BUILTIN_TYPES:
        os.environ.setdefault(AUTOLOAD_VAR, "0")
    else:
        # torch_tpu's import prints INFO lines from libtpu's C++ logging and a tcmalloc
        # performance warning; keep stderr to driftcheck's own one-line messages (warnings and
        # errors from libtpu still show).
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        import warnings

        warnings.filterwarnings("ignore", message="<TorchTpu/Performance/TcMalloc/")


def torch_tpu_version() -> str | None:
    """The installed torch_tpu version, or None; never imports torch_tpu."""
    try:
        return importlib.metadata.version("torch-tpu")
    except importlib.metadata.PackageNotFoundError:
        pass
    # An editable or vendored install may have the package without distribution metadata.
    return "unknown" if importlib.util.find_spec("torch_tpu") is not None else None


def backend_entry_points(extra_path: str | None = None) -> list[str]:
    """The ``torch.backends`` entry points ``import torch`` would autoload, as ``name = value``;
    ``extra_path``: a PYTHONPATH searched before ``sys.path`` (a side's own). Never imports them."""
    path = [p for p in (extra_path or "").split(os.pathsep) if p] + sys.path
    found = []
    for dist in importlib.metadata.distributions(path=path):
        for entry in dist.entry_points:
            if entry.group == "torch.backends":
                found.append(f"{entry.name} = {entry.value} ({dist.metadata['Name']} {dist.version})")
    return sorted(set(found))


def privateuse1_backend() -> dict[str, Any] | None:
    """The PrivateUse1 backend registered in this process: its name and the module that
    implements ``torch.<name>`` (torch_tpu's, or another package's), or None."""
    import torch

    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        return None
    module = getattr(torch, name, None)
    owner = getattr(module, "__name__", None) if isinstance(module, type(sys)) else (
        type(module).__module__ if module is not None else None)
    return {"name": name, "module": owner, "entry_points": backend_entry_points()}


def torch_tpu_loaded() -> bool:
    """Whether torch_tpu has been imported into this process (by autoload or by hand)."""
    return "torch_tpu" in sys.modules


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def _current_accelerator_type() -> str | None:
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else None


def _check_index(device_type: str, index: int | None, count: int, label: str) -> None:
    if index is not None and index >= count:
        raise DriftcheckError(
            f"{device_type}:{index} requested but only {count} {label} device(s) are visible"
        )


def _check_cuda(index: int | None) -> None:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        raise DriftcheckError(
            f"CUDA is not available in this torch build ({torch.__version__}): install a CUDA "
            "wheel of torch (https://pytorch.org/get-started/locally/) or use --device cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise DriftcheckError(
            "torch is built with CUDA but no CUDA device is visible: check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES"
        )
    _check_index("cuda", index, count, "CUDA")


def _check_tpu(index: int | None) -> None:
    import torch

    if torch_tpu_version() is None:
        if torch._C._get_privateuse1_backend_name() == "tpu":
            # another package's PrivateUse1 backend named "tpu" (not torch_tpu): describe() names it
            _check_privateuse1("tpu", index)
            return
        raise DriftcheckError(f"device 'tpu' needs torch_tpu: {TPU_FIX}")
    if _autoload_disabled() and not torch_tpu_loaded():
        raise DriftcheckError(
            f"torch_tpu is installed but not loaded because {AUTOLOAD_VAR}=0: unset it for the "
            "tpu run (driftcheck sets it only for cpu/cuda/mps/xpu runs)"
        )
    if _current_accelerator_type() != "tpu":
        raise DriftcheckError("torch_tpu is installed but found no TPU on this host")
    _check_index("tpu", index, torch.accelerator.device_count(), "TPU")


def _check_mps(index: int | None) -> None:
    import torch

    if not torch.backends.mps.is_built():
        raise DriftcheckError(
            "MPS is not available in this torch build: it needs the macOS arm64 wheel of torch"
        )
    if not torch.backends.mps.is_available():
        raise DriftcheckError("torch is built with MPS but no MPS device is visible (macOS 12.3+)")
    _check_index("mps", index, 1, "MPS")


def _check_xpu(index: int | None) -> None:
    import torch

    if not hasattr(torch, "xpu") or not torch.xpu._is_compiled():
        raise DriftcheckError(
            "XPU is not available in this torch build: install the XPU wheel of torch "
            "(https://pytorch.org/get-started/locally/)"
        )
    count = torch.xpu.device_count()
    if count == 0:
        raise DriftcheckError("torch is built with XPU but no XPU device is visible")
    _check_index("xpu", index, count, "XPU")


def registered_types() -> list[str]:
    """The device types this torch can run here: its own built backends, the lazy-tensor
    backend, torch_xla and torch_tpu where installed, a renamed PrivateUse1 backend."""
    import torch

    found = ["cpu"]
    found += ["cuda"] if torch.version.cuda is not None or torch.version.hip is not None else []
    found += ["mps"] if torch.backends.mps.is_built() else []
    found += ["xpu"] if hasattr(torch, "xpu") and torch.xpu._is_compiled() else []
    found += ["lazy"] if deferred.lazy_available() else []
    found += ["xla"] if importlib.util.find_spec("torch_xla") is not None else []
    found += ["tpu"] if torch_tpu_version() is not None else []
    renamed = torch._C._get_privateuse1_backend_name()
    return found + ([renamed] if renamed not in ("privateuseone", *found) else [])


def _check_privateuse1(device_type: str, index: int | None) -> None:
    import torch

    registered = torch._C._get_privateuse1_backend_name()
    if device_type != registered:
        raise DriftcheckError(f"unknown device type {device_type!r}: this torch ({torch.__version__}) "
                              f"has {', '.join(registered_types())}")
    if _current_accelerator_type() != device_type:
        raise DriftcheckError(f"backend {device_type!r} is registered but found no device")
    _check_index(device_type, index, torch.accelerator.device_count(), device_type)


def _check_deferred(device_type: str, index: int | None) -> None:
    if device_type == "lazy" and not deferred.lazy_available():
        raise DriftcheckError("this torch build has no lazy-tensor backend (torch._lazy.ts_backend): "
                              "use a CPU or CUDA wheel of torch")
    deferred.init_backend(device_type)
    if index not in (None, 0):
        raise DriftcheckError(f"bad device '{device_type}:{index}': driftcheck runs {device_type} "
                              f"on its device 0; use '{device_type}'")


def init_backend(device_type: str) -> bool:
    """Start an in-tree backend that needs it (``lazy``: the TorchScript lazy-tensor backend, once
    per process; ``xla``: torch_xla); whether ``device_type`` is one of them.

    Example:
        >>> init_backend("lazy")
        True
    """
    if not deferred.is_deferred(device_type):
        return False
    deferred.init_backend(device_type)
    return True


def storage_inspectable(device_type: str) -> bool:
    """Whether tensors of ``device_type`` have a storage whose identity, strides and offset mean
    what they do on CPU. Not on ``lazy`` (and torch_xla's ``xla``): views are functionalized
    there, strides are those of a contiguous tensor, and asking a lazy tensor for its storage
    raises, or inside the autograd engine crashes the process."""
    return device_type not in _NO_STORAGE


def open_device(spec: str) -> torch.device:
    """Check that ``spec`` can run here and return its ``torch.device``.

    Imports torch: call :func:`prepare_environment` first.

    Raises:
        DriftcheckError: one line saying what is missing and how to fix it (torch_tpu not
            installed, no TPU, a torch build without CUDA, no visible device, index out of range).

    Example:
        >>> open_device("cpu")
        device(type='cpu')
    """
    import torch

    device_type, index = parse_device(spec)
    if device_type == "cpu":
        if index not in (None, 0):
            raise DriftcheckError(f"bad device {spec!r}: the CPU has no index {index}; use 'cpu'")
    elif device_type == "cuda":
        _check_cuda(index)
    elif device_type == "tpu":
        _check_tpu(index)
    elif device_type == "mps":
        _check_mps(index)
    elif device_type == "xpu":
        _check_xpu(index)
    elif deferred.is_deferred(device_type):
        _check_deferred(device_type, index)
    else:
        _check_privateuse1(device_type, index)
    return torch.device(device_type) if index is None else torch.device(device_type, index)


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU).

    Uses ``torch.accelerator.synchronize`` for the current accelerator (the only safe call on
    torch_tpu); the legacy per-backend call is used only for cuda/mps/xpu when they are not the
    current accelerator.
    """
    import torch

    if device.type == "cpu":
        return
    if _current_accelerator_type() == device.type:
        torch.accelerator.synchronize(device)
    elif device.type in ("cuda", "mps", "xpu"):
        getattr(torch, device.type).synchronize()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(device: torch.device) -> dict[str, Any]:
    """A JSON-able description of ``device`` for trace manifests and reports.

    Returns:
        ``type``, ``index``, ``name``, ``capability`` (CUDA compute capability or None),
        ``accelerator`` (the current accelerator type or None), ``count``, and ``versions`` of the
        backend stack (torch, CUDA/HIP, cuDNN, torch_tpu).
    """
    import torch

    accelerator = _current_accelerator_type()
    info: dict[str, Any] = {
        "type": device.type,
        "index": device.index,
        "name": None,
        "capability": None,
        "accelerator": accelerator,
        "count": torch.accelerator.device_count() if accelerator is not None else 0,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None,
            "torch_tpu": torch_tpu_version(),
        },
        "privateuse1": privateuse1_backend(),
    }
    if device.type == "cpu":
        info["name"] = _cpu_name()
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        info["name"] = torch.cuda.get_device_name(index)
        info["capability"] = list(torch.cuda.get_device_capability(index))
    elif device.type == "lazy":
        info["name"] = "lazy tensors, TorchScript backend (torch._lazy.ts_backend)"
    elif accelerator == device.type:
        # Optional per-backend introspection: torch_tpu's legacy calls raise, so guard them all.
        module = getattr(torch, device.type, None)
        try:
            info["name"] = module.get_device_name(device.index or 0) if module else None
        except Exception:
            info["name"] = None
    return info

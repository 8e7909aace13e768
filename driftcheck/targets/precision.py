"""Precision settings: what decides the rounding of a run, captured into every trace manifest.

Two runs of correct code differ by what their settings allow: dtype, autocast, fp32 matmul
precision (TF32 on CUDA, bf16 passes on TPU), fp8, thread count (reduction order), the CPU
kernels (ATen's vectorisation level, oneDNN on or off: other reduction orders), library
versions. :func:`capture_settings` records them and :func:`apply_settings` sets the knobs of this
process; :mod:`driftcheck.targets.settings_diff` says which differences can explain drift, and
:func:`driftcheck.numerics.roundoff.effective_matmul_roundoff` turns them into the unit roundoff
the noise floor uses for a matmul-like op.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
from typing import Any

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes
from driftcheck.targets import devices

MATMUL_PRECISIONS = ("highest", "high", "medium")
_ENV_NAMES = ("XLA_FLAGS", "TORCH_DEVICE_BACKEND_AUTOLOAD", "NVIDIA_TF32_OVERRIDE",
              "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY")
_VERSION_PACKAGES = {"numpy": "numpy", "safetensors": "safetensors", "driftcheck": "driftcheck",
                     "torch_tpu": "torch-tpu", "transformers": "transformers"}


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def _amx_bf16() -> bool:
    """Whether the CPU has AMX-BF16: only then does oneDNN's bf16 fp32-math mode round inputs.

    Measured: on an avx512_bf16 CPU without AMX, ``set_float32_matmul_precision("medium")`` leaves
    256x256 fp32 matmul errors at ~1e-5 (fp32 level), not the ~3e-2 bf16 inputs would give.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return any(line.startswith("flags") and " amx_bf16" in line for line in cpuinfo)
    except OSError:
        return False


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda}
    found.update(_package_versions())
    return found


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str | None]:
    """Installed versions (reading package metadata costs ~2 ms each: once per process)."""
    found: dict[str, str | None] = {}
    for key, dist in _VERSION_PACKAGES.items():
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[key] = None
    return found


def _fp32_precision() -> dict[str, str]:
    """The new-style per-backend fp32 precision settings (torch >= 2.9), where present."""
    found: dict[str, str] = {}
    for name in ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                 "mkldnn.conv", "mkldnn.rnn"):
        node: Any = torch.backends
        for part in filter(None, name.split(".")):
            node = getattr(node, part, None)
        value = getattr(node, "fp32_precision", None)
        if isinstance(value, str):
            found[name or "generic"] = value
    return found


def _cpu_kernels() -> dict[str, Any]:
    """Which of this process's CPU kernels run: ATen's vectorisation level (``ATEN_CPU_CAPABILITY``
    read when torch loads: DEFAULT, AVX2, AVX512, ...) and whether oneDNN (mkldnn) convolutions and
    matmuls are on. Two correct runs that differ here sum in other orders."""
    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": bool(torch.backends.mkldnn.enabled)}


def _matmul_precision() -> str:
    # torch raises when the legacy flags (allow_tf32) and the new per-backend settings were both
    # used and disagree; the per-backend values are captured separately in "fp32_precision".
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "mixed"


def _fp8_dict(fp8: Any) -> dict[str, Any] | None:
    if fp8 is None:
        return None
    from driftcheck.targets.fp8 import Fp8Recipe

    recipe = fp8 if isinstance(fp8, Fp8Recipe) else Fp8Recipe.parse(str(fp8))
    return recipe.to_dict()


def capture_settings(device: torch.device, dtype: torch.dtype, autocast: str | None = None,
                     fp8: Any = None, matmul_precision: str | None = None) -> dict[str, Any]:
    """Everything that decides the rounding of a run on ``device``, as a JSON-able dict.

    Args:
        device: the device the run uses.
        dtype: the dtype parameters and inputs are cast to.
        autocast: the autocast dtype (``"bfloat16"``, ``"fp16"``), or None.
        fp8: an :class:`driftcheck.targets.fp8.Fp8Recipe`, its spec string (``"hybrid:delayed"``) or None.
        matmul_precision: the fp32 matmul precision the run asked for, when the backend does not
            report it through ``torch.get_float32_matmul_precision()`` (torch_tpu); else read.

    Returns:
        A nested dict: ``device`` (:func:`driftcheck.targets.devices.describe`), ``dtype``, ``autocast``,
        ``matmul_precision`` (``"mixed"`` when torch cannot name one), ``allow_tf32``,
        ``fp32_precision``, ``deterministic``, ``threads``, ``cpu_kernels`` (``capability``,
        ``mkldnn``), ``versions``, ``host``, ``env``, ``torch_tpu_loaded``, ``tpu_execution_mode``, ``fp8``.
    """
    env = {key: value for key, value in sorted(os.environ.items())
           if key.startswith("TORCH_TPU_") or key in _ENV_NAMES}
    tpu_mode = None
    if device.type == "tpu" and devices.torch_tpu_loaded():  # another "tpu" backend has no such mode
        fused = _truthy(os.environ.get("TORCH_TPU_DEFER_AND_FUSE"))
        tpu_mode = "defer_and_fuse" if fused else "eager"
    device_info = devices.describe(device)
    backend_versions = device_info.pop("versions", {})  # kept once, under "versions"
    settings: dict[str, Any] = {
        "device": device_info,
        "dtype": dtypes.float_name(dtype),
        "autocast": dtypes.float_name(autocast) if autocast else None,
        "matmul_precision": matmul_precision or _matmul_precision(),
        "matmul_precision_source": "requested" if matmul_precision else "torch",
        "allow_tf32": {"cuda_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                       "cudnn": bool(torch.backends.cudnn.allow_tf32)},
        "fp32_precision": _fp32_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": _cpu_kernels(),
        "versions": _versions(),
        "host": {"node": platform.node(), "machine": platform.machine(),
                 "system": platform.system(), "amx_bf16": _amx_bf16()},
        "env": env,
        "torch_tpu_loaded": devices.torch_tpu_loaded(),
        "tpu_execution_mode": tpu_mode,
        "fp8": _fp8_dict(fp8),
    }
    versions = settings["versions"]
    for key in ("hip", "cudnn"):
        versions[key] = backend_versions.get(key)
    versions["torch_tpu"] = versions["torch_tpu"] or devices.torch_tpu_version()
    json.dumps(settings)  # fail here, not when the manifest is written
    return settings


def cpu_matmul_precision_has_effect(level: str) -> bool:
    """Whether ``torch.set_float32_matmul_precision(level)`` (already applied) changes a CPU
    float32 matmul here: some builds use bf16 passes on CPUs that have them, most change nothing."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
    got = a @ b
    torch.set_float32_matmul_precision("highest")
    try:
        return not torch.equal(got, a @ b)
    finally:
        torch.set_float32_matmul_precision(level)


def apply_settings(matmul_precision: str | None = None, allow_tf32: bool | None = None,
                   deterministic: bool | None = None, threads: int | None = None,
                   allow_tf32_cudnn: bool | None = None, mkldnn: bool | None = None) -> dict[str, Any]:
    """Set the precision knobs of this process for a run; None leaves a knob as it is.

    Args:
        matmul_precision: ``"highest"``, ``"high"`` or ``"medium"``
            (``torch.set_float32_matmul_precision``).
        allow_tf32: TF32 for CUDA matmuls, and for cuDNN convolutions unless ``allow_tf32_cudnn``
            is given. Applied after ``matmul_precision`` so both hold (torch then reports the
            generic precision as mixed, captured as ``"mixed"`` with the per-backend values).
        deterministic: ``torch.use_deterministic_algorithms`` (sets ``CUBLAS_WORKSPACE_CONFIG``).
        threads: ``torch.set_num_threads`` (the CPU reduction order depends on it).
        allow_tf32_cudnn: TF32 for cuDNN convolutions alone.
        mkldnn: oneDNN's CPU kernels on or off (``torch.backends.mkldnn.enabled``): off, CPU
            convolutions and bf16 matmuls take ATen's own kernels.

    Returns:
        The previous values of the knobs that were set, so ``apply_settings(**previous)`` restores.

    Raises:
        DriftcheckError: an unknown matmul precision or a thread count below 1.
    """
    if matmul_precision is not None and matmul_precision not in MATMUL_PRECISIONS:
        raise DriftcheckError(
            f"unknown matmul precision {matmul_precision!r}: use highest, high or medium"
        )
    if threads is not None and threads < 1:
        raise DriftcheckError(f"bad thread count {threads}: use 1 or more")
    cudnn_tf32 = allow_tf32_cudnn if allow_tf32_cudnn is not None else allow_tf32
    # Read everything first: setting the matmul precision also flips the TF32 flags.
    previous: dict[str, Any] = {}
    if matmul_precision is not None and _matmul_precision() in MATMUL_PRECISIONS:
        previous["matmul_precision"] = _matmul_precision()
    if allow_tf32 is not None:
        previous["allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    if cudnn_tf32 is not None:
        previous["allow_tf32_cudnn"] = bool(torch.backends.cudnn.allow_tf32)
    if deterministic is not None:
        previous["deterministic"] = torch.are_deterministic_algorithms_enabled()
    if threads is not None:
        previous["threads"] = torch.get_num_threads()
    if mkldnn is not None:
        previous["mkldnn"] = bool(torch.backends.mkldnn.enabled)

    if matmul_precision is not None:
        torch.set_float32_matmul_precision(matmul_precision)
    if allow_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    if cudnn_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if deterministic is not None:
        if deterministic:
            # cuBLAS is deterministic only with a fixed workspace; must be set before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(deterministic)
    if threads is not None:
        torch.set_num_threads(threads)
    if mkldnn is not None:
        torch.backends.mkldnn.enabled = mkldnn  # type: ignore[assignment]  # a ContextProp: set, it sets the flag
    return previous

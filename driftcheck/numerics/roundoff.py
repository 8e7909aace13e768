"""The unit roundoff a run's matmuls effectively compute with, from its captured precision settings.

A float32 matmul does not always round as float32: CUDA may use TF32 (2^-11), a TPU one to six
bf16 passes, a CPU with AMX-BF16 oneDNN's bf16 mode; autocast and an fp8 recipe coarsen it
further. :func:`effective_matmul_roundoff` reads the settings dict of
:func:`driftcheck.targets.precision.capture_settings` (pure: no torch state is consulted).
"""
from __future__ import annotations

from typing import Any

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes

# torch_tpu replaces the fp32 matmul: "medium" (its default) is one bf16 pass, "high" three
# (bf16x3, ~16 significant bits), "highest" six (fp32-accurate).
TPU_MATMUL_ROUNDOFF = {"medium": 2.0**-8, "default": 2.0**-8, "high": 2.0**-16, "highest": 2.0**-24}
# torch's documented meaning of the precision names on other backends (mps, xpu, PrivateUse1).
GENERIC_MATMUL_ROUNDOFF = {"medium": dtypes.unit_roundoff("bf16"), "high": dtypes.unit_roundoff("tf32")}
FP32 = dtypes.unit_roundoff("float32")
TF32 = dtypes.unit_roundoff("tf32")
OPS = ("linear", "matmul", "conv")


def fp8_roundoff(fmt: str) -> float:
    """The unit roundoff of an fp8 recipe's format (``e4m3`` 2^-4, ``e5m2`` 2^-3)."""
    return dtypes.unit_roundoff(dtypes.FP8_FORMATS[fmt])


def _cuda_roundoff(settings: dict[str, Any], precision: str, fp32: dict[str, Any], conv: bool) -> float:
    flags = settings.get("allow_tf32") or {}
    if conv:
        tf32 = flags.get("cudnn") or fp32.get("cudnn.conv") == "tf32"
    else:
        tf32 = (flags.get("cuda_matmul") or fp32.get("cuda.matmul") == "tf32"
                or precision in ("high", "medium"))
    if tf32 and (settings.get("env") or {}).get("NVIDIA_TF32_OVERRIDE") != "0":
        return TF32
    return FP32


def _fp32_roundoff(settings: dict[str, Any], op: str) -> float:
    device = (settings.get("device") or {}).get("type", "cpu")
    precision = settings.get("matmul_precision") or "highest"
    fp32 = settings.get("fp32_precision") or {}
    conv = op == "conv"
    emulation = settings.get("emulation") or {}
    if emulation.get("backend") == "tpu":
        # driftcheck/targets/emulate.py: this CPU/CUDA run computed its matmuls as a TPU does
        return TPU_MATMUL_ROUNDOFF.get(emulation.get("matmul_precision") or "default", 2.0**-8)
    if device == "tpu":
        # XLA's precision config covers dot and convolution alike.
        return TPU_MATMUL_ROUNDOFF.get(precision, 2.0**-8)
    if device == "cuda":
        return _cuda_roundoff(settings, precision, fp32, conv)
    if device == "cpu":
        mode = fp32.get("mkldnn.conv" if conv else "mkldnn.matmul")
        if mode in ("bf16", "tf32") and (settings.get("host") or {}).get("amx_bf16"):
            return dtypes.unit_roundoff("bfloat16" if mode == "bf16" else "tf32")
        return FP32
    return GENERIC_MATMUL_ROUNDOFF.get(precision, FP32)


def effective_matmul_roundoff(settings: dict[str, Any], tensor_dtype: str, phase: str = "forward",
                              op: str = "linear") -> float:
    """The unit roundoff a matmul-like op of a run with ``settings`` effectively computes with.

    Args:
        settings: a dict from :func:`driftcheck.targets.precision.capture_settings` (missing keys
            mean torch defaults).
        tensor_dtype: the dtype of the op's inputs (``"float32"``, ``"bf16"``, ...).
        phase: ``"forward"`` or ``"backward"``/``"grads"``: the ``hybrid`` fp8 recipe uses e4m3
            forward and e5m2 for gradients.
        op: ``"linear"`` (nn.Linear: the fp8 recipe applies), ``"matmul"`` (other matmuls,
            attention) or ``"conv"`` (cuDNN/oneDNN convolution flags apply instead of matmul ones).

    Returns:
        The largest roundoff among the op's dtype, the autocast dtype, the fp32 mode of the device
        (TF32 2^-11 on CUDA; TPU medium 2^-8, high 2^-16, highest 2^-24) and the fp8 format.

    Raises:
        ValueError: ``tensor_dtype`` is not a floating-point dtype, or ``op`` is unknown.
    """
    if op not in OPS:
        raise ValueError(f"op must be linear, matmul or conv, not {op!r}")
    try:
        name = dtypes.float_name(tensor_dtype)
    except DriftcheckError as err:  # a programming error here, not a user's input
        raise ValueError(str(err)) from None
    roundoff = dtypes.unit_roundoff(name)
    if name == "float32":
        roundoff = max(roundoff, _fp32_roundoff(settings, op))
    if settings.get("autocast") and name in ("float32", "float64"):
        roundoff = max(roundoff, dtypes.unit_roundoff(dtypes.float_name(settings["autocast"])))
    fp8 = settings.get("fp8")
    if fp8 and op == "linear":
        fmt = fp8.get("format", "e4m3")
        if fmt == "hybrid":
            fmt = "e4m3" if phase == "forward" else "e5m2"
        roundoff = max(roundoff, fp8_roundoff(fmt))
    return roundoff

"""The effective matmul roundoff of a run's precision settings, and the float names it reads."""
from __future__ import annotations

import pytest
import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics.dtypes import float_name, significand_bits, torch_dtype
from driftcheck.numerics.roundoff import effective_matmul_roundoff, fp8_roundoff


@pytest.mark.parametrize(
    "given, expected",
    [(torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), ("torch.float16", "float16"),
     ("FP32", "float32"), ("double", "float64"), ("half", "float16"),
     ("float8_e4m3fn", "float8_e4m3fn")],
)
def test_float_name(given, expected: str) -> None:
    assert float_name(given) == expected


def test_dtype_name_rejects() -> None:
    with pytest.raises(DriftcheckError, match="unknown dtype 'int8'"):
        float_name("int8")
    assert torch_dtype(float_name("bf16")) is torch.bfloat16


def _settings(device: str = "cpu", precision_: str = "highest", **extra) -> dict:
    base = {"device": {"type": device}, "matmul_precision": precision_,
            "allow_tf32": {"cuda_matmul": False, "cudnn": True}, "fp32_precision": {},
            "host": {"amx_bf16": False}, "env": {}, "autocast": None, "fp8": None}
    base.update(extra)
    return base


@pytest.mark.parametrize(
    "settings, dtype, phase, expected",
    [
        (_settings(), "float32", "forward", 2.0**-24),
        (_settings(), "float64", "forward", 2.0**-53),
        (_settings(), "bfloat16", "forward", 2.0**-8),
        (_settings(), "float16", "forward", 2.0**-11),
        # CUDA: TF32 through the legacy flag, the precision name, or the new-style setting.
        (_settings("cuda", allow_tf32={"cuda_matmul": True}), "float32", "forward", 2.0**-11),
        (_settings("cuda", "high"), "float32", "forward", 2.0**-11),
        (_settings("cuda", fp32_precision={"cuda.matmul": "tf32"}), "float32", "forward", 2.0**-11),
        (_settings("cuda", "high", env={"NVIDIA_TF32_OVERRIDE": "0"}), "float32", "forward",
         2.0**-24),
        (_settings("cuda"), "float32", "forward", 2.0**-24),
        (_settings("cuda", allow_tf32={"cuda_matmul": True}), "bfloat16", "forward", 2.0**-8),
        # torch_tpu: medium = one bf16 pass, high = 3 passes, highest = 6.
        (_settings("tpu", "medium"), "float32", "forward", 2.0**-8),
        (_settings("tpu", "default"), "float32", "forward", 2.0**-8),
        (_settings("tpu", "high"), "float32", "forward", 2.0**-16),
        (_settings("tpu", "highest"), "float32", "forward", 2.0**-24),
        (_settings("tpu", "high"), "bfloat16", "forward", 2.0**-8),
        # CPU: oneDNN rounds to bf16 only with AMX-BF16.
        (_settings("cpu", "medium", fp32_precision={"mkldnn.matmul": "bf16"}), "float32",
         "forward", 2.0**-24),
        (_settings("cpu", "medium", fp32_precision={"mkldnn.matmul": "bf16"},
                   host={"amx_bf16": True}), "float32", "forward", 2.0**-8),
        (_settings("xpu", "high"), "float32", "forward", 2.0**-11),
        # autocast and fp8
        (_settings(autocast="bfloat16"), "float32", "forward", 2.0**-8),
        (_settings(autocast="float16"), "float32", "forward", 2.0**-11),
        (_settings(fp8={"format": "e4m3"}), "float32", "backward", 2.0**-4),
        (_settings(fp8={"format": "e5m2"}), "bfloat16", "forward", 2.0**-3),
        (_settings(fp8={"format": "hybrid"}), "float32", "forward", 2.0**-4),
        (_settings(fp8={"format": "hybrid"}), "float32", "backward", 2.0**-3),
        ({}, "float32", "forward", 2.0**-24),  # an old manifest without settings
    ],
)
def test_effective_matmul_roundoff(settings: dict, dtype: str, phase: str,
                                   expected: float) -> None:
    assert effective_matmul_roundoff(settings, dtype, phase) == expected


def test_fp8_only_applies_to_linear_ops() -> None:
    settings = _settings(fp8={"format": "e4m3"})
    assert effective_matmul_roundoff(settings, "float32", op="matmul") == 2.0**-24
    assert effective_matmul_roundoff(settings, "float32", op="conv") == 2.0**-24
    with pytest.raises(ValueError):
        effective_matmul_roundoff(settings, "float32", op="gemm")
    with pytest.raises(ValueError, match="unknown dtype 'int64'"):
        effective_matmul_roundoff(settings, "int64")


@pytest.mark.parametrize(
    "settings, expected",
    [
        # CUDA convolutions follow cuDNN's flag (on by default in torch), not the matmul one.
        (_settings("cuda"), 2.0**-11),
        (_settings("cuda", allow_tf32={"cuda_matmul": True, "cudnn": False}), 2.0**-24),
        (_settings("cpu", fp32_precision={"mkldnn.conv": "bf16"}, host={"amx_bf16": True}),
         2.0**-8),
        (_settings("tpu", "medium"), 2.0**-8),
    ],
)
def test_conv_roundoff(settings: dict, expected: float) -> None:
    assert effective_matmul_roundoff(settings, "float32", op="conv") == expected


def test_fp8_roundoff_of_the_recipe_formats() -> None:
    assert fp8_roundoff("e4m3") == 2.0**-4 and fp8_roundoff("e5m2") == 2.0**-3


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 8), (torch.float16, 11), (torch.float32, 24),
                                         (torch.float64, 53), ("tf32", 11), ("e4m3", 4)])
def test_significand_bits(dtype, bits: int) -> None:
    assert significand_bits(dtype) == bits

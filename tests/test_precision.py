"""Precision settings: capture, apply, effective roundoff, which differences explain drift."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from driftcheck.targets import precision
from driftcheck.errors import DriftcheckError
from driftcheck.targets.precision import (
    apply_settings,
    capture_settings,
    diff_settings,
    dtype_name,
    effective_matmul_roundoff,
    parse_dtype,
)


@pytest.fixture
def restore_torch_settings():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32, torch.are_deterministic_algorithms_enabled(),
             torch.get_num_threads())
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]
    torch.use_deterministic_algorithms(saved[3])
    torch.set_num_threads(saved[4])


@pytest.mark.parametrize(
    "given, expected",
    [(torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), ("torch.float16", "float16"),
     ("FP32", "float32"), ("double", "float64"), ("half", "float16"),
     ("float8_e4m3fn", "float8_e4m3fn")],
)
def test_dtype_name(given, expected: str) -> None:
    assert dtype_name(given) == expected


def test_dtype_name_rejects() -> None:
    with pytest.raises(DriftcheckError, match="unknown dtype 'int8'"):
        dtype_name("int8")
    assert parse_dtype("bf16") is torch.bfloat16


def test_capture_settings_cpu(restore_torch_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_TPU_ENABLE_DEBUG_CHECKS", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    apply_settings(matmul_precision="high", threads=1)
    settings = capture_settings(torch.device("cpu"), torch.float32, autocast="bf16",
                                fp8="hybrid:current")
    json.dumps(settings)
    assert settings["dtype"] == "float32" and settings["autocast"] == "bfloat16"
    assert settings["matmul_precision"] == "high"
    assert settings["matmul_precision_source"] == "torch"
    assert settings["threads"] == 1
    assert settings["device"]["type"] == "cpu"
    assert settings["env"] == {"TORCH_TPU_ENABLE_DEBUG_CHECKS": "1",
                               "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert settings["fp8"] == {"format": "hybrid", "scaling": "current", "history": 16,
                               "kernel": "auto"}
    assert settings["versions"]["torch"] == torch.__version__
    assert settings["versions"]["torch_tpu"] is None and "cudnn" in settings["versions"]
    assert "versions" not in settings["device"]  # once, at the top level
    assert settings["tpu_execution_mode"] is None and settings["torch_tpu_loaded"] is False
    if "mkldnn.matmul" in settings["fp32_precision"]:
        assert settings["fp32_precision"]["mkldnn.matmul"] == "tf32"  # what "high" selects


def test_capture_settings_requested_precision() -> None:
    settings = capture_settings(torch.device("cpu"), torch.bfloat16, matmul_precision="medium")
    assert settings["matmul_precision"] == "medium"
    assert settings["matmul_precision_source"] == "requested"
    assert settings["fp8"] is None and settings["autocast"] is None


@pytest.mark.parametrize("value, mode", [(None, "eager"), ("0", "eager"), ("1", "defer_and_fuse"),
                                         ("true", "defer_and_fuse")])
def test_tpu_execution_mode(monkeypatch: pytest.MonkeyPatch, value: str | None, mode: str) -> None:
    # A TPU device cannot be made here: describe() is faked, the rest is the real capture.
    monkeypatch.setattr(precision.devices, "describe", lambda device: {"type": device.type})
    if value is None:
        monkeypatch.delenv("TORCH_TPU_DEFER_AND_FUSE", raising=False)
    else:
        monkeypatch.setenv("TORCH_TPU_DEFER_AND_FUSE", value)

    class FakeTpu:
        type = "tpu"

    settings = capture_settings(FakeTpu(), torch.float32)  # type: ignore[arg-type]
    assert settings["tpu_execution_mode"] == mode


def test_apply_settings_returns_previous_values(restore_torch_settings) -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True  # torch's default
    threads = torch.get_num_threads()
    previous = apply_settings(matmul_precision="medium", allow_tf32=True, deterministic=True,
                              threads=1)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    # Legacy flag after the new API: torch refuses to name one precision; both are recorded.
    settings = capture_settings(torch.device("cpu"), torch.float32)
    assert settings["matmul_precision"] == "mixed"
    assert settings["fp32_precision"]["mkldnn.matmul"] == "bf16"
    assert settings["fp32_precision"]["cuda.matmul"] == "tf32"
    assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
    assert previous["matmul_precision"] == "highest" and previous["threads"] == threads
    assert previous["allow_tf32"] is False and previous["allow_tf32_cudnn"] is True
    apply_settings(**previous)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads
    assert apply_settings() == {}


def test_apply_settings_rejects(restore_torch_settings) -> None:
    with pytest.raises(DriftcheckError, match="unknown matmul precision 'low'"):
        apply_settings(matmul_precision="low")
    with pytest.raises(DriftcheckError, match="bad thread count 0"):
        apply_settings(threads=0)


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


def test_roundoff_from_a_real_capture(restore_torch_settings) -> None:
    apply_settings(matmul_precision="highest")
    settings = capture_settings(torch.device("cpu"), torch.float32, fp8="hybrid")
    assert effective_matmul_roundoff(settings, "float32") == 2.0**-4
    assert effective_matmul_roundoff(settings, "float32", "backward") == 2.0**-3
    assert effective_matmul_roundoff(settings, "float32", op="matmul") == 2.0**-24


def test_diff_settings_flags_what_explains_drift() -> None:
    ref = capture_settings(torch.device("cpu"), torch.float32)
    tgt = copy.deepcopy(ref)
    assert diff_settings(ref, tgt) == []
    tgt["dtype"] = "bfloat16"
    tgt["host"]["node"] = "tpu-vm-7"
    tgt["threads"] = ref["threads"] + 3
    tgt["device"] = {"type": "tpu", "index": 0}
    tgt["env"]["TORCH_TPU_DEFER_AND_FUSE"] = "1"
    tgt["fp8"] = {"format": "hybrid", "scaling": "delayed"}
    tgt["versions"]["torch_tpu"] = "0.2.0"
    rows = {key: (a, b, explains) for key, a, b, explains in diff_settings(ref, tgt)}
    assert rows["dtype"] == ("float32", "bfloat16", True)
    assert rows["host.node"][2] is False
    assert rows["threads"][2] is True  # reduction order
    assert rows["device.type"] == ("cpu", "tpu", True)
    assert rows["device.index"] == (None, 0, False)
    assert rows["env.TORCH_TPU_DEFER_AND_FUSE"] == (None, "1", True)
    assert rows["fp8"] == (None, {"format": "hybrid", "scaling": "delayed"}, True)  # one row
    assert rows["versions.torch_tpu"] == (None, "0.2.0", True)
    assert "device.name" in rows  # removed on the target side: reported, not dropped
    keys = [row[0] for row in diff_settings(ref, tgt)]
    assert keys == sorted(keys)

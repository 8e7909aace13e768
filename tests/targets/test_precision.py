"""Precision settings: captured into the manifest, applied to this process, and the roundoff a
real capture implies."""
from __future__ import annotations

import json

import pytest
import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics.roundoff import effective_matmul_roundoff
from driftcheck.targets import precision
from driftcheck.targets.precision import apply_settings, capture_settings


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
    monkeypatch.setattr(precision.devices, "torch_tpu_loaded", lambda: True)
    if value is None:
        monkeypatch.delenv("TORCH_TPU_DEFER_AND_FUSE", raising=False)
    else:
        monkeypatch.setenv("TORCH_TPU_DEFER_AND_FUSE", value)

    class FakeTpu:
        type = "tpu"

    settings = capture_settings(FakeTpu(), torch.float32)  # type: ignore[arg-type]
    assert settings["tpu_execution_mode"] == mode


def test_no_tpu_execution_mode_for_another_backend_named_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # a "tpu" that is not torch_tpu (tests/data/pytpu) has no torch_tpu mode to record
    monkeypatch.setattr(precision.devices, "describe", lambda device: {"type": device.type})
    monkeypatch.setenv("TORCH_TPU_DEFER_AND_FUSE", "1")

    class FakeTpu:
        type = "tpu"

    settings = capture_settings(FakeTpu(), torch.float32)  # type: ignore[arg-type]
    assert settings["tpu_execution_mode"] is None and settings["torch_tpu_loaded"] is False


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


def test_roundoff_from_a_real_capture(restore_torch_settings) -> None:
    apply_settings(matmul_precision="highest")
    settings = capture_settings(torch.device("cpu"), torch.float32, fp8="hybrid")
    assert effective_matmul_roundoff(settings, "float32") == 2.0**-4
    assert effective_matmul_roundoff(settings, "float32", "backward") == 2.0**-3
    assert effective_matmul_roundoff(settings, "float32", op="matmul") == 2.0**-24

"""Device parsing, the pre-import environment, availability errors and descriptions."""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from driftcheck.errors import DriftcheckError
from driftcheck.targets import devices
from driftcheck.targets.devices import describe, open_device, parse_device, synchronize

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", ("cpu", None)),
        ("cuda", ("cuda", None)),
        ("cuda:0", ("cuda", 0)),
        ("cuda:12", ("cuda", 12)),
        ("tpu", ("tpu", None)),
        ("tpu:3", ("tpu", 3)),
        ("mps", ("mps", None)),
        ("xpu:1", ("xpu", 1)),
        ("npu:0", ("npu", 0)),  # a PrivateUse1 name: syntax only, checked by open_device
        ("  CUDA:1 ", ("cuda", 1)),
    ],
)
def test_parse_device_table(spec: str, expected: tuple[str, int | None]) -> None:
    assert parse_device(spec) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("", "expected TYPE or TYPE:N"),
        ("cuda:", "expected TYPE or TYPE:N"),
        ("cuda:-1", "expected TYPE or TYPE:N"),
        ("cuda:x", "expected TYPE or TYPE:N"),
        ("cuda:0:1", "expected TYPE or TYPE:N"),
        ("0", "expected TYPE or TYPE:N"),
        ("cu da", "expected TYPE or TYPE:N"),
        ("meta", "hold no data"),
        ("gpu", "did you mean 'cuda'"),
    ],
)
def test_parse_device_rejects_bad_syntax(spec: str, fragment: str) -> None:
    with pytest.raises(DriftcheckError, match=fragment):
        parse_device(spec)


def test_parse_device_does_not_import_torch() -> None:
    code = (
        "import sys; from driftcheck.targets.devices import parse_device; parse_device('tpu:1');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _env_after_prepare(device_type: str, preset: str | None) -> dict:
    code = (
        "import os, sys, json\n"
        "from driftcheck.targets.devices import prepare_environment\n"
        f"prepare_environment({device_type!r})\n"
        "value = os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD')\n"
        "import torch\n"
        "x = torch.ones(2) @ torch.ones(2)\n"
        "print(json.dumps({'value': value, 'torch': torch.__version__, 'x': x.item(),"
        " 'tpu_loaded': 'torch_tpu' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    if preset is not None:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = preset
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps", "xpu"])
def test_prepare_environment_disables_autoload_for_builtin_backends(device_type: str) -> None:
    result = _env_after_prepare(device_type, None)
    assert result["value"] == "0"
    assert result["x"] == 2.0 and result["torch"] == torch.__version__
    assert result["tpu_loaded"] is False


def test_prepare_environment_keeps_autoload_for_tpu() -> None:
    assert _env_after_prepare("tpu", None)["value"] is None


def test_prepare_environment_respects_user_setting() -> None:
    assert _env_after_prepare("cpu", "1")["value"] == "1"


def test_open_cpu() -> None:
    assert open_device("cpu") == torch.device("cpu")
    assert open_device("cpu:0") == torch.device("cpu", 0)
    with pytest.raises(DriftcheckError, match="the CPU has no index 1"):
        open_device("cpu:1")


def test_open_tpu_without_torch_tpu_names_the_extra() -> None:
    assert devices.torch_tpu_version() is None  # this machine: no torch_tpu
    with pytest.raises(DriftcheckError) as err:
        open_device("tpu")
    # a line that works: driftcheck itself is not on the package index (pip install 'driftcheck[tpu]' fails)
    assert str(err.value) == ("device 'tpu' needs torch_tpu: pip install torch-tpu==0.2.0 (Linux x86_64; "
                              "from a driftcheck checkout: pip install -e \".[tpu]\")")


class _FakeAccelerator:
    """torch.accelerator as seen on a host with torch_tpu and ``count`` TPUs (None: no TPU)."""

    def __init__(self, count: int | None) -> None:
        self.count = count
        self.synced: list = []

    def current_accelerator(self):
        return None if self.count is None else _Dev("tpu")

    def device_count(self) -> int:
        return self.count or 0

    def synchronize(self, device=None) -> None:
        self.synced.append(device)


class _Dev:
    def __init__(self, type_: str) -> None:
        self.type = type_


@pytest.fixture
def fake_torch_tpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend torch_tpu 0.2.0 is installed (metadata + spec) and loaded, without importing it."""
    real_find_spec = importlib.util.find_spec
    real_version = importlib.metadata.version

    def find_spec(name, *args, **kwargs):
        if name == "torch_tpu":
            return importlib.machinery.ModuleSpec("torch_tpu", None)
        return real_find_spec(name, *args, **kwargs)

    def version(name):
        return "0.2.0" if name in ("torch-tpu", "torch_tpu") else real_version(name)

    monkeypatch.setattr(devices.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(devices.importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, "torch_tpu", object())
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)

    def install(count: int | None) -> _FakeAccelerator:
        fake = _FakeAccelerator(count)
        monkeypatch.setattr(torch, "accelerator", fake)
        return fake

    return install


def test_torch_tpu_installed_but_no_tpu(fake_torch_tpu) -> None:
    fake_torch_tpu(None)
    assert devices.torch_tpu_version() == "0.2.0"
    with pytest.raises(DriftcheckError) as err:
        open_device("tpu")
    assert str(err.value) == "torch_tpu is installed but found no TPU on this host"


def test_torch_tpu_installed_but_autoload_off(fake_torch_tpu, monkeypatch) -> None:
    fake_torch_tpu(1)
    monkeypatch.delitem(sys.modules, "torch_tpu")
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    with pytest.raises(DriftcheckError, match="TORCH_DEVICE_BACKEND_AUTOLOAD=0: unset it"):
        open_device("tpu")


def test_tpu_index_out_of_range(fake_torch_tpu) -> None:
    fake_torch_tpu(1)
    with pytest.raises(DriftcheckError) as err:
        open_device("tpu:3")
    assert str(err.value) == "tpu:3 requested but only 1 TPU device(s) are visible"


def test_synchronize_uses_torch_accelerator_for_the_current_accelerator(fake_torch_tpu) -> None:
    fake = fake_torch_tpu(1)
    synchronize(torch.device("cpu"))
    assert fake.synced == []
    sentinel = _Dev("tpu")
    synchronize(sentinel)  # type: ignore[arg-type]
    assert fake.synced == [sentinel]


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a torch build without a GPU")
def test_cuda_absent_message() -> None:
    with pytest.raises(DriftcheckError) as err:
        open_device("cuda")
    message = str(err.value)
    if torch.version.cuda is None:
        assert message.startswith("CUDA is not available in this torch build")
    else:
        assert "no CUDA device is visible" in message


def test_cuda_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA build with one visible GPU, simulated; the real check runs in test_open_cuda.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DriftcheckError) as err:
        open_device("cuda:3")
    assert str(err.value) == "cuda:3 requested but only 1 CUDA device(s) are visible"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DriftcheckError, match="built with CUDA but no CUDA device is visible"):
        open_device("cuda")


def test_mps_and_xpu_absent_messages() -> None:
    if not torch.backends.mps.is_available():
        with pytest.raises(DriftcheckError, match="MPS"):
            open_device("mps")
    if not torch.xpu.is_available():
        with pytest.raises(DriftcheckError, match="XPU"):
            open_device("xpu")


def test_unknown_privateuse1_name() -> None:
    # the types registered in this torch are named (the CPU wheel: cpu and lazy at least)
    with pytest.raises(DriftcheckError, match=r"unknown device type 'npu': this torch \(.*\) has cpu, .*lazy"):
        open_device("npu")


def test_describe_cpu_is_json_able() -> None:
    info = describe(torch.device("cpu"))
    json.dumps(info)
    assert info["type"] == "cpu" and info["index"] is None and info["name"]
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["torch_tpu"] is None


@cuda
@needs_cuda
def test_open_cuda() -> None:
    device = open_device("cuda:0")
    assert device == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(DriftcheckError, match=f"only {count} CUDA device"):
        open_device(f"cuda:{count}")
    info = describe(device)
    assert info["name"] == torch.cuda.get_device_name(0)
    assert info["capability"] == list(torch.cuda.get_device_capability(0))
    assert info["accelerator"] == "cuda"
    x = torch.ones(4, device=device) * 2
    synchronize(device)
    assert x.sum().item() == 8.0


def test_registered_privateuse1_without_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    with pytest.raises(DriftcheckError, match="backend 'npu' is registered but found no device"):
        open_device("npu:0")
    with pytest.raises(DriftcheckError, match=r"unknown device type 'foo': this torch .* has cpu.*, npu$"):
        open_device("foo")


def test_open_lazy_starts_the_torchscript_backend() -> None:
    assert devices.init_backend("cpu") is False
    assert open_device("lazy") == torch.device("lazy")
    assert devices.init_backend("lazy") is True  # a second start is a no-op
    assert torch.ones(2, device="lazy").add(1).cpu().tolist() == [2.0, 2.0]
    assert not devices.storage_inspectable("lazy") and devices.storage_inspectable("cpu")
    with pytest.raises(DriftcheckError, match="lazy:1"):
        open_device("lazy:1")

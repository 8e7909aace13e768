"""A real "tpu" target without a TPU: tests/data/pytpu, a PrivateUse1 backend made in Python.

The package is never installed into the test environment: it is laid out with its dist-info (the
``torch.backends`` entry point) in a temporary folder that only the target's PYTHONPATH names, so a
process loads it exactly as torch_tpu is loaded, by ``import torch``, and only where it is asked to.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENV, assert_one_line_error, make_pytpu_site

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pytpu_site(tmp_path_factory) -> Path:
    """What ``pip install --no-deps --target SITE tests/data/pytpu`` lays out, made by hand."""
    return make_pytpu_site(tmp_path_factory.mktemp("pytpu-site"))


def _env(site: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    path = [str(site)] if site is not None else []
    env["PYTHONPATH"] = os.pathsep.join(path + [str(REPO)])
    env.update(extra)
    return env


def _python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


PROBE = "import sys, torch; print(torch._C._get_privateuse1_backend_name(), 'pytpu' in sys.modules)"


def test_autoloads_only_where_its_folder_is_on_the_path(pytpu_site):
    assert _python(PROBE, _env(pytpu_site)) == "tpu True"
    assert _python(PROBE, _env(pytpu_site, TORCH_DEVICE_BACKEND_AUTOLOAD="0")) == "privateuseone False"
    assert _python(PROBE, _env(None)) == "privateuseone False"


NUMERICS = """
import torch
torch.manual_seed(0)
a, b = torch.randn(8, 64), torch.randn(64, 5)
ta, tb = a.to("tpu"), b.to("tpu")
one_pass = a.bfloat16().float() @ b.bfloat16().float()
print((ta @ tb).cpu().equal(one_pass), not (ta @ tb).cpu().equal(a @ b))
print(ta.exp().cpu().equal(a.exp()), ta.t().contiguous().cpu().equal(a.t().contiguous()))
x = ta.clone(); x[2:4].mul_(3)
print(x.cpu()[2:4].equal(a[2:4] * 3), x[2:].data_ptr() - x.data_ptr() == 2 * 4 * 64,
      x.data_ptr() != ta.data_ptr())
lin = torch.nn.Linear(64, 5)
lin_t = torch.nn.Linear(64, 5).to("tpu"); lin_t.load_state_dict(lin.state_dict())
opt = torch.optim.AdamW(lin_t.parameters(), lr=0.1)
lin_t(ta).square().mean().backward(); opt.step()
print(lin_t.weight.grad.device, lin_t.weight.device, bool(lin_t.weight.detach().cpu().ne(lin.weight).any()))
"""


def test_matmuls_are_one_bf16_pass_and_the_rest_is_the_cpus(pytpu_site):
    lines = _python(NUMERICS, _env(pytpu_site)).splitlines()
    assert lines[:3] == ["True True", "True True", "True True True"]
    assert lines[3] == "tpu:0 tpu:0 True"  # autograd and a foreach AdamW step ran on "tpu"


def test_open_device_describes_the_backend_not_torch_tpu(pytpu_site):
    code = ("import json; from driftcheck.targets import devices; "
            "print(json.dumps(devices.describe(devices.open_device('tpu'))))")
    info = json.loads(_python(code, _env(pytpu_site)))
    assert info["type"] == "tpu" and info["accelerator"] == "tpu"
    assert info["versions"]["torch_tpu"] is None
    assert info["privateuse1"]["module"] == "pytpu.backend"
    assert info["privateuse1"]["entry_points"] == ["pytpu = pytpu:autoload (pytpu 0.1.0)"]


def test_without_the_backend_tpu_still_needs_torch_tpu(pytpu_site, tmp_path):
    # on the path but not autoloaded: no backend named tpu, so the torch_tpu line, in one line
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "record", "mlp", "--device", "tpu",
                           "--out", str(tmp_path / "t")], capture_output=True, text=True,
                          env=_env(pytpu_site, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, "device 'tpu' needs torch_tpu")


def _run(model: str, out: Path, site: Path, *extra: str) -> subprocess.CompletedProcess:
    target_path = os.pathsep.join([str(site), str(REPO)])
    return subprocess.run([sys.executable, "-m", "driftcheck", "run", model, "--reference", "cpu",
                           "--target", "tpu", "--target-env", f"PYTHONPATH={target_path}", *extra,
                           "--out", str(out)], capture_output=True, text=True, env=_env(None),
                          timeout=900)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_run_mlp_on_the_python_tpu(pytpu_site, tmp_path):
    proc = _run("mlp", tmp_path / "run", pytpu_site)
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["first_divergence"]["module"] == "fc1"
    kinds = {f["kind"] for f in report["findings"]}
    assert "known.matmul_below_recorded_precision" in kinds  # named by the drill-down
    assert (tmp_path / "run" / "drill" / "repro" / "repro.py").is_file()
    ref, tgt = _manifest(tmp_path / "run" / "reference"), _manifest(tmp_path / "run" / "target")
    # the reference's process never loaded the backend; the target's did, and says which it is
    assert ref["run"]["precision"]["device"]["privateuse1"] is None
    assert ref["run"]["precision"]["device"]["accelerator"] is None
    assert tgt["run"]["precision"]["device"]["privateuse1"]["module"] == "pytpu.backend"
    assert tgt["run"]["precision"]["versions"]["torch_tpu"] is None


def test_run_mlp_control_with_cpu_matmuls_passes(pytpu_site, tmp_path):
    # bitwise the CPU's numbers, and no view finding: a "tpu" storage has the CPU bytes' address
    # and size (with 0-byte storages the view audit saw every slice as a copy: view.alias_lost)
    proc = _run("mlp", tmp_path / "run", pytpu_site, "--target-env", "PYTPU_MATMUL=fp32",
                "--view-audit")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_run_llama_on_the_python_tpu(pytpu_site, tmp_path):
    # model.to("tpu") replaces the parameters (no compatible shallow-copy type): the tied head
    # comes apart, as on lazy, and that is the named cause; the bf16 matmuls drift beside it
    proc = _run("llama", tmp_path / "run", pytpu_site)
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["first_divergence"]["finding"] == "alias.sharing_differs"
    assert report["first_divergence"]["module"] == "tok_emb"
    q_proj = [e for e in report["entries"] if e["module"] == "layers.0.attn.q_proj" and e["step"] == 0
              and e["phase"] == "forward" and e["slot"].startswith("output")]
    assert q_proj and all(e["status"] == "drift" and e["ratio"] > 100 for e in q_proj)


def test_run_looks_for_backends_on_the_targets_path(pytpu_site):
    from driftcheck.targets import devices

    assert devices.backend_entry_points(str(pytpu_site)) == ["pytpu = pytpu:autoload (pytpu 0.1.0)"]
    assert not any("pytpu" in e for e in devices.backend_entry_points(None))


def test_a_lazy_reference_compares_with_a_tpu_target(pytpu_site, tmp_path):
    """From torch_xla to TorchTPU: a reference recorded on a deferred device (the lazy-tensor
    design torch_xla's XLA tensors use) against a tpu target. With the target's matmuls in fp32
    the two backends compute the same numbers and the run passes; with one bf16 pass it fails
    at the first matmul."""
    proc = _run("mlp", tmp_path / "ctl", pytpu_site, "--reference", "lazy", "--target-env", "PYTPU_MATMUL=fp32",
                "--no-drill")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = _manifest(tmp_path / "ctl" / "reference")
    assert ref["run"]["precision"]["device"]["type"] == "lazy" and ref["run"]["lazy"]["steps"]
    proc = _run("mlp", tmp_path / "bf16", pytpu_site, "--reference", "lazy", "--no-drill")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bf16" / "report.json").read_text())
    assert report["first_divergence"]["module"] == "fc1"

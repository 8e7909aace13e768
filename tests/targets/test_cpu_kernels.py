"""Other real kernels on one CPU as targets (docs/noise-floor.md, "Real-kernel controls"): ATen's
vectorisation level (ATEN_CPU_CAPABILITY, read when torch loads) and oneDNN off (--mkldnn off).
Each is a clean fp32 target that must pass against a plain CPU reference, and the difference is
reported as a precision setting that explains drift."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import dc

from driftcheck.targets.precision import apply_settings, capture_settings
from driftcheck.targets.settings_diff import diff_settings


def test_capture_settings_records_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # recorded as given (torch read it at import)
    before = capture_settings(torch.device("cpu"), torch.float32)
    assert before["cpu_kernels"] == {"capability": torch.backends.cpu.get_cpu_capability(),
                                     "mkldnn": bool(torch.backends.mkldnn.enabled)}
    assert before["env"]["ATEN_CPU_CAPABILITY"] == "default"
    previous = apply_settings(mkldnn=False)
    try:
        assert torch.backends.mkldnn.enabled is False
        after = capture_settings(torch.device("cpu"), torch.float32)
    finally:
        apply_settings(**previous)
    assert previous == {"mkldnn": before["cpu_kernels"]["mkldnn"]}
    assert torch.backends.mkldnn.enabled == before["cpu_kernels"]["mkldnn"]
    assert after["cpu_kernels"]["mkldnn"] is False
    rows = {key: (a, b, explains) for key, a, b, explains in diff_settings(before, after)}
    assert rows == {"cpu_kernels.mkldnn": (before["cpu_kernels"]["mkldnn"], False, True)}


def test_record_with_mkldnn_off_restores_it(tmp_path) -> None:
    """record(mkldnn=False) turns oneDNN off for that record only; its manifest says so."""
    from driftcheck.models import load
    from driftcheck.record.runner import record
    from driftcheck.store import TraceReader

    was = torch.backends.mkldnn.enabled
    out = record(load("mlp"), tmp_path / "t", mkldnn=False, steps=1, mode="stats")
    assert torch.backends.mkldnn.enabled == was
    assert TraceReader(out).run["precision"]["cpu_kernels"]["mkldnn"] is False


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kernels")
    refs = {}
    for model in ("llama", "mlp"):
        refs[model] = str(root / model)
        p = dc("record", model, "--out", refs[model])
        assert p.returncode == 0, p.stderr
    return refs


# (the record options of the target, the setting the precision finding must name)
KERNELS = {"isa-default": (["--env", "ATEN_CPU_CAPABILITY=default"], "cpu_kernels.capability"),
           "mkldnn-off": (["--mkldnn", "off"], "cpu_kernels.mkldnn")}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("model", ("llama", "mlp"))
def test_other_cpu_kernels_are_a_clean_target(references, tmp_path, model: str, kernels: str) -> None:
    from driftcheck.store import TraceReader

    options, setting = KERNELS[kernels]
    ref, tgt, rep = references[model], tmp_path / "tgt", tmp_path / "report.json"
    p = dc("record", model, "--out", str(tgt), "--replay", ref, *options)
    assert p.returncode == 0, p.stderr
    kernels_run = TraceReader(tgt).run["precision"]["cpu_kernels"]
    if kernels == "isa-default":
        assert kernels_run["capability"] == "DEFAULT"
    else:
        assert kernels_run["mkldnn"] is False
    p = dc("compare", ref, str(tgt), "--json", str(rep))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(rep.read_text())
    assert report["verdict"] == "pass"
    ref_kernels = TraceReader(ref).run["precision"]["cpu_kernels"]
    if ref_kernels != kernels_run:  # an unvectorised CPU runs DEFAULT kernels anyway
        (finding,) = [f for f in report["findings"] if f["kind"] == "precision.settings_differ"]
        assert finding["severity"] == "warning" and setting in finding["message"]


def test_run_hands_mkldnn_off_to_the_target_only(tmp_path) -> None:
    from driftcheck.store import TraceReader

    out = tmp_path / "run"
    p = dc("run", "mlp", "--target", "cpu", "--mkldnn", "off", "--target-env",
           "ATEN_CPU_CAPABILITY=default", "--out", str(out), "--no-html", "--steps", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    ref, tgt = TraceReader(out / "reference").run, TraceReader(out / "target").run
    assert ref["precision"]["cpu_kernels"]["mkldnn"] is True
    assert tgt["precision"]["cpu_kernels"] == {"capability": "DEFAULT", "mkldnn": False}
    assert tgt["env"] == {"ATEN_CPU_CAPABILITY": "default"}

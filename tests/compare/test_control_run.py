"""The control run (issue 47): the reference device at the target's precision, recorded from the
same replay. An entry fails only where the analytic floor and the control both object (the
target further from the reference than the control is); where the control drifts as far, the
model's own code is named as sensitive to the precision. Injected defects are still caught and
blamed where they are, also inside the sensitive module."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DATA, dc, record_side

from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.loader import load_scenario
from driftcheck.record.run import Sides, control_side
from driftcheck.record.runner import record
from driftcheck.targets import opfaults

FRAGILE = f"{DATA / 'fragile.py'}:build"


def _record(root: Path, name: str, *, dtype: str, fault=None, threads: int | None = None,
            model: str = FRAGILE) -> Path:
    ref = root / "ref"
    return record_side(load_scenario(model), root / name, threads=threads, fault=fault, dtype=dtype,
                       replay=ref, local=ref, force=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    record(load_scenario(FRAGILE), root / "ref", dtype="fp32")
    _record(root, "clean", dtype="bf16")
    _record(root, "control", dtype="bf16", threads=2)
    return root


def test_a_model_fragile_at_bf16_fails_alone_and_passes_with_the_control_named_as_its_sensitivity(runs):
    alone = compare(runs / "ref", runs / "clean")
    assert alone.verdict == "fail"  # (x + 256) - 256 in bf16 is not x: the analytic floor objects
    assert alone.first_divergence["blame_module"] == "mix"
    rep = compare(runs / "ref", runs / "clean", control=runs / "control")
    assert rep.verdict == "pass", rep.decided_by
    assert "control run" in rep.decided_by
    rescued = [e for e in rep.entries if e.decided_by == "control" and e.details["analytic_ratio"] > rep.limit]
    assert rescued and {e.module for e in rescued} == {"mix.b"}
    sens = [f for f in rep.findings if f.kind == "precision.model_sensitive"]
    assert [f.module for f in sens] == ["mix"]  # the parent's code made mix.b's input
    assert sens[0].severity == "warning" and sens[0].details["control_ratio"] > rep.limit
    assert rep.control is not None and rep.control["dtype"] == "bfloat16"
    again = type(rep).from_dict(json.loads(json.dumps(rep.to_dict())))
    assert again.control == rep.to_dict()["control"]


@pytest.mark.parametrize("make,blame", [
    # a leaf Linear's output 5% off downstream of the fragile code
    (lambda: opfaults.scale_op("out", "addmm", 1.05), "out"),
    # the sum in the fragile module's own code 5% off: the control drifts there too, but not
    # in what that code adds itself (its local replay)
    (lambda: opfaults.scale_op("mix", "add", 1.05), "mix"),
    # SiLU's backward without its second term, after the fragile code
    (lambda: opfaults.wrong_backward("act", op="silu_backward"), "act"),
])
def test_a_defect_is_still_caught_and_blamed_with_the_control(runs, make, blame):
    tgt = _record(runs, f"fault-{blame}", dtype="bf16", fault=make)
    rep = compare(runs / "ref", tgt, control=runs / "control")
    assert rep.verdict == "fail", rep.decided_by
    assert rep.first_divergence["blame_module"] == blame, rep.first_divergence


def test_a_two_percent_defect_in_glue_code_is_still_found_at_bf16_with_the_control(tmp_path):
    record(load_scenario("llama"), tmp_path / "ref", dtype="fp32")
    _record(tmp_path, "control", dtype="bf16", threads=2, model="llama")
    tgt = _record(tmp_path, "t", dtype="bf16", model="llama",
                  fault=lambda: opfaults.scale_op("layers.1.mlp", "mul", 1.02))
    rep = compare(tmp_path / "ref", tgt, control=tmp_path / "control")
    assert rep.verdict == "fail"
    assert rep.first_divergence["blame_module"] == "layers.1.mlp"


def test_a_third_party_floor_gap_passes_with_the_control_and_is_named(tmp_path):
    """Mixtral's router auxiliary loss: a clean bf16 run over the analytic floor (a pattern it
    does not model) passes with the control, named where it drifts."""
    model = f"{DATA / 'fragile.py'}:mixtral_aux"
    record(load_scenario(model), tmp_path / "ref", dtype="fp32")
    tgt = _record(tmp_path, "t", dtype="bf16", model=model)
    assert compare(tmp_path / "ref", tgt).verdict == "fail"
    rep = compare(tmp_path / "ref", tgt, control=_record(tmp_path, "control", dtype="bf16", threads=2,
                                                         model=model))
    assert rep.verdict == "pass", rep.decided_by
    assert any(f.kind == "precision.model_sensitive" for f in rep.findings)


def test_the_control_side_is_the_reference_device_at_the_targets_precision_in_another_order(tmp_path):
    ref, ctl = tmp_path / "reference", tmp_path / "control"
    sides = Sides(model="llama", out=tmp_path, target="cpu", target_dtype="bf16", local=True,
                  target_env={"OMP_NUM_THREADS": "2"}, reference_env={"OMP_NUM_THREADS": "1"})
    args, env, label = control_side(sides, ref, ctl)
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--dtype") + 1] == "bf16"
    assert args[args.index("--replay") + 1] == str(ref) and args[args.index("--local") + 1] == str(ref)
    assert env["OMP_NUM_THREADS"] == "3"  # neither the reference's nor the target's order
    assert "control" in label
    # the target's precision settings go with it, its backend's do not
    sides.autocast, sides.emulate, sides.simulate = "bf16", "tpu", "gelu-tanh"
    args, _, _ = control_side(sides, ref, ctl)
    assert "--autocast" in args and "--emulate" not in args and "--simulate" not in args
    # a CUDA reference at the target's own precision: the control would be the reference again
    assert control_side(Sides(model="llama", out=tmp_path, reference="cuda", target="tpu"), ref, ctl) is None
    # a CPU reference at the target's own precision: another thread count
    _, env, _ = control_side(Sides(model="llama", out=tmp_path, target="tpu",
                                   reference_env={"OMP_NUM_THREADS": "1"}), ref, ctl)
    assert env["OMP_NUM_THREADS"] == "2"


def test_run_records_the_control_only_when_the_verdict_would_fail(tmp_path):
    out = tmp_path / "run"
    p = dc("run", FRAGILE, "--target", "cpu", "--target-dtype", "bf16", "--out", str(out), "--no-drill")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (out / "control" / "manifest.json").exists()
    assert "precision.model_sensitive" in p.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["control"]["dtype"] == "bfloat16"
    assert any(f["kind"] == "precision.model_sensitive" and f["module"] == "mix" for f in rep["findings"])
    assert "<th>control</th>" in (out / "report.html").read_text()  # its run beside the others
    # without it, the same run fails
    p = dc("run", FRAGILE, "--target", "cpu", "--target-dtype", "bf16", "--out", str(out), "--force",
           "--no-drill", "--no-control")
    assert p.returncode == 1, p.stdout + p.stderr
    assert not (out / "control").exists()  # a control of an earlier run is not left beside this one
    # compare takes it too; a pass needs no control (the built-in mlp at bf16)
    p = dc("compare", str(out / "reference"), str(out / "target"), "--control", str(tmp_path / "nope"))
    assert p.returncode == 2
    p = dc("run", "mlp", "--target", "cpu", "--target-dtype", "bf16", "--out", str(tmp_path / "mlp"))
    assert p.returncode == 0 and not (tmp_path / "mlp" / "control").exists()


def test_a_view_finding_the_control_shows_too_is_the_precisions_and_a_warning(tmp_path):
    model = f"{DATA / 'fragile.py'}:cast_write"
    record(load_scenario(model), tmp_path / "ref", dtype="fp32", view_audit=True)
    for name, threads in (("t", None), ("control", 2)):
        old = torch.get_num_threads()
        torch.set_num_threads(threads or old)
        try:
            record(load_scenario(model), tmp_path / name, dtype="bf16", replay=tmp_path / "ref",
                   local=tmp_path / "ref", view_audit=True)
        finally:
            torch.set_num_threads(old)
    alone = compare(tmp_path / "ref", tmp_path / "t")
    bad = [f for f in alone.findings if f.kind.startswith(("view.", "inplace."))]
    assert alone.verdict == "fail" and bad and bad[0].severity == "error"  # view.write_not_through_view
    rep = compare(tmp_path / "ref", tmp_path / "t", control=tmp_path / "control")
    same = [f for f in rep.findings if f.kind.startswith(("view.", "inplace."))]
    assert same and all(f.severity == "warning" and "control run" in f.message for f in same)
    assert rep.verdict == "pass", rep.decided_by


def test_a_control_of_another_precision_is_refused(runs):
    """A control bounds the target by a correct run's drift at the target's own precision: one
    recorded at another precision is bad input (one line, exit 2), from Python and the CLI."""
    _record(runs, "control_fp16", dtype="fp16", threads=2)
    with pytest.raises(DriftcheckError, match="--control was recorded at dtype float16, the target at dtype bfloat16"):
        compare(runs / "ref", runs / "clean", control=runs / "control_fp16")
    p = dc("compare", str(runs / "ref"), str(runs / "clean"), "--control", str(runs / "control_fp16"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "the target's precision" in p.stderr

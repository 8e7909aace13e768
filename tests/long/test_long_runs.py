"""Long runs (400 steps): clean targets stay inside the control band; a fault that begins at
step 150 is found there, and the full record of that step names the faulty module."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import dc

from driftcheck.compare import compare
from driftcheck.compare.long import compare_long
from driftcheck.errors import DriftcheckError
from driftcheck.loader import load_scenario
from driftcheck.record.long import record_long
from driftcheck.record.runner import record
from driftcheck.store.long import LongReader
from driftcheck.targets import faults

STEPS, EVERY, FAULT_AT, FAULTY = 400, 5, 150, "layers.1.mlp.down_proj"


def _long(name, out, **kw):
    return record_long(load_scenario(name), out, steps=STEPS, every=EVERY, force=True, model_id=name, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long-llama")
    ref = _long("llama", tmp / "ref")
    ctl = _long("llama", tmp / "ctl", dtype="bf16", replay=ref, perturb=True)
    return tmp, ref, ctl


def test_a_long_trace_is_columns_not_entries(llama):
    _, ref, _ = llama
    r = LongReader(ref)
    assert r.steps == STEPS and r.columns["loss"].shape == (STEPS,)
    assert r.columns["param_sample"].shape[0] == len(range(0, STEPS, EVERY)) + 1  # and the last step
    assert r.points == list(range(0, STEPS, 50))
    assert sum(f.stat().st_size for f in ref.rglob("long.*")) < 2_000_000


@pytest.mark.parametrize("name", ["llama", "resnet"])
def test_clean_bf16_targets_stay_in_the_band(tmp_path, name, llama):
    if name == "llama":
        tmp, ref, ctl = llama
    else:
        ref = _long(name, tmp_path / "ref")
        ctl = _long(name, tmp_path / "ctl", dtype="bf16", replay=ref, perturb=True)
        tmp = tmp_path
    tgt = _long(name, tmp / "bf16", dtype="bf16", replay=ref)
    rep = compare_long(ref, tgt, ctl)
    assert rep, rep.sentence
    # A correct run may cross the band for a while and come back (chaotic runs cross; the
    # verdict warns): on a CPU with AMX the bf16 Llama peaked at 4.1x its control, then returned.
    assert rep.first_bad_step is None and rep.worst_ratio < 2 * rep.band


def test_the_same_precision_with_other_threads_stays_in_the_band(tmp_path):
    ref = _long("llama", tmp_path / "ref")
    ctl = _long("llama", tmp_path / "ctl", replay=ref, perturb=True)
    torch.set_num_threads(2)
    try:
        tgt = _long("llama", tmp_path / "t2", replay=ref)
    finally:
        torch.set_num_threads(1)
    assert compare_long(ref, tgt, ctl)


def test_a_fault_from_step_150_is_found_there_and_named_in_full(llama):
    tmp, ref, ctl = llama
    bad = _long("llama", tmp / "bad", dtype="bf16", replay=ref,
                target_hooks=faults.starting_at(faults.scale_output(FAULTY, 2.0), FAULT_AT))
    rep = compare_long(ref, bad, ctl)
    assert not rep
    assert FAULT_AT <= rep.first_bad_step <= FAULT_AT + 2 * EVERY
    # the first bad step in full, both sides from the reference's nearest replay point
    s = rep.first_bad_step
    start = max(p for p in LongReader(ref).points if p <= s)
    full_ref = record(load_scenario("llama"), tmp / "fb-ref", replay=ref, start=start,
                      steps=s - start + 1, capture_steps=[s], force=True)
    full_tgt = record(load_scenario("llama"), tmp / "fb-tgt", replay=ref, start=start,
                      steps=s - start + 1, capture_steps=[s], dtype="bf16", force=True,
                      target_hooks=faults.starting_at(faults.scale_output(FAULTY, 2.0), FAULT_AT))
    full = compare(full_ref, full_tgt)
    assert not full
    assert full.first_divergence["module"] == FAULTY and full.first_divergence["step"] == s


def test_run_long_from_the_cli_passes_a_clean_target_and_writes_its_reports(tmp_path):
    out = tmp_path / "run"
    proc = dc("run", "llama", "--target", "cpu", "--target-dtype", "bf16", "--long", "--steps", "60",
              "--every", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PASS band (4x the control)" in proc.stdout
    assert {"reference", "target", "control", "long-report.json", "long-report.html"} <= {p.name for p in out.iterdir()}
    data = json.loads((out / "long-report.json").read_text())
    assert data["verdict"] == "pass" and len(data["loss"]["control"]) == 60
    html = (out / "long-report.html").read_text()
    assert "Plotly.newPlot" in html and "https://" not in html.split("<script>")[0]
    again = dc("compare", str(out / "reference"), str(out / "target"), "--control", str(out / "control"))
    assert again.returncode == 0 and "PASS band" in again.stdout
    alone = dc("compare", str(out / "reference"), str(out / "target"))
    assert alone.returncode == 1 and "no control run" in alone.stdout


def test_bad_long_inputs_are_one_line(tmp_path):
    for args, words in ((["record", "llama", "--out", str(tmp_path / "a"), "--long"], "--long needs --steps"),
                        (["record", "llama", "--out", str(tmp_path / "b"), "--perturb"], "add --long"),
                        (["record", "llama", "--out", str(tmp_path / "c"), "--start", "5"],
                         "--start needs --replay")):
        proc = dc(*args)
        assert proc.returncode == 2 and words in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    with pytest.raises(DriftcheckError, match="not a long reference"):
        plain = record(load_scenario("mlp"), tmp_path / "plain", force=True)
        record_long(load_scenario("mlp"), tmp_path / "x", steps=3, replay=plain)


def test_run_long_finds_torch_tpus_batchnorm_bug_and_records_that_step_in_full(tmp_path):
    """torch_tpu 0.2.0 never writes BatchNorm running statistics in training (simulated): the
    buffers leave the band at once, and the first bad step in full names the BatchNorm modules."""
    out = tmp_path / "run"
    proc = dc("run", "resnet", "--target", "cpu", "--target-dtype", "bf16", "--long", "--steps", "30",
              "--every", "5", "--simulate", "skip-bn-stats", "--out", str(out))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("FAIL band (4x the control): the target leaves the band at step 0")
    assert "BatchNorm running statistics" in lines[1]
    assert lines[2].startswith("FAIL step 0 in full: BatchNorm running statistics in 6 modules (bn1,")
    full = json.loads((out / "first-bad" / "report.json").read_text())
    assert any(f["kind"].startswith("batchnorm.") for f in full["findings"])
    long = json.loads((out / "long-report.json").read_text())
    assert long["first_bad_step"] == 0 and long["first_bad_report"]["verdict"] == "fail"


def test_hostile_long_traces_are_one_line(llama, tmp_path):
    import shutil

    _, ref, ctl = llama
    cases = {"long.json": (b"{nope", "is not readable JSON"),
             "long.safetensors": (b"\x00" * 100, "re-record the long trace")}
    for name, (data, words) in cases.items():
        bad = tmp_path / name
        shutil.copytree(ctl, bad)
        (bad / name).write_bytes(data)
        proc = dc("compare", str(ref), str(bad))
        assert proc.returncode == 2 and words in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    other = record_long(load_scenario("llama"), tmp_path / "other", steps=STEPS, every=EVERY)
    proc = dc("compare", str(ref), str(ctl), "--control", str(other))
    assert proc.returncode == 2 and "did not replay the reference" in proc.stderr

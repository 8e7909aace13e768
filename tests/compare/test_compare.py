"""compare: zero drift on re-records, no false alarm from bf16, injected faults localized."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import BUILTINS, a_middle_linear, record_builtin
from torch import nn

from driftcheck.compare import compare
from driftcheck.gate.report import Report
from driftcheck.loader import load_scenario
from driftcheck.targets import faults


def scale_output(name: str, s: float):
    """Target-only fault: ``name``'s forward output times ``s`` (inside the module)."""
    return faults.scale_output(name, s)


def scale_input_grad(name: str, s: float):
    """Target-only fault: the gradient ``name`` sends back to its input is scaled by ``s``."""
    return faults.scale_grad(name, s)


@pytest.mark.parametrize("name", BUILTINS)
def test_fp32_rerecord_has_zero_drift(traces, name):
    rep = compare(traces[name]["fp32"], traces[name]["fp32b"])
    assert rep.verdict == "pass" and bool(rep)
    assert rep.first_divergence is None
    assert all(e.metrics.get("max_abs", 0.0) == 0.0 for e in rep.entries)
    assert len(rep.entries) > 100


@pytest.mark.parametrize("name", BUILTINS)
def test_bf16_target_passes_and_drift_is_explained(traces, name):
    rep = compare(traces[name]["fp32"], traces[name]["bf16"])
    assert rep.verdict == "pass", rep.decided_by
    judged = [e for e in rep.entries if e.ratio is not None]
    # real bf16 drift exists and the floor explains it
    assert max(e.metrics.get("rel_l2", 0) for e in judged if e.phase == "forward") > 1e-3
    assert max(e.ratio for e in judged) < rep.limit / 2, "no margin left against the limit"
    assert not [f for f in rep.findings if f.severity == "error"]


def fault_report(traces, name, tmp_path, fault, dtype="fp32"):
    """Compare the fp32 reference with a target recorded under ``fault`` on a middle Linear."""
    mod = a_middle_linear(name)
    tgt = record_builtin(name, tmp_path / "t", dtype=dtype, replay=traces[name]["fp32"],
                         target_hooks=fault(mod))
    rep = compare(traces[name]["fp32"], tgt)
    assert rep.verdict == "fail"
    return mod, rep


@pytest.mark.parametrize("name", BUILTINS)
def test_scaled_forward_output_is_localized(traces, name, tmp_path):
    mod, rep = fault_report(traces, name, tmp_path, lambda m: scale_output(m, 1.05))
    fd = rep.first_divergence
    assert (fd["module"], fd["phase"], fd["step"], fd["slot"]) == (mod, "forward", 0, "output")


@pytest.mark.parametrize("name", BUILTINS)
def test_wrong_gradient_is_localized(traces, name, tmp_path):
    mod, rep = fault_report(traces, name, tmp_path, lambda m: scale_input_grad(m, 1.05))
    fd = rep.first_divergence
    assert (fd["module"], fd["phase"], fd["slot"]) == (mod, "backward", "grad_input.0")
    # the forward pass is untouched
    assert all(e.status == "ok" for e in rep.entries if e.phase == "forward" and e.step == 0)


@pytest.mark.parametrize("name", BUILTINS)
def test_bf16_target_with_a_real_fault_is_localized(traces, name, tmp_path):
    mod, rep = fault_report(traces, name, tmp_path, lambda m: scale_output(m, 1.25), dtype="bf16")
    assert rep.first_divergence["module"] == mod


def test_report_json_round_trip(traces):
    rep = compare(traces["mlp"]["fp32"], traces["mlp"]["bf16"])
    d = rep.to_dict()
    import json

    back = Report.from_dict(json.loads(json.dumps(d, allow_nan=False)))
    assert back.verdict == rep.verdict and len(back.entries) == len(rep.entries)
    assert {"schema", "verdict", "reference", "target", "first_divergence", "entries", "findings"} <= set(d)
    e = d["entries"][0]
    assert {"key", "module", "phase", "step", "call", "slot", "metrics", "floor", "ratio", "status"} <= set(e)


def test_limit_override_flips_the_verdict(traces):
    rep = compare(traces["llama"]["fp32"], traces["llama"]["bf16"], limit=1e-3)
    assert rep.verdict == "fail"
    assert rep.first_divergence is not None
    assert "--limit" in rep.decided_by


def test_integer_tensor_mismatch_is_exact(tmp_path):
    """A wrong integer buffer (a BatchNorm counter) fails exactly, whatever the floor."""
    from driftcheck.store import TraceWriter

    def make(path, counter):
        w = TraceWriter(path)
        t = torch.tensor(counter)
        w.add({"key": "0/params/bn/0/buffer.n", "module": "bn", "phase": "params", "step": 0,
               "call": 0, "slot": "buffer.n", "order": 0, "shape": [], "dtype": "int64",
               "stats": {"numel": 1, "l2": float(counter)}}, t)
        w.close({"steps": 1})
    make(tmp_path / "a", 1)
    make(tmp_path / "b", 2)
    rep = compare(tmp_path / "a", tmp_path / "b")
    assert rep.verdict == "fail"
    assert rep.entries[0].decided_by == "exact" and math.isinf(rep.entries[0].ratio)


def test_worst_entries_carry_error_histograms(traces, tmp_path):
    """The HTML report's detail sections need the error histogram of the entries shown."""
    _mod, rep = fault_report(traces, "llama", tmp_path, lambda m: scale_output(m, 1.05))
    first = next(e for e in rep.entries if e.key == rep.first_divergence["key"])
    with_hist = [e for e in rep.entries if "histogram" in e.details]
    assert first in with_hist and 2 <= len(with_hist) <= 9
    for e in with_hist:
        h = e.details["histogram"]
        assert sum(h["counts"]) + h["exact"] == e.metrics["count_finite"]
        assert len(h["edges"]) == len(h["counts"]) + 1
    from driftcheck.report.html import render_html

    assert render_html(rep).count("error histogram") >= 2


def test_nan_downstream_is_not_blamed_as_drift(tmp_path):
    """Pure-fp16 Adam divides by eps = 1e-8, which is 0 in fp16: Inf in Whisper's conv1 update.
    That is the origin; the next step's entries depend on it and must not show up as drift of
    their own (before the fix, two step-1 fc2 gradients did, at ratio 9)."""
    pytest.importorskip("transformers")
    from driftcheck.record.runner import record

    ref = record(load_scenario("hf:whisper"), tmp_path / "ref", force=True, model_id="hf:whisper")
    tgt = record(load_scenario("hf:whisper"), tmp_path / "t", dtype="fp16", replay=ref, force=True)
    rep = compare(ref, tgt)
    assert rep.verdict == "fail"
    fd = rep.first_divergence
    assert (fd["status"], fd["phase"], fd["step"]) == ("nonfinite", "optimizer", 0)
    assert [f.key for f in rep.findings if f.kind == "nonfinite.origin"] == [fd["key"]]
    assert not [e.key for e in rep.entries if e.status == "drift"]


def test_large_tensors_measured_in_parts_on_two_workers_match_one_stream(traces, tmp_path,
                                                                          monkeypatch):
    # A pair above PART_ELEMS is split into parts measured on several threads and merged in
    # order; here every tensor above 1000 elements is, in chunks of 256 (parts of 768).
    import driftcheck.compare as cmp
    import driftcheck.compare.measure as measure
    from driftcheck.store import TraceReader

    _mod, _ = fault_report(traces, "llama", tmp_path, lambda m: scale_output(m, 1.05))
    ref, tgt = TraceReader(traces["llama"]["fp32"]), TraceReader(tmp_path / "t")
    one = cmp.Comparison(ref, tgt, chunk_elems=256, workers=1).run()
    monkeypatch.setattr(measure, "PART_ELEMS", 1000)
    split = cmp.Comparison(ref, tgt, chunk_elems=256, workers=2)
    jobs = [split.measurer.parts(e, e) for e in split.ref_entries]
    assert sum(1 for p in jobs if p and len(p) > 1) >= 5  # several pairs really are split
    two = split.run()
    assert (two.verdict, two.first_divergence["key"]) == (one.verdict, one.first_divergence["key"])
    for a, b in zip(one.entries, two.entries):
        assert a.key == b.key and a.status == b.status
        for k, v in a.metrics.items():
            if isinstance(v, int) or k in ("max_abs", "max_ulp", "ref_absmax"):
                assert b.metrics[k] == v, (a.key, k)
            elif isinstance(v, float):
                assert b.metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-300), (a.key, k)
        assert a.details.get("histogram") == b.details.get("histogram")


def test_tied_weights_carry_their_owners_error(traces):
    """The built-in Llama ties its head to the token embedding: the weight is captured once,
    under the embedding. The head computes with it, so its output inherits that parameter's
    error, and the embedding's gradient sums the head's contribution, so it depends on the
    head's gradients. Without this, a clean bf16 target of BART and T5 (tied embeddings and
    head) failed at ratios 3.7 and 4.6."""
    from driftcheck.store import TraceReader

    for run in ("fp32", "bf16"):
        assert TraceReader(traces["llama"][run]).manifest["tied_params"] == [
            {"module": "lm_head", "param": "weight", "owner": "tok_emb", "owner_param": "weight"}]
    rep = compare(traces["llama"]["fp32"], traces["llama"]["bf16"])
    by_key = {e.key: e for e in rep.entries}
    head_out = by_key["1/forward/lm_head/0/output"]
    assert "1/params/tok_emb/0/param.weight" in head_out.details["inherits_from"]
    emb_grad = by_key["0/grads/tok_emb/0/param.weight"]
    assert "0/backward/lm_head/0/grad_output" in emb_grad.details["inherits_from"]
    assert rep.verdict == "pass"


def test_parameter_gradients_allow_for_their_summation_order(tmp_path):
    """A convolution's weight gradient sums batch x positions terms per element, in an order
    that depends on the thread count: fp32 with 2 threads against 1 differs by ~10 u there,
    and a floor without that accumulation failed a plain compare of the built-in ResNet at
    ratio 8.9. K is the number of terms, sqrt(K) u_acc the allowance."""
    from driftcheck.store import TraceReader

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref = record_builtin("resnet", tmp_path / "ref")
        torch.set_num_threads(1)
        tgt = record_builtin("resnet", tmp_path / "tgt", replay=ref)
    finally:
        torch.set_num_threads(old)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    gout = next(e for e in TraceReader(ref).entries
                if e["key"] == "0/backward/layer1.conv2/0/grad_output")
    n, _c, h, w = gout["shape"]
    grad = next(e for e in rep.entries if e.key == "0/grads/layer1.conv2/0/param.weight")
    assert grad.details["floor"]["k"] == n * h * w


class _FunctionalReluMLP(nn.Module):
    """ReLU applied by the parent's code between two Linears (F.relu, as
    nn.TransformerEncoderLayer does): the kink is in the gradient of b's *output*."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class _Attention(nn.Module):
    """nn.MultiheadAttention uses out_proj's weight through F.linear: out_proj never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.att, self.out = nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 3)

    def forward(self, x):
        return self.out(self.att(x, x, x)[0])


def _functional_scenario(model_cls, shape):
    from driftcheck.scenario import Scenario

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return Scenario(model=model_cls(), inputs=[torch.randn(*shape, generator=g) for _ in range(2)],
                    loss=lambda out, x: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), steps=2)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_kink_applied_around_a_module_is_judged_in_its_output_gradient(tmp_path, mode):
    """A clean bf16 target failed at ratio 20 (full mode) on b's output gradient: where b's
    output crossed zero between the runs, relu lets the gradient through on one side only."""
    from driftcheck.record.runner import record

    ref = record(_functional_scenario(_FunctionalReluMLP, (64, 32)), tmp_path / "r", mode=mode)
    tgt = record(_functional_scenario(_FunctionalReluMLP, (64, 32)), tmp_path / "t", mode=mode,
                 dtype="bf16", replay=ref)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    flips = [e.details["kink_flips"] for e in rep.entries
             if e.slot == "grad_output" and "kink_flips" in e.details]
    if mode == "full":
        assert flips and all(f["count"] > 0 and not f["unexplained"] for f in flips)
    bad = record(_functional_scenario(_FunctionalReluMLP, (64, 32)), tmp_path / "bad", mode=mode,
                 dtype="bf16", replay=ref, target_hooks=faults.scale_output("b", 1.05))
    rep = compare(ref, bad)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "b"


def test_parameters_used_by_an_ancestor_inherit_its_gradients(tmp_path):
    """out_proj's gradient is made by MultiheadAttention's own code: without the ancestor's
    gradients as its dependencies, a clean bf16 target failed at ratio 7.9 there."""
    from driftcheck.record.runner import record

    ref = record(_functional_scenario(_Attention, (4, 9, 32)), tmp_path / "r")
    tgt = record(_functional_scenario(_Attention, (4, 9, 32)), tmp_path / "t", dtype="bf16",
                 replay=ref)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    grad = next(e for e in rep.entries if e.key == "0/grads/att.out_proj/0/param.weight")
    assert "0/backward/att/0/grad_output.0" in grad.details["inherits_from"]


class _SlopeKinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.lk, self.b = nn.Linear(32, 128), nn.LeakyReLU(0.1), nn.Linear(128, 128)
        self.r6, self.c = nn.ReLU6(), nn.Linear(128, 4)

    def forward(self, x):
        return self.c(self.r6(self.b(self.lk(self.a(x))) * 3))


def test_a_kink_that_changes_the_slope_is_judged_at_its_crossings(tmp_path):
    """LeakyReLU's gradient goes from 1 to 0.1 where its input crosses zero: neither side is
    zero, so the zero-flip test missed it, and a clean bf16 target failed at ratio 4 there."""
    from driftcheck.record.runner import record

    ref = record(_functional_scenario(_SlopeKinks, (64, 32)), tmp_path / "r")
    tgt = record(_functional_scenario(_SlopeKinks, (64, 32)), tmp_path / "t", dtype="bf16",
                 replay=ref)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    lk = [e.details["kink_flips"] for e in rep.entries
          if e.module == "lk" and e.slot == "grad_input.0" and "kink_flips" in e.details]
    assert lk and all(f["count"] > 0 and f["count"] <= f["forward_crossings"] for f in lk)


def test_comparing_traces_with_nothing_to_judge_is_an_error(tmp_path):
    """Two traces without a single entry used to PASS ('all 0 entries within the limit')."""
    from driftcheck.errors import DriftcheckError
    from driftcheck.store import TraceWriter

    for name in ("a", "b"):
        TraceWriter(tmp_path / name).close({"steps": 1})
    with pytest.raises(DriftcheckError, match="nothing to judge"):
        compare(tmp_path / "a", tmp_path / "b")


def test_ignored_entries_and_their_reasons_are_in_the_verdict(traces, tmp_path):
    """An ignore rule over the faulty module: the verdict passes, but says what was ignored and
    why, and its worst ratio is over the judged entries only (it printed the ignored 1e7 ratio
    as 'worst ratio ... <= 3.5')."""
    from driftcheck.gate.policy import Policy
    from driftcheck.report.junit import render_junit
    from driftcheck.report.markdown import render_markdown

    mod, _failed = fault_report(traces, "mlp", tmp_path, lambda m: scale_output(m, 1.5))
    policy = Policy.from_mapping({"ignore": [{"glob": mod, "reason": "rewritten kernel, issue #42"}]})
    rep = compare(traces["mlp"]["fp32"], tmp_path / "t", policy=policy)
    ignored = [e for e in rep.entries if e.status == "ignored"]
    assert rep.verdict == "pass" and ignored
    assert f"ignored by the policy: {len(ignored)} entr" in rep.decided_by
    assert "'rewritten kernel, issue #42'" in rep.decided_by
    worst_judged = max(e.ratio for e in rep.entries if e.status != "ignored")
    assert f"worst ratio {worst_judged:.3g}" in rep.decided_by
    assert max(e.ratio for e in ignored) > worst_judged
    for text in (render_markdown(rep), render_junit(rep)):
        assert "rewritten kernel, issue #42" in text


def test_verdict_names_the_number_that_failed_and_its_source(traces, tmp_path):
    """With local replay the failing number is the local ratio: the verdict line printed the
    propagated one ('ratio 1.98 > limit'), below the limit it claimed to exceed."""
    ref = traces["llama"]["fp32"]
    mod = a_middle_linear("llama")
    tgt = record_builtin("llama", tmp_path / "t", dtype="bf16", replay=ref, local=ref,
                         target_hooks=scale_output(mod, 1.02))  # below the propagated floor
    rep = compare(ref, tgt)
    assert rep.verdict == "fail"
    first = next(e for e in rep.entries if e.key == rep.first_divergence["key"])
    assert first.module == mod and first.ratio <= first.limit < first.local_ratio
    assert rep.decided_by.startswith(f"{mod} {first.phase} step {first.step} {first.slot}: local ratio "
                                     f"{first.local_ratio:.3g} > limit {first.limit:g}")
    assert f"propagated ratio {first.ratio:.3g} is within it" in rep.decided_by

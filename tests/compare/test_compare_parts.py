"""The comparison's parts, each alone on hand-built entries (no trace on disk): the alignment
key and slot helpers, the dependency index, the alignment, progress, unit roundoff, the floor's
allowances and inherited error, the findings log, update scales and the verdict."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from driftcheck.compare.alignment import Alignment, check_runs
from driftcheck.compare.allowances import Allowances
from driftcheck.compare.decisions import Decisions
from driftcheck.compare.entries import TraceEntry, forward_slot, gradient_slot, slot_is
from driftcheck.compare.findings import FindingLog
from driftcheck.compare.index import Call, DependencyIndex, call_of
from driftcheck.compare.inheritance import Inherit, Inheritance, Scale, linear_rel
from driftcheck.compare.magnitude import Magnitudes
from driftcheck.compare.measure import Progress
from driftcheck.compare.norms import Norms
from driftcheck.compare.propagation import Ledger, Propagated
from driftcheck.compare.roundoff import Roundoff, autocast_roundoff, matmul_roundoff
from driftcheck.compare.scale import Scales, update_scale
from driftcheck.compare.verdict import Verdict
from driftcheck.errors import DriftcheckError
from driftcheck.gate.policy import Policy
from driftcheck.gate.report import DRIFT, OK, Entry, Finding
from driftcheck.store.keys import TraceKey


def entry(step: int, phase: str, module: str, call: int, slot: str, *, order: int = 0,
          shape: list[int] | None = None, dtype: str = "float32", stats: dict[str, Any] | None = None,
          meta: dict[str, Any] | None = None) -> TraceEntry:
    key = f"{step}/{phase}/{module or '.'}/{call}/{slot}"
    return TraceEntry.of({"key": key, "module": module, "phase": phase, "step": step, "call": call,
                          "slot": slot, "order": order, "shape": shape or [4], "dtype": dtype,
                          "stats": stats or {"numel": 4, "l2": 2.0, "absmax": 1.0}, "meta": meta})


class FakeReader:
    """A reader's face: its run metadata and tensors by entry key."""

    def __init__(self, run: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                 entries: list[TraceEntry] | None = None) -> None:
        self.run = run or {"steps": 1}
        self.tensors = tensors or {}
        self.manifest: dict[str, Any] = {}
        self.entries = [e.raw for e in entries or []]

    def tensor(self, raw: dict[str, Any], which: str = "tensor") -> torch.Tensor | None:
        return self.tensors.get(raw["key"]) if which == "tensor" else None


# -- keys and slots ------------------------------------------------------------------------------
def test_an_entry_aligns_by_its_trace_key_which_equals_the_old_tuple():
    e = entry(1, "forward", "a.b", 2, "output.0")
    assert isinstance(e.align, TraceKey) and e.align == (1, "forward", "a.b", 2, "output.0")
    assert e.slot_is("output") and not e.slot_is("input", "grad_output")


@pytest.mark.parametrize("slot,kinds,expected", [
    ("input.0", ("input",), True), ("output", ("output",), True), ("grad_input.1", ("grad_input",), True),
    ("local.output.0", ("output",), False),  # a local replay's capture is of no kind of its own
    ("state.w.exp_avg", ("state", "param"), True), ("param.weight", ("buffer",), False),
])
def test_slot_is(slot, kinds, expected):
    assert slot_is(slot, *kinds) is expected


def test_forward_and_gradient_slots_are_inverse():
    assert forward_slot("grad_input.0") == "input.0" and forward_slot("grad_output") == "output"
    assert gradient_slot("output.x.1") == "grad_output.x.1"
    assert forward_slot(gradient_slot("input.kv.0")) == "input.kv.0"


# -- the dependency index ------------------------------------------------------------------------
def _block() -> list[TraceEntry]:
    """A parent calling one child: parameters, the child's input and output, their gradients."""
    return [
        entry(0, "params", "p.c", 0, "param.weight"),
        entry(0, "forward", "p", 0, "input.0", order=0),
        entry(0, "forward", "p.c", 0, "input.0", order=1, meta={"parent": "p#0"}),
        entry(0, "forward", "p.c", 0, "output", order=2, meta={"parent": "p#0", "kind": "linear"}),
        entry(0, "forward", "p", 0, "output", order=3),
        entry(0, "backward", "p", 0, "grad_output", order=4),
        entry(0, "backward", "p.c", 0, "grad_output", order=5, meta={"parent": "p#0"}),
        entry(0, "backward", "p.c", 0, "grad_input.0", order=6, meta={"parent": "p#0"}),
        entry(0, "grads", "p.c", 0, "param.weight", order=7),
    ]


def test_call_of_reads_a_meta_reference():
    assert call_of(3, "layers.0.attn#2") == Call(3, "layers.0.attn", 2) == (3, "layers.0.attn", 2)


def test_dependency_index_links_calls_and_their_gradients():
    es = _block()
    idx = DependencyIndex(es)
    by = {e.key: e for e in es}
    assert idx.children[Call(0, "p", 0)] == [("p.c", 0)]
    assert idx.owner_kind(by["0/grads/p.c/0/param.weight"]) == "linear"
    child_out = idx.dependencies(by["0/forward/p.c/0/output"])
    assert {d.key for d in child_out} == {"0/forward/p.c/0/input.0", "0/params/p.c/0/param.weight"}
    # the child's input is made by its parent's code, from the parent's inputs (and parameters
    # may be handed over as inputs: the module's own and its ancestors')
    assert [d.key for d in idx.dependencies(by["0/forward/p.c/0/input.0"])] == [
        "0/forward/p/0/input.0", "0/params/p.c/0/param.weight"]
    grads = {d.key for d in idx.dependencies(by["0/grads/p.c/0/param.weight"])}
    assert {"0/backward/p.c/0/grad_output", "0/forward/p.c/0/input.0"} <= grads


def test_dependency_index_ties_a_parameter_to_its_user():
    es = [entry(0, "params", "emb", 0, "param.weight"), entry(0, "forward", "head", 0, "output", order=1)]
    idx = DependencyIndex(es, [{"owner": "emb", "owner_param": "weight", "module": "head"}])
    assert [d.key for d in idx.dependencies(es[1])] == ["0/params/emb/0/param.weight"]
    assert idx.users[("emb", "weight")] == ["head"]


# -- alignment -----------------------------------------------------------------------------------
def test_alignment_puts_local_replays_beside_the_entry_they_replay():
    ref = [entry(0, "forward", "a", 0, "output", order=1), entry(0, "params", "a", 0, "param.w", order=5)]
    tgt = [entry(0, "forward", "a", 0, "output"), entry(0, "forward", "a", 0, "local.output")]
    al = Alignment.of(ref, tgt, [])
    assert [e.phase for e in al.ref_entries] == ["params", "forward"]  # phase before order
    assert set(al.tgt_map) == {(0, "forward", "a", 0, "output")}
    assert al.local_map[(0, "forward", "a", 0, "output")].slot == "local.output"
    assert al.truth_map == {}


def test_check_runs_refuses_other_steps_and_warns_of_another_replay():
    es = [entry(0, "forward", "a", 0, "output")]
    with pytest.raises(DriftcheckError, match="the same --steps"):
        check_runs(FakeReader({"steps": 1}), FakeReader({"steps": 2}), es, es)
    warnings = check_runs(FakeReader({"steps": 1, "replay_id": "x"}),
                          FakeReader({"steps": 1, "replay_id": "y"}), es, es)
    assert len(warnings) == 1 and "replay_id" in warnings[0]


# -- progress, roundoff --------------------------------------------------------------------------
def test_progress_tells_done_of_total_never_past_it():
    seen: list[tuple[int, int]] = []
    p = Progress(lambda d, t: seen.append((d, t)))
    p.start(2)
    for _ in range(3):
        p.tick()
    assert seen == [(1, 2), (2, 2), (2, 2)]


def test_autocast_and_matmul_roundoff():
    assert autocast_roundoff({"autocast": "bf16"}) == 2.0 ** -8
    assert autocast_roundoff({"precision": {"autocast": "float16"}}) == 2.0 ** -11
    assert autocast_roundoff({}) == 0.0
    assert matmul_roundoff({}, "float32", "forward", "linear") == 2.0 ** -24
    assert matmul_roundoff({}, "complex64", "forward", "linear") == 2.0 ** -24  # its components'
    tf32 = {"precision": {"device": {"type": "cuda"}, "allow_tf32": {"cuda_matmul": True}}}
    assert matmul_roundoff(tf32, "float32", "forward", "composite") == 2.0 ** -11
    with pytest.raises(DriftcheckError):  # a broken manifest raises, no longer hidden
        autocast_roundoff({"autocast": "no-such-dtype"})


def test_roundoff_takes_the_coarser_side_and_a_bf16_input():
    r = entry(0, "forward", "m", 0, "output", meta={"kind": "norm"})
    x = entry(0, "forward", "m", 0, "input.0", dtype="bfloat16")
    idx = DependencyIndex([x, r])
    ro = Roundoff(idx, {}, {}, {})
    assert ro.of(r, r) == (2.0 ** -8, 2.0 ** -24)  # its input's bf16
    assert ro.of(x, x) == (2.0 ** -8, 2.0 ** -24)


# -- allowances and inheritance ------------------------------------------------------------------
def _parts(entries: list[TraceEntry], ledger: Ledger, reader: Any = None) -> tuple[DependencyIndex, Allowances]:
    reader = reader or FakeReader()
    idx = DependencyIndex(entries)
    log = FindingLog()
    mags = Magnitudes(idx, entries, ledger)
    scales = Scales(reader, reader, idx, {}, entries, ledger, log, mags,
                    Roundoff(idx, {}, {}, {}))
    decisions = Decisions(idx, reader, ledger, log)
    return idx, Allowances(idx, ledger, scales, mags, decisions)


def test_a_parameter_carries_the_last_steps_error_or_allowance():
    p = entry(1, "params", "m", 0, "param.w")
    ledger = Ledger()
    before = TraceKey(0, "optimizer", "m", 0, "param.w")
    ledger.errors[before] = Propagated(0.1, 0.2, 3.0, 1.0)
    ledger.floors[before] = (2.0, 5.0)
    _, allow = _parts([p], ledger)
    assert allow.carried_update(p) == (3.0, 5.0)
    assert allow.of_phase(p, p, "full", {}) == (3.0, 5.0)
    assert allow.of_phase(entry(0, "params", "m", 0, "param.w"), p, "full", {}) == (0.0, 0.0)  # step 0


def test_softmax_logits_allow_u_times_the_largest_logit():
    s = Scale(ref_rms=1.0, ref_max=2.0, rms=1.0, max=2.0)
    assert Allowances.softmax_logits(2.0 ** -8, 1.0, s) is None  # not over 1
    assert Allowances.softmax_logits(2.0 ** -8, 16.0, s) == (2.0 ** -4, 2.0 ** -3)


def test_extra_sums_the_phase_term_then_the_terms_on_top_in_order():
    r = entry(0, "forward", "m", 0, "output", meta={"kind": "linear"})
    _, allow = _parts([r], Ledger())
    s = Scale(ref_rms=1.0, ref_max=3.0, rms=1.0, max=3.0)
    details: dict[str, Any] = {}
    assert allow.extra(r, r, "full", 0.5, 4.0, s, details) == (0.5 * 4.0 * 1.0, 0.5 * 4.0 * 3.0)
    assert details == {}


def test_optimizer_update_allows_half_the_step_and_twice_its_largest_element():
    before = entry(0, "params", "m", 0, "param.w")
    after = entry(0, "optimizer", "m", 0, "param.w", order=1)
    reader = FakeReader(tensors={before.key: torch.tensor([1.0, 1.0, 1.0, 1.0]),
                                 after.key: torch.tensor([1.5, 1.0, 0.5, 1.0])})
    by = {e.align: e for e in (before, after)}
    rms = (0.125) ** 0.5
    assert update_scale(after, reader, by) == (pytest.approx(rms), 0.5)
    _, allow = _parts([before, after], Ledger(), reader)
    assert allow.optimizer_update(after, after, {}) == (pytest.approx(0.5 * rms), 1.0)


def test_linear_rel_is_uncapped_below_its_cap():
    assert linear_rel(0.0, 0.0) == 0.0 and linear_rel(3.0, 1.0) == 3.0
    assert linear_rel(1.0, 0.0) == 1e12 and linear_rel(float("nan"), 1.0) == 0.0


def test_a_gradient_inherits_its_incoming_gradients_error_uncapped():
    g = entry(0, "backward", "m", 0, "grad_output", stats={"numel": 4, "l2": 2.0, "absmax": 2.0})
    r = entry(0, "backward", "m", 0, "grad_input.0", order=1, meta={"kind": "linear"},
              stats={"numel": 4, "l2": 1.0, "absmax": 1.0})  # not the same values as g
    idx = DependencyIndex([g, r])
    inh = Inheritance(idx, Norms(idx, FakeReader(), FakeReader(), {}))
    noise = Propagated(1.0, 1.0, 3.0, 4.0)  # capped relative error, absolute 3x its rms of 1
    s = Scale(ref_rms=1.0, ref_max=1.0, rms=1.0, max=1.0)
    assert inh.inherited(Inherit(r, "full", [g], [noise], s, {})) == (3.0, 2.0)  # over g's rms 1, absmax 2
    squared = entry(0, "optimizer", "m", 0, "state.w.exp_avg_sq")
    assert Inheritance.squared_moment(Inherit(squared, "full", [], [], s, {}), (0.25, 0.5)) == (0.5, 1.0)


# -- findings and the verdict --------------------------------------------------------------------
def test_finding_log_keeps_order_and_knows_what_it_holds():
    log = FindingLog()
    log.add(Finding("precision.low_precision_sum", "a", 0, "x", severity="warning"))
    log.extend([Finding("alignment.missing_in_target", "b", 0, "y")])
    assert [f.module for f in log.items] == ["a", "b"]
    assert log.has("precision.low_precision_sum", "a") and not log.has("precision.low_precision_sum", "b")


def _judged(status: str, ratio: float, key: str = "0/forward/m/0/output") -> Entry:
    return Entry(key=key, module="m", phase="forward", step=0, call=0, slot="output", order=0,
                 limit=3.0, metrics={}, floor=1.0, ratio=ratio, status=status, rule="default")


def test_verdict_passes_within_the_limit_and_names_the_first_divergence():
    v = Verdict(Policy.default(), None, DependencyIndex([]))
    ok = v.report([_judged(OK, 1.5)], [], [], ({}, {}, None))
    assert ok.verdict == "pass" and ok.first_divergence is None and "worst ratio 1.5" in ok.decided_by
    bad = v.report([_judged(OK, 1.0), _judged(DRIFT, 9.0, "0/forward/m/0/output.1")], [], ["w"], ({}, {}, None))
    assert bad.verdict == "fail" and bad.first_divergence is not None
    assert bad.first_divergence["key"] == "0/forward/m/0/output.1" and bad.warnings == ["w"]
    assert bad.first_divergence["where"] == "in the forward of m"


def test_the_local_floor_is_the_floor_without_what_is_inherited():
    from driftcheck.compare.opinions import local_floor
    from driftcheck.numerics import floor as fl

    fi = fl.FloorInputs(u=2.0 ** -8, scale_rms=1.0, scale_max=2.0, k=64, u_acc=2.0 ** -24,
                        inherited_rms=0.5, inherited_max=0.5, extra_rms=0.01)
    own = fl.floor(fl.FloorInputs(u=2.0 ** -8, scale_rms=1.0, scale_max=2.0, k=64, u_acc=2.0 ** -24,
                                  extra_rms=0.01))
    assert local_floor(fi) == own and local_floor(fi).rms < fl.floor(fi).rms

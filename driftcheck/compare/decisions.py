"""Decisions: indices a module's code computes (argmax, top-k, sort) flip between two runs where
their scores tie within rounding, and what follows a flip; integer entries are judged here.

- How many may flip: the reference recorded, per module call, its decisions' margins (the gap to
  the nearest rival score, record/watch.py). A score carries about its inputs' error; a decision
  whose margin is within DECISION_SPREAD times that error may go either way.
- A token routed to another expert changes how many tokens each expert sees: such an expert's
  tensors differ in shape along one dimension. After a flip judged legitimate in the same step,
  that is a consequence, not a defect: the entry is not measured at that step (the module is
  judged where both runs route alike) and what depends on it inherits a full error.
- In stats mode, a consumer of flipped indices (an embedding lookup of VQ codes) carries a sparse
  error a sample rarely holds: sqrt(2 p) of its rms for a share p of rows swapped for another.
"""
from __future__ import annotations

import math
from typing import Any

from driftcheck.compare.entries import TraceEntry, identical
from driftcheck.compare.findings import FindingLog
from driftcheck.compare.index import Call, DependencyIndex, call_of
from driftcheck.compare.propagation import Ledger
from driftcheck.gate.report import DRIFT, IGNORED, OK, Entry, Finding
from driftcheck.numerics import dtypes
from driftcheck.numerics.stats import SAMPLE_SIZE
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

FLIP_BASE = 0.05  # a share of computed indices that may always differ (no margins recorded)
FLIP_BOUND_HITS = 3  # a sample with k flips: k + 3 bounds the count at 95% (Poisson)
DECISION_SPREAD = 4.0  # a decision within this many times its scores' error of a rival may flip


def flip_scope(r: TraceEntry) -> str:
    """The module a flipped index of ``r`` routes within: the parent of the module that
    returned it, or the module whose code passed it to a child."""
    if r.slot_is("output"):
        return r.module.rpartition(".")[0]
    parent = r.meta.get("parent")
    return call_of(r.step, parent).module if parent else ""


def _one_dim_differs(a: list[int], b: list[int]) -> bool:
    """Shapes of one rank that differ in exactly one dimension (tokens routed elsewhere)."""
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def _grid_step(x: Any) -> float | None:
    """The spacing of a tensor's values where they lie on a grid (at most half as many levels
    as values, every gap a whole multiple of the smallest), else None."""
    if x is None or x.numel() < 4:
        return None
    v = x.double().reshape(-1)
    v = v[v.isfinite()].unique()  # sorted
    if v.numel() < 2 or v.numel() > x.numel() // 2:
        return None
    gaps = v[1:] - v[:-1]
    step = float(gaps.min())
    if step <= 0.0:
        return None
    q = gaps / step
    return step if bool(((q - q.round()).abs() <= 1e-3 * q.clamp(min=1.0)).all()) else None


class Decisions:
    """The reference's decisions (indices its modules' code computed) against the target's:
    which flipped legitimately, by step (what may reroute later tensors), and the share of each
    index tensor that may have (what its consumers inherit in stats mode)."""

    def __init__(self, index: DependencyIndex, ref: TraceReader, ledger: Ledger, findings: FindingLog) -> None:
        self.index, self.ref, self.ledger, self.findings = index, ref, ledger, findings
        # step -> (key, module it routes within) of computed indices that flipped, legitimately
        self.flipped: dict[int, list[tuple[str, str]]] = {}
        self.flip_share: dict[TraceKey, float] = {}  # align key -> share of an index tensor that flipped
        self.rerouted_by: dict[str, Finding] = {}  # flipped decision -> its alignment.rerouted

    def deciding_call(self, r: TraceEntry) -> Call | None:
        """The module call whose code computed integer entry ``r``: the module itself for its
        output, the parent for a child's input."""
        if r.slot_is("output"):
            return Call(r.step, r.module, r.call)
        return self.index.parent_of(r)

    def passed_through(self, r: TraceEntry) -> bool:
        """Whether integer input ``r`` of a child holds the very values of one of its parent
        call's inputs (token or position ids handed down): data, exact, not a decision."""
        call = self.deciding_call(r) if r.slot_is("input") else None
        return call is not None and any(
            d.align != r.align and identical(d, r) for d in self.index.fwd_in.get(call, []))

    def judge_integer(self, r: TraceEntry, m: dict[str, Any], base: dict[str, Any],
                      details: dict[str, Any], ignore: str | None) -> Entry:
        """Integer tensors: inputs, buffers and counters must match exactly. Integers a module
        computes (top-k expert indices, argmax) may flip where their float scores tie within
        rounding: as many as the reference's decisions had margins within their scores' error
        (:meth:`flips_allowed`), and at least FLIP_BASE of them; more is a defect."""
        mismatched = m.get("frac_outside", 0.0) if m.get("max_abs", 0.0) > 0 else 0.0
        computed = r.phase == "forward" and (r.slot_is("output") or r.meta.get("parent") is not None) \
            and not self.passed_through(r)
        if m.get("nonfinite_mismatch"):
            mismatched = 1.0
        allowed, how = self.flips_allowed(r) if computed else (0.0, None)
        if how is not None:
            details["decisions"] = how
        ok = mismatched <= allowed
        details["integer_mismatch_fraction"] = mismatched
        status = OK if ok else DRIFT
        if ignore and not ok:
            status = IGNORED
        if computed:
            share = self.flip_share_bound(r, mismatched, details.get("measured_on"), how)
            if share > 0:
                self.flip_share[r.align] = share
        if computed and ok and mismatched > 0:
            self.flipped.setdefault(r.step, []).append((r.key, flip_scope(r)))
        rule = ignore or (f"computed integers may flip on near ties (<= {allowed:.1%} of elements)"
                          if computed else "integer tensors must match exactly")
        return Entry(**base, metrics=m, floor=0.0, ratio=0.0 if mismatched == 0 else
                     (mismatched / allowed if allowed else math.inf), status=status,
                     decided_by="exact", rule=rule, details=details)

    def flips_allowed(self, r: TraceEntry) -> tuple[float, dict[str, Any] | None]:
        """(share of integer entry ``r`` that may differ, how that was decided or None)."""
        call = self.deciding_call(r)
        if call is None:
            return FLIP_BASE, None
        s = call[0]
        counts: list[int] = []
        own: list[int] = []  # the call's own code's decisions (not its children's)
        err = 0.0
        todo: list[Call] = [call]
        seen: set[Call] = set()
        while todo:  # the call and the calls inside it
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            for o in self.index.fwd_out.get(c, []):
                prof = o.meta.get("decision_profile")
                if prof:
                    counts = [x + y for x, y in zip(counts, prof)] if counts else list(prof)
                    own = list(prof) if c == call else own
            # the scores come from the call's inputs and the parameters of it and its children
            for d in (self.index.fwd_in.get(c, []) if c == call else []) \
                    + self.index.params.get((s, c[1]), []):
                e = self.ledger.errors.get(d.align)
                if e is not None and dtypes.is_float(d.dtype) and math.isfinite(e.rel_max):
                    err = max(err, e.rel_max)
            todo.extend(Call(s, m, k) for m, k in self.index.children.get(c, []))
        if not counts or not counts[0] or err <= 0.0:
            return FLIP_BASE, None
        # margins are counted by margin / (2 x their row's largest |score|) <= 2^-k, and a score
        # carries ~err of that: a margin within DECISION_SPREAD err of it may flip
        k = math.floor(math.log2(2.0 / (DECISION_SPREAD * err))) if DECISION_SPREAD * err < 2.0 else 0
        k = min(max(k, 0), len(counts) - 1)
        near = counts[k] / counts[0]
        how: dict[str, Any] = {"decisions": counts[0], "near_tie_share": near, "scores_rel_error": err,
               "call": f"{call[1]}#{call[2]}"}
        if own and own[0]:
            how["own_near_tie_share"] = own[k] / own[0]
        return max(FLIP_BASE, near), how

    def rounding_allowance(self, r: TraceEntry) -> tuple[float, float, dict[str, Any]] | None:
        """(rms, max) error a float forward entry may carry where the code that made it rounded
        to a grid (record/watch.py: rounding_profile): a share p of its elements a whole step
        apart, p the share of roundings within DECISION_SPREAD times the error of what was
        rounded (the call's inputs, parameters and children's outputs) of a boundary; the step
        read off the reference's values (a grid: few levels, spaced by multiples of one step).
        None where the call rounded nothing or the values are on no grid."""
        call = self.deciding_call(r)
        if call is None or r.phase != "forward" or not dtypes.is_float(r.dtype):
            return None
        prof = next((o.meta["round_profile"] for o in self.index.fwd_out.get(call, [])
                     if o.meta.get("round_profile")), None)
        if not prof or not prof[0]:
            return None
        s = call[0]
        err = 0.0
        for d in self.index.fwd_in.get(call, []) + self.index.params.get((s, call[1]), []) \
                + self.index.child_outputs(call):
            e = self.ledger.errors.get(d.align)
            if e is not None and d.align != r.align and dtypes.is_float(d.dtype) and math.isfinite(e.rel_max):
                err = max(err, e.rel_max)
        if err <= 0.0:
            return None
        step = _grid_step(self.ref.tensor(r.raw, "tensor" if "tensor" in r.raw else "sample"))
        if step is None:
            return None
        k = math.floor(math.log2(2.0 / (DECISION_SPREAD * err))) if DECISION_SPREAD * err < 2.0 else 0
        p = prof[min(max(k, 0), len(prof) - 1)] / prof[0]
        return step * math.sqrt(p), step, {"near_boundary_share": p, "step": step,
                                           "rounded_rel_error": err, "call": f"{call[1]}#{call[2]}"}

    def rerouted(self, r: TraceEntry, t: TraceEntry) -> str | None:
        """The key of the flipped decision that explains a shape mismatch of ``r``, or None: a
        forward or backward tensor of a module inside the module that holds the decision (a
        router's parent, the MoE block), differing in one dimension only."""
        if r.phase not in ("forward", "backward") or not _one_dim_differs(list(r.shape), list(t.shape)):
            return None
        for key, scope in self.flipped.get(r.step, ()):
            if not scope or r.module == scope or r.module.startswith(scope + "."):
                return key
        return None

    def note_rerouted(self, r: TraceEntry, t: TraceEntry, flip: str) -> None:
        """One warning per flipped decision: the modules whose tensors it reshaped."""
        f = self.rerouted_by.get(flip)
        if f is None:
            f = self.rerouted_by[flip] = Finding(
                "alignment.rerouted", r.module, r.step, "", severity="warning", phase=r.phase,
                key=r.key, details={"decision": flip, "modules": [], "entries": 0,
                                    "example": {"key": r.key, "reference_shape": list(r.shape),
                                                "target_shape": list(t.shape)}})
            self.findings.add(f)
        d = f.details
        d["entries"] += 1
        if r.module not in d["modules"]:
            d["modules"].append(r.module)
        f.message = (f"{d['entries']} tensor(s) of {len(d['modules'])} module(s) changed shape after "
                     f"{flip} flipped on near ties (e.g. {r.key}: reference {list(r.shape)}, "
                     f"target {list(t.shape)}): routed otherwise, so not measured at this step "
                     "(each module is judged at the steps where both runs route alike)")

    def flip_share_bound(self, r: TraceEntry, seen: float, measured_on: str | None,
                          how: dict[str, Any] | None) -> float:
        """The share of index tensor ``r`` that may have flipped, for what its consumers inherit
        in stats mode: exact where every element was compared, else the share seen in the
        sample raised to a 95% bound (FLIP_BOUND_HITS more hits), no more than the share of its
        call's own decisions near a tie. 0 where nothing flipped and nothing was decided."""
        own = (how or {}).get("own_near_tie_share")
        if measured_on == "full" or (r.stats.get("numel") or 0) <= SAMPLE_SIZE:
            return seen
        if not seen and own is None:
            return 0.0  # data passed through (token ids), not indices its code decided
        bound = seen + FLIP_BOUND_HITS / SAMPLE_SIZE
        return max(seen, min(bound, own)) if own is not None else bound

    def flip_sparse(self, deps: list[TraceEntry]) -> float:
        """The relative rms error that flipped indices among ``deps`` bring (stats mode): a share
        p of the rows a lookup reads swapped for another of the same size is sqrt(2 p) of its
        rms, p from flip_share_bound (a 512-element sample rarely holds one flip in a
        thousand, yet a 3x3 conv after it spreads that flip nine times)."""
        p = max((self.flip_share.get(d.align, 0.0) for d in deps), default=0.0)
        return math.sqrt(min(2.0 * p, 1.0)) if p > 0 else 0.0

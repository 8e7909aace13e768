"""The verdict: pass or fail, the first divergence and who is blamed, the sentence that decided
it, and the error histograms of the entries a reader looks at first.
"""
from __future__ import annotations

import math
from typing import Any

from driftcheck.compare.entries import slot_is
from driftcheck.compare.index import DependencyIndex, call_of
from driftcheck.gate.policy import Policy
from driftcheck.gate.report import DRIFT, IGNORED, MISALIGNED, NONFINITE, OK, Entry, Finding, Report, gate_state
from driftcheck.numerics import metrics as mx
from driftcheck.store.keys import TraceKey

HISTOGRAMS = 8  # worst entries that get an error histogram (the HTML report shows up to 6 + 1)


class Verdict:
    """The report's verdict from the judged entries and the findings, under ``policy``."""

    def __init__(self, policy: Policy, limit_override: float | None, index: DependencyIndex) -> None:
        self.policy, self.limit_override, self.index = policy, limit_override, index

    def report(self, entries: list[Entry], findings: list[Finding], warnings: list[str],
               runs: tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]) -> Report:
        """The Report: verdict, first divergence and the sentence that decided it. ``runs``:
        the reference's, the target's and the truth's (or None) run metadata."""
        # Where drift enters: the first entry whose own error is over the limit. A leaf module
        # replayed locally is blamed only if its local error is; otherwise it inherited the drift.
        first = next((e for e in entries if e.status in (DRIFT, NONFINITE) and _blamed(e)), None) \
            or next((e for e in entries if e.status in (DRIFT, NONFINITE)), None)
        gate_findings = self.gate(findings)
        limit = self.limit_override if self.limit_override is not None else self.policy.limit
        decided_by = _decided_by(entries, gate_findings, first, limit) + _ignored_words(entries, findings)
        fd = self.first_divergence(first)
        cause = _semantic_cause(gate_findings, first)
        if cause is not None:
            # A finding names a defect for certain; drift only where the numbers part (a
            # running statistic never written drifts wherever it is next read).
            fd = {"key": fd["key"] if fd else "", "module": cause.module,
                  "phase": cause.phase or (fd or {}).get("phase") or "forward",
                  "step": cause.step if cause.step is not None else (fd or {}).get("step", 0),
                  "call": 0, "slot": cause.kind, "ratio": None, "status": "finding",
                  "finding": cause.kind, "where": cause.message, "blame_module": cause.module,
                  **({"drift": fd} if fd else {})}
        verdict = "fail" if any(e.status in (DRIFT, NONFINITE, MISALIGNED) for e in entries) or gate_findings \
            else "pass"
        ref_run, tgt_run, truth_run = runs
        return Report(verdict=verdict, reference=ref_run, target=tgt_run,
                      first_divergence=fd, entries=entries, findings=findings, limit=limit,
                      decided_by=decided_by, warnings=warnings, truth=truth_run,
                      policy=dict(self.policy.to_dict(), **({"limit_override": self.limit_override}
                                                            if self.limit_override is not None else {})))

    def gate(self, findings: list[Finding]) -> list[Finding]:
        """Each finding's gate state set (ignore reasons noted): those that fail the gate."""
        gate_findings = []
        for f in findings:
            reason = self.policy.ignore_reason(f.module, f.phase, f.step, f.kind)
            f.gate = gate_state(f, self.policy)
            if reason:
                f.details = dict(f.details or {}, ignored=reason)
            elif f.gate == "fails gate":
                gate_findings.append(f)
        return gate_findings

    def first_divergence(self, first: Entry | None) -> dict[str, Any] | None:
        """Where drift entered, in the report's form (None where nothing drifted)."""
        if first is None:
            return None
        fd: dict[str, Any] = {"key": first.key, "module": first.module, "phase": first.phase,
                              "step": first.step, "call": first.call, "slot": first.slot,
                              "ratio": first.ratio, "status": first.status,
                              "where": _where(first)}
        if first.local_ratio is not None:
            fd["local_ratio"] = first.local_ratio
        fd["blame_module"] = self.blame_module(first)
        r = self.index.by_align.get(TraceKey(first.step, first.phase, first.module, first.call, first.slot))
        if fd["blame_module"] != first.module and r is not None and self.index.rerun_by(r) == fd["blame_module"]:
            fd["where"] = (f"in the code of {fd['blame_module']} that reran {first.module} outside the "
                           f"forward (a custom autograd Function's backward: a reversible or recomputed "
                           f"block), which handed it this {first.slot}")
        elif fd["blame_module"] != first.module and first.phase == "backward" \
                and self._made_inside(first):
            fd["where"] = (f"in the backward of {fd['blame_module']}, which made this tensor "
                           f"that {first.module or 'the model'} returns (a cache)")
        return fd

    def _made_inside(self, e: Entry) -> bool:
        """Whether ``e`` is a tensor a module returns that a call inside it made (a cache)."""
        r = self.index.by_align.get(TraceKey(e.step, e.phase, e.module, e.call, e.slot))
        return r is not None and bool(self.index.made_inside(r))

    def blame_module(self, e: Entry) -> str:
        """The module whose code produced the diverging tensor: a forward input is computed by
        the parent's code between its submodules."""
        r = self.index.by_align.get(TraceKey(e.step, e.phase, e.module, e.call, e.slot))
        parent = self.index.parent_of(r) if r is not None else None
        rerun = self.index.rerun_by(r) if r is not None and (
            (e.phase == "forward" and slot_is(e.slot, "input") and parent is None)
            or (e.phase == "backward" and slot_is(e.slot, "grad_output"))) else None
        if rerun is not None:
            return rerun  # the code that reran the block (a reversible layer's backward)
        if e.phase == "forward" and slot_is(e.slot, "input") and parent is not None:
            return parent.module
        if e.phase == "backward" and slot_is(e.slot, "grad_output") and parent is not None \
                and not _blamed_elsewhere(e):
            # an output gradient over the limit where the parent's own code was replayed on
            # the reference's (record/own.py): the parent's backward made it
            return parent.module
        if r is not None and self.index.made_inside(r):
            return call_of(r.step, r.meta["made_by"]).module  # the call that made the cache tensor
        return e.module


def attach_histograms(entries: list[Entry], histograms: dict[str, mx.ErrorHistogram]) -> None:
    """Error histograms (log10 |target - reference|, measured in the metrics pass) for the
    entries a reader looks at first: the first over the limit and the worst by ratio."""
    first = next((e for e in entries if e.status in (DRIFT, NONFINITE)), None)
    judged = sorted((e for e in entries if e.ratio is not None),
                    key=lambda e: -(e.ratio if e.ratio is not None and not math.isnan(e.ratio) else math.inf))
    for e in ([first] if first is not None else []) + judged[:HISTOGRAMS]:
        h = histograms.get(e.key)
        if h is not None and "histogram" not in e.details:
            e.details["histogram"] = {"edges": list(h.edges), "counts": list(h.counts),
                                      "exact": h.exact}


def _decided_by(entries: list[Entry], gate_findings: list[Finding], first: Entry | None, limit: float) -> str:
    """The sentence that decided the verdict."""
    if any(e.status in (DRIFT, NONFINITE, MISALIGNED) for e in entries) or gate_findings:
        parts = []
        cause = _semantic_cause(gate_findings, first)
        if cause is not None:
            parts.append(f"{cause.kind} in {cause.module or '(model)'} step {cause.step}: "
                         f"{cause.message}")
        if first is not None:
            parts.append(_decisive(first))
        if gate_findings:
            kinds = sorted({f.kind for f in gate_findings})
            parts.append(f"{len(gate_findings)} finding(s) fail the gate: {', '.join(kinds)}")
        n_drift = sum(e.status == DRIFT for e in entries)
        if n_drift:
            parts.append(f"{n_drift} entr{'y' if n_drift == 1 else 'ies'} above the limit")
        return "; ".join(parts)
    judged = [e for e in entries if e.status != IGNORED]  # ignored ones are not within it
    worst = max((e.ratio for e in judged if e.ratio is not None and math.isfinite(e.ratio)),
                default=0.0)
    by_control = sum(_by_control(e, e.limit if e.limit is not None else limit) for e in judged)
    control = (f"; {by_control} of them over the analytic floor but no further from the reference "
               "than the control run (a correct run at the target's precision)") if by_control else ""
    return (f"all {len(judged)} entries within the limit (worst ratio "
            f"{worst:.3g} <= {limit:g}) and no finding fails the gate{control}")


# Findings that name a defect for certain (inplace.value_mismatch compares values, which drift;
# alias.sharing_differs: tied weights trained as separate copies)
SEMANTIC = ("batchnorm.", "view.", "inplace.base_not_updated", "alias.")


def _semantic_cause(findings: list[Finding], first: Entry | None) -> Finding | None:
    """The gate-failing semantic finding that explains the failure: the first one at or before
    the first divergence's step (a defect there makes every later number suspect)."""
    for f in sorted((f for f in findings if f.kind.startswith(SEMANTIC)),
                    key=lambda f: f.step if f.step is not None else -1):
        if first is None or f.step is None or f.step <= first.step:
            return f
    return None


def _ignored_words(entries: list[Entry], findings: list[Finding]) -> str:
    """What the policy's ignore rules took out of the verdict, with their reasons (shown on every
    surface, since the verdict sentence is)."""
    reasons: dict[str, list[int]] = {}
    for e in entries:
        if e.status == IGNORED:
            reasons.setdefault(e.rule or "ignore rule", [0, 0])[0] += 1
    for f in findings:
        if f.gate == "ignored":
            reasons.setdefault((f.details or {}).get("ignored") or "ignore rule", [0, 0])[1] += 1
    if not reasons:
        return ""
    n_e = sum(v[0] for v in reasons.values())
    n_f = sum(v[1] for v in reasons.values())
    what = " and ".join(x for x in (f"{n_e} entr{'y' if n_e == 1 else 'ies'}" if n_e else "",
                                   f"{n_f} finding{'' if n_f == 1 else 's'}" if n_f else "") if x)
    shown = "; ".join(f"{r!r}: {a + b}" for r, (a, b) in list(reasons.items())[:3])
    more = f"; +{len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
    return f"; ignored by the policy: {what} ({shown}{more})"


def _by_control(e: Entry, limit: float) -> bool:
    """Whether the control run passed this entry over its analytic (or local) floor."""
    d = e.details or {}
    local = d.get("local") or {}
    return (e.decided_by == "control" and d.get("analytic_ratio", 0.0) > limit) or \
        ((local.get("control") or {}).get("analytic_ratio", 0.0) > limit and local.get("status") == OK)


def _decisive(e: Entry) -> str:
    """The first divergence in words, with the number that failed and where it came from: the
    local replay's ratio when the propagated one is within the limit, else the propagated (or
    truth-judged) ratio."""
    where = f"{e.module or '(model)'} {e.phase} step {e.step} {e.slot}"
    if e.status == NONFINITE:
        return f"{where} has NaN/Inf the reference lacks"
    if e.ratio is not None and e.limit is not None and e.ratio <= e.limit and e.local_ratio is not None:
        how = ("the step redone ideally from the target's own parameter, gradient and state"
               if e.phase == "optimizer" else "the module's own error replayed on the reference's inputs")
        return (f"{where}: local ratio {_fmt_ratio(e.local_ratio)} > limit {e.limit:g} ({e.rule}, "
                f"{how}; propagated ratio {_fmt_ratio(e.ratio)} is within it)")
    source = {"truth": "truth run", "control": "and the control run drifts less"}.get(
        e.decided_by or "", "propagated")
    return f"{where}: ratio {_fmt_ratio(e.ratio)} > limit {e.limit:g} ({e.rule}, {source})"


def _blamed_elsewhere(e: Entry) -> bool:
    """Whether no local replay of the entry's maker (a composite's own code) objects to it."""
    local = (e.details or {}).get("local")
    return local is None or local["status"] == OK


def _blamed(e: Entry) -> bool:
    """Whether the entry's own module (not what it inherited) put it over the limit."""
    local = (e.details or {}).get("local")
    return local is None or local["status"] != OK


def _where(e: Entry) -> str:
    """Say in words where drift entered."""
    mod = e.module or "the model"
    if e.phase == "forward" and slot_is(e.slot, "input"):
        return (f"in the code of the parent of {mod} that computes its input {e.slot} "
                "(between submodules)")
    if e.phase == "forward":
        return f"in the forward of {mod}"
    if e.phase == "backward" and slot_is(e.slot, "grad_input"):
        return f"in the backward of {mod}"
    if e.phase == "backward":
        return f"in the backward of the code that consumes the output of {mod}"
    if e.phase == "grads":
        return f"in the weight gradient of {mod}"
    if e.phase == "optimizer" and slot_is(e.slot, "buffer"):
        return f"in the buffers of {mod} after the step (they are updated by its forward)"
    if e.phase == "optimizer":
        return f"in the optimizer update of {mod}"
    if e.phase == "params":
        return f"in the initial state of {mod} (replayed weights differ beyond the cast)"
    return f"in the {e.phase} of {mod}"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else ("inf" if math.isinf(r) else f"{r:.3g}")

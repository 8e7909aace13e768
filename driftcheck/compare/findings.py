"""Findings: what compare reports besides drift (alignment, the traces' own findings, fp8
casts, NaN/Inf origin, precision settings, view events), and the log they are kept in.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from driftcheck.compare import normalization
from driftcheck.compare.aliasing import explain_extras, sharing_findings
from driftcheck.compare.entries import TraceEntry, gradient_slot
from driftcheck.compare.index import Call
from driftcheck.compare.propagation import Propagated
from driftcheck.compare.roundoff import autocast_roundoff
from driftcheck.gate.report import NONFINITE, OK, Entry, Finding
from driftcheck.numerics import dtypes
from driftcheck.store.keys import TraceKey, is_local_slot
from driftcheck.store.reader import TraceReader
from driftcheck.targets.settings_diff import diff_settings

EntryMap = dict[TraceKey, TraceEntry]


class FindingLog:
    """The comparison's findings in the order they were made (the report's order)."""

    def __init__(self) -> None:
        self.items: list[Finding] = []

    def add(self, finding: Finding) -> Finding:
        self.items.append(finding)
        return finding

    def extend(self, findings: Iterable[Finding]) -> None:
        self.items.extend(findings)

    def has(self, kind: str, module: str) -> bool:
        """Whether a finding of ``kind`` on ``module`` was made already."""
        return any(f.kind == kind and f.module == module for f in self.items)


class Findings:
    """What the two traces show besides drift, added to ``log`` (the judge adds its own)."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, log: FindingLog,
                 control: TraceReader | None = None) -> None:
        self.ref, self.tgt, self.log, self.control = ref, tgt, log, control

    def alignment(self, ref_map: EntryMap, tgt_map: EntryMap) -> None:
        """Entries one run holds and the other does not (a compiled run's capture gaps are
        warnings; the gradients of inputs a module returns are taken out of ``tgt_map``)."""
        missing: dict[str, list[TraceEntry]] = defaultdict(list)
        extra: dict[str, list[TraceEntry]] = defaultdict(list)
        for k, e in ref_map.items():
            if k not in tgt_map:
                missing[e.module].append(e)
        for k, e in tgt_map.items():
            if k not in ref_map:
                extra[e.module].append(e)
        compiled = bool(self.ref.run.get("compile") or self.tgt.run.get("compile"))
        calls = [{Call(e.step, e.module, e.call) for e in m.values() if e.phase == "forward"}
                 for m in (ref_map, tgt_map)]
        # Entries one side of a compiled comparison holds and the other cannot: warnings, not
        # judged. (kind, which entries, why)
        rules: tuple[tuple[str, Callable[[list[TraceEntry], set[Call]], bool], str], ...] = (
                 ("compile.input_gap", lambda es, other: _inputs_of(es, other),
                  "input(s) of calls both runs made exist only on the {held}: compiled code may "
                  "pass a tensor where eager code passes None (Hugging Face models build their "
                  "attention mask while Dynamo traces); not judged, the call's outputs are"),
                 ("compile.capture_gap", lambda es, other: _gradients_only(es),
                  "gradient tensor(s) of this module exist only on the {held}: a compiled run's "
                  "capture did not get them (a gradient computed inside a compiled graph that no "
                  "hook sees, docs/compile.md); not judged"))
        if compiled:
            self.returned_inputs(ref_map, tgt_map)
        for kind, applies, why in rules if compiled else ():
            for side, gaps, other in (("target", missing, calls[1]), ("reference", extra, calls[0])):
                held = "reference" if side == "target" else "target"
                for mod in [m for m, es in gaps.items() if applies(es, other)]:
                    es = gaps.pop(mod)
                    self.log.add(Finding(
                        kind, mod, es[0].step, f"{len(es)} " + why.format(held=held)
                        + f" (e.g. {es[0].key})", phase=es[0].phase, key=es[0].key,
                        severity="warning", details={"count": len(es), "keys": [x.key for x in es[:10]],
                                                     "missing_on": side}))
        for mod, es in missing.items():
            self.log.add(Finding(
                "alignment.missing_in_target", mod, es[0].step,
                f"{len(es)} tensor(s) recorded on the reference are missing on the target "
                f"(e.g. {es[0].key}): the target skipped or renamed this module, or the two "
                "runs captured different phases/steps", phase=es[0].phase, key=es[0].key,
                details={"count": len(es), "keys": [x.key for x in es[:10]]}))
        for mod, es in extra.items():
            self.log.add(Finding(
                "alignment.extra_in_target", mod, es[0].step,
                f"{len(es)} tensor(s) exist only on the target (e.g. {es[0].key}): the target "
                "ran a module or call the reference did not", phase=es[0].phase,
                key=es[0].key, details={"count": len(es), "keys": [x.key for x in es[:10]]}))

    def layout(self) -> None:
        """A data-parallel side's loss normalized over each rank's own count (compare/normalization.py)."""
        found = normalization.finding(self.ref, self.tgt)
        if found is not None:
            self.log.add(found)

    def returned_inputs(self, ref_map: EntryMap, tgt_map: EntryMap) -> None:
        """A compiled comparison does not judge the gradients of an input that its module returns
        unchanged as one of its outputs (torchvision's LastLevelMaxPool appends to the list it is
        given and returns it): eager capture takes the input gradient of the module's own
        operations and the output gradient of the whole tensor, a compiled capture's views split
        them where the tensor is handed in and out. Taken out of the target's map (so nothing
        inherits from them) and reported."""
        calls: dict[Call, tuple[list[TraceEntry], list[TraceEntry]]] = defaultdict(lambda: ([], []))
        for e in ref_map.values():
            if e.phase == "forward" and e.stats:
                calls[Call(e.step, e.module, e.call)][e.slot_is("output")].append(e)
        gone: dict[str, list[TraceEntry]] = defaultdict(list)
        for (step, module, call), (ins, outs) in calls.items():
            same = [(x, o) for x in ins for o in outs if o.shape == x.shape and o.stats == x.stats]
            slots = {gradient_slot(x.slot) for x, _ in same} | {gradient_slot(o.slot) for _, o in same}
            for slot in sorted(slots):
                a = TraceKey(step, "backward", module, call, slot)
                if a in tgt_map and a in ref_map:
                    del tgt_map[a]
                    gone[module].append(ref_map[a])
        for mod, es in gone.items():
            self.log.add(Finding(
                "compile.capture_gap", mod, es[0].step,
                f"{len(es)} gradient(s) of this module not judged: it returns an input unchanged "
                "as one of its outputs, whose gradients eager capture takes whole and a compiled "
                f"capture splits where the tensor is handed in and out (docs/compile.md) (e.g. "
                f"{es[0].key})", phase=es[0].phase, key=es[0].key, severity="warning",
                details={"count": len(es), "keys": [x.key for x in es[:10]],
                         "missing_on": "neither: an input returned as an output"}))

    def of_traces(self, errors: Mapping[TraceKey, Propagated]) -> None:
        """The findings each trace recorded (the reference's as warnings), parameters and
        buffers whose sharing differs, its fp8 casts, and its view events against the other's
        (within ``errors``' drift)."""
        for side, reader in (("target", self.tgt), ("reference", self.ref)):
            for f in reader.manifest.get("findings", []) or []:
                if not isinstance(f, dict) or "kind" not in f:
                    continue
                finding = Finding(**{k: v for k, v in f.items() if k in Finding.__dataclass_fields__})
                if side == "reference":
                    finding.severity = "warning"
                    finding.message = "the reference run itself: " + finding.message
                finding.details = dict(finding.details or {}, side=side)
                self.log.add(finding)
        first = min((e.get("step", 0) for e in self.ref.manifest.get("entries") or []), default=0)
        untying = sharing_findings(self.ref.manifest, self.tgt.manifest, first)
        explain_extras(self.log.items, untying)
        self.log.extend(untying)
        self.fp8()
        ref_ev = self.ref.manifest.get("view_events")
        tgt_ev = self.tgt.manifest.get("view_events")
        blind = any(isinstance(f, dict) and f.get("kind") == "view.audit_unobservable"  # unseen side
                    for r in (self.ref, self.tgt) for f in r.manifest.get("findings") or [])
        if ref_ev and tgt_ev and not blind:
            from driftcheck.audit import views

            found = views.compare_events(ref_ev, tgt_ev, view_tolerance(self.ref.run, self.tgt.run, errors))
            self.log.extend(self._as_control_shows(found, views, ref_ev, errors))

    def _as_control_shows(self, found: list[Finding], views: Any, ref_ev: Any,
                          errors: Mapping[TraceKey, Propagated]) -> list[Finding]:
        """The view/in-place findings the control run shows too (the same kind in the same
        module at the same step, against the same reference) are the precision's doing: the
        model's code at that precision (an ``x.to(dtype)`` that is the tensor itself in float32
        and a copy in bfloat16, written into), not the target's. They become warnings."""
        ctl_ev = self.control.manifest.get("view_events") if self.control is not None else None
        if not found or not ctl_ev or self.control is None:
            return found
        shown = {(f.kind, f.module, f.step) for f in views.compare_events(
            ref_ev, ctl_ev, view_tolerance(self.ref.run, self.control.run, errors))}
        dtype = str(self.control.run.get("dtype") or "the target's precision")
        for f in found:
            if (f.kind, f.module, f.step) in shown and f.severity != "warning":
                f.severity = "warning"
                f.message = (f"the control run (the reference device at {dtype}) shows it too: the "
                             f"precision's doing in the model's code, not the target's: {f.message}")
                f.details = dict(f.details or {}, control="shows it too")
        return found

    def fp8(self) -> None:
        """Summarise the target's fp8 casts (amax, scale, flushed and saturated fractions)."""
        casts = [c for c in (self.tgt.manifest.get("fp8") or []) if isinstance(c, dict)]
        if not casts:
            return
        def worst(key: str) -> dict[str, Any]:
            return max(casts, key=lambda c: c.get(key) or 0.0)
        flushed, saturated = worst("flushed_fraction"), worst("saturated_fraction")
        recipe = (self.tgt.run.get("precision") or {}).get("fp8") or self.tgt.run.get("fp8")
        self.log.add(Finding(
            "precision.fp8_casts", "", None,
            f"{len(casts)} fp8 casts (recipe {recipe}): at most "
            f"{100 * (flushed.get('flushed_fraction') or 0):.2g}% of a tensor flushed to zero "
            f"({flushed.get('module')} {flushed.get('role')}), at most "
            f"{100 * (saturated.get('saturated_fraction') or 0):.2g}% saturated "
            f"({saturated.get('module')} {saturated.get('role')})", severity="warning",
            details={"casts": casts[:500]}))
        for c in casts:
            if (c.get("saturated_fraction") or 0) > 0:
                self.log.add(Finding(
                    "precision.fp8_saturation", c.get("module", ""), c.get("step"),
                    f"{c.get('role')} of {c.get('module')} saturated in {c.get('format')}: "
                    f"{100 * c['saturated_fraction']:.3g}% of {c.get('numel')} values clipped at the "
                    f"format's max (scale {c.get('scale'):.3g}, amax {c.get('amax'):.3g}); delayed "
                    "scaling lags a growing amax: use current scaling or a longer margin",
                    severity="warning", details=dict(c)))

    def nonfinite(self, entries: list[Entry]) -> None:
        """Where NaN/Inf first appear on the target only; where the reference itself has them."""
        first = next((e for e in entries if e.status == NONFINITE), None)
        if first is not None:
            self.log.add(Finding(
                "nonfinite.origin", first.module, first.step,
                f"NaN/Inf first appears on the target at {first.key} "
                f"({first.metrics.get('nonfinite_new')} element(s)) where the reference is finite: "
                "look for an overflow (bf16/fp16 range, fp8 saturation) or a bad kernel here",
                phase=first.phase, key=first.key))
        bad_ref = next((e for e in entries
                        if (e.metrics.get("nan_ref") or 0) + (e.metrics.get("inf_ref") or 0) > 0), None)
        if bad_ref is not None:
            self.log.add(Finding(
                "nonfinite.reference", bad_ref.module, bad_ref.step,
                f"the reference itself has NaN/Inf at {bad_ref.key}: drift after it cannot be "
                "judged; fix the reference run first", phase=bad_ref.phase, key=bad_ref.key,
                severity="warning"))

    def model_sensitivity(self, entries: list[Entry], control: TraceReader | None,
                          maker: Callable[[Entry], str]) -> None:
        """Where the control run (the reference device at the target's precision) drifts beyond
        the analytic floor as far as the target does: the model's own code computes something
        else at that precision there (a constant that absorbs a small addend, a weight computed
        in the stream's dtype). Named per module, first entry each, as the model's sensitivity
        to the precision, never as a defect of the target. ``maker``: the module whose code
        made an entry's tensor (a forward input: its parent's)."""
        if control is None:
            return
        dtype = str(control.run.get("dtype") or "the target's precision")
        self.control_kernels(entries, dtype)
        seen: set[str] = set()
        for e in entries:
            got = _control_rescued(e)
            module = maker(e) if got is not None else ""
            if got is None or module in seen:
                continue
            seen.add(module)
            which, c = got
            self.log.add(Finding(
                "precision.model_sensitive", module, e.step,
                f"{e.key}: the control run (the reference device at {dtype}) is "
                f"{c['control_ratio']:.3g}x the {which} noise floor here too, and the target no further "
                f"from the reference than {c['m']:g}x the control: the precision's doing in "
                f"{module or '(model)'}'s code (code that computes something else at {dtype}, or a "
                "pattern the analytic floor does not model), not a defect of the target",
                phase=e.phase, key=e.key, severity="warning",
                details={"which": which, "control_ratio": c["control_ratio"],
                         "err_control": c["err_control"], "err_target": c["err_target"]}))
            if len(seen) >= 8:
                break

    def control_kernels(self, entries: list[Entry], dtype: str) -> None:
        """Where the control's own kernel is off (compare/opinions.py ``_control_kernel``): the
        control gave no word there, named per module (warning)."""
        seen: set[str] = set()
        for e in entries:
            d = e.details or {}
            k = next((c["kernel"] for c in (d.get("control"), (d.get("local") or {}).get("control"))
                      if c and c.get("kernel")), None)
            if k is None or e.module in seen:
                continue
            seen.add(e.module)
            self.log.add(Finding(
                "precision.control_kernel", e.module, e.step,
                f"{e.key}: the control run's own kernel (the reference device at {dtype}) is "
                f"{k['ratio']:.3g}x the limit's share off what rounding this op's operands to {dtype} "
                "explains: no correct run here, so it vouches for nothing at this module (check that "
                "device's kernels: bench/kernel_check.py)",
                phase=e.phase, key=e.key, severity="warning", details=dict(k)))

    def precision(self) -> None:
        """The precision settings that differ between the runs (they explain drift)."""
        rp, tp = self.ref.run.get("precision") or {}, self.tgt.run.get("precision") or {}
        diffs = [(k, a, b) for k, a, b, explains in diff_settings(rp, tp) if explains]
        if diffs:
            shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:6])
            more = f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""
            self.log.add(Finding(
                "precision.settings_differ", "", None,
                f"{len(diffs)} precision setting(s) differ between the runs: {shown}{more}. "
                "They explain drift; the noise floor accounts for dtype, TF32, matmul precision "
                "and fp8, and for other reduction orders (threads, CPU kernels) by its sqrt(K) "
                "terms", severity="warning",
                details={"settings": [{"setting": k, "reference": a, "target": b} for k, a, b in diffs]}))


def _control_rescued(e: Entry) -> tuple[str, dict[str, Any]] | None:
    """("analytic" or "local", the control's opinion) where the control passed an entry whose
    analytic (or local) floor it is itself far over; None elsewhere."""
    d = e.details or {}
    limit = e.limit if e.limit is not None else math.inf
    c = d.get("control")
    if e.decided_by == "control" and c and c.get("control_ratio", 0.0) > limit:
        return "analytic", c
    lc = (d.get("local") or {}).get("control")
    if lc and lc.get("control_ratio", 0.0) > limit and (d.get("local") or {}).get("status") == OK:
        return "local", lc
    return None


VIEW_TOLERANCE_CAP = 0.5  # a write that lands wrong changes its base by O(1)


def view_tolerance(ref_run: dict[str, Any], tgt_run: dict[str, Any],
                   errors: Mapping[TraceKey, Propagated]) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    """The accepted relative difference of a base after a write through a view: 8 unit
    roundoffs of the coarser precision either run computed in (its dtype, or its autocast
    dtype), plus the largest relative error this comparison measured at that step: the values
    written are computed upstream and carry its drift (an fp32 target with a defect elsewhere,
    autocast), which is not the view's doing. Capped: a write that lands wrong still shows."""
    us = []
    for run in (ref_run, tgt_run):
        us += [dtypes.unit_roundoff(str(run.get("dtype") or "float32")), autocast_roundoff(run)]
    drift: dict[int | None, float] = {}  # by step (a view event may have none)
    for (step, phase, *_), err in errors.items():
        if phase in ("forward", "backward", "loss"):
            drift[step] = max(drift.get(step, 0.0), min(err.rel_rms * err.mu, 1.0))
    base = 8 * max(us)

    def tolerance(r: dict[str, Any], t: dict[str, Any]) -> float:
        return min(base + 2.0 * drift.get(r.get("step"), 0.0), max(base, VIEW_TOLERANCE_CAP))
    return tolerance


def _inputs_of(entries: list[TraceEntry], calls: set[Call]) -> bool:
    """Only forward inputs of module calls that the other run made too."""
    return all(e.phase == "forward" and e.slot_is("input") and Call(e.step, e.module, e.call)
               in calls for e in entries)


def _gradients_only(entries: list[TraceEntry]) -> bool:
    """Only a module call's output or input gradients (``backward``), none of its own values."""
    return all(e.phase == "backward" and not is_local_slot(e.slot) for e in entries)

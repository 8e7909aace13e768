"""Judging one entry: its measured error against its floor, with the error it inherits, the
local replay and the truth run where recorded, integers exactly.

The pipeline of a float entry (:meth:`Judge.judge`): measure the pair; size it (:class:`Scale`)
and record what it passes on; inherit its dependencies' error (inheritance.py); its unit
roundoff (roundoff.py) and allowances (allowances.py); the floor (numerics/floor.py); kink
flips counted (kinks.py) and sparse errors passed on in stats mode; the second opinions
(opinions.py); the status.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from driftcheck.compare.alignment import Alignment
from driftcheck.compare.allowances import Allowances
from driftcheck.compare.decisions import Decisions
from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.findings import FindingLog
from driftcheck.compare.inheritance import Inherit, Inheritance, Scale
from driftcheck.compare.kinks import Kinks
from driftcheck.compare.magnitude import Magnitudes
from driftcheck.compare.measure import Measurer, rms_of
from driftcheck.compare.norms import Norms
from driftcheck.compare.opinions import Opinions
from driftcheck.compare.products import Products
from driftcheck.compare.propagation import NONE, WRONG, Ledger, Propagated
from driftcheck.compare.roundoff import Roundoff
from driftcheck.compare.scale import Scales
from driftcheck.gate.policy import Policy
from driftcheck.gate.report import DRIFT, IGNORED, MISALIGNED, NONFINITE, OK, Entry, Finding
from driftcheck.numerics import dtypes, floor as fl, metrics as mx
from driftcheck.store.keys import TraceKey

FLIPS_EXPECTED = 0.5  # kink flips a gradient is expected to hold from which one is allowed its max


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured pair being judged: the entries, their metrics and size, the policy's word."""

    r: TraceEntry  # the reference's entry
    t: TraceEntry  # the target's
    m: dict[str, Any]  # the measured metrics
    how: str  # what they were measured on: "full", "sample" or "stats"
    scale: Scale
    base: dict[str, Any]  # the report Entry's identity fields and limit
    details: dict[str, Any]  # the report Entry's details, filled as judged
    limit: float
    rule: str
    ignore: str | None  # the policy's ignore reason, if any


class Judge:
    """Judges the reference's entries in execution order against the target's, recording in
    ``ledger`` what each passes on to the entries judged after it."""

    def __init__(self, *, policy: Policy, limit_override: float | None, alignment: Alignment,
                 ledger: Ledger, findings: FindingLog, measurer: Measurer, roundoff: Roundoff,
                 magnitudes: Magnitudes, norms: Norms, kinks: Kinks, decisions: Decisions,
                 scales: Scales, inheritance: Inheritance, allowances: Allowances, opinions: Opinions,
                 whole: Mapping[TraceKey, tuple[float, float]] | None = None,
                 products: Products | None = None) -> None:
        self.policy, self.limit_override = policy, limit_override
        self.index, self.ledger, self.findings = alignment.index, ledger, findings
        self.measurer, self.roundoff, self.magnitudes, self.norms = measurer, roundoff, magnitudes, norms
        self.kinks, self.decisions, self.scales = kinks, decisions, scales
        self.inheritance, self.allowances, self.opinions = inheritance, allowances, opinions
        self.products = products
        # align key -> (rel rms, rel max) of the whole tensor this rank holds a shard of (FSDP):
        # what its dependents inherit (driftcheck/compare/ranks.py measures it over the ranks)
        self.whole = whole or {}
        self.histograms: dict[str, mx.ErrorHistogram] = {}  # entry key -> its error histogram

    def judge(self, r: TraceEntry, t: TraceEntry) -> Entry:
        """The reference's entry ``r`` against the target's ``t``, judged."""
        limit, rule = self.policy.limit_for(r.module, r.phase)
        if self.limit_override is not None:
            limit, rule = self.limit_override, f"--limit {self.limit_override:g}"
        base = dict(key=r.key, module=r.module, phase=r.phase, step=r.step,
                    call=r.call, slot=r.slot, order=r.order, limit=limit)
        misaligned = self.misaligned(r, t, base, rule)
        if misaligned is not None:
            return misaligned
        m, how, hist = self.measurer.pair_metrics(r, t)
        if hist is not None:
            self.histograms[r.key] = hist
        details: dict[str, Any] = {"ref_stats": r.stats, "tgt_stats": t.stats,
                                   "ref_dtype": r.dtype, "tgt_dtype": t.dtype,
                                   "measured_on": how}
        if r.meta.get("module_type"):
            details["module_type"] = r.meta["module_type"]
        scale = self.scale_of(r, m, details)
        self.pass_on(r, t, m, how, scale)
        ignore = self.policy.ignore_reason(r.module, r.phase, r.step)
        if not dtypes.is_float(r.dtype):
            return self.decisions.judge_integer(r, m, base, details, ignore)
        return self.judge_float(Case(r, t, m, how, scale, base, details, limit, rule, ignore))

    def misaligned(self, r: TraceEntry, t: TraceEntry, base: dict[str, Any], rule: str) -> Entry | None:
        """A pair of other shapes or kinds (or None): what depends on it inherits a full error;
        a shape that follows a decision which flipped on near ties is no defect."""
        if list(r.shape) != list(t.shape):
            self.ledger.errors[r.align] = WRONG
            flip = self.decisions.rerouted(r, t)
            if flip is not None:
                self.decisions.note_rerouted(r, t, flip)
                return Entry(**base, metrics={}, floor=None, ratio=None, status=OK,
                             rule=f"shape follows {flip}, which flipped on near ties")
            self.findings.add(Finding(
                "alignment.shape_mismatch", r.module, r.step,
                f"{r.key}: reference shape {r.shape}, target shape {t.shape}",
                phase=r.phase, key=r.key))
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        if dtypes.measure_kind(r.dtype) != dtypes.measure_kind(t.dtype):
            self.findings.add(Finding(
                "alignment.dtype_mismatch", r.module, r.step,
                f"{r.key}: reference dtype {r.dtype}, target dtype {t.dtype} (not both "
                "integer, both real or both complex)", phase=r.phase, key=r.key))
            self.ledger.errors[r.align] = WRONG
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        return None

    def scale_of(self, r: TraceEntry, m: dict[str, Any], details: dict[str, Any]) -> Scale:
        """The entry's size. The operand magnitude (|A||B| in its probabilistic form), never
        below the value itself: where terms cancel (a key bias's gradient is exactly zero in
        exact arithmetic) the rounding error scales with the terms, not with their tiny sum."""
        ref_rms = m.get("ref_rms") or 0.0
        ref_max = m.get("ref_absmax") or r.stats.get("absmax") or 0.0
        mag = max(r.meta.get("mag_rms") or 0.0, self.magnitudes.magnitude(r))
        gain, gain_max = self.norms.gain(r)
        if gain > 1.0:
            details["norm_gain"] = gain
        scale_rms = max(ref_rms, mag, self.norm_unit(r))
        scale_max = ref_max * (scale_rms / ref_rms if ref_rms > 0 else 1.0)
        if not ref_max and scale_rms:
            # The reference is exactly zero (terms that cancel exactly: a gradient over two
            # mirrored samples) where its terms are not: the target's rounding of them is noise
            # of rms scale_rms, whose largest of n elements is ~sqrt(2 ln n) times that.
            n = max(int(r.stats.get("numel") or 0), 2)
            scale_max = scale_rms * math.sqrt(2.0 * math.log(n))
        return Scale(ref_rms, ref_max, scale_rms, scale_max, gain, gain_max)

    def norm_unit(self, r: TraceEntry) -> float:
        """A mean-subtracting norm's output is gamma (x - mean) / sqrt(var + eps) + beta: its
        rounding of x - mean, u |x|, comes out as u |x| / sqrt(var + eps) |gamma|, the gain times
        gamma, whatever the output's own size. Where a group's spread is below eps (a GroupNorm
        of one channel a group over a 1x1 map: x - mean is rounding noise) the output is that
        noise, far below gamma (hf_deformable_detr's input projection, 1.4e5 with 2 threads).
        The rms of the norm's weight (1 without one) for its forward output; 0 elsewhere."""
        if not (r.phase == "forward" and r.slot_is("output") and r.meta.get("norm_dims")
                and not r.meta.get("norm_rms")):
            return 0.0
        w = self.index.by_align.get(TraceKey(r.step, "params", r.module, 0, "param.weight"))
        return rms_of(w.stats) if w is not None else 1.0

    def pass_on(self, r: TraceEntry, t: TraceEntry, m: dict[str, Any], how: str, scale: Scale) -> None:
        """Record what the entry passes on: its error relative to its scale (and absolute)."""
        a = r.align
        e_rms, e_max = m.get("rms", 0.0), m.get("max_abs", 0.0)
        if how != "full" and not (r.meta.get("stats_from_sample") or t.meta.get("stats_from_sample")):
            # What is passed on is at least the gap of the two runs' whole-tensor rms (absmax):
            # a sample can miss the few rows that carry the error (a Linear before a BatchNorm
            # over two values, timm_levit in stats mode: its Adam moments at 27-422). Not where a
            # side's statistics are themselves estimated from its sample (a sum or mean over
            # ranks, compare/parts.py): their gap is the estimate's, not the runs'.
            e_rms = max(e_rms, abs(rms_of(t.stats) - rms_of(r.stats)))
            e_max = max(e_max, abs((t.stats.get("absmax") or 0.0) - (r.stats.get("absmax") or 0.0)))
        errors = self.ledger.errors
        errors[a] = Propagated(fl.relative(e_rms, scale.rms), fl.relative(e_max, scale.max), e_rms, e_max,
                               scale.rms / scale.ref_rms if scale.ref_rms > 0 else 1.0)
        if m.get("nonfinite_new") or m.get("nonfinite_mismatch"):
            # NaN/Inf where the reference is finite: whatever depends on it can be anything
            # (its metrics only see the finite positions); nonfinite.origin names the source.
            errors[a] = errors[a]._replace(rel_rms=fl.REL_CAP, rel_max=fl.REL_CAP)
        if a in self.whole:
            # A shard (FSDP): the module computes with the whole tensor, whose other shards
            # (other ranks) may carry more of the error than this one.
            w_rms, w_max = self.whole[a]
            e = errors[a]
            errors[a] = e._replace(rel_rms=max(e.rel_rms, w_rms), rel_max=max(e.rel_max, w_max))

    def judge_float(self, c: Case) -> Entry:
        """A float entry against its floor (the module docstring's pipeline)."""
        r, t, m, how, scale, details = c.r, c.t, c.m, c.how, c.scale, c.details
        deps = self.index.dependencies(r)
        inh = [self.ledger.errors.get(d.align, NONE) for d in deps]
        inh_rms, inh_max = self.inheritance.inherited(Inherit(r, how, deps, inh, scale, details))
        flipped = self.decisions.flip_sparse(deps) if how != "full" else 0.0
        if flipped:
            # rows looked up by indices that flipped (a sample shows few): whole rows swapped
            details["flip_estimate"] = flipped
            inh_rms, inh_max = max(inh_rms, flipped), max(inh_max, fl.REL_CAP)
        u, u_acc = self.roundoff.of(r, t)
        logits = self.scales.logit_max(r)
        extra_rms, extra_max = self.allowances.extra(r, t, how, u, logits, scale, details)
        k = self.terms(r)
        # A norm subtracting a mean far above the spread amplifies its input's error (and its
        # own rounding of x - mean) by rms/std: the floor's scale, not the value passed on.
        fi = fl.FloorInputs(u=u, u_acc=u_acc, k=k, scale_rms=scale.rms * scale.gain,
                            scale_max=scale.max * scale.gain_max, inherited_rms=inh_rms, inherited_max=inh_max,
                            extra_rms=extra_rms, extra_max=extra_max,
                            tiny=max(dtypes.tiny(r.dtype), dtypes.tiny(t.dtype)))
        f = fl.floor(fi)
        fi, f = self.weight_difference(c, fi, f)
        if r.phase == "optimizer":
            self.ledger.floors[r.align] = (f.rms, f.max)
        judged = self.flips_judged(c, f)
        ratio = f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        if how != "full":
            self.pass_on_sparse(c, judged, inh, flipped)
        if judged is not m:
            details["kink_flips"] = judged["kink_flips"]
            if judged["kink_flips"]["unexplained"]:
                ratio = math.inf
        details["analytic_ratio"] = ratio
        details_floor = {"rms": f.rms, "max": f.max, "local_rms": f.local_rms,
                         "inherited_rms": f.inherited_rms, "u": u, "k": k,
                         "scale_rms": scale.rms, "inherited_rel": fi.inherited_rms}
        if logits > 1.0:
            details_floor["softmax_logit_max"] = logits
        return self.decide(c, fi, f, ratio, details_floor, deps)

    def weight_difference(self, c: Case, fi: fl.FloorInputs, f: fl.Floor) -> tuple[fl.FloorInputs, fl.Floor]:
        """A product over its floor after a step: what its weight's difference makes of the
        reference's operand, exactly (compare/products.py), is inherited too; computed only
        where the floor without it objects."""
        r, m = c.r, c.m
        if self.products is None or not Products.applies(r, c.how) \
                or f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) <= 1.0:
            return fi, f
        got = self.products.inherited(r)
        if got is None or not (fi.scale_rms > 0 and fi.scale_max > 0):
            return fi, f
        rel = (got[0] / fi.scale_rms, got[1] / fi.scale_max)
        if rel[0] <= fi.inherited_rms and rel[1] <= fi.inherited_max:
            return fi, f
        c.details["weight_difference"] = {"rms": got[0], "max": got[1]}
        fi = dataclasses.replace(fi, inherited_rms=max(fi.inherited_rms, rel[0]),
                                 inherited_max=max(fi.inherited_max, rel[1]))
        return fi, fl.floor(fi)

    def terms(self, r: TraceEntry) -> int | None:
        """K, the terms the entry's own sum adds (the floor's accumulation growth sqrt(K))."""
        if r.phase == "grads":
            k: int | None = r.meta.get("k") or self.magnitudes.grad_terms(r)
        elif r.phase == "backward" and r.slot_is("grad_output"):
            k = self.magnitudes.consumer_terms(r)  # made by the code that consumed the output, not by this module
        else:
            k = r.meta.get("k") or self.norms.k(r)
        return k

    def flips_judged(self, c: Case, f: fl.Floor) -> dict[str, Any]:
        """The metrics judged: kink flips counted out of a gradient over its floor. A kink
        inside the module (nn.ReLU) shows in its input gradient; one applied to its output by
        the code around it (F.relu, x.relu() between two Linears) in its output's."""
        r, t, m, how = c.r, c.t, c.m, c.how
        if how in ("full", "sample") and r.phase == "backward" and r.slot_is("grad_input", "grad_output") \
                and f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) > 1.0:
            return self.kinks.flips(r, t, m, f.max, "tensor" if how == "full" else "sample")
        return m

    def pass_on_sparse(self, c: Case, judged: dict[str, Any], inh: list[Propagated], flipped: float) -> None:
        """Sparse errors (kink flips) that a sample rarely holds: estimated where they enter,
        then passed on to everything measured on samples downstream, as measured errors are in
        full mode (a layer's gradient sums over the flips of the one above)."""
        r, details = c.r, c.details
        sparse = max(max((x.sparse for x in inh), default=0.0), flipped)
        flip_max = max((x.sparse_max for x in inh), default=0.0)
        if r.phase == "backward" and r.slot_is("grad_input", "grad_output"):
            flips = self.kinks.estimate(r, judged.get("kink_flips"))
            if flips:
                details["kink_estimate"] = flips
                sparse = max(sparse, flips)
                if flips * flips * (r.stats.get("numel") or 0) >= FLIPS_EXPECTED:
                    # A flipped element's error is its whole gradient, an element like any
                    # other (the gradient does not know where its input was): the rms of
                    # the gradient, not the rms share sqrt(p) of all flips, is its largest
                    # error (tv_mobilenet_v2 between 1 and 2 threads: 2 flips of a ReLU6 at
                    # 26% of the gradient's absmax, its conv's input gradient at 5.1).
                    flip_max = max(flip_max, fl.relative(rms_of(r.stats), r.stats.get("absmax") or 0.0))
        if r.phase == "optimizer" and r.slot_is("param"):
            signs = self.scales.update_sign_flips(r, c.scale.ref_rms)
            if signs:
                details["update_flip_estimate"] = signs
                sparse = max(sparse, signs)
        if sparse:
            e = self.ledger.errors[r.align]
            self.ledger.errors[r.align] = e._replace(rel_rms=max(e.rel_rms, sparse),
                                                     rel_max=max(e.rel_max, sparse, flip_max), sparse=sparse,
                                                     sparse_max=flip_max)

    def decide(self, c: Case, fi: fl.FloorInputs, f: fl.Floor, ratio: float,
               details_floor: dict[str, Any], deps: list[TraceEntry]) -> Entry:
        """The entry's status: over the limit (the analytic ratio, or the truth run's or the
        control run's where more lenient), or its module's own error over it (the local
        replay, the control's local replay where recorded); ignored by the policy."""
        r, t, m, details, limit, ignore = c.r, c.t, c.m, c.details, c.limit, c.ignore
        decided_by = "analytic"
        truth = self.opinions.truth_run(r, t, fi, limit)
        if truth is not None:
            details["truth"] = truth
            # Both judges must object (see docs/diagnosis.md): the entry's ratio is the more
            # lenient of the two, and the judge that gave it decided.
            if truth["ratio"] < ratio:
                ratio, decided_by = truth["ratio"], "truth"
        control = self.opinions.control_run(r, m, fi, f, limit)
        if control is not None:
            details["control"] = control
            if control["ratio"] < ratio:  # the same rule: both must object
                ratio, decided_by = control["ratio"], "control"
        local = self.opinions.local(r, fi, limit)
        if local is not None:
            details["local"] = local
        details["floor"] = details_floor
        details["inherits_from"] = [d.key for d in deps][:8]
        if m.get("nonfinite_new", 0) > 0:
            status = NONFINITE
        elif ratio > limit:
            status = DRIFT
        elif local is not None and local["status"] != OK:
            status = local["status"]  # the module's own error is over the limit
        else:
            status = OK
        if ignore and status != OK:
            status = IGNORED
        return Entry(**c.base, metrics=m, floor=f.rms, ratio=ratio, status=status,
                     decided_by=decided_by, local_ratio=local["ratio"] if local else None,
                     rule=ignore or c.rule, details=details)

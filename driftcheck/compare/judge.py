"""Judging one entry: its measured error against its floor, with the error it inherits, the
local replay and the truth run where recorded, integers exactly (methods of the Comparison).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from driftcheck.compare.decisions import flip_scope
from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.inheritance import _linear_rel
from driftcheck.compare.measure import rms_of
from driftcheck.compare.propagation import NONE, WRONG, Propagated
from driftcheck.gate.report import DRIFT, IGNORED, MISALIGNED, NONFINITE, OK, Entry, Finding
from driftcheck.numerics import dtypes, floor as fl

C_UPDATE = 0.5  # optimizer: share of the reference's own update that rounding may flip
TRUTH_M, TRUTH_M_LOW = 2.0, 3.0  # TorchDynamo's multipliers: fp32 targets, bf16/fp16 targets
NOISE_GRAD = 0.3  # a gradient whose error is this share of its value is rounding noise
KAPPA_PARAM = 2.0  # as floor.KAPPA, for a parameter's absolute error that enters an output
FLIPS_EXPECTED = 0.5  # kink flips a gradient is expected to hold from which one is allowed its max


class Judging:
    """The judging half of :class:`driftcheck.compare.Comparison`."""

    def _judge(self, r: TraceEntry, t: TraceEntry) -> Entry:
        a = r.align
        limit, rule = self.policy.limit_for(r.module, r.phase)
        if self.limit_override is not None:
            limit, rule = self.limit_override, f"--limit {self.limit_override:g}"
        base = dict(key=r.key, module=r.module, phase=r.phase, step=r.step,
                    call=r.call, slot=r.slot, order=r.order, limit=limit)
        if list(r.shape) != list(t.shape):
            self.errors[a] = WRONG
            flip = self._rerouted(r, t)
            if flip is not None:
                self._note_rerouted(r, t, flip)
                return Entry(**base, metrics={}, floor=None, ratio=None, status=OK,
                             rule=f"shape follows {flip}, which flipped on near ties")
            self.findings.append(Finding(
                "alignment.shape_mismatch", r.module, r.step,
                f"{r.key}: reference shape {r.shape}, target shape {t.shape}",
                phase=r.phase, key=r.key))
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        if dtypes.measure_kind(r.dtype) != dtypes.measure_kind(t.dtype):
            self.findings.append(Finding(
                "alignment.dtype_mismatch", r.module, r.step,
                f"{r.key}: reference dtype {r.dtype}, target dtype {t.dtype} (not both "
                "integer, both real or both complex)", phase=r.phase, key=r.key))
            self.errors[a] = WRONG
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        m, how, hist = self._pair_metrics(r, t)
        if hist is not None:
            self._histograms_by_key[r.key] = hist
        judged = m
        details: dict[str, Any] = {"ref_stats": r.stats, "tgt_stats": t.stats,
                                   "ref_dtype": r.dtype, "tgt_dtype": t.dtype,
                                   "measured_on": how}
        meta = r.meta
        if meta.get("module_type"):
            details["module_type"] = meta["module_type"]
        ref_rms = m.get("ref_rms") or 0.0
        ref_max = m.get("ref_absmax") or r.stats.get("absmax") or 0.0
        # The operand magnitude (|A||B| in its probabilistic form), never below the value itself:
        # where terms cancel (a key bias's gradient is exactly zero in exact arithmetic) the
        # rounding error scales with the terms, not with their tiny sum.
        mag = max(meta.get("mag_rms") or 0.0, self._magnitude(r))
        gain, gain_max = self._norm_gain(r)
        if gain > 1.0:
            details["norm_gain"] = gain
        scale_rms = max(ref_rms, mag)
        scale_max = ref_max * (scale_rms / ref_rms if ref_rms > 0 else 1.0)
        e_rms, e_max = m.get("rms", 0.0), m.get("max_abs", 0.0)
        if how != "full":
            # What is passed on is at least the gap of the two runs' whole-tensor rms (absmax):
            # a sample can miss the few rows that carry the error (a Linear before a BatchNorm
            # over two values, timm_levit in stats mode: its Adam moments at 27-422).
            e_rms = max(e_rms, abs(rms_of(t.stats) - rms_of(r.stats)))
            e_max = max(e_max, abs((t.stats.get("absmax") or 0.0) - (r.stats.get("absmax") or 0.0)))
        self.errors[a] = Propagated(fl.relative(e_rms, scale_rms), fl.relative(e_max, scale_max), e_rms, e_max,
                                    scale_rms / ref_rms if ref_rms > 0 else 1.0)
        if m.get("nonfinite_new") or m.get("nonfinite_mismatch"):
            # NaN/Inf where the reference is finite: whatever depends on it can be anything
            # (its metrics only see the finite positions); nonfinite.origin names the source.
            self.errors[a] = self.errors[a]._replace(rel_rms=fl.REL_CAP, rel_max=fl.REL_CAP)
        if a in self.whole:
            # A shard (FSDP): the module computes with the whole tensor, whose other shards
            # (other ranks) may carry more of the error than this one.
            w_rms, w_max = self.whole[a]
            e = self.errors[a]
            self.errors[a] = e._replace(rel_rms=max(e.rel_rms, w_rms), rel_max=max(e.rel_max, w_max))
        ignore = self.policy.ignore_reason(r.module, r.phase, r.step)
        if not dtypes.is_float(r.dtype):
            return self._judge_integer(r, m, base, details, ignore)
        deps = self.ref_index.dependencies(r)
        inh = [self.errors.get(d.align, NONE) for d in deps]
        inh_rms, inh_max = self._inherited(r, how, deps, inh, ref_rms, ref_max, scale_rms, scale_max,
                                           gain, gain_max, details)
        flipped = self._flip_sparse(deps) if how != "full" else 0.0
        if flipped:
            # rows looked up by indices that flipped (a sample shows few): whole rows swapped
            details["flip_estimate"] = flipped
            inh_rms, inh_max = max(inh_rms, flipped), max(inh_max, fl.REL_CAP)
        u, u_acc = self._u(r, t)
        if r.phase == "grads" and self._owner_kind(r) in ("norm", "batchnorm"):
            # A norm kernel's backward sums its parameters' gradients in the storage dtype
            # (CPU bf16 LayerNorm: 7% on a bias over 512 positions), not in fp32: that of its
            # output gradient, under autocast too, where the parameters are fp32 (timm_coatnet:
            # 10% on a LayerNorm2d weight over 512 positions).
            u_acc = max(u_acc, u, self._grad_output_u(r))
        extra_rms = extra_max = 0.0
        if r.phase == "grads" and r.slot == "param.bias" and len(r.shape) == 1:
            extra_rms, extra_max = self._bias_sum_error(r, how)
            if extra_rms:
                details["bias_sum_error"] = extra_rms
        elif r.phase == "grads" and how != "full":
            extra_rms, extra_max = self._norm_sum_allowance(r)  # a norm's weight, from samples
            if extra_rms:
                details["low_precision_sum_allowance"] = extra_rms
        if r.phase == "params" and r.step > 0:
            # The state before step s is the state after step s-1: the same tensor.
            prev = self.errors.get((r.step - 1, "optimizer", r.module, 0, r.slot))
            if prev is not None:
                extra_rms, extra_max = prev.rms, prev.max
            # ... and what that entry was allowed: a sample measures other positions there
            allowed = self._floors.get((r.step - 1, "optimizer", r.module, 0, r.slot))
            if allowed is not None:
                extra_rms, extra_max = max(extra_rms, allowed[0]), max(extra_max, allowed[1])
        if r.phase == "optimizer" and r.slot.startswith("state."):
            extra_rms, extra_max = self._state_from_grad(r)
        if r.phase == "backward" and r.slot.startswith("grad_output"):
            extra_rms, extra_max = self._ctc_gradient(r)
        if r.phase == "optimizer" and r.slot.startswith("param."):
            upd_rms, upd_max = self._update_scale(r)
            extra_rms, extra_max = C_UPDATE * upd_rms, 2.0 * upd_max
            g = self.ref_index.by_align.get((r.step, "grads", r.module, 0, r.slot))
            if g is not None:
                err_g = self.errors.get(g.align, NONE)
                rel_g = _linear_rel(err_g.rms, rms_of(g.stats))  # error / the gradient's own rms
                if rel_g > NOISE_GRAD:
                    # The gradient is below its own rounding noise (terms that cancel): an
                    # adaptive optimizer turns that noise into full-size steps on both runs.
                    t_rms, t_max = self._update_scale(t, self.tgt, self.tgt_map)
                    extra_rms = max(extra_rms, 2.0 * max(upd_rms, t_rms))
                    extra_max = max(extra_max, 2.0 * max(upd_max, t_max))
                    details["gradient_below_noise"] = rel_g
        if r.phase == "forward" and r.slot.startswith("output") and meta.get("kind") in ("norm", "batchnorm"):
            # y = gamma xhat + beta: the parameters' absolute errors enter the output as they
            # are, where a relative error capped at 1 says too little (a zero-initialised bias
            # that Adam stepped by +-lr from noise: hf_mobilevitv2, 58x its value)
            p_rms, p_max = self._norm_param_error(r, ref_rms)
            extra_rms, extra_max = extra_rms + KAPPA_PARAM * p_rms, extra_max + KAPPA_PARAM * p_max
        logits = self._logit_max(r)
        if logits > 1.0:
            # exp turns a logit's rounding u|x| into a relative error u|x| of its weight
            extra_rms += u * logits * scale_rms
            extra_max += u * logits * scale_max
        rounded = self._rounding_allowance(r) if r.phase == "forward" else None
        if rounded is not None:
            # the model's code rounded it to a grid: elements near a boundary a step apart
            extra_rms, extra_max = extra_rms + rounded[0], extra_max + rounded[1]
            details["rounding"] = rounded[2]
        tiny = max(dtypes.tiny(r.dtype), dtypes.tiny(t.dtype))
        if r.phase == "grads":
            k = meta.get("k") or self._grad_terms(r)
        elif r.phase == "backward" and r.slot.startswith("grad_output"):
            k = self._consumer_terms(r)  # made by the code that consumed the output, not by this module
        else:
            k = meta.get("k") or self._norm_k(r)
        # A norm subtracting a mean far above the spread amplifies its input's error (and its
        # own rounding of x - mean) by rms/std: the floor's scale, not the value passed on.
        fi = fl.FloorInputs(u=u, u_acc=u_acc, k=k, scale_rms=scale_rms * gain,
                            scale_max=scale_max * gain_max, inherited_rms=inh_rms, inherited_max=inh_max,
                            extra_rms=extra_rms, extra_max=extra_max, tiny=tiny)
        f = fl.floor(fi)
        if r.phase == "optimizer":
            self._floors[a] = (f.rms, f.max)
        # A kink inside the module (nn.ReLU) shows in its input gradient; one applied to its
        # output by the code around it (F.relu, x.relu() between two Linears) in its output's.
        if how in ("full", "sample") and r.phase == "backward" \
                and r.slot.startswith(("grad_input", "grad_output")) \
                and f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) > 1.0:
            judged = self._kink_flips(r, t, m, f.max, "tensor" if how == "full" else "sample")
        ratio = f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        if how != "full":
            # Sparse errors (kink flips) that a sample rarely holds: estimated where they enter,
            # then passed on to everything measured on samples downstream, as measured errors
            # are in full mode (a layer's gradient sums over the flips of the one above).
            sparse = max(max((x.sparse for x in inh), default=0.0), flipped)
            flip_max = max((x.sparse_max for x in inh), default=0.0)
            if r.phase == "backward" and r.slot.startswith(("grad_input", "grad_output")):
                flips = self._kink_estimate(r, judged.get("kink_flips"))
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
            if r.phase == "optimizer" and r.slot.startswith("param."):
                signs = self._update_sign_flips(r, ref_rms)
                if signs:
                    details["update_flip_estimate"] = signs
                    sparse = max(sparse, signs)
            if sparse:
                e = self.errors[a]
                self.errors[a] = e._replace(rel_rms=max(e.rel_rms, sparse),
                                            rel_max=max(e.rel_max, sparse, flip_max), sparse=sparse,
                                            sparse_max=flip_max)
        if judged is not m:
            details["kink_flips"] = judged["kink_flips"]
            if judged["kink_flips"]["unexplained"]:
                ratio = math.inf
        decided_by = "analytic"
        details["analytic_ratio"] = ratio
        truth = self._truth_judgement(r, t, fi, limit) if self.truth is not None else None
        if truth is not None:
            details["truth"] = truth
            # Both judges must object (see docs/diagnosis.md): the entry's ratio is the more
            # lenient of the two, and the judge that gave it decided.
            if truth["ratio"] < ratio:
                ratio, decided_by = truth["ratio"], "truth"
        local = self._local_judgement(r, fi, limit)
        if local is not None:
            details["local"] = local
        details["floor"] = {"rms": f.rms, "max": f.max, "local_rms": f.local_rms,
                            "inherited_rms": f.inherited_rms, "u": u, "k": k,
                            "scale_rms": scale_rms, "inherited_rel": inh_rms}
        if logits > 1.0:
            details["floor"]["softmax_logit_max"] = logits
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
        return Entry(**base, metrics=m, floor=f.rms, ratio=ratio, status=status,
                     decided_by=decided_by, local_ratio=local["ratio"] if local else None,
                     rule=ignore or rule, details=details)

    def _judge_integer(self, r: TraceEntry, m: dict[str, Any], base: dict[str, Any],
                       details: dict[str, Any], ignore: str | None) -> Entry:
        """Integer tensors: inputs, buffers and counters must match exactly. Integers a module
        computes (top-k expert indices, argmax) may flip where their float scores tie within
        rounding: as many as the reference's decisions had margins within their scores' error
        (compare/decisions.py), and at least FLIP_BASE of them; more is a defect."""
        mismatched = m.get("frac_outside", 0.0) if m.get("max_abs", 0.0) > 0 else 0.0
        computed = r.phase == "forward" and (r.slot.startswith("output")
                                                or r.meta.get("parent") is not None) \
            and not self._passed_through(r)
        if m.get("nonfinite_mismatch"):
            mismatched = 1.0
        allowed, how = self._flips_allowed(r) if computed else (0.0, None)
        if how is not None:
            details["decisions"] = how
        ok = mismatched <= allowed
        details["integer_mismatch_fraction"] = mismatched
        status = OK if ok else DRIFT
        if ignore and not ok:
            status = IGNORED
        if computed:
            share = self._flip_share_bound(r, mismatched, details.get("measured_on"), how)
            if share > 0:
                self._flip_share[r.align] = share
        if computed and ok and mismatched > 0:
            self._flipped.setdefault(r.step, []).append((r.key, flip_scope(r)))
        rule = ignore or (f"computed integers may flip on near ties (<= {allowed:.1%} of elements)"
                          if computed else "integer tensors must match exactly")
        return Entry(**base, metrics=m, floor=0.0, ratio=0.0 if mismatched == 0 else
                     (mismatched / allowed if allowed else math.inf), status=status,
                     decided_by="exact", rule=rule, details=details)

    def _local_judgement(self, r: TraceEntry, fi: fl.FloorInputs, limit: float) -> dict[str, Any] | None:
        """The error this module adds itself: the target's replay of it on the reference's
        inputs (``local.*``) against the reference's output, over the local-only floor."""
        le = self.local_map.get(r.align)
        if le is None or list(le.shape) != list(r.shape) or not dtypes.is_float(le.dtype):
            return None
        measured = self._measure_between(self.ref, r, self.tgt, le)
        m = measured.metrics
        f = fl.floor(dataclasses.replace(fi, inherited_rms=0.0, inherited_max=0.0))
        ratio = f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0))
        flips = None
        if ratio > 1.0 and r.phase == "backward" and r.slot.startswith(("grad_input", "grad_output")) \
                and measured.how in ("full", "sample"):
            # The replay rounds the reference's input to the target's dtype: a kink's or a
            # selection's gradient flips where that carried an element across (or into a tie).
            judged = self._kink_flips(r, le, m, f.max, "tensor" if measured.how == "full"
                                      else "sample", local=True)
            if judged is not m:
                flips = judged["kink_flips"]
                ratio = math.inf if flips["unexplained"] else \
                    f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        status = NONFINITE if m.get("nonfinite_new", 0) > 0 else (DRIFT if ratio > limit else OK)
        out = {"ratio": ratio, "status": status, "floor": f.rms, "floor_max": f.max,
               "rms": m.get("rms"), "max_abs": m.get("max_abs"),
               "nonfinite_new": m.get("nonfinite_new", 0), "key": le.key}
        if flips is not None:
            out["kink_flips"] = flips
        return out

    def _truth_judgement(self, r: TraceEntry, t: TraceEntry, fi: fl.FloorInputs,
                         limit: float) -> dict[str, Any] | None:
        """TorchDynamo's accuracy rule against the float64 truth: the target is as good as the
        reference when err(target, truth) <= M * err(reference, truth) + tol, M = 3 for a
        bf16/fp16 target (2 otherwise), tol = this op's own rounding (the local analytic floor).
        Expressed on the policy's scale, ratio = limit * err_t / (M * err_r + tol), so it is over
        the limit exactly when the rule fails. It only matters for a reference of the target's
        precision (bf16 CPU vs bf16 accelerator): an fp32 reference is far closer to the truth
        than any correct bf16 run, and the analytic floor decides."""
        te = self.truth_map.get(r.align)
        if te is None or list(te.shape) != list(r.shape) or not dtypes.is_float(te.dtype):
            return None
        err_t = self._measure_between(self.truth, te, self.tgt, t).metrics
        err_r = self._measure_between(self.truth, te, self.ref, r).metrics
        if err_t.get("nonfinite_new", 0) or err_r.get("nonfinite_new", 0):
            return None
        mult = TRUTH_M_LOW if t.dtype in ("bfloat16", "float16") else TRUTH_M
        tol = fl.floor(dataclasses.replace(fi, inherited_rms=0.0, inherited_max=0.0))
        f_rms = mult * err_r.get("rms", 0.0) + tol.rms
        f_max = mult * err_r.get("max_abs", 0.0) + tol.max
        raw = max(fl._div(err_t.get("rms", 0.0), f_rms), fl._div(err_t.get("max_abs", 0.0), f_max))
        return {"ratio": limit * raw, "floor": f_rms, "m": mult, "err_target": err_t.get("rms"),
                "err_reference": err_r.get("rms"), "truth_key": te.key}

"""Floor inputs beyond the entry itself: a run's own optimizer update, the error an optimizer's
state takes from its gradient, a kernel's own low-precision sum, and the unit roundoff each side
computed with (methods of the Comparison; operand magnitudes are in magnitude.py).
"""
from __future__ import annotations

import math
from typing import Any

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.kinks import KINK_NEAR, density_near_zero
from driftcheck.compare.magnitude import LINEAR_STATE, SQUARED_STATE
from driftcheck.compare.measure import rms_of
from driftcheck.compare.propagation import NONE
from driftcheck.gate.report import Finding
from driftcheck.numerics import dtypes, floor as fl
from driftcheck.store.reader import TraceReader

MATMUL_KINDS = ("linear", "conv", "composite")
AUTOCAST_U = {n: dtypes.unit_roundoff(n) for n in ("bf16", "bfloat16", "fp16", "float16")}
LOW_PRECISION_SUM = 0.01  # a kernel's own sum off by this share of it: named (a warning)
LOW_PRECISION_U = 2.0 ** -12  # coarser than this: a low-precision dtype (bf16, fp16, fp8)


def _matmul_roundoff(run: dict[str, Any], dtype: str, phase: str, kind: str | None) -> float:
    settings = run.get("precision") or {}
    op = {"linear": "linear", "conv": "conv"}.get(kind or "", "matmul")
    try:
        from driftcheck.numerics.roundoff import effective_matmul_roundoff

        return effective_matmul_roundoff(settings, dtype, phase=phase, op=op)
    except (ImportError, TypeError, KeyError, ValueError):
        return dtypes.unit_roundoff(dtype)


def autocast_roundoff(run: dict[str, Any]) -> float:
    """The unit roundoff of a run's autocast dtype (0 without autocast, or an unknown one)."""
    cast = run.get("autocast") or (run.get("precision") or {}).get("autocast")
    return AUTOCAST_U.get(cast, 0.0) if isinstance(cast, str) else 0.0


class Scales:
    """The floor-input half of :class:`driftcheck.compare.Comparison`."""

    def _update_scale(self, r: TraceEntry, reader: TraceReader | None = None,
                      index: dict | None = None) -> tuple[float, float]:
        """rms and max of a run's own optimizer update of a parameter (the reference's by
        default)."""
        reader = reader or self.ref
        index = index if index is not None else self.ref_index.by_align
        s, _, m, _, slot = r.align
        before = index.get((s, "params", m, 0, slot))
        if before is None:
            return 0.0, 0.0
        a, b = reader.tensor(r.raw), reader.tensor(before.raw)
        if (a is None or b is None) and r.stats.get("numel") == before.stats.get("numel"):
            # Stats mode: samples of the same positions (the entry after the update is sampled
            # where the one before it is: meta sampled_as), or samples of a tensor no larger than
            # a sample (the whole tensor, in order, whatever their keys): the update itself.
            a, b = reader.tensor(r.raw, "sample"), reader.tensor(before.raw, "sample")
            same = r.meta.get("sampled_as") == "params"
            if a is not None and a.numel() != r.stats.get("numel") and not same:
                a = None
        if a is None or b is None or a.shape != b.shape:
            d_rms = abs(rms_of(r.stats) - rms_of(before.stats))
            return d_rms, d_rms
        d = a.double() - b.double()
        return float(d.pow(2).mean().sqrt()), float(d.abs().max()) if d.numel() else 0.0

    def _u(self, r: TraceEntry, t: TraceEntry) -> tuple[float, float]:
        """(u, u_acc) for this entry: the coarser side, matmul precision where it applies."""
        u = max(dtypes.unit_roundoff(r.dtype), dtypes.unit_roundoff(t.dtype))
        if r.phase in ("forward", "backward") and not (r.phase == "forward"
                                                       and r.slot.startswith("input")):
            # A module computes in the lowest precision among its inputs (a gate in bf16 beside
            # an fp32 hidden state): its outputs and input gradients carry that rounding.
            # Its own parameters count too (a norm's bf16 weight times an fp32 hidden state).
            for e in list(self.ref_index.fwd_in.get((r.step, r.module, r.call), ())) + \
                    list(self.ref_index.params.get((r.step, r.module), ())):
                te = self.tgt_map.get(e.align)
                for d in (e.dtype, te.dtype if te is not None else e.dtype):
                    if dtypes.is_float(d):
                        u = max(u, dtypes.unit_roundoff(d))
        if r.phase in ("forward", "backward"):
            # Under autocast any op may run in the autocast dtype whatever dtype its tensors
            # are stored in (a LayerNorm whose fp32 tensors carry bf16 rounding), the code
            # between submodules included.
            u = max([u] + [autocast_roundoff(run) for run in (self.ref.run, self.tgt.run)])
        kind = r.meta.get("kind")
        if r.phase in ("forward", "backward", "loss") and (kind in MATMUL_KINDS or r.phase == "loss"):
            for run, e in ((self.ref.run, r), (self.tgt.run, t)):
                u = max(u, _matmul_roundoff(run, e.dtype, r.phase, kind))
        if r.phase == "grads" and r.slot == "param.weight":
            # a weight gradient is a matmul too (of the output gradient and the input): the
            # run's matmul precision applies (TF32, a TPU's bf16 passes)
            owner = self._owner_kind(r)
            if owner in MATMUL_KINDS:
                for run, e in ((self.ref.run, r), (self.tgt.run, t)):
                    u = max(u, _matmul_roundoff(run, e.dtype, "backward", owner))
        u_acc = max(dtypes.accumulation_roundoff(r.dtype), dtypes.accumulation_roundoff(t.dtype))
        return u, u_acc

    def _grad_output_u(self, r: TraceEntry) -> float:
        """The coarsest unit roundoff among the target's output gradients of the calls of the
        module a parameter entry belongs to (the dtype its backward kernel computes in)."""
        u = 0.0
        for c in self.ref_index.calls.get((r.step, r.module), ()):
            for e in self.ref_index.gout.get((r.step, r.module, c), [])[:1]:
                t = self.tgt_map.get(e.align)
                if t is not None and dtypes.is_float(t.dtype):
                    u = max(u, dtypes.unit_roundoff(t.dtype))
        return u

    def _owner_kind(self, r: TraceEntry) -> str | None:
        """The kind of the module a parameter entry belongs to (from its forward output)."""
        for c in sorted(self.ref_index.calls.get((r.step, r.module), ())):
            for e in self.ref_index.fwd_out.get((r.step, r.module, c), [])[:1]:
                return e.meta.get("kind")
        return None

    def _bias_sum_error(self, r: TraceEntry, how: str) -> tuple[float, float]:
        """A bias's gradient sums its output gradient over every position: the error that
        gradient brings adds up coherently where it is shared by the positions (a common
        component, as a bf16 weight's rounding is), which sqrt(K) growth misses. In full mode
        it is computed, the target's output gradient minus the reference's summed per channel
        over every call; from samples it is bounded by positions x the rms error."""
        s, _, m, _, _ = r.align
        c_out = r.shape[0]
        total = own = absum = None
        bound = 0.0
        # the kernel sums in the dtype it computes in: its output gradient's (a bf16 LayerNorm
        # under autocast keeps fp32 parameters and gradients), at least the gradient's own
        kernel = [self.tgt_map[r.align].dtype] if r.align in self.tgt_map else []
        for call in sorted(self.ref_index.calls.get((s, m), ())):
            for e in self.ref_index.gout.get((s, m, call), [])[:1]:
                t = self.tgt_map.get(e.align)
                err = self.errors.get(e.align)
                if t is None or len(e.shape) < 1:
                    continue
                if dtypes.is_float(t.dtype):
                    kernel.append(t.dtype)
                dim = 1 if len(e.shape) > 1 and e.shape[1] == c_out and e.shape[-1] != c_out else -1
                if e.shape[dim] != c_out:
                    continue
                a = self.ref.tensor(e.raw) if how == "full" else None
                b = self.tgt.tensor(t.raw) if a is not None else None
                if a is not None and b is not None and a.shape == b.shape:
                    bt = b.double().movedim(dim, -1).reshape(-1, c_out)
                    d = bt.sum(0) - a.double().movedim(dim, -1).reshape(-1, c_out).sum(0)
                    total = d if total is None else total + d
                    own = bt.sum(0) if own is None else own + bt.sum(0)
                    k = bt.abs().sum(0) * bt.shape[0]
                    absum = k if absum is None else absum + k
                elif err is not None:  # sparse: what its sample could not show
                    bound += (e.stats.get("numel") or 0) / c_out * max(
                        err.rms, err.sparse * rms_of(e.stats))
        if total is not None:
            # ... and what the target's kernel lost summing it (a bf16 sum of near-equal terms
            # stagnates), measured against its own output gradient, within the worst-case
            # bound K u sum|g| of a sum in its dtype (Higham, Accuracy and Stability, 4.2)
            t = self.tgt_map.get(r.align)
            tb = self.tgt.tensor(t.raw) if t is not None else None
            if tb is not None and tb.shape == own.shape and absum is not None:
                gap = (tb.double() - own).abs()
                coarse = max(kernel, key=dtypes.unit_roundoff)
                lost = gap.minimum(dtypes.unit_roundoff(coarse) * absum)
                total = total.abs() + lost
                share = float(gap.pow(2).mean().sqrt()) / max(float(own.pow(2).mean().sqrt()), 1e-300)
                if share > LOW_PRECISION_SUM and not any(
                        f.kind == "precision.low_precision_sum" and f.module == m for f in self.findings):
                    self.findings.append(Finding(
                        "precision.low_precision_sum", m, s,
                        f"{r.slot} gradient, step {s}: the target's kernel summed it over "
                        f"{self._grad_terms(r)} "
                        f"positions in low precision: it differs from the sum of the target's own "
                        f"output gradient by {100 * share:.3g}% (rms); within the worst case of a "
                        f"{coarse} sum, not judged as drift", phase="grads", key=r.key,
                        severity="warning", details={"share": share}))
            return float(total.pow(2).mean().sqrt()), float(total.abs().max())
        stag_rms, stag_max = self._norm_sum_allowance(r)
        return bound + stag_rms, bound + stag_max

    def _norm_sum_allowance(self, r: TraceEntry) -> tuple[float, float]:
        """From samples a kernel's own sum cannot be measured: a norm kernel summing its
        parameter gradients in a low-precision dtype (its output gradient's) is allowed the worst
        case full mode clips its measured loss to, K u times the larger of the sum and its terms'
        l2 norm (bf16 sums of same-sign terms stagnate: timm_coatnet under autocast, 30% over 512
        positions), at most the sum or that norm itself."""
        if self._owner_kind(r) not in ("norm", "batchnorm"):
            return 0.0, 0.0
        u_k = max([self._grad_output_u(r)] + ([dtypes.unit_roundoff(self.tgt_map[r.align].dtype)]
                                              if r.align in self.tgt_map else []))
        if u_k <= LOW_PRECISION_U:
            return 0.0, 0.0
        share = min((self._grad_terms(r) or 1) * u_k, 1.0)
        # A sum accumulated in u_k loses u_k |partial sum| at each add; partial sums of terms
        # that cancel grow with the terms' l2 norm, not with the sum (hf_focalnet's last
        # LayerNorm bias, 4x its own size over 128 positions in bf16): K u_k times the larger.
        value = rms_of(r.stats)
        scale = max(value, self._magnitude(r))
        absmax = r.stats.get("absmax") or 0.0
        return share * scale, share * absmax * (scale / value if value > 0 else 1.0)

    def _state_from_grad(self, r: TraceEntry) -> tuple[float, float]:
        """The error an optimizer's running moment takes from its gradient's, in absolute
        terms: a relative error caps at REL_CAP, yet a gradient below its rounding noise (a
        bias summed in bf16) is off by several times its size and so is its moment.
        m = b m' + (1 - b) g moves by c dg, c = rms(m) / rms(g) ((1 - b) at the first step);
        v = b v' + (1 - b) g^2 by c2 (2 g dg + dg^2) <= c2 (2 |g|max + |dg|max) rms(dg),
        c2 = mean(v) / mean(g^2) (again 1 - b at the first step)."""
        s, _, m, _, slot = r.align
        parts = slot.split(".")
        if len(parts) < 3 or parts[0] != "state" or parts[-1] not in LINEAR_STATE + SQUARED_STATE:
            return 0.0, 0.0
        # b m' carries the moment's error of the step before (b <= 1), measured or allowed
        prev = self.errors.get((s - 1, "optimizer", m, 0, slot), NONE)
        allowed = self._floors.get((s - 1, "optimizer", m, 0, slot), (0.0, 0.0))
        carried = (max(prev.rms, allowed[0]), max(prev.max, allowed[1]))
        g = self.ref_index.by_align.get((s, "grads", m, 0, f"param.{parts[1]}"))
        err = self.errors.get(g.align) if g is not None else None
        if g is None or err is None or not err.rms:
            return carried
        # c from the reference's moment and gradient, or the target's where the reference's
        # gradient is exactly zero (a unit dead on one side only)
        state, grad = r.stats, g.stats
        if not rms_of(grad) and g.align in self.tgt_map and r.align in self.tgt_map:
            state, grad = self.tgt_map[r.align].stats, self.tgt_map[g.align].stats
        g_rms = rms_of(grad)
        if not g_rms:
            return carried
        g_max = max(g.stats.get("absmax") or 0.0, grad.get("absmax") or 0.0)
        # Clipped by the global norm, the optimizer sees g * max_norm / |G|: the clip factor's
        # relative error (that of |G|, over every parameter's gradient) on top of this one's.
        clip = self._clip_error(s)
        d_rms, d_max = err.rms + clip * g_rms, err.max + clip * g_max
        if parts[-1] in LINEAR_STATE:
            c = rms_of(state) / g_rms
            return carried[0] + c * d_rms, carried[1] + c * d_max
        c2 = abs(state.get("mean") or 0.0) / (g_rms * g_rms)
        return (carried[0] + c2 * (2 * g_max + d_max) * d_rms,
                carried[1] + c2 * (2 * g_max + d_max) * d_max)

    def _clip_error(self, step: int) -> float:
        """The relative error of the global gradient norm of ``step`` where either run clipped
        its gradients by it (run ``grad_clip: {"norm": max_norm}``, a Trainer's max_grad_norm):
        sqrt(sum of squared gradient errors / sum of squared gradients) over the step's
        parameter gradients; 0 where neither run clips by norm."""
        if not any(isinstance(run.get("grad_clip"), dict) and run["grad_clip"].get("norm")
                   for run in (self.ref.run, self.tgt.run)):
            return 0.0
        cache = self.__dict__.setdefault("_clip_errors", {})
        if step not in cache:
            e2 = g2 = 0.0
            for e in self.ref_entries:
                if e.step == step and e.phase == "grads" and e.align in self.errors:
                    n = e.stats.get("numel") or 0
                    e2 += self.errors[e.align].rms ** 2 * n
                    g2 += rms_of(e.stats) ** 2 * n
            cache[step] = min(math.sqrt(e2 / g2), 1.0) if g2 > 0 else 0.0
        return cache[step]

    def _ctc_gradient(self, r: TraceEntry) -> tuple[float, float]:
        """The output gradient of a module whose output the code around it feeds to a CTC loss
        over T frames (meta ``ctc_frames`` of that call). Its gradient, softmax - gamma, moves by
        the logits' absolute error through the softmax, and through the alignment posteriors
        gamma by the error of a whole path's log-probability: a sum over the T frames, about
        sqrt(T) of them for rounding errors, and at the worst element up to all T of them (a
        path's errors add; |sum| <= T max: SEW-D between 1 and 2 threads, fp32, T = 79: the
        gradient's largest error 71x the logits' largest, its rms 9x theirs). A relative error
        says nothing of either, where the gradient is far smaller than the logits (hf wav2vec2:
        30x its logits' relative error)."""
        # the loss is computed by the code around the module (its parent's), or by the module's
        # own code from the output it also returns (a Hugging Face model computing its loss)
        frames = max((int(e.meta.get("ctc_frames") or 0) for e in self.ref_index.consumer_outputs(r)),
                     default=0)
        if not frames:
            return 0.0, 0.0
        out = self.errors.get((r.step, "forward", r.module, r.call, r.slot.removeprefix("grad_")))
        if out is None:
            return 0.0, 0.0
        return (1.0 + math.sqrt(frames)) * out.rms, (1.0 + frames) * out.max

    def _update_sign_flips(self, r: TraceEntry, ref_rms: float) -> float:
        """An adaptive optimizer's first steps are ~lr * sign(g): where a gradient element is
        within its error of zero the two runs step 2 lr apart. Few and full-size, a sample of
        the updated parameter rarely holds one, yet the next step computes with all of them:
        their share of the parameter's rms (2 * update rms * sqrt(p), p the fraction of the
        gradient's sample within twice its error of zero, or its density near zero from the
        KINK_NEAR smallest magnitudes), passed on as sparse error (stats mode)."""
        g = self.ref_index.by_align.get((r.step, "grads", r.module, 0, r.slot))
        err = self.errors.get(g.align) if g is not None else None
        gs = self.ref.tensor(g.raw, "sample") if g is not None else None
        if err is None or not err.rms or gs is None or gs.numel() < 2 * KINK_NEAR or not ref_rms:
            return 0.0
        a = gs.double().abs().reshape(-1)
        p = max(float((a <= 2.0 * err.rms).double().mean()), density_near_zero(a, err.rms))
        upd_rms, _ = self._update_scale(r)
        return min(2.0 * upd_rms * math.sqrt(p) / ref_rms, fl.REL_CAP)

    def _norm_gain(self, r: TraceEntry) -> tuple[float, float]:
        """rms/std of a mean-subtracting norm's input (meta ``norm_gain`` of its output, and of
        its worst group ``norm_gain_max``): the factor by which subtracting the mean amplifies
        the error of its input, for its outputs and its input gradients, and for a child's
        input that its parent norm's code normalized (_norm_call); 1 for anything else."""
        if r.phase not in ("forward", "backward") or r.slot.startswith("grad_output"):
            return 1.0, 1.0
        call = (r.step, r.module, r.call)
        if r.slot.startswith("input"):
            call = self._norm_call(r)
            if call is None:
                return 1.0, 1.0
        outs = self.ref_index.fwd_out.get(call, ())
        g = max((float(e.meta.get("norm_gain") or 1.0) for e in outs), default=1.0)
        return g, max([g] + [float(e.meta.get("norm_gain_max") or 1.0) for e in outs])

    def _logit_max(self, r: TraceEntry) -> float:
        """The largest softmax logit with weight that this module call's own code computed (its
        outputs and input gradients go through that softmax), for the model's output gradients
        also the loss code's; 0 for anything else."""
        if r.phase not in ("forward", "backward"):
            return 0.0
        if r.slot.startswith("grad_output"):
            if r.module:
                return 0.0
            # the model's output gradients: made by the model's own code after its last module
            # (a contrastive loss's cross-entropy) or by the loss code (the loss entry's meta)
            outs = list(self.ref_index.fwd_out.get((r.step, r.module, r.call), ())) + \
                list(self.ref_index.loss.get(r.step, ()))
            return max((float(e.meta.get("logit_absmax") or 0.0) for e in outs), default=0.0)
        call = (r.step, r.module, r.call)
        if r.slot.startswith("input"):  # computed by the parent's code, its softmax included
            call = self.ref_index.parent_of(r)
            if call is None:
                return 0.0
        outs = self.ref_index.fwd_out.get(call, ())
        return max((float(e.meta.get("logit_absmax") or 0.0) for e in outs), default=0.0)

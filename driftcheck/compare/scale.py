"""Floor inputs beyond the entry itself: a run's own optimizer update, the error an optimizer's
state takes from its gradient, a kernel's own low-precision sum, a CTC loss's frames, a
softmax's logits (what compare/allowances.py names as the floor's allowances; operand
magnitudes are in magnitude.py, unit roundoff in roundoff.py).
"""
from __future__ import annotations

import math

import torch

from driftcheck.compare.entries import TraceEntry, forward_slot
from driftcheck.compare.findings import FindingLog
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.compare.kinks import KINK_NEAR, density_near_zero
from driftcheck.compare.magnitude import LINEAR_STATE, SQUARED_STATE, Magnitudes
from driftcheck.compare.measure import rms_of
from driftcheck.compare.propagation import NONE, Ledger
from driftcheck.compare.roundoff import Roundoff
from driftcheck.gate.report import Finding
from driftcheck.numerics import dtypes, floor as fl
from driftcheck.store.keys import Slot, TraceKey
from driftcheck.store.reader import TraceReader

LOW_PRECISION_SUM = 0.01  # a kernel's own sum off by this share of it: named (a warning)
LOW_PRECISION_U = 2.0 ** -12  # coarser than this: a low-precision dtype (bf16, fp16, fp8)


def update_scale(r: TraceEntry, reader: TraceReader, by_align: dict[TraceKey, TraceEntry]) -> tuple[float, float]:
    """rms and max of a run's own optimizer update of a parameter: optimizer entry ``r`` against
    the same parameter before the step (in ``by_align``), both read from ``reader``."""
    s, _, m, _, slot = r.align
    before = by_align.get(TraceKey(s, "params", m, 0, slot))
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


class Scales:
    """Sizes of what an entry's floor allows beyond its own rounding, from the two runs."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, index: DependencyIndex,
                 tgt_map: dict[TraceKey, TraceEntry], ref_entries: list[TraceEntry], ledger: Ledger,
                 findings: FindingLog, magnitudes: Magnitudes, roundoff: Roundoff) -> None:
        self.ref, self.tgt, self.index, self.tgt_map = ref, tgt, index, tgt_map
        self.ref_entries, self.ledger, self.findings = ref_entries, ledger, findings
        self.magnitudes, self.roundoff = magnitudes, roundoff
        self.clip_errors: dict[int, float] = {}  # step -> relative error of its gradient norm

    def update(self, r: TraceEntry, target: TraceEntry | None = None) -> tuple[float, float]:
        """rms and max of the reference's own optimizer update of a parameter (the target's,
        of its entry ``target``, where given)."""
        if target is not None:
            return update_scale(target, self.tgt, self.tgt_map)
        return update_scale(r, self.ref, self.index.by_align)

    def bias_sum_error(self, r: TraceEntry, how: str) -> tuple[float, float]:
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
        for call in sorted(self.index.calls.get((s, m), ())):
            for e in self.index.gout.get(Call(s, m, call), [])[:1]:
                t = self.tgt_map.get(e.align)
                err = self.ledger.errors.get(e.align)
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
        if total is not None and own is not None and absum is not None:
            total = self._kernel_sum(r, total, own, absum, kernel)
            return float(total.pow(2).mean().sqrt()), float(total.abs().max())
        stag_rms, stag_max = self.norm_sum_allowance(r)
        return bound + stag_rms, bound + stag_max

    def _kernel_sum(self, r: TraceEntry, total: torch.Tensor, own: torch.Tensor, absum: torch.Tensor,
                    kernel: list[str]) -> torch.Tensor:
        # ... and what the target's kernel lost summing it (a bf16 sum of near-equal terms
        # stagnates), measured against its own output gradient, within the worst-case
        # bound K u sum|g| of a sum in its dtype (Higham, Accuracy and Stability, 4.2)
        t = self.tgt_map.get(r.align)
        tb = self.tgt.tensor(t.raw) if t is not None else None
        if tb is None or tb.shape != own.shape:
            return total
        gap = (tb.double() - own).abs()
        coarse = max(kernel, key=dtypes.unit_roundoff)
        lost = gap.minimum(dtypes.unit_roundoff(coarse) * absum)
        share = float(gap.pow(2).mean().sqrt()) / max(float(own.pow(2).mean().sqrt()), 1e-300)
        if share > LOW_PRECISION_SUM and not self.findings.has("precision.low_precision_sum", r.module):
            self.findings.add(Finding(
                "precision.low_precision_sum", r.module, r.step,
                f"{r.slot} gradient, step {r.step}: the target's kernel summed it over "
                f"{self.magnitudes.grad_terms(r)} "
                f"positions in low precision: it differs from the sum of the target's own "
                f"output gradient by {100 * share:.3g}% (rms); within the worst case of a "
                f"{coarse} sum, not judged as drift", phase="grads", key=r.key,
                severity="warning", details={"share": share}))
        return total.abs() + lost

    def norm_sum_allowance(self, r: TraceEntry) -> tuple[float, float]:
        """From samples a kernel's own sum cannot be measured: a norm kernel summing its
        parameter gradients in a low-precision dtype (its output gradient's) is allowed the worst
        case full mode clips its measured loss to, K u sum|g| (Higham, 4.2), at most sum|g|
        itself, or the sum where that is larger. sum|g| per channel is bounded by sqrt(K) times
        the terms' l2 norm (Cauchy-Schwarz), all a sample can say of it."""
        if self.index.owner_kind(r) not in ("norm", "batchnorm"):
            return 0.0, 0.0
        u_k = max([self.roundoff.grad_output_u(r)] + ([dtypes.unit_roundoff(self.tgt_map[r.align].dtype)]
                                                      if r.align in self.tgt_map else []))
        if u_k <= LOW_PRECISION_U:
            return 0.0, 0.0
        terms = self.magnitudes.grad_terms(r) or 1
        share = min(terms * u_k, 1.0)
        # A sum accumulated in u_k loses u_k |partial sum| at each add. Partial sums of terms
        # that cancel in total grow with the terms, not with the sum, and where the terms are
        # ordered (positions of an image, a sequence) they grow coherently, up to sum|g|, not as a
        # random walk (l2): hf_perceiver_image's cross-attention LayerNorm bias over 2048 image
        # positions in bf16, the kernel's own sum 23% of sum|g| off, 5x the l2 norm.
        value = rms_of(r.stats)
        scale = max(value, math.sqrt(terms) * self.magnitudes.magnitude(r))
        absmax = r.stats.get("absmax") or 0.0
        return share * scale, share * absmax * (scale / value if value > 0 else 1.0)

    def state_from_grad(self, r: TraceEntry) -> tuple[float, float]:
        """The error an optimizer's running moment takes from its gradient's, in absolute
        terms: a relative error caps at REL_CAP, yet a gradient below its rounding noise (a
        bias summed in bf16) is off by several times its size and so is its moment.
        m = b m' + (1 - b) g moves by c dg, c = rms(m) / rms(g) ((1 - b) at the first step);
        v = b v' + (1 - b) g^2 by c2 (2 g dg + dg^2) <= c2 (2 |g|max + |dg|max) rms(dg),
        c2 = mean(v) / mean(g^2) (again 1 - b at the first step)."""
        s, _, m, _, slot = r.align
        parsed = Slot.parse(slot)
        parts = parsed.path.split(".")  # <param>.<key>
        if parsed.local or parsed.kind != "state" or len(parts) < 2 \
                or parts[-1] not in LINEAR_STATE + SQUARED_STATE:
            return 0.0, 0.0
        # b m' carries the moment's error of the step before (b <= 1), measured or allowed
        prev_key = TraceKey(s - 1, "optimizer", m, 0, slot)
        prev = self.ledger.errors.get(prev_key, NONE)
        allowed = self.ledger.floors.get(prev_key, (0.0, 0.0))
        carried = (max(prev.rms, allowed[0]), max(prev.max, allowed[1]))
        g = self.index.by_align.get(TraceKey(s, "grads", m, 0, str(Slot("param", parts[0]))))
        err = self.ledger.errors.get(g.align) if g is not None else None
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
        clip = self.clip_error(s)
        d_rms, d_max = err.rms + clip * g_rms, err.max + clip * g_max
        if parts[-1] in LINEAR_STATE:
            c = rms_of(state) / g_rms
            return carried[0] + c * d_rms, carried[1] + c * d_max
        c2 = abs(state.get("mean") or 0.0) / (g_rms * g_rms)
        return (carried[0] + c2 * (2 * g_max + d_max) * d_rms,
                carried[1] + c2 * (2 * g_max + d_max) * d_max)

    def clip_error(self, step: int) -> float:
        """The relative error of the global gradient norm of ``step`` where either run clipped
        its gradients by it (run ``grad_clip: {"norm": max_norm}``, a Trainer's max_grad_norm):
        sqrt(sum of squared gradient errors / sum of squared gradients) over the step's
        parameter gradients; 0 where neither run clips by norm."""
        if not any(isinstance(run.get("grad_clip"), dict) and run["grad_clip"].get("norm")
                   for run in (self.ref.run, self.tgt.run)):
            return 0.0
        if step not in self.clip_errors:
            e2 = g2 = 0.0
            errors = self.ledger.errors
            for e in self.ref_entries:
                if e.step == step and e.phase == "grads" and e.align in errors:
                    n = e.stats.get("numel") or 0
                    e2 += errors[e.align].rms ** 2 * n
                    g2 += rms_of(e.stats) ** 2 * n
            self.clip_errors[step] = min(math.sqrt(e2 / g2), 1.0) if g2 > 0 else 0.0
        return self.clip_errors[step]

    def ctc_gradient(self, r: TraceEntry) -> tuple[float, float]:
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
        frames = max((int(e.meta.get("ctc_frames") or 0) for e in self.index.consumer_outputs(r)),
                     default=0)
        if not frames:
            return 0.0, 0.0
        out = self.ledger.errors.get(TraceKey(r.step, "forward", r.module, r.call, forward_slot(r.slot)))
        if out is None:
            return 0.0, 0.0
        return (1.0 + math.sqrt(frames)) * out.rms, (1.0 + frames) * out.max

    def update_sign_flips(self, r: TraceEntry, ref_rms: float) -> float:
        """An adaptive optimizer's first steps are ~lr * sign(g): where a gradient element is
        within its error of zero the two runs step 2 lr apart. Few and full-size, a sample of
        the updated parameter rarely holds one, yet the next step computes with all of them:
        their share of the parameter's rms (2 * update rms * sqrt(p), p the fraction of the
        gradient's sample within twice its error of zero, or its density near zero from the
        KINK_NEAR smallest magnitudes), passed on as sparse error (stats mode)."""
        g = self.index.by_align.get(r.align._replace(phase="grads", call=0))
        err = self.ledger.errors.get(g.align) if g is not None else None
        gs = self.ref.tensor(g.raw, "sample") if g is not None else None
        if err is None or not err.rms or gs is None or gs.numel() < 2 * KINK_NEAR or not ref_rms:
            return 0.0
        a = gs.double().abs().reshape(-1)
        p = max(float((a <= 2.0 * err.rms).double().mean()), density_near_zero(a, err.rms))
        upd_rms, _ = self.update(r)
        return min(2.0 * upd_rms * math.sqrt(p) / ref_rms, fl.REL_CAP)

    def logit_max(self, r: TraceEntry) -> float:
        """The largest softmax logit with weight that this module call's own code computed (its
        outputs and input gradients go through that softmax), for the model's output gradients
        also the loss code's; 0 for anything else."""
        if r.phase not in ("forward", "backward"):
            return 0.0
        call: Call | None = Call(r.step, r.module, r.call)
        if r.slot_is("grad_output"):
            if r.module:
                return 0.0
            # the model's output gradients: made by the model's own code after its last module
            # (a contrastive loss's cross-entropy) or by the loss code (the loss entry's meta)
            outs = list(self.index.fwd_out.get(Call(r.step, r.module, r.call), ())) + \
                list(self.index.loss.get(r.step, ()))
            return max((float(e.meta.get("logit_absmax") or 0.0) for e in outs), default=0.0)
        if r.slot_is("input"):  # computed by the parent's code, its softmax included
            call = self.index.parent_of(r)
            if call is None:
                return 0.0
        outs = self.index.fwd_out.get(call, []) if call is not None else []
        return max((float(e.meta.get("logit_absmax") or 0.0) for e in outs), default=0.0)

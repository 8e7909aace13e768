"""The floor's allowances (``FloorInputs.extra_rms`` / ``extra_max``): absolute error an entry
may carry beyond its own rounding and the relative error it inherits, each a named term.

An entry gets at most one term of its phase (:meth:`Allowances.of_phase`): a bias gradient's
coherent sum, a norm kernel's low-precision sum, a parameter's carried optimizer error, an
optimizer moment's gradient error, the optimizer's update, a CTC loss's output gradient. On top
of it, in this order: a norm output's parameter error, a softmax's logits, a rounding grid, a
reduction split across ranks. The sum is taken in exactly that order (floating point: the floors
are bit for bit those of the comparison before these were named).
"""
from __future__ import annotations

import math
from typing import Any

from driftcheck.compare.decisions import Decisions
from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import DependencyIndex
from driftcheck.compare.inheritance import Scale, linear_rel
from driftcheck.compare.magnitude import Magnitudes
from driftcheck.compare.measure import rms_of
from driftcheck.compare.propagation import NONE, Ledger
from driftcheck.compare.scale import Scales
from driftcheck.numerics import dtypes
from driftcheck.store.keys import TraceKey

C_UPDATE = 0.5  # optimizer: share of the reference's own update that rounding may flip
NOISE_GRAD = 0.3  # a gradient whose error is this share of its value is rounding noise
KAPPA_PARAM = 2.0  # as floor.KAPPA, for a parameter's absolute error that enters an output

Extra = tuple[float, float]  # (rms, max), absolute
NOTHING: Extra = (0.0, 0.0)


class Allowances:
    """The named allowance terms of an entry's floor, and their sum (:meth:`extra`)."""

    def __init__(self, index: DependencyIndex, ledger: Ledger, scales: Scales, magnitudes: Magnitudes,
                 decisions: Decisions) -> None:
        self.index, self.ledger, self.scales = index, ledger, scales
        self.magnitudes, self.decisions = magnitudes, decisions

    def extra(self, r: TraceEntry, t: TraceEntry, how: str, u: float, logits: float, scale: Scale,
              details: dict[str, Any]) -> Extra:
        """(extra_rms, extra_max) of entry ``r`` (``t`` the target's): its phase's term, then
        the terms that add to it, summed left to right."""
        total = self.of_phase(r, t, how, details)
        for term in (self.norm_parameters(r, scale), self.softmax_logits(u, logits, scale),
                     self.grid_rounding(r, details), self.rank_split(r, t, details)):
            if term is not None:
                total = (total[0] + term[0], total[1] + term[1])
        return total

    def of_phase(self, r: TraceEntry, t: TraceEntry, how: str, details: dict[str, Any]) -> Extra:
        """The one term of the entry's phase and slot (none for most entries)."""
        if r.phase == "grads":
            return self.gradient_sum(r, how, details)
        if r.phase == "params" and r.step > 0:
            return self.carried_update(r)
        if r.phase == "optimizer" and r.slot_is("state"):
            return self.scales.state_from_grad(r)
        if r.phase == "backward" and r.slot_is("grad_output"):
            return self.scales.ctc_gradient(r)
        if r.phase == "optimizer" and r.slot_is("param"):
            return self.optimizer_update(r, t, details)
        return NOTHING

    def gradient_sum(self, r: TraceEntry, how: str, details: dict[str, Any]) -> Extra:
        """A parameter gradient's sum over positions: a bias's coherent error and its kernel's
        own low-precision sum (:meth:`Scales.bias_sum_error`); from samples, a norm's weight's
        low-precision sum (:meth:`Scales.norm_sum_allowance`)."""
        if r.slot == "param.bias" and len(r.shape) == 1:
            extra = self.scales.bias_sum_error(r, how)
            if extra[0]:
                details["bias_sum_error"] = extra[0]
            return extra
        if how != "full":
            extra = self.scales.norm_sum_allowance(r)  # a norm's weight, from samples
            if extra[0]:
                details["low_precision_sum_allowance"] = extra[0]
            return extra
        return NOTHING

    def carried_update(self, r: TraceEntry) -> Extra:
        """The state before step s is the state after step s-1, the same tensor: its measured
        error, and at least what that entry was allowed (a sample measures other positions)."""
        before = TraceKey(r.step - 1, "optimizer", r.module, 0, r.slot)
        prev = self.ledger.errors.get(before)
        extra = (prev.rms, prev.max) if prev is not None else NOTHING
        allowed = self.ledger.floors.get(before)
        if allowed is not None:
            extra = (max(extra[0], allowed[0]), max(extra[1], allowed[1]))
        return extra

    def optimizer_update(self, r: TraceEntry, t: TraceEntry, details: dict[str, Any]) -> Extra:
        """A share of the reference's own update (rounding may flip it, C_UPDATE), twice its
        largest element; where the gradient is below its own rounding noise (terms that cancel),
        an adaptive optimizer turns that noise into full-size steps on both runs: twice the
        larger run's update."""
        upd_rms, upd_max = self.scales.update(r)
        extra_rms, extra_max = C_UPDATE * upd_rms, 2.0 * upd_max
        g = self.index.by_align.get(r.align._replace(phase="grads", call=0))
        if g is not None:
            err_g = self.ledger.errors.get(g.align, NONE)
            rel_g = linear_rel(err_g.rms, rms_of(g.stats))  # error / the gradient's own rms
            if rel_g > NOISE_GRAD:
                t_rms, t_max = self.scales.update(r, target=t)
                extra_rms = max(extra_rms, 2.0 * max(upd_rms, t_rms))
                extra_max = max(extra_max, 2.0 * max(upd_max, t_max))
                details["gradient_below_noise"] = rel_g
        return extra_rms, extra_max

    def norm_parameters(self, r: TraceEntry, scale: Scale) -> Extra | None:
        """y = gamma xhat + beta: a norm's parameters' absolute errors enter its output as they
        are, where a relative error capped at 1 says too little (a zero-initialised bias that
        Adam stepped by +-lr from noise: hf_mobilevitv2, 58x its value); KAPPA_PARAM of them."""
        if not (r.phase == "forward" and r.slot_is("output") and r.meta.get("kind") in ("norm", "batchnorm")):
            return None
        p_rms, p_max = self.magnitudes.norm_param_error(r, scale.ref_rms)
        return KAPPA_PARAM * p_rms, KAPPA_PARAM * p_max

    @staticmethod
    def softmax_logits(u: float, logits: float, scale: Scale) -> Extra | None:
        """exp turns a logit's rounding u|x| into a relative error u|x| of its weight (the
        largest logit of the call's softmax, :meth:`Scales.logit_max`, when over 1)."""
        if not logits > 1.0:
            return None
        return u * logits * scale.rms, u * logits * scale.max

    def grid_rounding(self, r: TraceEntry, details: dict[str, Any]) -> Extra | None:
        """The model's code rounded a forward entry to a grid: elements near a boundary may
        land a step apart (:meth:`Decisions.rounding_allowance`)."""
        rounded = self.decisions.rounding_allowance(r) if r.phase == "forward" else None
        if rounded is None:
            return None
        details["rounding"] = rounded[2]
        return rounded[0], rounded[1]

    @staticmethod
    def rank_split(r: TraceEntry, t: TraceEntry, details: dict[str, Any]) -> Extra | None:
        """A logical tensor that a reduction across N ranks made (meta ``rank_split``, written by
        compare/layouts.py: a gradient all-reduced or reduce-scattered, the loss's mean): the
        collective adds N partial sums in the tensor's own dtype, up to N - 1 roundings more
        than one process's sum: sqrt(N) u of its rms, N u of its largest element, u of the
        dtype of the side that was split."""
        extra = None
        for side in (r, t):
            n = side.meta.get("rank_split")
            if not isinstance(n, int) or n < 2 or not dtypes.is_float(side.dtype):
                continue
            u = dtypes.unit_roundoff(side.dtype)
            term = (math.sqrt(n) * u * rms_of(r.stats), n * u * (r.stats.get("absmax") or 0.0))
            extra = term if extra is None else (max(extra[0], term[0]), max(extra[1], term[1]))
        if extra is not None:
            details["rank_split_allowance"] = extra[0]
        return extra

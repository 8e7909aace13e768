"""What an entry inherits: the error of the entries it depends on (compare/index.py), relative to
its own scale, where the floor is built on it (method of the Comparison).

A relative error is capped at 1 (floor.REL_CAP) for what a nonlinear op makes of it. Where the op
is linear or the dependency is the very same tensor, the absolute error passes on instead (a
gradient J^T g, a parameter updated in place, an nn.Identity, a mean over a pure-noise stream).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.measure import rms_of
from driftcheck.compare.norms import through_norm
from driftcheck.compare.propagation import Propagated
from driftcheck.numerics import floor as fl

REL_LINEAR_CAP = 1e12  # a linear map passes on any relative error (finite: the floor stays a number)
SQUARED_STATE = ("exp_avg_sq", "square_avg", "max_exp_avg_sq")  # optimizer state of g^2


def _same_values(a: Any, b: Any) -> bool:
    """Shapes of the same tensor up to a flatten of its leading dims (a BatchNorm1d over the
    tokens of a (batch, tokens, channels) stream sees (batch * tokens, channels))."""
    a, b = list(a), list(b)
    return a == b or (bool(a) and bool(b) and a[-1] == b[-1] and math.prod(a) == math.prod(b))


def _identical(d: TraceEntry, r: TraceEntry) -> bool:
    """Whether the reference recorded the same nonzero values for ``d`` and ``r`` (the same
    tensor, passed on unchanged), by their whole-tensor statistics."""
    a, b = d.stats, r.stats
    return bool(a.get("l2")) and all(a.get(k) == b.get(k) for k in ("numel", "l2", "mean", "min", "max"))


MEAN_SAME = 1e-4  # two float32 means of the same terms agree to this (relative)
MEAN_FAR = 1e-3  # ... and a mean this far from zero (relative to the rms) says which terms


def _mean_of(r: TraceEntry, d: TraceEntry) -> bool:
    """Whether ``r`` holds means over groups of ``d`` (fewer elements of a smaller rms, the same
    overall mean, that mean clear of zero), by their reference statistics."""
    n_r, n_d = r.stats.get("numel") or 0, d.stats.get("numel") or 0
    m_r, m_d = r.stats.get("mean"), d.stats.get("mean")
    if not (0 < n_r < n_d and n_d % n_r == 0) or m_r is None or m_d is None:
        return False
    rms_d = rms_of(d.stats)
    return rms_of(r.stats) < rms_d and abs(m_d) >= MEAN_FAR * rms_d \
        and abs(m_r - m_d) <= MEAN_SAME * abs(m_d)


def _noise(d: TraceEntry, x: Propagated) -> bool:
    """Whether dependency ``d`` is pure noise: its error at least its own reference rms."""
    return x.rms > 0 and x.rms >= rms_of(d.stats)


def _same_tensor(r: TraceEntry, kind: str | None) -> Callable[[TraceEntry], bool] | None:
    """Which dependencies of ``r`` may hold its very values (then their absolute error is its
    own), or None where none does."""
    if r.phase == "backward" and r.slot.startswith("grad_output"):
        return lambda d: d.phase == "backward"
    if r.phase == "optimizer" and r.slot.startswith("param."):
        # the parameter updated in place (p - lr * step): its value before the step is a term
        # (a zero-initialised key bias that Adam stepped by +-lr from noise on one run only)
        return lambda d: d.phase == "params" and d.slot == r.slot
    if kind != "composite":
        return None
    if r.phase == "backward" and r.slot.startswith("grad_input"):
        return lambda d: d.phase == "backward" and d.module != r.module and d.slot.startswith("grad_input")
    if r.phase == "forward" and r.slot.startswith("output"):
        return lambda d: d.phase == "forward" and d.module != r.module and d.slot.startswith("output")
    return None


def _linear_rel(err: float, scale: float) -> float:
    """err/scale, uncapped below REL_LINEAR_CAP: 0 for no error, the cap over a zero scale."""
    if err == 0.0 or math.isnan(err):
        return 0.0
    return min(err / scale, REL_LINEAR_CAP) if scale > 0 else REL_LINEAR_CAP


class Inheritance:
    """The inheritance part of :class:`driftcheck.compare.Comparison`."""

    def _inherited(self, r: TraceEntry, how: str, deps: list[TraceEntry], inh: list[Propagated],
                   ref_rms: float, ref_max: float, scale_rms: float, scale_max: float,
                   gain: float, gain_max: float, details: dict[str, Any]) -> tuple[float, float]:
        """(rms, max) relative error ``r`` inherits from its dependencies ``deps`` (their
        propagated errors ``inh``), relative to its floor's scale."""
        meta = r.meta
        inh_rms = max((x.rel_rms for x in inh), default=0.0)
        inh_max = max((x.rel_max for x in inh), default=0.0)
        if through_norm(r):
            # A norm divides by its input's spread: what counts is the error relative to the
            # input's value, not to the operand magnitude it came with (mu > 1 where it cancelled).
            inh_rms = max(inh_rms, max((min(x.rel_rms * x.mu, fl.REL_CAP) for x in inh), default=0.0))
            inh_max = max(inh_max, max((min(x.rel_max * x.mu, fl.REL_CAP) for x in inh), default=0.0))
        if r.phase == "forward" and r.slot.startswith("output") and meta.get("kind") in ("norm", "batchnorm"):
            # full mode: the input's error through the norm itself, group by group (norms.py)
            lin = self._norm_inherited(r, how)
            if lin is not None and scale_rms > 0:
                details["norm_propagated"] = lin[0]
                inh_rms = max(inh_rms, lin[0] / (scale_rms * gain))
                if scale_max > 0:
                    inh_max = max(inh_max, lin[1] / (scale_max * gain_max))
        same = _same_tensor(r, meta.get("kind"))
        if ref_rms > 0:
            # A tensor of the same values that reached this one brings its absolute error: a
            # child's input gradient that is this gradient (through a residual add, or a
            # composite's input gradient, its first child's), a composite's output that is its
            # last child's, and any dependency whose reference values are this entry's (an
            # nn.Identity's input is the output of the conv before it). Where that tensor
            # cancelled (a BatchNorm over two values), its relative error says less. Not
            # capped: it is the same tensor (or a term of it).
            for d, x in zip(deps, inh):
                if ((same is not None and same(d)) or _identical(d, r)) and _same_values(d.shape, r.shape):
                    inh_rms = max(inh_rms, _linear_rel(x.rms, ref_rms))
                    if ref_max > 0:
                        inh_max = max(inh_max, _linear_rel(x.max, ref_max))
        if r.phase == "forward" and r.slot.startswith("output") and meta.get("kind") == "composite" \
                and ref_rms > 0:
            # A tensor that is pure noise (its error over its own size, capped) says nothing of
            # the scale of what the composite's code makes of it: a mean over a noise stream
            # (hf_mobilevitv2's pooler, 140% of its input off) is far smaller than its terms,
            # and carries up to their absolute error.
            for d, x in zip(deps, inh):
                if d.phase == "forward" and _noise(d, x):
                    inh_rms = max(inh_rms, _linear_rel(x.rms, ref_rms))
                    if ref_max > 0:
                        inh_max = max(inh_max, _linear_rel(x.max, ref_max))
        if r.phase == "forward" and r.slot.startswith("input") and ref_rms > 0:
            # A mean the parent's code took over a child's output (a global context pooled over
            # the map, FocalNet's modulation): its error is at most the terms' absolute one
            # (|mean(e)| <= rms(e)), which is far more than their relative error says where the
            # terms cancel (a mean 20x below their rms: 3.6). Known by its mean: the same.
            for d, x in zip(deps, inh):
                if d.phase == "forward" and d.slot.startswith("output") and _mean_of(r, d):
                    inh_rms = max(inh_rms, _linear_rel(x.rms, ref_rms))
                    if ref_max > 0:
                        inh_max = max(inh_max, _linear_rel(x.max, ref_max))
        if r.phase == "optimizer" and r.slot.startswith("buffer."):
            # A running statistic adds momentum x the batch's mean (or variance): linear in its
            # input, whose error relative to its own size passes on uncapped (a conv's output
            # that is pure noise, 30x its reference: hf_mobilevitv2's running mean at 3.9)
            for d, x in zip(deps, inh):
                if d.phase == "forward" and _noise(d, x):
                    inh_rms = max(inh_rms, _linear_rel(x.rms, rms_of(d.stats)))
                    inh_max = max(inh_max, _linear_rel(x.max, d.stats.get("absmax") or 0.0))
        if r.phase in ("grads", "backward"):
            # A gradient is linear in the gradients it is computed from (J^T g): their error
            # relative to their own scale passes on uncapped, where a BatchNorm over two values
            # made one pure noise many times its reference's size (timm_rexnet, timm_levit).
            # A Linear/Conv weight's gradient (g^T x) is linear in its forward input as well: an
            # input that is pure noise (hf_mobilevitv2's pooled features under autocast: a
            # classifier's weight gradient at 4.4) passes its error on uncapped too.
            weight = r.phase == "grads" and r.slot == "param.weight" and self._owner_kind(r) in ("linear", "conv")
            for d, x in zip(deps, inh):
                if d.phase == "backward" or (weight and d.phase == "forward" and d.slot.startswith("input")):
                    inh_rms = max(inh_rms, _linear_rel(x.rms, x.mu * rms_of(d.stats)))
                    inh_max = max(inh_max, _linear_rel(x.max, x.mu * (d.stats.get("absmax") or 0.0)))
        if r.phase == "backward" and r.slot.startswith("grad_input") and ref_max > 0 \
                and r.meta.get("kind") in ("linear", "conv"):
            # Its input gradient is g W: an error in one element of g (a kink flip after the
            # layer) reaches each input it touches times one weight, |W|max at most, wherever
            # that lands relative to the gradient's own max (timm_fastvit's depthwise 1x1 conv:
            # a flip at a channel of weight ~1 where the largest gradient had a small one, 3.86).
            w = self.ref_index.by_align.get((r.step, "params", r.module, 0, "param.weight"))
            w_max = (w.stats.get("absmax") or 0.0) if w is not None else 0.0
            for d, x in zip(deps, inh):
                if w_max and d.phase == "backward" and d.module == r.module \
                        and d.slot.startswith("grad_output"):
                    # measured, or as passed on (kink flips a sample does not hold: judge.py)
                    g_max = max(x.max, x.rel_max * x.mu * (d.stats.get("absmax") or 0.0))
                    inh_max = max(inh_max, _linear_rel(g_max * w_max, ref_max))
        if r.phase == "optimizer" and r.slot.endswith(SQUARED_STATE):
            # a second moment squares the gradient: twice its relative error, before KAPPA
            inh_rms, inh_max = 2.0 * inh_rms, 2.0 * inh_max
        return inh_rms, inh_max

"""What an entry inherits: the error of the entries it depends on (compare/index.py), relative to
its own scale, where the floor is built on it: a pipeline of named terms, each raising the
inherited (rms, max) where it applies.

A relative error is capped at 1 (floor.REL_CAP) for what a nonlinear op makes of it. Where the op
is linear or the dependency is the very same tensor, the absolute error passes on instead (a
gradient J^T g, a parameter updated in place, an nn.Identity, a mean over a pure-noise stream).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from driftcheck.compare.entries import TraceEntry, gradient_slot, identical
from driftcheck.compare.index import DependencyIndex
from driftcheck.compare.measure import rms_of
from driftcheck.compare.norms import Norms, through_norm
from driftcheck.compare.propagation import Propagated
from driftcheck.compare.slices import Slices
from driftcheck.numerics import floor as fl
from driftcheck.store.keys import TraceKey

REL_LINEAR_CAP = 1e12  # a linear map passes on any relative error (finite: the floor stays a number)
SQUARED_STATE = ("exp_avg_sq", "square_avg", "max_exp_avg_sq")  # optimizer state of g^2


def _same_values(a: Any, b: Any) -> bool:
    """Shapes of the same tensor up to a flatten of its leading dims (a BatchNorm1d over the
    tokens of a (batch, tokens, channels) stream sees (batch * tokens, channels))."""
    a, b = list(a), list(b)
    return a == b or (bool(a) and bool(b) and a[-1] == b[-1] and math.prod(a) == math.prod(b))


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
    if r.phase == "backward" and r.slot_is("grad_output"):
        return lambda d: d.phase == "backward"
    if r.phase == "optimizer" and r.slot_is("param"):
        # the parameter updated in place (p - lr * step): its value before the step is a term
        # (a zero-initialised key bias that Adam stepped by +-lr from noise on one run only)
        return lambda d: d.phase == "params" and d.slot == r.slot
    if kind != "composite":
        return None
    if r.phase == "backward" and r.slot_is("grad_input"):
        return lambda d: d.phase == "backward" and d.module != r.module and d.slot_is("grad_input")
    if r.phase == "forward" and r.slot_is("output"):
        return lambda d: d.phase == "forward" and d.module != r.module and d.slot_is("output")
    return None


def linear_rel(err: float, scale: float) -> float:
    """err/scale, uncapped below REL_LINEAR_CAP: 0 for no error, the cap over a zero scale."""
    if err == 0.0 or math.isnan(err):
        return 0.0
    return min(err / scale, REL_LINEAR_CAP) if scale > 0 else REL_LINEAR_CAP


@dataclasses.dataclass(frozen=True)
class Scale:
    """An entry's size: the reference's rms and absmax, the floor's scale (at least the operand
    magnitude, where terms cancel) and the factor a norm's mean subtraction amplifies it by."""

    ref_rms: float
    ref_max: float
    rms: float
    max: float
    gain: float = 1.0
    gain_max: float = 1.0


@dataclasses.dataclass(frozen=True)
class Inherit:
    """What one entry inherits from: its dependencies and their propagated errors."""

    r: TraceEntry
    how: str  # what it is measured on: "full", "sample" or "stats"
    deps: list[TraceEntry]
    inh: list[Propagated]
    scale: Scale
    details: dict[str, Any]


Rel = tuple[float, float]  # (rms, max) relative error


class Inheritance:
    """The relative error an entry inherits: the largest of its dependencies', raised by the
    terms below where the op passes absolute error on (each a method, applied in order)."""

    def __init__(self, index: DependencyIndex, norms: Norms, slices: Slices | None = None) -> None:
        self.index, self.norms, self.slices = index, norms, slices
        self._l1: dict[str, float | None] = {}  # an output gradient's l1 norm, by key

    def inherited(self, x: Inherit) -> Rel:
        """(rms, max) relative error ``x.r`` inherits from its dependencies ``x.deps`` (their
        propagated errors ``x.inh``), relative to its floor's scale."""
        rel = (max((p.rel_rms for p in x.inh), default=0.0), max((p.rel_max for p in x.inh), default=0.0))
        for term in (self.through_norm, self.norm_propagated, self.same_tensor, self.slice_of,
                     self.loss_of_outputs, self.composite_noise,
                     self.mean_of_output, self.running_statistic, self.linear_gradient,
                     self.weight_times_flip, self.squared_moment):
            rel = term(x, rel)
        return rel

    @staticmethod
    def through_norm(x: Inherit, rel: Rel) -> Rel:
        """A norm divides by its input's spread: what counts is the error relative to the
        input's value, not to the operand magnitude it came with (mu > 1 where it cancelled)."""
        if not through_norm(x.r):
            return rel
        return (max(rel[0], max((min(p.rel_rms * p.mu, fl.REL_CAP) for p in x.inh), default=0.0)),
                max(rel[1], max((min(p.rel_max * p.mu, fl.REL_CAP) for p in x.inh), default=0.0)))

    def norm_propagated(self, x: Inherit, rel: Rel) -> Rel:
        """A norm's output in full mode: the input's error through the norm itself, group by
        group (norms.py)."""
        r, sc = x.r, x.scale
        if not (r.phase == "forward" and r.slot_is("output") and r.meta.get("kind") in ("norm", "batchnorm")):
            return rel
        lin = self.norms.inherited(r, x.how)
        if lin is None or not sc.rms > 0:
            return rel
        x.details["norm_propagated"] = lin[0]
        inh_rms, inh_max = max(rel[0], lin[0] / (sc.rms * sc.gain)), rel[1]
        if sc.max > 0:
            inh_max = max(inh_max, lin[1] / (sc.max * sc.gain_max))
        return inh_rms, inh_max

    @staticmethod
    def _absolute(x: Inherit, rel: Rel, passes: Callable[[TraceEntry, Propagated], bool]) -> Rel:
        """``rel`` raised by the absolute error of the dependencies that ``passes`` (relative to
        the entry's own rms and absmax, uncapped)."""
        inh_rms, inh_max = rel
        ref_rms, ref_max = x.scale.ref_rms, x.scale.ref_max
        for d, p in zip(x.deps, x.inh):
            if passes(d, p):
                inh_rms = max(inh_rms, linear_rel(p.rms, ref_rms))
                if ref_max > 0:
                    inh_max = max(inh_max, linear_rel(p.max, ref_max))
        return inh_rms, inh_max

    def same_tensor(self, x: Inherit, rel: Rel) -> Rel:
        """A tensor of the same values that reached this one brings its absolute error: a
        child's input gradient that is this gradient (through a residual add, or a composite's
        input gradient, its first child's), a composite's output that is its last child's, and
        any dependency whose reference values are this entry's (an nn.Identity's input is the
        output of the conv before it). Where that tensor cancelled (a BatchNorm over two
        values), its relative error says less. Not capped: it is the same tensor (or a term)."""
        r = x.r
        same = _same_tensor(r, r.meta.get("kind"))
        if not x.scale.ref_rms > 0:
            return rel
        return self._absolute(x, rel, lambda d, _: ((same is not None and same(d)) or identical(d, r))
                              and _same_values(d.shape, r.shape))

    def slice_of(self, x: Inherit, rel: Rel) -> Rel:
        """A forward tensor cut from one it depends on (compare/slices.py: a class token split
        off a stage's output) holds its source's absolute error: a slice small by cancellation
        carries its neighbours' error, not the source's relative error times its own size."""
        r, slices = x.r, self.slices
        if slices is None or r.phase != "forward" or not x.scale.ref_rms > 0:
            return rel
        return self._absolute(x, rel, lambda d, _: d.phase == "forward" and slices.cut_from(r, d))

    def loss_of_outputs(self, x: Inherit, rel: Rel) -> Rel:
        """The loss inherits its inputs' error through the loss function, to first order:
        |dL| <= sum |dL/dz| |dz| = ||g||_1 |dz|, g the model's output gradient the reference
        recorded (the backward of that output). Not the outputs' relative error times the loss:
        after a step that made the model confident, a cross-entropy of 0.005 moves by its logits'
        margin's absolute error (it is exponential in the margin), ten times the loss's share."""
        r = x.r
        if r.phase != "loss" or not x.scale.ref_rms > 0:
            return rel
        inh_rms, inh_max = rel
        for d, p in zip(x.deps, x.inh):
            g = self.index.by_align.get(TraceKey(r.step, "backward", d.module, d.call, gradient_slot(d.slot)))
            g_l1 = self._grad_l1(g) if g is not None and d.phase == "forward" else None
            if g_l1:
                inh_rms = max(inh_rms, linear_rel(g_l1 * p.rms, x.scale.ref_rms))
                if x.scale.ref_max > 0:
                    inh_max = max(inh_max, linear_rel(g_l1 * p.max, x.scale.ref_max))
        if (inh_rms, inh_max) != rel:
            x.details["loss_through_outputs"] = inh_rms
        return inh_rms, inh_max

    def _grad_l1(self, g: TraceEntry) -> float | None:
        """||g||_1 of a reference gradient: its full tensor, else its sample's mean |g| times
        its size (stats mode), else None."""
        if g.key not in self._l1:
            ref = self.slices.ref if self.slices is not None else None
            got = None
            for which in ("tensor", "sample"):
                t = ref.tensor(g.raw, which) if ref is not None and which in g.raw else None
                if t is not None and t.numel() and t.is_floating_point():
                    got = float(t.double().abs().sum()) * (1.0 if which == "tensor"
                                                           else math.prod(g.shape) / t.numel())
                    break
            self._l1[g.key] = got
        return self._l1[g.key]

    def composite_noise(self, x: Inherit, rel: Rel) -> Rel:
        """A tensor that is pure noise (its error over its own size, capped) says nothing of the
        scale of what a composite's code makes of it: a mean over a noise stream
        (hf_mobilevitv2's pooler, 140% of its input off) is far smaller than its terms, and
        carries up to their absolute error."""
        r = x.r
        if not (r.phase == "forward" and r.slot_is("output") and r.meta.get("kind") == "composite"
                and x.scale.ref_rms > 0):
            return rel
        return self._absolute(x, rel, lambda d, p: d.phase == "forward" and _noise(d, p))

    def mean_of_output(self, x: Inherit, rel: Rel) -> Rel:
        """A mean the parent's code took over a child's output (a global context pooled over
        the map, FocalNet's modulation): its error is at most the terms' absolute one
        (|mean(e)| <= rms(e)), which is far more than their relative error says where the
        terms cancel (a mean 20x below their rms: 3.6). Known by its mean: the same."""
        r = x.r
        if not (r.phase == "forward" and r.slot_is("input") and x.scale.ref_rms > 0):
            return rel
        return self._absolute(x, rel, lambda d, _: d.phase == "forward" and d.slot_is("output") and _mean_of(r, d))

    @staticmethod
    def running_statistic(x: Inherit, rel: Rel) -> Rel:
        """A running statistic adds momentum x the batch's mean (or variance): linear in its
        input, whose error relative to its own size passes on uncapped (a conv's output that
        is pure noise, 30x its reference: hf_mobilevitv2's running mean at 3.9)."""
        if not (x.r.phase == "optimizer" and x.r.slot_is("buffer")):
            return rel
        inh_rms, inh_max = rel
        for d, p in zip(x.deps, x.inh):
            if d.phase == "forward" and _noise(d, p):
                inh_rms = max(inh_rms, linear_rel(p.rms, rms_of(d.stats)))
                inh_max = max(inh_max, linear_rel(p.max, d.stats.get("absmax") or 0.0))
        return inh_rms, inh_max

    def linear_gradient(self, x: Inherit, rel: Rel) -> Rel:
        """A gradient is linear in the gradients it is computed from (J^T g): their error
        relative to their own scale passes on uncapped, where a BatchNorm over two values made
        one pure noise many times its reference's size (timm_rexnet, timm_levit). A Linear/Conv
        weight's gradient (g^T x) is linear in its forward input as well: an input that is pure
        noise (hf_mobilevitv2's pooled features under autocast: a classifier's weight gradient
        at 4.4) passes its error on uncapped too."""
        r = x.r
        if r.phase not in ("grads", "backward"):
            return rel
        weight = r.phase == "grads" and r.slot == "param.weight" and self.index.owner_kind(r) in ("linear", "conv")
        inh_rms, inh_max = rel
        for d, p in zip(x.deps, x.inh):
            if d.phase == "backward" or (weight and d.phase == "forward" and d.slot_is("input")):
                inh_rms = max(inh_rms, linear_rel(p.rms, p.mu * rms_of(d.stats)))
                inh_max = max(inh_max, linear_rel(p.max, p.mu * (d.stats.get("absmax") or 0.0)))
        return inh_rms, inh_max

    def weight_times_flip(self, x: Inherit, rel: Rel) -> Rel:
        """A Linear/Conv's input gradient is g W: an error in one element of g (a kink flip
        after the layer) reaches each input it touches times one weight, |W|max at most,
        wherever that lands relative to the gradient's own max (timm_fastvit's depthwise 1x1
        conv: a flip at a channel of weight ~1 where the largest gradient had a small one, 3.86)."""
        r, ref_max = x.r, x.scale.ref_max
        if not (r.phase == "backward" and r.slot_is("grad_input") and ref_max > 0
                and r.meta.get("kind") in ("linear", "conv")):
            return rel
        w = self.index.by_align.get(TraceKey(r.step, "params", r.module, 0, "param.weight"))
        w_max = (w.stats.get("absmax") or 0.0) if w is not None else 0.0
        inh_max = rel[1]
        for d, p in zip(x.deps, x.inh):
            if w_max and d.phase == "backward" and d.module == r.module and d.slot_is("grad_output"):
                # measured, or as passed on (kink flips a sample does not hold: judge.py)
                g_max = max(p.max, p.rel_max * p.mu * (d.stats.get("absmax") or 0.0))
                inh_max = max(inh_max, linear_rel(g_max * w_max, ref_max))
        return rel[0], inh_max

    @staticmethod
    def squared_moment(x: Inherit, rel: Rel) -> Rel:
        """A second moment squares the gradient: twice its relative error, before KAPPA."""
        if x.r.phase == "optimizer" and x.r.slot.endswith(SQUARED_STATE):
            return 2.0 * rel[0], 2.0 * rel[1]
        return rel

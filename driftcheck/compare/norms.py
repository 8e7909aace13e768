"""Norms: the error a normalization's output inherits from its input, propagated exactly
through the norm's linearization where both inputs are recorded whole; how much a norm's
subtracted mean amplifies its input's error; the length of its groups.

y = gamma (x - mean) / sigma + beta moves, to first order, by

    dy = gamma / sigma (dx - mean(dx) - xhat mean(dx xhat))        (an RMSNorm: no mean(dx))

per normalization group. Its statistics sum over each group (the group's length K), so two
correct kernels that sum in another order (another thread count, another blocking) differ by
about sqrt(K) u in them: the floor's K for a norm's output and input gradient. A relative error
taken over the whole input assumes each group's error is in proportion to its own size; a group
far smaller than the rest (a distillation token of std 0.002 in a stream of rms 0.26, whose
parameter Adam stepped by +-lr) can carry 35% of its own size and is divided by that small
spread.
"""
from __future__ import annotations

import math

import torch

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader


class Norms:
    """What passes through the reference's norm calls (and what the target's inputs of them
    make of it)."""

    def __init__(self, index: DependencyIndex, ref: TraceReader, tgt: TraceReader,
                 tgt_map: dict[TraceKey, TraceEntry]) -> None:
        self.index, self.ref, self.tgt, self.tgt_map = index, ref, tgt, tgt_map

    def call(self, r: TraceEntry) -> Call | None:
        """The norm call whose statistics ``r`` went through: its own for a norm's output or
        input gradient; for a child's forward input, its parent's where the parent is a norm
        whose own code normalized it (timm's BatchNormAct2d calls F.batch_norm, then its
        ``drop`` and ``act`` children: drop's input is the norm's result, which a compiled
        target's fused reduction computes in another order); None for anything else."""
        if through_norm(r):
            return Call(r.step, r.module, r.call)
        if r.phase != "forward" or not r.slot_is("input"):
            return None
        call = self.index.parent_of(r)
        if call is None:
            return None
        outs = self.index.fwd_out.get(call, ())
        if not any(o.meta.get("norm_dims") and list(o.shape) == list(r.shape) for o in outs):
            return None
        # not the norm's own input handed on as it is (its statistics the same)
        if any(list(x.shape) == list(r.shape) and x.stats == r.stats
               for x in self.index.fwd_in.get(call, ())):
            return None
        return call

    def gain(self, r: TraceEntry) -> tuple[float, float]:
        """rms/std of a mean-subtracting norm's input (meta ``norm_gain`` of its output, and of
        its worst group ``norm_gain_max``): the factor by which subtracting the mean amplifies
        the error of its input, for its outputs and its input gradients, and for a child's
        input that its parent norm's code normalized (:meth:`call`); 1 for anything else."""
        if r.phase not in ("forward", "backward") or r.slot_is("grad_output"):
            return 1.0, 1.0
        call: Call | None = Call(r.step, r.module, r.call)
        if r.slot_is("input"):
            call = self.call(r)
            if call is None:
                return 1.0, 1.0
        outs = self.index.fwd_out.get(call, ()) if call is not None else ()
        g = max((float(e.meta.get("norm_gain") or 1.0) for e in outs), default=1.0)
        return g, max([g] + [float(e.meta.get("norm_gain_max") or 1.0) for e in outs])

    def k(self, r: TraceEntry) -> int | None:
        """The length of a norm call's groups (what its mean and variance sum over) for its
        output and its input gradients (and a child's input its code normalized: :meth:`call`),
        from the layout its forward output recorded; None for other entries and where no
        layout was recorded (or it does not fit the shape)."""
        call = self.call(r)
        if call is None:
            return None
        out = next((e for e in self.index.fwd_out.get(call, ()) if e.meta.get("norm_dims")), None)
        if out is None:
            return None
        return group_length(list(out.shape), out.meta["norm_dims"], out.meta.get("norm_groups"))

    def inherited(self, r: TraceEntry, how: str) -> tuple[float, float] | None:
        """(rms, max) of the first-order change of a norm call's output that its input's error
        causes (full mode, the call's ``norm_dims`` recorded); None where it cannot be computed."""
        dims = r.meta.get("norm_dims")
        if how != "full" or not dims:
            return None
        x_e = next(iter(self.index.fwd_in.get(Call(r.step, r.module, r.call)) or []), None)
        xt_e = self.tgt_map.get(x_e.align) if x_e is not None else None
        if x_e is None or xt_e is None:
            return None
        xr, xt = self.ref.tensor(x_e.raw), self.tgt.tensor(xt_e.raw)
        if xr is None or xt is None or xr.shape != xt.shape or not xr.is_floating_point():
            return None
        try:
            return self.propagate(r, xr.double(), xt.double() - xr.double(), dims)
        except (RuntimeError, IndexError, ValueError):
            return None  # a layout that does not fit the input (dims, groups): go without

    def propagate(self, r: TraceEntry, x: torch.Tensor, dx: torch.Tensor,
                  dims: list[int]) -> tuple[float, float] | None:
        """(rms, max) of the first-order change ``dy`` of the norm's output (module docstring)
        for an input ``x`` moved by ``dx``, through the reference's norm weight."""
        if not x.numel() or not torch.isfinite(dx).all():
            return None
        shape = x.shape
        groups = r.meta.get("norm_groups")
        if groups:
            x, dx = x.reshape(shape[0], groups, -1), dx.reshape(shape[0], groups, -1)
        eps = float(r.meta.get("norm_eps") or 0.0)
        if r.meta.get("norm_rms"):
            sd = (x.pow(2).mean(dims, keepdim=True) + eps).sqrt()
            xh = x / sd
            dy = (dx - xh * (dx * xh).mean(dims, keepdim=True)) / sd
        else:
            mu = x.mean(dims, keepdim=True)
            sd = (x.var(dims, unbiased=False, keepdim=True) + eps).sqrt()
            xh = (x - mu) / sd
            dy = (dx - dx.mean(dims, keepdim=True) - xh * (dx * xh).mean(dims, keepdim=True)) / sd
        dy = dy.reshape(shape)
        gamma = self.weight(r, shape, dims if not groups else [1])
        if gamma is None:
            return None
        dy = dy * gamma
        return float(dy.pow(2).mean().sqrt()), float(dy.abs().max()) if dy.numel() else 0.0

    def weight(self, r: TraceEntry, shape: torch.Size, dims: list[int]) -> torch.Tensor | float | None:
        """The reference's norm weight, shaped to broadcast against the input (1 without one;
        None where its layout is not the input's)."""
        w_e = next((p for p in self.index.params.get((r.step, r.module), ()) if p.slot == "param.weight"), None)
        if w_e is None:
            return 1.0
        w = self.ref.tensor(w_e.raw)
        if w is None:
            return None
        w = w.double()
        tail = list(shape[len(shape) - w.dim():]) if w.dim() <= len(shape) else None
        if dims == list(range(len(shape) - w.dim(), len(shape))) and list(w.shape) == tail:
            return w  # a LayerNorm over its trailing dims
        if w.dim() == 1 and len(shape) > 1 and w.numel() == shape[1]:
            return w.reshape([1, -1] + [1] * (len(shape) - 2))  # per channel (BatchNorm, GroupNorm)
        return None


def through_norm(r: TraceEntry) -> bool:
    """Whether ``r`` is a norm call's output or input gradient (what passes through the norm)."""
    return r.meta.get("kind") in ("norm", "batchnorm") and (
        (r.phase == "forward" and r.slot_is("output")) or (r.phase == "backward" and r.slot_is("grad_input")))


def group_length(shape: list[int], dims: list[int], groups: int | None) -> int | None:
    """How many elements one normalization group of a tensor of ``shape`` holds: the product of
    ``dims`` (after reshaping to (N, groups, -1) where ``groups`` is given); None where the
    layout does not fit the shape."""
    if groups:
        g = int(groups)
        if len(shape) < 2 or shape[0] <= 0 or g <= 0 or shape[1] % g or list(dims) != [2]:
            return None
        return math.prod(shape[1:]) // g or None
    if not dims or any(not isinstance(d, int) or not -len(shape) <= d < len(shape) for d in dims):
        return None
    return math.prod(shape[d] for d in dims) or None

"""What the tracer records about a module besides its tensors: its kind, reduction lengths and
operand magnitudes (the noise floor's inputs), its kinks or selection, and the kink profile of
a ReLU's input (what the module's code computes inside is watched by record/watch.py).

Computed on the tensors' device with no host sync; compare reads them from each entry's meta.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.numerics import chunks, passes
from driftcheck.targets import deferred
from driftcheck.targets.deferred import DEFERRED_TYPES


def floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def is_leaf(m: nn.Module) -> bool:
    """A module without children: the unit local replay reruns (the one leaf check)."""
    return not any(True for _ in m.children())


def _dense(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a Linear-like leaf: nn.Linear, or Hugging Face's Conv1D (GPT-2's
    projections: weight (in, out), ``x @ W``)."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = getattr(m, "weight", None)
    if type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0]), int(w.shape[1])
    return None


def module_kind(m: nn.Module) -> tuple[str, int | None]:
    """A coarse op kind and reduction length (forward) for the noise floor."""
    dense = _dense(m)
    if dense is not None:
        return "linear", dense[0]
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        # each output sums in_channels/groups x (kernel taps landing on it: kernel / stride)
        return "conv", max((m.in_channels // m.groups) * math.prod(m.kernel_size)
                           // math.prod(m.stride), 1)
    if isinstance(m, nn.modules.conv._ConvNd):
        return "conv", (m.in_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.Embedding):
        return "embedding", None
    if isinstance(m, (nn.LayerNorm, nn.GroupNorm)) or type(m).__name__.lower().endswith("rmsnorm"):
        return "norm", None
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return "batchnorm", None
    if is_leaf(m):
        return "elementwise", None
    return "composite", None


def grad_input_k(m: nn.Module) -> int | None:
    """The reduction length of a Linear/Conv's input gradient: each input element sums over
    the outputs it fed (out_features; out_channels/groups x the kernel taps that cover it)."""
    dense = _dense(m)
    if dense is not None:
        return dense[1]
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return (m.out_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.modules.conv._ConvNd):
        return max((m.out_channels // m.groups) * math.prod(m.kernel_size) // math.prod(m.stride), 1)
    return None


# Piecewise functions: their gradient jumps where the input crosses a kink, so two runs'
# gradients differ in full at the few elements whose input rounding carried across one.
_KINKS_BY_NAME = (("hardswish", (-3.0, 3.0)), ("hard_swish", (-3.0, 3.0)),
                  ("hardsigmoid", (-3.0, 3.0)), ("hard_sigmoid", (-3.0, 3.0)),
                  ("hardmish", (-2.0, 0.0)), ("hard_mish", (-2.0, 0.0)),
                  ("relu6", (0.0, 6.0)), ("relu", (0.0,)), ("threshold", (0.0,)))
# Ops that select among their inputs (max/min pooling): rounding flips the choice where two
# candidates tie within it; their gradient then moves to another element. (A top-k router is
# not one: a flipped expert changes its token's whole input gradient row, not one element.)
_SELECTION_NAMES = ("maxpool", "max_pool", "minpool", "min_pool")


def piecewise(m: nn.Module) -> dict[str, Any]:
    """``{"kinks": [...]}`` for a piecewise activation, ``{"selection": True}`` for an op that
    selects, {} otherwise (compare judges such gradients' flips by count, not by the floor)."""
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.FractionalMaxPool2d,
                      nn.FractionalMaxPool3d)):
        return {"selection": True}
    if isinstance(m, nn.Hardtanh):  # ReLU6 too
        return {"kinks": [float(m.min_val), float(m.max_val)]}
    if isinstance(m, nn.Threshold):
        return {"kinks": [float(m.threshold)]}
    if isinstance(m, (nn.Hardshrink, nn.Softshrink)):
        return {"kinks": [-float(m.lambd), float(m.lambd)]}
    if isinstance(m, (nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.CELU, nn.SELU)):
        return {"kinks": [0.0]}
    name = type(m).__name__.lower()
    if any(s in name for s in _SELECTION_NAMES):
        return {"selection": True}
    for key, kinks in _KINKS_BY_NAME:
        if key in name:
            return {"kinks": list(kinks)}
    return {}


def static_meta(m: nn.Module) -> dict[str, Any]:
    """The part of a forward entry's meta that depends on the module alone."""
    kind, k = module_kind(m)
    meta: dict[str, Any] = {"module_type": type(m).__name__, "kind": kind}
    if k is not None:
        meta["k"] = k
    kg = grad_input_k(m)
    if kg is not None:
        meta["k_grad"] = kg
    if kind == "conv":
        meta["kernel"] = math.prod(cast(tuple[int, ...], m.kernel_size))
        if isinstance(m, nn.modules.conv._ConvNd) and not m.transposed and m.padding_mode == "zeros":
            # the layout compare/products.py convolves a weight's difference with
            pad = m.padding
            meta["conv"] = {"stride": list(m.stride), "dilation": list(m.dilation), "groups": m.groups,
                            "padding": pad if isinstance(pad, str) else list(pad)}
    if kind == "batchnorm":
        # a running mean sums momentum x the batch mean: its rounding scales with what it sums
        meta["momentum"] = m.momentum if m.momentum is not None else 1.0
    if type(m).__name__ == "_WeightNorm" and isinstance(getattr(m, "dim", None), int):
        meta["weight_norm_dim"] = m.dim  # torch.nn.utils.parametrizations.weight_norm
    if is_leaf(m):
        meta.update(piecewise(m))
    return meta


def call_k(static: dict[str, Any], args: tuple) -> int | None:
    """The reduction length of a call whose length depends on its inputs' shapes, else None.
    A weight norm ``g * v / ||v||`` sums v's squares over every dim but ``dim`` (all of them
    for dim -1); its gradients sum over the same elements (``<v/||v||, dW>``), so the one
    length is the forward's and the input gradients'."""
    dim = static.get("weight_norm_dim")
    if dim is None or len(args) < 2 or not isinstance(args[1], torch.Tensor) or args[1].dim() == 0:
        return None
    v = args[1]
    if dim == -1:
        return v.numel()
    return v.numel() // max(int(v.shape[dim]), 1)


def backward_meta(ctx: dict[str, Any]) -> dict[str, Any]:
    """A backward entry's meta from its forward call's: the module, and the reduction length of
    its input gradient as ``k``."""
    meta: dict[str, Any] = {k: ctx[k] for k in ("parent", "module_type", "kind", "conv") if k in ctx}
    if "k_grad" in ctx:
        meta["k"] = ctx["k_grad"]
    return meta


def _col_sumsq(x: torch.Tensor, k: int) -> torch.Tensor:
    """Column sums of squares of ``x`` seen as (-1, k): float32, on x's device; on the host, a
    contiguous float32/float64 ``x`` in one compiled pass (float64 sums) without a temporary."""
    if x.is_cpu and x.dtype in (torch.float32, torch.float64) and x.numel() <= passes.SMALL:
        return (x.reshape(-1, k).double() ** 2).sum(0).float()  # small: float64 sums, no numba
    if x.is_cpu and x.dtype in (torch.float32, torch.float64) and x.is_contiguous() and x.numel():
        from driftcheck.numerics import summary_kernels as kernels  # numba: imported where it is used

        out = np.empty(k, dtype=np.float64)
        chunks.col_sumsq(kernels.col_sumsq, kernels.flat_view(x), k, out)
        return torch.from_numpy(out).float()
    xs = x.reshape(-1, k)
    xs = xs if xs.dtype == torch.float32 else xs.float()
    return (xs * xs).sum(0)


def magnitude_sq(m: nn.Module, x: torch.Tensor,
                  weight_sq: dict[Any, tuple] | None = None) -> torch.Tensor | None:
    """mean over output elements of sum_i x_i^2 w_i^2: the squared rms of sqrt(|x|^2 @ |W|^2).

    The probabilistic scale of a dot product's rounding error (Higham & Mary 2019) is
    u * sqrt(sum_i (x_i w_i)^2); computed from column sums, it costs O(input + weight).
    ``weight_sq`` caches a Linear's column sums of w^2 by weight (id -> (version, sums)): the
    weights do not change between optimizer steps, and a module may be called many times; and
    an input's (key ("x", id)), for the projections that share it.
    """
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or not floating(x):
        return None
    # float32 is plenty for a magnitude (a scale, not a value) and keeps the cost near one
    # pass over the input and the weight
    acc = torch.float32
    with torch.no_grad():
        dense = _dense(m)
        if dense is not None and x.shape[-1] == dense[0]:
            k, n_out = dense
            cached = weight_sq.get(id(w)) if weight_sq is not None else None
            if cached is not None and cached[0] == w._version:
                sw = cached[1]
            else:
                linear = isinstance(m, nn.Linear)
                sw = _col_sumsq(w.detach() if linear else w.detach().t(), k)  # (K,)
                if weight_sq is not None:
                    weight_sq[id(w)] = (w._version, sw)
            xk = weight_sq.get(("x", id(x))) if weight_sq is not None else None
            if xk is not None and xk[0]() is x and xk[1] == (x._version, x.shape, x.stride()):
                sx = xk[2]  # the same input to another projection (q, k and v; gate and up)
            else:
                sx = _col_sumsq(x.detach(), k)
                if weight_sq is not None:
                    try:
                        weight_sq[("x", id(x))] = (weakref.ref(x), (x._version, x.shape, x.stride()), sx)
                    except (TypeError, RuntimeError):  # not weak-referenceable, no version
                        pass
            rows = max(x.numel() // k, 1)
            if x.device.type in DEFERRED_TYPES:  # no dot kernel there: a host fallback, a sync
                return (sx * sw.to(sx)).sum() / (rows * n_out)
            return torch.dot(sx, sw.to(sx)) / (rows * n_out)
        if isinstance(m, nn.modules.conv._ConvNd) and x.dim() >= 2 and x.shape[1] == m.in_channels:
            # weight (C_out, C_in/g, *kernel); a transposed one's is (C_in, C_out/g, *kernel),
            # and an output position of it gets ~kernel/stride taps
            g = m.groups
            dims = [0] + list(range(2, x.dim()))
            ex = x.detach().to(acc).pow(2).mean(dim=dims).reshape(g, -1)  # (g, C_in/g)
            wsq = w.detach().to(acc).pow(2).reshape(w.shape[0], w.shape[1], -1).sum(-1)
            wsq = wsq.reshape(g, w.shape[0] // g, w.shape[1])  # weight rows/g x columns
            if m.transposed:
                return (wsq * ex[:, :, None]).sum() / m.out_channels / math.prod(m.stride)
            return (wsq * ex[:, None, :]).sum() / m.out_channels
    return None


# Modules whose gradient jumps where the input crosses a kink (piecewise: ReLU's 0, a
# hard-swish's +-3): two runs' gradients differ in full at the few elements whose input
# rounding carried across one, a sparse error a stats-mode sample rarely holds. KINK_BINS + 1
# counts of the inputs' distances to the nearest kink (kink_profile) let compare estimate how
# many elements came that close (compare/kinks.py: _kink_estimate).
KINK_BINS = 40


def tie_profile(m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A max pool's kink profile: counts[k] = windows whose two largest inputs are within
    absmax(x) * 2^-k of each other (where rounding may flip the choice), on x's device. None
    for a selection this does not know how to rerun."""
    pools: dict[type, tuple[Callable[..., Any], int]] = {
        nn.MaxPool1d: (F.max_pool1d, 1), nn.MaxPool2d: (F.max_pool2d, 2),
        nn.MaxPool3d: (F.max_pool3d, 3), nn.AdaptiveMaxPool1d: (F.adaptive_max_pool1d, 1),
        nn.AdaptiveMaxPool2d: (F.adaptive_max_pool2d, 2),
        nn.AdaptiveMaxPool3d: (F.adaptive_max_pool3d, 3)}
    fn, dims = pools.get(type(m), (None, 0))
    if fn is None or not x.is_floating_point() or x.numel() == 0 or x.dim() <= dims:
        return None
    kw = dict(output_size=m.output_size) if hasattr(m, "output_size") else \
        dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding,
             dilation=m.dilation, ceil_mode=m.ceil_mode)
    with torch.no_grad():
        xf = x.detach().float()
        top, idx = fn(xf, return_indices=True, **kw)  # idx: flat positions in each plane
        spatial = xf.dim() - dims
        xs = xf.reshape(*xf.shape[:spatial], -1).clone()
        xs.scatter_(-1, idx.reshape(*idx.shape[:spatial], -1), -math.inf)
        second = fn(xs.reshape(xf.shape), **kw)
        gap = torch.where(torch.isfinite(second), top - second, torch.full_like(top, math.inf))
        return kink_profile_of(gap.reshape(-1), xf.abs().max())


def kink_profile(x: torch.Tensor, kinks: list[float] | tuple[float, ...] = (0.0,)) -> torch.Tensor:
    """counts[k] = elements whose distance to the nearest kink is <= absmax(x) * 2^-k (finite
    ones; k = 0..KINK_BINS, elements on a kink in every bin), on x's device: no sync."""
    with torch.no_grad():
        xf = x.detach().reshape(-1).float()
        d = xf.abs() if list(kinks) == [0.0] else \
            torch.stack([(xf - c).abs() for c in kinks]).amin(0)
        fin = torch.isfinite(xf)
        d = deferred.where(fin, d, math.nan)
        return kink_profile_of(d, deferred.where(fin, xf.abs(), 0.0).max()
                               if xf.numel() else xf.new_ones(()))


def kink_profile_of(d: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """counts[k] = finite distances d <= absmax * 2^-k, k = 0..KINK_BINS (zeros in every bin)."""
    with torch.no_grad():
        a = deferred.where(torch.isfinite(d), d, -1.0)  # -1: left out
        m = absmax.clamp(min=torch.finfo(torch.float32).tiny)
        if d.device.type in DEFERRED_TYPES:
            # the same counts without frexp (a host fallback there, so a sync): a/m <= 2^-k
            # compared with each exact power of two
            r = (a / m).reshape(-1)
            bounds = torch.pow(2.0, -torch.arange(KINK_BINS + 1, dtype=torch.float32)).to(r.device)
            kept = (r >= 0).unsqueeze(0)
            hits = (r.unsqueeze(0) <= bounds.unsqueeze(1)) | (bounds.unsqueeze(1) >= 1.0)
            return (hits & kept).sum(1)
        mant, exp = torch.frexp(a / m)  # a/m = mant * 2^exp, mant in [0.5, 1)
        # k: the largest with a/m <= 2^-k (a/m in (2^-k-1, 2^-k])
        k = (exp.neg() + (mant == 0.5).to(exp.dtype)).clamp(0, KINK_BINS)
        k = torch.where(a == 0, KINK_BINS, k)
        k = torch.where(a < 0, KINK_BINS + 1, k)
        flat = k.reshape(-1).to(torch.int64)
        # scatter_add_, not bincount: bincount reads the largest bin on the host (a sync on CUDA)
        hist = torch.zeros(KINK_BINS + 2, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))[:KINK_BINS + 1]
        return hist.flip(0).cumsum(0).flip(0)  # counts[k] = elements in bins >= k

"""What the tracer records about a module besides its tensors: its kind, reduction length and
operand magnitudes (the noise floor's inputs), and the kink profile of a ReLU's input.

Computed on the tensors' device with no host sync; compare reads them from each entry's meta.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def is_leaf(m: nn.Module) -> bool:
    """A module without children: the unit local replay reruns (the one leaf check)."""
    return not any(True for _ in m.children())


def module_kind(m: nn.Module) -> tuple[str, int | None]:
    """A coarse op kind and reduction length for the noise floor."""
    if isinstance(m, nn.Linear):
        return "linear", m.in_features
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


def static_meta(m: nn.Module) -> dict[str, Any]:
    """The part of a forward entry's meta that depends on the module alone."""
    kind, k = module_kind(m)
    meta: dict[str, Any] = {"module_type": type(m).__name__, "kind": kind}
    if k is not None:
        meta["k"] = k
    if kind == "conv":
        meta["kernel"] = math.prod(m.kernel_size)
    return meta


def magnitude_sq(m: nn.Module, x: torch.Tensor,
                  weight_sq: dict[int, tuple[int, torch.Tensor]] | None = None) -> torch.Tensor | None:
    """mean over output elements of sum_i x_i^2 w_i^2: the squared rms of sqrt(|x|^2 @ |W|^2).

    The probabilistic scale of a dot product's rounding error (Higham & Mary 2019) is
    u * sqrt(sum_i (x_i w_i)^2); computed from column sums, it costs O(input + weight).
    ``weight_sq`` caches a Linear's column sums of w^2 by weight (id -> (version, sums)): the
    weights do not change between optimizer steps, and a module may be called many times.
    """
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or not floating(x):
        return None
    # float32 is plenty for a magnitude (a scale, not a value) and keeps the cost near one
    # pass over the input and the weight
    acc = torch.float32
    with torch.no_grad():
        if isinstance(m, nn.Linear) and x.shape[-1] == w.shape[1]:
            k = w.shape[1]
            xs = x.detach().reshape(-1, k)
            if xs.dtype != acc:
                xs = xs.to(acc)
            cached = weight_sq.get(id(w)) if weight_sq is not None else None
            if cached is not None and cached[0] == w._version:
                sw = cached[1]
            else:
                wd = w.detach() if w.dtype == acc else w.detach().to(acc)
                sw = (wd * wd).sum(0)  # (K,)
                if weight_sq is not None:
                    weight_sq[id(w)] = (w._version, sw)
            rows = max(x.numel() // k, 1)
            return torch.dot((xs * xs).sum(0), sw) / (rows * w.shape[0])
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


# Modules whose gradient switches off where the input crosses zero: two runs' gradients differ
# in full at the few elements whose input rounding carried across it, a sparse error a stats-mode
# sample rarely holds. KINK_BINS + 1 counts of the input's magnitudes (kink_profile) let compare
# estimate how many elements came that close to zero (compare._kink_estimate).
KINK_MODULES = (nn.ReLU,)
KINK_BINS = 40


def kink_profile(x: torch.Tensor) -> torch.Tensor:
    """counts[k] = elements with |x| <= absmax * 2^-k (finite ones; k = 0..KINK_BINS, zeros in
    every bin), on x's device: no sync."""
    with torch.no_grad():
        a = x.detach().reshape(-1).abs().float()
        a = torch.where(torch.isfinite(a), a, torch.full_like(a, -1.0))  # -1: left out
        m = a.max().clamp(min=torch.finfo(torch.float32).tiny) if a.numel() else a.new_ones(())
        mant, exp = torch.frexp(a / m)  # a/m = mant * 2^exp, mant in [0.5, 1)
        # k: the largest with a/m <= 2^-k (a/m in (2^-k-1, 2^-k])
        k = (exp.neg() + (mant == 0.5).to(exp.dtype)).clamp(0, KINK_BINS)
        k = torch.where(a == 0, KINK_BINS, k)
        k = torch.where(a < 0, KINK_BINS + 1, k)
        hist = torch.bincount(k.reshape(-1), minlength=KINK_BINS + 2)[:KINK_BINS + 1]
        return hist.flip(0).cumsum(0).flip(0)  # counts[k] = elements in bins >= k

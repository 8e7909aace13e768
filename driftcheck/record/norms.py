"""What the tracer records about a norm call: how much subtracting the mean amplifies its input's
error (its gain), and how it groups its input (its layout, for compare to propagate the input's
error through it: compare/norms.py). Computed on the tensors' device with no host sync.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from driftcheck.targets import deferred


def norm_gain_sq(m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """[mean, max] over normalization groups of (rms / std)^2 of a mean-subtracting norm's input: how
    much subtracting the mean amplifies the input's error (a channel whose mean is far above its
    spread, as after a 1x1 spatial map with batch 2, cancels). The worst group's rms is at least the
    whole input's (a token far smaller than the stream it sits in, a channel of two close values);
    for a BatchNorm the mean over channels too. On x's device; None for others."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return None
    with torch.no_grad():
        xf = x.detach().float()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and xf.dim() >= 2:
            dims = [0] + list(range(2, xf.dim()))
            eps = m.eps
        elif isinstance(m, nn.LayerNorm):
            dims = list(range(xf.dim() - len(m.normalized_shape), xf.dim()))
            eps = m.eps
        elif isinstance(m, nn.GroupNorm) and xf.dim() >= 2:
            xf = xf.reshape(xf.shape[0], m.num_groups, -1)
            dims, eps = [2], m.eps
        elif isinstance(m, getattr(nn, "RMSNorm", ())) or "rmsnorm" in type(m).__name__.lower():
            # No mean to subtract: each row's own gain is 1, but a row far smaller than the
            # stream (which attention mixes into it) is divided by its own small rms.
            ms = xf.pow(2).mean(dim=-1)
            eps = float(getattr(m, "eps", None) or getattr(m, "variance_epsilon", None) or 1e-6)
            worst = (xf.pow(2).mean() / (ms + eps)).max().clamp(min=1.0)
            return torch.stack([torch.ones((), device=worst.device), worst])
        else:
            return None
        ms = xf.pow(2).mean(dim=dims)
        if xf.device.type in deferred.DEFERRED_TYPES:  # lazy has no var kernel: a host fallback
            var = (xf - xf.mean(dim=dims, keepdim=True)).pow(2).mean(dim=dims)
        else:
            var = xf.var(dim=dims, unbiased=False)
        g = (ms / (var + eps)).clamp(min=1.0).reshape(-1)
        # Groups computed from one stream (a Linear's output channels, attention's tokens) can
        # carry an error of the stream's size: a group far smaller than the rest (a channel of
        # a BatchNorm over two values, +-0.002 in a stream of rms 0.6; a token of small
        # activations) is amplified by the stream's rms over its own std. That bounds the
        # worst element; for a BatchNorm, whose channels are averaged over, the rms gain too.
        stream = xf.pow(2).mean() / (var + eps)
        worst = torch.maximum(g.max(), stream.max())
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return torch.stack([torch.maximum(g, stream).mean(), worst])
        return torch.stack([g.mean(), worst])  # the rms gain^2 and the worst group's


def norm_layout(m: nn.Module, x: Any) -> dict[str, Any] | None:
    """How a norm call normalizes its input ``x``, for compare to propagate the input's error
    through it: ``norm_dims`` (the dims each group spans; a GroupNorm's after reshaping to
    (N, groups, -1)), ``norm_groups``, ``norm_rms`` (no mean subtracted), ``norm_eps``. None for
    a BatchNorm in eval mode (it normalizes by its running statistics: a linear map) and for a
    norm whose layout it does not know."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    eps: Any = getattr(m, "eps", None)
    if eps is None:
        eps = getattr(m, "variance_epsilon", 1e-6)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        if not m.training:
            return None
        return {"norm_dims": [0] + list(range(2, x.dim())), "norm_eps": float(eps)}
    if isinstance(m, nn.GroupNorm):
        return {"norm_dims": [2], "norm_groups": int(m.num_groups), "norm_eps": float(eps)}
    if isinstance(m, nn.LayerNorm):
        shape = list(m.normalized_shape)
        n = len(shape)
        if list(x.shape[-n:]) == shape:
            return {"norm_dims": list(range(x.dim() - n, x.dim())), "norm_eps": float(eps)}
        if n == 1 and x.shape[1] == shape[0]:  # channels first (timm's LayerNorm2d)
            return {"norm_dims": [1], "norm_eps": float(eps)}
        return None
    if "rmsnorm" in type(m).__name__.lower():
        return {"norm_dims": [x.dim() - 1], "norm_rms": True, "norm_eps": float(eps)}
    return None

"""Per-tensor summary statistics computed on the tensor's own device, without a host sync.

The stats of many tensors are stacked into one small tensor so a step needs one transfer.
"""
from __future__ import annotations

import torch

# Column order of the stats vector; the manifest stores them under these names.
FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel")


def _acc_dtype(device: torch.device) -> torch.dtype:
    # float64 where the backend supports it; TPUs and MPS do not, float32 is enough for a summary.
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def stats_vector(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of len(FIELDS) on ``t``'s device: stats over the finite values of ``t``."""
    acc = _acc_dtype(t.device)
    if t.is_complex():
        t = t.abs()
    x = t.detach().reshape(-1).to(acc)
    n = x.numel()
    if n == 0:
        nan = torch.tensor(float("nan"), dtype=acc, device=t.device)
        zero = torch.zeros((), dtype=acc, device=t.device)
        return torch.stack([nan, nan, nan, nan, nan, zero, zero, zero, zero])
    finite = torch.isfinite(x)
    count = finite.sum().to(acc)
    xz = torch.where(finite, x, torch.zeros((), dtype=acc, device=x.device))
    safe = torch.clamp(count, min=1)
    mean = xz.sum() / safe
    var = torch.where(finite, (x - mean) ** 2, torch.zeros((), dtype=acc, device=x.device)).sum() / safe
    inf = torch.tensor(float("inf"), dtype=acc, device=x.device)
    mn = torch.where(finite, x, inf).min()
    mx = torch.where(finite, x, -inf).max()
    nofinite = count == 0
    nanv = torch.tensor(float("nan"), dtype=acc, device=x.device)
    return torch.stack([
        torch.where(nofinite, nanv, mn), torch.where(nofinite, nanv, mx),
        torch.where(nofinite, nanv, mean), torch.where(nofinite, nanv, var.sqrt()),
        xz.abs().max(), torch.linalg.vector_norm(xz),
        torch.isnan(x).sum().to(acc), torch.isinf(x).sum().to(acc),
        torch.tensor(float(n), dtype=acc, device=x.device),
    ])


def to_dict(vec: list[float]) -> dict[str, float | int]:
    """Host-side stats vector -> manifest dict (counts as ints)."""
    d: dict[str, float | int] = {}
    for name, v in zip(FIELDS, vec):
        d[name] = int(v) if name in ("nan", "inf", "numel") else float(v)
    return d

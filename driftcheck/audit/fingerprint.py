"""The view audit's fingerprint of a written base: four sums, compared as relative differences."""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FIELDS", "fingerprint", "same", "value_error"]

_WEIGHT_PERIOD = 251  # checksum weights 1 + (i mod 251)/251: position-sensitive, never zero
FIELDS = ("sum", "abs_sum", "checksum", "checksum_scale")


def fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """(sum, sum |x|, sum x*w, sum |x|*w) on t's device: cheap, dtype-robust, position-aware;
    exact for integer/bool tensors (int64, integer weights, wrapping mod 2^64: no rounding above
    2^53, and the same result in any summation order)."""
    if t.is_quantized:
        return None
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1)
    if x.is_floating_point():
        acc = torch.float64 if t.device.type in ("cpu", "cuda") else torch.float32
        x = x.to(acc)
        w = 1.0 + torch.remainder(torch.arange(x.numel(), device=x.device, dtype=acc),
                                  _WEIGHT_PERIOD) / _WEIGHT_PERIOD
    else:
        x = x.to(torch.int64)
        w = 1 + torch.remainder(torch.arange(x.numel(), device=x.device), _WEIGHT_PERIOD)
    a = x.abs()
    return torch.stack([x.sum(), a.sum(), (x * w).sum(), (a * w).sum()])


def same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def value_error(r: dict[str, float], t: dict[str, float]) -> float:
    """Largest fingerprint difference over its magnitude (not over the possibly-cancelled value)."""
    err = 0.0
    for value, scale in (("sum", "abs_sum"), ("checksum", "checksum_scale")):
        a, b = (math.nan if x is None else x for x in (r[value], t[value]))  # JSON non-finite
        if (math.isnan(a) and math.isnan(b)) or a == b:
            continue
        diff = abs(a - b)
        if math.isnan(diff) or math.isinf(diff):
            return math.inf
        magnitude = max(r[scale] or 0, t[scale] or 0)
        err = max(err, diff / magnitude if magnitude > 0 else math.inf)
    return err


def finite(value: dict[str, Any] | None) -> bool:
    """Whether a base's fingerprint was taken on finite values (one of memory that holds NaN/Inf
    bit patterns, ``torch.empty``'s, cannot show a write that changed it)."""
    return value is not None and bool(value) and all(
        isinstance(v, (int, float)) and math.isfinite(v) for v in value.values())

"""The watch: what a module's own code computes between its children, seen op by op (a torch
function mode over the forward). It records, per module call, the largest softmax logit that
carries weight, the frames of a CTC loss, and the margins of the decisions the code takes
(argmax, top-k, sort): inputs of the noise floor that no module boundary shows.

Computed on the tensors' device with no host sync; compare reads them from each entry's meta.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from driftcheck.numerics import chunks, passes
from driftcheck.record.calls import CallKey, Calls
from driftcheck.record.meta import kink_profile_of
from driftcheck.store.buffers import mapped_empty
from driftcheck.targets import deferred

# Softmax amplifies the rounding of its logits: a logit x carries u|x| of error, and exp turns
# it into a relative error u|x| of its weight (attention logits reach 100+). The largest
# |logit| that carries weight is recorded per module call (the module running the softmax).
_SOFTMAX = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax"})
LOGIT_SPAN = 40.0  # logits more than this below their row's max have no weight (e^-40)
_SDPA_BLOCK = 1 << 24  # logits recomputed for scaled_dot_product_attention, elements at a time


def _weighted_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| over the finite elements within LOGIT_SPAN of their row's finite max (masked
    ones are not), as a float32 scalar: max(largest kept value, -smallest kept value, 0), in
    four passes over x in its own dtype (no float32 copy of the logits)."""
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() \
            and dim % x.dim() == x.dim() - 1 and x.is_contiguous() and type(x) is torch.Tensor \
            and x.numel() > passes.SMALL:  # small logits: the torch ops below, no numba
        # On the host, softmax over the last dim: both scans of a row in one compiled call
        # while the row is in cache (the same float32 value as the torch ops below).
        from driftcheck.numerics import summary_kernels as k  # numba: imported where it is used

        return torch.tensor(chunks.row_max(k.weighted_absmax, k.flat_view(x), x.shape[-1], LOGIT_SPAN))
    if x.device.type in deferred.DEFERRED_TYPES:  # no amax/where kernels there: host fallbacks
        top = x.max(dim=dim, keepdim=True).values.float()
        fin = torch.isfinite(top)
        lo = deferred.where(fin, top - LOGIT_SPAN, math.inf)
        low = deferred.where(x >= lo, x, 0.0).min().float()
        high = deferred.where(fin, top, 0.0).max()
        return torch.maximum(torch.maximum(high, -low), torch.zeros_like(high))
    top = x.amax(dim=dim, keepdim=True).float()  # a row holding NaN or +inf keeps nothing
    fin = torch.isfinite(top)
    lo = torch.where(fin, top - LOGIT_SPAN, torch.full_like(top, math.inf))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    low = torch.where(x >= lo, x, zero).amin().float()  # x >= lo: in float32 or x's wider dtype
    high = torch.where(fin, top, torch.zeros_like(top)).amax()
    return torch.maximum(torch.maximum(high, -low), torch.zeros_like(high))


def _sdpa_logits_absmax(q: torch.Tensor, k: torch.Tensor, mask: Any, causal: bool,
                        scale: float | None, blocks: dict | None = None) -> torch.Tensor:
    """The weighted |logit| max of scaled_dot_product_attention, recomputed in row blocks; on
    the host into ``blocks["flat"]`` (one block the watch keeps for its next calls, grown)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.dim() >= 3 and k.dim() == q.dim() and q.shape[-3] != k.shape[-3] \
            and q.shape[-3] % k.shape[-3] == 0:  # grouped-query attention
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    lq, lk = q.shape[-2], k.shape[-2]
    rows = max(1, _SDPA_BLOCK // max(1, lk * (q.numel() // max(1, q.shape[-1] * lq))))
    best = torch.zeros((), device=q.device)
    kt = k.detach().float().transpose(-1, -2)
    for lo in range(0, lq, rows):
        # one block of logits allocated, scaled and masked in place (the same values as the
        # out-of-place ops: a 349M Llama's step allocated 1.2 GB more for their copies)
        qb = q.detach()[..., lo:lo + rows, :].float()
        shape = torch.broadcast_shapes(qb.shape[:-2], kt.shape[:-2]) + (qb.shape[-2], lk)
        if blocks is not None and q.device.type == "cpu":
            n = math.prod(shape)
            if blocks.get("flat") is None or blocks["flat"].numel() < n:  # one block, grown
                blocks["flat"] = mapped_empty((n,), torch.float32)  # never malloc's (buffers.py)
            s = torch.matmul(qb, kt, out=blocks["flat"][:n].view(shape)).mul_(scale)
        else:
            s = (qb @ kt).mul_(scale)
        if causal:
            i = torch.arange(lo, min(lo + rows, lq), device=q.device)[:, None]
            s.masked_fill_(torch.arange(lk, device=q.device)[None, :] > i + (lk - lq), -math.inf)
        if isinstance(mask, torch.Tensor):
            mk = mask[..., lo:lo + rows, :] if mask.dim() >= 2 and mask.shape[-2] == lq else mask
            if s.shape != torch.broadcast_shapes(s.shape, mk.shape):
                s = s.expand(torch.broadcast_shapes(s.shape, mk.shape)).clone()  # a mask wider than s
            if mk.dtype == torch.bool:
                s.masked_fill_(~mk, -math.inf)
            else:
                s.add_(mk.float())
        best = torch.maximum(best, _weighted_absmax(s, -1))
    return best


# A decision (argmax, top-k, sort) flips where rounding carries a score across its neighbour:
# the index a module computes differs between two runs at the few positions whose scores tie
# within their error. Per decision, its margin (the gap to the nearest competing score); their
# counts by gap (meta.kink_profile_of, relative to twice the row's largest |score|: bin 0 holds all)
# let compare judge how many computed indices may flip (compare/judge.py: _judge_integer).
_DECISIONS = frozenset({"argmax", "argmin", "topk", "sort", "argsort", "max", "min"})
DECISION_ELEMS = 1 << 24  # scores larger than this are not profiled (an extra top-k over them)


def decision_margins(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(margin of each index the op returns, the largest |score| of its row), both with the
    decision's dim last, for an index-producing op, on the scores' device; None where the op
    returns no index or the layout is not one this knows."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 and name != "topk" else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() < 2 \
            or x.numel() > DECISION_ELEMS:
        return None
    if name in ("max", "min") and not isinstance(dim, int):
        return None  # a value, not an index: a kink (max pooling), not a decision
    if name == "topk":
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    else:
        k, largest = 1, name in ("argmax", "max")
        if name in ("sort", "argsort"):
            largest = bool(args[2] if len(args) > 2 else kwargs.get("descending", False))
        if dim is None:
            if name in ("sort", "argsort"):
                dim = -1
            else:  # over the flattened tensor
                x, dim = x.reshape(-1), 0
    if not isinstance(dim, int) or not isinstance(k, int) or x.dim() == 0 or k < 1:
        return None
    n = x.shape[dim]
    if n < 2:
        return None
    if name in ("sort", "argsort"):
        k = n
    with torch.no_grad():
        s = x.detach().float()
        s = s if largest else -s
        s = torch.where(torch.isfinite(s), s, torch.full_like(s, -math.inf))
        top = s.topk(min(k + 1, n), dim=dim).values.movedim(dim, -1)
        gaps = top[..., :-1] - top[..., 1:]  # adjacent gaps, >= 0
        inf = torch.full_like(gaps[..., :1], math.inf)
        left = torch.cat([inf, gaps], -1)  # the gap to the score above each kept one
        right = torch.cat([gaps, inf], -1)  # ... and to the one below
        margin = torch.minimum(left, right)[..., :min(k, n)]
        xa = x.detach().float().abs()
        rowmax = torch.where(torch.isfinite(xa), xa, torch.zeros((), device=x.device)).amax(dim)
        return margin, rowmax.unsqueeze(-1)


def decision_profile(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """counts[k] = indices whose margin is <= 2 rowmax 2^-k, rowmax the largest |score| the
    decision chose among (counts[0]: every finite one)."""
    got = decision_margins(name, args, kwargs)
    if got is None:
        return None
    margin, rowmax = got
    rel = margin / (2.0 * rowmax).clamp(min=torch.finfo(torch.float32).tiny)
    return kink_profile_of(rel.reshape(-1), torch.ones((), device=rel.device))


# Rounding to a grid in the model's own code (a VAE's latents quantized to uint8 levels,
# fake quantization) flips an element by a whole step where its error carries it across a
# boundary. Per rounding, its margins (the distance to the nearest boundary) by size relative to
# 2 absmax of what is rounded, as decisions' (compare/decisions.py: _rounding_allowance).
_ROUNDINGS = frozenset({"round", "round_", "floor", "floor_", "ceil", "ceil_", "trunc", "trunc_"})


# A decision taken outside torch on values the code moved to the host (scipy's Hungarian
# matching of a DETR-style loss, on a cost matrix): no margin to record, but which elements
# receive a gradient may change on near ties. Counted per module call (meta "host_decisions").
_TO_HOST = frozenset({"__array__", "numpy", "tolist"})


def rounding_profile(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """counts[k] = elements whose distance to a rounding boundary is <= 2 absmax 2^-k."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0 \
            or x.numel() > DECISION_ELEMS:
        return None
    decimals = kwargs.get("decimals", 0) if name.startswith("round") else 0
    if not isinstance(decimals, int):
        return None
    with torch.no_grad():
        z = x.detach().float() * (10.0 ** decimals)
        frac = z - z.floor()
        # round: the boundary is at frac 0.5; floor/ceil/trunc: at the integers
        margin = (frac - 0.5).abs() if name.startswith("round") else torch.minimum(frac, 1.0 - frac)
        za = torch.where(torch.isfinite(z), z.abs(), torch.zeros((), device=z.device))
        return kink_profile_of(margin.reshape(-1) / (10.0 ** decimals),
                               2.0 * za.amax() / (10.0 ** decimals))


# every name ``LogitWatch._see`` acts on (any other torch function goes straight through)
_WATCHED = frozenset(_SOFTMAX | _DECISIONS | _TO_HOST | _ROUNDINGS
                     | {"cross_entropy", "ctc_loss", "scaled_dot_product_attention"})


class LogitWatch(TorchFunctionMode):
    """While active, ``on_logits(absmax)`` gets the weighted |logit| max of every softmax,
    cross-entropy and scaled_dot_product_attention call (a device scalar: no sync),
    ``on_ctc(frames)`` the time length of every CTC loss, and ``on_decision(profile)`` the
    margin profile of every argmax/argmin/top-k/sort and max/min over a dim,
    ``on_rounding(profile)`` that of every round/floor/ceil/trunc, and ``on_host()`` each float
    tensor taken to numpy."""

    def __init__(self, on_logits: Callable[[torch.Tensor], None],
                 on_ctc: Callable[[int], None] | None = None,
                 on_decision: Callable[[torch.Tensor], None] | None = None,
                 on_rounding: Callable[[torch.Tensor], None] | None = None,
                 on_host: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_rounding = on_rounding
        self.on_host = on_host
        self.on_logits = on_logits
        self.on_ctc = on_ctc  # the frames of a CTC loss computed by the current module's code
        self.blocks: dict = {}  # attention logits recomputed on the host: one block, reused
        self.on_decision = on_decision
        self.around: Callable[[], Any] | None = None  # a context around the watch's own work
        # The view audit paused around the watch's own ops (the logits it recomputes in place
        # into its block are the tracer's writes, not the model's: tests/record/test_watch.py)
        self.quiet: Callable[[], Any] = contextlib.nullcontext

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _WATCHED:
            with self.quiet():
                if self.around is None:
                    self._see(func, args, kwargs)
                else:
                    with self.around():
                        self._see(func, args, kwargs)
        return func(*args, **kwargs)

    def _see(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        name = getattr(func, "__name__", None)
        try:
            if name in _SOFTMAX or name == "cross_entropy":
                x = args[0] if args else kwargs.get("input")
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                    dim: Any  # an int, or whatever the call was given
                    if name == "cross_entropy":  # its softmax runs over the class dim
                        dim = 1 if x.dim() >= 2 else 0
                    else:
                        dim = args[1] if len(args) > 1 else kwargs.get("dim")
                    with torch.no_grad():
                        self.on_logits(_weighted_absmax(x, dim if isinstance(dim, int) else -1))
            elif name == "ctc_loss" and self.on_ctc is not None:
                lp = args[0] if args else kwargs.get("log_probs")
                if isinstance(lp, torch.Tensor) and lp.dim() >= 2:
                    self.on_ctc(int(lp.shape[0]))  # (T, N, C) or (T, C): no sync
            elif name == "scaled_dot_product_attention":
                q = args[0] if args else kwargs.get("query")
                k = args[1] if len(args) > 1 else kwargs.get("key")
                mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
                causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
                if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.numel():
                    with torch.no_grad():
                        scale = args[6] if len(args) > 6 else kwargs.get("scale")
                        self.on_logits(_sdpa_logits_absmax(q, k, mask, bool(causal), scale, self.blocks))
            elif name in _DECISIONS and self.on_decision is not None:
                prof = decision_profile(name, args, kwargs)
                if prof is not None:
                    self.on_decision(prof)
            elif name in _TO_HOST and self.on_host is not None:
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 1:
                    self.on_host()  # values decided on outside torch
            elif name in _ROUNDINGS and self.on_rounding is not None:
                prof = rounding_profile(name, args, kwargs)
                if prof is not None:
                    self.on_rounding(prof)
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError):
            pass  # a layout this does not know: the floor goes without the amplification


def own_work(fn: Callable) -> Callable:
    """``fn`` (a hook) with torch functions undispatched: the tracer's own ops (copies, stats,
    samples) stay out of any torch function mode around the step (the LogitWatch, a user's),
    which would otherwise see and cost a Python call for each of them."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return run


LOSS_CODE = ("", -1)  # the (module, call) key of what the loss code computes, outside any module


class WatchLog:
    """What the watch saw, per module call: each value keyed by the call running when the
    module's own code computed it (``LOSS_CODE`` outside any module), until the call's
    post-hook takes it (``take``). Nothing is kept while ``calls`` is inactive or replaying."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.around: Callable[[], Any] | None = None  # the watches' ``around`` (LogitWatch)
        self.quiet: Callable[[], Any] = contextlib.nullcontext  # the watches' ``quiet``
        self.blocks: dict = {}  # the watches' block of recomputed attention logits
        self.reset()

    def reset(self) -> None:
        # (module, call) -> |logit| max, CTC frames, margin counts of its decisions and
        # roundings, float tensors taken to the host
        self.logits: dict[CallKey, torch.Tensor] = {}
        self.ctc: dict[CallKey, int] = {}
        self.decisions: dict[CallKey, torch.Tensor] = {}
        self.roundings: dict[CallKey, torch.Tensor] = {}
        self.host_decisions: dict[CallKey, int] = {}

    def watch(self) -> LogitWatch:
        """A torch function mode that hands what it sees to this log."""
        mode = LogitWatch(self.on_logits, self.on_ctc, self.on_decision, self.on_rounding,
                          self.on_host)
        mode.around = self.around
        mode.quiet = self.quiet
        mode.blocks = self.blocks  # kept from step to step
        return mode

    def _taking(self) -> bool:
        return self.calls.active and not self.calls.replaying

    def on_ctc(self, frames: int) -> None:
        key = self.calls.top
        if key is None or not self._taking():
            return
        self.ctc[key] = max(self.ctc.get(key, 0), frames)

    def on_decision(self, profile: torch.Tensor) -> None:
        if not self._taking():
            return
        key = self.calls.top or LOSS_CODE
        prev = self.decisions.get(key)
        self.decisions[key] = profile if prev is None else prev + profile

    def on_rounding(self, profile: torch.Tensor) -> None:
        key = self.calls.top
        if key is None or not self._taking():
            return  # the loss code's rounding: nothing of the model's it feeds
        prev = self.roundings.get(key)
        self.roundings[key] = profile if prev is None else prev + profile

    def on_host(self) -> None:
        """The current code took float values to the host (the loss code's: LOSS_CODE)."""
        if not self._taking():
            return
        key = self.calls.top or LOSS_CODE
        self.host_decisions[key] = self.host_decisions.get(key, 0) + 1

    def on_logits(self, absmax: torch.Tensor) -> None:
        if not self._taking():
            return
        # outside any module: the loss code (its softmax makes the model's output gradients)
        key = self.calls.top or LOSS_CODE
        prev = self.logits.get(key)
        self.logits[key] = absmax if prev is None else torch.maximum(prev, absmax)

    def take(self, key: CallKey) -> Watched:
        """What the code of call ``key`` computed, removed from the log."""
        return Watched(self.logits.pop(key, None), self.decisions.pop(key, None),
                       self.roundings.pop(key, None), self.host_decisions.pop(key, None),
                       self.ctc.pop(key, None))


class Watched(NamedTuple):
    """What one call's own code computed, as the watch saw it."""

    logit_absmax: torch.Tensor | None  # the largest softmax logit that carries weight
    decisions: torch.Tensor | None  # margin counts of the indices it computed
    roundings: torch.Tensor | None  # margin counts of what it rounded to a grid
    host_decisions: int | None  # float tensors it took to the host
    ctc_frames: int | None  # the frames of a CTC loss it computed

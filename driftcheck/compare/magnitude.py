"""Operand magnitudes: the size of the terms an entry sums (a gradient's, a running mean's, a
norm's input gradient's), which its rounding scales with where the terms cancel and the sum is
far smaller than they are.
"""
from __future__ import annotations

import math

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.compare.measure import rms_of
from driftcheck.compare.propagation import NONE, Ledger
from driftcheck.numerics import dtypes
from driftcheck.store.keys import Slot, TraceKey

LINEAR_STATE = ("exp_avg", "momentum_buffer")  # optimizer moments linear in the gradient
SQUARED_STATE = ("exp_avg_sq", "square_avg", "max_exp_avg_sq", "sum")  # ... in its square


# Activations whose derivative's terms stay within ~1 of |g| (no kink: the hard variants and
# the ReLU family are piecewise, compare/kinks.py); matched in the module's type name, lower-cased.
_SMOOTH = ("gelu", "silu", "swish", "mish", "tanh", "sigmoid", "elu", "softplus")


def smooth_activation(module_type: str | None) -> bool:
    name = (module_type or "").lower()
    return "hard" not in name and "relu" not in name and any(k in name for k in _SMOOTH)


class Magnitudes:
    """Operand magnitudes and term counts (K) of the reference's entries, from its statistics
    and the errors judged so far (an optimizer moment's ``mu``)."""

    def __init__(self, index: DependencyIndex, ref_entries: list[TraceEntry], ledger: Ledger) -> None:
        self.index, self.ref_entries, self.ledger = index, ref_entries, ledger
        self.sibling_scale: dict[tuple[int, str], float] = {}  # (step, module) -> its gradients' rms
        self.broadcast: dict[TraceKey, tuple[float, int] | None] = {}  # asked by magnitude and K

    def magnitude(self, r: TraceEntry) -> float:
        """Operand magnitude of a parameter gradient (and the optimizer state built from it):
        dW = sum_n g_n x_n^T has rounding error ~ u * sqrt(sum_n g_n^2 x_n^2), whose rms over W
        is about ||G|| ||X|| / sqrt(numel(G) * fan_in); a bias's is ||G|| / sqrt(numel(b))."""
        s, ph, m, _, slot = r.align
        if ph == "optimizer" and r.slot_is("state"):
            g = self.index.by_align.get(TraceKey(s, "grads", m, 0, str(Slot("param", Slot.parse(slot).head))))
            if g is None:
                return 0.0
            mu = self.ledger.errors.get(g.align, NONE).mu
            sq = slot.endswith(SQUARED_STATE)
            return rms_of(r.stats) * (mu * mu if sq else mu)
        if ph in ("optimizer", "params") and slot.endswith("running_mean"):
            return self.running_mean_magnitude(r)
        if ph == "backward" and r.slot_is("grad_input") and r.meta.get("kind") in ("norm", "batchnorm"):
            return self.norm_grad_magnitude(r)
        if ph == "backward" and r.slot_is("grad_input") and smooth_activation(r.meta.get("module_type")):
            # g * f'(x): f' is computed from terms of magnitude ~1 (GELU's Phi(x) + x phi(x),
            # tanh's 1 - tanh^2) that cancel where f' is near 0, so its rounding scales with |g|,
            # not with |g f'(x)| (SEW's GELU between 1 and 2 threads: the vectorized and the
            # scalar tail loop split the elements otherwise, 3.55 under the local replay).
            return max((rms_of(e.stats) for e in self.index.gout.get(Call(s, m, r.call), [])[:1]),
                       default=0.0)
        if ph != "grads":
            return 0.0
        if not self.index.calls.get((s, m)):
            # A parameter its module's parent uses directly (F.multi_head_attention_forward with
            # k_proj.weight and .bias): no call of its own, no output gradient to size its terms
            # by. A gradient that cancels (a key bias's is exactly zero in exact arithmetic) is
            # judged at the scale of its siblings' gradients (hf_wavlm: 3e5 on a clean bf16 run).
            cache = self.sibling_scale
            if (s, m) not in cache:
                cache[(s, m)] = max((rms_of(e.stats) for e in self.ref_entries
                                     if e.step == s and e.phase == "grads" and e.module == m), default=0.0)
            return cache[(s, m)]
        return self._gradient_magnitude(r)

    def _gradient_magnitude(self, r: TraceEntry) -> float:
        s, _, m, _, slot = r.align
        g2 = x2 = g_n = 0.0
        out_ch: int | None = None
        fan_in: int | None = None
        for c in self.index.calls.get((s, m), ()):
            for e in self.index.gout.get(Call(s, m, c), [])[:1]:
                g2 += (e.stats.get("l2") or 0.0) ** 2
                g_n += e.stats.get("numel") or 0
                if e.shape:
                    out_ch = e.shape[-1] if e.meta.get("kind") == "linear" else \
                        (e.shape[1] if len(e.shape) > 1 else e.shape[0])
            for e in self.index.fwd_in.get(Call(s, m, c), [])[:1]:
                x2 += (e.stats.get("l2") or 0.0) ** 2
            for e in self.index.fwd_out.get(Call(s, m, c), [])[:1]:
                meta = e.meta
                if meta.get("k"):
                    fan_in = meta["k"] // max(meta.get("kernel", 1), 1)
        numel = r.stats.get("numel") or 0
        if not g2 or not numel:
            return 0.0
        if slot == "param.weight" and x2 and fan_in and g_n:
            return math.sqrt(g2 * x2 / (g_n * fan_in))
        if len(r.shape) == 1 and out_ch == r.shape[0]:
            return math.sqrt(g2 / numel)  # a bias (or a norm's per-channel parameter)
        if slot == "param.weight" and self.index.owner_kind(r) in ("linear", "conv"):
            return 0.0
        terms = self.broadcast_terms(r)
        return math.sqrt(terms[0] / numel) if terms else 0.0

    def norm_param_error(self, r: TraceEntry, y_rms: float) -> tuple[float, float]:
        """(rms, max) of the error a norm's output takes from its parameters' (y = gamma xhat +
        beta): beta's as it is, gamma's times xhat's rms, estimated as rms(y) / rms(gamma)
        (1 in training, anything for a BatchNorm in eval mode)."""
        err_rms = err_max = 0.0
        for p in self.index.params.get((r.step, r.module), ()):
            e = self.ledger.errors.get(p.align)
            if e is None or not dtypes.is_float(p.dtype):
                continue
            if p.slot == "param.bias":
                err_rms, err_max = err_rms + e.rms, err_max + e.max
            elif p.slot == "param.weight":
                g = rms_of(p.stats)
                xhat = y_rms / g if g > 0 else 1.0
                err_rms, err_max = err_rms + e.rms * xhat, err_max + e.max * xhat
        return err_rms, err_max

    def broadcast_terms(self, r: TraceEntry) -> tuple[float, int] | None:
        """(sum of squares, numel) of the gradient a parameter the module's own code uses
        directly is summed from: a position embedding added to a stream, a class token
        concatenated to it, a learned scalar (StarReLU's scale and bias). Its gradient sums the
        gradient where it is used over the dims it is broadcast along, and where those terms
        cancel (a position embedding before a BatchNorm) its rounding scales with them, not with
        their sum. That gradient is the module's output gradient or one of its children's
        input gradients: the largest of those whose shape the parameter broadcasts against
        (right-aligned, each dim 1 or equal); None where none does."""
        cache = self.broadcast
        if r.align in cache:
            return cache[r.align]
        s, _, m, _, _ = r.align
        best: tuple[float, int] | None = None
        for c in self.index.calls.get((s, m), ()):
            for e in self.index.gout.get(Call(s, m, c), [])[:1] + self.index.child_gins(Call(s, m, c)):
                n = e.stats.get("numel") or 0
                if n and _broadcasts(r.shape, e.shape) and n > (r.stats.get("numel") or 0):
                    g2 = (e.stats.get("l2") or 0.0) ** 2
                    if best is None or g2 > best[0]:
                        best = (g2, n)
        cache[r.align] = best
        return best

    def norm_grad_magnitude(self, r: TraceEntry) -> float:
        """A norm's input gradient is (gamma / sigma) (g - mean(g) - xhat mean(g xhat)): where
        a group holds few values (batch 2 over a 1x1 map: BatchNorm after global pooling) the
        projections cancel it to ~0 and its rounding scales with the terms, rms(g) |gamma| /
        sigma, estimated as rms(g) rms(y) gain / rms(x) from the call's output gradient,
        output and input (gain = rms/std of the input, meta norm_gain)."""
        key = Call(r.step, r.module, r.call)
        g, y, x = (self.index.gout.get(key, [])[:1], self.index.fwd_out.get(key, [])[:1],
                   self.index.fwd_in.get(key, [])[:1])
        if not (g and y and x):
            return 0.0
        rx = rms_of(x[0].stats)
        if not rx:
            return 0.0
        gain = float(y[0].meta.get("norm_gain") or 1.0)
        return rms_of(g[0].stats) * rms_of(y[0].stats) * gain / rx

    def running_mean_magnitude(self, r: TraceEntry) -> float:
        """A BatchNorm's running mean adds momentum x the batch mean of its input each call:
        where that mean cancels (a normalized input through a bias-free convolution: ~1e-9 of
        its rms) rounding and inherited error scale with the terms summed, not with their sum.
        The params entry of step s is the running mean after step s-1: that step's calls."""
        s, ph, m, _, _ = r.align
        step = s - 1 if ph == "params" else s
        x2 = n = 0.0
        momentum = 0.0
        for c in self.index.calls.get((step, m), ()):
            outs = self.index.fwd_out.get(Call(step, m, c), [])
            if not outs or outs[0].meta.get("kind") != "batchnorm":
                continue
            momentum = max(momentum, float(outs[0].meta.get("momentum", 0.1) or 0.0))
            for e in self.index.fwd_in.get(Call(step, m, c), [])[:1]:
                x2 += (e.stats.get("l2") or 0.0) ** 2
                n += e.stats.get("numel") or 0
        return momentum * math.sqrt(x2 / n) if n else 0.0

    def consumer_terms(self, r: TraceEntry) -> int | None:
        """K of the sum that made a module's output gradient in its parent's own code, where that
        code maps the output's last dimension to another: the backward of such a map (a matmul
        in the parent's code: Mixtral's experts call act_fn, then F.linear on their down_proj
        slice) sums over the last dimension of the parent's output gradient, in an order that
        threads and kernels choose (hf_mixtral, 2 threads on an AMD EPYC: act_fn's output
        gradient at 3.5 floors with the sum left out). None where the last dimensions agree
        (elementwise code around the module, or a sibling's input gradient)."""
        call = self.index.parent_of(r)
        if call is None or len(r.shape) < 2:
            return None
        g = next(iter(self.index.gout.get(call, ())), None)
        if g is None or len(g.shape) < 2 or g.shape[-1] == r.shape[-1]:
            return None
        return int(g.shape[-1])

    def grad_terms(self, r: TraceEntry) -> int | None:
        """How many terms each element of a parameter gradient sums (K of its accumulation):
        per call, the output gradient's elements per output channel (batch x positions for a
        convolution, rows for a Linear), over every call. Two runs may sum them in different
        orders (threads, kernels): fp32 against fp32 differs by ~sqrt(K) u there."""
        s, _, m, _, _ = r.align
        if not r.shape:
            return None
        terms = 0
        for c in self.index.calls.get((s, m), ()):
            for e in self.index.gout.get(Call(s, m, c), [])[:1]:
                # the output channel: dim 1 (convolutions, batch norm) or last (Linear, norms)
                if len(e.shape) > 1 and r.shape[0] in (e.shape[1], e.shape[-1]):
                    terms += (e.stats.get("numel") or 0) // r.shape[0]
        if not terms and not (r.slot == "param.weight" and self.index.owner_kind(r) in ("linear", "conv")):
            bt = self.broadcast_terms(r)  # a parameter its module's code broadcasts
            terms = bt[1] // max(r.stats.get("numel") or 1, 1) if bt else 0
        return terms or None


def _broadcasts(p: list | tuple, g: list | tuple) -> bool:
    """A parameter of shape p broadcasts against a gradient of shape g (right-aligned)."""
    p, g = list(p), list(g)
    extra = len(p) - len(g)
    if extra > 0:
        if any(d != 1 for d in p[:extra]):
            return False
        p = p[extra:]
    return all(a in (1, b) for a, b in zip(reversed(p), reversed(g)))

"""Products: the error a Linear's or a convolution's output (and input gradient) inherits from
its weight's difference, applied exactly to the reference's operand.

After an optimizer step the two runs' weights differ (sign flips of near-zero gradients under
Adam, the update's rounding). The floor passes that on as the weight's relative error times the
product's operand magnitude: a random walk, right where the differences point anywhere. They do
not always: a weight whose gradient was rank one (a query over the one class token of each
sample) flips whole rows, each row's difference a multiple of the input direction, and the
product sums them coherently, sqrt(K) times the random walk (a clean bf16 AdamW step: 5.6x
over the floor, the layer's own error 0.56). So where the floor objects, the difference itself
is multiplied by the reference's operand:

    forward          dy = x (W_t - W_r)^T + (b_t - b_r)       (a convolution of x with dW)
    input gradient   dx = g (W_t - W_r)                        (conv: its transposed form)

exact to first order (the operand's own error is the other dependency's), whatever direction
the differences share. Full mode only (both weights and the operand whole); a transposed or
non-zero-padded convolution, and a trace without the convolution's layout, go without.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import grad as nn_grad

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.numerics import dtypes
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

MAX_ELEMS = 1 << 26  # an operand or weight larger than this is not read to decide
_CONV = {3: (F.conv1d, nn_grad.conv1d_input), 4: (F.conv2d, nn_grad.conv2d_input),
         5: (F.conv3d, nn_grad.conv3d_input)}


class Products:
    """The first-order error of a product that its weight's difference makes (module
    docstring), cached per entry."""

    def __init__(self, index: DependencyIndex, ref: TraceReader, tgt: TraceReader,
                 tgt_map: dict[TraceKey, TraceEntry]) -> None:
        self.index, self.ref, self.tgt, self.tgt_map = index, ref, tgt, tgt_map
        self._known: dict[str, tuple[float, float] | None] = {}  # by entry key (and dtype)

    @staticmethod
    def applies(r: TraceEntry, how: str) -> bool:
        """Whether ``r`` is a product of a weight that an optimizer step may have moved: a
        Linear's or a convolution's forward output or input gradient after the first step."""
        return how == "full" and r.step > 0 and r.meta.get("kind") in ("linear", "conv") and (
            (r.phase == "forward" and r.slot_is("output"))
            or (r.phase == "backward" and r.slot == "grad_input.0"))

    def inherited(self, r: TraceEntry) -> tuple[float, float] | None:
        """(rms, max) of the error ``r`` gets from its weight's (and bias's) difference, or None
        where it cannot be computed."""
        if r.key not in self._known:
            try:
                self._known[r.key] = self._compute(r)
            except (RuntimeError, ValueError, TypeError, IndexError):
                self._known[r.key] = None  # a layout this does not know: go without
        return self._known[r.key]

    def _pair(self, r: TraceEntry, slot: str) -> torch.Tensor | None:
        """target - reference of the parameter ``slot`` of ``r``'s module at its step, in
        float64 (None where either is missing or not whole)."""
        p = self._param(r, slot)
        pt = self.tgt_map.get(p.align) if p is not None else None
        if p is None or pt is None or not p.has_tensor or not pt.has_tensor \
                or list(p.shape) != list(pt.shape) or (p.stats.get("numel") or 0) > MAX_ELEMS:
            return None
        a, b = self.ref.tensor(p.raw), self.tgt.tensor(pt.raw)
        if a is None or b is None or not a.is_floating_point() or not b.is_floating_point():
            return None
        return b.double() - a.double()

    def _param(self, r: TraceEntry, slot: str) -> TraceEntry | None:
        """The reference's entry of the parameter ``slot`` that ``r``'s call computed with: the
        module's own, or for a parametrized weight (``weight_norm``: wav2vec2's positional
        convolution) the parametrization's output last computed before ``r``."""
        p = self.index.by_align.get(TraceKey(r.step, "params", r.module, 0, slot))
        if p is not None or slot != "param.weight":
            return p
        path = f"{r.module}.parametrizations.weight"
        made = [o for c in self.index.calls.get((r.step, path), ()) for o in self.index.fwd_out.get(
            Call(r.step, path, c), ()) if o.order < r.order and o.slot_is("output")]
        return max(made, key=lambda o: o.order, default=None)

    def _operand(self, r: TraceEntry) -> torch.Tensor | None:
        """The reference's operand of the product: the forward input, or the output gradient."""
        if r.phase == "forward":
            e = next(iter(self.index.fwd_in.get(Call(r.step, r.module, r.call)) or []), None)
        else:
            e = self.index.by_align.get(TraceKey(r.step, "backward", r.module, r.call, "grad_output"))
        if e is None or not e.has_tensor or (e.stats.get("numel") or 0) > MAX_ELEMS:
            return None
        x = self.ref.tensor(e.raw)
        return x.double() if x is not None and x.is_floating_point() else None

    def _compute(self, r: TraceEntry) -> tuple[float, float] | None:
        dw = self._pair(r, "param.weight")
        if dw is None:
            return None
        x = self._operand(r)
        if x is None or not torch.isfinite(dw).all() or not torch.isfinite(x).all():
            return None
        y = self._linear(r, x, dw) if r.meta.get("kind") == "linear" else self._conv(r, x, dw)
        if y is None or list(y.shape) != list(r.shape):
            return None
        db = self._pair(r, "param.bias") if r.phase == "forward" else None
        if db is not None:
            y = y + (db.reshape(-1) if r.meta.get("kind") == "linear" else
                     db.reshape([-1] + [1] * (y.dim() - 2)))
        if not y.numel():
            return None
        return float(y.pow(2).mean().sqrt()), float(y.abs().max())

    def rounding_error(self, r: TraceEntry, dtype: str) -> tuple[float, float] | None:
        """(rms, max) of how far rounding a Linear's or convolution's operands (the reference's
        input, weight and bias) to ``dtype`` moves its output, the arithmetic after exact: what
        a correct kernel at that precision is off the reference before its own accumulation.
        None where it cannot be computed (not a forward output of one, not whole, a layout this
        does not know)."""
        key = f"{r.key}@{dtype}"
        if key not in self._known:
            try:
                self._known[key] = self._rounded(r, dtypes.torch_dtype(dtype))
            except (RuntimeError, ValueError, TypeError, IndexError, KeyError):
                self._known[key] = None
        return self._known[key]

    def _rounded(self, r: TraceEntry, dtype: torch.dtype) -> tuple[float, float] | None:
        if not (r.phase == "forward" and r.slot_is("output") and r.meta.get("kind") in ("linear", "conv")
                and r.has_tensor and dtype.is_floating_point):
            return None
        w_e, b_e = self._param(r, "param.weight"), self._param(r, "param.bias")
        x, y = self._operand(r), self.ref.tensor(r.raw)
        w = self.ref.tensor(w_e.raw) if w_e is not None and w_e.has_tensor else None
        if x is None or y is None or w is None or not w.is_floating_point():
            return None
        def rd(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).double()
        x, w = rd(x), rd(w)
        out = self._linear(r, x, w) if r.meta.get("kind") == "linear" else self._conv(r, x, w)
        if out is None or list(out.shape) != list(r.shape):
            return None
        b = self.ref.tensor(b_e.raw) if b_e is not None and b_e.has_tensor else None
        if b is not None:
            b = rd(b)
            out = out + (b.reshape(-1) if r.meta.get("kind") == "linear" else b.reshape([-1] + [1] * (out.dim() - 2)))
        d = out - y.double()
        if not d.numel() or not bool(torch.isfinite(d).all()):
            return None
        return float(d.pow(2).mean().sqrt()), float(d.abs().max())

    @staticmethod
    def _linear(r: TraceEntry, x: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
        """x dW^T (nn.Linear's weight is (out, in); Hugging Face's Conv1D's (in, out)), or
        g dW for the input gradient."""
        if dw.dim() != 2:
            return None
        w = dw.t() if r.meta.get("module_type") == "Conv1D" else dw  # now (out, in)
        return x @ w.t() if r.phase == "forward" else x @ w

    @staticmethod
    def _conv(r: TraceEntry, x: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
        """The convolution of x with dW (or its input gradient from g), with the layout the
        record kept (meta ``conv``)."""
        lay = r.meta.get("conv")
        fns = _CONV.get(dw.dim())
        if not isinstance(lay, dict) or fns is None or x.dim() != dw.dim():
            return None
        kw = dict(stride=lay["stride"], padding=lay["padding"], dilation=lay["dilation"],
                  groups=lay["groups"])
        if r.phase == "forward":
            return fns[0](x, dw, **kw)
        if lay["padding"] == "valid":
            kw["padding"] = 0
        elif lay["padding"] == "same":  # symmetric where the kernel's reach is even
            reach = [d * (k - 1) for d, k in zip(lay["dilation"], dw.shape[2:])]
            if any(n % 2 for n in reach):
                return None
            kw["padding"] = [n // 2 for n in reach]
        return fns[1](list(r.shape), dw, x, **kw)

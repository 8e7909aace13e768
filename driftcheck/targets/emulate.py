"""Emulation of a TPU's matmul precision on CPU or CUDA (``record --emulate tpu``).

torch_tpu computes a float32 matmul-like op (XLA's dot and convolution) from bf16 passes; its
``torch.tpu.precision`` levels, mapped from ``torch.set_float32_matmul_precision``:

- ``default`` (torch's "medium"; torch_tpu's thread-local default): one pass, the inputs
  rounded to bf16 and their products accumulated in fp32;
- ``high`` (3 passes): each fp32 operand split into a bf16 high and a bf16 low part,
  hi*hi + hi*lo + lo*hi;
- ``highest`` (6 passes): three bf16 parts, hi*hi + hi*mid + mid*hi + mid*mid + hi*lo + lo*hi,
  about fp32 accuracy.

bf16 (or fp16) inputs are multiplied in one pass with fp32 accumulation at every level.

:class:`TpuMatmul` is a ``TorchDispatchMode``: under it every ``mm``, ``bmm``, ``addmm``,
``baddbmm``, ``mv``, ``dot``, ``convolution`` and ``convolution_backward`` is computed that way,
in the forward and in the backward (autograd's backward ops dispatch through the mode too), with
no change to the model's code. ``linear``, ``matmul`` and ``einsum`` reach it as those ops;
:func:`emulate_tpu` also selects the math kernel of scaled dot-product attention, so its two
matmuls are emulated as well. Each pass is an exact product of bf16 values (8 + 8 significant bits
fit in fp32) summed in fp32, so the emulated ``default`` matmul is bitwise the fp32 matmul of the
inputs rounded to bf16.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck.errors import DriftcheckError

aten = torch.ops.aten

# The level names, and torch's names that torch_tpu maps onto them.
LEVELS = ("default", "high", "highest")
TORCH_NAMES = {"medium": "default", "default": "default", "high": "high", "highest": "highest"}
# Which bf16 parts of (a, b) each level multiplies, smallest terms first (summed in that order).
PASSES: dict[str, list[tuple[int, int]]] = {
    "default": [(0, 0)],
    "high": [(0, 1), (1, 0), (0, 0)],
    "highest": [(0, 2), (2, 0), (1, 1), (0, 1), (1, 0), (0, 0)],
}
PARTS = {"default": 1, "high": 2, "highest": 3}


def level_of(matmul_precision: str | None) -> str:
    """The TPU level for a ``--matmul-precision`` name (torch's or torch_tpu's); None: default."""
    if matmul_precision is None:
        return "default"
    try:
        return TORCH_NAMES[matmul_precision]
    except KeyError:
        raise DriftcheckError(f"unknown --matmul-precision {matmul_precision!r} for --emulate tpu: "
                              "choose default (torch's medium), high or highest") from None


def split(x: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``x`` (float32) as ``parts`` float32 tensors holding bf16 values that sum to it, largest
    first: each part is the bf16 rounding of what the parts before it left."""
    out, rest = [], x
    for _ in range(parts):
        part = rest.to(torch.bfloat16).to(torch.float32)
        out.append(part)
        rest = rest - part
    return out


def passes(op: Callable[[torch.Tensor, torch.Tensor], Any], a: torch.Tensor, b: torch.Tensor,
           level: str) -> Any:
    """``op(a, b)`` as the TPU computes it at ``level``: the sum, in fp32, of ``op`` over the
    level's pairs of bf16 parts. ``op`` must be bilinear; its results may be tuples (summed
    element by element, None kept)."""
    n = PARTS[level]
    pa, pb = split(a, n), split(b, n)
    total = None
    for i, j in PASSES[level]:
        out = op(pa[i], pb[j])
        if total is None:
            total = out
        elif isinstance(out, tuple):
            total = tuple(None if t is None else t + o for t, o in zip(total, out))
        else:
            total = total + out
    return total


def _emulated(a: torch.Tensor, b: torch.Tensor, op: Callable[[torch.Tensor, torch.Tensor], Any],
              level: str) -> Any:
    """Dispatch one bilinear op on its two operands' dtypes: fp32 through the level's passes,
    bf16/fp16 in one pass with fp32 accumulation (result in their dtype), others as they are."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return passes(op, a, b, level)
    if a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype:
        out = op(a.float(), b.float())
        return tuple(None if t is None else t.to(a.dtype) for t in out) if isinstance(out, tuple) \
            else out.to(a.dtype)
    return op(a, b)


class TpuMatmul(TorchDispatchMode):
    """Matmul-like aten ops computed at a TPU precision level (see the module docstring).
    ``calls`` counts the ops it emulated, by name."""

    def __init__(self, level: str = "default") -> None:
        super().__init__()
        if level not in LEVELS:
            raise DriftcheckError(f"unknown TPU matmul precision {level!r}: choose {', '.join(LEVELS)}")
        self.level = level
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None or kwargs:
            return func(*args, **kwargs)
        out = handler(self.level, *args)
        if out is NotImplemented:
            return func(*args, **kwargs)
        self._count(func.__name__)
        return out


def _bilinear(op: Any) -> Callable[..., Any]:
    """The handler of a plain bilinear op (mm, bmm, mv, dot)."""
    return lambda level, a, b: _emulated(a, b, op, level)


def _scaled_sum(op: Any) -> Callable[..., Any]:
    """The handler of ``beta * base + alpha * op(a, b)`` (addmm over mm, baddbmm over bmm)."""
    def handler(level: str, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any = 1,
                alpha: Any = 1) -> Any:
        prod = _emulated(a, b, op, level)
        return (beta * base + alpha * prod if beta != 0 else alpha * prod).to(prod.dtype)
    return handler


def _convolution(level: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 *conv: Any) -> Any:
    out = _emulated(x, w, lambda a, b: aten.convolution.default(a, b, None, *conv), level)
    if bias is None:
        return out
    shape = [1, -1] + [1] * (out.dim() - 2)
    return out + bias.reshape(shape).to(out.dtype)


def _convolution_backward(level: str, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          bias_sizes: Any, *rest: Any) -> Any:
    # grad_input = sum g_p (*) w_q and grad_weight = sum g_p (*) x_q over the same pairs: one
    # call per pair computes both; the bias gradient is a sum of g, not a matmul.
    *conv, mask = rest
    if not (g.dtype == x.dtype == w.dtype):
        return NotImplemented
    no_bias = list(mask[:2]) + [False]

    def both(gp: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        gi, gw, _ = aten.convolution_backward.default(gp, pair[0], pair[1], bias_sizes, *conv, no_bias)
        return gi, gw

    if g.dtype == torch.float32:
        n = PARTS[level]
        pg, px, pw = split(g, n), split(x, n), split(w, n)
        total: tuple | None = None
        for i, j in PASSES[level]:
            out = both(pg[i], (px[j], pw[j]))
            total = out if total is None else tuple(None if t is None else t + o for t, o in zip(total, out))
        gi, gw = total if total is not None else (None, None)
    elif g.dtype in (torch.bfloat16, torch.float16):
        gi, gw = both(g.float(), (x.float(), w.float()))
        gi, gw = (None if t is None else t.to(g.dtype) for t in (gi, gw))
    else:
        return NotImplemented
    gb = None
    if mask[2]:  # the kernel's own sum of g, as the unemulated backward computes it
        gb = aten.convolution_backward.default(g, x, w, bias_sizes, *conv, [False, False, True])[2]
    return gi, gw, gb


_HANDLERS: dict[Any, Callable[..., Any]] = {
    **{op: _bilinear(op) for op in (aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default)},
    aten.addmm.default: _scaled_sum(aten.mm.default), aten.baddbmm.default: _scaled_sum(aten.bmm.default),
    aten.convolution.default: _convolution, aten.convolution_backward.default: _convolution_backward,
}


@contextlib.contextmanager
def emulate_tpu(level: str = "default") -> Iterator[TpuMatmul]:
    """Run the enclosed forward and backward with a TPU's matmul precision ``level``.

    Example:
        >>> with emulate_tpu("default") as mode:
        ...     loss = model(x).sum(); loss.backward()
        >>> mode.calls   # {'addmm': 2, 'mm': 4, ...}
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mode = TpuMatmul(level)
    with sdpa_kernel([SDPBackend.MATH]), mode:
        yield mode

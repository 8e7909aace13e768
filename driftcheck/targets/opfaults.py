"""Op-level backend faults: one ATen op computed wrongly, the way a backend kernel gets it wrong.

``driftcheck.targets.faults`` changes what a whole module returns. These faults sit lower, where a backend
does: a ``TorchDispatchMode`` pushed under everything else (under driftcheck's own recorders), that
computes one op differently. Scoped to a module, the fault is active only while that module's
forward runs (forward ops) or while autograd runs a node that module's forward created (backward
ops); unscoped, it is active everywhere, as a faulty kernel would be.

- ``gelu_tanh``: exact GELU computed with the tanh approximation.
- ``attention_scale``: attention logits scaled by ``factor`` times the right scale (1/d for
  1/sqrt(d)): the softmax's input in eager attention, ``scale`` of fused attention ops.
- ``low_precision_sum``: ``sum``/``mean`` accumulated sequentially in bf16.
- ``matmul_bf16_inputs``: a float32 matmul computed from bf16-rounded operands (one bf16 pass).
- ``scaled_mm_wrong_axis``: fp8 ``_scaled_mm`` with row-wise scales along the wrong axis.
- ``scale_op``: one forward op's result scaled by ``factor`` (glue code a few percent off).
- ``wrong_backward``: a backward formula with a missing term (``silu_backward``, ``gelu_backward``)
  or, for any other backward op, its result scaled by ``factor``.

A fault is a callable taking the model (``record(target_hooks=...)``); ``remove()`` undoes it.
``install_from_env()`` installs the fault named by ``DRIFTCHECK_OP_FAULT`` for the whole process:
what a ``sitecustomize`` calls to stand in for a faulty backend under a standalone repro.
"""
from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

from driftcheck.errors import DriftcheckError
from driftcheck.targets.faults import sequential_sum

__all__ = [
    "FACTORIES",
    "OpFault",
    "attention_scale",
    "gelu_tanh",
    "install_from_env",
    "low_precision_sum",
    "matmul_bf16_inputs",
    "scale_op",
    "scaled_mm_wrong_axis",
    "wrong_backward",
]

# torch, driftcheck (the package: this file is in targets/) and the standard library
_SKIP = (os.path.dirname(torch.__file__) + os.sep,
         os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, os.path.dirname(os.__file__) + os.sep)
_SDPA = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention")


class _Mode(TorchDispatchMode):
    def __init__(self, fault: OpFault) -> None:
        super().__init__()
        self.fault = fault

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        f = self.fault
        name = func.overloadpacket.__name__
        if name in f.ops and f.active() and not _float64(args):
            f.hits += 1
            if not f.backward:
                f._site()
            return f.compute(func, args, kwargs)
        if f.watch and name in f.watch and f._depth > 0 and not _float64(args):
            f._site()  # the forward op whose backward is the faulty one
        return func(*args, **kwargs)


def _float64(args: tuple) -> bool:
    # driftcheck's own float64 truth runs are not the backend's kernels under test
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)


class OpFault:
    """A fault on the ATen ops ``ops`` (overload packet names), computed by ``compute``.

    Attributes:
        kind, module, params: what, where (``None``: everywhere) and with which settings.
        hits: how many op calls it changed.
    """

    def __init__(self, kind: str, ops: tuple[str, ...], compute: Callable[..., Any],
                 module: str | None = None, backward: bool = False, watch: tuple[str, ...] = (),
                 **params: Any) -> None:
        self.kind, self.ops, self.compute, self.module = kind, frozenset(ops), compute, module
        self.backward, self.params, self.hits = backward, params, 0
        self.watch = frozenset(watch)
        # (file, line) of the model code that issued the faulty op (for a backward op: its
        # forward op), found from the Python stack when it runs: a benchmark's ground truth
        self.sites: set[tuple[str, int]] = set()
        self._depth = 0
        self._spans: list[tuple[int, int]] = []
        self._start = 0
        self._handles: list[Any] = []
        self._mode: _Mode | None = None

    def _site(self) -> None:
        for fr in reversed(traceback.extract_stack()[:-3]):
            if not fr.filename.startswith(_SKIP) and not fr.filename.startswith("<"):
                self.sites.add((fr.filename, fr.lineno or 0))
                return

    # -- scope ---------------------------------------------------------------------------------
    def active(self) -> bool:
        if self.module is None:
            return True
        if not self.backward:
            return self._depth > 0
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        seq = node._sequence_nr()
        if self._depth > 0 and seq >= self._start:  # made inside the module's call still running
            return True
        return any(s <= seq < e for s, e in self._spans)

    def _pre(self, *_: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._start = torch._C._autograd._get_sequence_nr()

    def _post(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._spans.append((self._start, torch._C._autograd._get_sequence_nr()))
            del self._spans[:-256]

    # -- install -------------------------------------------------------------------------------
    def __call__(self, model: nn.Module | None = None) -> OpFault:
        if self.module is not None:
            if model is None:
                raise DriftcheckError(f"op fault {self.kind} on {self.module!r} needs the model")
            try:
                mod = model.get_submodule(self.module)
            except AttributeError:
                raise DriftcheckError(f"op fault {self.kind}: the model has no submodule "
                                      f"{self.module!r}") from None
            self._handles = [mod.register_forward_pre_hook(self._pre),
                             mod.register_forward_hook(self._post)]
        self._mode = _Mode(self)
        _push_mode(self._mode)  # under every mode entered later: a backend's kernel
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._mode is not None:
            popped = _pop_mode()
            if popped is not self._mode:  # someone pushed after us and did not pop: put it back
                _push_mode(popped)
            self._mode = None

    def describe(self) -> str:
        where = self.module or "everywhere"
        settings = "".join(f", {k}={v}" for k, v in self.params.items())
        return f"{self.kind}({where}{settings})"


# -- the faults ----------------------------------------------------------------------------------
def gelu_tanh(module: str | None = None) -> OpFault:
    def compute(func, args, kwargs):
        kwargs = dict(kwargs, approximate="tanh")
        return func(*args[:1], **kwargs)
    return OpFault("gelu_tanh", ("gelu",), compute, module)


def attention_scale(module: str | None = None, factor: float | None = None) -> OpFault:
    """Attention with the wrong scale. ``factor=None``: 1/d instead of 1/sqrt(d), i.e. logits
    times 1/sqrt(d) for the head size d of the fused op (8 for a plain softmax)."""
    def compute(func, args, kwargs):
        name = func.overloadpacket.__name__
        if name == "_softmax":
            x = args[0]
            k = factor if factor is not None else 1 / math.sqrt(8.0)
            return func(x * k, *args[1:], **kwargs)
        q = args[0]
        d = q.shape[-1]
        k = factor if factor is not None else 1 / math.sqrt(d)
        scale = kwargs.get("scale")
        base = scale if scale is not None else 1 / math.sqrt(d)
        return func(*args, **dict(kwargs, scale=base * k))
    return OpFault("attention_scale", ("_softmax",) + _SDPA, compute, module,
                   factor=factor if factor is not None else "1/sqrt(d)")


def low_precision_sum(module: str | None = None, dtype: torch.dtype = torch.bfloat16) -> OpFault:
    def compute(func, args, kwargs):
        x = args[0]
        if not x.is_floating_point() or x.dim() == 0:
            return func(*args, **kwargs)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dims = tuple(range(x.dim())) if dim in (None, []) else \
            ((dim,) if isinstance(dim, int) else tuple(dim))
        out = sequential_sum(x, dims, dtype).to(x.dtype)
        if func.overloadpacket.__name__ == "mean":
            out = out / math.prod(x.shape[d] for d in dims)
        return out if keep else out.squeeze(tuple(d % x.dim() for d in dims))
    return OpFault("low_precision_sum", ("sum", "mean"), compute, module,
                   dtype=str(dtype).replace("torch.", ""))


def matmul_bf16_inputs(module: str | None = None) -> OpFault:
    def compute(func, args, kwargs):
        def r(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.dtype == torch.float32:
                return a.to(torch.bfloat16).to(torch.float32)
            return a
        return func(*[r(a) for a in args], **kwargs)
    return OpFault("matmul_bf16_inputs", ("mm", "addmm", "bmm", "baddbmm", "matmul"), compute, module)


def wrong_backward(module: str | None = None, op: str = "silu_backward",
                   factor: float = 1.5) -> OpFault:
    """``silu_backward`` as grad*sigmoid(x), ``gelu_backward`` as grad*Phi(x) (each missing its
    second term); any other op: its result times ``factor``."""
    def compute(func, args, kwargs):
        if op == "silu_backward":
            return args[0] * torch.sigmoid(args[1])
        if op == "gelu_backward":
            x = args[1]
            return args[0] * 0.5 * (1 + torch.erf(x / math.sqrt(2.0)))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out * factor
        return type(out)(o * factor if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in out)
    return OpFault("wrong_backward", (op,), compute, module, backward=True,
                   watch=(op.removesuffix("_backward"),), op=op)


def scale_op(module: str | None = None, op: str = "mul", factor: float = 1.02) -> OpFault:
    """One forward op's result times ``factor`` (a kernel a few percent off): a parent's own
    glue code (a SwiGLU's product ``mul``, a residual ``add``, an attention's ``_softmax``)."""
    def compute(func, args, kwargs):
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        # an in-place op (``out += identity``: add_) returns the tensor it wrote: scale it there
        return out.mul_(factor) if func.overloadpacket.__name__.endswith("_") else out * factor
    return OpFault("scale_op", (op,), compute, module, op=op, factor=factor)


def scaled_mm_wrong_axis(module: str | None = None) -> OpFault:
    """fp8 ``_scaled_mm`` with row-wise scales applied along the other axis (torch_tpu's bug
    #1820): the row scale of A multiplies columns and the column scale of B rows (square
    outputs; other shapes are left alone)."""
    def compute(func, args, kwargs):
        a, b, sa, sb = args[:4]
        if sa.numel() > 1 and sb.numel() > 1 and a.shape[0] == b.shape[1]:
            args = (a, b, sb.reshape(sa.shape), sa.reshape(sb.shape)) + tuple(args[4:])
        return func(*args, **kwargs)
    return OpFault("scaled_mm_wrong_axis", ("_scaled_mm",), compute, module)


FACTORIES: dict[str, Callable[..., OpFault]] = {
    "gelu_tanh": gelu_tanh, "attention_scale": attention_scale,
    "low_precision_sum": low_precision_sum, "matmul_bf16_inputs": matmul_bf16_inputs,
    "wrong_backward": wrong_backward, "scaled_mm_wrong_axis": scaled_mm_wrong_axis,
    "scale_op": scale_op,
}


def from_spec(spec: str, module: str | None = None) -> OpFault:
    """``name`` or ``name:key=value,...`` (``wrong_backward:op=gelu_backward``)."""
    name, _, rest = spec.partition(":")
    if name not in FACTORIES:
        raise DriftcheckError(f"unknown op fault {name!r}; choose from {', '.join(FACTORIES)}")
    kw: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            kw[k] = float(v)
        except ValueError:
            kw[k] = v
    return FACTORIES[name](module, **kw)


def install_from_env() -> OpFault | None:
    """Install ``DRIFTCHECK_OP_FAULT`` (a ``from_spec`` string) for the whole process."""
    spec = os.environ.get("DRIFTCHECK_OP_FAULT")
    return from_spec(spec)() if spec else None


"""Backend faults injected into a target run, without touching the model's source.

Each fault wraps one named submodule's ``forward`` (an instance attribute, removed again by
``remove()``), so the tracer's hooks see the faulty call exactly as they would see a faulty
kernel, and a local replay of that module (driftcheck/record/local.py) runs through the fault too.
A fault is a callable taking the model, so it plugs into ``runner.record(target_hooks=...)``:

    record(scenario, "target", dtype="bf16", replay="ref", target_hooks=faults.scale_output("fc2", 1.05))

- ``scale_output`` / ``offset_output``: the module's output is off by a factor or an offset.
- ``fp8_matmul``: a Linear/Conv computes its matmul from fp8 (e4m3) round trips of its input and
  weight while everything else stays in the run's dtype.
- ``low_precision_reduction``: sums inside the module (a Linear's dot products, a norm's mean and
  variance, a softmax's denominator) accumulate in bf16/fp16 instead of fp32.
- ``scale_grad``: the gradient the module passes back to its first input is scaled (a wrong
  backward formula).
- ``other_dropout_mask``: a Dropout draws its own mask instead of the run's.
- ``overflow``: the module's output is multiplied into Inf.

``stochastic_rounding()`` is not a fault but legitimate noise (a control): a dispatch mode that
re-rounds every arithmetic op's output stochastically (a quarter of the values move by one ULP),
as a correct backend with another rounding mode could; a comparison must not flag it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from driftcheck.errors import DriftcheckError
from driftcheck.nested import flatten, substitute
from driftcheck.numerics import dtypes

__all__ = ["Fault", "fp8_matmul", "low_precision_reduction", "offset_output", "other_dropout_mask",
           "overflow", "scale_grad", "scale_output", "starting_at", "stochastic_rounding"]


@dataclasses.dataclass
class Fault:
    """One fault on one submodule. Call it with the model to install it (``remove()`` undoes it).

    Attributes:
        kind: what goes wrong (``scale_output``, ``fp8_matmul`` ...).
        module: the ``named_modules()`` path of the faulty submodule.
        params: the fault's settings, for reports.
    """

    kind: str
    module: str
    params: dict[str, Any]
    wrap: Callable[[nn.Module, Callable[..., Any]], Callable[..., Any]]
    _installed: list[tuple[nn.Module, Any]] = dataclasses.field(default_factory=list, repr=False)

    def __call__(self, model: nn.Module) -> Fault:
        try:
            module = model.get_submodule(self.module)
        except AttributeError:
            names = [n for n, _ in model.named_modules() if n][:8]
            raise DriftcheckError(f"fault {self.kind}: the model has no submodule {self.module!r} "
                                  f"(e.g. {', '.join(names)})") from None
        previous = module.__dict__.get("forward")
        module.forward = self.wrap(module, module.forward)
        self._installed.append((module, previous))
        return self

    def remove(self) -> None:
        """Restore the original forward of every module this fault was installed on."""
        while self._installed:
            module, previous = self._installed.pop()
            if previous is None:
                del module.forward
            else:
                module.forward = previous

    def describe(self) -> str:
        settings = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.kind}({self.module}{', ' + settings if settings else ''})"


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _map_float(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return substitute(out, "output", lambda _, t: fn(t) if t.is_floating_point() else t)


# -- output faults --------------------------------------------------------------------------------
def scale_output(module: str, factor: float) -> Fault:
    """Every floating output of ``module`` multiplied by ``factor`` (1.01 = 1% too large)."""
    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        return lambda *a, **k: _map_float(forward(*a, **k), lambda t: t * factor)
    return Fault("scale_output", module, {"factor": factor}, wrap)


def offset_output(module: str, offset: float) -> Fault:
    """``offset`` added to every element of every floating output of ``module``."""
    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        return lambda *a, **k: _map_float(forward(*a, **k), lambda t: t + offset)
    return Fault("offset_output", module, {"offset": offset}, wrap)


def overflow(module: str, factor: float | None = None) -> Fault:
    """``module``'s output times ``factor``, so that it overflows to Inf as an overflowing kernel
    would. ``factor=None``: 4 * max(dtype) / max|output|, so the largest elements (all those
    above a quarter of the output's absmax) become Inf whatever the output's scale; a fixed
    factor such as 1e38 overflows bf16 only where |x| > 3.4."""
    def blow_up(t: torch.Tensor) -> torch.Tensor:
        if factor is not None:
            return t * factor
        amax = t.detach().abs().amax().float().clamp(min=torch.finfo(t.dtype).tiny)
        return (t.float() * (4 * torch.finfo(t.dtype).max / amax)).to(t.dtype)

    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        return lambda *a, **k: _map_float(forward(*a, **k), blow_up)
    return Fault("overflow", module, {"factor": factor if factor is not None else "4*max/absmax"}, wrap)


# -- numerics faults ------------------------------------------------------------------------------
def _fp8_roundtrip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x through fp8 with a per-tensor amax scale, and back; straight-through in the backward."""
    with torch.no_grad():
        fmax = torch.finfo(dtype).max
        amax = x.detach().abs().amax().float().clamp(min=1e-30)
        scale = fmax / amax
        q = ((x.detach().float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale).to(x.dtype)
    return x + (q - x).detach()


def fp8_matmul(module: str, dtype: torch.dtype = torch.float8_e4m3fn) -> Fault:
    """A Linear or Conv whose input and weight go through an fp8 round trip before the matmul
    (accumulation stays in the run's precision): one op in lower precision than the rest."""
    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        if isinstance(mod, nn.Linear):
            return lambda x: F.linear(_fp8_roundtrip(x, dtype), _fp8_roundtrip(mod.weight, dtype),
                                      mod.bias)
        if isinstance(mod, nn.modules.conv._ConvNd):
            return lambda x: mod._conv_forward(_fp8_roundtrip(x, dtype),
                                               _fp8_roundtrip(mod.weight, dtype), mod.bias)
        raise DriftcheckError(f"fp8_matmul: {module} is a {type(mod).__name__}, not a Linear or Conv")
    return Fault("fp8_matmul", module, {"dtype": str(dtype).replace("torch.", "")}, wrap)


def sequential_sum(x: torch.Tensor, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Sum over ``dims`` one element at a time, rounding the running sum to ``dtype`` after every
    addition (a kernel without a wide accumulator). Returns the reduced shape with keepdim."""
    dims = tuple(sorted(d % x.dim() for d in dims))
    keep = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*keep, *dims)
    flat = moved.reshape(*moved.shape[:len(keep)], -1)  # (..., n)
    acc = torch.zeros(flat.shape[:-1], dtype=dtype, device=x.device)
    for i in range(flat.shape[-1]):
        acc = acc + flat[..., i].to(dtype)  # rounded to dtype at every step
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    return acc.reshape(shape)


class _LowPrecisionReductions(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype, ops: frozenset[str]) -> None:
        super().__init__()
        self.dtype, self.ops = dtype, ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.dtype
        if "linear" in self.ops and func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            prod = x.unsqueeze(-2) * w  # (..., out, in): products are exact enough in fp32
            y = sequential_sum(prod, (-1,), d).squeeze(-1).to(x.dtype)
            return y + b if b is not None else y
        if "mean" in self.ops and func in (torch.mean, torch.Tensor.mean) and args:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            dims = tuple(range(x.dim())) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
            n = math.prod(x.shape[i] for i in dims)
            out = (sequential_sum(x, dims, d) / n).to(x.dtype)
            return out if keepdim else out.squeeze(dims)
        if "softmax" in self.ops and func in (torch.softmax, torch.Tensor.softmax, F.softmax):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            e = (x - x.amax(dim, keepdim=True)).exp()
            return (e / sequential_sum(e, (dim,), d).to(e.dtype)).to(x.dtype)
        if "layer_norm" in self.ops and func is F.layer_norm:
            x, shape = args[0], args[1]
            w = args[2] if len(args) > 2 else kwargs.get("weight")
            b = args[3] if len(args) > 3 else kwargs.get("bias")
            eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
            dims = tuple(range(x.dim() - len(shape), x.dim()))
            n = math.prod(shape)
            mean = (sequential_sum(x, dims, d) / n).to(x.dtype)
            var = (sequential_sum((x - mean) ** 2, dims, d) / n).to(x.dtype)
            y = (x - mean) * torch.rsqrt(var + eps)
            return y * w + b if w is not None else y
        if "batch_norm" in self.ops and func is F.batch_norm:
            names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
            a = dict(zip(names, args), **kwargs)
            if not a.get("training", False):
                return func(*args, **kwargs)
            func(*args, **kwargs)  # the running statistics update as the correct kernel does it
            x = a["input"]
            dims = tuple(i for i in range(x.dim()) if i != 1)
            n = math.prod(x.shape[i] for i in dims)
            mean = (sequential_sum(x, dims, d) / n).to(x.dtype)
            var = (sequential_sum((x - mean) ** 2, dims, d) / n).to(x.dtype)
            shape = [1, -1] + [1] * (x.dim() - 2)
            y = (x - mean) * torch.rsqrt(var + a.get("eps", 1e-5))
            w, b = a.get("weight"), a.get("bias")
            return y * w.reshape(shape) + b.reshape(shape) if w is not None else y
        return func(*args, **kwargs)


REDUCTIONS = ("linear", "mean", "softmax", "layer_norm", "batch_norm")


def low_precision_reduction(module: str, dtype: torch.dtype = torch.bfloat16,
                            ops: tuple[str, ...] = REDUCTIONS) -> Fault:
    """Reductions inside ``module``'s forward accumulate in ``dtype``, one element at a time:
    a Linear's dot products (``linear``), ``mean`` (RMSNorm), ``softmax`` denominators,
    ``layer_norm`` and training ``batch_norm`` statistics. ``ops`` picks which."""
    unknown = set(ops) - set(REDUCTIONS)
    if unknown:
        raise DriftcheckError(f"low_precision_reduction: unknown op(s) {sorted(unknown)}; "
                              f"choose from {', '.join(REDUCTIONS)}")

    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        def faulty(*a: Any, **k: Any) -> Any:
            with _LowPrecisionReductions(dtype, frozenset(ops)):
                return forward(*a, **k)
        return faulty
    return Fault("low_precision_reduction", module,
                 {"dtype": str(dtype).replace("torch.", ""), "ops": ",".join(ops)}, wrap)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


def scale_grad(module: str, factor: float) -> Fault:
    """The gradient ``module`` returns for its first input is ``factor`` times the right one; the
    forward is untouched (a wrong backward formula)."""
    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        def faulty(x: Any, *a: Any, **k: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x = _ScaleGrad.apply(x, factor)
            return forward(x, *a, **k)
        return faulty
    return Fault("scale_grad", module, {"factor": factor}, wrap)


class _OwnMask:
    """Inside the faulty module, F.dropout draws from its own generator."""

    def __init__(self, generator: torch.Generator) -> None:
        self.g = generator

    def __enter__(self) -> _OwnMask:
        self.saved = F.dropout  # the run's (CPU-mask controlled) dropout
        outer = self

        def own(input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> torch.Tensor:
            if not training or p == 0:
                return outer.saved(input, p, training, inplace)
            outer.saved(input.detach().clone(), p, training, False)  # keep the run's mask stream in step
            keep = (torch.rand(input.shape, generator=outer.g) >= p).to(device=input.device,
                                                                        dtype=input.dtype)
            return input * keep / (1.0 - p)

        F.dropout = own
        return self

    def __exit__(self, *exc: Any) -> None:
        F.dropout = self.saved


def other_dropout_mask(module: str, seed: int = 12345) -> Fault:
    """A Dropout that draws its mask from its own generator (``seed``) rather than the run's
    CPU-generated masks: the backend did not reproduce the reference's randomness."""
    g = torch.Generator().manual_seed(seed)

    def wrap(mod: nn.Module, forward: Callable) -> Callable:
        def faulty(*a: Any, **k: Any) -> Any:
            with _OwnMask(g):
                return forward(*a, **k)
        return faulty
    return Fault("other_dropout_mask", module, {"seed": seed}, wrap)


# -- the stochastic-rounding control --------------------------------------------------------------
# Ops that compute (their outputs carry rounding); copies, views, indexing, comparisons, max/min
# and ReLU are exact on every backend and are left alone.
_ARITHMETIC = frozenset({
    "add", "sub", "rsub", "mul", "div", "mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "matmul",
    "linear", "convolution", "convolution_backward", "exp", "log", "tanh", "sigmoid", "erf", "cos",
    "sin", "pow", "sqrt", "rsqrt", "reciprocal", "mean", "sum", "var", "gelu", "gelu_backward",
    "silu", "silu_backward", "tanh_backward", "sigmoid_backward", "_softmax",
    "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_attention_math",
    "embedding_dense_backward", "nll_loss_forward", "nll_loss_backward", "addcmul", "addcdiv",
    "lerp", "avg_pool2d", "avg_pool2d_backward", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward", "mse_loss",
})
_REROUNDED = (torch.bfloat16, torch.float16, torch.float32)


class _StochasticRounding(TorchDispatchMode):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _ARITHMETIC or func._schema.is_mutable:
            return out
        ptrs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
        with _disable_current_modes():  # its own arithmetic is not the kernels under test (an op fault below)
            for t in _tensors(out, None):
                if t.dtype in _REROUNDED and t.numel() and t.untyped_storage().data_ptr() not in ptrs:
                    self._reround(t)
        return out

    def _reround(self, t: torch.Tensor) -> None:
        # Given the round-to-nearest result, the exact value lies within half a ULP; model where
        # as uniform and round that stochastically: move one ULP towards it with probability
        # equal to its distance (a quarter of the values move). The error statistics are those of
        # stochastic rounding (rms 0.41 ULP); against the true exact value it is <= 1.5 ULP.
        finfo = torch.finfo(t.dtype)
        x = t.float()
        _, e = torch.frexp(x)
        ulp = torch.ldexp(torch.ones_like(x), e - dtypes.significand_bits(t.dtype)).clamp(min=finfo.tiny * finfo.eps)
        frac = torch.rand(x.shape, generator=self.g).to(x.device) - 0.5  # where the exact value was
        move = torch.sign(frac) * (torch.rand(x.shape, generator=self.g).to(x.device) < frac.abs())
        ok = torch.isfinite(x) & (x != 0)
        y = torch.where(ok, x + move * ulp, x).to(t.dtype)
        t.copy_(torch.where(torch.isfinite(y), y, t))  # never round a finite value into Inf


def _tensors(obj: Any, kwargs: dict | None) -> list[torch.Tensor]:
    return [t for _, t in flatten((obj, kwargs or {}), "x")]


def rerounded(mode: TorchDispatchMode, t: torch.Tensor) -> torch.Tensor:
    """``t`` re-rounded as ``mode`` (a ``stochastic_rounding()``) re-rounds an op's result,
    outside every dispatch mode (no op fault below sees it); autograd passes through."""
    with _disable_current_modes():
        with torch.no_grad():
            r = t.detach().clone()
            if isinstance(mode, _StochasticRounding) and r.dtype in _REROUNDED and r.numel():
                mode._reround(r)
        return t + (r - t.detach())


def stochastic_rounding(seed: int = 0) -> TorchDispatchMode:
    """A dispatch mode (use as ``with``) that re-rounds the output of every arithmetic op in
    bf16/fp16/fp32 stochastically (one ULP up or down, or kept): legitimate noise, a
    control that a comparison must not flag. fp64 (driftcheck's own statistics) is untouched."""
    return _StochasticRounding(seed)


class starting_at:
    """``fault`` installed from step ``step`` on: pass it as ``target_hooks`` to record() or
    record_long(), which call ``set_step`` with each step's number."""

    def __init__(self, fault: Fault, step: int) -> None:
        self.fault, self.step, self.on = fault, step, False
        self.model: nn.Module | None = None

    def __call__(self, model: nn.Module) -> starting_at:
        self.model = model
        return self

    def set_step(self, step: int) -> None:
        if step >= self.step and not self.on and self.model is not None:
            self.fault(self.model)
            self.on = True

    def describe(self) -> str:
        return f"{self.fault.describe()} from step {self.step}"

"""Emulated fp8 training for ``nn.Linear`` on any device: the precision what-if before the hardware.

:func:`enable_fp8` swaps the forward of every plain ``nn.Linear`` (same module objects, same
``named_modules()`` paths, so driftcheck's hooks still see them) for an autograd Function that
works like a Transformer-Engine fp8 GEMM with per-tensor scaling:

- forward: input and weight are scaled and cast to fp8 (saturating), multiplied with fp32
  accumulation (``torch._scaled_mm``), the bias is added in fp32, the output is rounded to bf16
  (then returned in the input's dtype so the model keeps its dtypes);
- backward: ``grad_output`` is cast to fp8 too (e5m2 in the ``hybrid`` recipe) and both gradient
  GEMMs reuse the fp8 input and weight of the forward; ``grad_input`` is rounded to bf16,
  ``grad_weight`` comes from the fp32 accumulator, ``grad_bias`` is a fp32 sum of the unquantised
  ``grad_output``.

Every cast is recorded per (module path, call, role): amax, scale, flushed and saturated fractions,
kept on the device until :meth:`Fp8Handle.stats` fetches them in one transfer (no sync per cast).

``torch._scaled_mm`` (tensor-wise scales, float32 0-dim) runs on CPU and CUDA (sm_89+). Its CUDA
kernel needs every dimension a multiple of 16 and the second operand column-major: operands are
zero-padded (exact: zeros add nothing) and laid out accordingly. Where the kernel is missing or
refuses the operands (older GPUs, e5m2 x e5m2 on CUDA), the ``auto`` kernel falls back to
``dequant``: fp8 values upcast and multiplied in fp32, where every fp8 value and product is exact,
so only the accumulation order differs. Which kernel ran is recorded per cast.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import types
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes

FORMATS = ("e4m3", "e5m2", "hybrid")
SCALINGS = ("current", "delayed")
KERNELS = ("auto", "scaled_mm", "dequant")
ROLES = ("input", "weight", "grad_output")
FP8_DTYPES, _NAMES = dtypes.FP8_FORMATS, dtypes.FP8_FORMAT_OF
_BROKEN: set[tuple[str, torch.dtype, torch.dtype]] = set()  # where _scaled_mm refused to run


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the emulated fp8 GEMMs cast their operands.

    Args:
        format: ``"e4m3"`` or ``"e5m2"`` for every tensor, or ``"hybrid"``: e4m3 for input and
            weight, e5m2 for ``grad_output`` (the wider range gradients need).
        scaling: ``"current"`` scales each tensor by its own amax; ``"delayed"`` by the largest
            amax of the last ``history`` calls of the same module and role (the first call uses
            its own), which can saturate when values grow.
        history: length of the amax history of delayed scaling.
        kernel: ``"auto"`` (``torch._scaled_mm``, else dequant), ``"scaled_mm"`` (error if it
            cannot run) or ``"dequant"`` (always upcast and multiply in fp32).

    Example:
        >>> Fp8Recipe.parse("hybrid:delayed:16") == Fp8Recipe("hybrid", "delayed", 16)
        True
    """

    format: str = "hybrid"
    scaling: str = "delayed"
    history: int = 16
    kernel: str = "auto"

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.format, FORMATS, "format"),
                                     (self.scaling, SCALINGS, "scaling"),
                                     (self.kernel, KERNELS, "kernel")):
            if value not in allowed:
                raise DriftcheckError(f"unknown fp8 {what} {value!r}: use {', '.join(allowed)}")
        if not isinstance(self.history, int) or self.history < 1:
            raise DriftcheckError(f"bad fp8 amax history {self.history!r}: use an integer >= 1")

    @classmethod
    def parse(cls, spec: str) -> Fp8Recipe:
        """``FORMAT[:SCALING[:HISTORY]]``: ``hybrid``, ``e4m3:current``, ``hybrid:delayed:32``."""
        parts = [part.strip().lower() for part in spec.split(":")]
        if len(parts) > 3 or not parts[0]:
            raise DriftcheckError(f"bad fp8 recipe {spec!r}: use FORMAT[:SCALING[:HISTORY]]")
        kwargs: dict[str, Any] = {"format": parts[0]}
        if len(parts) > 1:
            kwargs["scaling"] = parts[1]
        if len(parts) > 2:
            if not parts[2].isdigit():
                raise DriftcheckError(f"bad fp8 recipe {spec!r}: HISTORY must be an integer")
            kwargs["history"] = int(parts[2])
        return cls(**kwargs)

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 dtype a tensor of ``role`` (input, weight, grad_output) is cast to."""
        if self.format == "hybrid":
            return FP8_DTYPES["e5m2" if role == "grad_output" else "e4m3"]
        return FP8_DTYPES[self.format]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form recorded in trace manifests."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.format}:{self.scaling}:{self.history}"


class Quantized(NamedTuple):
    """A tensor cast to fp8: ``data * inv_scale`` approximates the original."""

    data: torch.Tensor  # fp8, the shape of the original
    inv_scale: torch.Tensor  # float32, 0-dim
    values: torch.Tensor  # float32 (4,): amax, scale, flushed count, saturated count


def compute_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max / amax`` as a float32 0-dim tensor; 1 where amax is 0, inf or nan."""
    amax = amax.float()
    scale = torch.finfo(dtype).max / amax
    usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale)
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
             amax: torch.Tensor | None = None) -> Quantized:
    """Cast ``x * scale`` to ``dtype`` with saturation, counting flushed and saturated values.

    Flushed: non-zero values that become (±)0. Saturated: ``|x * scale|`` above the fp8 maximum,
    clamped to it (as Transformer Engine does; e4m3fn has no inf, e5m2 would overflow to inf).
    Runs on ``x``'s device without a host sync.
    """
    fp8_max = torch.finfo(dtype).max
    scale = scale.float()
    scaled = x.detach().float() * scale
    # The amax element itself maps to fp8_max * (1 +- 2^-24) through the fp32 scale: not saturated.
    saturated = (scaled.abs() > fp8_max * (1 + 2.0**-20)).sum()
    data = scaled.clamp(-fp8_max, fp8_max).to(dtype)
    # Bit test instead of a float compare: +0 and -0 are 0x00 and 0x80 in both formats.
    flushed = ((x.detach() != 0) & ((data.view(torch.uint8) & 0x7F) == 0)).sum()
    amax = _amax(x) if amax is None else amax
    values = torch.stack([amax, scale.reshape(()), flushed.float(), saturated.float()])
    return Quantized(data, (1.0 / scale).reshape(()), values)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # Pad through a byte view: not every backend has fp8 pad kernels, and byte 0 is +0.0.
    return F.pad(t.view(torch.uint8), (0, cols, 0, rows)).view(t.dtype)


def _scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor,
               scale_b: torch.Tensor) -> torch.Tensor:
    m, k = a.shape  # a (M, K) @ b (K, N) -> (M, N) float32
    n = b.shape[1]
    pad_m, pad_k, pad_n = (-m) % 16, (-k) % 16, (-n) % 16
    if pad_m or pad_k:
        a = _pad(a, pad_m, pad_k)
    if pad_k or pad_n:
        b = _pad(b, pad_k, pad_n)
    a = a.contiguous()  # row-major
    b = b.t().contiguous().t()  # column-major
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    return out[:m, :n]


def _dequant_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor,
                scale_b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()) * (scale_a * scale_b)


def _no_autocast(device_type: str) -> Any:
    # Autocast would round the fp32 matmul's output to bf16 before the scale, and it changes
    # _scaled_mm's result on CPU (measured): the emulated GEMM must not depend on it.
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _matmul(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
            kernel: str) -> tuple[torch.Tensor, str]:
    key = (a.device.type, a.dtype, b.dtype)
    with _no_autocast(a.device.type):
        if kernel == "scaled_mm" or (kernel == "auto" and key not in _BROKEN):
            try:
                return _scaled_mm(a, scale_a, b, scale_b), "scaled_mm"
            except (RuntimeError, TypeError, AttributeError) as err:
                if kernel == "scaled_mm":
                    reason = (str(err).strip().splitlines() or ["no reason given"])[0]
                    raise DriftcheckError(
                        f"torch._scaled_mm cannot multiply {_NAMES[a.dtype]} x {_NAMES[b.dtype]} "
                        f"on {a.device.type} ({reason}): use the fp8 kernel 'auto' or 'dequant'"
                    ) from err
                _BROKEN.add(key)
        return _dequant_mm(a, scale_a, b, scale_b), "dequant"


@dataclasses.dataclass
class _Record:
    module: str
    call: int
    role: str
    format: str
    numel: int
    values: torch.Tensor
    kernel: str | None = None


class _Call:
    """One call of one patched Linear: where its casts are recorded."""

    def __init__(self, handle: Fp8Handle, module: str, call: int) -> None:
        self.handle, self.module, self.call = handle, module, call

    def quantize(self, role: str, x: torch.Tensor) -> tuple[Quantized, _Record]:
        return self.handle._quantize(self.module, self.call, role, x)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                call: _Call) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        qx, rx = call.quantize("input", x2)
        qw, rw = call.quantize("weight", weight)  # (N, K)
        kernel = call.handle.recipe.kernel
        out, rx.kernel = _matmul(qx.data, qx.inv_scale, qw.data.t(), qw.inv_scale, kernel)
        rw.kernel = rx.kernel
        if bias is not None:
            out = out + bias.float()  # in the fp32 epilogue, before the one bf16 rounding
        out = out.to(torch.bfloat16).to(x.dtype)
        ctx.save_for_backward(qx.data, qx.inv_scale, qw.data, qw.inv_scale)
        ctx.call, ctx.shape = call, shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        qg, rg = ctx.call.quantize("grad_output", g2)
        kernel = ctx.call.handle.recipe.kernel
        grad_x = grad_w = grad_b = None
        used = set()
        if ctx.needs_input_grad[0]:
            gx, name = _matmul(qg.data, qg.inv_scale, w8, w_inv, kernel)  # (M, N) @ (N, K)
            grad_x = gx.to(torch.bfloat16).to(x_dtype).reshape(ctx.shape)
            used.add(name)
        if ctx.needs_input_grad[1]:
            gw, name = _matmul(qg.data.t(), qg.inv_scale, x8, x_inv, kernel)  # (N, M) @ (M, K)
            grad_w = gw.to(w_dtype)
            used.add(name)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(b_dtype)
        rg.kernel = "+".join(sorted(used)) or None
        return grad_x, grad_w, grad_b, None


class Fp8Handle:
    """The fp8 emulation installed on a model: its statistics, and the way back. ``recipe`` is
    in use on ``modules`` (paths of the patched Linears); ``skipped``: Linear subclasses with
    their own forward (left as they are)."""

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.modules: list[str] = []
        self.skipped: list[str] = []
        self._patched: list[nn.Module] = []
        self._calls: collections.Counter[str] = collections.Counter()
        self._history: dict[tuple[str, str], collections.deque] = {}
        self._records: list[_Record] = []

    def _next_call(self, path: str) -> _Call:
        call = _Call(self, path, self._calls[path])
        self._calls[path] += 1
        return call

    def _quantize(self, module: str, call: int, role: str,
                  x: torch.Tensor) -> tuple[Quantized, _Record]:
        dtype = self.recipe.dtype(role)
        amax = _amax(x)
        scale_amax = amax
        if self.recipe.scaling == "delayed":
            history = self._history.setdefault(
                (module, role), collections.deque(maxlen=self.recipe.history))
            if history:
                scale_amax = torch.stack(list(history)).amax()
            history.append(amax)
        quantized = quantize(x, dtype, compute_scale(scale_amax, dtype), amax)
        record = _Record(module, call, role, _NAMES[dtype], x.numel(),
                         torch.cat([quantized.values, scale_amax.reshape(1)]))
        self._records.append(record)
        return quantized, record

    def _patch(self, path: str, module: nn.Linear) -> None:
        handle = self

        def forward(linear: nn.Linear, input: torch.Tensor) -> torch.Tensor:
            return _Fp8Linear.apply(input, linear.weight, linear.bias, handle._next_call(path))

        forward._driftcheck_fp8 = True  # type: ignore[attr-defined]
        # An instance attribute: the module object, its name and its hooks stay as they were.
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]  # on purpose
        self._patched.append(module)
        self.modules.append(path)

    def stats(self) -> list[dict[str, Any]]:
        """One dict per fp8 cast since the last :meth:`reset`, in execution order.

        Keys: ``module``, ``call``, ``role`` (input, weight, grad_output), ``format``, ``numel``,
        ``amax`` (of this tensor), ``scale_amax`` (the amax the scale came from: differs from
        ``amax`` under delayed scaling), ``scale`` (fp8 = x * scale), ``flushed``/``saturated``
        (counts) and ``flushed_fraction``/``saturated_fraction`` (of ``numel``), ``kernel``.
        Fetches all values from the device in one transfer.
        """
        if not self._records:
            return []
        device = self._records[0].values.device
        table = torch.stack([r.values.to(device) for r in self._records]).cpu().tolist()
        rows = []
        for record, (amax, scale, flushed, saturated, scale_amax) in zip(self._records, table):
            numel = max(record.numel, 1)
            rows.append({
                "module": record.module, "call": record.call, "role": record.role,
                "format": record.format, "numel": record.numel, "amax": amax,
                "scale_amax": scale_amax, "scale": scale, "flushed": int(flushed),
                "saturated": int(saturated), "flushed_fraction": flushed / numel,
                "saturated_fraction": saturated / numel, "kernel": record.kernel,
            })
        return rows

    def reset(self, history: bool = False) -> None:
        """Start a new step: clear statistics and call counters (and the amax history if asked)."""
        self._records.clear()
        self._calls.clear()
        if history:
            self._history.clear()

    def remove(self) -> None:
        """Restore every patched Linear's own forward; the model computes bitwise as before."""
        for module in self._patched:
            if getattr(module.__dict__.get("forward"), "_driftcheck_fp8", False):
                del module.forward
        self._patched.clear()

    def __enter__(self) -> Fp8Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def enable_fp8(model: nn.Module, recipe: Fp8Recipe | str = "hybrid") -> Fp8Handle:
    """Run every plain ``nn.Linear`` of ``model`` through emulated fp8 GEMMs.

    Args:
        model: the model; its modules are patched in place (instance ``forward``), not replaced.
        recipe: an :class:`Fp8Recipe` or its spec string (``"hybrid"``, ``"e4m3:current"``).

    Returns:
        An :class:`Fp8Handle`: ``stats()``, ``reset()`` per step, ``remove()`` (also at ``with``
        exit).

    Raises:
        DriftcheckError: fp8 is already enabled on the model, or it has no ``nn.Linear``.

    Example:
        >>> with enable_fp8(model, "hybrid:delayed") as fp8:
        ...     model(x).sum().backward()
        ...     rows = fp8.stats()
    """
    recipe = recipe if isinstance(recipe, Fp8Recipe) else Fp8Recipe.parse(recipe)
    handle = Fp8Handle(recipe)
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path, module in linears:
        if getattr(module.__dict__.get("forward"), "_driftcheck_fp8", False):
            raise DriftcheckError(
                f"fp8 emulation is already enabled on {path or 'the model'}: "
                "remove() the first handle"
            )
    for path, module in linears:
        # Subclasses with their own forward (LoRA, quantised layers) or an already patched
        # forward would lose behaviour if replaced: leave them, and say so.
        if type(module).forward is not nn.Linear.forward or "forward" in module.__dict__:
            handle.skipped.append(path)
        else:
            handle._patch(path, module)
    if not handle.modules:
        raise DriftcheckError(
            f"fp8 emulation found no nn.Linear to run in fp8 in {type(model).__name__}: "
            "fp8 covers Linear layers only"
        )
    return handle

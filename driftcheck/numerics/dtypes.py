"""Every dtype table and predicate driftcheck uses: one place, pure (torch dtypes, no I/O).

- precision: unit roundoff, assert_close tolerances, the spacing constants of each format;
- names: a trace's dtype names (torch's, minus "torch."), the CLI's short names (fp32, bf16),
  and the safetensors codes (F32, BF16, ...) of the file format;
- predicates: floating, exact (integer/bool), the kind two tensors must share to be measured.
"""
from __future__ import annotations

import math

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics.dtype_names import (  # the torch-free names, re-exported
    CLI_DTYPE_NAMES as CLI_DTYPE_NAMES,
    CODE_NAMES as CODE_NAMES,
    FLOAT_NAMES as FLOAT_NAMES,
    SAFETENSORS_CODES as SAFETENSORS_CODES,
    TRACE_DTYPES as TRACE_DTYPES,
)

DTypeLike = torch.dtype | str

# Unit roundoff u = 2^-(p) for a p-bit significand (implicit bit included): the relative error
# bound of one rounding to nearest. The spacing eps at 1.0 is 2u. We derive eps from this table,
# not from torch.finfo, because finfo(float8_e5m2fnuz).eps reports 0.125 where the format (2
# mantissa bits: 1.25 is representable, 1.125 is not) has 0.25.
_UNIT_ROUNDOFF: dict[torch.dtype | str, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    "tf32": 2.0**-11,  # fp32 range, 10 mantissa bits
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float8_e4m3fn: 2.0**-4,
    torch.float8_e4m3fnuz: 2.0**-4,
    torch.float8_e5m2: 2.0**-3,
    torch.float8_e5m2fnuz: 2.0**-3,
    torch.float8_e8m0fnu: 2.0**-1,  # MX block scales: powers of two only
}

# torch.testing.assert_close defaults for fp64/fp32/fp16/bf16.
_TOLERANCES: dict[torch.dtype | str, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    # Ours, not assert_close's (it has none for these): tf32 shares fp16's unit roundoff; fp8
    # rtol is one ULP at 1.0 (2u), atol covers values flushed near the bottom of the range.
    "tf32": (1e-3, 1e-5),
    torch.float8_e4m3fn: (0.125, 1e-3),
    torch.float8_e4m3fnuz: (0.125, 1e-3),
    torch.float8_e5m2: (0.25, 1e-3),
    torch.float8_e5m2fnuz: (0.25, 1e-3),
    torch.float8_e8m0fnu: (0.0, 0.0),  # ours: block scales either match or are a binade apart
}

_ALIASES: dict[str, DTypeLike] = {
    "fp64": torch.float64, "f64": torch.float64, "double": torch.float64,
    "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "tf32": "tf32", "tensorfloat32": "tf32",
    "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
    "e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2,
    "e5m2fnuz": torch.float8_e5m2fnuz, "fp8_e5m2fnuz": torch.float8_e5m2fnuz,
    "e8m0": torch.float8_e8m0fnu, "e8m0fnu": torch.float8_e8m0fnu,
}


def _lookup(dtype: str) -> object:
    """A dtype name or alias (any case, ``torch.`` prefix or not) as what it names, or None."""
    name = dtype.strip().lower().removeprefix("torch.")
    return _ALIASES.get(name, getattr(torch, name, None))


def canonical(dtype: DTypeLike) -> DTypeLike:
    """torch.dtype, or the string "tf32" (no torch dtype): complex -> its component dtype."""
    if isinstance(dtype, str):
        found = _lookup(dtype)
        if not isinstance(found, torch.dtype) and found != "tf32":
            raise DriftcheckError(
                f"unknown dtype {dtype!r}: use a torch dtype name (float32, bfloat16, "
                "float8_e4m3fn, int64, ...) or fp64, fp32, tf32, fp16, bf16, e4m3, e5m2"
            )
        dtype = found
    if isinstance(dtype, torch.dtype) and dtype.is_complex:
        dtype = dtype.to_real()
    return dtype


def is_exact(dtype: DTypeLike) -> bool:
    """Integer and bool dtypes: no rounding."""
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point


def known(dtype: DTypeLike) -> DTypeLike:
    d = canonical(dtype)
    if not is_exact(d) and d not in _UNIT_ROUNDOFF:
        raise DriftcheckError(f"no precision model for dtype {d}: unpack or upcast it before comparing")
    return d


def unit_roundoff(dtype: DTypeLike) -> float:
    """Unit roundoff u of ``dtype`` (fp32 2^-24, bf16 2^-8, ...); 0.0 for integer/bool dtypes.

    Accepts torch dtypes and names: ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ``"tf32"``,
    ``"e4m3"``, ... Complex dtypes take their component's roundoff.
    """
    d = known(dtype)
    return 0.0 if is_exact(d) else _UNIT_ROUNDOFF[d]


def coarser(a: DTypeLike, b: DTypeLike) -> DTypeLike:
    """The dtype (canonical form: torch.dtype or "tf32") with the larger unit roundoff; ``a`` on ties."""
    ca, cb = known(a), known(b)
    return cb if unit_roundoff(cb) > unit_roundoff(ca) else ca


def default_tolerances(dtype: DTypeLike) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` following torch.testing.assert_close; (0, 0) for integers."""
    d = known(dtype)
    return (0.0, 0.0) if is_exact(d) else _TOLERANCES[d]


def significand_bits(dtype: DTypeLike) -> int:
    """p, the significand bits (implicit bit included) of a floating dtype: u = 2^-p (bf16 8,
    fp16 11, fp32 24)."""
    return -math.frexp(unit_roundoff(dtype))[1] + 1


def float_name(dtype: DTypeLike) -> str:
    """A floating dtype's trace name: ``torch.bfloat16`` / ``"bf16"`` / ``"torch.bfloat16"`` ->
    ``"bfloat16"`` (a torch dtype is named whatever it is).

    Raises:
        DriftcheckError: a name of no floating dtype with a precision model (``"int8"``, ``"tf32"``).
    """
    if isinstance(dtype, torch.dtype):
        return name_of(dtype)
    found = _lookup(str(dtype))
    if not (isinstance(found, torch.dtype) and found.is_floating_point and found in _UNIT_ROUNDOFF):
        raise DriftcheckError(
            f"unknown dtype {dtype!r}: use float32, float64, bfloat16 or float16 (bf16, fp16, ...)"
        )
    return name_of(found)


def eps_tiny(d: DTypeLike) -> tuple[float, float]:
    eps = 2.0 * _UNIT_ROUNDOFF[d]
    tiny = float(torch.finfo(torch.float32 if isinstance(d, str) else d).tiny)  # "tf32": fp32's range
    return eps, tiny


# -- names ---------------------------------------------------------------------------------------
# The short names the command line takes (--dtype, --reference-dtype, --target-dtype).
CLI_DTYPES: dict[str, torch.dtype] = {cli: getattr(torch, name) for cli, name in CLI_DTYPE_NAMES.items()}

# The fp8 formats of emulated fp8 training (record --fp8), by recipe name.
FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_FORMAT_OF = {dtype: name for name, dtype in FP8_FORMATS.items()}

_NAMES: dict[torch.dtype, str] = {}


def name_of(dtype: torch.dtype) -> str:
    """A torch dtype's trace name: ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """A trace dtype name as a torch dtype."""
    return getattr(torch, name)


def parse_cli(name: str) -> torch.dtype:
    """A ``--dtype`` value (fp32, bf16, fp16, fp64 or the long names) as a torch dtype."""
    try:
        return CLI_DTYPES[name.lower()]
    except (KeyError, AttributeError):
        hint = ""
        if isinstance(name, str) and name.lower().startswith(("fp8", "e4m3", "e5m2", "float8")):
            hint = " (fp8 is not a storage dtype here: --fp8 e4m3|e5m2|hybrid emulates fp8 training of Linear layers)"
        raise DriftcheckError(f"unsupported --dtype {name!r}: choose fp32, bf16, fp16 or fp64{hint}") from None


# -- predicates on trace dtype names -------------------------------------------------------------
def is_float(name: str) -> bool:
    """Floating or complex (a value with rounding), by trace name."""
    return name in FLOAT_NAMES or name.startswith("complex")


def measure_kind(name: str) -> str:
    """exact (integer/bool), real or complex: only tensors of one kind can be measured together."""
    return "complex" if name.startswith("complex") else ("real" if is_float(name) else "exact")


def tiny(name: str) -> float:
    """Smallest normal of a real floating dtype (0.0 for integers, complex and unknown names)."""
    try:
        real = is_float(name) and not name.startswith("complex")
        return float(torch.finfo(getattr(torch, name)).tiny) if real else 0.0
    except (TypeError, AttributeError):
        return 0.0


def largest(name: str) -> float | None:
    """Largest finite value of a real floating dtype; None for others."""
    if not is_float(name) or name.startswith("complex"):
        return None
    return float(torch.finfo(getattr(torch, name)).max)


def accumulation_roundoff(name: str) -> float:
    """The roundoff of the accumulator a kernel of this dtype sums in (fp64, else fp32)."""
    return 2.0**-53 if name == "float64" else 2.0**-24

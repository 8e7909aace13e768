"""Error metrics between a reference tensor and a target tensor, in float64, chunk by chunk.

Pure numerics: no filesystem, no click/rich. Every tensor is read in flat chunks that are moved
to the CPU and upcast to float64 one at a time, so memory stays bounded by the chunk size however
large the tensor. Sums are float64 within a chunk (torch's cascade sum) and compensated
(Neumaier) across chunks, so results do not depend on the chunk size beyond float64 rounding;
maxima, counts and ``max_abs_index`` are exactly independent of it.

``tensor_error`` / ``ErrorAccumulator.result()`` return a flat dict:

================== ==========================================================================
``count``          number of elements compared (complex tensors: real and imaginary parts)
``count_finite``   positions where both sides are finite: every error metric is over these
``max_abs``        max |t - r|
``max_abs_index``  flat (row-major) index of the first position reaching ``max_abs``;
                   -1 when no finite pair differs
``mean_abs``       mean |t - r|
``rms``            root-mean-square error sqrt(mean (t - r)^2)
``rel_l2``         ||t - r||_2 / ||r||_2; 0 when the error is zero, inf when only r is zero
``cosine``         <r, t> / (||r|| ||t||); 1.0 when both are all-zero, 0.0 when exactly one is
``max_ulp``        max |t - r| / ulp(|r|) with ulp taken in the coarser of the two dtypes
``frac_outside``   fraction of finite pairs with |t - r| > atol + rtol * |r|
``rtol``, ``atol`` the tolerances used (defaults from the coarser dtype, as assert_close)
``sqnr_db``        10 log10(sum r^2 / sum (t - r)^2); inf when the error is zero
``ref_rms``        rms of the reference over its own finite values
``ref_absmax``     max |r| over the reference's finite values
``tgt_rms``        rms of the target over its own finite values
``nan_ref``        NaN count in the reference (``nan_tgt``, ``inf_ref``, ``inf_tgt`` alike)
``nonfinite_new``  positions where the target is NaN/Inf and the reference is finite
``nonfinite_mismatch`` positions where exactly one side is non-finite, or both are but differ
                   (NaN vs Inf, +Inf vs -Inf); NaN vs NaN and same-sign Inf pairs agree
================== ==========================================================================

Integer and bool tensors are compared like floats (ulp 1, tolerances 0); int64 values above
2^53 lose precision in the float64 upcast.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from driftcheck.errors import DriftcheckError

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


def _canonical(dtype: DTypeLike) -> DTypeLike:
    """torch.dtype, or the string "tf32" (no torch dtype): complex -> its component dtype."""
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        found = _ALIASES.get(name, getattr(torch, name, None))
        if not isinstance(found, torch.dtype) and found != "tf32":
            raise DriftcheckError(
                f"unknown dtype {dtype!r}: use a torch dtype name (float32, bfloat16, "
                "float8_e4m3fn, int64, ...) or fp64, fp32, tf32, fp16, bf16, e4m3, e5m2"
            )
        dtype = found
    if isinstance(dtype, torch.dtype) and dtype.is_complex:
        dtype = dtype.to_real()
    return dtype


def _is_exact(dtype: DTypeLike) -> bool:
    """Integer and bool dtypes: no rounding."""
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point


def _known(dtype: DTypeLike) -> DTypeLike:
    d = _canonical(dtype)
    if not _is_exact(d) and d not in _UNIT_ROUNDOFF:
        raise DriftcheckError(f"no precision model for dtype {d}: unpack or upcast it before comparing")
    return d


def unit_roundoff(dtype: DTypeLike) -> float:
    """Unit roundoff u of ``dtype`` (fp32 2^-24, bf16 2^-8, ...); 0.0 for integer/bool dtypes.

    Accepts torch dtypes and names: ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ``"tf32"``,
    ``"e4m3"``, ... Complex dtypes take their component's roundoff.
    """
    d = _known(dtype)
    return 0.0 if _is_exact(d) else _UNIT_ROUNDOFF[d]


def coarser(a: DTypeLike, b: DTypeLike) -> DTypeLike:
    """The dtype (canonical form: torch.dtype or "tf32") with the larger unit roundoff; ``a`` on ties."""
    ca, cb = _known(a), _known(b)
    return cb if unit_roundoff(cb) > unit_roundoff(ca) else ca


def default_tolerances(dtype: DTypeLike) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` following torch.testing.assert_close; (0, 0) for integers."""
    d = _known(dtype)
    return (0.0, 0.0) if _is_exact(d) else _TOLERANCES[d]


def _eps_tiny(d: DTypeLike) -> tuple[float, float]:
    eps = 2.0 * _UNIT_ROUNDOFF[d]
    tiny = float(torch.finfo(torch.float32 if d == "tf32" else d).tiny)
    return eps, tiny


def ulp(x: torch.Tensor, dtype: DTypeLike) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64 in, float64 out).

    Normal range: eps * 2^floor(log2|x|). Below the smallest normal ``tiny`` (and at zero) the
    spacing is the subnormal step tiny*eps. Inf -> inf, NaN -> NaN. Integer dtypes: 1.
    The formula extends past the dtype's max, so values outside its range still get a spacing.
    """
    d = _known(dtype)
    x = x.to(torch.float64)
    if _is_exact(d):
        return torch.where(torch.isnan(x), x, torch.ones_like(x))
    eps, tiny = _eps_tiny(d)
    ax = x.abs()
    _, exp = torch.frexp(ax)  # ax = m * 2^exp, m in [0.5, 1): floor(log2 ax) = exp - 1
    normal = eps * torch.exp2((exp - 1).to(torch.float64))
    out = torch.where(ax < tiny, torch.full_like(ax, tiny * eps), normal)
    return torch.where(torch.isfinite(ax), out, ax)  # inf -> inf, nan -> nan


class _Sum:
    """Neumaier-compensated running sum of float64 partials (one per chunk)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.comp = 0.0

    def add(self, v: float) -> None:
        t = self.total + v
        if abs(self.total) >= abs(v):
            self.comp += (self.total - t) + v
        else:
            self.comp += (v - t) + self.total
        self.total = t

    @property
    def value(self) -> float:
        return self.total + self.comp


def _as_float64(chunk: torch.Tensor) -> torch.Tensor:
    """Flat float64 CPU copy of one chunk; complex as interleaved (real, imag)."""
    c = chunk.detach()
    if c.is_complex():
        c = torch.view_as_real(c)
    # Move first, then upcast: TPU/MPS have no float64.
    return c.reshape(-1).to("cpu").to(torch.float64)


_EXPONENT_BITS = 0x7FF0000000000000  # sign and mantissa cleared: the power of two of a float64


class ErrorAccumulator:
    """Streaming error metrics of target vs reference, fed chunk by chunk in row-major order.

    Args:
        ref_dtype, tgt_dtype: the precision each side computed in (may differ from the stored
            dtype, e.g. ``"tf32"``); ULP and default tolerances use the coarser of the two.
        rtol, atol: override the tolerances for ``frac_outside``.

    Example:
        acc = ErrorAccumulator(torch.float32, torch.bfloat16)
        for r, t in zip(ref_chunks, tgt_chunks):
            acc.update(r, t)
        acc.result()["max_ulp"]
    """

    def __init__(self, ref_dtype: DTypeLike, tgt_dtype: DTypeLike,
                 rtol: float | None = None, atol: float | None = None) -> None:
        self.ref_dtype = _known(ref_dtype)
        self.tgt_dtype = _known(tgt_dtype)
        self.coarse = coarser(self.ref_dtype, self.tgt_dtype)
        d_rtol, d_atol = default_tolerances(self.coarse)
        self.rtol: float = d_rtol if rtol is None else float(rtol)
        self.atol: float = d_atol if atol is None else float(atol)
        self._n = 0
        self._n_pair = 0
        self._n_ref = 0
        self._n_tgt = 0
        self._abs, self._sq = _Sum(), _Sum()
        self._rr, self._tt, self._rt = _Sum(), _Sum(), _Sum()
        self._ref_sq, self._tgt_sq = _Sum(), _Sum()
        self._max_abs = 0.0
        self._max_index = -1
        self._max_ulp = 0.0
        self._outside = 0
        self._ref_absmax = 0.0
        self._counts = dict.fromkeys(
            ("nan_ref", "nan_tgt", "inf_ref", "inf_tgt", "nonfinite_new", "nonfinite_mismatch"), 0
        )

    def update(self, ref_chunk: torch.Tensor, tgt_chunk: torch.Tensor) -> None:
        """Add the next chunk pair (same number of elements; any dtype, any device)."""
        r, t = _as_float64(ref_chunk), _as_float64(tgt_chunk)
        if r.numel() != t.numel():
            raise ValueError(f"chunk sizes differ: reference {r.numel()}, target {t.numel()}")
        offset, n = self._n, r.numel()
        self._n += n
        if n == 0:
            return
        if not _is_exact(self.coarse):
            rr, tt = float(torch.dot(r, r)), float(torch.dot(t, t))
            if math.isfinite(rr) and math.isfinite(tt):  # finite sums of squares: all finite
                self._update_finite(r, t, offset, n, rr, tt)
                return
        fr, ft = torch.isfinite(r), torch.isfinite(t)
        nan_r, nan_t = torch.isnan(r), torch.isnan(t)
        c = self._counts
        c["nan_ref"] += int(nan_r.sum())
        c["nan_tgt"] += int(nan_t.sum())
        c["inf_ref"] += int(torch.isinf(r).sum())
        c["inf_tgt"] += int(torch.isinf(t).sum())
        c["nonfinite_new"] += int((fr & ~ft).sum())
        # Both non-finite agree only when equal (same-sign inf) or both NaN.
        agree = (r == t) | (nan_r & nan_t)
        c["nonfinite_mismatch"] += int(((fr ^ ft) | (~fr & ~ft & ~agree)).sum())

        both = fr & ft
        zero = torch.zeros((), dtype=torch.float64)
        # Zero out non-pair positions instead of gathering: indices stay flat, sums unaffected.
        r0, t0 = torch.where(both, r, zero), torch.where(both, t, zero)
        e = t0 - r0
        ae = e.abs()
        self._n_pair += int(both.sum())
        self._abs.add(float(ae.sum()))
        self._sq.add(float((e * e).sum()))
        self._rr.add(float((r0 * r0).sum()))
        self._tt.add(float((t0 * t0).sum()))
        self._rt.add(float((r0 * t0).sum()))
        m = float(ae.max())
        if m > self._max_abs:  # strict: the first chunk holding the max keeps it
            self._max_abs = m
            self._max_index = offset + int(ae.argmax())  # argmax: first occurrence
        ar = r0.abs()
        self._max_ulp = max(self._max_ulp, float((ae / ulp(ar, self.coarse)).max()))
        self._outside += int((both & (ae > self.atol + self.rtol * ar)).sum())

        rf = torch.where(fr, r, zero)
        tf = torch.where(ft, t, zero)
        self._n_ref += int(fr.sum())
        self._n_tgt += int(ft.sum())
        self._ref_sq.add(float((rf * rf).sum()))
        self._tgt_sq.add(float((tf * tf).sum()))
        self._ref_absmax = max(self._ref_absmax, float(rf.abs().max()))

    def _update_finite(self, r: torch.Tensor, t: torch.Tensor, offset: int, n: int,
                       rr: float, tt: float) -> None:
        # The common case, every value finite: the same metrics in far fewer passes (dot
        # products for sums of squares, the ULP spacing read off the float64 exponent bits, no
        # masking), which keeps compare near memory speed.
        e = t - r
        ae = e.abs()
        m = float(ae.max())
        if m > self._max_abs:  # strict: the first chunk holding the max keeps it
            self._max_abs = m
            self._max_index = offset + int(ae.argmax())  # argmax: first occurrence
        self._n_pair += n
        self._n_ref += n
        self._n_tgt += n
        self._abs.add(float(ae.sum()))
        self._sq.add(float(torch.dot(e, e)))
        self._rr.add(rr)
        self._tt.add(tt)
        self._rt.add(float(torch.dot(r, t)))
        self._ref_sq.add(rr)
        self._tgt_sq.add(tt)
        ar = r.abs()
        self._ref_absmax = max(self._ref_absmax, float(ar.max()))
        # ulp(|r|) = eps * 2^floor(log2 max(|r|, tiny)): zeroing the mantissa bits of a normal
        # float64 gives 2^floor(log2 x) exactly; below tiny the subnormal step tiny*eps.
        eps, tiny = _eps_tiny(self.coarse)
        pow2 = (ar.clamp(min=tiny).view(torch.int64) & _EXPONENT_BITS).view(torch.float64)
        self._max_ulp = max(self._max_ulp, float((ae / pow2).max()) / eps)
        self._outside += int(torch.count_nonzero(ae > ar.mul_(self.rtol).add_(self.atol)))

    def result(self) -> dict[str, float | int]:
        """The metrics so far (keys in the module docstring)."""
        n = self._n_pair
        sq, rr, tt = self._sq.value, self._rr.value, self._tt.value
        if sq == 0.0:
            rel_l2, sqnr = 0.0, math.inf
        elif rr == 0.0:
            rel_l2, sqnr = math.inf, -math.inf
        else:
            rel_l2, sqnr = math.sqrt(sq / rr), 10.0 * math.log10(rr / sq)
        if rr == 0.0 and tt == 0.0:
            cosine = 1.0
        elif rr == 0.0 or tt == 0.0:
            cosine = 0.0
        else:
            # sqrt separately: rr * tt can overflow float64 for fp64 data near its range.
            cosine = max(-1.0, min(1.0, self._rt.value / (math.sqrt(rr) * math.sqrt(tt))))
        return {
            "count": self._n,
            "count_finite": n,
            "max_abs": self._max_abs,
            "max_abs_index": self._max_index,
            "mean_abs": self._abs.value / n if n else 0.0,
            "rms": math.sqrt(sq / n) if n else 0.0,
            "rel_l2": rel_l2,
            "cosine": cosine,
            "max_ulp": self._max_ulp,
            "frac_outside": self._outside / n if n else 0.0,
            "rtol": self.rtol,
            "atol": self.atol,
            "sqnr_db": sqnr,
            "ref_rms": math.sqrt(self._ref_sq.value / self._n_ref) if self._n_ref else 0.0,
            "ref_absmax": self._ref_absmax,
            "tgt_rms": math.sqrt(self._tgt_sq.value / self._n_tgt) if self._n_tgt else 0.0,
            **self._counts,
        }


def _flat_chunks(t: torch.Tensor, chunk_elems: int) -> Iterator[torch.Tensor]:
    """Row-major flat pieces of ``t``, each at most ``chunk_elems`` elements.

    The split depends only on the shape (slices along dim 0, recursing into rows larger than a
    chunk), so two tensors of one shape split alike whatever their strides; a non-contiguous
    piece is copied on its own, never the whole tensor.
    """
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.numel() == 0:
        return
    row = t[0].numel()
    if row > chunk_elems:  # only when t.dim() > 1: a 1-D row is one element
        for i in range(t.shape[0]):
            yield from _flat_chunks(t[i], chunk_elems)
        return
    step = max(1, chunk_elems // row)
    for start in range(0, t.shape[0], step):
        yield t[start:start + step].reshape(-1)


def _check_pair(ref: torch.Tensor, tgt: torch.Tensor, chunk_elems: int) -> None:
    if ref.shape != tgt.shape:
        raise DriftcheckError(
            f"cannot compare tensors of shapes {tuple(ref.shape)} (reference) and "
            f"{tuple(tgt.shape)} (target): both runs must record the same model and inputs"
        )
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")


def tensor_error(
    ref: torch.Tensor,
    tgt: torch.Tensor,
    *,
    ref_dtype: DTypeLike | None = None,
    tgt_dtype: DTypeLike | None = None,
    chunk_elems: int = 1 << 20,
    rtol: float | None = None,
    atol: float | None = None,
) -> dict[str, float | int]:
    """Error metrics of ``tgt`` against ``ref`` (same shape), streamed in flat chunks.

    Args:
        ref, tgt: tensors of any dtype and device; each chunk is upcast to float64 on the CPU.
        ref_dtype, tgt_dtype: computing precision of each side; default: the tensors' dtypes.
        chunk_elems: elements per chunk; bounds the float64 working memory.
        rtol, atol: tolerances for ``frac_outside``; default: the coarser dtype's.

    Returns:
        The metrics dict described in the module docstring.

    Example:
        tensor_error(ref_fp32, tgt_bf16)["max_ulp"]  # in bf16 ULPs
    """
    _check_pair(ref, tgt, chunk_elems)
    acc = ErrorAccumulator(
        ref.dtype if ref_dtype is None else ref_dtype,
        tgt.dtype if tgt_dtype is None else tgt_dtype,
        rtol=rtol,
        atol=atol,
    )
    for r, t in zip(_flat_chunks(ref, chunk_elems), _flat_chunks(tgt, chunk_elems)):
        acc.update(r, t)
    return acc.result()


def _pair_chunks(ref: torch.Tensor, tgt: torch.Tensor, chunk_elems: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for r, t in zip(_flat_chunks(ref, chunk_elems), _flat_chunks(tgt, chunk_elems)):
        yield _as_float64(r), _as_float64(t)


def _log_errors(r: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """log10 |t - r| over finite pairs with a non-zero error, and the count of exact matches."""
    both = torch.isfinite(r) & torch.isfinite(t)
    ae = (t[both] - r[both]).abs()
    nonzero = ae > 0
    return torch.log10(ae[nonzero]), int((~nonzero).sum())


class ErrorHistogram(NamedTuple):
    """Histogram of log10 |t - r|: ``counts[i]`` errors in [edges[i], edges[i+1]), the last bin
    closed; errors beyond the edges fall in the end bins. ``exact``: finite pairs with no error."""

    edges: list[float]
    counts: list[int]
    exact: int


def error_histogram(
    ref: torch.Tensor,
    tgt: torch.Tensor,
    bins: int | Sequence[float] = 40,
    *,
    chunk_elems: int = 1 << 20,
) -> ErrorHistogram:
    """Histogram of log10 |tgt - ref| over finite pairs with a non-zero error, streamed.

    Args:
        bins: a number of equal bins spanning whole decades around the observed errors (two
            passes over the data), or explicit edges in log10 units (one pass).

    Returns:
        ``ErrorHistogram(edges, counts, exact)``; with ``bins`` an int and no non-zero error,
        ``edges`` and ``counts`` are empty.

    Example:
        h = error_histogram(ref, tgt, 30)  # h.edges[0] == -7.0 means bins start at 1e-7
    """
    _check_pair(ref, tgt, chunk_elems)
    if isinstance(bins, int):
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        lo, hi = math.inf, -math.inf
        for r, t in _pair_chunks(ref, tgt, chunk_elems):
            logs, _ = _log_errors(r, t)
            if logs.numel():
                lo, hi = min(lo, float(logs.min())), max(hi, float(logs.max()))
        if lo > hi:
            exact = sum(_log_errors(r, t)[1] for r, t in _pair_chunks(ref, tgt, chunk_elems))
            return ErrorHistogram([], [], exact)
        lo, hi = math.floor(lo), math.ceil(hi)
        hi = hi if hi > lo else lo + 1
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    else:
        edges = torch.tensor([float(e) for e in bins], dtype=torch.float64)
        if edges.numel() < 2 or not bool((edges[1:] > edges[:-1]).all()):
            raise ValueError("bins must be at least two strictly increasing edges")
    nbins = edges.numel() - 1
    counts = torch.zeros(nbins, dtype=torch.int64)
    exact = 0
    for r, t in _pair_chunks(ref, tgt, chunk_elems):
        logs, ex = _log_errors(r, t)
        exact += ex
        # right=True: boundaries[i-1] <= v < boundaries[i]; inner edges only, so the end bins
        # take everything beyond the outer edges.
        idx = torch.bucketize(logs, edges[1:-1].contiguous(), right=True)
        counts += torch.bincount(idx, minlength=nbins)
    return ErrorHistogram(edges.tolist(), [int(c) for c in counts], exact)


SUMMARY_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel", "zeros")


def summary_stats(t: torch.Tensor, *, chunk_elems: int = 1 << 20) -> dict[str, float | int]:
    """Summary of ``t`` over its finite values, in float64, streamed (the reference for stats.py).

    Keys: ``min``, ``max``, ``mean``, ``std`` (population, as stats.py), ``absmax``, ``l2``
    (over finite values), ``nan``, ``inf``, ``numel``, ``zeros`` (exact zeros). With no finite
    value min/max/mean/std are NaN; an empty tensor also has absmax NaN. Complex tensors are
    summarised by their magnitudes, like stats.py.
    """
    n_all = n = 0
    mean = m2 = 0.0
    lo, hi, absmax = math.inf, -math.inf, 0.0
    sq = _Sum()
    nan = inf = zeros = 0
    for chunk in _flat_chunks(t, chunk_elems):
        x = _as_float64(chunk.abs() if chunk.is_complex() else chunk)
        n_all += x.numel()
        nan += int(torch.isnan(x).sum())
        inf += int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        zeros += int((x == 0).sum())
        k = x.numel()
        if k == 0:
            continue
        mk = float(x.mean())
        m2k = float(((x - mk) ** 2).sum())
        # Chan et al. pairwise merge of (count, mean, M2): stable where sum x^2 - n mean^2 is not.
        delta = mk - mean
        total = n + k
        mean += delta * k / total
        m2 += m2k + delta * delta * n * k / total
        n = total
        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
        absmax = max(absmax, float(x.abs().max()))
        sq.add(float((x * x).sum()))
    nanv = math.nan
    return {
        "min": lo if n else nanv,
        "max": hi if n else nanv,
        "mean": mean if n else nanv,
        "std": math.sqrt(m2 / n) if n else nanv,
        "absmax": absmax if n_all else nanv,
        "l2": math.sqrt(sq.value),
        "nan": nan,
        "inf": inf,
        "numel": n_all,
        "zeros": zeros,
    }

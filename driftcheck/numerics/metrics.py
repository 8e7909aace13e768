"""Error metrics between a reference tensor and a target tensor, in float64, chunk by chunk.

Pure numerics: no filesystem, no click/rich. Every tensor is read in flat chunks that are moved
to the CPU one at a time and measured in float64 by one compiled pass (``kernels.py``: each value
widened in registers, never a float64 copy of the chunk), so memory stays bounded by the chunk
size however large the tensor (a chunk of at most ``passes.SMALL`` finite pairs is measured by
numpy instead, with the same results up to the order of its float64 sums: a comparison of small
tensors never imports numba). Sums are float64 within a chunk (vectorized partial sums) and
compensated (Neumaier) across chunks, so results do not depend on the chunk size beyond float64
rounding; maxima, counts, ``max_abs_index`` and the error histogram are exactly independent of it.

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
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import passes
from driftcheck.numerics.dtypes import DTypeLike, coarser, default_tolerances, eps_tiny, is_exact, known


def ulp(x: torch.Tensor, dtype: DTypeLike) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64 in, float64 out).

    Normal range: eps * 2^floor(log2|x|). Below the smallest normal ``tiny`` (and at zero) the
    spacing is the subnormal step tiny*eps. Inf -> inf, NaN -> NaN. Integer dtypes: 1.
    The formula extends past the dtype's max, so values outside its range still get a spacing.
    """
    d = known(dtype)
    x = x.to(torch.float64)
    if is_exact(d):
        return torch.where(torch.isnan(x), x, torch.ones_like(x))
    eps, tiny = eps_tiny(d)
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


def _as_array(chunk: torch.Tensor) -> np.ndarray:
    """One chunk as the kernels read it (``passes.host_array``); complex as interleaved
    (real, imag)."""
    return passes.host_array(torch.view_as_real(chunk) if chunk.is_complex() else chunk)


_LOG10_2 = math.log10(2.0)


class ErrorHistogram(NamedTuple):
    """Histogram of log10 |t - r| over finite pairs with a non-zero error: ``counts[i]`` errors
    in [edges[i], edges[i+1]). Edges lie on powers of two (``k * log10 2``): one bin per binade,
    or whole groups of binades when the errors span more than the bins asked for.
    ``exact``: finite pairs with no error."""

    edges: list[float]
    counts: list[int]
    exact: int


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
        acc.histogram()  # log10 |t - r|, one bin per binade
    """

    def __init__(self, ref_dtype: DTypeLike, tgt_dtype: DTypeLike,
                 rtol: float | None = None, atol: float | None = None) -> None:
        self.ref_dtype = known(ref_dtype)
        self.tgt_dtype = known(tgt_dtype)
        self.coarse = coarser(self.ref_dtype, self.tgt_dtype)
        d_rtol, d_atol = default_tolerances(self.coarse)
        self.rtol: float = d_rtol if rtol is None else float(rtol)
        self.atol: float = d_atol if atol is None else float(atol)
        if is_exact(self.coarse):
            self._unit, self._tiny = 0.0, 0.0
        else:
            self._unit, self._tiny = eps_tiny(self.coarse)
        self._n = 0
        self._sums = {f: _Sum() for f in ("abs", "sq", "rr", "tt", "rt", "ref_sq", "tgt_sq")}
        self._counts = dict.fromkeys(
            ("n_pair", "n_ref", "n_tgt", "outside", "exact", "nan_ref", "nan_tgt", "inf_ref",
             "inf_tgt", "nonfinite_new", "nonfinite_mismatch"), 0)
        self._max_abs = 0.0
        self._max_index = -1
        self._max_ulp = 0.0
        self._ref_absmax = 0.0
        self._hist = np.zeros(passes.HIST_BINS, dtype=np.int64)

    def update(self, ref_chunk: torch.Tensor, tgt_chunk: torch.Tensor) -> None:
        """Add the next chunk pair (same number of elements; any dtype, any device)."""
        r, t = _as_array(ref_chunk), _as_array(tgt_chunk)
        if r.size != t.size:
            raise ValueError(f"chunk sizes differ: reference {r.size}, target {t.size}")
        if r.dtype != t.dtype:
            r, t = r.astype(np.float64), t.astype(np.float64)
        offset = self._n
        self._n += r.size
        if r.size == 0:
            return
        hist = np.zeros(passes.HIST_BINS, dtype=np.int64)
        args = (r, t, self.rtol, self.atol, self._tiny, self._unit, hist)
        small = passes.small_pass(*args) if r.size <= passes.SMALL else None
        if small is not None:  # numpy: a small chunk of finite values
            p = dict(zip(passes.FIELDS, small))
        else:
            from driftcheck.numerics import kernels  # numba: imported where it is used

            p = dict(zip(passes.FIELDS, kernels.finite_pass(*args)))
            if math.isfinite(p["rr"]) and math.isfinite(p["tt"]):  # finite sums: every value finite
                if p["max_abs"] > self._max_abs:
                    p["max_index"] = kernels.first_index(r, t, p["max_abs"])
            else:
                hist[:] = 0
                p = dict(zip(passes.FIELDS, kernels.general_pass(*args)))
        self._hist += hist
        for f, s in self._sums.items():
            s.add(p[f])
        for f in self._counts:
            self._counts[f] += p[f]
        if p["max_abs"] > self._max_abs:  # strict: the first chunk holding the max keeps it
            self._max_abs = p["max_abs"]
            self._max_index = offset + p["max_index"]
        self._max_ulp = max(self._max_ulp, p["max_ulp"])
        self._ref_absmax = max(self._ref_absmax, p["ref_absmax"])

    def merge(self, other: ErrorAccumulator) -> None:
        """Append ``other``: it accumulated the elements that follow this one's (a tensor
        measured in parts on several threads, merged left to right)."""
        if (other.coarse, other.rtol, other.atol) != (self.coarse, self.rtol, self.atol):
            raise ValueError("cannot merge accumulators of different precisions or tolerances")
        offset = self._n
        self._n += other._n
        for f, s in self._sums.items():
            s.add(other._sums[f].total)
            s.add(other._sums[f].comp)
        for f in self._counts:
            self._counts[f] += other._counts[f]
        if other._max_abs > self._max_abs:  # strict: the earlier part keeps a tied maximum
            self._max_abs = other._max_abs
            self._max_index = offset + other._max_index
        self._max_ulp = max(self._max_ulp, other._max_ulp)
        self._ref_absmax = max(self._ref_absmax, other._ref_absmax)
        self._hist += other._hist

    def result(self) -> dict[str, float | int]:
        """The metrics so far (keys in the module docstring)."""
        c = self._counts
        n = c["n_pair"]
        sq, rr, tt = (self._sums[f].value for f in ("sq", "rr", "tt"))
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
            cosine = max(-1.0, min(1.0, self._sums["rt"].value / (math.sqrt(rr) * math.sqrt(tt))))
        n_ref, n_tgt = c["n_ref"], c["n_tgt"]
        return {
            "count": self._n,
            "count_finite": n,
            "max_abs": self._max_abs,
            "max_abs_index": self._max_index,
            "mean_abs": self._sums["abs"].value / n if n else 0.0,
            "rms": math.sqrt(sq / n) if n else 0.0,
            "rel_l2": rel_l2,
            "cosine": cosine,
            "max_ulp": self._max_ulp,
            "frac_outside": c["outside"] / n if n else 0.0,
            "rtol": self.rtol,
            "atol": self.atol,
            "sqnr_db": sqnr,
            "ref_rms": math.sqrt(self._sums["ref_sq"].value / n_ref) if n_ref else 0.0,
            "ref_absmax": self._ref_absmax,
            "tgt_rms": math.sqrt(self._sums["tgt_sq"].value / n_tgt) if n_tgt else 0.0,
            **{k: c[k] for k in ("nan_ref", "nan_tgt", "inf_ref", "inf_tgt", "nonfinite_new",
                                 "nonfinite_mismatch")},
        }

    def histogram(self, max_bins: int = 40) -> ErrorHistogram:
        """Histogram of log10 |t - r| so far: one bin per binade of the float64 error, whole
        groups of binades when the errors span more than ``max_bins``; empty edges and counts
        when no finite pair differs."""
        if max_bins < 1:
            raise ValueError(f"max_bins must be >= 1, got {max_bins}")
        h = self._hist.copy()
        exact = self._counts["exact"]
        h[1] += h[0] - exact  # float64-subnormal errors (bin 0 beside the exact zeros)
        h[0] = 0
        nz = np.flatnonzero(h)
        if nz.size == 0:
            return ErrorHistogram([], [], exact)
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        group = -(-(hi - lo) // max_bins)
        starts = range(lo, hi, group)
        counts = [int(h[k:k + group].sum()) for k in starts]
        edges = [(k - 1023) * _LOG10_2 for k in [*starts, starts[-1] + group]]
        return ErrorHistogram(edges, counts, exact)


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
    return _accumulate(ref, tgt, chunk_elems, ErrorAccumulator(
        ref.dtype if ref_dtype is None else ref_dtype,
        tgt.dtype if tgt_dtype is None else tgt_dtype,
        rtol=rtol,
        atol=atol,
    )).result()


def error_histogram(ref: torch.Tensor, tgt: torch.Tensor, max_bins: int = 40, *,
                    chunk_elems: int = 1 << 20) -> ErrorHistogram:
    """Histogram of log10 |tgt - ref| over finite pairs with a non-zero error, streamed
    (``ErrorAccumulator.histogram``).

    Example:
        h = error_histogram(ref, tgt)  # h.edges[0] == -24 * log10(2): errors from 2^-24 up
    """
    return _accumulate(ref, tgt, chunk_elems, ErrorAccumulator(ref.dtype, tgt.dtype)).histogram(max_bins)


def _accumulate(ref: torch.Tensor, tgt: torch.Tensor, chunk_elems: int,
                acc: ErrorAccumulator) -> ErrorAccumulator:
    """``acc`` fed every chunk pair of two in-memory tensors of the same shape."""
    _check_pair(ref, tgt, chunk_elems)
    for r, t in zip(_flat_chunks(ref, chunk_elems), _flat_chunks(tgt, chunk_elems)):
        acc.update(r, t)
    return acc

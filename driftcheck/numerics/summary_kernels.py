"""The compiled inner loops of stats mode on the host (``stats.summarize``, the capture hooks):
``segment_stats`` (statistics of many small captures laid end to end), ``dense_stats`` (one
large capture; ``copy_stats`` copies it in the same pass; ``widen_bf16`` and ``widen_f16`` give
it narrow floats a chunk at a time), ``sample_positions`` and
``gather_sample`` (the seeded sample), ``summarize_into``
(statistics and sample of one capture, taken in its hook) and ``col_sumsq`` (a Linear's operand
magnitude, record/meta.py). Pure numerics, no I/O; compiled by numba on first use, as
``kernels``, whose conventions they share (float64 sums, reassociated, never approximated).
"""
from __future__ import annotations

import math

import numpy as np
from numba import types
from numba.extending import overload

from driftcheck.numerics.kernels import BLOCK, FLAGS, flat_view, host_array, jit  # noqa: F401  (re-exported)


@jit()
def segment_stats(x, lengths, out):  # pragma: no cover (compiled)
    """Summary statistics of consecutive segments of ``x`` (float32 or float64), one row of
    ``out`` (float64, ``(len(lengths), 9)``) per segment, columns as ``stats.FIELDS``: min, max,
    mean, std (population), absmax, l2 over the finite values (NaN for min..std without any,
    absmax 0), then the NaN count, the Inf count and the length. Two passes per segment (the
    mean, then the squared deviations from it): no cancellation for |mean| >> std. A segment
    whose sums come out finite has no NaN/Inf and takes the vectorized passes."""
    start = 0
    for k in range(lengths.shape[0]):
        n = lengths[k]
        seg = x[start:start + n]
        start += n
        row = out[k]
        row[8] = n
        s, sq, lo, hi = dense_stats(seg)
        if n > 0 and math.isfinite(s) and math.isfinite(sq):
            mean = s / n
            row[0] = lo
            row[1] = hi
            row[2] = mean
            row[3] = math.sqrt(_squared_deviation(seg, mean) / n)
            row[4] = max(abs(lo), abs(hi))
            row[5] = math.sqrt(sq)
            row[6] = 0.0
            row[7] = 0.0
        else:
            _segment_general(seg, row)


@jit(fastmath=FLAGS)
def _squared_deviation(seg, mean):  # pragma: no cover (compiled)
    dev = 0.0
    for j in range(seg.shape[0]):
        d = np.float64(seg[j]) - mean
        dev += d * d
    return dev


@jit()
def _segment_general(seg, row):  # pragma: no cover (compiled)
    """``segment_stats`` of one segment holding NaN/Inf (or overflowing float64 squares)."""
    n = seg.shape[0]
    count = 0
    nan = 0
    inf = 0
    s = 0.0
    sq = 0.0
    lo = math.inf
    hi = -math.inf
    for j in range(n):
        v = np.float64(seg[j])
        if math.isfinite(v):
            count += 1
            s += v
            sq += v * v
            lo = min(lo, v)
            hi = max(hi, v)
        elif math.isnan(v):
            nan += 1
        else:
            inf += 1
    row[6] = nan
    row[7] = inf
    row[5] = math.sqrt(sq)
    if count == 0:
        row[0] = row[1] = row[2] = row[3] = math.nan
        row[4] = 0.0
        return
    mean = s / count
    dev = 0.0
    for j in range(n):
        v = np.float64(seg[j])
        if math.isfinite(v):
            dev += (v - mean) * (v - mean)
    row[0] = lo
    row[1] = hi
    row[2] = mean
    row[3] = math.sqrt(dev / count)
    row[4] = max(abs(lo), abs(hi))


@jit()
def sample_positions(base, shifts, lengths, offsets, out):  # pragma: no cover (compiled)
    """Stats-mode sample positions of many tensors (``stats.sample_indices``): row i of ``out`` is
    min(floor(((base + shifts[i]) mod 1) * lengths[i]), lengths[i] - 1) + offsets[i].
    base + shift lies in [0, 2): subtracting 1 is exact."""
    for i in range(shifts.shape[0]):
        n = lengths[i]
        for j in range(base.shape[0]):
            x = base[j] + shifts[i]
            if x >= 1.0:
                x -= 1.0
            out[i, j] = min(np.int64(x * n), n - 1) + offsets[i]


@jit()
def gather_sample(x, base, shift, out):  # pragma: no cover (compiled)
    """The stats-mode sample of one flat array of more than len(base) elements: out[j] =
    x[min(floor(((base[j] + shift) mod 1) * n), n - 1)], the positions ``sample_positions``
    gives (no fastmath: the positions must be those, bit for bit)."""
    n = x.shape[0]
    for j in range(base.shape[0]):
        v = base[j] + shift
        if v >= 1.0:
            v -= 1.0
        out[j] = x[min(np.int64(v * n), n - 1)]


@jit()
def summarize_into(x, base, shift, rows, samples, k):  # pragma: no cover (compiled)
    """One capture at once: ``segment_stats`` of all of ``x`` (flat, non-empty) into
    ``rows[k]`` and its stats-mode sample into ``samples[k]``: all of ``x`` when it has at
    most len(base) elements, else the elements at ``sample_positions`` for this ``shift``."""
    n = x.shape[0]
    lengths = np.empty(1, np.int64)
    lengths[0] = n
    segment_stats(x, lengths, rows[k:k + 1])
    m = base.shape[0]
    if n <= m:
        for j in range(n):
            samples[k, j] = x[j]
        return
    gather_sample(x, base, shift, samples[k])


@jit(fastmath=FLAGS)
def dense_stats(x):  # pragma: no cover (compiled)
    """(sum, sum of squares, min, max) of a float32/float64 array in float64, one pass.

    Meant for arrays the caller then checks: a NaN or Inf anywhere makes the sum or the sum of
    squares non-finite. min/max are taken over order-preserving integer keys of the values' own
    bit patterns (int32 for float32, int64 for float64; negative values with their magnitude
    bits flipped), which vectorize where a floating-point min/max reduction does not."""
    return _stats_pass(x, x, False)


@jit(fastmath=FLAGS)
def copy_stats(x, out):  # pragma: no cover (compiled)
    """``dense_stats(x)`` while copying ``x`` into ``out`` (same dtype and length), in the same
    pass: full mode keeps a copy of each capture and its statistics, and the source is read once,
    while it is in cache, instead of once for the copy and once more, cold, for the statistics."""
    return _stats_pass(x, out, True)


@jit(fastmath=FLAGS)
def _stats_pass(x, out, copy):  # pragma: no cover (compiled)
    n = x.shape[0]
    s = 0.0
    sq = 0.0
    keys = _keys(out if copy else x)
    lo, hi = _key_bounds(keys)
    for start in range(0, n, BLOCK):  # slices, not index ranges: those do not vectorize
        xb = x[start:start + BLOCK]
        m = xb.shape[0]
        if copy:  # the copy in the same loop: one read of each element
            ob = out[start:start + BLOCK]
            for j in range(m):
                ob[j] = xb[j]
                v = np.float64(ob[j])
                s, sq = s + v, sq + v * v
        else:
            for j in range(m):
                v = np.float64(xb[j])
                s, sq = s + v, sq + v * v
        lo, hi = _key_range(keys[start:start + BLOCK], lo, hi)  # the block again, from L1
    mn, mx = _key_values(keys, lo, hi)
    return s, sq, mn, mx


@jit()
def widen_bf16(bits, out):  # pragma: no cover (compiled)
    """bfloat16 values, given as their uint16 bit patterns, into ``out`` (float32, as long):
    a bfloat16 is the upper half of the float32 of the same value, so this is exact."""
    o = out.view(np.uint32)
    for j in range(bits.shape[0]):
        o[j] = np.uint32(bits[j]) << np.uint32(16)


@jit()
def widen_f16(bits, out):  # pragma: no cover (compiled)
    """float16 values, given as their uint16 bit patterns, into ``out`` (float32, as long),
    exactly (numba has no float16 arithmetic on the host; numpy's cast is ~6x slower): the
    exponent rebiased (15 -> 127), the mantissa shifted up; zeros, infinities and NaN payloads
    keep their bits (a NaN quieted); a subnormal is its mantissa times 2^-24, exact in float32."""
    o = out.view(np.uint32)
    for j in range(bits.shape[0]):
        h = np.uint32(bits[j])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        e = (h >> np.uint32(10)) & np.uint32(0x1F)
        m = h & np.uint32(0x3FF)
        if e == np.uint32(0x1F):  # (a NaN quieted, as the hardware's conversion does)
            o[j] = sign | np.uint32(0x7F800000) | (m << np.uint32(13)) | (np.uint32(0x400000) if m else np.uint32(0))
        elif e != np.uint32(0):
            o[j] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
        else:
            v = np.float32(m) * np.float32(5.9604645e-08)  # 2^-24
            out[j] = -v if sign else v


@jit(fastmath=FLAGS)
def weighted_absmax(x, cols, span):  # pragma: no cover (compiled)
    """``record.watch``'s weighted |logit| max of a float32/float64 softmax input, rows of
    ``cols`` laid end to end (softmax over the last dim): max(largest finite row max, -(least
    element within ``span`` below its row's max), 0), the row max and threshold rounded to
    float32 as the torch expression does; a row holding NaN or a non-finite max keeps nothing.
    Two scans of each row while it is in L1, both on integer keys (they vectorize)."""
    keys = _keys(x)
    high = -math.inf
    least = 0.0  # kept values below 0 are what counts: start at 0
    for start in range(0, x.shape[0], cols):
        row = keys[start:start + cols]
        lo, hi = _key_bounds(row)
        lo, hi = _key_range(row, lo, hi)
        mn, mx = _key_values(row, lo, hi)
        top = np.float32(mx)
        if math.isnan(mn) or not math.isfinite(top):  # NaN (either sign) or +-inf as the max
            continue
        high = max(high, np.float64(top))
        floor = np.float32(top - np.float32(span))
        least = min(least, _least_at_or_above(row, x[start:start + cols], floor))
    return max(np.float32(high), np.float32(-least), np.float32(0.0))


# Order-preserving integer keys of float bit patterns, in the values' own width: a float32
# array's min/max runs on int32 lanes (twice as many per vector as int64). Chosen by dtype when
# the calling kernel compiles (numba overloads): one loop in _stats_pass for both dtypes.
_MAG32 = np.int32(0x7FFFFFFF)
_MAG64 = np.int64(0x7FFFFFFFFFFFFFFF)
_SHIFT32 = np.int32(31)


def _flip(k):  # pragma: no cover (replaced by its overload in compiled code)
    raise NotImplementedError


def _keys(x):  # pragma: no cover (replaced by its overload in compiled code)
    raise NotImplementedError


def _key_bounds(keys):  # pragma: no cover
    raise NotImplementedError


def _key_range(keys, lo, hi):  # pragma: no cover
    raise NotImplementedError


def _key_values(keys, lo, hi):  # pragma: no cover
    raise NotImplementedError


def _least_at_or_above(keys, x, floor):  # pragma: no cover
    raise NotImplementedError


@overload(_flip, inline="always")
def _flip_impl(k):  # pragma: no cover (compiled)
    """A float bit pattern's order-preserving key, and back (the flip is its own inverse):
    negative values with their magnitude bits flipped. Every int32 step cast back to int32:
    numba widens int32 arithmetic to int64, and a loop would then run on int64 lanes."""
    if k == types.int32:
        return lambda k: np.int32(k ^ np.int32(np.int32(k >> _SHIFT32) & _MAG32))
    return lambda k: k ^ ((k >> 63) & _MAG64)


@overload(_keys, inline="always")
def _keys_impl(x):  # pragma: no cover (compiled)
    if x.dtype == types.float32:
        return lambda x: x.view(np.int32)
    return lambda x: x.view(np.int64)


@overload(_key_bounds, inline="always")
def _key_bounds_impl(keys):  # pragma: no cover (compiled)
    """(largest key, smallest key): the starting (lo, hi) of a min/max scan."""
    if keys.dtype == types.int32:
        return lambda keys: (np.int32(0x7FFFFFFF), np.int32(-0x7FFFFFFF - 1))
    return lambda keys: (np.int64(0x7FFFFFFFFFFFFFFF), np.int64(-0x7FFFFFFFFFFFFFFF - 1))


@overload(_key_range, inline="always")
def _key_range_impl(keys, lo, hi):  # pragma: no cover (compiled)
    """(lo, hi) widened by the keys of a block (int32 or int64: ``_flip`` keeps the width)."""
    def impl(keys, lo, hi):
        for j in range(keys.shape[0]):
            k = _flip(keys[j])
            lo = k if k < lo else lo
            hi = k if k > hi else hi
        return lo, hi
    return impl


@overload(_key_values, inline="always")
def _key_values_impl(keys, lo, hi):  # pragma: no cover (compiled)
    """The float64 values of keys lo and hi (the flip is its own inverse)."""
    if keys.dtype == types.int32:
        def impl32(keys, lo, hi):
            ends = np.array([lo, hi], np.int32)
            for i in range(2):
                ends[i] = _flip(ends[i])
            f = ends.view(np.float32)
            return np.float64(f[0]), np.float64(f[1])
        return impl32

    def impl64(keys, lo, hi):
        ends = np.array([lo, hi], np.int64)
        for i in range(2):
            ends[i] = _flip(ends[i])
        f = ends.view(np.float64)
        return f[0], f[1]
    return impl64


@jit(fastmath=FLAGS)
def col_sumsq(x, k, out):  # pragma: no cover (compiled)
    """out[j] = sum over rows r of x[r * k + j]^2 in float64: the column sums of squares of a
    flat row-major (rows, k) float32/float64 array, in one pass and no temporary."""
    rows = x.shape[0] // k
    for j in range(k):
        out[j] = 0.0
    for r in range(rows):
        row = x[r * k:(r + 1) * k]
        for j in range(k):
            v = np.float64(row[j])
            out[j] += v * v


@overload(_least_at_or_above, inline="always")
def _least_at_or_above_impl(keys, x, floor):  # pragma: no cover (compiled)
    """min(0, least x[j] >= floor) as a float64, on the keys of x (a key of 0 where x[j] is
    below floor or NaN: the compare is false)."""
    if keys.dtype == types.int32:
        def impl32(keys, x, floor):
            m = np.int32(0)
            for j in range(keys.shape[0]):
                k = _flip(keys[j])
                k = k if x[j] >= floor else np.int32(0)
                m = k if k < m else m
            return _key_values(keys, m, m)[0]
        return impl32

    def impl64(keys, x, floor):
        m = np.int64(0)
        f = np.float64(floor)
        for j in range(keys.shape[0]):
            k = _flip(keys[j])
            k = k if x[j] >= f else np.int64(0)
            m = k if k < m else m
        return _key_values(keys, m, m)[0]
    return impl64

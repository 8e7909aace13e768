"""The compiled inner loops of ``metrics.ErrorAccumulator`` (one pass over a chunk pair) and of
``stats.summarize`` on the host (statistics of many captured tensors at once).

Pure numerics, no I/O. Each kernel reads a chunk pair of float32 or float64 numpy arrays
(``host_array`` widens other dtypes exactly), computes every per-chunk partial in float64 registers in a
single pass, and releases the GIL, so compare's worker threads run truly in parallel. Compiled by
numba on first use and cached on disk beside this file (or in numba's user cache directory).

``finite_pass`` is the common case and assumes every value is finite: its sums of squares come
out non-finite when one is not, and the caller then runs ``general_pass``, which accounts for
NaN/Inf position by position. Both fill ``hist`` (``HIST_BINS`` int64 counters) with the binary
exponent of each finite pair's |t - r| as a float64: bin k counts errors in [2^(k-1023),
2^(k-1022)); bin 0 holds zero and float64-subnormal errors.

Stats mode's kernels (the statistics and samples of captures on the host) are in
``summary_kernels``; ``host_array`` and ``flat_view`` (how both read a host tensor) are in ``passes``
(re-exported here), with ``small_pass``: the same partials in numpy for small chunks.

Sums are float64 and may be reassociated (vectorized partial sums), never fused or approximated:
no fast-math flag that changes what a single operation returns is set, and NaN/Inf propagate.
"""
from __future__ import annotations

import math
import signal
import threading

import numba
import numpy as np

from driftcheck.numerics.passes import (  # noqa: F401  (re-exported: how the kernels read a tensor)
    EXPONENT_BITS,
    FIELDS,
    HIST_BINS,
    RECIPROCAL_BITS,
    flat_view,
    host_array,
)

BLOCK = 1024  # elements per inner block (two float64 buffers stay in L1)
FLAGS = {"reassoc", "nsz"}  # reorder sums, ignore the sign of zero: results of each op unchanged


def jit(**options):
    """``numba.njit(nogil=True, cache=True)``; without a writable cache location (a read-only
    install and no writable home), compile on first use in each process instead. Either way
    compiling (or loading from the cache) holds Ctrl-C back until it is done: see
    ``hold_interrupts``."""
    def decorate(fn):
        try:
            dispatcher = numba.njit(nogil=True, cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            dispatcher = numba.njit(nogil=True, **options)(fn)
        return hold_interrupts(dispatcher)
    return decorate


def hold_interrupts(dispatcher):
    """Make ``dispatcher`` (a numba ``njit`` function) compile with SIGINT held back.

    numba compiles on a call with new argument types, and LLVM calls back into Python through
    ctypes while it does: a KeyboardInterrupt raised inside such a callback is printed as "Exception
    ignored" and lost, and the process then dies of the signal (exit status -2) instead of
    finishing the trace as interrupted (130). While a kernel compiles in the main thread, SIGINT is
    only noted, and raised as the usual KeyboardInterrupt once the compile is done. Calls with types
    already compiled never reach this (numba's dispatcher calls ``_compile_for_args`` only on a
    miss), so it costs nothing per call."""
    compile_for_args = dispatcher._compile_for_args

    def compile_holding_interrupts(*args, **kws):
        handler = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is not threading.main_thread() or not callable(handler):
            return compile_for_args(*args, **kws)  # Python's handlers run in the main thread only
        caught = []
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
        try:
            return compile_for_args(*args, **kws)
        finally:
            signal.signal(signal.SIGINT, handler)
            if caught:
                handler(*caught[0])

    dispatcher._compile_for_args = compile_holding_interrupts
    return dispatcher


@jit(fastmath=FLAGS)
def finite_pass(r, t, rtol, atol, tiny, unit, hist):  # pragma: no cover (compiled)
    """Partials (``FIELDS``) of a chunk pair assumed all finite; ``max_index`` is -1 (the
    caller finds it with ``first_index`` only when the chunk's maximum is a new one).

    ``unit``: ULPs are counted in spacings ``unit * 2^floor(log2 max(|r|, tiny))`` when
    ``unit`` > 0 (floating dtypes: unit = eps); in plain |t - r| when ``unit`` == 0 (integers).

    Written for the vectorizer: each block is sliced so the inner loops index from 0, and the
    maxima are taken over the int64 bit patterns of non-negative float64 values (ordered like
    the values), since a floating-point max reduction keeps LLVM from vectorizing a loop.
    """
    n = r.shape[0]
    ae_buf = np.empty(BLOCK, np.float64)
    ar_buf = np.empty(BLOCK, np.float64)
    ae_bits = ae_buf.view(np.int64)
    ar_bits = ar_buf.view(np.int64)
    tiny_bits = np.array([tiny], np.float64).view(np.int64)[0]
    s_abs = 0.0
    s_sq = 0.0
    s_rr = 0.0
    s_tt = 0.0
    s_rt = 0.0
    outside = 0
    exact = 0
    mx = np.int64(0)
    amax = np.int64(0)
    mu = np.int64(0)
    for start in range(0, n, BLOCK):
        rb = r[start:start + BLOCK]
        tb = t[start:start + BLOCK]
        m = rb.shape[0]
        for j in range(m):
            a = np.float64(rb[j])
            b = np.float64(tb[j])
            e = b - a
            ae = abs(e)
            ar = abs(a)
            s_abs += ae
            s_sq += e * e
            s_rr += a * a
            s_tt += b * b
            s_rt += a * b
            outside += ae > atol + rtol * ar
            exact += ae == 0.0
            ae_buf[j] = ae
            ar_buf[j] = ar
        for j in range(m):
            x = ae_bits[j]
            mx = x if x > mx else mx
            y = ar_bits[j]
            amax = y if y > amax else amax
            # 2^floor(log2 max(|r|, tiny)) of a normal float64 is its exponent bits alone, and
            # its reciprocal has exponent bits 2046 - those, so the multiplication below is
            # exact like a division, at a fraction of its cost. The result is only used when
            # the sums of squares are finite, i.e. every |r| < 2^512: the reciprocal is normal.
            ar_bits[j] = RECIPROCAL_BITS - ((y if y > tiny_bits else tiny_bits) & EXPONENT_BITS)
        if unit > 0.0:
            for j in range(m):
                ar_buf[j] = ae_buf[j] * ar_buf[j]
            for j in range(m):
                q = ar_bits[j]
                mu = q if q > mu else mu
        for j in range(m):
            hist[ae_bits[j] >> 52] += 1
    bits = np.array([mx, amax, mu], np.int64).view(np.float64)
    max_abs = bits[0]
    max_ulp = bits[2] / unit if unit > 0.0 else max_abs
    return (n, n, n, s_abs, s_sq, s_rr, s_tt, s_rt, s_rr, s_tt, max_abs, max_ulp, outside,
            bits[1], exact, 0, 0, 0, 0, 0, 0, -1)


@jit()
def first_index(r, t, value):  # pragma: no cover (compiled)
    """First flat index where |t - r| (in float64) equals ``value``; -1 if none does."""
    for i in range(r.shape[0]):
        if abs(np.float64(t[i]) - np.float64(r[i])) == value:
            return i
    return -1


@jit()
def general_pass(r, t, rtol, atol, tiny, unit, hist):  # pragma: no cover (compiled)
    """Partials (``FIELDS``) of any chunk pair, NaN and Inf included: error metrics over the
    positions where both sides are finite, each side's own statistics over its finite values,
    and the non-finite counts. ``max_index`` is the first position of this chunk's maximum
    error among finite pairs (-1 when every finite pair matches exactly)."""
    n_pair = 0
    n_ref = 0
    n_tgt = 0
    s_abs = 0.0
    s_sq = 0.0
    s_rr = 0.0
    s_tt = 0.0
    s_rt = 0.0
    ref_sq = 0.0
    tgt_sq = 0.0
    mx = 0.0
    mi = -1
    mu = 0.0
    amax = 0.0
    outside = 0
    exact = 0
    nan_r = 0
    nan_t = 0
    inf_r = 0
    inf_t = 0
    new = 0
    mismatch = 0
    bits = np.empty(1, np.float64)
    pw = np.empty(1, np.float64)
    pw_bits = pw.view(np.int64)
    for i in range(r.shape[0]):
        a = np.float64(r[i])
        b = np.float64(t[i])
        fa = math.isfinite(a)
        fb = math.isfinite(b)
        na = math.isnan(a)
        nb = math.isnan(b)
        nan_r += na
        nan_t += nb
        inf_r += not (fa or na)
        inf_t += not (fb or nb)
        new += fa and not fb
        if fa != fb or (not fa and not fb and not (a == b or (na and nb))):
            mismatch += 1
        if fa:
            n_ref += 1
            ref_sq += a * a
            amax = max(amax, abs(a))
        if fb:
            n_tgt += 1
            tgt_sq += b * b
        if fa and fb:
            e = b - a
            ae = abs(e)
            ar = abs(a)
            n_pair += 1
            s_abs += ae
            s_sq += e * e
            s_rr += a * a
            s_tt += b * b
            s_rt += a * b
            if ae > mx:  # strict: the first position holding the maximum keeps it
                mx = ae
                mi = i
            if unit > 0.0:  # ae / 2^floor(log2 max(|r|, tiny)): the exponent bits alone
                pw[0] = max(ar, tiny)
                pw_bits[0] &= EXPONENT_BITS
                mu = max(mu, ae / pw[0])
            else:
                mu = max(mu, ae)
            outside += ae > atol + rtol * ar
            exact += ae == 0.0
            bits[0] = ae
            hist[bits.view(np.int64)[0] >> 52] += 1
    if unit > 0.0:
        mu = mu / unit
    return (n_pair, n_ref, n_tgt, s_abs, s_sq, s_rr, s_tt, s_rt, ref_sq, tgt_sq, mx, mu, outside,
            amax, exact, nan_r, nan_t, inf_r, inf_t, new, mismatch, mi)

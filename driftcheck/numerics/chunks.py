"""Chunks: one compiled pass over a large host array cut into fixed chunks, the chunks spread
over as many threads as torch's intra-op pool has.

A capture hook runs on the training thread while torch's other intra-op threads wait for the
next op: the statistics' read pass over a large capture (``stats.large_row``), the Linear
operand magnitudes (record/meta.py) and the logit watch (record/watch.py) used one core of the
several the step itself uses. The compiled kernels release the GIL, so helper threads reading
other chunks of the same array run beside the hook's own; the pass is memory-bound and two
threads read a large array 1.4-1.9x as fast as one on the development host.

The results do not depend on the thread count: the chunks are fixed (``CHUNK`` elements, from
the array's start) and their partial sums are added in chunk order whichever thread made them,
so a pass gives the same statistics bit for bit on 1 thread and on 8 (the compiled kernels'
own vectorized float64 sums are not changed by it). Minima and maxima are exact either way.
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from driftcheck.numerics import crc

CHUNK = 1 << 18  # elements a chunk (1 MiB of float32): ~0.1-0.2 ms of reading, ~20 us to hand over
MAX_THREADS = 8
MAX_BLOCKS = 64  # column sums: blocks of rows a pass is cut into, at most
T = TypeVar("T")

_lock = threading.Lock()
_local = threading.local()  # .helper: this thread is one of the helpers
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)


def _helpers() -> ThreadPoolExecutor:
    """The helper threads (made on first use; made again in a forked child, where the parent's
    threads do not exist)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="driftcheck-chunks"))
        return _pool[1]


def threads(chunks: int) -> int:
    """How many threads ``chunks`` chunks are spread over: torch's intra-op count (what the
    user gave the step), at most one per chunk and ``MAX_THREADS``."""
    return max(1, min(torch.get_num_threads(), chunks, MAX_THREADS))


def spread(fn: Callable[[int], T], count: int) -> list[T]:
    """``[fn(0), ..., fn(count - 1)]``, the indices cut into ``threads(count)`` consecutive
    runs: the first on the calling thread, the others on helpers."""
    k = threads(count)
    if k == 1 or getattr(_local, "helper", False):  # (a helper's own call: serial, no deadlock)
        return [fn(i) for i in range(count)]
    bounds = [count * j // k for j in range(k + 1)]

    def run(j: int) -> list[T]:
        return [fn(i) for i in range(bounds[j], bounds[j + 1])]

    def helper(j: int) -> list[T]:
        _local.helper = True
        return run(j)

    pool = _helpers()
    pending: list[Future[list[T]]] = [pool.submit(helper, j) for j in range(1, k)]
    try:
        out = run(0)
    finally:
        # Every helper is done before this returns or raises: none may still be reading an
        # array (or writing a copy) the caller is about to free or reuse. A Ctrl-C while
        # waiting is raised once they are.
        interrupted: BaseException | None = None
        for f in pending:
            while True:
                try:
                    f.exception()
                    break
                except BaseException as e:  # (KeyboardInterrupt: wait on, raise it after)
                    interrupted = e
        if interrupted is not None:
            raise interrupted
    for f in pending:
        out.extend(f.result())
    return out


def _wide(n: int) -> np.ndarray:
    """This thread's float32 block for a widened chunk (at most ``CHUNK`` elements), its first
    ``n``; made once a thread and kept (a block freed each chunk would move glibc's mmap
    threshold, store/buffers.py ``mapped_empty``)."""
    block = getattr(_local, "wide", None)
    if block is None:
        block = _local.wide = np.empty(CHUNK, dtype=np.float32)
    return block[:n]


def _cuts(n: int, chunk: int) -> list[int]:
    return list(range(0, n, chunk)) + [n]


def stats(kernel: Callable[..., tuple[float, float, float, float]], x: np.ndarray,
          out: np.ndarray | None = None, checksum: bool = False,
          widen: Callable[[np.ndarray, np.ndarray], Any] | None = None
          ) -> tuple[float, float, float, float, int | None]:
    """(sum, sum of squares, min, max, CRC32C or None) of a flat array by ``kernel``
    (``dense_stats`` on ``x``, or ``copy_stats`` copying it into ``out``), chunk by chunk; the
    sums added in chunk order. ``checksum``: the CRC32C of ``out``'s bytes too, each chunk's
    taken right after its copy (in cache) and combined (numerics/crc.py). ``widen``: ``x``
    holds narrow floats, each chunk widened by ``widen(chunk, into)`` into a float32 block of
    its thread's (kept: no allocation a chunk) for ``kernel``, the same chunks and sums as on
    the whole array widened first. A NaN or Inf anywhere makes a sum non-finite, as the
    kernel's own."""
    n = x.shape[0]
    cuts = _cuts(n, CHUNK) if n > CHUNK else [0, n]
    width = x.itemsize

    def part(i: int) -> tuple[tuple[float, float, float, float], int]:
        a, b = cuts[i], cuts[i + 1]
        if widen is not None:
            wide = _wide(b - a)
            widen(x[a:b], wide)
            return kernel(wide), 0
        if out is None:
            return kernel(x[a:b]), 0
        got = kernel(x[a:b], out[a:b])
        return got, (crc.checksum(out[a:b]) if checksum else 0)

    parts = spread(part, len(cuts) - 1) if len(cuts) > 2 else [part(0)]
    value = crc.combine_all((c, (cuts[i + 1] - cuts[i]) * width) for i, (_, c) in enumerate(parts)) \
        if checksum and out is not None else None
    if len(parts) == 1:
        return (*parts[0][0], value)
    s = sq = 0.0
    for p, _ in parts:
        s += p[0]
        sq += p[1]
    lows, highs = [p[2] for p, _ in parts], [p[3] for p, _ in parts]
    if any(math.isnan(v) for v in lows + highs):
        return s, sq, math.nan, math.nan, value
    return s, sq, min(lows), max(highs), value


def checksum(x: np.ndarray) -> int:
    """The CRC32C of a flat array's bytes, chunk by chunk, combined."""
    n = x.shape[0]
    if n <= CHUNK:
        return crc.checksum(x)
    cuts = _cuts(n, CHUNK)
    parts = spread(lambda i: crc.checksum(x[cuts[i]:cuts[i + 1]]), len(cuts) - 1)
    return crc.combine_all((c, (cuts[i + 1] - cuts[i]) * x.itemsize) for i, c in enumerate(parts))


def col_sumsq(kernel: Callable[..., Any], x: np.ndarray, k: int, out: np.ndarray) -> None:
    """``out[j]`` = the sum over rows of ``x[r * k + j] ** 2`` (``x`` flat, row-major (rows, k)),
    by ``kernel`` (``col_sumsq``) over blocks of whole rows; the blocks' sums added in order."""
    rows = x.shape[0] // k
    # rows a block: a chunk's worth, and at most MAX_BLOCKS blocks (each holds k partial sums)
    per = max(1, CHUNK // max(k, 1), -(-rows // MAX_BLOCKS))
    if rows <= per:
        kernel(x, k, out)
        return
    cuts = _cuts(rows, per)

    def block(i: int) -> np.ndarray:
        part = np.empty(k, dtype=np.float64)
        kernel(x[cuts[i] * k:cuts[i + 1] * k], k, part)
        return part

    parts = spread(block, len(cuts) - 1)
    out[:] = parts[0]
    for p in parts[1:]:
        out += p


def row_max(kernel: Callable[[np.ndarray, int, float], float], x: np.ndarray, cols: int,
            span: float) -> float:
    """``kernel`` (``weighted_absmax``: a maximum over rows of ``cols``) over blocks of whole
    rows, the largest of the blocks' results: exact, whatever the blocks."""
    rows = x.shape[0] // max(cols, 1)
    per = max(1, CHUNK // max(cols, 1))
    if rows <= per:
        return kernel(x, cols, span)
    cuts = _cuts(rows, per)
    return max(spread(lambda i: kernel(x[cuts[i] * cols:cuts[i + 1] * cols], cols, span), len(cuts) - 1))


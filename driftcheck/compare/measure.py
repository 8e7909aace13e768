"""Streaming measurement: every aligned pair read once, chunk by chunk, and measured.

Full tensors are streamed from the memory-mapped shards (memory bounded by the chunk), on
``workers`` threads (the kernels release the GIL), a large pair split into parts measured side
by side and merged in order. Stats-mode entries are measured on their seeded samples, or
estimated from their summary statistics.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from driftcheck.compare.entries import TraceEntry
from driftcheck.numerics import dtypes, metrics as mx
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

PART_ELEMS = 1 << 22  # elements above which one pair is measured in parts, on several workers
HISTOGRAM_BINS = 40  # at most, each a whole number of binades of |target - reference|


class Measured(NamedTuple):
    """One pair read and measured: its metrics, what they were measured on ("full", "sample" or
    "stats") and the error histogram of the elements read (None for "stats")."""

    metrics: dict[str, Any]
    how: str
    histogram: mx.ErrorHistogram | None


def rms_of(stats: dict[str, Any]) -> float:
    n = stats.get("numel") or 0
    l2 = stats.get("l2")
    if not n or l2 is None or not math.isfinite(l2):
        return 0.0
    return l2 / math.sqrt(n)


def stats_metrics(rs: dict[str, Any], ts: dict[str, Any]) -> dict[str, Any]:
    """Error estimates from summary statistics alone (stats mode without a sample)."""
    rr, tr = rms_of(rs), rms_of(ts)
    mean_d = abs((ts.get("mean") or 0.0) - (rs.get("mean") or 0.0))
    # Lower bounds on the error: ||t-r|| >= | ||t|| - ||r|| |, and |mean(t-r)|.
    rms = max(abs(tr - rr), mean_d)
    amax = max(abs((ts.get("max") or 0) - (rs.get("max") or 0)), abs((ts.get("min") or 0) - (rs.get("min") or 0)))
    return {"rms": rms, "max_abs": amax, "ref_rms": rr, "ref_absmax": rs.get("absmax") or 0.0,
            "tgt_rms": tr, "nan_ref": rs.get("nan", 0), "nan_tgt": ts.get("nan", 0),
            "inf_ref": rs.get("inf", 0), "inf_tgt": ts.get("inf", 0),
            "nonfinite_new": max(0, (ts.get("nan", 0) + ts.get("inf", 0)) - (rs.get("nan", 0) + rs.get("inf", 0))),
            "estimated_from": "stats"}


def saturation(r: TraceEntry, t: TraceEntry) -> float | None:
    """The coarser side's largest finite value, when the reference goes beyond it."""
    limits = [x for x in (dtypes.largest(r.dtype), dtypes.largest(t.dtype)) if x is not None]
    if not limits:
        return None
    lim = min(limits)
    absmax = max(abs(r.stats.get("min") or 0.0), abs(r.stats.get("max") or 0.0))
    return lim if absmax > 0.5 * lim else None


class Progress:
    """Pairs measured, then entries judged: told to ``on_progress`` as (done, total)."""

    def __init__(self, on_progress: Callable[[int, int], None] | None = None) -> None:
        self.on_progress = on_progress
        self.done, self.total = 0, 0

    def start(self, total: int) -> None:
        self.done, self.total = 0, total

    def tick(self) -> None:
        """One more pair measured or entry judged: tell ``on_progress``."""
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(min(self.done, self.total), self.total)


Job = tuple[int, tuple[int, int] | None]  # (pair, its flat element range or None: whole)


class Measurer:
    """Measures pairs of entries of two runs: all aligned pairs up front on ``workers`` threads
    (:meth:`measure_all`), kept until judged (:meth:`pair_metrics`), or one pair on demand."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, *, chunk_elems: int = 1 << 17,
                 workers: int = 1, progress: Progress | None = None) -> None:
        self.ref, self.tgt = ref, tgt
        self.chunk_elems = chunk_elems
        self.workers = workers
        self.progress = progress or Progress()
        self.measured: dict[TraceKey, Measured] = {}  # measured up front, until judged

    def pair_metrics(self, r: TraceEntry, t: TraceEntry) -> Measured:
        """The metrics of an aligned pair: measured up front, else now."""
        measured = self.measured.pop(r.align, None)
        return measured if measured is not None else self.measure(self.ref, r, self.tgt, t)

    def measure(self, ref: TraceReader, r: TraceEntry, tgt: TraceReader, t: TraceEntry) -> Measured:
        """Metrics of ``t`` (in ``tgt``) against ``r`` (in ``ref``): streamed from the full
        tensors, else the stats-mode samples (the same seeded indices on both runs), else
        estimated from the summary statistics; with the error histogram of the elements read
        (None when estimated from statistics), in the same pass."""
        acc, how = self.accumulate(ref, r, tgt, t)
        return finish(acc, how, r, t)

    def accumulate(self, ref: TraceReader, r: TraceEntry, tgt: TraceReader, t: TraceEntry,
                   part: tuple[int, int] | None = None) -> tuple[mx.ErrorAccumulator | None, str]:
        """Stream the pair (or only its flat elements [lo, hi) when ``part`` is given: full
        tensors only) into an accumulator. (None, "stats") when neither side stored data."""
        rc = ref.chunks(r.raw, self.chunk_elems, part=part)
        tc = tgt.chunks(t.raw, self.chunk_elems, part=part)
        how = "full"
        if rc is None or tc is None:
            rs, ts = ref.tensor(r.raw, "sample"), tgt.tensor(t.raw, "sample")
            if rs is None or ts is None or rs.shape != ts.shape:
                return None, "stats"
            rc, tc, how = iter([rs.reshape(-1)]), iter([ts.reshape(-1)]), "sample"
        acc = mx.ErrorAccumulator(r.dtype, t.dtype)
        sat = saturation(r, t)
        for a, b in zip(rc, tc):  # one chunk at a time: memory bounded by the chunk
            if sat is not None:
                # Sentinels like finfo(dtype).min in attention masks differ by dtype by design:
                # beyond the coarser dtype's range both sides mean "saturated", not error.
                a, b = a.double().clamp(-sat, sat), b.double().clamp(-sat, sat)
            acc.update(a, b)
        return acc, how

    def parts(self, r: TraceEntry, t: TraceEntry) -> list[tuple[int, int]] | None:
        """Flat element ranges of a large pair of full tensors, measured on several workers;
        each a whole number of chunks, so the chunks are those of one stream."""
        n = math.prod(r.shape)
        if (not r.has_tensor or not t.has_tensor or n <= PART_ELEMS or r.dtype != t.dtype
                or "complex" in str(r.dtype)):
            return None
        step = max(1, PART_ELEMS // self.chunk_elems) * self.chunk_elems
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def measure_all(self, pairs: list[tuple[TraceEntry, TraceEntry]]) -> None:
        """Metrics of every pair on ``workers`` threads (the kernels release the GIL), a large
        pair split into parts measured side by side and merged in order; floors and ratios,
        which depend on earlier entries, are then judged in order."""
        self.measured = {}
        todo = [(r, t) for r, t in pairs if list(r.shape) == list(t.shape)
                and dtypes.measure_kind(r.dtype) == dtypes.measure_kind(t.dtype)]
        jobs: list[Job] = []
        for i, (r, t) in enumerate(todo):
            parts = self.parts(r, t)
            jobs += [(i, p) for p in parts] if parts else [(i, None)]
        if self.workers <= 1 or len(jobs) < 2:
            return  # measured lazily, one at a time, by pair_metrics

        def run(job: Job) -> tuple[mx.ErrorAccumulator | None, str]:
            r, t = todo[job[0]]
            return self.accumulate(self.ref, r, self.tgt, t, part=job[1])

        def done(i: int, acc: mx.ErrorAccumulator | None, how: str) -> None:
            r, t = todo[i]
            self.measured[r.align] = finish(acc, how, r, t)
            self.progress.tick()

        current: tuple[int, mx.ErrorAccumulator | None, str] | None = None
        with ThreadPoolExecutor(self.workers, thread_name_prefix="driftcheck-compare") as pool:
            # Results come in job order: a pair's parts left to right, then the next pair, so
            # each pair is merged and finished (its accumulator dropped) as soon as it is whole.
            for (i, _), (acc, how) in zip(jobs, pool.map(run, jobs)):
                if current is not None and current[0] == i:
                    if current[1] is not None and acc is not None:
                        current[1].merge(acc)
                    continue
                if current is not None:
                    done(*current)
                current = (i, acc, how)
        if current is not None:
            done(*current)


def finish(acc: mx.ErrorAccumulator | None, how: str, r: TraceEntry, t: TraceEntry) -> Measured:
    """The pair's metrics from its accumulator (from the statistics where there is none)."""
    if acc is None:
        return Measured(stats_metrics(r.stats, t.stats), "stats", None)
    m: dict[str, Any] = acc.result()
    if how == "full":
        m["ref_rms"] = m.get("ref_rms", rms_of(r.stats))
    else:
        m["ref_rms"] = rms_of(r.stats)
        m["ref_absmax"] = r.stats.get("absmax", m.get("ref_absmax"))
        m["estimated_from"] = "sample"
    return Measured(m, how, acc.histogram(HISTOGRAM_BINS))

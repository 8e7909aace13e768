"""Streaming measurement: every aligned pair read once, chunk by chunk, and measured.

Full tensors are streamed from the memory-mapped shards (memory bounded by the chunk), on
``workers`` threads (the kernels release the GIL), a large pair split into parts measured side
by side and merged in order. Stats-mode entries are measured on their seeded samples, or
estimated from their summary statistics (methods of the Comparison).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from driftcheck.compare.entries import TraceEntry
from driftcheck.numerics import dtypes, metrics as mx
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


class Measuring:
    """The measurement half of :class:`driftcheck.compare.Comparison`."""

    def _pair_metrics(self, r: TraceEntry, t: TraceEntry) -> Measured:
        measured = self._measured.pop(r.align, None)
        return measured if measured is not None else self._measure(r, t)

    def _measure(self, r: TraceEntry, t: TraceEntry) -> Measured:
        return self._measure_between(self.ref, r, self.tgt, t)

    def _measure_between(self, ref: TraceReader, r: TraceEntry, tgt: TraceReader, t: TraceEntry) -> Measured:
        """Metrics of ``t`` (in ``tgt``) against ``r`` (in ``ref``): streamed from the full
        tensors, else the stats-mode samples (the same seeded indices on both runs), else
        estimated from the summary statistics; with the error histogram of the elements read
        (None when estimated from statistics), in the same pass."""
        acc, how = self._accumulate(ref, r, tgt, t)
        return self._finish(acc, how, r, t)

    def _accumulate(self, ref: TraceReader, r: TraceEntry, tgt: TraceReader, t: TraceEntry,
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

    def _finish(self, acc: mx.ErrorAccumulator | None, how: str, r: TraceEntry, t: TraceEntry) -> Measured:
        if acc is None:
            return Measured(stats_metrics(r.stats, t.stats), "stats", None)
        m = acc.result()
        if how == "full":
            m["ref_rms"] = m.get("ref_rms", rms_of(r.stats))
        else:
            m["ref_rms"] = rms_of(r.stats)
            m["ref_absmax"] = r.stats.get("absmax", m.get("ref_absmax"))
            m["estimated_from"] = "sample"
        return Measured(m, how, acc.histogram(HISTOGRAM_BINS))

    def _parts(self, r: TraceEntry, t: TraceEntry) -> list[tuple[int, int]] | None:
        """Flat element ranges of a large pair of full tensors, measured on several workers;
        each a whole number of chunks, so the chunks are those of one stream."""
        n = math.prod(r.shape)
        if (not r.has_tensor or not t.has_tensor or n <= PART_ELEMS or r.dtype != t.dtype
                or "complex" in str(r.dtype)):
            return None
        step = max(1, PART_ELEMS // self.chunk_elems) * self.chunk_elems
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _measure_all(self, pairs: list[tuple[TraceEntry, TraceEntry]]) -> None:
        """Metrics of every pair on ``workers`` threads (the kernels release the GIL), a large
        pair split into parts measured side by side and merged in order; floors and ratios,
        which depend on earlier entries, are then judged in order."""
        self._measured = {}
        todo = [(r, t) for r, t in pairs if list(r.shape) == list(t.shape)
                and dtypes.measure_kind(r.dtype) == dtypes.measure_kind(t.dtype)]
        jobs: list[tuple[int, tuple[int, int] | None]] = []
        for i, (r, t) in enumerate(todo):
            jobs += [(i, p) for p in (self._parts(r, t) or [None])]
        if self.workers <= 1 or len(jobs) < 2:
            return  # measured lazily, one at a time, by _pair_metrics
        from concurrent.futures import ThreadPoolExecutor

        def run(job: tuple[int, tuple[int, int] | None]) -> tuple[mx.ErrorAccumulator | None, str]:
            r, t = todo[job[0]]
            return self._accumulate(self.ref, r, self.tgt, t, part=job[1])

        def finish(i: int, acc: mx.ErrorAccumulator | None, how: str) -> None:
            r, t = todo[i]
            self._measured[r.align] = self._finish(acc, how, r, t)
            self.tick()

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
                    finish(*current)
                current = (i, acc, how)
        if current is not None:
            finish(*current)

"""Normalization: a data-parallel side whose loss averages over a count that differs between the
ranks' parts (a mean of the ranks' means) against a side that took one mean over the whole batch.

A rank r of W whose loss is S_r / N_r (a Hugging Face causal LM's mean over the tokens its labels
do not mask with -100) makes the gradients of its batch part 1/(W N_r) dS_r, where one process
makes 1/N dS_r (N = the sum of the N_r): each batch part of the first backward gradient is the
other side's times one factor, c_r = N / (W N_r), and the sum of the 1/c_r is W. Named where,
on the first backward entry whose logical tensor joined the ranks' batch parts (meta
``batch_parts``, compare/layouts.py), per-part least-squares factors explain the difference (what
is left after them is under a tenth of it), differ from each other by 1% or more (equal counts
make them all 1: a uniform scale is not this), and keep that sum: a difference of
the layout, not of precision or of a kernel. Pure numerics on the two traces' tensors, or on
their samples in stats mode (the same positions on both sides).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from driftcheck.compare.parts import sample_key_of
from driftcheck.gate.report import Finding
from driftcheck.numerics import stats as tstats
from driftcheck.store.reader import TraceReader

KIND = "layout.loss_normalization"


def finding(ref: TraceReader, tgt: TraceReader) -> Finding | None:
    """The finding, or None where the first batch-joined backward gradient shows no such factors."""
    by_key = {e["key"]: e for e in ref.entries}
    for e in tgt.entries:  # execution order: the first batch-joined backward entry is the loss's
        if e["phase"] != "backward" or e["key"] not in by_key:
            continue
        r = by_key[e["key"]]
        parts = (e.get("meta") or {}).get("batch_parts"), (r.get("meta") or {}).get("batch_parts")
        if not parts[0] and not parts[1]:  # not a batch part (the loss's own scalar gradient)
            continue
        if parts[0] and parts[1]:  # both sides of ranks: no one-mean side to measure against
            return None
        got = _values(ref, r, tgt, e)
        if got is None:
            return None
        return _factors(e, got, parts[0] or parts[1], target_split=bool(parts[0]))  # type: ignore[arg-type]
    return None


def _values(ref: TraceReader, r: dict[str, Any], tgt: TraceReader, e: dict[str, Any]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(reference values, target values, their rows along dim 0): the whole tensors, or the
    samples at their flat positions."""
    if list(r["shape"]) != list(e["shape"]) or not e["shape"]:
        return None
    rows = int(e["shape"][0])
    per_row = math.prod(e["shape"]) // max(rows, 1)
    a, b = ref.tensor(r), tgt.tensor(e)
    if a is not None and b is not None:
        flat = np.arange(a.numel())
    else:
        a, b = ref.tensor(r, "sample"), tgt.tensor(e, "sample")
        if a is None or b is None or a.numel() != b.numel():
            return None
        flat = tstats.sample_indices(sample_key_of(e), math.prod(e["shape"]), int(tgt.run.get("seed") or 0))
    x, y = a.double().reshape(-1).numpy(), b.double().reshape(-1).numpy()
    return x, y, np.asarray(flat) // max(per_row, 1)


def _factors(e: dict[str, Any], got: tuple[np.ndarray, np.ndarray, np.ndarray], parts: list[int],
             target_split: bool) -> Finding | None:
    x, y, rows = got
    if not target_split:  # the reference is the data-parallel side: the factors the other way
        x, y = y, x
    ok = np.isfinite(x) & np.isfinite(y)
    before = float(np.linalg.norm((y - x)[ok]))
    if not before or not np.linalg.norm(y[ok]):
        return None
    bounds = np.cumsum([0, *parts])
    c, resid = [], np.zeros_like(y)
    for lo, hi in itertools.pairwise(bounds):
        m = ok & (rows >= lo) & (rows < hi)
        den = float(x[m] @ x[m])
        if not m.any() or den == 0.0:
            return None
        c.append(float(x[m] @ y[m]) / den)
        resid[m] = y[m] - c[-1] * x[m]
    after = float(np.linalg.norm(resid[ok]))
    w = len(parts)
    # Equal counts make every factor 1, so the layout never scales all parts alike: factors
    # that differ from each other (a uniform scale is the target's own, not this), and whose
    # inverses sum to W as the counts' shares sum to 1.
    if not (after <= 0.1 * before and all(f > 0 for f in c) and max(c) >= 1.01 * min(c)
            and abs(sum(1.0 / f for f in c) - w) <= 0.02 * w):
        return None
    shares = ", ".join(f"rank {i}: {100.0 / (w * f):.1f}%" for i, f in enumerate(c))
    side = "target" if target_split else "reference"
    return Finding(
        KIND, e["module"], e["step"],
        f"each rank's batch part of this first backward gradient is the other side's times one "
        f"factor ({', '.join(f'{f:.4g}' for f in c)}; what is left after them is {after / before:.1%} "
        f"of the difference): the {side}'s loss is a mean of its {w} ranks' means over counts that "
        f"differ between their parts (a loss that averages over the tokens its labels do not mask, "
        f"-100; counted shares {shares}), not one mean over the global batch. A difference of the "
        "layout, not of precision: compare the same layout, or give every rank the same count",
        phase="backward", key=e["key"], severity="warning",
        details={"factors": c, "explained": 1.0 - after / before, "counted_shares": [1.0 / (w * f) for f in c],
                 "data_parallel_side": side})

"""Parts: the logical stats-mode entry of a multi-rank run, from its ranks' entries of one key.

compare/layouts.py rebuilds the logical tensor of a full-mode entry; a stats-mode entry has only
statistics and a 512-element sample, so its logical entry is rebuilt from those
(docs/trace-format.md, "Layouts"):

- where every rank's sample is its whole tensor (at most 512 elements), the logical tensor
  itself, exactly as in full mode, then its statistics and its sample;
- a part joined with the others (a DTensor shard ``S<d>``, a data-parallel batch slice): the
  statistics combine exactly (counts, sums, sums of squares, extremes); the sample is the
  ranks' shares of the logical sample (record/parts.py, meta ``part``), at the positions a
  single process samples;
- a sum or a mean over the ranks (a partial sum ``P``, the loss, DDP's gradients before the
  all-reduce, a gradient every rank holds whole): each rank sampled the same positions, so the
  sample is the sum or mean of theirs; the statistics of a sum cannot be combined from its
  terms' and are estimated from that sample (meta ``stats_from_sample``);
- replicated: rank 0's.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import stats as tstats
from driftcheck.store.format import block_of
from driftcheck.store.keys import sample_key

Entry = dict[str, Any]


def whole(group: list[Entry], samples: list[torch.Tensor]) -> bool:
    """Whether every rank's sample is its whole tensor (at most 512 elements)."""
    return all(s.numel() == math.prod(g["shape"]) for s, g in zip(samples, group))


def of_tensor(e: Entry, t: torch.Tensor, seed: int) -> tuple[list[int], dict[str, Any], torch.Tensor]:
    """(shape, statistics, sample) of the logical tensor ``t`` of entry ``e``, rebuilt whole."""
    return list(t.shape), tstats.to_dict(tstats.stats_vector(t).tolist()), tstats.sample_of(t, sample_key_of(e), seed)


def logical(group: list[Entry], samples: list[torch.Tensor], how: str, seed: int,
            expect: list[int] | None = None) -> tuple[list[int], dict[str, Any], torch.Tensor, bool]:
    """(shape, statistics, sample, whether the statistics are estimated from the sample) of the
    logical entry whose ranks' samples are not all whole (:func:`whole`, :func:`of_tensor`), ``how``
    as compare/layouts.py ``how_of`` says; ``expect``: the other side's shape, if known."""
    e, n = group[0], len(group)
    key = sample_key_of(e)
    dtype = samples[0].dtype
    if how in ("gathered", "batch") and not ((e.get("meta") or {}).get("layout") or {}).get("placements") == ["R"]:
        parts = [(g.get("meta") or {}).get("part") for g in group]
        if any(p is None or "values" not in p for p in parts):
            raise DriftcheckError(f"{e['key']}: a rank's stats-mode entry holds no share of the logical "
                                  "sample (recorded before driftcheck kept one, or on a lazy or xla "
                                  "device, which keeps none); record again, or with --mode full")
        shape = list(parts[0]["global_shape"])  # type: ignore[index]
        if expect is not None and shape != list(expect) and not (e.get("meta") or {}).get("layout"):
            # a batch or tensor-parallel part along another dim than the one kept (a DTensor's
            # own layout says where it lies: the other side's shape is no check of it)
            raise DriftcheckError(f"{e['key']}: the ranks hold parts of shape {shape}, the other side "
                                  f"{list(expect)}: not their part along the dim a stats-mode record "
                                  "keeps (a tensor-parallel activation's: the last); record with --mode full")
        out = torch.full((tstats.SAMPLE_SIZE,), float("nan"), dtype=torch.float64)
        seen = torch.zeros(tstats.SAMPLE_SIZE, dtype=torch.bool)
        for p, g in zip(parts, group):
            j, _ = tstats.part_positions(key, seed, *block_of(p), list(g["shape"]))  # type: ignore[arg-type]
            values = [float(v) for v in p["values"]]  # type: ignore[index]  # "nan", "inf": strings
            if len(values) != len(j):
                raise DriftcheckError(f"{e['key']}: a rank's share holds {len(values)} values where its "
                                      f"part holds {len(j)} of the logical sample's positions")
            out[torch.from_numpy(j)] = torch.tensor(values, dtype=torch.float64)
            seen[torch.from_numpy(j)] = True
        if not bool(seen.all()):
            raise DriftcheckError(f"{e['key']}: the ranks' shares cover {int(seen.sum())} of the "
                                  f"logical sample's {tstats.SAMPLE_SIZE} positions: not one tensor's parts")
        factor = 1.0 / n if how == "batch" and e["phase"] == "backward" else 1.0
        stats = combined([g["stats"] for g in group], factor)
        return shape, stats, (out * factor).to(dtype), False
    if how in ("summed", "mean"):
        total = torch.stack([s.double() for s in samples]).sum(0)
        sample = (total / n if how == "mean" else total).to(dtype)
        stats = estimated(sample, math.prod(e["shape"]))
        for k in ("nan", "inf"):  # a sum's or mean's non-finite elements: at least any rank's
            stats[k] = max(stats[k], *(int(g["stats"].get(k) or 0) for g in group))
        return list(e["shape"]), stats, sample, True
    return list(e["shape"]), dict(e["stats"]), samples[0], False


def sample_key_of(e: Entry) -> str:
    """The key whose seeded positions the entry's sample holds (store/keys.py ``sample_key``)."""
    return sample_key(e["step"], e["phase"], e["module"], e["call"], e["slot"])


def combined(parts: list[dict[str, Any]], factor: float = 1.0) -> dict[str, Any]:
    """The statistics of the parts joined into one tensor (times ``factor`` > 0), exactly: counts
    add, the finite elements' mean and mean square are count-weighted, extremes are extremes."""
    count = [float((p.get("numel") or 0) - (p.get("nan") or 0) - (p.get("inf") or 0)) for p in parts]
    c = sum(count)
    out: dict[str, Any] = {k: int(sum(int(p.get(k) or 0) for p in parts)) for k in ("nan", "inf", "numel")}
    for k in tstats.FP8_FIELDS:
        if all(k in p for p in parts):
            out[k] = int(sum(int(p[k]) for p in parts))
    live = [(p, w) for p, w in zip(parts, count) if w > 0]
    if not c or not live:
        out.update({k: None for k in ("min", "max", "mean", "std", "absmax")}, l2=0.0)
        return out
    mean = sum(w * float(p["mean"]) for p, w in live) / c
    # each part's spread about the joint mean (no E[x^2] - mean^2: it cancels where |mean| >> std)
    var = sum(w * (float(p["std"]) ** 2 + (float(p["mean"]) - mean) ** 2) for p, w in live) / c
    out.update(min=factor * min(float(p["min"]) for p, _ in live), max=factor * max(float(p["max"]) for p, _ in live),
               mean=factor * mean, std=factor * math.sqrt(var),
               absmax=factor * max(float(p["absmax"]) for p, _ in live),
               l2=factor * math.sqrt(sum(float(p.get("l2") or 0.0) ** 2 for p in parts)))
    return out


def estimated(sample: torch.Tensor, numel: int) -> dict[str, Any]:
    """Statistics of a tensor of ``numel`` elements estimated from its sample: its mean, spread
    and extremes as the sample's, its l2 norm scaled to the whole, counts scaled likewise."""
    s = tstats.to_dict(tstats.stats_vector(sample).tolist())
    k = max(sample.numel(), 1)
    scale = numel / k
    s["l2"] = float(s.get("l2") or 0.0) * math.sqrt(scale)
    s["nan"], s["inf"] = round(int(s["nan"] or 0) * scale), round(int(s["inf"] or 0) * scale)
    s["numel"] = numel
    return s

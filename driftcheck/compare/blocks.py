"""Blocks: the logical tensor of ranks that each hold a block of it, at an offset along every dim.

A run on a 2-D mesh (``--parallel fsdp-tp``: ``dp`` data-parallel groups of ``tp`` tensor-
parallel ranks, rank ``g * tp + c`` in group ``g`` at tensor-parallel coordinate ``c``) and any
DTensor whose layout records its block's offset (record/parts.py ``dtensor_layout``) are rebuilt
here for compare/layouts.py (docs/trace-format.md, "Layouts"):

- a DTensor shard: at its layout's ``offset`` (FSDP2 over tensor-parallel shards: strided
  shards, each rank's one block; replicas along a mesh dim hold the same block);
- an fsdp-tp activation without a layout: its group's part of the batch along dim 0 (offset
  ``g * n``), and where the other side's shape says so its part along one other dim (offset
  ``c * m``: a module outside the plan between a colwise and a rowwise Linear); or the whole
  tensor (the forward's replicated, a backward gradient the mean over the ranks);
- the loss: the mean over the ranks.

A backward gradient split along the batch is divided by the number of groups (each group's loss
the mean over its part of the batch, the global loss the mean of theirs: compare/layouts.py).
Blocks that tile the logical tensor are joined; statistics of the distinct blocks combine
exactly and their shares of the logical sample fill it (record/parts.py), as for 1-D parts.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from driftcheck.compare import parts as cparts
from driftcheck.errors import DriftcheckError
from driftcheck.numerics import stats as tstats
from driftcheck.store.format import SHARES, block_of

Entry = dict[str, Any]


class Plan(NamedTuple):
    """How the ranks' entries of one key make the logical one: ``how`` ("blocks", "mean" or
    "replicated"); for blocks the logical shape, each rank's offset, the number of batch
    parts a backward gradient is divided by (1: not split along the batch) and whether the
    blocks at one offset sum to the logical block rather than copy it."""

    how: str
    shape: list[int]
    offsets: list[list[int]]
    batch: int = 1
    summed: bool = False  # the blocks at one offset are partial sums (a DTensor's "P")


def kind_of(run: dict[str, Any], n: int) -> tuple[int, int]:
    """(batch parts, tensor-parallel size) of a side of ``n`` ranks with run metadata ``run``:
    (1, 1) a single trace, (n, 1) DDP/FSDP2, (1, n) tensor parallel, (dp, tp) fsdp-tp."""
    parallel = run.get("parallel")
    if n <= 1:
        return 1, 1
    if parallel == "tp":
        return 1, n
    if parallel == "fsdp-tp":
        tp = int(((run.get("tensor_parallel") or {}).get("mesh") or {}).get("tp") or 1)
        return n // tp, tp
    return n, 1


def candidates(x: list[int], kind: tuple[int, int]) -> list[list[int]]:
    """The logical shapes a rank's tensor of shape ``x`` may be a part of, the likeliest first:
    its batch part joined, that and its part along one other dim (the last first), itself."""
    parts, tp = kind
    out: list[list[int]] = []
    base = [x[0] * parts, *x[1:]] if parts > 1 and x else list(x)
    if parts > 1 and x:
        out.append(base)
    if tp > 1:
        out += [[s * tp if d == dim else s for d, s in enumerate(base)]
                for dim in range(len(base) - 1, 0 if parts > 1 else -1, -1)]
    return out + [list(x)]


def logical_shape(x: list[int], kind_a: tuple[int, int], y: list[int], kind_b: tuple[int, int],
                  copies: Callable[[], bool | None] | None = None) -> list[int]:
    """The logical shape of a key whose ranks hold ``x`` on one side and ``y`` on the other: the
    one of one side's candidates that is also one of the other's; else ``x``. Where several are
    (both sides split along a tensor-parallel dim: an activation outside the plan may be a part
    there, or a copy on every rank of the group), ``copies()`` says which: whether a side's
    tensor-parallel ranks hold equal copies (None: not known, the copy taken)."""
    other = candidates(y, kind_b)
    common = [c for c in candidates(x, kind_a) if c in other]
    if not common:
        return list(x)
    if len(common) > 1:
        whole = [c for c in common if c[1:] == x[1:]]  # the batch part or the tensor itself
        split = [c for c in common if c[1:] != x[1:]]  # also a part along a tensor-parallel dim
        if whole and split:
            return split[0] if copies is not None and copies() is False else whole[0]
    return common[0]


class Copies:
    """Whether the first two ranks of a tensor-parallel group (ranks 0 and 1 of a ``tp`` or an
    fsdp-tp run) hold equal copies of an entry: its tensors, or in stats mode its statistics and
    samples; None where either lacks it. ``logical_shape``'s tie-break."""

    def __init__(self, dirs: dict[int, Any]) -> None:
        from driftcheck.store.reader import TraceReader

        self.readers = [TraceReader(dirs[r]) for r in (0, 1)]
        self.by_key = [{e["key"]: e for e in r.entries} for r in self.readers]

    def __call__(self, key: str) -> bool | None:
        got_pair = [k.get(key) for k in self.by_key]
        pair = [e for e in got_pair if e is not None]
        if len(pair) < 2 or pair[0]["shape"] != pair[1]["shape"]:
            return None
        which = "tensor" if all(e.get("tensor") for e in pair) else "sample"
        got = [r.tensor(e, which) for r, e in zip(self.readers, pair)]
        if got[0] is None or got[1] is None:
            return None
        return bool(torch.equal(got[0], got[1])) and (which == "tensor" or pair[0]["stats"] == pair[1]["stats"])


def plan(entries: list[Entry], shapes: list[list[int]], expect: list[int] | None,
         kind: tuple[int, int]) -> Plan:
    """The blocks (or else) of the ranks' entries of one key, their tensors of ``shapes``, the
    other side's shape ``expect``, the side's ``kind`` (``kind_of``)."""
    e, x = entries[0], list(shapes[0])
    key, phase = e["key"], e["phase"]
    layout = (e.get("meta") or {}).get("layout")
    if layout:
        summed = "P" in layout.get("placements", [])
        if summed and (layout["placements"].count("P") > 1 or "R" in layout["placements"]):
            raise DriftcheckError(f"{key}: a partial sum on a mesh of shape {layout.get('mesh')} with "
                                  f"placements {layout['placements']} (partial or replicated along "
                                  "another mesh dim): not rebuilt; record with --parallel fsdp or tp")
        if kind[0] > 1 and kind[1] > 1 and phase in ("forward", "backward") and len(layout.get("mesh") or []) == 1:
            raise DriftcheckError(f"{key}: an fsdp-tp activation whose layout (placements "
                                  f"{layout.get('placements')}) is not a block of the 2-D mesh: not "
                                  "rebuilt; record with --parallel fsdp or tp")
        if layout.get("offset") is None:
            if summed:
                raise DriftcheckError(f"{key}: a partial sum on a mesh of shape {layout.get('mesh')} "
                                      "recorded without its block's offset; record it again")
            return Plan("replicated", x, [])
        if all(p == "R" for p in layout["placements"]):
            return Plan("replicated", x, [])
        offsets = [[int(o) for o in ((g.get("meta") or {}).get("layout") or {}).get("offset") or []]
                   for g in entries]
        return Plan("blocks", [int(s) for s in layout["global_shape"]], offsets,
                    kind[0] if layout.get("batch") and phase == "backward" else 1, summed)
    if phase == "loss":
        return Plan("mean", x, [])
    if phase not in ("forward", "backward"):
        return Plan("replicated", x, [])
    shape = list(expect) if expect is not None else candidates(x, kind)[0]
    if shape == x:
        return Plan("mean" if phase == "backward" else "replicated", x, [])
    parts, tp = kind
    for c in candidates(x, kind)[:-1]:
        if c == shape:
            offsets = []
            for r in range(len(entries)):
                g, t = divmod(r, tp)
                offsets.append([(g if d == 0 and parts > 1 else t) * x[d] if c[d] != x[d] else 0
                                for d in range(len(x))])
            return Plan("blocks", shape, offsets, parts if phase == "backward" and parts > 1 else 1)
    raise DriftcheckError(f"{key}: the ranks hold shape {x}, the other side {shape}: neither their "
                          "part of the batch (dim 0), that and a part along one other dim, nor the "
                          "whole tensor")


def place(key: str, p: Plan, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The logical tensor of the ranks' blocks (a backward batch part divided by the groups), and
    whether the copies of a block that ranks share are all equal.

    Raises:
        DriftcheckError: blocks that do not tile the logical shape."""
    out = torch.empty(p.shape, dtype=tensors[0].dtype)
    covered = torch.zeros(p.shape, dtype=torch.bool)
    same = True
    for off, ts in by_block(p, tensors).items():
        region = _region(key, list(off), list(ts[0].shape), p.shape)
        if p.summed and ts[0].is_floating_point():
            out[region] = torch.stack([t.double() for t in ts]).sum(0).to(out.dtype)
        else:
            same = same and all(torch.equal(ts[0], t) for t in ts[1:])
            out[region] = ts[0]
        covered[region] = True
    if not bool(covered.all()):
        raise DriftcheckError(f"{key}: the ranks' blocks cover {int(covered.sum())} of the logical "
                              f"tensor's {covered.numel()} elements: not one tensor's parts")
    if p.batch > 1 and out.is_floating_point():
        out = (out.double() / p.batch).to(out.dtype)
    return out, same


def distinct(p: Plan, group: list[Entry]) -> list[Entry]:
    """The ranks' entries of distinct blocks (of ranks sharing a block, the first)."""
    return [gs[0] for gs in by_block(p, group).values()]


def by_block(p: Plan, items: list[Any]) -> dict[tuple[int, ...], list[Any]]:
    """The ranks' ``items`` (tensors, entries) grouped by their block's offset, in rank order."""
    out: dict[tuple[int, ...], list[Any]] = {}
    for item, offset in zip(items, p.offsets):
        out.setdefault(tuple(offset), []).append(item)
    return out


def stats(p: Plan, group: list[Entry], seed: int, dtype: torch.dtype
          ) -> tuple[dict[str, Any], torch.Tensor, bool, bool]:
    """(statistics, sample, whether the statistics are estimated from the sample, whether the
    ranks that hold copies of one block kept equal shares and statistics) of the logical
    stats-mode entry of the ranks' blocks: the distinct blocks' statistics combined exactly and
    their shares of the logical sample put together; blocks of partial sums: their shares summed,
    the statistics estimated from the sample (compare/parts.py ``estimated``)."""
    e = group[0]
    key = cparts.sample_key_of(e)
    out = torch.zeros(tstats.SAMPLE_SIZE, dtype=torch.float64)
    seen = torch.zeros(tstats.SAMPLE_SIZE, dtype=torch.bool)
    blocks = by_block(p, group)
    same = True
    for off, gs in blocks.items():
        _region(e["key"], list(off), list(gs[0]["shape"]), p.shape)
        j, _ = tstats.part_positions(key, seed, p.shape, list(off), list(gs[0]["shape"]))
        if not p.summed:
            same = same and all(g["stats"] == gs[0]["stats"] and _share(g, p.shape, off) == _share(gs[0], p.shape, off)
                                for g in gs[1:])
        for g in gs if p.summed else gs[:1]:
            share = _share(g, p.shape, off)
            if share is None:
                raise DriftcheckError(
                    f"{e['key']}: a rank's stats-mode entry holds no share of the logical sample of "
                    f"shape {p.shape} (a part along a dim a stats-mode record does not keep, or "
                    "recorded on a lazy or xla device); record with --mode full")
            values = [float(v) for v in share["values"]]  # "nan", "inf": strings
            if len(values) != len(j):
                raise DriftcheckError(f"{e['key']}: a rank's share holds {len(values)} values where "
                                      f"its part holds {len(j)} of the logical sample's positions")
            out[torch.from_numpy(j)] += torch.tensor(values, dtype=torch.float64)
        seen[torch.from_numpy(j)] = True
    firsts = [gs[0] for gs in blocks.values()]
    if sum(math.prod(g["shape"]) for g in firsts) != math.prod(p.shape) or not bool(seen.all()):
        raise DriftcheckError(f"{e['key']}: the ranks' blocks cover {int(seen.sum())} of the logical "
                              f"sample's {tstats.SAMPLE_SIZE} positions: not one tensor's parts")
    sample = (out / p.batch).to(dtype)
    if p.summed:
        got = cparts.estimated(sample, math.prod(p.shape))
        for k in ("nan", "inf"):  # a sum's non-finite elements: at least any rank's
            got[k] = max(got[k], *(int(g["stats"].get(k) or 0) for g in group))
        return got, sample, True, same
    return cparts.combined([g["stats"] for g in firsts], 1.0 / p.batch), sample, False, same


def _share(g: Entry, shape: list[int], offset: tuple[int, ...]) -> dict[str, Any] | None:
    """The rank's share (meta ``part`` or ``part_tp``) of the block at ``offset`` of ``shape``."""
    meta = g.get("meta") or {}
    return next((meta[n] for n in SHARES if meta.get(n) and "values" in meta[n]
                 and block_of(meta[n]) == (shape, list(offset))), None)


def _region(key: str, offset: list[int], shape: list[int], logical: list[int]) -> tuple[slice, ...]:
    if len(offset) != len(logical) or len(shape) != len(logical) or any(
            o < 0 or o + n > s for o, n, s in zip(offset, shape, logical)):
        raise DriftcheckError(f"{key}: a rank's block of shape {shape} at {offset} lies outside the "
                              f"logical shape {logical}")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))

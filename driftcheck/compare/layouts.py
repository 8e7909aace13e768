"""Compare across layouts: a single-process trace against a multi-rank run directory (``OUT/rank-<r>``
of a torchrun record, DDP, FSDP2 or TP), or two multi-rank runs of different rank counts or of
different ``parallel``, judged as one.

Each multi-rank side is rebuilt into one logical trace (a temporary directory), which the
ordinary ``compare`` then judges. Each entry's logical tensor, from the ranks'
entries of the same key (docs/trace-format.md, "Layouts"):

- a DTensor shard (meta ``layout``: placements, mesh, coordinate, logical shape; FSDP2's
  parameters, gradients and optimizer state): the shards joined along the sharded dim in mesh
  order (``S<d>``), rank 0's (``R``), or their sum (``P``);
- forward activations and the backward's gradients of a data-parallel rank (its slice of the
  global batch: record/ranks.py ``shard_batch``, contiguous parts in rank order): joined along dim
  0 where that gives the logical shape (``logical_shapes``: the single trace's; of two multi-rank
  sides, what their slices say); a tensor of the logical shape is the same on every rank
  (forward: rank 0's; backward: the mean). A backward gradient is divided by the
  world size: each rank's loss is the mean over its part of the batch, the global loss the mean
  of the ranks' (DDP's averaging of gradients makes the same assumption);
- the loss: the mean over the ranks;
- DDP's ``grads`` (each rank's gradient before the all-reduce): the mean over the ranks;
- parameters, buffers and optimizer state of DDP (replicated): rank 0's; a rank that differs is a
  warning;
- a tensor-parallel side (``--parallel tp``: every rank ran the whole batch): its shards
  (parameters, and the activations its plan's styles left as local shards, meta ``layout``)
  joined, its partial sums (``P``) summed; everything else replicated, rank 0's, the loss too
  (never joined along dim 0, never averaged); an activation without a layout that is a part of
  the other side's shape along one dim (a module outside the plan between a colwise and a
  rowwise Linear) joined along that dim in rank order.

Same layouts (both sides multi-rank with the same ranks and the same ``parallel``) keep
compare/ranks.py's rank-by-rank path.
In stats mode the logical entry is rebuilt from the ranks' statistics and samples
(compare/parts.py): joined parts' statistics combine exactly, their samples are the ranks' shares
of the logical sample, kept at record time (record/parts.py).
"""
from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from driftcheck.compare import blocks, parts
from driftcheck.errors import DriftcheckError
from driftcheck.numerics import stats as tstats
from driftcheck.store.layout import complete_ranks, rank_dirs
from driftcheck.store.reader import TraceReader
from driftcheck.store.writer import TraceWriter

_RMS_META = ("mag_rms", "norm_gain")  # rms over the elements or groups of a batch slice
_MAX_META = ("norm_gain_max", "logit_absmax")
_MEAN_SCALAR = ("{}: a scalar each rank computed from its part of the batch (a loss or a metric of the "
                "model's own code): the ranks' mean is compared")
_SUM_META = ("kink_profile", "decision_profile", "round_profile", "host_decisions")


def compare_layouts(ref: str | os.PathLike, target: str | os.PathLike, **kwargs: Any) -> Any:
    """Compare two traces of different layouts (1 rank against N, N against M, DDP, FSDP2, TP or
    fsdp-tp against another): each multi-rank side rebuilt into one logical trace, then ``compare``;
    such a side's run metadata says ``world_size`` and ``layout: "logical"``, its warnings first."""
    from driftcheck.compare import compare

    truth = kwargs.pop("truth", None)
    dirs = [complete_ranks(ref), complete_ranks(target)]
    firsts = [TraceReader(d[min(d)] if d else side) for d, side in zip(dirs, (ref, target))]
    split = [d for r, d in zip(firsts, dirs) if blocks.kind_of(r.run, len(d))[1] > 1]  # along tp
    a, b = ((_shapes(r), len(d) or 1, r.run.get("parallel") == "tp",
             blocks.kind_of(r.run, len(d)) if r.run.get("parallel") == "fsdp-tp" else None)
            for r, d in zip(firsts, dirs))
    expect = logical_shapes(a, b, copies=blocks.Copies(split[0]) if split else None)
    warnings = [f"{side}: recorded by {r.run.get('driver') or 'driftcheck.trace()'}, whose ranks may "
                "not hold contiguous parts of one global batch in rank order (as driftcheck record "
                "--parallel splits it); the logical tensors assume they do"
                for r, d, side in zip(firsts, dirs, (ref, target))
                if d and (r.run.get("driver") or not r.run.get("replay_id"))]
    with tempfile.TemporaryDirectory(prefix="driftcheck-logical-") as tmp:
        paths = []
        for name, side, d in (("reference", ref, dirs[0]), ("target", target, dirs[1])):
            if d:
                paths.append(Path(tmp) / name)
                warnings += logical_trace(d, paths[-1], expect)
            else:
                paths.append(Path(side))
        if truth is not None and rank_dirs(truth):  # a multi-rank truth: rebuilt as the others
            warnings += logical_trace(rank_dirs(truth), Path(tmp) / "truth", expect)
            truth = Path(tmp) / "truth"
        report = compare(str(paths[0]), str(paths[1]), truth=str(truth) if truth is not None else None,
                         **kwargs)
    if dirs[0]:
        report.reference = dict(report.reference, world_size=len(dirs[0]), layout="logical")
    if dirs[1]:
        report.target = dict(report.target, world_size=len(dirs[1]), layout="logical")
    report.warnings = warnings + list(report.warnings)
    return report


def logical_shapes(a: tuple[Any, ...], b: tuple[Any, ...],
                   copies: Callable[[str], bool | None] | None = None) -> dict[str, list[int]]:
    """The logical shape of every key both sides have, from each side's (shapes of rank 0 or
    of the single trace, number of ranks; 1: a single trace[, tensor parallel]): a single
    trace's shape; else the batch slice joined (dim 0 times the ranks) where the slices of the
    two sides say so (the same world size: always, the two sides then join alike). A tensor-
    parallel side holds the whole batch; an activation of it outside the plan may be a part
    along one other dim (``_tp_shape``). An fsdp-tp side (its (dp, tp) mesh given after the
    tensor-parallel flag) holds blocks: compare/blocks.py ``logical_shape`` (``copies``: whether
    a tensor-parallel side's ranks hold copies of a key)."""
    (sa, na, *ta), (sb, nb, *tb) = a, b
    tp_a, tp_b = bool(ta and ta[0]), bool(tb and tb[0])
    mesh_a, mesh_b = (ta[1] if len(ta) > 1 else None), (tb[1] if len(tb) > 1 else None)
    out = {}
    for k in sa.keys() & sb.keys():
        x, y = list(sa[k]), list(sb[k])
        if mesh_a or mesh_b:
            out[k] = blocks.logical_shape(x, mesh_a or ((1, na) if tp_a else (na, 1)),
                                          y, mesh_b or ((1, nb) if tp_b else (nb, 1)),
                                          functools.partial(copies, k) if copies is not None else None)
        elif tp_a or tp_b:
            out[k] = _tp_shape(x, na, tp_a, y, nb, tp_b)
        elif na == 1 or nb == 1:
            out[k] = x if na == 1 else y
        elif not x or not y:
            out[k] = x
        elif na == nb and x == y:
            out[k] = [x[0] * na, *x[1:]]
        elif x[0] * na == y[0] * nb and x[1:] == y[1:]:
            out[k] = [x[0] * na, *x[1:]]
        else:
            out[k] = x
    return out


def _tp_shape(x: list[int], na: int, tp_a: bool, y: list[int], nb: int, tp_b: bool) -> list[int]:
    """The logical shape of an entry one side (or both) of which is tensor parallel: the whole
    batch on every rank, a module outside the plan (an activation between a colwise and a
    rowwise Linear, the local heads' attention weights) perhaps a part along one dim."""
    if not tp_a:  # the other side first
        x, na, tp_a, y, nb, tp_b = y, nb, tp_b, x, na, tp_a
    if x == y or len(x) != len(y) or (nb == 1 and not tp_b):
        return y if nb == 1 and not tp_b else x  # a single trace's shape is the logical one
    if not tp_b:  # data parallel: its batch part joined, its other dims whole
        return [x[0], *y[1:]] if x[0] == y[0] * nb else x
    diff = [d for d in range(len(x)) if x[d] != y[d]]
    return [x[d] * na if d == diff[0] else x[d] for d in range(len(x))] \
        if len(diff) == 1 and x[diff[0]] * na == y[diff[0]] * nb else x


def _shapes(r: TraceReader) -> dict[str, list[int]]:
    """Each entry's shape, a shard's logical one (a TP side's activations are shards too)."""
    return {e["key"]: list(((e.get("meta") or {}).get("layout") or {}).get("global_shape")
                            or e["shape"]) for e in r.entries}


def logical_trace(ranks: dict[int, Path], out: Path, expect: dict[str, list[int]]) -> list[str]:
    """Write the logical trace of the ranks' traces into ``out`` (a new directory);
    ``expect`` (``logical_shapes``) decides which activations are batch slices. Returns
    warnings."""
    readers = [TraceReader(ranks[r]) for r in sorted(ranks)]
    base = readers[0]
    if len({r.run.get("mode") for r in readers}) > 1:
        raise DriftcheckError(f"{ranks[min(ranks)].parent}: its ranks were recorded in different modes")
    seed = int(base.run.get("seed") or 0)
    by_key = [{e["key"]: e for e in r.entries} for r in readers]
    parallel = base.run.get("parallel")
    kind = blocks.kind_of(base.run, len(readers))
    warnings: list[str] = []
    with TraceWriter(out, force=True) as writer:
        for e in base.entries:
            if not all(e["key"] in k for k in by_key):
                raise DriftcheckError(f"{e['key']} is in rank 0's trace but not in every rank's: "
                                      "the ranks ran different steps or modules")
            group = [k[e["key"]] for k in by_key]
            if not all(g.get("tensor") for g in group):  # stats mode (or auto's stats entries)
                warnings += _stats_entry(writer, readers, group, expect.get(e["key"]), parallel, seed, kind)
                continue
            tensors = [r.tensor(g) for r, g in zip(readers, group)]
            t, how = logical_tensor(group, tensors, expect.get(e["key"]), parallel, kind)  # type: ignore[arg-type]
            if how == "blocks-differ":
                warnings.append(f"{e['key']}: ranks holding the same block differ; the first's is compared")
            elif how == "replicated-differs":
                warnings.append(f"{e['key']}: the ranks' copies differ; rank 0's is compared")
            elif how == "mean-scalar":
                warnings.append(_MEAN_SCALAR.format(e["key"]))
            warnings += batch_statistics(e, how, warnings)
            writer.add(_entry(e, group, t, how, parallel, kind=kind, expect=expect.get(e["key"])), t.contiguous())
        run = {k: v for k, v in base.run.items() if k != "rank"}
        extra = {k: v for k, v in base.manifest.items()
                 if k not in ("format", "version", "run", "shards", "entries", "replay")}
        writer.close(dict(run, world_size=len(readers), layout="logical"), extra)
    return warnings


def _stats_entry(writer: TraceWriter, readers: list[TraceReader], group: list[dict[str, Any]],
                 expect: list[int] | None, parallel: str | None, seed: int,
                 kind: tuple[int, int] = (1, 1)) -> list[str]:
    """Write the logical stats-mode entry of the ranks' ``group`` (compare/parts.py); warnings."""
    e = group[0]
    samples = [r.tensor(g, "sample") for r, g in zip(readers, group)]
    if any(s is None for s in samples):
        raise DriftcheckError(f"{e['key']}: a rank's entry holds neither a tensor nor a sample")
    if parts.whole(group, samples):  # type: ignore[arg-type]
        t, how = logical_tensor(group, [s.reshape(g["shape"]) for s, g in zip(samples, group)],  # type: ignore[union-attr]
                                expect, parallel, kind)
        shape, stats, sample = parts.of_tensor(e, t, seed)
        estimated = False
    else:
        how = how_of(group, [g["shape"] for g in group], expect, parallel, kind)
        if how == "blocks":
            plan = blocks.plan(group, [g["shape"] for g in group], expect, kind)
            shape = plan.shape
            stats, sample, estimated, same = blocks.stats(plan, group, seed, samples[0].dtype)  # type: ignore[union-attr]
            how = "blocks" if same else "blocks-differ"
        else:
            shape, stats, sample, estimated = parts.logical(group, samples, how, seed, expect)  # type: ignore[arg-type]
    warnings = [f"{e['key']}: ranks holding the same block differ; the first's is compared"] \
        if how == "blocks-differ" else []
    if how == "replicated-differs" or (how == "replicated" and not all(
            torch.equal(samples[0], s) for s in samples[1:])):  # type: ignore[arg-type]
        warnings.append(f"{e['key']}: the ranks' copies differ; rank 0's is compared")
    elif how == "mean-scalar":
        warnings.append(_MEAN_SCALAR.format(e["key"]))
    warnings += batch_statistics(e, how, warnings)
    entry = _entry(e, group, None, how, parallel, shape=shape, stats=stats, kind=kind, expect=expect)
    if estimated:
        entry.setdefault("meta", {})["stats_from_sample"] = True
    writer.add(entry, None, sample=sample.contiguous())
    return warnings


def how_of(entries: list[dict[str, Any]], shapes: list[list[int]], expect: list[int] | None,
           parallel: str | None, kind: tuple[int, int] = (1, 1)) -> str:
    """How the ranks' entries of one key (their tensors of ``shapes``) make the logical one, from
    layout and shapes alone, in either mode: ``gathered`` (shards, or a tensor-parallel part),
    ``summed``, ``batch``, ``blocks`` (of a 2-D mesh: compare/blocks.py, the side's ``kind``),
    ``mean`` or ``replicated`` (which ``logical_tensor`` then tells apart by value)."""
    e, n, shape = entries[0], len(entries), list(shapes[0])
    layout = (e.get("meta") or {}).get("layout")
    if parallel == "fsdp-tp" or (layout and layout.get("offset") is not None and len(layout.get("mesh") or []) > 1):
        return blocks.plan(entries, shapes, expect, kind).how
    if layout:
        if len(layout.get("mesh") or []) != 1:
            raise DriftcheckError(f"{e['key']}: a DTensor on a mesh of shape {layout.get('mesh')}; only "
                                  "1-D meshes (FSDP2, TP) are rebuilt so far")
        return "summed" if layout["placements"] == ["P"] else "gathered"
    # A tensor-parallel rank ran the whole batch: what is not a shard is replicated (the loss
    # too), or a part along one dim (_tp_dim). A data-parallel rank ran its part of the batch.
    if parallel == "tp":
        if expect is not None and shape != list(expect):
            _tp_dim(e["key"], shape, n, expect)
            return "gathered"
        return "replicated"
    phase = e["phase"]
    if phase == "loss" or (phase == "grads" and parallel == "ddp"):
        return "mean"
    if phase in ("forward", "backward"):
        if expect is not None and n > 1 and shape and [shape[0] * n, *shape[1:]] == list(expect):
            return "batch"
        if expect is not None and shape != list(expect):
            raise DriftcheckError(f"{e['key']}: the ranks hold shape {shape}, the other side "
                                  f"{list(expect)}: neither its batch slice (dim 0) nor the whole tensor")
        if phase == "backward":
            return "mean"
    return "replicated"


def logical_tensor(entries: list[dict[str, Any]], tensors: list[torch.Tensor], expect: list[int] | None,
                   parallel: str | None, kind: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, str]:
    """The logical tensor of the ranks' ``tensors`` of one entry, and how it was rebuilt
    (``how_of``; a replicated one as ``replicated``, ``replicated-differs`` or ``mean-scalar``;
    blocks whose copies differ as ``blocks-differ``)."""
    how = how_of(entries, [list(t.shape) for t in tensors], expect, parallel, kind)
    n = len(tensors)
    if how == "blocks":
        t, same = blocks.place(entries[0]["key"], blocks.plan(entries, [list(t.shape) for t in tensors],
                                                              expect, kind), tensors)
        return t, "blocks" if same else "blocks-differ"
    if how in ("gathered", "summed"):
        if (entries[0].get("meta") or {}).get("layout"):
            return _from_placements(entries, tensors), how
        return torch.cat(tensors, dim=_tp_dim(entries[0]["key"], list(tensors[0].shape), n, expect)), how  # type: ignore[arg-type]
    if how == "batch":
        t = torch.cat(tensors, dim=0)
        return (_scaled(t, 1 / n) if entries[0]["phase"] == "backward" else t), how
    if how == "mean":
        return _mean(tensors), how
    same = all(torch.equal(tensors[0], t) for t in tensors[1:])
    if not same and parallel != "tp" and entries[0]["phase"] == "forward" and tensors[0].numel() == 1 \
            and tensors[0].is_floating_point():
        # a scalar each data-parallel rank computed from its part of the batch (a loss the
        # model's own code computes: output.loss of a Hugging Face model): its mean, as the loss's
        return _mean(tensors), "mean-scalar"
    return tensors[0], "replicated" if same else "replicated-differs"


def _tp_dim(key: str, shape: list[int], n: int, expect: list[int]) -> int:
    """The dim along which the ranks' parts of a tensor-parallel activation without a layout (a
    module outside the plan computed it from local shards) join, in rank order: the one dim
    whose size is the ranks' part of the logical one."""
    dims = [d for d in range(len(shape)) if len(shape) == len(expect) and shape[d] != expect[d]]
    if len(dims) != 1 or shape[dims[0]] * n != expect[dims[0]]:
        raise DriftcheckError(f"{key}: the tensor-parallel ranks hold shape {shape}, the other side "
                              f"{list(expect)}: neither the whole tensor nor its part along one dim")
    return dims[0]


def _from_placements(entries: list[dict[str, Any]], tensors: list[torch.Tensor]) -> torch.Tensor:
    layout = entries[0]["meta"]["layout"]
    key = entries[0]["key"]
    coords = [(e.get("meta") or {}).get("layout", {}).get("coord") for e in entries]
    order = sorted(range(len(tensors)), key=lambda i: coords[i][0] if coords[i] else i)
    place = layout["placements"][0]
    if place.startswith("S"):
        t = torch.cat([tensors[i] for i in order], dim=int(place[1:]))
    elif place == "P":
        t = _sum(tensors)
    else:
        t = tensors[order[0]]
    if list(t.shape) != list(layout["global_shape"]):
        raise DriftcheckError(f"{key}: its shards join to shape {list(t.shape)}, not the logical "
                              f"{layout['global_shape']}")
    return t


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors[0].is_floating_point():
        return tensors[0]
    return _scaled(_sum(tensors), 1 / len(tensors))


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors[0].is_floating_point():
        return tensors[0]
    return torch.stack([t.double() for t in tensors]).sum(0).to(tensors[0].dtype)


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return (t.double() * factor).to(t.dtype) if t.is_floating_point() else t


def _entry(e: dict[str, Any], group: list[dict[str, Any]], t: torch.Tensor | None, how: str,
           parallel: str | None = None, shape: list[int] | None = None,
           stats: dict[str, Any] | None = None, kind: tuple[int, int] = (1, 1),
           expect: list[int] | None = None) -> dict[str, Any]:
    """The logical entry: rank 0's, with the logical tensor's shape and statistics (of ``t``, or
    ``shape`` and ``stats`` of a stats-mode entry); the meta that summarises a batch slice
    combined over the slices (over the distinct blocks of a 2-D mesh: ``kind``, ``expect``)."""
    out = {k: v for k, v in e.items() if k not in ("tensor", "sample", "stats", "meta")}
    out["shape"] = list(t.shape) if t is not None else list(shape or [])
    out["stats"] = tstats.to_dict(tstats.stats_vector(t).tolist()) if t is not None else dict(stats or {})
    meta = {k: v for k, v in (e.get("meta") or {}).items() if k not in ("shard", "layout", "part", "part_tp")}
    if len(group) > 1 and (how == "summed" or (  # a reduction across the ranks (allowances.py)
            e["phase"] in ("grads", "loss") and how in ("mean", "gathered") and parallel != "tp")
            or how == "mean-scalar"):
        meta["rank_split"] = len(group)
    combine = group if how == "batch" else []
    if how == "batch":
        meta["batch_parts"] = [int(g["shape"][0]) for g in group]  # compare/normalization.py
    elif how.startswith("blocks"):
        plan = blocks.plan(group, [g["shape"] for g in group], expect, kind)
        if e["phase"] == "grads" and kind[0] > 1:  # summed over the data-parallel groups
            meta["rank_split"] = kind[0]
        if kind[0] > 1 and plan.shape and plan.shape[0] != group[0]["shape"][0] \
                and e["phase"] in ("forward", "backward"):
            combine = blocks.distinct(plan, group)
            meta["batch_parts"] = [int(g["shape"][0]) for g, o in zip(group, plan.offsets)
                                   if any(g is c for c in combine) and not any(o[1:])]
    if combine:
        metas = [g.get("meta") or {} for g in combine]
        for k in meta:
            vals: list[Any] = [m.get(k) for m in metas]
            if any(v is None for v in vals):
                continue
            if k in _RMS_META and all(isinstance(v, (int, float)) for v in vals):
                meta[k] = math.sqrt(sum(float(v) ** 2 for v in vals) / len(vals))
            elif k in _MAX_META and all(isinstance(v, (int, float)) for v in vals):
                meta[k] = max(vals)
            elif k in _SUM_META and all(isinstance(v, list) for v in vals):
                meta[k] = [sum(x) for x in zip(*vals)]
            elif k in _SUM_META and all(isinstance(v, int) for v in vals):
                meta[k] = sum(vals)
    if meta:
        out["meta"] = meta
    return out


def batch_statistics(e: dict[str, Any], how: str, said: list[str]) -> list[str]:
    """A BatchNorm in training (not SyncBatchNorm) normalizes each rank's part of the batch by
    that part's statistics: not one process's numbers, whatever the precision. Once a module."""
    meta = e.get("meta") or {}
    if not (how == "batch" and e["phase"] == "forward" and meta.get("kind") == "batchnorm"
            and meta.get("norm_dims") is not None and meta.get("module_type") != "SyncBatchNorm"):
        return []
    text = (f"{e['module']}: a BatchNorm in training normalizes each rank's part of the batch by "
            "its own statistics (not SyncBatchNorm): its outputs differ from one process's by the "
            "layout, not by precision")
    return [] if text in said else [text]

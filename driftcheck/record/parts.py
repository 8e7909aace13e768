"""Parts: where a rank's tensor lies in the logical one, and its share of the logical sample.

A stats-mode trace keeps a 512-element sample of each tensor at positions seeded by the entry's
key and its number of elements (numerics/stats.py ``sample_indices``). A rank of a multi-rank
run holds a part of a logical tensor: its positions are not the logical tensor's, so its own
sample cannot be set beside a single process's. Each rank therefore also keeps, for such an
entry, the elements of the *logical* sample that fall in its part (meta ``part``: the logical
shape, the dim the part spans, where it starts, which of the logical sample's positions it
holds and their values); compare/layouts.py puts the ranks' shares together into the logical
sample, at the single process's positions (docs/trace-format.md, "Layouts").

A part is a block: a contiguous range along each dim, its offset in the logical tensor
(meta ``part``: ``global_shape``, ``offset``; ``dim`` and ``start`` too where it is a range along
one dim, as traces before blocks held it):
- a DTensor shard (FSDP2's parameters, gradients and optimizer state; tensor-parallel shards,
  ``meta.layout``): where its layout's ``offset`` says (torch's
  ``compute_local_shape_and_global_offset``, any mesh: FSDP2 over tensor-parallel shards gives
  strided shards on a 2-D mesh, each rank's still one block); a layout without an offset (a 1-D
  mesh, recorded before offsets) as torch's chunks, ceil(n / N) a rank;
- a data-parallel rank's forward and backward tensors (DDP, FSDP2, fsdp-tp's groups): its equal
  part of the global batch along dim 0 (record/ranks.py ``batch_part``). Which of them really are
  batch slices (not tensors every rank holds whole) only the other side's shapes say: compare
  uses the part where they do and the ordinary sample where the tensor is the same size as the
  logical one.
- a tensor-parallel rank's forward and backward tensors without a layout (an activation
  function between a colwise and a rowwise Linear): its part along the last dim, if it is one;
  under fsdp-tp such a tensor may be either its group's batch part or that and a part along the
  last dim, so it keeps both shares (meta ``part`` and ``part_tp``) and compare takes the one
  the other side's shape says.
Replicated tensors, partial sums and whatever has no such part keep only the ordinary sample.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.numerics import stats as tstats
from driftcheck.store.format import SHARES

Part = tuple[list[int], list[int]]  # (logical shape, offset of the block along each dim)


class Parts:
    """The part of the logical tensor that each entry of a rank holds: ``batch`` (which part of
    the global batch, of how many: record/ranks.py ``batch_part``; None: the whole batch) and
    ``tp`` (this rank's coordinate and size of its tensor-parallel mesh; None: no tensor
    parallelism)."""

    def __init__(self, batch: tuple[int, int] | None, tp: tuple[int, int] | None, seed: int) -> None:
        self.batch, self.tp, self.seed = batch, tp, seed

    def of(self, phase: str, shape: list[int], layout: dict[str, Any] | None) -> list[Part]:
        """The entry's possible parts, the first the likeliest: from its DTensor ``layout``, else
        from the batch split and the tensor-parallel mesh; [] where the rank holds the logical
        tensor whole (or no block of it)."""
        if layout is not None:
            got = dtensor_part(layout, shape)
            return [got] if got is not None else []
        if phase not in ("forward", "backward") or not shape or not shape[0]:
            return []
        zero = [0] * len(shape)
        out: list[Part] = []
        if self.batch is not None:
            i, n = self.batch
            out.append(([shape[0] * n, *shape[1:]], [i * shape[0], *zero[1:]]))
        if self.tp is not None and (self.batch is None or len(shape) > 1):
            # an activation outside the plan that a module computed from a colwise output (an
            # activation function between a colwise and a rowwise Linear) is that output's part
            # along the last dim, if it is a part at all (compare decides)
            i, n = self.tp
            logical, offset = out[0] if out else (list(shape), zero)
            out.append(([*logical[:-1], logical[-1] * n], [*offset[:-1], i * shape[-1]]))
        return out

    def shares_of(self, entry: dict[str, Any], data: torch.Tensor, skey: str
                  ) -> list[tuple[str, dict[str, Any], torch.Tensor]]:
        """[(meta name, meta ``part``, its values gathered from ``data`` on its device)] of an
        entry: one a possible part (``of``: the first ``part``, the second ``part_tp``) that is
        not small enough to be sampled whole (its parts are then whole in their own samples).
        Which positions the values are at, compare computes again (numerics/stats.py
        ``part_positions``)."""
        out = []
        found = self.of(entry["phase"], entry["shape"], (entry.get("meta") or {}).get("layout"))
        for name, (logical, offset) in zip(SHARES, found):
            if math.prod(logical) <= tstats.SAMPLE_SIZE or len(logical) != len(entry["shape"]):
                continue
            _, idx = tstats.part_positions(skey, self.seed, logical, offset, entry["shape"])
            index = torch.from_numpy(idx)
            if data.device.type == "cuda":  # no stream sync: a pinned buffer, copied asynchronously
                index = index.pin_memory().to(data.device, non_blocking=True)
            elif data.device.type != "cpu":
                index = index.to(data.device)
            out.append((name, part_meta(logical, offset, entry["shape"]), data.reshape(-1)[index]))
        return out


def part_meta(logical: list[int], offset: list[int], shape: list[int]) -> dict[str, Any]:
    """Meta ``part`` of a block (its values added when read back): ``global_shape``, ``offset``,
    and ``dim``/``start`` where it is a range along one dim only."""
    out: dict[str, Any] = {"global_shape": list(logical), "offset": list(offset)}
    dims = [d for d in range(len(logical)) if shape[d] != logical[d] or offset[d]]
    if len(dims) <= 1:
        out.update(dim=dims[0] if dims else 0, start=offset[dims[0]] if dims else 0)
    return out


def dtensor_layout(t: Any, batch: tuple[int, int] | None = None) -> dict[str, Any]:
    """How a DTensor's local shard maps to the logical tensor (meta ``layout``), from its own
    attributes, no collective: its placements (``"S<dim>"`` sharded along dim, a strided shard
    too, ``"R"`` replicated, ``"P"`` a partial sum), the mesh's shape, this rank's coordinate in
    the mesh, the logical shape and the offset of this rank's block in it (docs/trace-format.md;
    a partial sum's: where the block it adds to lies). ``batch`` (this rank's data-parallel group, of how
    many: an fsdp-tp activation, a DTensor on the tensor-parallel mesh of its group's part of
    the batch): the layout lifted onto the 2-D mesh, the batch along dim 0 (``"batch": true``)."""
    def name(p: Any) -> str:
        if p.is_partial():
            return "P"
        return "R" if p.is_replicate() else f"S{p.dim}"

    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    out: dict[str, Any] = {"placements": [name(p) for p in t.placements], "mesh": list(mesh.shape),
                           "coord": list(coord) if coord is not None else None, "global_shape": list(t.shape)}
    if coord is not None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        # a partial sum's block: where it lies, as if replicated along that mesh dim (the
        # blocks at one offset sum to the logical block)
        local, offset = compute_local_shape_and_global_offset(
            t.shape, mesh, [Replicate() if p.is_partial() else p for p in t.placements])
        out["offset"] = [int(x) for x in offset]
        if batch is not None and t.dim() and "S0" not in out["placements"]:
            group, groups = batch
            out = {"placements": ["S0", *out["placements"]], "mesh": [groups, *out["mesh"]],
                   "coord": [group, *out["coord"]], "global_shape": [t.shape[0] * groups, *t.shape[1:]],
                   "offset": [group * int(local[0]), *out["offset"][1:]], "batch": True}
    return out


def dtensor_part(layout: dict[str, Any], shape: list[int]) -> Part | None:
    """The block of a DTensor shard: at its layout's ``offset``; without one (recorded before
    offsets), a shard ``S<d>`` on a 1-D mesh is chunk ``coord`` of ceil(n / N) along d (torch's
    Shard placement). None for a partial sum, a replicated tensor and other layouts."""
    placements, mesh, coord = layout.get("placements"), layout.get("mesh"), layout.get("coord")
    logical = layout.get("global_shape")
    if logical is None or not placements or not any(str(p).startswith("S") for p in placements):
        return None
    if layout.get("offset") is not None:
        return list(logical), [int(x) for x in layout["offset"]]
    if not (len(placements) == 1 and mesh and len(mesh) == 1 and coord):
        return None
    dim = int(placements[0][1:]) % max(len(logical), 1)
    size = -(-int(logical[dim]) // int(mesh[0]))
    offset = [0] * len(logical)
    offset[dim] = int(coord[0]) * size
    return list(logical), offset

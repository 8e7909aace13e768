"""Parts: where a rank's tensor lies in the logical one, and its share of the logical sample.

A stats-mode trace keeps a 512-element sample of each tensor at positions seeded by the entry's
key and its number of elements (numerics/stats.py ``sample_indices``). A rank of a multi-rank
run holds a part of a logical tensor: its positions are not the logical tensor's, so its own
sample cannot be set beside a single process's. Each rank therefore also keeps, for such an
entry, the elements of the *logical* sample that fall in its part (meta ``part``: the logical
shape, the dim the part spans, where it starts, which of the logical sample's positions it
holds and their values); compare/layouts.py puts the ranks' shares together into the logical
sample, at the single process's positions (docs/trace-format.md, "Layouts").

A part is a contiguous range along one dim:
- a DTensor sharded along dim d on a 1-D mesh (FSDP2's parameters, gradients and optimizer
  state; tensor parallel shards, ``meta.layout``): torch's chunks, ceil(n / N) a rank;
- a data-parallel rank's forward and backward tensors (DDP, FSDP2): its equal part of the global
  batch along dim 0 (record/ranks.py ``shard_batch``). Which of them really are batch slices
  (not tensors every rank holds whole) only the other side's shapes say: compare uses the part
  where they do and the ordinary sample where the tensor is the same size as the logical one.
- a tensor-parallel rank's forward and backward tensors without a layout (an activation
  function between a colwise and a rowwise Linear): its part along the last dim, if it is one.
Replicated tensors, partial sums and whatever has no such part keep only the ordinary sample.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.numerics import stats as tstats

Part = tuple[list[int], int, int]  # (logical shape, dim, start along it)


class Parts:
    """The part of the logical tensor that each entry of rank ``rank`` of ``world`` holds."""

    def __init__(self, rank: int, world: int, splits_batch: bool, seed: int) -> None:
        self.rank, self.world, self.splits_batch, self.seed = rank, world, splits_batch, seed

    def of(self, phase: str, shape: list[int], layout: dict[str, Any] | None) -> Part | None:
        """The entry's part: from its DTensor ``layout``, else from the batch split; None where
        the rank holds the logical tensor whole (or no contiguous part of it)."""
        if layout is not None:
            return dtensor_part(layout, shape)
        if phase not in ("forward", "backward") or not shape or not shape[0]:
            return None
        if self.splits_batch:
            return [shape[0] * self.world, *shape[1:]], 0, self.rank * shape[0]
        # tensor parallel: an activation outside the plan that a module computed from a colwise
        # output (an activation function between a colwise and a rowwise Linear) is that
        # output's part along the last dim, if it is a part at all (compare decides)
        return [*shape[:-1], shape[-1] * self.world], len(shape) - 1, self.rank * shape[-1]

    def share_of(self, entry: dict[str, Any], data: torch.Tensor, skey: str
                 ) -> tuple[dict[str, Any], torch.Tensor] | None:
        """(meta ``part``, its values gathered from ``data`` on its device) of an entry, or None
        where it has no part to share or the logical tensor is small enough to be sampled whole
        (its parts are then whole in their own samples). Which positions the values are at,
        compare computes again (numerics/stats.py ``part_positions``)."""
        part = self.of(entry["phase"], entry["shape"], (entry.get("meta") or {}).get("layout"))
        if part is None or math.prod(part[0]) <= tstats.SAMPLE_SIZE or len(part[0]) != len(entry["shape"]):
            return None
        _, idx = tstats.part_positions(skey, self.seed, *part, entry["shape"])
        index = torch.from_numpy(idx)
        if data.device.type == "cuda":  # no stream sync: a pinned buffer, copied asynchronously
            index = index.pin_memory().to(data.device, non_blocking=True)
        elif data.device.type != "cpu":
            index = index.to(data.device)
        return {"global_shape": part[0], "dim": part[1], "start": part[2]}, data.reshape(-1)[index]

def dtensor_layout(t: Any) -> dict[str, Any]:
    """How a DTensor's local shard maps to the logical tensor (meta ``layout``), from its own
    attributes, no collective: its placements (``"S<dim>"`` sharded along dim, ``"R"``
    replicated, ``"P"`` a partial sum), the mesh's shape, this rank's coordinate in the mesh
    and the logical shape (docs/trace-format.md)."""
    def name(p: Any) -> str:
        if p.is_shard():
            return f"S{p.dim}"
        return "R" if p.is_replicate() else "P"

    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    return {"placements": [name(p) for p in t.placements], "mesh": list(mesh.shape),
            "coord": list(coord) if coord is not None else None, "global_shape": list(t.shape)}


def dtensor_part(layout: dict[str, Any], shape: list[int]) -> Part | None:
    """The part of a DTensor shard ``S<d>`` on a 1-D mesh: chunk ``coord`` of ceil(n / N) along
    d (torch's Shard placement); None for other placements and meshes."""
    placements, mesh, coord = layout.get("placements"), layout.get("mesh"), layout.get("coord")
    logical = layout.get("global_shape")
    if not (placements and len(placements) == 1 and str(placements[0]).startswith("S")
            and mesh and len(mesh) == 1 and coord and logical is not None):
        return None
    dim = int(placements[0][1:]) % max(len(logical), 1)
    size = -(-int(logical[dim]) // int(mesh[0]))
    return list(logical), dim, int(coord[0]) * size

"""Multi-rank records: the process group, each rank's batch and the wrapped model of a DDP or FSDP
run started by ``torchrun`` (record(..., parallel=...) records one trace per rank).

    torchrun --nproc_per_node 2 -m driftcheck record llama --out ref --parallel ddp
    torchrun --nproc_per_node 2 -m driftcheck record llama --out tgt --parallel ddp \\
        --dtype bf16 --replay ref
    driftcheck compare ref tgt          # rank by rank, one verdict

Layout: ``OUT/rank-<r>`` is a complete, ordinary trace of rank ``r`` (its own manifest, shards and
replay file), with ``rank``, ``world_size``, ``parallel`` and ``backend`` in its run metadata. The
process group's backend is the device's own (``choose_backend``) or ``--dist-backend NAME``. A
target replays a multi-rank reference rank by rank (the same world size), or a single-process
reference, each rank taking its part of each batch (record/inputs.py).

What each rank sees: the scenario's batch of every step is split along dim 0 into ``world_size``
equal parts (rank ``r`` takes part ``r``), so the global batch is the single-process one; under
``--parallel tp`` (record/tensor_parallel.py) every rank takes the whole batch instead; under
``--parallel fsdp-tp`` (a 2-D mesh of ``world / tp`` data-parallel groups of ``tp`` ranks: the
plan applied within each group, FSDP2 across them) rank ``r`` takes part ``r // tp`` of
``world / tp`` (``batch_part``). The
tracer hooks the inner module (module paths as without the wrapper), the training loop calls the
wrapper. Hooks only copy local tensors, never communicate: FSDP's sharded parameters, gradients
and optimizer state (DTensors) are recorded as this rank's local shard, and nothing a hook does
can make ranks wait for each other (under tensor parallelism every rank runs every hook:
record/capture.py gathers a sharded Linear's operand magnitudes there). Under DDP the ``grads``
phase is the gradient as it reached the parameter on this rank; the all-reduced result shows in
the optimizer phase.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, cast

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.nested import flatten, substitute

PARALLEL = ("ddp", "fsdp", "tp", "fsdp-tp")
DEFAULT_TP_SIZE = 2  # --parallel fsdp-tp's tensor-parallel group without --tp-size


def splits_batch(parallel: str | None) -> bool:
    """Whether the ranks of a ``parallel`` run each take a part of the batch (DDP, FSDP2, FSDP2
    across tensor-parallel groups) rather than all of it (tensor parallel)."""
    return parallel in ("ddp", "fsdp", "fsdp-tp")


def batch_part(parallel: str | None, rank: int, world: int, tp: int | None = None
               ) -> tuple[int, int] | None:
    """(which part, of how many) of each global batch rank ``rank`` of ``world`` takes along dim
    0: its own of ``world`` (DDP, FSDP2), its data-parallel group's of ``world / tp`` under
    fsdp-tp (ranks ``g * tp`` to ``g * tp + tp - 1`` form group ``g``, as ``init_device_mesh``
    lays out a (dp, tp) mesh); None: the whole batch (tensor parallel)."""
    if not splits_batch(parallel):
        return None
    if parallel == "fsdp-tp":
        size = mesh_shape(world, tp)[1]
        return rank // size, world // size
    return rank, world


def mesh_shape(world: int, tp: int | None) -> tuple[int, int]:
    """The (dp, tp) mesh of an fsdp-tp run of ``world`` ranks with tensor-parallel groups of
    ``tp`` (default DEFAULT_TP_SIZE).

    Raises:
        DriftcheckError: one line: ``tp`` below 2 or not dividing ``world``."""
    size = DEFAULT_TP_SIZE if tp is None else int(tp)
    if size < 2 or world % size:
        raise DriftcheckError(f"--tp-size {size} does not make a (data-parallel, tensor-parallel) "
                              f"mesh of the {world} ranks: it must be at least 2 and divide them")
    return world // size, size


# -- recording ------------------------------------------------------------------------------------
# The process-group backend of each device type under torchrun (--dist-backend NAME chooses any
# other registered one). tpu_dist is registered by torch_tpu (import torch_tpu before the group).
DEFAULT_BACKENDS = {"cuda": "nccl", "tpu": "tpu_dist", "cpu": "gloo", "lazy": "gloo"}


def choose_backend(device_type: str, name: str | None = None) -> str:
    """The process-group backend a record on ``device_type`` joins: ``name`` (any backend
    registered with torch.distributed), else the device type's own (DEFAULT_BACKENDS, then
    torch's default for the type).

    Raises:
        DriftcheckError: one line: a backend not registered or not available in this torch
            (tpu_dist without torch_tpu, nccl in a CPU build), or a device type without a default.
    """
    import torch.distributed as dist

    chosen = (name or DEFAULT_BACKENDS.get(device_type)
              or dist.Backend.default_device_backend_map.get(device_type))
    if not chosen:
        raise DriftcheckError(f"no default process-group backend for device {device_type!r}: pass "
                              f"--dist-backend NAME (available here: {', '.join(available_backends())})")
    if not dist.is_backend_available(chosen):
        why = (f"--dist-backend {chosen}" if name
               else f"the process-group backend of device {device_type!r}, {chosen},")
        hint = ("torch_tpu registers it: install torch_tpu and record with --device tpu"
                if chosen == "tpu_dist" else "pass --dist-backend NAME")
        raise DriftcheckError(f"{why} is not available in this torch (registered and available: "
                              f"{', '.join(available_backends())}); {hint}")
    return chosen


def available_backends() -> list[str]:
    """The process-group backends torch.distributed has registered and can start here."""
    import torch.distributed as dist

    return [b for b in dist.Backend.backend_list
            if b not in ("undefined", "fake") and dist.is_backend_available(b)]


def init_from_env(device: torch.device, backend: str | None = None) -> tuple[int, int, str]:
    """Join the process group torchrun describes with ``choose_backend``'s backend for
    ``device``; (rank, world, backend)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise DriftcheckError("--parallel needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        chosen = choose_backend(device.type, backend)
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise DriftcheckError("--parallel runs under torchrun: torchrun --nproc_per_node N -m "
                                  "driftcheck record MODEL --out DIR --parallel ddp")
        dist.init_process_group(chosen, timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def shard_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s part of a batch: every tensor split along dim 0 into ``world`` parts."""
    def part(_: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] % world:
            raise DriftcheckError(
                f"cannot split a batch tensor of shape {tuple(t.shape)} across {world} ranks: "
                f"its first dimension must be a multiple of {world}; make the scenario's batch "
                "size divisible by the number of processes")
        return t.chunk(world, dim=0)[rank].clone()

    return substitute(batch, "", part)


def join_batches(parts: list[Any]) -> Any:
    """The global batch of the ranks' ``parts`` (rank order): every tensor joined along dim 0,
    anything else as rank 0 has it (the inverse of ``shard_batch``)."""
    others = [dict(flatten(p, "")) for p in parts[1:]]

    def join(path: str, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, *(o[path] for o in others)], dim=0)

    return substitute(parts[0], "", join)


def wrap(model: nn.Module, parallel: str, device: torch.device,
         tp_plan: dict[str, Any] | None = None, tp_size: int | None = None) -> nn.Module:
    """The module the training loop calls: DDP around ``model``, or ``model`` itself after
    ``fully_shard`` (FSDP2 shards it in place and keeps its module paths), after the tensor-
    parallel ``tp_plan`` (record/tensor_parallel.py), or after both on a (dp, tp) mesh (the plan
    on each data-parallel group's ``tp`` ranks, then ``fully_shard`` across the groups: FSDP2's
    2-D layout, its parameters DTensors on both mesh dims)."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return cast(nn.Module, fully_shard(model))  # the same module, its class made FSDP's
    if parallel == "tp":
        from driftcheck.record.tensor_parallel import parallelize, plan_of

        return parallelize(model, plan_of(model, tp_plan, None), device)
    if parallel == "fsdp-tp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from driftcheck.record.tensor_parallel import parallelize, plan_of

        mesh = init_device_mesh(device.type, mesh_shape(dist.get_world_size(), tp_size),
                                mesh_dim_names=("dp", "tp"))
        parallelize(model, plan_of(model, tp_plan, None), device, mesh["tp"], mesh["dp"])
        return cast(nn.Module, fully_shard(model, mesh=mesh["dp"]))
    raise DriftcheckError(f"--parallel must be one of {', '.join(PARALLEL)}, not {parallel!r}")


# -- a process group started by somebody else (driftcheck.trace, the integrations) -----------
def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (or DataParallel): its module paths are the model's own."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DataParallel, DistributedDataParallel)):
        model = model.module
    return model


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor; any other tensor as it is."""
    if type(t) is not torch.Tensor and hasattr(t, "placements") and hasattr(t, "to_local"):
        return t.to_local()
    return t


def rank_info(model: nn.Module) -> dict[str, Any]:
    """rank, world_size, parallel and backend of a run in an initialized process group of more
    than one process; {} for a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    sharded = any(local_shard(p) is not p for p in model.parameters())
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "parallel": "fsdp" if sharded else "ddp", "backend": dist.get_backend()}


def broadcast_str(value: str | None) -> str:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])

"""Multi-rank records: one trace per rank of a DDP or FSDP run started by ``torchrun``.

    torchrun --nproc_per_node 2 -m driftcheck record llama --out ref --parallel ddp
    torchrun --nproc_per_node 2 -m driftcheck record llama --out tgt --parallel ddp \\
        --dtype bf16 --replay ref
    driftcheck compare ref tgt          # rank by rank, one verdict

Layout: ``OUT/rank-<r>`` is a complete, ordinary trace of rank ``r`` (its own manifest, shards and
replay file), with ``rank``, ``world_size``, ``parallel`` and ``backend`` in its run metadata. A
target replays the reference rank by rank, so both runs need the same world size.

What each rank sees: the scenario's batch of every step is split along dim 0 into ``world_size``
equal parts (rank ``r`` takes part ``r``), so the global batch is the single-process one. The
tracer hooks the inner module (module paths as without the wrapper), the training loop calls the
wrapper. Hooks only copy local tensors, never communicate: FSDP's sharded parameters, gradients
and optimizer state (DTensors) are recorded as this rank's local shard, and nothing a hook does
can make ranks wait for each other. Under DDP the ``grads`` phase is the gradient as it reached
the parameter on this rank; the all-reduced result shows in the optimizer phase.
"""
from __future__ import annotations

import datetime
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from driftcheck.errors import DriftcheckError

PARALLEL = ("ddp", "fsdp")
RANK_DIR = re.compile(r"^rank-(\d+)$")


def rank_dir(out: str | os.PathLike, rank: int) -> Path:
    """The trace directory of ``rank`` inside a multi-rank run directory."""
    return Path(out) / f"rank-{rank}"


def rank_dirs(run_dir: str | os.PathLike) -> dict[int, Path]:
    """{rank: trace directory} of a multi-rank run directory; empty for a single trace."""
    p = Path(run_dir)
    if not p.is_dir() or (p / "manifest.json").exists():
        return {}
    found = {int(m.group(1)): c for c in p.iterdir()
             if c.is_dir() and not c.is_symlink() and (m := RANK_DIR.match(c.name))}
    return dict(sorted(found.items()))


def is_multirank(run_dir: str | os.PathLike) -> bool:
    return bool(rank_dirs(run_dir))


# -- recording ------------------------------------------------------------------------------------
def init_from_env(device: torch.device) -> tuple[int, int, str]:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); (rank, world, backend)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise DriftcheckError("--parallel needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise DriftcheckError("--parallel runs under torchrun: torchrun --nproc_per_node N -m "
                                  "driftcheck record MODEL --out DIR --parallel ddp")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def shard_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s part of a batch: every tensor split along dim 0 into ``world`` parts."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % world:
            raise DriftcheckError(
                f"cannot split a batch tensor of shape {tuple(batch.shape)} across {world} ranks: "
                f"its first dimension must be a multiple of {world}; make the scenario's batch "
                "size divisible by the number of processes")
        return batch.chunk(world, dim=0)[rank].clone()
    if isinstance(batch, dict):
        return {k: shard_batch(v, rank, world) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_batch(v, rank, world) for v in batch)
    return batch


def wrap(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """The module the training loop calls: DDP around ``model``, or ``model`` itself after
    ``fully_shard`` (FSDP2 shards it in place and keeps its module paths)."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    raise DriftcheckError(f"--parallel must be one of {', '.join(PARALLEL)}, not {parallel!r}")


def record_rank(scenario: Any, out: str | os.PathLike, *, parallel: str,
                device: torch.device | str = "cpu", dtype: str = "fp32", steps: int | None = None,
                seed: int = 0, replay: str | os.PathLike | None = None, mode: str = "full",
                force: bool = False, model_id: str | None = None,
                include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
                full_modules: Iterable[str] | None = None, phases: Iterable[str] | None = None,
                capture_steps: Iterable[int] | None = None, transfer: str = "batched",
                autocast: str | None = None) -> Path:
    """Record this rank of a torchrun job into ``out/rank-<rank>``; returns that directory.

    Args mirror :func:`driftcheck.runner.record`; ``parallel`` is "ddp" or "fsdp";
    ``replay`` is the reference's run directory (its ``rank-<rank>`` is used).
    """
    from driftcheck.rng import DropoutControl
    from driftcheck.runner import (_load_replay_state, decode_batch, encode_batch, parse_dtype,
                                   run_metadata, train)
    from driftcheck.store import TraceWriter, read_replay
    from driftcheck.tracer import Tracer

    device = torch.device(device)
    rank, world, backend = init_from_env(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    tdtype = parse_dtype(dtype)
    out_dir = rank_dir(out, rank)
    model = scenario.model
    torch.manual_seed(seed)
    replay_tensors: dict[str, torch.Tensor] = {}
    replay_meta: dict[str, Any] | None = None
    if replay is not None:
        src = rank_dir(replay, rank)
        if not src.is_dir():
            raise DriftcheckError(f"--replay {replay} has no {src.name}: the reference ran with fewer "
                                  f"ranks than this run's {world}; use the same --nproc_per_node")
        tensors, meta = read_replay(src)
        if meta.get("world_size", world) != world:
            raise DriftcheckError(f"--replay {replay} was recorded with {meta.get('world_size')} "
                                  f"ranks, this run has {world}; use the same --nproc_per_node")
        _load_replay_state(model, tensors, src)
        batches = [decode_batch(d, tensors) for d in meta.get("inputs", [])]
        n_steps = int(steps if steps is not None else len(batches))
        if n_steps > len(batches):
            raise DriftcheckError(f"--replay {replay} holds {len(batches)} step(s), {n_steps} asked")
        batches = batches[:n_steps]
        replay_id, seed = meta.get("replay_id"), int(meta.get("seed", seed))
        torch.manual_seed(seed)
    else:
        n_steps = int(steps if steps is not None else scenario.steps)
        batches = [shard_batch(scenario.batch(i), rank, world) for i in range(n_steps)]
        replay_id = uuid.uuid4().hex if rank == 0 else None
        replay_id = _broadcast_str(replay_id)  # once, before any hook exists
        descs = [encode_batch(b, f"input/{i}", replay_tensors) for i, b in enumerate(batches)]
        for name, t in model.state_dict(keep_vars=True).items():
            kind = "param" if isinstance(t, nn.Parameter) else "buffer"
            replay_tensors[f"{kind}/{name}"] = t.detach()
        replay_meta = {"format": "driftcheck.replay", "version": 1, "replay_id": replay_id,
                       "seed": seed, "steps": n_steps, "inputs": descs, "model": model_id,
                       "rank": rank, "world_size": world,
                       "randomness": "dropout masks drawn on CPU from (seed, step, call index)"}
    if n_steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {n_steps}")
    model.to(device=device)
    if tdtype != torch.float32:
        model.to(dtype=tdtype)
    wrapped = wrap(model, parallel, device)
    optimizer = scenario.optimizer(model.parameters()) if scenario.optimizer and scenario.loss else None
    sel = set(phases or ("forward", "backward", "grads", "optimizer"))
    if optimizer is None:
        sel -= {"optimizer"}
    with TraceWriter(out_dir, force=force) as writer:
        if replay_meta is not None:
            writer.write_replay(replay_tensors, replay_meta)
        tracer = Tracer(model, writer, mode=mode, optimizer=optimizer, include=include,
                        exclude=exclude, full_modules=full_modules, phases=sel,
                        steps=capture_steps, transfer=transfer, seed=seed)
        tracer.attach()
        try:
            train(wrapped, batches, scenario, optimizer, device=device, dtype=tdtype,
                  dropout=DropoutControl(seed), autocast=autocast, tracer=tracer, model_id=model_id)
        finally:
            tracer._active = False
            tracer.detach()
        run = run_metadata(model=model, device=device, mode=mode, steps=n_steps,
                           dtype=str(tdtype).replace("torch.", ""), dtype_obj=tdtype, seed=seed,
                           model_id=model_id or scenario.name, scenario=scenario.name,
                           replay_id=replay_id, replay_of=str(replay) if replay else None,
                           autocast=autocast, rank=rank, world_size=world, parallel=parallel,
                           backend=backend,
                           capture={"include": list(include or []), "exclude": list(exclude or []),
                                    "phases": sorted(sel), "transfer": transfer})
        writer.close(run, extra=tracer.manifest_extra())
    return out_dir


def _broadcast_str(value: str | None) -> str:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


# -- comparing ------------------------------------------------------------------------------------
def compare_ranks(ref: str | os.PathLike, target: str | os.PathLike, **kwargs: Any) -> Any:
    """Compare two multi-rank run directories rank by rank; one Report for all of them.

    Entries and findings carry their rank (``details["rank"]``, keys prefixed ``rank<r>:``); the
    verdict fails when any rank fails; the first divergence is the earliest over all ranks
    (step, phase, execution order); ``decided_by`` gives each rank's verdict.
    """
    from driftcheck import format as fmt
    from driftcheck.compare import compare
    from driftcheck.report import Report

    refs, tgts = rank_dirs(ref), rank_dirs(target)
    if not refs or not tgts:
        which = ref if not refs else target
        raise DriftcheckError(f"{which} is not a multi-rank run directory (rank-0, rank-1, ... "
                              "inside); compare single traces directly")
    if set(refs) != set(tgts):
        raise DriftcheckError(f"the reference has ranks {sorted(refs)} and the target {sorted(tgts)}: "
                              "record both with the same --nproc_per_node")
    truth = kwargs.pop("truth", None)
    reports = {}
    for r in refs:
        t = rank_dir(truth, r) if truth else None
        reports[r] = compare(str(refs[r]), str(tgts[r]), truth=str(t) if t else None, **kwargs)
    entries, findings, warnings = [], [], []
    firsts = []
    for r, rep in reports.items():
        for e in rep.entries:
            e.key = f"rank{r}:{e.key}"
            e.details = dict(e.details or {}, rank=r)
            entries.append(e)
        for f in rep.findings:
            f.message = f"[rank {r}] {f.message}"
            f.key = f"rank{r}:{f.key}" if f.key else f.key
            f.details = dict(f.details or {}, rank=r)
            findings.append(f)
        warnings += [f"[rank {r}] {w}" for w in rep.warnings]
        if rep.first_divergence:
            fd = dict(rep.first_divergence, rank=r, key=f"rank{r}:{rep.first_divergence['key']}")
            firsts.append(((fd["step"], fmt.PHASE_RANK.get(fd["phase"], 99),
                            next((e.order for e in rep.entries if e.key == fd["key"]), math.inf), r), fd))
    first = min(firsts, key=lambda x: x[0])[1] if firsts else None
    verdict = "fail" if any(not rep for rep in reports.values()) else "pass"
    decided_by = "; ".join(f"rank {r}: {rep.verdict} ({rep.decided_by})" for r, rep in reports.items())
    base = reports[min(reports)]
    ref_run = dict(base.reference, world_size=len(reports))
    tgt_run = dict(base.target, world_size=len(reports))
    return Report(verdict=verdict, reference=ref_run, target=tgt_run, first_divergence=first,
                  entries=entries, findings=findings, limit=base.limit, decided_by=decided_by,
                  warnings=warnings, truth=base.truth, policy=base.policy)

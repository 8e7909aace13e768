"""A record's steps: the scenario's batches and the replay file a reference writes (its initial
state and inputs), or the batches a target replays from a reference (its initial state loaded
into the model; a long reference's segment from a replay point)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.record import ranks
from driftcheck.record.config import RecordConfig
from driftcheck.record.points import load_state as _load_replay_state, segment
from driftcheck.scenario import Scenario
from driftcheck.store.layout import is_multirank, rank_dirs
from driftcheck.store.replay import (
    decode_batch,
    encode_batch,
    input_prefix,
    read_replay,
    replay_meta as make_replay_meta,
    state_key,
)


class Inputs(NamedTuple):
    """A record's steps: their batches, the replay id and seed, and (a reference) what its
    replay file holds."""

    batches: list[Any]
    replay_id: str | None
    seed: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] | None  # the replay file's metadata to write; None: replayed


def replayed_inputs(model: nn.Module, config: RecordConfig, n_steps: int,
                     world: int | None, rank: int | None = None) -> Inputs:
    """A target's steps: the reference's initial state loaded into ``model``, its batches.

    Across layouts: replaying a multi-rank reference of another number of ranks (or from a
    single process) takes its global batch (the ranks' parts joined in rank order) and rank 0's
    initial state; a rank then takes its part of each batch (ranks.shard_batch), as a reference
    rank of this run's world size would have."""
    replay = config.replay
    assert replay is not None
    joined = None
    if is_multirank(replay):  # record._join_ranks resolved one of as many ranks to its rank
        tensors, meta, joined = _joined_replay(replay)
        meta = {k: v for k, v in meta.items() if k not in ("rank", "world_size")}  # global
    else:
        tensors, meta = read_replay(replay)
    if meta.get("inputs_are") == "calls":
        raise DriftcheckError(f"--replay {replay} was recorded by a training-loop callback "
                              f"({meta.get('driver') or 'driftcheck.integrations'}): replay it "
                              "with the same callback's replay=, not driftcheck record")
    if config.parallel and meta.get("world_size", world) != world:
        raise DriftcheckError(f"--replay {Path(replay).parent} was recorded with "
                              f"{meta.get('world_size')} ranks, this run has {world}; use the "
                              "same --nproc_per_node")
    _load_replay_state(model, tensors, replay)
    inputs = meta.get("inputs", [])
    if not isinstance(inputs, list):
        raise DriftcheckError(f"--replay {replay}: the replay file's input list is malformed; "
                              "re-record the reference")
    all_batches = joined if joined is not None else [decode_batch(d, tensors) for d in inputs]
    part = ranks.batch_part(config.parallel, rank or 0, world or 1, config.tp_size)
    if part is not None and "world_size" not in meta and world:
        # a single-process reference, or the global batch of a multi-rank one
        all_batches = [ranks.shard_batch(b, *part) for b in all_batches]
    if meta.get("cycle") or config.start:  # a long reference: from its replay point at `start`
        all_batches = segment(model, replay, meta, all_batches, config.start or 0, config.steps,
                              n_steps)
    if config.steps is None:
        n_steps = len(all_batches)  # a replayed target runs the reference's steps
    batches = all_batches[:n_steps]
    if len(batches) < n_steps:
        raise DriftcheckError(f"--replay {replay} holds {len(batches)} step(s) of inputs but "
                              f"{n_steps} were asked for; use --steps {len(batches)} or "
                              "re-record the reference with more steps")
    if not isinstance(meta.get("seed", config.seed), int) or isinstance(meta.get("seed"), bool):
        raise DriftcheckError(f"--replay {replay}: the replay file's seed is not an integer; "
                              "re-record the reference")
    seed = int(meta.get("seed", config.seed))
    torch.manual_seed(seed)
    return Inputs(batches, meta.get("replay_id"), seed, {}, None)


def new_inputs(model: nn.Module, scenario: Scenario, config: RecordConfig, n_steps: int,
               rank: int | None = None, world: int | None = None) -> Inputs:
    """A reference's steps: the scenario's batches, and its replay file (initial state, inputs)."""
    if config.start:
        raise DriftcheckError("--start needs --replay of a long reference (driftcheck record --long)")
    batches = [scenario.batch(i) for i in range(n_steps)]
    replay_id = uuid.uuid4().hex
    if config.parallel:
        assert rank is not None and world is not None  # joined the group: record._join_ranks
        part = ranks.batch_part(config.parallel, rank, world, config.tp_size)
        if part is not None:  # TP: every rank takes the whole batch
            batches = [ranks.shard_batch(b, *part) for b in batches]
        replay_id = ranks.broadcast_str(replay_id if rank == 0 else None)  # before any hook
    tensors: dict[str, torch.Tensor] = {}
    descs = [encode_batch(b, input_prefix(i), tensors) for i, b in enumerate(batches)]
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            kind = "param" if isinstance(t, nn.Parameter) else "buffer"
            tensors[state_key(kind, name)] = t.detach()
    meta = make_replay_meta(replay_id=replay_id, seed=config.seed, steps=n_steps, inputs=descs,
                            model=config.model_id)
    if config.parallel:
        meta.update(rank=rank, world_size=world)
    return Inputs(batches, replay_id, config.seed, tensors, meta)


def _joined_replay(run_dir: str | os.PathLike[str]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[Any]]:
    """Rank 0's replay (tensors, metadata) of a multi-rank reference, and the global batches:
    each step's batch parts joined in order (the inverse of ranks.shard_batch; of ranks holding
    the same part, the first)."""
    dirs = rank_dirs(run_dir)
    replays = [read_replay(d) for d in dirs.values()]
    tensors, meta = replays[0]
    if any(m.get("replay_id") != meta.get("replay_id") for _, m in replays):
        raise DriftcheckError(f"--replay {run_dir}: its ranks come from different records "
                              "(different replay ids); re-record the reference")
    parts = [[decode_batch(d, t) for d in m.get("inputs", [])] for t, m in replays]
    if len({len(p) for p in parts}) != 1:
        raise DriftcheckError(f"--replay {run_dir}: its ranks hold different numbers of steps")
    held = batch_parts_of(run_dir)
    if not held:  # tensor parallel: each rank holds the whole batch
        return tensors, meta, parts[0]
    first = [parts[held.index(i)] for i in range(max(held) + 1)]
    return tensors, meta, [ranks.join_batches(list(step)) for step in zip(*first)]


def batch_parts_of(run_dir: str | os.PathLike[str]) -> list[int]:
    """Which part of the global batch each rank of a multi-rank record holds (rank order), as its
    rank 0's manifest says; [] where every rank holds all of it (tensor parallel) or for a
    single trace."""
    from driftcheck.store.reader import TraceReader

    dirs = rank_dirs(run_dir)
    if not dirs:
        return []
    run = TraceReader(dirs[min(dirs)]).run
    tp = ((run.get("tensor_parallel") or {}).get("mesh") or {}).get("tp")
    got = [ranks.batch_part(run.get("parallel") or "ddp", r, len(dirs), tp) for r in sorted(dirs)]
    return [g[0] for g in got if g is not None]


def splits_batch_of(run_dir: str | os.PathLike[str]) -> bool:
    """Whether the ranks of a multi-rank record each hold a part of the batch (DDP, FSDP2,
    fsdp-tp), or all of it (tensor parallel), as its rank 0's manifest says."""
    return not rank_dirs(run_dir) or bool(batch_parts_of(run_dir))

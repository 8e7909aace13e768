"""Replay points: a record that starts where a long reference was at some step (the first bad
step of a long run, recorded in full: ``record(..., replay=LONG_REF, start=S)``), and loading a
replay file's or a point's state into a model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.store.replay import model_state, state_key


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], replay: Any) -> None:
    """Copy a replay file's ``param/``/``buffer/`` tensors into ``model``; a model that is not
    the recorded one is refused in one line."""
    state = model_state(tensors)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise DriftcheckError(
            f"--replay {replay} was recorded from a different model: "
            f"{len(missing)} tensor(s) missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}); record the target with the same MODEL as the reference")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise DriftcheckError(f"--replay {replay}: shapes differ for {bad[:3]}; the reference was "
                              "recorded from a different model configuration")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def segment(model: nn.Module, replay: Any, meta: dict[str, Any], inputs: list[Any], start: int,
            steps: int | None, n_steps: int) -> list[Any]:
    """The inputs of steps start..start+n_steps-1 of a long reference (step i uses input i mod
    cycle), the model loaded from its replay point at ``start`` (its initial state at 0)."""
    if not meta.get("cycle"):
        raise DriftcheckError(f"--start needs --replay of a long reference (driftcheck record "
                              f"--long); {replay} is a plain trace")
    if steps is None or start + n_steps > int(meta.get("steps", 0)):
        raise DriftcheckError(f"--replay {replay} is a long reference of {meta.get('steps')} "
                              "step(s): give --steps (and --start) within it")
    if start:
        from driftcheck.store.long import point_path, read_point

        path = point_path(Path(replay), start)
        if not path.is_file():
            raise DriftcheckError(f"--start {start}: {replay} has no replay point there (points: "
                                  f"{_points(replay)}); choose one of them")
        state, _ = read_point(path)
        load_state(model, {state_key("param", k): v for k, v in state.items()}, replay)
    return [inputs[(start + i) % len(inputs)] for i in range(n_steps)]


def load_point_optimizer(optimizer: torch.optim.Optimizer, replay: Any, step: int) -> None:
    from driftcheck.store.long import point_path, read_point

    _, opt = read_point(point_path(Path(replay), step))
    if opt is not None:
        optimizer.load_state_dict(opt)


def _points(replay: Any) -> str:
    from driftcheck.store.long import LongReader

    try:
        return ", ".join(map(str, LongReader(replay).points)) or "none"
    except DriftcheckError:
        return "unreadable"

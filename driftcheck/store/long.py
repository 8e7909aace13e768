"""A long record: per-step columns of thousands of training steps, and the replay points.

A long trace directory holds (names in driftcheck/store/format.py):
- ``long.json``: ``format: "driftcheck.long"``, ``version``, ``run`` (run metadata as a trace's,
  with ``steps``, ``every``, ``points_every``, ``role``), ``columns`` (name -> shape), ``points``
  (the steps that have a replay point);
- ``long.safetensors``: one tensor per quantity (float64; the parameter sample float32, which
  holds fp32/bf16/fp16 parameters exactly, float64 for a float64 run): ``loss``, ``grad_norm``,
  ``update_norm``, ``param_norm`` of shape [steps]; ``sample_steps`` [n] (the steps sampled:
  every ``every``-th, after its update) with ``param_sample`` [n, S] (the parameters at S fixed,
  seeded positions: the same on every run of the model) and ``module_rms`` [n, M] (each
  module's forward output rms at those steps; module names in ``run.modules``);
- ``replay.safetensors``: a trace's replay file (initial state, inputs, seed; ``cycle``: step i
  uses input i mod cycle), so a target replays with ``--replay``;
- ``points/step-<s>.safetensors`` (the reference): parameters, buffers and optimizer state at the
  start of step s, every ``points_every`` steps; the first bad step is recorded in full from the
  nearest one (driftcheck/record/long.py).
The JSON is written last: without it the directory is not a long trace.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.store import format as fmt
from driftcheck.store.replay import decode_batch, encode_batch
from driftcheck.store.shard import MappedShard, strict_json, write_safetensors

STEP_COLUMNS = ("loss", "grad_norm", "update_norm", "param_norm")


def is_long(path: str | os.PathLike) -> bool:
    return (Path(path) / fmt.LONG_MANIFEST).is_file()


def write_long(out: Path, run: dict[str, Any], columns: dict[str, torch.Tensor],
               points: list[int]) -> None:
    """The columns, then ``long.json`` (atomically, last)."""
    # float64, except the parameter sample: float32 holds fp32/bf16/fp16 parameters exactly
    host = {k: v.detach().to("cpu", v.dtype if k == "param_sample" else torch.float64).contiguous()
            for k, v in columns.items()}
    write_safetensors(out / fmt.LONG_COLUMNS, sorted(host.items()), metadata={}, fsync=True)
    manifest = {"format": fmt.LONG_FORMAT, "version": fmt.LONG_VERSION, "run": run,
                "columns": {k: list(v.shape) for k, v in sorted(host.items())},
                "points": sorted(points)}
    tmp = out / f".{fmt.LONG_MANIFEST}.tmp"
    tmp.write_bytes(strict_json(manifest))
    os.replace(tmp, out / fmt.LONG_MANIFEST)


class LongReader:
    """A long trace, validated: ``run``, ``columns`` (float64 tensors), ``points``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.dir = Path(path)
        m = self.dir / fmt.LONG_MANIFEST
        if not self.dir.is_dir():
            raise TraceError(f"long trace {self.dir} does not exist")
        if not m.is_file():
            raise TraceError(f"{self.dir} is not a long trace (no {fmt.LONG_MANIFEST}): record it "
                             "with driftcheck record --long")
        try:
            manifest = json.loads(m.read_text())
        except (OSError, ValueError) as e:
            raise TraceError(f"{m} is not readable JSON ({e}); re-record the long trace") from None
        if not isinstance(manifest, dict) or manifest.get("format") != fmt.LONG_FORMAT:
            raise TraceError(f"{m} is not a driftcheck long trace manifest")
        if manifest.get("version") != fmt.LONG_VERSION:
            raise TraceError(f"{m} has long-trace version {manifest.get('version')!r}; this "
                             f"driftcheck reads version {fmt.LONG_VERSION}")
        run = manifest.get("run")
        self.run: dict[str, Any] = run if isinstance(run, dict) else {}
        self.points = [p for p in manifest.get("points", []) if isinstance(p, int)]
        try:
            shard = MappedShard(self.dir / fmt.LONG_COLUMNS, what="long columns")
            self.columns = {k: shard.read(*shard.tensors[k]).double() for k in shard.tensors}
        except (TraceError, KeyError, ValueError) as e:
            raise TraceError(f"{self.dir / fmt.LONG_COLUMNS}: {e}; re-record the long trace") from None
        steps = self.run.get("steps")
        for k in STEP_COLUMNS:
            c = self.columns.get(k)
            if c is None or c.dim() != 1 or c.numel() != steps:
                raise TraceError(f"{self.dir}: column {k!r} is missing or not {steps} steps long; "
                                 "the long trace is corrupt")

    @property
    def steps(self) -> int:
        return int(self.run["steps"])


# -- replay points ---------------------------------------------------------------------------------
def point_path(out: Path, step: int) -> Path:
    return out / fmt.POINTS_DIR / f"step-{step}.safetensors"


def write_point(out: Path, step: int, model: torch.nn.Module, optimizer: Any) -> None:
    """Parameters, buffers and optimizer state at the start of ``step``."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        tensors[f"model/{name}"] = t.detach().to("cpu", copy=True)
    opt_desc = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        state = {str(k): v for k, v in sd["state"].items()}
        opt_desc = encode_batch({"state": state, "param_groups": _groups(sd["param_groups"])},
                                "opt", tensors)
        tensors = {k: (v.detach().to("cpu", copy=True) if k.startswith("opt") else v)
                   for k, v in tensors.items()}
    path = point_path(out, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, sorted(tensors.items()),
                      metadata={"driftcheck": json.dumps({"step": step, "optimizer": opt_desc})},
                      fsync=False)


def read_point(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """(model state, optimizer state_dict or None) of a replay point."""
    try:
        f = MappedShard(path, what="replay point")
        meta = json.loads(f.metadata.get("driftcheck", "null"))
        tensors = {k: f.read(*f.tensors[k]) for k in f.tensors}
    except (TraceError, ValueError, KeyError) as e:
        raise TraceError(f"{path} is not a readable replay point ({e}); re-record the reference") from None
    model = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("model/")}
    opt = None
    if isinstance(meta, dict) and meta.get("optimizer") is not None:
        raw = decode_batch(meta["optimizer"], tensors)
        opt = {"state": {int(k): v for k, v in raw["state"].items()},
               "param_groups": raw["param_groups"]}
    return model, opt


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer param groups as JSON-able values (betas tuples, tensors of a capturable lr)."""
    out = []
    for g in groups:
        clean: dict[str, Any] = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            if isinstance(v, (bool, int, float, str)) or v is None:
                clean[k] = v
            elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
                clean[k] = list(v)
            else:
                raise DriftcheckError(f"the optimizer's param group option {k!r} ({type(v).__name__}) "
                                      "cannot be saved in a replay point")
        out.append(clean)
    return out

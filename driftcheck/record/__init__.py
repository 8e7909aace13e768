"""Recording: everything between a user's model and a trace directory.

    tracer.py    Tracer (selection, lifecycle, state captures) and the trace() API
    hooks.py     forward hooks: inputs, outputs, module meta, audits, local replay
    autograd.py  the backward: output gradients, input gradients off the autograd edges
    capture.py   copies and summaries at hook time, one batched host transfer per step
    meta.py      per-module meta: op kind, reduction length, magnitudes, kink profile
    local.py     local replay: each leaf module rerun on the reference's inputs
    rng.py       CPU-drawn dropout masks, so a target reproduces the reference's randomness
    runner.py    record(): a Scenario for N steps on a device/dtype, one rank or many
    long.py      record_long(): thousands of steps as per-step columns, with replay points
    points.py    a record started at a long reference's replay point; replay state into a model
    ranks.py     torchrun process group, each rank's batch, the DDP/FSDP wrapper
    metadata.py  run metadata for the manifest
    run.py       ``driftcheck run``: reference, truth and target, each in its own process

Lazy exports: ``driftcheck run`` orchestrates the sides through ``run.py`` without importing
torch itself (each side imports it in its own process, after its device is known).
"""
from __future__ import annotations

from typing import Any

__all__ = ["Tracer", "record", "trace", "train"]


def __getattr__(name: str) -> Any:
    if name in ("record", "train"):
        from driftcheck.record import runner
        return getattr(runner, name)
    if name in ("Tracer", "trace"):
        from driftcheck.record import tracer
        return getattr(tracer, name)
    raise AttributeError(f"module 'driftcheck.record' has no attribute {name!r}")

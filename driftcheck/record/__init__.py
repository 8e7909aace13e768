"""Recording: everything between a user's model and a trace directory.

    config.py     RecordConfig (a whole record) and CaptureConfig (what the tracer captures)
    tracer.py     Tracer: the orchestrator of the parts below, each owning its state; trace()
    calls.py      Calls: the module calls open now, their numbers, whether hooks are live
    selection.py  Selection: which modules, phases and steps are captured, full or stats
    capture.py    Capture: copies and summaries at hook time, one batched host transfer per step
    host_summaries.py  HostSummaries: host captures' stats rows and samples, held in mapped blocks
    transfer.py   the step's host transfer: deferred data, one copy per dtype, samples packed
    state.py      StateCapture: parameters, buffers, gradients, optimizer state (tied once)
    hooks.py      ForwardHooks: inputs, outputs, module meta, the local replay
    autograd.py   BackwardHooks: output gradients, input gradients off the autograd edges
    watch.py      LogitWatch / WatchLog: what a module's own code computes between its children
    audits.py     NormAudit: the BatchNorm running-stat audit, eager and compiled
    tapping.py    TapGradients / GraphTaps: what the graph taps hand over (taps.py: the taps)
    meta.py       per-module meta: op kind, reduction length, magnitudes, kink profile
    local.py      local replay: each leaf module rerun on the reference's inputs
    rng.py        CPU-drawn dropout masks, so a target reproduces the reference's randomness
    runner.py     record(scenario, config): a Scenario for N steps on a device/dtype, one rank or many
    inputs.py     a record's steps: the scenario's batches and replay file, or a reference's
    loop.py       train(): the training loop of a record, traced or not (the same code)
    long.py       record_long(): thousands of steps as per-step columns, with replay points
    points.py     a record started at a long reference's replay point; replay state into a model
    ranks.py      torchrun process group, each rank's batch, the DDP/FSDP wrapper
    metadata.py   run metadata for the manifest
    run.py        ``driftcheck run``: reference, truth and target, each in its own process

Lazy exports: ``driftcheck run`` orchestrates the sides through ``run.py`` without importing
torch itself (each side imports it in its own process, after its device is known).
"""
from __future__ import annotations

from typing import Any

__all__ = ["CaptureConfig", "RecordConfig", "Tracer", "record", "trace", "train"]


def __getattr__(name: str) -> Any:
    if name in ("record", "train"):
        from driftcheck.record import runner
        return getattr(runner, name)
    if name in ("RecordConfig", "CaptureConfig"):
        from driftcheck.record import config
        return getattr(config, name)
    if name in ("Tracer", "trace"):
        from driftcheck.record import tracer
        return getattr(tracer, name)
    raise AttributeError(f"module 'driftcheck.record' has no attribute {name!r}")

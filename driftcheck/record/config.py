"""What a record is asked to do, as two frozen values: ``CaptureConfig`` (what the tracer
captures) and ``RecordConfig`` (a whole record: the trace directory, the device and dtype, the
replay, the target's variations, and the capture), carried from the CLI through ``record()`` to
the tracer.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from driftcheck.store import format as fmt


def _strings(values: Iterable[str] | None) -> tuple[str, ...]:
    return tuple(values or ())


def _steps(values: Iterable[int] | None) -> frozenset[int] | None:
    return None if values is None else frozenset(values)


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What a :class:`driftcheck.record.tracer.Tracer` captures.

    Args:
        mode: "full" (tensors), "stats" (statistics + a seeded sample), "auto" (stats, full
            tensors for modules matching ``full_modules``).
        include / exclude: module path globs selecting what is captured (params follow their
            owning module).
        phases: subset of ("forward", "backward", "grads", "optimizer"); None or empty: all.
        steps: step indices to capture (None = all).
        transfer: "batched" (one device-to-host transfer per step) or "per-capture".
        seed: seeds the stats-mode sample indices (same on both runs).
        audits: run the BatchNorm running-stat audit.
        view_audit: the run records view/in-place events (the runner, or trace(), installs the audit).
        max_pending_bytes: captures waiting for a transfer beyond this are flushed early.
        root_output_grads: capture the gradients of the model's own outputs (off where a loop
            returns copies of them that the loss never uses: accelerate's fp32 outputs).
    """

    mode: str = "full"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    full_modules: tuple[str, ...] = ()
    phases: frozenset[str] | None = None
    steps: frozenset[int] | None = None
    transfer: str = "batched"
    seed: int = 0
    audits: bool = True
    view_audit: bool = False
    max_pending_bytes: int = 1 << 30
    root_output_grads: bool = True

    def __post_init__(self) -> None:
        if self.mode not in fmt.MODES:
            raise ValueError(f"mode must be one of {fmt.MODES}, not {self.mode!r}")
        for name in ("include", "exclude", "full_modules"):
            object.__setattr__(self, name, _strings(getattr(self, name)))
        object.__setattr__(self, "phases", None if self.phases is None else frozenset(self.phases))
        object.__setattr__(self, "steps", _steps(self.steps))

    @property
    def selected_phases(self) -> frozenset[str]:
        """The phases captured: those asked for, or all of them."""
        return frozenset(self.phases or fmt.SELECTABLE_PHASES)


@dataclasses.dataclass(frozen=True)
class RecordConfig:
    """One record: where it goes, what runs, and what is captured (``record(scenario, config)``).

    Args:
        out: the trace directory to create (``force`` to overwrite).
        device: where to run. dtype: "fp32", "bf16", "fp16" or "fp64".
        steps: training steps (default: the scenario's). seed: CPU RNG seed (dropout masks).
        replay: a reference trace whose initial weights and inputs this run starts from.
        mode, include, exclude, full_modules, phases, capture_steps, transfer, view_audit:
            what is captured (:class:`CaptureConfig`; ``capture_steps`` is its ``steps``).
        autocast: "bf16"/"fp16" to run the forward under torch.autocast.
        emulate: a TPU matmul precision level ("default", "high", "highest"): every matmul and
            convolution, forward and backward, computed as torch_tpu does (targets/emulate.py).
        fp8: "e4m3", "e5m2" or "hybrid": Linear matmuls through emulated fp8.
        local: a full-mode reference trace (the one replayed): every leaf module is also rerun
            on that reference's inputs of the same call, and its output (and input gradients,
            from the reference's output gradients) recorded as ``local.*`` entries, so compare
            can tell the error a module adds from the error it inherits (record/local.py).
        simulate: a simulated faulty backend (targets/simulate.py) the target runs on.
        on_step: called with (steps done, steps in all) after each step (a progress bar).
        on_written: called before ``on_step`` with (entries, bytes of their tensors) the trace
            holds so far (what the progress shows besides the steps).
        target_hooks: called with the model after it is placed, before recording (fault
            injection in tests and benchmarks); if what it returns has ``set_step``, that is
            called with each step's number (a fault scheduled to begin at some step).
        parallel: "ddp", "fsdp", "tp" or "fsdp-tp" under torchrun (record/ranks.py): this rank
            into ``out/rank-<rank>``, replaying the reference's ``rank-<rank>`` (of a reference
            whose ranks hold the same batch parts; else its global batch).
        tp_size: with parallel "fsdp-tp", the ranks of each tensor-parallel group (None: 2).
        dist_backend: with ``parallel``, the process-group backend by name (any registered with
            torch.distributed); None: the device's own (record/ranks.py ``choose_backend``).
        start: with ``replay`` a long reference (record/long.py): start at this step from its
            replay point (weights and optimizer state) and run ``steps`` steps from there,
            numbered from ``start`` (``capture_steps`` are those numbers).
        env: the environment variables this side was given (``--env``): recorded as ``run.env``,
            so every later rerun of this side (the drill-down) runs under them.
        compile: ``torch.compile`` settings (record/compilation.py ``settings``): the loop calls
            the compiled model, captured by graph taps (record/taps.py).
        model_id: the model's name in the run metadata (default: the scenario's).
        mkldnn: oneDNN's CPU kernels on (True) or off (False) for this record, None: as torch
            has them; recorded as the manifest's ``precision.cpu_kernels.mkldnn``.
    """

    out: str | os.PathLike[str]
    device: Any = "cpu"  # a torch.device or its name
    dtype: str = "fp32"
    steps: int | None = None
    seed: int = 0
    replay: str | os.PathLike[str] | None = None
    mode: str = "full"
    force: bool = False
    model_id: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    full_modules: tuple[str, ...] = ()
    phases: frozenset[str] | None = None
    capture_steps: frozenset[int] | None = None
    transfer: str = "batched"
    autocast: str | None = None
    fp8: str | None = None
    emulate: str | None = None
    local: str | os.PathLike[str] | None = None
    view_audit: bool = False
    simulate: str | None = None
    on_step: Callable[[int, int], None] | None = None
    on_written: Callable[[int, int], None] | None = None
    target_hooks: Callable[[Any], Any] | None = None
    parallel: str | None = None
    dist_backend: str | None = None
    tp_size: int | None = None
    start: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    compile: Mapping[str, Any] | None = None
    mkldnn: bool | None = None

    def __post_init__(self) -> None:
        for name in ("include", "exclude", "full_modules"):
            object.__setattr__(self, name, _strings(getattr(self, name)))
        object.__setattr__(self, "phases", None if self.phases is None else frozenset(self.phases))
        object.__setattr__(self, "capture_steps", _steps(self.capture_steps))
        object.__setattr__(self, "env", dict(self.env or {}))

    def replace(self, **changes: Any) -> RecordConfig:
        """This config with ``changes`` (a rank's directory, a replay resolved)."""
        return dataclasses.replace(self, **changes)

    def capture(self, **changes: Any) -> CaptureConfig:
        """What the tracer of this record captures (``changes``: what the run decided, the
        phases a scenario without a loss or optimizer has, the replay's seed)."""
        base = dict(mode=self.mode, include=self.include, exclude=self.exclude,
                    full_modules=self.full_modules, phases=self.phases, steps=self.capture_steps,
                    transfer=self.transfer, seed=self.seed, view_audit=self.view_audit)
        return CaptureConfig(**{**base, **changes})

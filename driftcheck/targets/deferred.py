"""Deferred-execution devices: PyTorch's lazy-tensor backend (``lazy``) and torch_xla (``xla``).

On such a device an op only adds to a graph; the graph runs at a sync point: the step's
``mark_step``, or any read of a value (``.cpu()``, ``.item()``, an op the backend falls back to
the host for). A capture that reads a tensor inside a step splits the step's graph, so the
traced run computes a different program than the untraced one: hooks keep their copies on the
device, the step's own ``mark_step`` materialises them with the model's state, and one transfer
moves them to the host afterwards (record/capture.py).

The counters (``torch._lazy.metrics``) say how many graphs a step compiled and ran and how many
tensors it synced: the manifest's ``run.lazy`` holds them per step, and a graph the capture ran
inside a step is a finding (``deferred.capture_sync``).
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from driftcheck.errors import DriftcheckError

if TYPE_CHECKING:
    import torch

DEFERRED_TYPES = ("lazy", "xla")
# The counters recorded per step: graphs compiled (Uncached) or found compiled (Cached), and
# so run; tensors synced with IR pending; step marks.
COUNTERS = ("UncachedCompile", "CachedCompile", "SyncedTensorsWithIR", "MarkStep")
XLA_FIX = "pip install torch_xla (a version matching this torch)"


def is_deferred(device: torch.device | str) -> bool:
    """Whether ``device`` runs deferred (ops build a graph that runs at sync points)."""
    kind = device if isinstance(device, str) else device.type
    return kind.split(":")[0] in DEFERRED_TYPES


def init_backend(device_type: str) -> None:
    """Make ``device_type`` usable in this process: the TorchScript backend of ``lazy`` (once),
    torch_xla for ``xla``. Imports torch."""
    if device_type == "lazy":
        import torch._lazy
        import torch._lazy.ts_backend

        if not _lazy_ready():
            torch._lazy.ts_backend.init()
    elif device_type == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            raise DriftcheckError(f"device 'xla' needs torch_xla: {XLA_FIX}")
        import torch_xla  # noqa: F401  (registers the device)


def _lazy_ready() -> bool:
    import torch

    try:
        torch.empty(0, device="lazy")
    except RuntimeError:
        return False
    return True


def lazy_available() -> bool:
    """Whether this torch build has the lazy-tensor backend (the CPU and CUDA wheels do)."""
    import torch

    return hasattr(torch._C, "_lazy") and importlib.util.find_spec("torch._lazy.ts_backend") is not None


def copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that later writes cannot reach. On the lazy backend a ``clone`` of a
    tensor that holds device data can share that data, and an in-place update the backend
    makes there (BatchNorm's running statistics) then lands in the clone instead of the
    tensor (docs/devices.md): a product makes a buffer of its own, with the same values."""
    if t.device.type in DEFERRED_TYPES and (t.is_floating_point() or t.is_complex()):
        return t * 1
    return t.clone()


def where(keep: torch.Tensor, x: torch.Tensor, value: float) -> torch.Tensor:
    """``torch.where(keep, x, value)``; on the lazy backend, which lowers no ``where`` (a host
    fallback there, so a sync), the same values as a masked fill."""
    import torch

    if x.device.type in DEFERRED_TYPES:
        return x.masked_fill(keep == 0, value)
    return torch.where(keep, x, value)


def mark_step(device: torch.device) -> None:
    """The step boundary of a deferred device: every live tensor's pending graph runs (a no-op
    on other devices)."""
    if device.type == "lazy":
        import torch._lazy

        torch._lazy.mark_step()
    elif device.type == "xla":
        import torch_xla

        torch_xla.sync()


def materialise(tensors: list[torch.Tensor]) -> None:
    """Run the pending graphs of ``tensors`` on a deferred device together, as one graph (the
    tensors that hold data already need none)."""
    lazy = [t for t in tensors if t.device.type == "lazy"]
    if lazy:
        import torch._lazy

        torch._lazy.sync_multi(lazy, [])
    xla = [t for t in tensors if t.device.type == "xla"]
    if xla:
        import torch_xla

        torch_xla._XLAC._xla_sync_multiple(xla, [], wait=True)


def counters(device_type: str) -> dict[str, int]:
    """The backend's ``COUNTERS`` now (zeros where it has not counted one yet)."""
    if device_type == "lazy":
        import torch._lazy.metrics as metrics

        names = set(metrics.counter_names())
        return {n: int(metrics.counter_value(n)) if n in names else 0 for n in COUNTERS}
    if device_type == "xla":
        import torch_xla.debug.metrics as xmetrics

        return {n: int(xmetrics.counter_value(n) or 0) for n in COUNTERS}
    return {}


def graphs(counts: dict[str, int]) -> int:
    """How many graphs ran, from a difference of ``counters``."""
    return counts.get("UncachedCompile", 0) + counts.get("CachedCompile", 0)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """``after - before``, counter by counter."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


class StepCounts:
    """The counters of each traced step of a deferred device, and the graphs the tracer's own
    work ran inside a step (each one a sync point the capture added)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.steps: list[dict[str, int]] = []
        self.capture_graphs: list[int] = []  # per step: graphs the capture ran inside it
        self._start = counters(device_type)
        self._own = 0
        self._depth = 0

    def restart(self) -> None:
        """The next step's counts start now."""
        self._start, self._own = counters(self.device_type), 0

    def own(self) -> Any:
        """A context around the tracer's own work inside a step: the graphs it runs are counted."""
        return _Own(self)

    def end_step(self, step: int) -> None:
        """After step ``step``'s ``mark_step`` (and its transfer): its counts."""
        now = counters(self.device_type)
        self.steps.append({"step": step, **diff(now, self._start)})
        self.capture_graphs.append(self._own)
        self._start, self._own = now, 0

    def metadata(self) -> dict[str, Any]:
        """The manifest's ``run.lazy``: per-step counts and the capture's own graphs."""
        return {"backend": self.device_type, "counters": list(COUNTERS), "steps": self.steps,
                "capture_graphs": self.capture_graphs}


class _Own:
    """Counts the graphs run inside it, once where such contexts nest."""

    def __init__(self, counts: StepCounts) -> None:
        self.counts = counts

    def __enter__(self) -> None:
        self.counts._depth += 1
        if self.counts._depth == 1:
            self.before = counters(self.counts.device_type)

    def __exit__(self, *exc: Any) -> None:
        self.counts._depth -= 1
        if self.counts._depth == 0:
            self.counts._own += graphs(diff(counters(self.counts.device_type), self.before))

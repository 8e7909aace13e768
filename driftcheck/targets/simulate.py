"""Simulated faulty backends: the defects driftcheck must catch, reproduced on CPU.

Each simulator is a context manager around a run (a ``TorchDispatchMode``), so the detectors
(``audit.batchnorm``, ``audit.views``, ``probe``) can be proven against the fault they claim to
catch without the faulty hardware:

- ``views_become_copies()``: view ops return fresh copies (a backend without real views).
- ``drop_view_writes()``: an in-place write through a view lands in a private copy of the view
  and never reaches its base (a backend that functionalises views wrongly).
- ``skip_batchnorm_stat_updates()``: the torch_tpu 0.2.0 BatchNorm bug: training normalises with
  the batch statistics, ``running_mean``/``running_var`` are never written, ``num_batches_tracked``
  still advances (Python increments it). The output stays bitwise identical to a correct run.

Modes stack: to let a detector mode (``audit.views.ViewAudit``) observe a fault, enter the fault
first and the detector inside it, so the detector's calls pass through the fault.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck.errors import DriftcheckError

__all__ = ["drop_view_writes", "skip_batchnorm_stat_updates", "views_become_copies"]

# Overload packets (``aten.<name>``) whose outputs a real backend must alias with their input.
# narrow, chunk and (usually) t decompose into slice / split / transpose above the Python key;
# they are listed so the set stays right if a backend registers them directly.
_VIEW_OPS = frozenset({
    "view", "_reshape_alias", "as_strided", "slice", "select", "transpose", "permute", "expand",
    "narrow", "diagonal", "unsqueeze", "squeeze", "t", "unbind", "split", "split_with_sizes",
    "chunk", "unfold", "view_as", "unflatten",
})

# Kernels that update running statistics as a side effect of training-mode batch norm.
_BATCH_NORM_OPS = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
    "cudnn_batch_norm", "miopen_batch_norm", "batch_norm_update_stats",
})


def _packet_name(func: Any) -> str:
    return func.overloadpacket.__name__


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into, from its schema's alias annotations (``Tensor(a!)``)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _is_view_of_other(t: torch.Tensor) -> bool:
    # A view in autograd's sense, or a tensor covering only part of its storage (``.data`` of a
    # view, ``set_``): either way writes to it are meant to be seen through another tensor.
    if t._is_view():
        return True
    extent = t.untyped_storage().nbytes()
    return t.storage_offset() != 0 or t.numel() * t.element_size() < extent


class _Simulated(TorchDispatchMode):
    """A simulated backend; ``changes`` counts the ops it made behave differently, so a run it
    could not affect can say so instead of passing as a check of that defect."""

    changes = 0


class _ViewsBecomeCopies(_Simulated):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _packet_name(func) not in _VIEW_OPS:
            return out
        self.changes += 1
        if isinstance(out, torch.Tensor):
            return out.clone()
        if isinstance(out, (list, tuple)):
            return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out


class _DropViewWrites(_Simulated):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in _written(func, args, kwargs):
            if t.numel() and _is_view_of_other(t):
                self.changes += 1
                # Re-seat the view, same geometry, on a private copy of its storage: the op
                # writes there, the view reads its new values, the base never sees them.
                private = t.untyped_storage().clone()
                t.set_(private, t.storage_offset(), t.size(), t.stride())
        return func(*args, **kwargs)


class _SkipBatchNormStatUpdates(_Simulated):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _packet_name(func) not in _BATCH_NORM_OPS:
            return func(*args, **kwargs)
        saved = [(t, t.clone()) for t in _running_stats(func, args, kwargs)]
        self.changes += bool(saved)
        out = func(*args, **kwargs)
        # Restoring (rather than passing None) keeps the kernel, and so the output, identical.
        for t, before in saved:
            t.copy_(before)
        return out


def _running_stats(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    stats = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("running_mean", "running_var"):
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            if isinstance(value, torch.Tensor):
                stats.append(value)
    return stats


def views_become_copies() -> TorchDispatchMode:
    """A backend whose view ops (view, slice, select, transpose, ...) return copies.

    Example:
        >>> with views_become_copies():
        ...     x = torch.zeros(3); x[1:].fill_(1.0)   # x stays all zeros
    """
    return _ViewsBecomeCopies()


def drop_view_writes() -> TorchDispatchMode:
    """A backend where in-place writes through a view never reach the view's base."""
    return _DropViewWrites()


def skip_batchnorm_stat_updates() -> TorchDispatchMode:
    """The torch_tpu 0.2.0 BatchNorm bug: running_mean/running_var are never written in training."""
    return _SkipBatchNormStatUpdates()


class _OpFaultBackend:
    """A backend with one wrong kernel (driftcheck/opfaults.py), everywhere in the run."""

    def __init__(self, spec: str) -> None:
        from driftcheck.targets.opfaults import from_spec

        self.fault = from_spec(spec)

    def __enter__(self) -> _OpFaultBackend:
        self.fault()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fault.remove()

    @property
    def changes(self) -> int:
        return self.fault.hits


# --simulate NAME -> opfaults spec: backends with one wrong kernel, for the drill-down end to end
OP_FAULTS = {"gelu-tanh": "gelu_tanh", "attention-scale": "attention_scale",
             "sum-bf16": "low_precision_sum", "matmul-bf16": "matmul_bf16_inputs",
             "silu-backward": "wrong_backward:op=silu_backward",
             "scaled-mm-wrong-axis": "scaled_mm_wrong_axis"}


def backend(name: str) -> Any:
    """The simulated faulty backend ``--simulate NAME`` runs on, for checking the audits and the
    drill-down end to end."""
    makers = {"views-become-copies": views_become_copies, "drop-view-writes": drop_view_writes,
              "skip-bn-stats": skip_batchnorm_stat_updates}
    if name in OP_FAULTS:
        return _OpFaultBackend(OP_FAULTS[name])
    if name not in makers:
        raise DriftcheckError(f"unknown --simulate {name!r}: choose one of "
                              f"{', '.join(list(makers) + list(OP_FAULTS))}")
    return makers[name]()

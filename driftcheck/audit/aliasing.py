"""Aliasing: what an op writes and what a tensor aliases, read off the op's schema and the
tensors' storages; the view audit's (audit/views.py) eyes on a run. Also which allocations hand
out uninitialised memory (``EMPTY``): a base made by one and filled a view at a time holds, before
each write, whatever the memory held, different in every run."""
from __future__ import annotations

import functools
from typing import Any

import torch

# Allocations whose memory is not initialised (the overload packets' names)
EMPTY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


@functools.cache
def allocates_uninitialised(func: Any) -> bool:
    """Whether ``func`` hands out memory it leaves uninitialised (``EMPTY``), once per op."""
    return func.overloadpacket.__name__ in EMPTY


# Aliases autograd makes for itself (saving tensors for backward, .detach() in hooks): which
# tensors get saved depends on the dtype path (a bf16 run casts where an fp32 run does not), so
# they say nothing about the backend's view semantics.
AUTOGRAD_ALIASES = frozenset({"detach", "alias", "lift_fresh"})


@functools.cache
def op_kind(func: Any) -> str | None:
    """"view", "inplace", "out" or None, from the op's schema alias annotations."""
    schema = func._schema
    if schema.name.split("::")[-1] in AUTOGRAD_ALIASES:
        return None
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if writes:
        return "out" if any(a.kwarg_only for a in writes) else "inplace"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return None


def written(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, torch.Tensor):
            out.append((arg.name, value))
        elif isinstance(value, (list, tuple)):  # _foreach_*_: one event per list element
            out.extend((f"{arg.name}.{j}", v) for j, v in enumerate(value)
                       if isinstance(v, torch.Tensor))
    return out


def strided(t: Any) -> bool:
    # Sparse, nested and meta tensors have no storage/strides to compare: not audited.
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a write to ``t`` must reach: its autograd base, else its whole storage."""
    if t._is_view() and t._base is not None:
        return t._base
    if t.numel() == 0 or t.is_quantized:
        return None
    itemsize = t.element_size()
    whole = t.untyped_storage().nbytes() // itemsize
    if t.storage_offset() == 0 and t.numel() == whole and t.is_contiguous():
        return None  # not a view of anything: it is all of its storage
    # ``.data`` of a view, ``set_``: a partial window on a storage with no autograd base.
    return t.new_empty(0).set_(t.untyped_storage(), 0, (whole,), (1,))


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, functional)
        return False


def layout(t: torch.Tensor) -> dict[str, Any]:
    return {"sizes": list(t.shape), "strides": list(t.stride()), "storage_offset": int(t.storage_offset())}

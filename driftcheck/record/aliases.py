"""The alias structure of a model's parameters and buffers: which of them are one tensor (tied
weights, a buffer registered twice) or share storage (a parameter or buffer that is a view of
another), as the model is on its run's device.

Taken where the tracer sees the model, after it was moved: moving a module to a backend without a
compatible shallow-copy type (PyTorch's lazy tensors, torch_xla, PrivateUse1 backends) replaces
its parameters, and tied weights come apart there. Identity and ``_base`` (a view's base) work on
every backend; storage is compared only where a tensor has a real one (a lazy tensor's
``data_ptr()`` is 0 and its storage raises), and only for same-storage tests."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _root(t: torch.Tensor) -> torch.Tensor:
    while t._base is not None:  # a view's base, up to the tensor that owns the memory
        t = t._base
    return t


def _storage(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, address of the storage) where ``t`` has a real storage, else None."""
    if type(t) not in (torch.Tensor, nn.Parameter, nn.parameter.Buffer):  # DTensor, subclasses
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return None if ptr == 0 else (str(t.device), ptr)


def alias_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The parameters and buffers (dotted names, ``named_parameters``/``named_buffers`` order,
    parameters first) that share memory: ``{"tensors": [...], "how": "tied"}`` for names that
    are one tensor (tied weights, a buffer registered twice), ``"storage"`` for two or more
    distinct tensors that are views of one another or share a storage (a name can be in one group
    of each kind). An empty list where nothing is shared."""
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *((n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None)]
    parent = list(range(len(named)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen: dict[Any, int] = {}
    for i, (_, t) in enumerate(named):
        for key in (("id", id(t)), ("root", id(_root(t))), ("storage", _storage(t))):
            if key[1] is None:
                continue
            if key in seen:
                parent[find(i)] = find(seen[key])
            else:
                seen[key] = i
    tied: dict[int, list[str]] = {}
    storage: dict[int, list[int]] = {}
    for i, (name, t) in enumerate(named):
        tied.setdefault(id(t), []).append(name)
        storage.setdefault(find(i), []).append(i)
    out = [{"tensors": names, "how": "tied"} for names in tied.values() if len(names) > 1]
    out += [{"tensors": [named[i][0] for i in idxs], "how": "storage"} for idxs in storage.values()
            if len({id(named[i][1]) for i in idxs}) > 1]
    return out

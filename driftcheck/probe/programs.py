"""What the probe programs share: their registration and helpers (views.py and inplace.py hold them)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Program = Callable[[torch.device], dict[str, Any]]

# Results that are facts about memory (storage identity, strides, offsets), not values: a backend
# whose tensors have no inspectable storage (lazy, functionalizing) cannot be held to them.
MEMORY_FACTS = frozenset({"v_is_view", "shares", "aliases_new", "views", "strides", "offset",
                          "contiguous"})


# ---------------------------------------------------------------------------------------------
# Helpers the programs share. Inputs are made on CPU (the TPU RNG does not reproduce CPU streams)
# and are small integers, so every correct backend computes them exactly.


def registrar(table: dict[str, Program]) -> Callable[[Program], Program]:
    """A decorator that adds each program to ``table`` under its name, in definition order."""
    def program(fn: Program) -> Program:
        table[fn.__name__] = fn
        return fn
    return program


def x_(dev: torch.device, *shape: int) -> torch.Tensor:
    """arange(numel) reshaped, as its own (non-view) tensor on ``dev``."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).clone().to(dev)


def out(**values: Any) -> dict[str, Any]:
    return {k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
            for k, v in values.items()}


def shares(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether a and b share storage; None where storage cannot be inspected (lazy tensors)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def raises(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except RuntimeError:
        return True
    return False


def write_through(dev: torch.device, make_view: Callable[[torch.Tensor], torch.Tensor],
                   write: Callable[[torch.Tensor], Any], *shape: int) -> dict[str, Any]:
    """Make a view of a fresh base, write through it; the base must see the write."""
    x = x_(dev, *shape)
    before = x.clone()
    v = make_view(x)
    write(v)
    return out(x=x, v=v, v_is_view=shares(v, x), base_changed=not torch.equal(x, before),
                strides=tuple(v.stride()), offset=v.storage_offset())

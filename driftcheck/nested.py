"""The one walker over nested structures of tensors (args, kwargs, outputs, batches).

``flatten`` names every tensor by its path (``input.0``, ``output.logits``,
``output.past_key_values.0.keys``): the slot grammar of a trace. ``substitute`` rebuilds a
structure with each tensor replaced, naming them the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) for every tensor inside nested tuples/lists/dicts/ModelOutputs."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict) or _is_model_output(obj):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}.{i}")
    elif hasattr(obj, "to_legacy_cache") or (hasattr(obj, "layers") and hasattr(obj, "get_seq_length")):
        # Hugging Face Cache objects: keys/values per layer.
        layers = getattr(obj, "layers", None)
        if isinstance(layers, (list, tuple)):
            for i, layer in enumerate(layers):
                for name in ("keys", "values"):
                    v = getattr(layer, name, None)
                    if isinstance(v, torch.Tensor):
                        yield f"{prefix}.{i}.{name}", v


def _is_model_output(obj: Any) -> bool:
    # transformers.utils.ModelOutput is an OrderedDict subclass; stay import-free.
    return hasattr(obj, "to_tuple") and hasattr(obj, "items")


def substitute(obj: Any, prefix: str, fn: Callable[[str, torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(slot, tensor)``; slots as ``flatten``
    names them (``input.0``, ``input.x``, ``output.1.2``)."""
    if isinstance(obj, torch.Tensor):
        return fn(prefix, obj)
    if isinstance(obj, dict):
        return {k: substitute(v, f"{prefix}.{k}", fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(substitute(v, f"{prefix}.{i}", fn) for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [substitute(v, f"{prefix}.{i}", fn) for i, v in enumerate(obj)]
    return obj

"""The one walker over nested structures of tensors (args, kwargs, outputs, batches, op arguments).

A structure is a tree: its nodes are mappings (dicts and Hugging Face ``ModelOutput``), sequences
(tuples and lists, namedtuples included) and Hugging Face ``Cache`` objects (keys and values per
layer); everything else is a leaf (a tensor, a number, None, any other object). :func:`kind` and
:func:`items` are the whole definition; :func:`fold` walks it, naming every node by its path.
``flatten`` names every tensor by that path (``input.0``, ``output.logits``,
``output.past_key_values.0.keys``): the slot grammar of a trace. ``substitute`` rebuilds a
structure with each tensor replaced, naming them the same way. The replay file's batch codec
(``store/replay.py``), the op log (``drill/oplog.py``) and the view audit (``audit/views.py``)
fold with it too.

Not ``torch.utils._pytree``: pytree knows registered types only (a subclass of dict or tuple
that nobody registered is a leaf to it, its tensors gone from the trace), names a namedtuple's
children by field where slots number them, and Hugging Face registers its Cache classes there
itself for ``torch.export`` (all keys, then all values) when a user exports: the slots would
change with what the user's process did before. Duck typing keeps transformers unimported.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")
Children = Callable[[], list[tuple[Any, T]]]

TENSOR, MAPPING, SEQUENCE, CACHE, LEAF = "tensor", "mapping", "sequence", "cache", "leaf"
# Leaves by exact type, decided without looking for ModelOutput's or Cache's attributes.
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})


def kind(obj: Any) -> str:
    """What ``obj`` is in a structure: tensor, mapping, sequence, cache or leaf."""
    if isinstance(obj, torch.Tensor):
        return TENSOR
    t = type(obj)
    if t in _PLAIN:
        return LEAF
    if t is tuple or t is list:  # the common nodes, before looking for attributes
        return SEQUENCE
    if isinstance(obj, dict) or _is_model_output(obj):
        return MAPPING
    if isinstance(obj, (tuple, list)):
        return SEQUENCE
    if hasattr(obj, "to_legacy_cache") or (hasattr(obj, "layers") and hasattr(obj, "get_seq_length")):
        return CACHE
    return LEAF


def _is_model_output(obj: Any) -> bool:
    # transformers.utils.ModelOutput is an OrderedDict subclass; stay import-free.
    return hasattr(obj, "to_tuple") and hasattr(obj, "items")


def items(obj: Any, of_kind: str | None = None) -> list[tuple[Any, Any]]:
    """``(key, child)`` of a node in order; a child's path is ``<path>.<key>``. A mapping's keys
    are its own, a sequence's its indices, a Cache's ``<layer>.keys`` / ``<layer>.values`` (the
    tensors it holds); a leaf has none."""
    k = kind(obj) if of_kind is None else of_kind
    if k is SEQUENCE:
        return list(enumerate(obj))
    if k is MAPPING:
        return list(obj.items())
    if k is CACHE:
        return _cache_items(obj)
    return []


def _cache_items(cache: Any) -> list[tuple[Any, Any]]:
    # Hugging Face Cache objects: keys/values per layer (a layer not yet filled holds None).
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        return []
    found: list[tuple[Any, Any]] = []
    for i, layer in enumerate(layers):
        for name in ("keys", "values"):
            v = getattr(layer, name, None)
            if isinstance(v, torch.Tensor):
                found.append((f"{i}.{name}", v))
    return found


def _none() -> list[tuple[Any, Any]]:
    return []


def fold(obj: Any, path: str, fn: Callable[[str, Any, str, Children[T]], T]) -> T:
    """``fn(path, obj, kind, children)`` for ``obj``: ``children()`` folds its children
    (``[(key, result)]``, in order, each at ``<path>.<key>``) when ``fn`` calls it, so ``fn`` may
    refuse a node before descending, or keep it whole."""
    k = kind(obj)
    if k is TENSOR or k is LEAF:
        return fn(path, obj, k, _none)

    def children() -> list[tuple[Any, T]]:
        return [(key, fold(child, f"{path}.{key}", fn)) for key, child in items(obj, k)]
    return fn(path, obj, k, children)


def _tensors(path: str, obj: Any, k: str, children: Children[list[tuple[str, torch.Tensor]]]
             ) -> list[tuple[str, torch.Tensor]]:
    if k is TENSOR:
        return [(path, obj)]
    found: list[tuple[str, torch.Tensor]] = []
    for _, sub in children():
        found.extend(sub)
    return found


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) for every tensor inside nested tuples/lists/dicts/ModelOutputs/Caches."""
    yield from fold(obj, prefix, _tensors)


def substitute(obj: Any, prefix: str, fn: Callable[[str, torch.Tensor], Any],
               other: Callable[[Any, str], Any] | None = None) -> Any:
    """``obj`` with every tensor replaced by ``fn(slot, tensor)``; slots as ``flatten``
    names them (``input.0``, ``input.x``, ``output.1.2``).

    Dicts (a ModelOutput too), tuples (a namedtuple too) and lists are rebuilt as plain dicts,
    tuples and lists. A Cache is kept as it is, its tensors not replaced: it is live state the
    model's modules update in place, and a copy would be one the model does not hold. With
    ``other``, a Cache or a leaf is replaced by ``other(node, kind)`` instead.
    """
    def rebuild(path: str, o: Any, k: str, children: Children[Any]) -> Any:
        if k == TENSOR:
            return fn(path, o)
        if other is not None and k in (CACHE, LEAF):
            return other(o, k)
        if k == MAPPING and isinstance(o, dict):
            return dict(children())
        if k == SEQUENCE:
            rebuilt = (v for _, v in children())
            return tuple(rebuilt) if isinstance(o, tuple) else list(rebuilt)
        return o
    return fold(obj, prefix, rebuild)

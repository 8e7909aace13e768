"""Regrouped gradient sums: where a compiled trace's input-gradient taps change how autograd adds
up a gradient (record/taps.py asks while Dynamo traces; the finding compile.regrouped_gradients).
Reads Dynamo's FX graph only; no state."""
from __future__ import annotations

from typing import Any

import torch


def regrouping(graph: Any) -> set[str]:
    """The modules of ``graph`` (Dynamo's FX graph, with the taps) whose input view changes
    how autograd adds up a gradient: the module uses the view twice or more (its gradients are
    added first, then handed on as one) and the input is used outside it too. Untraced, all of
    the input's gradients are added in the order they arrive: floating-point addition is not
    associative, so the sums upstream may differ in their last bits (docs/compile.md)."""
    hook = getattr(torch.ops.higher_order, "register_hook", None)
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hook or len(node.args) < 3:
            continue
        view = node.args[0]  # then the hook's body, its free values (sizes where dynamic), the tap
        call = next((a for a in node.args[2:] if _is_tap(a)), None)
        if getattr(view, "target", None) != "view_as" or view.args[0] is not view.args[1] \
                or call is None:
            continue
        if _uses(node) >= 2 and _uses(view.args[0], skip=view) >= 1:
            found.add(str(call.args[2]))  # tap(tensors, tracer, module, where, slots)
    return found


_NO_GRAD = frozenset({"detach", "size", "dim", "numel", "stride", "new_zeros", "new_ones",
                      "new_empty", "new_full", "new_tensor"})
_LIKE = frozenset({"type_as", "view_as", "expand_as", "reshape_as"})  # the other's shape or dtype
_NO_GRAD_FNS = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
                torch.rand_like, torch.randn_like)
_MAYBE_SELF = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous"})


def _uses(node: Any, skip: Any = None, depth: int = 0) -> int:
    """How many gradients autograd adds up for ``node``'s value: its users, less the taps and
    what takes no gradient, through ops that return the tensor itself (``x.float()`` of a
    float32 ``x``) and hooks on it."""
    n = 0
    for u in node.users:
        if u is skip or _is_tap(u) or (u.op == "call_method" and (
                u.target in _NO_GRAD or (u.target in _LIKE and u.args[0] is not node))) \
                or (u.op == "call_function" and u.target in _NO_GRAD_FNS):
            continue  # a tap, or what takes no gradient (``y.type_as(x)``: x's dtype only)
        if u.op == "call_method" and u.target == "view_as" and u.args[0] is node \
                and u.args[1] is node:  # another module's input view: a use where it has one
            n += _uses(u, depth=depth + 1) > 0 if depth < 8 else 1
            continue
        same = u.op == "call_method" and u.target in _MAYBE_SELF and _same(node, u)
        through = same or (u.op == "call_function" and u.args and u.args[0] is node
                           and u.target is getattr(torch.ops.higher_order, "register_hook", None))
        n += _uses(u, depth=depth + 1) if through and depth < 8 else 1
    return n


def _is_tap(node: Any) -> bool:
    return getattr(node, "target", None) in (torch.ops.driftcheck.tap, torch.ops.driftcheck.tap.default)


def _same(a: Any, b: Any) -> bool:
    """Whether ``b``'s value is ``a``'s tensor itself (same dtype, shape and strides)."""
    x, y = a.meta.get("example_value"), b.meta.get("example_value")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    # compared as text: symbolic sizes (dynamic shapes) compared as values would add guards
    return x.dtype == y.dtype and str(tuple(x.shape)) == str(tuple(y.shape)) \
        and str(x.stride()) == str(y.stride())

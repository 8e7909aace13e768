"""Regrouped gradient sums: where a compiled trace's input-gradient taps change how autograd adds
up a gradient (record/taps.py asks while Dynamo traces; the finding compile.regrouped_gradients).
Reads Dynamo's FX graph only; no state."""
from __future__ import annotations

from typing import Any

import torch


def regrouping(graph: Any) -> set[str]:
    """The modules of ``graph`` (Dynamo's FX graph, with the taps) whose input view changes
    how autograd adds up a gradient: two or more of the tensor's gradients come through the view
    (the module's own uses, and those inside modules it hands the input on to: added first,
    then handed on as one), and others do not (uses outside it). Untraced, all of the tensor's
    gradients are added in the order they arrive: floating-point addition is not associative,
    so the sums upstream may differ in their last bits (docs/compile.md)."""
    hook = _hook()
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hook or len(node.args) < 3:
            continue
        view = node.args[0]  # then the hook's body, its free values (sizes where dynamic), the tap
        call = next((a for a in node.args[2:] if _is_tap(a)), None)
        if getattr(view, "target", None) != "view_as" or view.args[0] is not view.args[1] \
                or call is None:
            continue
        inside = _uses(node)
        if inside >= 2 and _uses(_viewed(view.args[0])) > inside:
            found.add(str(call.args[2]))  # tap(tensors, tracer, module, where, slots)
    return found


_NO_GRAD = frozenset({"detach", "size", "dim", "numel", "stride", "new_zeros", "new_ones",
                      "new_empty", "new_full", "new_tensor"})
_LIKE = frozenset({"type_as", "view_as", "expand_as", "reshape_as"})  # the other's shape or dtype
_NO_GRAD_FNS = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
                torch.rand_like, torch.randn_like)
_MAYBE_SELF = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous"})


def _hook() -> Any:
    return getattr(torch.ops.higher_order, "register_hook", None)


def _viewed(node: Any) -> Any:
    """The tensor under hooks and input views of ours (``view_as(x, x)``, hooked)."""
    for _ in range(64):
        if node.op == "call_function" and node.target is _hook() and node.args:
            node = node.args[0]
        elif node.op == "call_method" and node.target == "view_as" and node.args[0] is node.args[1]:
            node = node.args[0]
        else:
            break
    return node


def _uses(node: Any, depth: int = 0) -> int:
    """How many gradients autograd adds up for ``node``'s value: its users, less the taps and
    what takes no gradient, through ops that return the tensor itself (``x.float()`` of a
    float32 ``x``), hooks on it and the input views of ours other modules are handed (their
    uses counted)."""
    n = 0
    for u in node.users:
        if _is_tap(u) or (u.op == "call_method" and (
                u.target in _NO_GRAD or (u.target in _LIKE and u.args[0] is not node))) \
                or (u.op == "call_function" and u.target in _NO_GRAD_FNS):
            continue  # a tap, or what takes no gradient (``y.type_as(x)``: x's dtype only)
        ours = u.op == "call_method" and u.target == "view_as" and u.args[0] is node \
            and u.args[1] is node  # another module's input view: its uses are node's
        same = u.op == "call_method" and u.target in _MAYBE_SELF and _same(node, u)
        through = ours or same or (u.op == "call_function" and u.args and u.args[0] is node
                                   and u.target is _hook())
        n += _uses(u, depth + 1) if through and depth < 32 else 1
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

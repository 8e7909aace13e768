"""The backward half of a module call: the gradient of each output (a tensor hook) and of each
input, read off the autograd edges that leave the module's own subgraph (methods of the Tracer).

Nodes created during the call are found by sequence number; the edges from them into the
inputs' nodes get node post-hooks, so a captured input gradient is this module's contribution
alone, and in-place ops inside the module are fine. A child call's subgraph is not walked again:
its exits (recorded by its own walk) stand for it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from driftcheck.record.meta import backward_meta, floating
from driftcheck.record.watch import own_work


class BackwardHooks:
    """The autograd half of :class:`driftcheck.record.tracer.Tracer` (its state lives there)."""

    def _hook_backward(self, name: str, call: int, outputs: list[tuple[str, torch.Tensor]],
                       ctx: dict[str, Any], made_by: dict[str, str] | None = None) -> None:
        bctx = backward_meta(ctx)
        tapped = self._tapped_out.pop((name, call), ())
        if tapped:  # hooked in the graph by the module's forward_tap (record/taps.py)
            self._tap_ctx[(name, call)] = bctx
        for slot, t in (outputs if name or self.root_output_grads else ()):
            if slot in tapped:
                continue
            gslot = "grad_" + slot
            gctx = dict(bctx, made_by=made_by[slot]) if made_by and slot in made_by else bctx
            if self.compiled and compiled_output(t):
                # This hook runs around the compiled code that made ``t`` (the module's forward
                # compiled as a frame of its own): a hook here would see only the gradient that
                # reaches ``t`` from outside that code, not the share of any use inside it, a
                # false failure against an eager reference. Its gradient comes from the graph
                # where a forward_tap there hooked the same tensor; otherwise it is left out and
                # compare reports a compile.capture_gap, not judged (docs/compile.md).
                self._alias_grad(name, call, gslot, t, gctx)
                continue
            if t.requires_grad and floating(t) and t.grad_fn is not None:
                hook = own_work(self._make_grad_output_hook(name, call, gslot, gctx))
                t.register_hook(hook)
                if whole_base_node(t) is not None:
                    # An in-place op on a view (ReLU(inplace=True) after an N-d Linear) rebases
                    # it onto its base, and the view's own hook never fires: the base's does
                    # (the same gradient, reshaped; the first capture of a key wins).
                    t._base.register_hook(lambda g, hook=hook, shape=t.shape: hook(g.reshape(shape)))
        inputs = self._call_inputs.pop((name, call), None)
        start = self._start_seq.pop((name, call), None)
        if not inputs or start is None:
            return
        # Targets: the autograd node (and output index) of each input tensor, and of the base
        # of an input that is a whole view of it (where an in-place op inside the call leads).
        targets: dict[tuple[int, int], str] = {}
        shapes: dict[str, torch.Size] = {}
        for slot, t, node, nr, base in inputs:
            if node is not None:
                targets[(id(node), nr)] = slot
            if base is not None:
                targets.setdefault((id(base[0]), base[1]), slot)
            shapes[slot] = t.shape
        leaf_targets = {id(t): slot for slot, t, node, _, _ in inputs if node is None}
        # Walk the nodes created during this call; collect edges into the inputs' nodes. A
        # child call's subgraph is not walked again: from its single output node, its exits
        # (the edges leaving its subgraph, recorded by its own walk) stand for it.
        edges: dict[str, list[tuple[Any, int]]] = {}
        edge_seen: set[tuple[int, int]] = set()
        walked: list[tuple[Any, int, Any, int]] = []  # every edge looked at: exits are among them
        expanded: set[int] = set()
        seen: set[int] = set()
        roots = [t.grad_fn for _, t in outputs if t.requires_grad and t.grad_fn is not None]
        stack = list(roots)

        def follow(src: Any, i: int, nxt: Any, nr: int) -> None:
            walked.append((src, i, nxt, nr))
            slot = targets.get((id(nxt), nr))
            if slot is None and leaf_targets and type(nxt).__name__ == "AccumulateGrad":
                slot = leaf_targets.get(id(getattr(nxt, "variable", None)))
            if slot is None:
                stack.append(nxt)
            elif (id(src), i) not in edge_seen:  # reached twice (a child's exits and a walk)
                edge_seen.add((id(src), i))
                edges.setdefault(slot, []).append((src, i))

        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            child = self._exits.get(id(node))
            if child is not None and child[0] >= start:
                for edge in child[2]:
                    follow(*edge)
                continue
            seq = node._sequence_nr()
            if seq < start or seq == 2**64 - 1:
                continue
            expanded.add(id(node))
            for i, (nxt, nr) in enumerate(node.next_functions):
                if nxt is not None:
                    follow(node, i, nxt, nr)
        # For the enclosing calls' walks: only a single output node made by this call (an
        # Identity's output node is its input's, made before the call: not this call's to stand for).
        if len({id(r) for r in roots}) == 1 and id(roots[0]) in expanded:
            self._exits[id(roots[0])] = (start, roots[0], [
                e for e in walked if id(e[2]) not in expanded])
        for slot, edge_list in edges.items():
            acc = _GradAccumulator(self, name, call, "grad_" + slot, len(edge_list), bctx,
                                   shapes.get(slot))
            by_node: dict[int, list[int]] = {}
            nodes: dict[int, Any] = {}
            for node, i in edge_list:
                by_node.setdefault(id(node), []).append(i)
                nodes[id(node)] = node
            for nid, idxs in by_node.items():
                self._node_handles.append(nodes[nid].register_hook(own_work(acc.node_hook(idxs))))

    def _make_grad_output_hook(self, name: str, call: int, slot: str,
                               ctx: dict[str, Any]) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self._active and grad is not None:
                self._capture(name, "backward", call, slot, grad, extra=ctx)
        return hook

    def _next_sequence_nr(self) -> int:
        """The sequence number the next autograd node created on this thread will get."""
        peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
        if peek is not None:
            return peek()
        with self._quiet():  # a torch without the peek: make a node and read its number
            probe = torch.zeros((), requires_grad=True) * 1.0
        return probe.grad_fn._sequence_nr() + 1


class _GradAccumulator:
    """Sums the gradient reaching one module input over all edges leaving the module."""

    def __init__(self, tracer: Any, name: str, call: int, slot: str, n_edges: int,
                 ctx: dict[str, Any], shape: torch.Size | None = None) -> None:
        self.tracer, self.name, self.call, self.slot = tracer, name, call, slot
        self.remaining = n_edges
        self.total: torch.Tensor | None = None
        self.ctx = ctx
        self.shape = shape  # the input's: an edge into its base carries the base's shape

    def node_hook(self, idxs: list[int]) -> Callable:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            for i in idxs:
                g = grad_inputs[i] if i < len(grad_inputs) else None
                if g is not None:
                    g = g.detach()
                    if self.shape is not None and g.shape != self.shape \
                            and g.numel() == math.prod(self.shape):
                        g = g.reshape(self.shape)
                    if self.remaining == 1 and self.total is None:
                        # The only edge: captured now, as any hooked tensor is (stats mode
                        # summarises a large one in place; the capture copies what it keeps).
                        self.remaining = 0
                        if self.tracer._active:
                            self.tracer._capture(self.name, "backward", self.call, self.slot, g,
                                                 extra=self.ctx)
                        continue
                    self.total = g.clone() if self.total is None else self.total + g
                self.remaining -= 1
            if self.remaining == 0 and self.total is not None and self.tracer._active:
                self.tracer._capture(self.name, "backward", self.call, self.slot, self.total,
                                     extra=self.ctx, copy=False)
        return hook


def whole_base_node(t: torch.Tensor) -> tuple[Any, int] | None:
    """(grad_fn, output_nr) of the base of ``t`` when ``t`` is a view of all of it, in order
    (an N-d Linear's output: a view of its matmul's), else None."""
    if not t._is_view():
        return None
    base = t._base
    if base is None or base.grad_fn is None or base.numel() != t.numel() \
            or not (t.is_contiguous() and base.is_contiguous()) \
            or t.storage_offset() != base.storage_offset():
        return None
    return base.grad_fn, base.output_nr


def compiled_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output of a compiled region (its autograd node is AOT autograd's
    ``CompiledFunctionBackward``), or a view of one."""
    for x in (t, t._base if t._is_view() else None):
        node = getattr(x, "grad_fn", None)
        if node is not None and type(node).__name__ == "CompiledFunctionBackward":
            return True
    return False

"""The backward half of a module call: the gradient of each output (a tensor hook) and of each
input, read off the autograd edges that leave the module's own subgraph (``BackwardHooks``).

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

from driftcheck.record.calls import CallKey, Calls
from driftcheck.record.capture import Capture
from driftcheck.record.meta import backward_meta, floating
from driftcheck.record.tapping import TapGradients
from driftcheck.record.watch import own_work

Pairs = list[tuple[str, torch.Tensor]]  # (slot, tensor) of a call's inputs or outputs
Edge = tuple[Any, int, Any, int]  # (node, its next_functions index, the next node, its output nr)
GradInput = tuple[str, torch.Tensor, Any, int, "tuple[Any, int] | None"]  # slot, t, node, nr, base


class BackwardHooks:
    """The backward of each module call: its output gradients (tensor hooks) and input
    gradients (node hooks on the edges that leave its subgraph), taken into ``capture``.

    Args:
        capture: where the gradients go. calls: whether hooks are live.
        tap_grads: the gradients of calls inside a compiled graph (record/tapping.py).
        compiled: the model runs compiled code. root_output_grads: capture the gradients of
            the model's own outputs.
    """

    def __init__(self, capture: Capture, calls: Calls, tap_grads: TapGradients, *,
                 compiled: bool, root_output_grads: bool) -> None:
        self.capture = capture
        self.calls = calls
        self.tap_grads = tap_grads
        self.compiled = compiled
        self.root_output_grads = root_output_grads
        self.node_handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self._call_inputs: dict[CallKey, list[GradInput]] = {}
        self._start_seq: dict[CallKey, int] = {}
        self._span_start: dict[CallKey, int] = {}  # a call's first sequence number
        self._spans: list[tuple[int, int, str]] = []  # (first, end, "<module>#<call>"), post-order
        # id(output node) -> (start sequence number, the node, exit edges) of this step's calls
        self._exits: dict[int, tuple[int, Any, list[Edge]]] = {}

    def remove_node_hooks(self) -> None:
        for h in self.node_handles:
            h.remove()
        self.node_handles.clear()

    def spanning(self, key: CallKey) -> bool:
        """Whether call ``key`` was opened by an eager pre-hook with its autograd span."""
        return key in self._span_start

    def open(self, key: CallKey, inputs: Pairs) -> None:
        """A call begins: where its autograd nodes start, and its inputs' nodes (an in-place
        op inside the module, ReLU(inplace=True), replaces a tensor's grad_fn during the call)."""
        self._span_start[key] = self.next_sequence_nr()
        grad_inputs = [(s, t, t.grad_fn, t.output_nr, whole_base_node(t)) for s, t in inputs
                       if t.requires_grad and floating(t)]
        if grad_inputs:
            self._call_inputs[key] = grad_inputs
            # Nodes created from here on belong to this call: mark the sequence number.
            self._start_seq[key] = self.next_sequence_nr()

    def hook(self, name: str, call: int, outputs: Pairs, ctx: dict[str, Any],
             made_by: dict[str, str] | None = None) -> None:
        """A call ends: hook its output gradients and the edges of its input gradients."""
        bctx = backward_meta(ctx)
        self._hook_outputs(name, call, outputs, bctx, made_by)
        inputs = self._call_inputs.pop((name, call), None)
        start = self._start_seq.pop((name, call), None)
        if not inputs or start is None:
            return
        edges = self._walk(inputs, outputs, start)
        for slot, edge_list in edges.items():
            acc = _GradAccumulator(self.capture, self.calls, name, call, "grad_" + slot,
                                   len(edge_list), bctx, _shape(inputs, slot))
            by_node: dict[int, list[int]] = {}
            nodes: dict[int, Any] = {}
            for node, i in edge_list:
                by_node.setdefault(id(node), []).append(i)
                nodes[id(node)] = node
            for nid, idxs in by_node.items():
                self.node_handles.append(nodes[nid].register_hook(own_work(acc.node_hook(idxs))))

    def _hook_outputs(self, name: str, call: int, outputs: Pairs, bctx: dict[str, Any],
                      made_by: dict[str, str] | None) -> None:
        tapped = self.tap_grads.claim(name, call, bctx)
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
                self.tap_grads.alias(name, call, gslot, t, gctx)
                continue
            if t.requires_grad and floating(t) and t.grad_fn is not None:
                hook = own_work(self._grad_output_hook(name, call, gslot, gctx))
                t.register_hook(hook)
                base = t._base if whole_base_node(t) is not None else None
                if base is not None:
                    # An in-place op on a view (ReLU(inplace=True) after an N-d Linear) rebases
                    # it onto its base, and the view's own hook never fires: the base's does
                    # (the same gradient, reshaped; the first capture of a key wins).
                    base.register_hook(lambda g, hook=hook, shape=t.shape: hook(g.reshape(shape)))

    def _walk(self, inputs: list[GradInput], outputs: Pairs, start: int
              ) -> dict[str, list[tuple[Any, int]]]:
        """slot -> the edges (node, index) from this call's nodes into that input's node."""
        # Targets: the autograd node (and output index) of each input tensor, and of the base
        # of an input that is a whole view of it (where an in-place op inside the call leads).
        targets: dict[tuple[int, int], str] = {}
        for slot, _t, node, nr, base in inputs:
            if node is not None:
                targets[(id(node), nr)] = slot
            if base is not None:
                targets.setdefault((id(base[0]), base[1]), slot)
        leaf_targets = {id(t): slot for slot, t, node, _, _ in inputs if node is None}
        # Walk the nodes created during this call; collect edges into the inputs' nodes. A
        # child call's subgraph is not walked again: from its single output node, its exits
        # (the edges leaving its subgraph, recorded by its own walk) stand for it.
        edges: dict[str, list[tuple[Any, int]]] = {}
        edge_seen: set[tuple[int, int]] = set()
        walked: list[Edge] = []  # every edge looked at: exits are among them
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
        return edges

    def _grad_output_hook(self, name: str, call: int, slot: str,
                          ctx: dict[str, Any]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.calls.active and grad is not None:
                self.capture(name, "backward", call, slot, grad, extra=ctx)
        return hook

    def made_by(self, name: str, call: int, outputs: Pairs) -> dict[str, str]:
        """Outputs of this call that a descendant's own code made (a key/value cache tensor an
        attention module built and the model returns): slot -> "<module>#<call>" of the
        innermost call whose autograd nodes include the tensor's. Its gradient is computed
        inside that call's backward, not by the code that consumes this call's output."""
        start = self._span_start.pop((name, call), None)
        if start is None:
            return {}
        end = self.next_sequence_nr()
        made: dict[str, str] = {}
        for slot, t in outputs:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            seq = node._sequence_nr() if node is not None else -1
            if not start <= seq < end:
                continue
            best = None
            for s, e, who in reversed(self._spans):  # the calls that ran inside this one
                if s < start:
                    break
                if s <= seq < e and (best is None or s > best[0]):
                    best = (s, who)
            if best is not None:
                made[slot] = best[1]
        self._spans.append((start, end, f"{name}#{call}"))
        return made

    def next_sequence_nr(self) -> int:
        """The sequence number the next autograd node created on this thread will get."""
        peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
        if peek is not None:
            return int(peek())
        with self.capture.quiet():  # a torch without the peek: make a node and read its number
            probe = torch.zeros((), requires_grad=True) * 1.0
        assert probe.grad_fn is not None
        return int(probe.grad_fn._sequence_nr()) + 1


def _shape(inputs: list[GradInput], slot: str) -> torch.Size | None:
    """The shape of the input at ``slot`` (the last of that slot, as a dict would keep)."""
    shape = None
    for s, t, _, _, _ in inputs:
        if s == slot:
            shape = t.shape
    return shape


class _GradAccumulator:
    """Sums the gradient reaching one module input over all edges leaving the module."""

    def __init__(self, capture: Capture, calls: Calls, name: str, call: int, slot: str,
                 n_edges: int, ctx: dict[str, Any], shape: torch.Size | None = None) -> None:
        self.capture, self.calls = capture, calls
        self.name, self.call, self.slot = name, call, slot
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
                        if self.calls.active:
                            self.capture(self.name, "backward", self.call, self.slot, g,
                                         extra=self.ctx)
                        continue
                    if self.total is None:
                        self.total = g.clone()
                    elif g.shape == self.total.shape and g.dtype == self.total.dtype:
                        self.total.add_(g)  # our own copy, summed in place: no new tensor an edge
                    else:
                        self.total = self.total + g
                self.remaining -= 1
            if self.remaining == 0 and self.total is not None and self.calls.active:
                self.capture(self.name, "backward", self.call, self.slot, self.total,
                             extra=self.ctx, copy=False)
                self.total = None  # the capture's now: a second backward through the graph adds to no copy of ours
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

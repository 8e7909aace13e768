"""The dependency index: structural lookups on the reference's entries (who depends on whom).

An entry's floor inherits the error of the entries it depends on (floor.py); this is where
"depends on" is decided: a module's forward output on its inputs, its children's outputs and
its parameters; a gradient on the gradients that reached it and the forward tensors it was
made from; the optimizer state on the parameter, its gradient and the previous state.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from driftcheck.compare.entries import TraceEntry, identical
from driftcheck.store.keys import Slot, TraceKey

Entries = list[TraceEntry]


class Call(NamedTuple):
    """One call of a module within a step: what a forward or backward entry belongs to."""

    step: int
    module: str
    call: int


def call_of(step: int, ref: str) -> Call:
    """A call named in an entry's meta (``parent``, ``made_by``: ``"<module>#<call>"``)."""
    module, _, call = ref.rpartition("#")
    return Call(step, module, int(call))


class DependencyIndex:
    """Structural lookups on the reference's entries (who depends on whom)."""

    def __init__(self, entries: Entries, tied: list[dict[str, str]] | None = None) -> None:
        self.fwd_in: dict[Call, Entries] = defaultdict(list)
        self.fwd_out: dict[Call, Entries] = defaultdict(list)
        self.gout: dict[Call, Entries] = defaultdict(list)
        self.gin: dict[Call, Entries] = defaultdict(list)
        self.children: dict[Call, list[tuple[str, int]]] = defaultdict(list)
        self.params: dict[tuple[int, str], Entries] = defaultdict(list)
        self.calls: dict[tuple[int, str], set[int]] = defaultdict(set)
        self.by_align: dict[TraceKey, TraceEntry] = {}
        self.loss: dict[int, Entries] = defaultdict(list)
        self.top_outputs: dict[int, Entries] = defaultdict(list)
        self.backward_from: dict[int, int] = {}  # step -> the order its first backward entry has
        for e in entries:
            self._add(e)
        self.users: dict[tuple[str, str], list[str]] = defaultdict(list)
        self._tie(tied or [])

    def _add(self, e: TraceEntry) -> None:
        s, ph, m, c, _ = a = e.align
        self.by_align[a] = e
        parent = e.meta.get("parent")
        if ph == "forward":
            (self.fwd_in if e.slot_is("input") else self.fwd_out)[Call(s, m, c)].append(e)
            self.calls[(s, m)].add(c)
            if parent is not None and e.slot_is("output"):
                key = call_of(s, parent)
                if (m, c) not in self.children[key]:
                    self.children[key].append((m, c))
            if parent is None and e.slot_is("output"):
                self.top_outputs[s].append(e)
        elif ph == "backward":
            (self.gout if e.slot_is("grad_output") else self.gin)[Call(s, m, c)].append(e)
            self.backward_from[s] = min(self.backward_from.get(s, e.order), e.order)
        elif ph == "params":
            self.params[(s, m)].append(e)
        elif ph == "loss":
            self.loss[s].append(e)

    def _tie(self, tied: list[dict[str, str]]) -> None:
        # Tied parameters: a module computes with its owner's captured parameter (so inherits
        # its error), and the owner's gradient sums that module's contribution.
        tied_in: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for tie in tied:
            self.users[(tie["owner"], tie["owner_param"])].append(tie["module"])
            tied_in[tie["module"]].append((tie["owner"], str(Slot("param", tie["owner_param"]))))
        if tied_in:
            for s, m in self.calls:
                for owner, slot in tied_in.get(m, ()):
                    e = self.by_align.get(TraceKey(s, "params", owner, 0, slot))
                    if e is not None and all(x is not e for x in self.params[(s, m)]):
                        self.params[(s, m)].append(e)

    def caller(self, s: int, module: str) -> str:
        """``module``, or where it never ran as a module at step ``s`` (an ancestor used its
        parameters itself: nn.MultiheadAttention calls F.linear with out_proj.weight), its
        nearest ancestor that did."""
        m = module
        while m and not self.calls.get((s, m)):
            m = m.rpartition(".")[0]
        return m if self.calls.get((s, m)) else module

    def parent_of(self, e: TraceEntry) -> Call | None:
        parent = e.meta.get("parent")
        return None if parent is None else call_of(e.step, parent)

    def rerun_by(self, e: TraceEntry) -> str | None:
        """Where ``e`` (an output gradient, or a forward input) belongs to a call made outside
        the model's forward, during the backward: a custom autograd Function's backward that
        reruns a block (a reversible layer recomputes its inputs from its outputs and
        backpropagates through the block itself). That code handed the block its inputs and its output's gradient, so it
        made them: the module in whose call the block first ran (its parent then). An output
        gradient goes up while a child's output is its parent's own (the last child of a
        Sequential). None for anything else."""
        call = Call(e.step, e.module, e.call)
        while (first := next(iter(self.fwd_out.get(call) or self.fwd_in.get(call) or []), None)) is not None \
                and (parent := self.parent_of(first)) is not None:
            if e.phase != "backward" or not any(identical(o, p) for o in self.fwd_out.get(call, ())
                                                for p in self.fwd_out.get(parent, ())):
                return None  # the parent's own code consumed it (or computed the input)
            call = parent
        if first is None or not call.module or first.order < self.backward_from.get(call.step, first.order + 1):
            return None  # the model's own call, or one of the loss code's (before the backward)
        for c in sorted(self.calls.get((call.step, call.module), ())):
            o = next(iter(self.fwd_out.get(Call(call.step, call.module, c)) or []), None)
            parent = self.parent_of(o) if o is not None and c != call.call else None
            if parent is not None:
                return parent.module
        return None

    def owner_kind(self, r: TraceEntry) -> str | None:
        """The kind of the module a parameter entry belongs to (from its forward output)."""
        for c in sorted(self.calls.get((r.step, r.module), ())):
            for e in self.fwd_out.get(Call(r.step, r.module, c), [])[:1]:
                kind: str | None = e.meta.get("kind")
                return kind
        return None

    def consumer_outputs(self, e: TraceEntry) -> Entries:
        """The forward outputs (and so the metas) of the calls whose code may have consumed
        output ``e``: its parent's, and its own (a module that computes its loss from the output
        it also returns)."""
        calls = [c for c in (self.parent_of(e), Call(e.step, e.module, e.call)) if c is not None]
        return [o for c in calls for o in self.fwd_out.get(c, ())]

    def child_outputs(self, call: Call) -> Entries:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.fwd_out.get(Call(s, m, c), [])]

    def child_gins(self, call: Call) -> Entries:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.gin.get(Call(s, m, c), [])]

    def made_inside(self, e: TraceEntry) -> Entries:
        """For an output gradient whose tensor a descendant call made itself (meta ``made_by``:
        a key/value cache the model returns), the backward entries of that call recorded before
        it, when there are any: the gradient was then computed inside that call's backward, not
        by the code consuming the output. [] otherwise."""
        made = e.meta.get("made_by")
        if not made or e.phase != "backward":
            return []
        call = call_of(e.step, made)
        before = [g for g in self.gin.get(call, []) + self.child_gins(call) if g.order < e.order]
        if not before:
            return []
        return before + [g for g in self.gout.get(call, []) if g.order < e.order]

    def dependencies(self, e: TraceEntry) -> Entries:
        """The entries whose error ``e`` inherits (see floor.py)."""
        ph = e.phase
        if ph == "params":
            prev = self.by_align.get(TraceKey(e.step - 1, "optimizer", e.module, 0, e.slot)) if e.step > 0 else None
            deps = [prev] if prev else []
        elif ph == "forward":
            deps = self._forward_inputs(e) if e.slot_is("input") else self._forward_outputs(e)
        elif ph == "loss":
            deps = list(self.top_outputs.get(e.step, []))
        elif ph == "backward":
            deps = self._output_gradient(e) if e.slot_is("grad_output") else self._input_gradient(e)
        elif ph == "grads":
            deps = self._parameter_gradient(e)
        elif ph == "optimizer":
            deps = self._optimizer(e)
        else:
            deps = []
        return [d for d in deps if d is not e]

    def _forward_inputs(self, e: TraceEntry) -> Entries:
        deps: Entries = []
        parent = self.parent_of(e)
        if parent is not None:
            deps += self.fwd_in.get(parent, [])
            deps += [o for o in self.child_outputs(parent) if o.order < e.order]
        # parameters handed over as inputs (weight-norm parametrizations, tied weights):
        # those of the module and of its ancestors in the module tree
        path = e.module
        while path:
            deps += self.params.get((e.step, path), [])
            path = path.rpartition(".")[0]
        return deps

    def _forward_outputs(self, e: TraceEntry) -> Entries:
        call = Call(e.step, e.module, e.call)
        return self.fwd_in.get(call, []) + self.child_outputs(call) + self.params.get((e.step, e.module), [])

    def _output_gradient(self, e: TraceEntry) -> Entries:
        # The gradient of C's output was made by code in some ancestor's scope: inherit from
        # every ancestor's incoming gradient and the gradients its children produced so far.
        s, call = e.step, Call(e.step, e.module, e.call)
        deps: Entries = []
        anc = self.parent_of(e)
        if anc is None:
            deps += self.loss.get(s, [])
        while anc is not None:
            deps += [g for g in self.gout.get(anc, []) if g.order < e.order]
            deps += [g for g in self.child_gins(anc) if g.order < e.order]
            deps += self.fwd_in.get(anc, []) + self.child_outputs(anc)
            outs = self.fwd_out.get(anc, [])
            anc = self.parent_of(outs[0]) if outs else None
            if anc is None:
                deps += self.loss.get(s, [])
        deps += self.fwd_out.get(call, [])
        # An output the call's own later children consumed too (IntermediateLayerGetter's
        # features feed its next layers): their input gradients, recorded before this one,
        # are terms of it.
        deps += [g for g in self.child_gins(call) if g.order < e.order]
        inside = self.made_inside(e)
        if inside:  # a cache tensor: its gradient came through the call that made it
            deps += inside
        return deps

    def _input_gradient(self, e: TraceEntry) -> Entries:
        call = Call(e.step, e.module, e.call)
        deps = self.gout.get(call, []) + self.child_gins(call)
        deps += self.fwd_in.get(call, []) + self.fwd_out.get(call, []) + self.child_outputs(call)
        return deps + self.params.get((e.step, e.module), [])

    def _parameter_gradient(self, e: TraceEntry) -> Entries:
        s, m = e.step, e.module
        deps: Entries = []
        leaf = Slot.parse(e.slot).path
        for user in [m, *self.users.get((m, leaf), ())]:  # with the modules tied to it
            user = self.caller(s, user)
            for cc in self.calls.get((s, user), ()):
                k = Call(s, user, cc)
                deps += self.gout.get(k, []) + self.fwd_in.get(k, []) + self.fwd_out.get(k, [])
                deps += self.child_gins(k)
                if not self.gout.get(k):
                    # No output gradient recorded (an in-place op after the module took its
                    # place): the gradients around it in its parent's call stand for it.
                    outs = self.fwd_out.get(k, [])
                    parent = self.parent_of(outs[0]) if outs else None
                    if parent is not None:
                        deps += self.gout.get(parent, []) + self.child_gins(parent)
        return deps + self.params.get((s, m), [])

    def _optimizer(self, e: TraceEntry) -> Entries:
        s, m, slot = e.step, e.module, e.slot
        parsed = Slot.parse(slot)
        leaf = parsed.head if "." in slot else slot
        before = TraceKey(s, "params", m, 0, str(Slot("param", leaf)))
        deps = [d for d in (self.by_align.get(before),
                            self.by_align.get(before.with_slot(str(Slot("buffer", leaf)))),
                            self.by_align.get(before._replace(phase="grads")),
                            self.by_align.get(TraceKey(s - 1, "optimizer", m, 0, slot))) if d]
        if e.slot_is("buffer"):
            for cc in self.calls.get((s, m), ()):
                deps += self.fwd_in.get(Call(s, m, cc), [])
        return deps

"""The dependency index: structural lookups on the reference's entries (who depends on whom).

An entry's floor inherits the error of the entries it depends on (floor.py); this is where
"depends on" is decided: a module's forward output on its inputs, its children's outputs and
its parameters; a gradient on the gradients that reached it and the forward tensors it was
made from; the optimizer state on the parameter, its gradient and the previous state.
"""
from __future__ import annotations

from collections import defaultdict

from driftcheck.compare.entries import TraceEntry


class DependencyIndex:
    """Structural lookups on the reference's entries (who depends on whom)."""

    def __init__(self, entries: list[TraceEntry], tied: list[dict[str, str]] | None = None) -> None:
        self.fwd_in: dict[tuple, list] = defaultdict(list)
        self.fwd_out: dict[tuple, list] = defaultdict(list)
        self.gout: dict[tuple, list] = defaultdict(list)
        self.gin: dict[tuple, list] = defaultdict(list)
        self.children: dict[tuple, list] = defaultdict(list)
        self.params: dict[tuple, list] = defaultdict(list)
        self.calls: dict[tuple, set] = defaultdict(set)
        self.by_align: dict[tuple, TraceEntry] = {}
        self.loss: dict[int, list] = defaultdict(list)
        self.top_outputs: dict[int, list] = defaultdict(list)
        for e in entries:
            a = e.align
            self.by_align[a] = e
            s, ph, m, c, slot = a
            meta = e.meta
            if ph == "forward":
                (self.fwd_in if slot.startswith("input") else self.fwd_out)[(s, m, c)].append(e)
                self.calls[(s, m)].add(c)
                parent = meta.get("parent")
                if parent is not None and slot.startswith("output"):
                    p_mod, _, p_call = parent.rpartition("#")
                    key = (s, p_mod, int(p_call))
                    if (m, c) not in self.children[key]:
                        self.children[key].append((m, c))
                if parent is None and slot.startswith("output"):
                    self.top_outputs[s].append(e)
            elif ph == "backward":
                (self.gout if slot.startswith("grad_output") else self.gin)[(s, m, c)].append(e)
            elif ph == "params":
                self.params[(s, m)].append(e)
            elif ph == "loss":
                self.loss[s].append(e)
        # Tied parameters: a module computes with its owner's captured parameter (so inherits
        # its error), and the owner's gradient sums that module's contribution.
        self.users: dict[tuple[str, str], list[str]] = defaultdict(list)
        tied_in: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for tie in tied or []:
            self.users[(tie["owner"], tie["owner_param"])].append(tie["module"])
            tied_in[tie["module"]].append((tie["owner"], "param." + tie["owner_param"]))
        if tied_in:
            for s, m in self.calls:
                for owner, slot in tied_in.get(m, ()):
                    e = self.by_align.get((s, "params", owner, 0, slot))
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

    def parent_of(self, e: TraceEntry) -> tuple | None:
        parent = e.meta.get("parent")
        if parent is None:
            return None
        p_mod, _, p_call = parent.rpartition("#")
        return (e.step, p_mod, int(p_call))

    def consumer_outputs(self, e: TraceEntry) -> list:
        """The forward outputs (and so the metas) of the calls whose code may have consumed
        output ``e``: its parent's, and its own (a module that computes its loss from the output
        it also returns)."""
        calls = [c for c in (self.parent_of(e), (e.step, e.module, e.call)) if c is not None]
        return [o for c in calls for o in self.fwd_out.get(c, ())]

    def child_outputs(self, call: tuple) -> list:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.fwd_out.get((s, m, c), [])]

    def child_gins(self, call: tuple) -> list:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.gin.get((s, m, c), [])]

    def made_inside(self, e: TraceEntry) -> list[TraceEntry]:
        """For an output gradient whose tensor a descendant call made itself (meta ``made_by``:
        a key/value cache the model returns), the backward entries of that call recorded before
        it, when there are any: the gradient was then computed inside that call's backward, not
        by the code consuming the output. [] otherwise."""
        made = e.meta.get("made_by")
        if not made or e.phase != "backward":
            return []
        d_mod, _, d_call = made.rpartition("#")
        call = (e.step, d_mod, int(d_call))
        before = [g for g in self.gin.get(call, []) + self.child_gins(call) if g.order < e.order]
        if not before:
            return []
        return before + [g for g in self.gout.get(call, []) if g.order < e.order]

    def dependencies(self, e: TraceEntry) -> list[TraceEntry]:
        """The entries whose error ``e`` inherits (see floor.py)."""
        s, ph, m, c, slot = e.align
        call = (s, m, c)
        deps: list[TraceEntry] = []
        if ph == "params":
            if s > 0:
                prev = self.by_align.get((s - 1, "optimizer", m, 0, slot))
                deps += [prev] if prev else []
        elif ph == "forward" and slot.startswith("input"):
            parent = self.parent_of(e)
            if parent is not None:
                deps += self.fwd_in.get(parent, [])
                deps += [o for o in self.child_outputs(parent) if o.order < e.order]
            # parameters handed over as inputs (weight-norm parametrizations, tied weights):
            # those of the module and of its ancestors in the module tree
            path = m
            while path:
                deps += self.params.get((s, path), [])
                path = path.rpartition(".")[0]
        elif ph == "forward":
            deps += self.fwd_in.get(call, []) + self.child_outputs(call) + self.params.get((s, m), [])
        elif ph == "loss":
            deps += self.top_outputs.get(s, [])
        elif ph == "backward" and slot.startswith("grad_output"):
            # The gradient of C's output was made by code in some ancestor's scope: inherit from
            # every ancestor's incoming gradient and the gradients its children produced so far.
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
        elif ph == "backward":
            deps += self.gout.get(call, []) + self.child_gins(call)
            deps += self.fwd_in.get(call, []) + self.fwd_out.get(call, []) + self.child_outputs(call)
            deps += self.params.get((s, m), [])
        elif ph == "grads":
            leaf = slot.partition(".")[2]
            for user in [m, *self.users.get((m, leaf), ())]:  # with the modules tied to it
                user = self.caller(s, user)
                for cc in self.calls.get((s, user), ()):
                    k = (s, user, cc)
                    deps += self.gout.get(k, []) + self.fwd_in.get(k, []) + self.fwd_out.get(k, [])
                    deps += self.child_gins(k)
                    if not self.gout.get(k):
                        # No output gradient recorded (an in-place op after the module took its
                        # place): the gradients around it in its parent's call stand for it.
                        outs = self.fwd_out.get(k, [])
                        parent = self.parent_of(outs[0]) if outs else None
                        if parent is not None:
                            deps += self.gout.get(parent, []) + self.child_gins(parent)
            deps += self.params.get((s, m), [])
        elif ph == "optimizer":
            leaf = slot.split(".", 2)[1] if slot.count(".") >= 1 else slot
            deps += [d for d in (self.by_align.get((s, "params", m, 0, f"param.{leaf}")),
                                 self.by_align.get((s, "params", m, 0, f"buffer.{leaf}")),
                                 self.by_align.get((s, "grads", m, 0, f"param.{leaf}")),
                                 self.by_align.get((s - 1, "optimizer", m, 0, slot))) if d]
            if slot.startswith("buffer."):
                for cc in self.calls.get((s, m), ()):
                    deps += self.fwd_in.get((s, m, cc), [])
        return [d for d in deps if d is not e]

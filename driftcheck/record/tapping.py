"""Tapping: the tracer's side of the taps (record/taps.py): what the graph's tap operators hand
over when the compiled graph runs, taken into the ordinary capture, and each module's forward
replaced by a forward tap for the trace."""
from __future__ import annotations

import weakref
from typing import Any

import torch

from driftcheck.audit import batchnorm as bn_audit
from driftcheck.record import compilation, taps
from driftcheck.record.taps import positional, uninstall, unregister


class GraphTaps:
    """What the taps hand over, taken by :class:`driftcheck.record.tracer.Tracer` (its state
    lives there): a tapped call goes through the same ``_enter``/``_leave`` as an eager hook's,
    without grad mode (its gradients come from ``grad_tap``), the local replay or an autograd
    walk."""

    _regrouped: frozenset[str] | set[str] = frozenset()  # modules named by REGROUPED taps

    def _on_tap(self, name: str, where: str, slots: list[str], tensors: list[torch.Tensor]) -> int:
        if self._replaying or self._paused or not self._active:
            return -1
        if where == taps.REGROUPED:  # not a call: the modules whose input view regroups a sum
            self._regrouped = self._regrouped | set(name.split(taps.SEP))
            return -1
        pairs = list(zip(slots, tensors))
        module = self._by_name[name]
        if where == "out":  # a forward_tap's outputs: of the call open on top of the stack
            top = self._stack[-1] if self._stack else None
            if top is None or top[0] != name or top not in self._span_start \
                    or not self._selected(name):
                # Not a call an eager pre-hook opened (with its autograd span: _enter): its
                # post-hook is traced and hooks the outputs itself. Or the graph ran this tap
                # past a tap of a call inside (inductor may move ordered ops): none is taken.
                return -1
            self._tapped_out[top] = set(slots)
            for slot, t in pairs:  # an enclosing call that returns it as it is: _alias_grad
                self._tapped_tensors[taps.where(t)] = (name, top[1], "grad_" + slot, weakref.ref(t))
            return top[1]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if where == "pre":
                return self._enter(name, module, positional(pairs), {}, pairs, compiled=True)
            inputs = [(s, t) for s, t in pairs if s.startswith("input")]
            outputs = [(s, t) for s, t in pairs if not s.startswith("input")]
            return self._leave(name, module, positional(inputs), {}, outputs, compiled=True)

    def _tap_forwards(self) -> None:
        """A ``forward_tap`` in place of each module's forward, for the trace (``_untap``)."""
        for module, name in self.names.items():
            fn = taps.forward_tap(self._tap_id, name, self.root_output_grads, module)
            if fn is not None:
                module.forward = fn

    def _untap(self) -> None:
        """The tracer's number unregistered, each module's own forward back; the regrouped
        gradient sums the graphs reported, as a finding."""
        if self._regrouped:
            names = sorted(self._regrouped)
            self.findings.append(compilation.finding(
                "compile.regrouped_gradients", "warning",
                f"{len(names)} module(s) take two or more of a tensor's gradients through their "
                f"input-gradient tap while others of its gradients do not (e.g. "
                f"{', '.join(names[:3])}): the tap adds theirs first, so gradients upstream may "
                "differ from the untraced compiled run's in their last bits (floating-point "
                "addition regrouped; docs/compile.md)", {"modules": names}, module=names[0]))
            self._regrouped = frozenset()
        unregister(self._tap_id)
        self._tap_id = None
        for module in self.names:
            uninstall(module)

    def _on_grad_tap(self, name: str, call: int, slot: str, grad: torch.Tensor) -> None:
        if call < 0 or self._paused or not self._active or not self._capturing("backward"):
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if self._selected(name):
                self._capture(name, "backward", call, slot, grad.detach(),
                              extra=self._tap_ctx.get((name, call)))
            for owner, ocall, oslot, ctx in self._grad_aliases.pop((name, call, slot), ()):
                self._capture(owner, "backward", ocall, oslot, grad.detach(), extra=ctx)

    def _alias_grad(self, name: str, call: int, slot: str, t: torch.Tensor, ctx: Any) -> bool:
        """Whether the gradient of ``t``, an output of this call made by a compiled region, comes
        from a ``forward_tap`` of a call inside it that returned the same tensor (a model's
        logits, its classifier's output, where the model's own forward ran eagerly): the hook in
        that graph sees its whole gradient, and hands it to this call too."""
        made = self._tapped_tensors.get(taps.where(t))
        node = type(t.grad_fn).__name__ if t.grad_fn is not None else None
        if made is None or made[3]() is None or node != "CompiledFunctionBackward":
            return False  # not the very values the tap saw (freed since, or a view of them)
        self._grad_aliases.setdefault(made[:3], []).append((name, call, slot, ctx))
        return True

    def _audit_deferred(self) -> None:
        """The BatchNorm audit of calls inside a compiled graph: their buffers are written back
        after the graph, so each call is audited against the buffers at the end of the step
        (exact for a norm called once a step, as nearly all are; later calls are skipped)."""
        for name, call, x in self._bn_deferred:
            if call != 0 or self._calls.get(name, 0) != 1:
                continue
            module = self._by_name[name]
            before = self._bn_step_start.get(name)
            if before is None:
                continue
            with self._quiet():
                found = bn_audit.audit_call(name, module, x, before, bn_audit.snapshot(module),
                                            module.training, self.step_index, call)
            self.findings.extend(f.to_dict() for f in found)
        self._bn_deferred.clear()
        self._snapshot_norms()

    def _snapshot_norms(self) -> None:
        self._bn_step_start = {name: bn_audit.snapshot(m) for name, m in self._by_name.items()
                               if self.audits and bn_audit.is_tracked_norm(m)}

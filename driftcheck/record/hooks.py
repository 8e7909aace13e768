"""Forward hooks of every module (methods of the Tracer): the pre-hook copies the inputs and
marks where the call's autograd nodes start, the post-hook copies the outputs with their meta,
runs the BatchNorm audit and the local replay, and hooks the backward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.audit import batchnorm as bn_audit
from driftcheck.nested import flatten
from driftcheck.record.autograd import whole_base_node
from driftcheck.record.meta import (
    backward_meta,
    call_k,
    floating,
    is_leaf,
    kink_profile,
    magnitude_sq,
    piecewise,
    static_meta,
    tie_profile,
)
from driftcheck.record.norms import norm_gain_sq, norm_layout


class ForwardHooks:
    """The forward half of :class:`driftcheck.record.tracer.Tracer` (its state lives there)."""

    def _make_pre_hook(self, name: str) -> Callable:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying or self._paused:
                return  # a local replay of this module, or between steps: not a call of the traced run
            self._enter(name, module, args, kwargs)
        return pre_hook

    def _enter(self, name: str, module: nn.Module, args: tuple, kwargs: dict,
               inputs: list[tuple[str, torch.Tensor]] | None = None, compiled: bool = False) -> int:
        """A module call begins (its inputs are ``inputs``, or ``args``/``kwargs`` flattened);
        returns the call's number. ``compiled``: from a graph tap (record/taps.py), where the
        autograd graph is the compiled one's and buffers are written back after the graph."""
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        parent = self._stack[-1] if self._stack else None
        self._stack.append((name, call))
        if not self._selected(name):
            return call
        ctx = {"parent": f"{parent[0]}#{parent[1]}" if parent else None,
               "call_start": self._order}
        if self.local is not None and is_leaf(module) and not compiled:
            self.local.before_call(name, call, self.device)
        if inputs is None:
            inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
        if self._capturing("forward"):
            kinks = self._kinks.get(name, False)
            if kinks is False:  # a module's kinks (a max pool's: "ties") do not change
                pw = piecewise(module) if is_leaf(module) else {}
                kinks = self._kinks[name] = pw.get("kinks") or ("ties" if pw.get("selection") else None)
            # a max pool's ties are profiled in full mode too: which windows came within
            # rounding of a tie cannot be read off the two runs' tensors without its windows
            kink = kinks is not None and (kinks == "ties" or not self._full(name)) \
                and self._capturing("backward")
            for i, (slot, t) in enumerate(inputs):
                dev_meta = None
                if kink and i == 0 and t.is_floating_point():
                    with self._quiet():
                        try:
                            prof = tie_profile(module, t) if kinks == "ties" else \
                                kink_profile(t, kinks)
                            dev_meta = {"kink_profile": prof} if prof is not None else None
                        except (RuntimeError, NotImplementedError, ValueError):
                            pass  # a backend without frexp/bincount: compare goes without
                self._capture(name, "forward", call, slot, t, extra=ctx, dev_meta=dev_meta)
        if self.audits and bn_audit.is_tracked_norm(module) and inputs:
            with self._quiet():
                if compiled:  # buffers are written back after the graph: audited at step end
                    self._bn_deferred.append((name, call, inputs[0][1].detach().clone()))
                else:
                    self._bn_before[(name, call)] = (bn_audit.snapshot(module),
                                                     inputs[0][1].detach().clone())
        if self._capturing("backward") and torch.is_grad_enabled():
            self._span_start[(name, call)] = self._next_sequence_nr()
            # Remember each input's autograd node now: an in-place op inside the module
            # (ReLU(inplace=True)) replaces the tensor's grad_fn during the call.
            grad_inputs = [(s, t, t.grad_fn, t.output_nr, whole_base_node(t)) for s, t in inputs
                           if t.requires_grad and floating(t)]
            if grad_inputs:
                self._call_inputs[(name, call)] = grad_inputs
                # Nodes created from here on belong to this call: mark the sequence number.
                self._start_seq[(name, call)] = self._next_sequence_nr()
        return call

    def _make_post_hook(self, name: str) -> Callable:
        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._replaying or self._paused:
                return
            self._leave(name, module, args, kwargs, list(flatten(output, "output")))
        return post_hook

    def _leave(self, name: str, module: nn.Module, args: tuple, kwargs: dict,
               outputs: list[tuple[str, torch.Tensor]], compiled: bool = False) -> int:
        """A module call ends with ``outputs``; returns the call's number."""
        name_, call = self._stack.pop() if self._stack else (name, 0)
        if not self._selected(name):
            return call
        parent = self._stack[-1] if self._stack else None
        static = self._static.get(name)
        if static is None:  # what the module is does not change between calls
            static = self._static[name] = static_meta(module)
        ctx: dict[str, Any] = {"parent": f"{parent[0]}#{parent[1]}" if parent else None}
        ctx.update(static)
        k = call_k(static, args)
        if k is not None:
            ctx.update(k=k, k_grad=k)
        kind = static["kind"]
        dev_meta = None
        if kind in ("linear", "conv") and args and isinstance(args[0], torch.Tensor):
            with self._quiet():
                try:
                    mag = magnitude_sq(module, args[0], self._weight_sq)
                except (RuntimeError, ValueError, NotImplementedError):
                    mag = None  # a layer shape it does not know: the floor goes without
            if mag is not None:
                dev_meta = {"mag_sq": mag}
        if kind in ("norm", "batchnorm") and args and isinstance(args[0], torch.Tensor):
            with self._quiet():
                try:
                    gain = norm_gain_sq(module, args[0])
                except (RuntimeError, ValueError, NotImplementedError):
                    gain = None
            if gain is not None:
                dev_meta = dict(dev_meta or {}, norm_gain_sq=gain)
            layout = norm_layout(module, args[0])
            if layout is not None:
                ctx = dict(ctx, **layout)
        logits = self._logits.pop((name_, call), None)
        if logits is not None:
            dev_meta = dict(dev_meta or {}, logit_absmax=logits)
        decisions = self._decisions.pop((name_, call), None)
        if decisions is not None:  # the indices its code computed, by margin (record/watch.py)
            dev_meta = dict(dev_meta or {}, decision_profile=decisions)
        roundings = self._roundings.pop((name_, call), None)
        if roundings is not None:  # what its code rounded to a grid, by margin
            dev_meta = dict(dev_meta or {}, round_profile=roundings)
        host = self._host_decisions.pop((name_, call), None)
        if host:  # its code took float values to the host (a decision torch does not see)
            ctx = dict(ctx, host_decisions=host)
        ctc = self._ctc.pop((name_, call), None)
        if ctc:  # this call's code computed a CTC loss over that many frames
            ctx = dict(ctx, ctc_frames=ctc)
        if self._capturing("forward"):
            for i, (slot, t) in enumerate(outputs):
                self._capture(name, "forward", call, slot, t, extra=ctx,
                              dev_meta=dev_meta if i == 0 else None)
        if (name, call) in self._bn_before:
            before, x = self._bn_before.pop((name, call))
            with self._quiet():
                found = bn_audit.audit_call(name, module, x, before, bn_audit.snapshot(module),
                                            module.training, self.step_index, call)
            self.findings.extend(f.to_dict() for f in found)
        if compiled:  # its gradients come from graph taps: they need the call's meta
            self._tap_ctx[(name, call)] = backward_meta(ctx)
        elif self._capturing("backward") and torch.is_grad_enabled():
            self._hook_backward(name, call, outputs, ctx, self._made_by(name, call, outputs))
        if self.local is not None and self._capturing("forward") and is_leaf(module) \
                and not compiled:
            with torch._C._EnableTorchFunction():  # the user's module, as it ran
                self._local_replay(name, call, module, args, kwargs, ctx)
        return call

    def _made_by(self, name: str, call: int, outputs: list[tuple[str, torch.Tensor]]
                 ) -> dict[str, str]:
        """Outputs of this call that a descendant's own code made (a key/value cache tensor an
        attention module built and the model returns): slot -> "<module>#<call>" of the
        innermost call whose autograd nodes include the tensor's. Its gradient is computed
        inside that call's backward, not by the code that consumes this call's output."""
        start = self._span_start.pop((name, call), None)
        if start is None:
            return {}
        end = self._next_sequence_nr()
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

    def _local_replay(self, name: str, call: int, module: nn.Module, args: tuple, kwargs: dict,
                      ctx: dict[str, Any]) -> None:
        """Capture ``local.*`` entries: this leaf module rerun on the reference's inputs."""
        backward = self._capturing("backward") and torch.is_grad_enabled()
        self._replaying = True
        try:
            with self._quiet():
                results = self.local.replay(
                    self.step_index, name, call, module, args, kwargs, backward=backward,
                    owner=lambda p: self.param_owner.get(id(p), (None, None, None))[:2]
                    if id(p) in self.param_owner else None)
        finally:
            self._replaying = False
        bctx = backward_meta(ctx)
        order = self._order  # local entries must not shift the order numbers of the real ones
        for phase, slot, t in results:
            self._capture(name, phase, call, slot, t, extra=ctx if phase == "forward" else bctx,
                          copy=False)
        self._order = order

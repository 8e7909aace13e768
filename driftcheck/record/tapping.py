"""Tapping: the tracer's side of the taps (record/taps.py): what the graph's tap operators hand
over when the compiled graph runs, taken into the ordinary capture, and each module's forward
replaced by a forward tap for the trace."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.record import compilation, taps
from driftcheck.record.calls import CallKey, Calls
from driftcheck.record.capture import Capture
from driftcheck.record.taps import positional, uninstall, unregister
from driftcheck.store.keys import slot_kind

Pairs = list[tuple[str, torch.Tensor]]
Alias = tuple[str, int, str, Any]  # (module, call, slot, meta) of an enclosing call's gradient


class TapGradients:
    """The gradients of calls inside a compiled graph: each tapped call's backward meta, the
    outputs a forward tap hooked, and the enclosing calls that share one of their gradients."""

    def __init__(self, capture: Capture, calls: Calls, selected: Callable[[str], bool]) -> None:
        self.capture = capture
        self.calls = calls
        self.selected = selected
        self.reset()

    def reset(self) -> None:
        self.contexts: dict[CallKey, dict[str, Any]] = {}  # a tapped call's backward meta
        self.tapped_out: dict[CallKey, set[str]] = {}  # the output slots a forward_tap hooked
        self.tapped_tensors: dict[tuple, tuple[str, int, str, weakref.ref]] = {}  # and tensors
        # (module, call, slot) -> the enclosing calls' output gradients that are that gradient
        self.aliases: dict[tuple[str, int, str], list[Alias]] = {}

    def claim(self, name: str, call: int, bctx: dict[str, Any]) -> set[str]:
        """The output slots of call (name, call) that a forward_tap hooked in the graph (their
        gradients come from there, with ``bctx``); empty where none."""
        tapped = self.tapped_out.pop((name, call), set())
        if tapped:  # hooked in the graph by the module's forward_tap (record/taps.py)
            self.contexts[(name, call)] = bctx
        return tapped

    def hooked(self, key: CallKey, slots: list[str], tensors: list[torch.Tensor]) -> None:
        """A forward_tap of call ``key`` hooked these outputs."""
        self.tapped_out[key] = set(slots)
        for slot, t in zip(slots, tensors):  # an enclosing call that returns it as it is: alias
            self.tapped_tensors[taps.where(t)] = (key[0], key[1], "grad_" + slot, weakref.ref(t))

    def alias(self, name: str, call: int, slot: str, t: torch.Tensor, ctx: Any) -> bool:
        """Whether the gradient of ``t``, an output of this call made by a compiled region, comes
        from a ``forward_tap`` of a call inside it that returned the same tensor (a model's
        logits, its classifier's output, where the model's own forward ran eagerly): the hook in
        that graph sees its whole gradient, and hands it to this call too."""
        made = self.tapped_tensors.get(taps.where(t))
        node = type(t.grad_fn).__name__ if t.grad_fn is not None else None
        if made is None or made[3]() is None or node != "CompiledFunctionBackward":
            return False  # not the very values the tap saw (freed since, or a view of them)
        self.aliases.setdefault(made[:3], []).append((name, call, slot, ctx))
        return True

    def on_grad(self, name: str, call: int, slot: str, grad: torch.Tensor) -> None:
        """A grad_tap's gradient, for the call and the enclosing calls that share it."""
        if call < 0 or self.calls.paused or not self.calls.active or not self.capture.wants("backward"):
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if self.selected(name):
                self.capture(name, "backward", call, slot, grad.detach(),
                             extra=self.contexts.get((name, call)))
            for owner, ocall, oslot, ctx in self.aliases.pop((name, call, slot), ()):
                self.capture(owner, "backward", ocall, oslot, grad.detach(), extra=ctx)


Enter = Callable[..., int]  # ForwardHooks.enter / leave: (name, module, args, kwargs, pairs, compiled)


class GraphTaps:
    """What the taps hand over (registered with record/taps.py as ``tap_id``): a tapped call
    goes through the same ``enter``/``leave`` as an eager hook's, without grad mode (its
    gradients come from ``grad_tap``), the local replay or an autograd walk.

    Args:
        names: module -> its path. calls, selection: the calls open and what is captured.
        tap_grads: where the gradient taps go. findings: the run's, for the regrouped sums.
        enter / leave: the forward hooks' (ForwardHooks.enter / leave).
        spanning: whether a call was opened by an eager pre-hook (BackwardHooks.spanning).
    """

    def __init__(self, names: dict[nn.Module, str], calls: Calls, selected: Callable[[str], bool],
                 tap_grads: TapGradients, findings: list[dict[str, Any]], *,
                 enter: Enter, leave: Enter, spanning: Callable[[CallKey], bool],
                 root_output_grads: bool) -> None:
        self.names = names
        self.by_name = {name: module for module, name in names.items()}
        self.calls = calls
        self.selected = selected
        self.tap_grads = tap_grads
        self.findings = findings
        self.enter, self.leave, self.spanning = enter, leave, spanning
        self.root_output_grads = root_output_grads
        self.regrouped: set[str] = set()  # modules named by REGROUPED taps
        self.tap_id: int | None = None

    def register(self) -> int:
        """A number for the graph code to name this by (``taps.register``)."""
        self.tap_id = taps.register(self)
        return self.tap_id

    def on_tap(self, name: str, where: str, slots: list[str], tensors: list[torch.Tensor]) -> int:
        """The body of a ``driftcheck::tap``: a call's number, or -1 where none is taken."""
        if self.calls.replaying or self.calls.paused or not self.calls.active:
            return -1
        if where == taps.REGROUPED:  # not a call: the modules whose input view regroups a sum
            self.regrouped |= set(name.split(taps.SEP))
            return -1
        pairs = list(zip(slots, tensors))
        module = self.by_name[name]
        if where == "out":  # a forward_tap's outputs: of the call open on top of the stack
            top = self.calls.top
            if top is None or top[0] != name or not self.spanning(top) or not self.selected(name):
                # Not a call an eager pre-hook opened (with its autograd span: enter): its
                # post-hook is traced and hooks the outputs itself. Or the graph ran this tap
                # past a tap of a call inside (inductor may move ordered ops): none is taken.
                return -1
            self.tap_grads.hooked(top, slots, tensors)
            return top[1]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if where == "pre":
                return self.enter(name, module, positional(pairs), {}, pairs, compiled=True)
            inputs = [(s, t) for s, t in pairs if slot_kind(s) == "input"]
            outputs = [(s, t) for s, t in pairs if slot_kind(s) != "input"]
            return self.leave(name, module, positional(inputs), {}, outputs, compiled=True)

    def on_grad_tap(self, name: str, call: int, slot: str, grad: torch.Tensor) -> None:
        """The body of a ``driftcheck::grad_tap``."""
        self.tap_grads.on_grad(name, call, slot, grad)

    def tap_forwards(self) -> None:
        """A ``forward_tap`` in place of each module's forward, for the trace (``untap``)."""
        assert self.tap_id is not None
        for module, name in self.names.items():
            fn = taps.forward_tap(self.tap_id, name, self.root_output_grads, module)
            if fn is not None:
                module.forward = fn  # restored by untap

    def untap(self) -> None:
        """The number unregistered, each module's own forward back; the regrouped gradient sums
        the graphs reported, as a finding."""
        if self.regrouped:
            names = sorted(self.regrouped)
            self.findings.append(compilation.finding(
                "compile.regrouped_gradients", "warning",
                f"{len(names)} module(s) take two or more of a tensor's gradients through their "
                f"input-gradient tap while others of its gradients do not (e.g. "
                f"{', '.join(names[:3])}): the tap adds theirs first, so gradients upstream may "
                "differ from the untraced compiled run's in their last bits (floating-point "
                "addition regrouped; docs/compile.md)", {"modules": names}, module=names[0]))
            self.regrouped = set()
        if self.tap_id is not None:
            unregister(self.tap_id)
        self.tap_id = None
        for module in self.names:
            uninstall(module)

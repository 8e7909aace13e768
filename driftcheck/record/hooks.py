"""Forward hooks of every module (``ForwardHooks``): the pre-hook copies the inputs and marks
where the call's autograd nodes start, the post-hook copies the outputs with their meta, runs
the BatchNorm audit and the local replay, and hooks the backward.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.nested import flatten
from driftcheck.record.audits import NormAudit
from driftcheck.record.autograd import BackwardHooks
from driftcheck.record.calls import Calls, call_label
from driftcheck.record.capture import Capture
from driftcheck.record.compilation import unaccounted
from driftcheck.record.isolation import KeptGrads, holds_state, private_state
from driftcheck.record.meta import (
    backward_meta,
    call_k,
    is_leaf,
    kink_profile,
    magnitude_sq,
    piecewise,
    static_meta,
    tie_profile,
)
from driftcheck.record.norms import norm_gain_sq, norm_layout
from driftcheck.record.own import Captured, ChildCall
from driftcheck.record.selection import Selection
from driftcheck.record.tapping import TapGradients
from driftcheck.record.watch import WatchLog

Pairs = list[tuple[str, torch.Tensor]]  # (slot, tensor) of a call's inputs or outputs
PreHook = Callable[[nn.Module, tuple, dict], None]
PostHook = Callable[[nn.Module, tuple, dict, Any], None]


class ForwardHooks:
    """Each module call's forward: ``enter`` at its pre-hook, ``leave`` at its post-hook (or
    from a graph tap, record/tapping.py).

    Args:
        capture, calls, selection: where captures go, the calls open, what is captured.
        watch: what the module's own code computed (record/watch.py), for its outputs' meta.
        norms: the BatchNorm audit. backward: the call's backward (record/autograd.py).
        tap_grads: the backward meta of calls inside a compiled graph.
        local: a local.LocalReplay (leaf modules rerun on the reference's inputs), or None.
        device: the model's. owner: the (module, name) a parameter is recorded under.
    """

    def __init__(self, capture: Capture, calls: Calls, selection: Selection, watch: WatchLog,
                 norms: NormAudit, backward: BackwardHooks, tap_grads: TapGradients, *,
                 local: Any, device: torch.device,
                 owner: Callable[[torch.Tensor], tuple[str, str] | None]) -> None:
        self.capture, self.calls, self.selection = capture, calls, selection
        self.watch, self.norms, self.backward, self.tap_grads = watch, norms, backward, tap_grads
        self.local = local
        self.kept: KeptGrads | None = None  # the live gradients while a replay runs (tracer sets it)
        self.device = device
        self.owner = owner
        self._static: dict[str, dict[str, Any]] = {}  # module path -> static_meta
        self._kinks: dict[str, Any] = {}  # module path -> its kinks, "ties" or None
        # a composite call open now -> the child calls its own code made (its local replay)
        self._children: dict[tuple[str, int], list[ChildCall]] = {}
        # a call open now that was handed a cache -> its arguments with the cache as it was
        # when the call began (its local replay starts from that state, on a copy)
        self._states: dict[tuple[str, int], tuple[tuple, dict]] = {}
        self.reset()

    def keep_grads(self, state: Any) -> list[Any]:
        """Keep the live gradients of the parameters (``state``: the tracer's StateCapture, its
        ``owners`` and the ``grads`` its post-accumulate hooks took) as they are while a replay
        runs (isolation.py ``KeptGrads``); the hooks' handles."""
        self.kept = KeptGrads(lambda p: state.grads.pop(id(p), None))
        return [p.register_hook(self.kept.hook(p)) for *_, p in state.owners.values() if p.requires_grad]

    def reset(self) -> None:
        self._weight_sq: dict[Any, tuple] = {}  # meta.magnitude_sq's column sums
        self._compiled_calls: list[tuple] = []  # compiled leaf calls awaiting their local replay

    def pre_hook(self, name: str) -> PreHook:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.calls.ignored:
                return  # a local replay of this module, or between steps: not a call of the traced run
            self.enter(name, module, args, kwargs)
        return pre_hook

    def enter(self, name: str, module: nn.Module, args: tuple, kwargs: dict,
              inputs: Pairs | None = None, compiled: bool = False) -> int:
        """A module call begins (its inputs are ``inputs``, or ``args``/``kwargs`` flattened);
        returns the call's number. ``compiled``: from a graph tap (record/taps.py), where the
        autograd graph is the compiled one's and buffers are written back after the graph."""
        call, parent = self.calls.open(name)
        if self.local is not None and not compiled:
            if parent in self._children:
                given = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
                self._children[parent].append(ChildCall(module, name, call, versions={
                    id(t): t._version for _, t in given if not t.is_inference()}))
            if not is_leaf(module) and self.selection.module(name):
                self._children[(name, call)] = []
            if holds_state((args, kwargs)):
                self._states[(name, call)] = private_state((args, kwargs))
        if not self.selection.module(name):
            return call
        ctx = {"parent": call_label(parent), "call_start": self.capture.order}
        if self.local is not None and not compiled:
            self.local.before_call(name, call, self.device)
        if inputs is None:
            inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
        if self.capture.wants("forward"):
            self._capture_inputs(name, call, module, inputs, ctx)
        if inputs:
            self.norms.enter(name, call, module, inputs[0][1], compiled)
        if self.capture.wants("backward") and torch.is_grad_enabled():
            self.backward.open((name, call), inputs)
        return call

    def _capture_inputs(self, name: str, call: int, module: nn.Module, inputs: Pairs,
                        ctx: dict[str, Any]) -> None:
        kinks = self._kinks.get(name, False)
        if kinks is False:  # a module's kinks (a max pool's: "ties") do not change
            pw = piecewise(module) if is_leaf(module) else {}
            kinks = self._kinks[name] = pw.get("kinks") or ("ties" if pw.get("selection") else None)
        # a max pool's ties are profiled in full mode too: which windows came within
        # rounding of a tie cannot be read off the two runs' tensors without its windows
        kink = kinks is not None and (kinks == "ties" or not self.selection.full(name)) \
            and self.capture.wants("backward")
        for i, (slot, t) in enumerate(inputs):
            dev_meta = None
            if kink and i == 0 and t.is_floating_point():
                with self.capture.quiet():
                    try:
                        prof = tie_profile(module, t) if kinks == "ties" else \
                            kink_profile(t, kinks)
                        dev_meta = {"kink_profile": prof} if prof is not None else None
                    except (RuntimeError, NotImplementedError, ValueError):
                        pass  # a backend without frexp/bincount: compare goes without
            self.capture(name, "forward", call, slot, t, extra=ctx, dev_meta=dev_meta)

    def post_hook(self, name: str) -> PostHook:
        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.calls.ignored:
                return
            self.leave(name, module, args, kwargs, list(flatten(output, "output")), output=output)
        return post_hook

    def leave(self, name: str, module: nn.Module, args: tuple, kwargs: dict,
              outputs: Pairs, compiled: bool = False, output: Any = None) -> int:
        """A module call ends with ``outputs`` (``output``: as returned, where known); returns
        the call's number."""
        name_, call = self.calls.close(name)
        children = self._children.pop((name_, call), None)
        at_start = self._states.pop((name_, call), None)
        if self._children and self.calls.top in self._children and not compiled:
            # a child call of the composite open now: what answers it in that one's replay
            kid = next((c for c in reversed(self._children[self.calls.top])
                        if c.name == name_ and c.call == call), None)
            if kid is not None:
                kid.output = output
                kid.mask_end = self.local.mask_index()
                # an input returned as it is: not one an in-place module wrote (ReLU(inplace=True))
                given = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
                kid.passed = {o: i for o, t in outputs for i, x in given
                              if t is x and kid.versions.get(id(x), -1) == (-1 if x.is_inference() else x._version)}
        if not self.selection.module(name):
            return call
        ctx, dev_meta = self._call_meta(name, module, args, self.calls.top)
        watched = self.watch.take((name_, call))
        if watched.logit_absmax is not None:
            dev_meta = dict(dev_meta or {}, logit_absmax=watched.logit_absmax)
        if watched.decisions is not None:  # the indices its code computed, by margin (record/watch.py)
            dev_meta = dict(dev_meta or {}, decision_profile=watched.decisions)
        if watched.roundings is not None:  # what its code rounded to a grid, by margin
            dev_meta = dict(dev_meta or {}, round_profile=watched.roundings)
        if watched.host_decisions:  # its code took float values to the host (a decision torch does not see)
            ctx = dict(ctx, host_decisions=watched.host_decisions)
        if watched.ctc_frames:  # this call's code computed a CTC loss over that many frames
            ctx = dict(ctx, ctc_frames=watched.ctc_frames)
        if self.capture.wants("forward"):
            for i, (slot, t) in enumerate(outputs):
                self.capture(name, "forward", call, slot, t, extra=ctx,
                             dev_meta=dev_meta if i == 0 else None)
        self.norms.leave(name, call, module)
        if compiled:  # its gradients come from graph taps: they need the call's meta
            self.tap_grads.contexts[(name, call)] = backward_meta(ctx)
        elif self.capture.wants("backward") and torch.is_grad_enabled():
            self.backward.hook(name, call, outputs, ctx, self.backward.made_by(name, call, outputs))
        if self.local is not None and self.capture.wants("forward") and compiled and is_leaf(module):
            # inside the compiled graph: replayed through its own compiled code after the step
            self._compiled_calls.append((name, call, module, args, ctx))
        elif self.local is not None and self.capture.wants("forward") \
                and (is_leaf(module) or children is not None):
            with torch._C._EnableTorchFunction():  # the user's module, as it ran
                self._local_replay(name, call, module, *(at_start or (args, kwargs)), ctx, children)
        return call

    def replay_compiled(self) -> None:
        """At the step's end: the local replays of the leaf calls a compiled graph made, each
        leaf's code compiled on its own with the target's settings (no graph break added to
        the run: it has run)."""
        calls, self._compiled_calls = self._compiled_calls, []
        if not calls:
            return
        # the replay's compiles are not the run's (its breaks, its frames); a graph's tap runs
        # without autograd: the backward is replayed wherever the reference holds the call's
        # gradients (record/local.py)
        with unaccounted(), torch.enable_grad(), torch._C._EnableTorchFunction():
            for name, call, module, args, ctx in calls:
                self._local_replay(name, call, module, args, {}, ctx, None, compiled=True)

    def _call_meta(self, name: str, module: nn.Module, args: tuple, parent: Any
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """(the call's meta, its device-side meta: operand magnitudes, a norm's gain)."""
        static = self._static.get(name)
        if static is None:  # what the module is does not change between calls
            static = self._static[name] = static_meta(module)
        ctx: dict[str, Any] = {"parent": call_label(parent)}
        ctx.update(static)
        k = call_k(static, args)
        if k is not None:
            ctx.update(k=k, k_grad=k)
        kind = static["kind"]
        dev_meta = None
        if kind in ("linear", "conv") and args and isinstance(args[0], torch.Tensor):
            with self.capture.quiet():
                try:
                    mag = magnitude_sq(module, args[0], self._weight_sq)
                except (RuntimeError, ValueError, NotImplementedError):
                    mag = None  # a layer shape it does not know: the floor goes without
            if mag is not None:
                dev_meta = {"mag_sq": mag}
        if kind in ("norm", "batchnorm") and args and isinstance(args[0], torch.Tensor):
            with self.capture.quiet():
                try:
                    gain = norm_gain_sq(module, args[0])
                except (RuntimeError, ValueError, NotImplementedError):
                    gain = None
            if gain is not None:
                dev_meta = dict(dev_meta or {}, norm_gain_sq=gain)
            layout = norm_layout(module, args[0])
            if layout is not None:
                ctx = dict(ctx, **layout)
        return ctx, dev_meta

    def _local_replay(self, name: str, call: int, module: nn.Module, args: tuple, kwargs: dict,
                      ctx: dict[str, Any], children: list[ChildCall] | None,
                      compiled: bool = False) -> None:
        """Capture ``local.*`` entries: this leaf module rerun on the reference's inputs, or
        this composite's own code with its ``children`` calls answered from the reference."""
        backward = self.capture.wants("backward") and torch.is_grad_enabled()
        step = self.capture.step
        self.calls.replaying = True
        try:
            with self.capture.quiet(), self.kept.kept() if self.kept is not None else contextlib.nullcontext():
                results: list[Captured]
                if children is None:
                    results = [(name, call, phase, slot, t, {}) for phase, slot, t in self.local.replay(
                        step, name, call, module, args, kwargs, backward=backward, owner=self.owner,
                        compiled=compiled)]
                else:
                    results = self.local.replay_own(step, name, call, module, args, kwargs, children,
                                                    backward=backward, owner=self.owner)
        finally:
            self.calls.replaying = False
        bctx = backward_meta(ctx)
        order = self.capture.order  # local entries must not shift the order numbers of the real ones
        for mod, c, phase, slot, t, meta in results:
            extra = (ctx if phase == "forward" else bctx) if mod == name else {"parent": call_label((name, call))}
            self.capture(mod, phase, c, slot, t, extra=dict(extra, **meta), copy=False)
        self.capture.order = order

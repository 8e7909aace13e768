"""The tracer: hooks that capture every activation, gradient and state tensor of a training step.

How each phase is captured (no ``register_full_backward_hook``: it raises when a module's output
is later modified in place, as BatchNorm followed by ``ReLU(inplace=True)`` is in every ResNet):
- forward: a pre-hook copies the inputs, a hook copies the outputs (copies at hook time, so a
  later in-place op cannot change what was recorded);
- backward: a tensor hook on each output gives the gradient w.r.t. that output; the gradient
  w.r.t. each input is read off the autograd edges that leave the module's own subgraph (nodes
  created during the call, found by sequence number) through node post-hooks, so it is this
  module's contribution alone and in-place ops inside the module are fine;
- params/buffers before the step, parameter gradients (post-accumulate hooks), parameters,
  buffers and optimizer state after the optimizer step, and the loss.
Hooks only copy: the computation, RNG streams and autograd graph are left as they were, so
traced and untraced runs are bitwise equal.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes, stats as tstats
from driftcheck.record import compilation, ranks, taps
from driftcheck.record.aliases import alias_groups
from driftcheck.record.audits import NormAudit
from driftcheck.record.autograd import BackwardHooks
from driftcheck.record.calls import Calls
from driftcheck.record.capture import Capture
from driftcheck.record.config import CaptureConfig
from driftcheck.record.hooks import ForwardHooks
from driftcheck.record.metadata import run_metadata
from driftcheck.record.selection import Selection
from driftcheck.record.state import StateCapture, tied_parameters
from driftcheck.record.tapping import GraphTaps, TapGradients
from driftcheck.record.update import IdealUpdate
from driftcheck.record.watch import LOSS_CODE, WatchLog, own_work
from driftcheck.store.layout import rank_dir
from driftcheck.store.writer import TraceWriter
from driftcheck.targets import deferred


class Tracer:
    """Captures one model's training steps into a TraceWriter: the orchestrator of the parts
    below, each of which owns its state.

    - ``calls`` (record/calls.py): the module calls open now, and whether hooks are live;
    - ``selection`` (record/selection.py): which modules, phases and steps are captured;
    - ``capture`` (record/capture.py): copies and summaries, one host transfer per step;
    - ``state`` (record/state.py): parameters, buffers, gradients, optimizer state;
    - ``forward`` / ``backward`` (record/hooks.py, record/autograd.py): each module call;
    - ``watch`` (record/watch.py): what a module's own code computed between its children;
    - ``norms`` (record/audits.py): the BatchNorm running-stat audit;
    - ``tap_grads`` / ``graph_taps`` (record/tapping.py): calls inside a compiled graph.

    Args:
        model: the module to trace (hooks go on every submodule). writer: where captures go.
        config: what is captured (record/config.py ``CaptureConfig``); or its fields as keyword
            arguments: mode, include, exclude, full_modules, phases, steps, transfer, seed,
            audits, view_audit, max_pending_bytes, root_output_grads.
        optimizer: if given, parameters/state after its ``step()`` are captured right then.
        local: a local.LocalReplay: leaf modules replayed on the reference's inputs.
        compiled: the model runs under ``torch.compile`` (found by itself where the model, or
            a submodule, is compiled already): its module calls are captured by graph taps.
    """

    def __init__(self, model: nn.Module, writer: TraceWriter, config: CaptureConfig | None = None,
                 *, optimizer: torch.optim.Optimizer | None = None, local: Any = None,
                 compiled: bool = False, **options: Any) -> None:
        if config is None:
            config = CaptureConfig(**options)
        elif options:
            raise TypeError("Tracer takes a CaptureConfig or its fields as keywords, not both")
        self.config = config
        self.compiled = compiled or taps.compiled(model)
        model = taps.unwrap(model)  # torch.compile(model): the paths are the model's own
        self.model = model
        self.writer = writer
        self.mode = config.mode
        self.optimizer = optimizer
        self.device = _model_device(model)
        self.names = {m: n for n, m in model.named_modules()}
        self.findings: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.fp8_stats: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self.calls = Calls()
        self.selection = Selection(config)
        self.capture = Capture(writer, self.selection, config)
        # a deferred device (lazy, xla): the step's graph runs at t.step(), counted per step
        self.counts = deferred.StepCounts(self.device.type) if deferred.is_deferred(self.device) \
            else None
        self.capture.deferred = self.counts is not None
        self.state = StateCapture(model, self.capture, self.selection.module, optimizer)
        self.state.late_buffers = self.counts is not None
        self.tied_params = tied_parameters(self.names, self.state.owners)
        self.aliases = alias_groups(model)  # on the run's device: where a move unties weights
        self.watch = WatchLog(self.calls)
        self.watch.quiet = self.capture.quiet  # the view audit does not see the watch's own ops
        if self.counts is not None:  # the watch's graphs are the capture's too
            self.watch.around = self.counts.own
        self.norms = NormAudit(config.audits, self.capture, self.findings)
        self.tap_grads = TapGradients(self.capture, self.calls, self.selection.module)
        self.backward = BackwardHooks(self.capture, self.calls, self.tap_grads,
                                      compiled=self.compiled,
                                      root_output_grads=config.root_output_grads)
        # compiled: each leaf replayed through its own compiled code at the step's end
        self.local = local if not self.compiled or getattr(local, "regional", None) else None
        self.forward = ForwardHooks(self.capture, self.calls, self.selection, self.watch,
                                    self.norms, self.backward, self.tap_grads, local=self.local,
                                    device=self.device, owner=self.state.owner)
        # with the local replay, each parameter's step redone ideally on the host (eager devices)
        self.update = IdealUpdate(optimizer, self.capture, self.state.owner, self.selection.module) \
            if optimizer is not None and local is not None and self.counts is None else None
        self.graph_taps = GraphTaps(self.names, self.calls, self.selection.module, self.tap_grads,
                                    self.findings, enter=self.forward.enter,
                                    leave=self.forward.leave, spanning=self.backward.spanning,
                                    root_output_grads=config.root_output_grads)

    # -- what others read and set ----------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """The step being traced (a record started at a replay point starts later than 0)."""
        return self.capture.step

    @step_index.setter
    def step_index(self, step: int) -> None:
        self.capture.step = step

    @property
    def audit(self) -> Any:
        """The view audit's dispatch mode (audit/views.py ViewAudit), or None."""
        return self.capture.audit

    @audit.setter
    def audit(self, audit: Any) -> None:
        self.capture.audit = audit

    @property
    def current_module(self) -> str:
        """The module path running now (for the view audit); "" outside any module."""
        return self.calls.current_module

    def manifest_extra(self) -> dict[str, Any]:
        """What the manifest records besides the entries: the run's findings, the alias
        structure of its parameters and buffers (always: an empty list is "nothing shared"), and
        the tied parameters (module, param) -> (owner, owner_param), if any."""
        replay = self.local.findings() if self.local is not None else []
        replay += self.update.findings() if self.update is not None else []
        extra: dict[str, Any] = {"findings": self.findings + self.sync_findings() + replay, "aliases": self.aliases}
        if self.tied_params:
            extra["tied_params"] = self.tied_params
        return extra

    def sync_findings(self) -> list[dict[str, Any]]:
        """``deferred.capture_sync``: the steps of a deferred device in which the capture ran a
        graph of its own before the step's mark_step (a sync point the untraced run lacks)."""
        if self.counts is None:
            return []
        return [{"kind": "deferred.capture_sync", "severity": "error", "module": "", "step": step,
                 "message": f"the capture ran {n} graph(s) of its own inside step {step} on the "
                            f"deferred device {self.device.type!r}: a sync point the untraced run "
                            "does not have, so the traced step is split into other graphs than "
                            "the untraced one (--transfer per-capture does this; report it as a "
                            "driftcheck bug otherwise)",
                 "details": {"graphs": n, "counts": counts}}
                for counts, n in zip(self.counts.steps, self.counts.capture_graphs) if n
                for step in (counts["step"],)]

    def own(self, fn: Any) -> Any:
        """``fn`` (a hook) with the graphs it runs on a deferred device counted as the capture's."""
        if self.counts is None:
            return fn
        counts = self.counts

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with counts.own():
                return fn(*args, **kwargs)
        return run

    def logit_watch(self, code: str = "forward") -> Any:
        """A torch function mode to run the forward under: the largest softmax logit of each
        module call goes into its output's meta (``logit_absmax``, a floor input). Not around a
        compiled forward (``code`` "forward", or "loop": a user's loop calling a compiled model):
        Dynamo would trace the mode into the graph."""
        if self.compiled and code in ("forward", "loop"):
            return contextlib.nullcontext()
        return self.watch.watch()

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> Tracer:
        tid = self.graph_taps.register()
        if self.compiled:
            self.graph_taps.tap_forwards()  # each module's forward hooks its outputs in the graph
        for module, name in self.names.items():
            # Each hook is graph code where Dynamo traces it (record/taps.py), eager otherwise.
            self._handles.append(module.register_forward_pre_hook(taps.either(
                self.own(own_work(self.forward.pre_hook(name))),
                functools.partial(taps.pre, tid, name), post=False, around=self.compiled),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(taps.either(
                self.own(own_work(self.forward.post_hook(name))),
                functools.partial(taps.post, tid, name, bool(name) or self.config.root_output_grads),
                post=True, around=self.compiled), with_kwargs=True))
        if self.compiled:  # Dynamo does not guard on hooks: code compiled before they were added
            torch._dynamo.reset()  # would run without them, and code compiled with them outlive them
        for _, (_mod, _leaf, p) in self.state.owners.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    self.own(own_work(self.state.grad_hook))))
        self._handles += self.forward.keep_grads(self.state) if self.local is not None else []  # while replaying
        if self.optimizer is not None:
            self._handles += self.state.optimizer_hooks(self.optimizer, lambda f: self.own(own_work(f)),
                                                        deferred=self.counts is not None)
        if self.update is not None:
            self._handles.extend(self.update.attach())
        self.calls.active = True
        if self.compiled:
            self.norms.snapshot(self.graph_taps.by_name)
        if self.counts is not None:  # before any step: the state made as one graph, read now
            deferred.materialise([*self.model.parameters(), *self.model.buffers()])
            self.capture.host_now = True
        tstats.warm(self.device, list(self.model.parameters()))  # before step 0, not in it
        self.state.params("params")
        self.capture.host_now = False
        if self.counts is not None:
            self.counts.restart()  # step 0 counts from here
        return self

    def pause(self) -> None:
        """Ignore model calls until resume(): a training loop's evaluation or logging between
        the traced steps is not part of any step."""
        self.calls.paused = True

    def resume(self) -> None:
        self.calls.paused = False

    def detach(self) -> None:
        """Stop capturing: every hook removed, the graph taps undone."""
        self.calls.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.backward.remove_node_hooks()
        if self.graph_taps.tap_id is not None:
            self.graph_taps.untap()
            if taps.compiled(self.model) or self.compiled:
                torch._dynamo.reset()  # the user's next compile is without the taps

    def flush(self) -> None:
        """Move pending captures to the host in one batched transfer and hand them to the writer."""
        self.capture.flush()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Capture the step's loss (phase ``loss``)."""
        watched = self.watch.take(LOSS_CODE)  # what the loss code computed (record/watch.py)
        host = watched.host_decisions
        if self.capture.wants("loss") and isinstance(loss, torch.Tensor):
            logits = watched.logit_absmax
            self.capture("", "loss", 0, "loss", loss, extra={"host_decisions": host} if host else None,
                         dev_meta={"logit_absmax": logits} if logits is not None else None)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the current step: capture what is left, write it out, start the next step."""
        with torch._C.DisableTorchFunction():
            self._step(loss)

    def _step(self, loss: torch.Tensor | None) -> None:
        with self.counts.own() if self.counts is not None else contextlib.nullcontext():
            if loss is not None:
                self.record_loss(loss)
            self.state.capture_grads()
            if not self.state.updated:
                self.state.after_update()
            if self.norms.deferred or self.compiled:
                self.norms.audit_deferred(self.graph_taps.by_name, self.calls.counts)
            self.forward.replay_compiled()
            if self.update is not None:
                self.update.flush()
        if self.counts is not None:  # the step's own sync point: its graph, captures included
            deferred.mark_step(self.device)
            self.capture.host_now = True  # the state now holds the data the step made
            if self.state.updated:
                self.state.params("optimizer", params=False)
            self.norms.audit_later()
        self.capture.flush()
        if self.counts is not None:
            self.counts.end_step(self.capture.step)
        self.backward.remove_node_hooks()
        self.capture.step += 1
        known = self._reset_step()
        if self.calls.active:  # the parameters after the update, unless changed (carried)
            self.capture.carry(known)
            self.state.params("params")
            self.capture.carry(None)
        self.capture.host_now = False

    def _reset_step(self) -> dict[int, Any]:
        """Every part's per-step state empty; returns the step's summaries (Capture.reset)."""
        for part in (self.calls, self.state, self.watch, self.tap_grads, self.norms, self.backward, self.forward):
            part.reset()
        return self.capture.reset()


@contextlib.contextmanager
def trace(model: nn.Module, out: str, *, mode: str = "full",
          optimizer: torch.optim.Optimizer | None = None, force: bool = False,
          run: dict[str, Any] | None = None, **kwargs: Any) -> Iterator[Tracer]:
    """Record a model you drive yourself.

    Args:
        model: the module to trace.
        out: the trace directory to create.
        mode: "full", "stats" or "auto".
        optimizer: optional; parameters and optimizer state are captured after its step().
        force: overwrite an existing trace directory. run: extra run metadata for the manifest.

    Under torchrun (a process group of more than one process) every rank writes
    ``out/rank-<r>``, with its rank, world size and ``parallel`` ("ddp", or "fsdp" where the
    parameters are FSDP2 DTensors) in the run metadata; a DistributedDataParallel model is traced
    through its ``.module``. ``driftcheck compare`` then compares rank by rank.
        **kwargs: passed to :class:`Tracer` (include, exclude, phases, steps, transfer, seed,
            view_audit: the view/in-place audit runs around the block, its events go into the
            manifest).

    Example:
        >>> with driftcheck.trace(model, out="trace", optimizer=opt) as t:
        ...     for batch in batches:
        ...         loss = loss_fn(model(batch)); loss.backward(); opt.step(); opt.zero_grad()
        ...         t.step(loss)
    """
    model = compilation.inline_hooks(ranks.unwrap(model))  # DDP: hooks on the user's module
    rank = ranks.rank_info(model)
    if rank:
        out = str(rank_dir(out, rank["rank"]))
    try:
        writer = TraceWriter(out, force=force)
    except DriftcheckError as e:  # the CLI's words name --force; a Python caller passes force=True
        raise FileExistsError(str(e).replace("pass --force", "pass force=True")) from None
    with writer:
        tracer = Tracer(model, writer, mode=mode, optimizer=optimizer, **kwargs).attach()
        account = compilation.Account().start() if tracer.compiled else None
        audit = view_audit(tracer, tracer.device) if tracer.config.view_audit else None
        try:
            with tracer.logit_watch("loop"), audit or contextlib.nullcontext():
                yield tracer
        finally:
            tracer.detach()
            if account is not None:
                account.stop()
        if audit is not None:
            tracer.events = audit.events()
            tracer.findings.extend(f.to_dict() for f in [audit.unobservable()] if f)
        if tracer.step_index == 0:
            warnings.warn(f"driftcheck.trace({out!r}): the block ended without t.step(); the trace "
                          "holds a partial step 0 and says 0 steps. Call t.step(loss) at the end of "
                          "every training step", stacklevel=3)
        tracer.flush()
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        params = sum(p.numel() for p in model.parameters())
        meta = run_metadata(model=model, device=_model_device(model), mode=mode,
                            steps=tracer.step_index, dtype=dtypes.name_of(dtype), dtype_obj=dtype,
                            model_id=f"{type(model).__name__} ({params} parameters)", **rank)
        if account is not None:
            counts, found = account.result()
            meta["compile"] = dict(backend="user", mode=None, dynamic=None, **counts)
            tracer.findings.extend(found)
        if tracer.counts is not None:
            meta["lazy"] = tracer.counts.metadata()
        meta.update(run or {})
        extra = tracer.manifest_extra()
        if tracer.events:
            extra["view_events"] = tracer.events
        writer.close(meta, extra=extra)


def view_audit(tracer: Tracer, device: torch.device) -> Any:
    """The view audit (audit/views.py) for a run on ``device``, made the tracer's; None where it
    cannot apply (``lazy``: no storage to inspect, and a dispatch mode there breaks the backward),
    with its ``view.audit_unobservable`` warning added to the tracer's findings instead."""
    from driftcheck.audit.views import ViewAudit, not_observed
    from driftcheck.targets.devices import storage_inspectable

    if not storage_inspectable(device.type):
        tracer.findings.extend(f.to_dict() for f in [not_observed([device.type])] if f)
        return None
    tracer.audit = ViewAudit(lambda: tracer.current_module, lambda: tracer.step_index)
    return tracer.audit


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

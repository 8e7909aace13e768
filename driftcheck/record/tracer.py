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
import fnmatch
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes, stats as tstats
from driftcheck.record import compilation, ranks, taps
from driftcheck.record.autograd import BackwardHooks
from driftcheck.record.capture import Capturing, _Pending
from driftcheck.record.hooks import ForwardHooks
from driftcheck.record.metadata import run_metadata
from driftcheck.record.tapping import GraphTaps
from driftcheck.record.watch import LOSS_CODE, Watching, own_work
from driftcheck.store import format as fmt
from driftcheck.store.layout import rank_dir
from driftcheck.store.writer import TraceWriter

_SELECTED_BY = {"params": "forward", "loss": "forward"}  # phases --phases does not name


class Tracer(ForwardHooks, BackwardHooks, Capturing, GraphTaps, Watching):
    """Captures one model's training steps into a TraceWriter.

    Args:
        model: the module to trace (hooks go on every submodule).
        writer: where captures go.
        mode: "full" (tensors), "stats" (statistics + a seeded sample), "auto" (stats, full
            tensors for modules matching ``full_modules``).
        optimizer: if given, parameters/state after its ``step()`` are captured right then.
        include / exclude: module path globs selecting what is captured (params follow their
            owning module).
        phases: subset of ("forward", "backward", "grads", "optimizer").
        steps: step indices to capture (None = all).
        transfer: "batched" (one device-to-host transfer per step) or "per-capture".
        seed: seeds the stats-mode sample indices (same on both runs).
        audits: run the BatchNorm running-stat audit.
        root_output_grads: capture the gradients of the model's own outputs (off where a loop
            returns copies of them that the loss never uses: accelerate's fp32 outputs).
        compiled: the model runs under ``torch.compile`` (found by itself where the model, or
            a submodule, is compiled already): its module calls are captured by graph taps.
    """

    def __init__(self, model: nn.Module, writer: TraceWriter, *, mode: str = "full",
                 optimizer: torch.optim.Optimizer | None = None,
                 include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
                 full_modules: Iterable[str] | None = None,
                 phases: Iterable[str] | None = None, steps: Iterable[int] | None = None,
                 transfer: str = "batched", seed: int = 0, audits: bool = True,
                 view_audit: bool = False, max_pending_bytes: int = 1 << 30,
                 local: Any = None, root_output_grads: bool = True,
                 compiled: bool = False) -> None:
        if mode not in fmt.MODES:
            raise ValueError(f"mode must be one of {fmt.MODES}, not {mode!r}")
        self.compiled = compiled or taps.compiled(model)
        model = taps.unwrap(model)  # torch.compile(model): the paths are the model's own
        self.model = model
        self.writer = writer
        self.mode = mode
        self.include = list(include or [])
        self.exclude = list(exclude or [])
        self.full_modules = list(full_modules or [])
        self.phases = set(phases or fmt.SELECTABLE_PHASES)
        self.steps = None if steps is None else set(steps)
        self.transfer = transfer
        self.seed = seed
        self.audits = audits
        self.view_audit = view_audit
        self.root_output_grads = root_output_grads
        self.local = local  # a local.LocalReplay: replay leaf modules on the reference's inputs
        if self.compiled:
            self.local = None  # a leaf rerun eagerly is not what the compiled graph computed
        self.device = _model_device(model)
        self._replaying = False
        self._paused = False  # pause(): between a loop's steps (evaluation, logging) nothing is a call
        self.max_pending_bytes = max_pending_bytes
        self.optimizer = optimizer
        self.names = {m: n for n, m in model.named_modules()}
        self.param_owner = {}
        for name, p in model.named_parameters():
            mod, _, leaf = name.rpartition(".")
            self.param_owner[id(p)] = (mod, leaf, p)
        # Parameters a module holds but another owns (tied embeddings and heads, shared weights):
        # captured once, under the owner; compare needs to know who else computes with them.
        self.tied_params = [
            {"module": name, "param": leaf, "owner": self.param_owner[id(p)][0],
             "owner_param": self.param_owner[id(p)][1]}
            for module, name in self.names.items()
            for leaf, p in module.named_parameters(recurse=False)
            if id(p) in self.param_owner and self.param_owner[id(p)][:2] != (name, leaf)]
        self.step_index = 0
        self.findings: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._node_handles: list[Any] = []
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._active = False
        self._reset_step()
        self._select_cache: dict[str, bool] = {}
        self.audit: Any = None  # a ViewAudit dispatch mode, when the view audit is on
        self.fp8_stats: list[dict[str, Any]] = []
        self._host = tstats.HostSummaries(seed)
        self._static: dict[str, dict[str, Any]] = {}  # module path -> _static_meta
        self._kinks: dict[str, Any] = {}  # module path -> its kinks, "ties" or None

    def manifest_extra(self) -> dict[str, Any]:
        """What the manifest records besides the entries: the run's findings, and the tied
        parameters (module, param) -> (owner, owner_param), if any."""
        extra: dict[str, Any] = {"findings": self.findings}
        if self.tied_params:
            extra["tied_params"] = self.tied_params
        return extra

    @property
    def current_module(self) -> str:
        """The module path running now (for the view audit); "" outside any module."""
        return self._stack[-1][0] if self._stack else ""

    def _quiet(self) -> Any:
        # The tracer's own copies must not show up in the view/in-place audit.
        return self.audit.paused() if self.audit is not None else contextlib.nullcontext()

    # -- selection ---------------------------------------------------------------------------
    def _selected(self, module: str) -> bool:
        hit = self._select_cache.get(module)
        if hit is None:
            hit = (not self.include or any(fnmatch.fnmatchcase(module, g) for g in self.include)) \
                and not any(fnmatch.fnmatchcase(module, g) for g in self.exclude)
            self._select_cache[module] = hit
        return hit

    def _capturing(self, phase: str) -> bool:
        if self.steps is not None and self.step_index not in self.steps:
            return False
        if phase == "params":
            return bool(self.phases & {"forward", "optimizer"})
        return _SELECTED_BY.get(phase, phase) in self.phases

    def _full(self, module: str) -> bool:
        if self.mode == "full":
            return True
        if self.mode == "auto":
            return any(fnmatch.fnmatchcase(module, g) for g in self.full_modules)
        return False

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> Tracer:
        self._tap_id = tid = taps.register(self)
        self._by_name = {name: module for module, name in self.names.items()}
        if self.compiled:
            self._tap_forwards()  # each module's forward hooks its outputs in the graph
        for module, name in self.names.items():
            # Each hook is graph code where Dynamo traces it (record/taps.py), eager otherwise.
            self._handles.append(module.register_forward_pre_hook(taps.either(
                own_work(self._make_pre_hook(name)),
                functools.partial(taps.pre, tid, name), post=False, around=self.compiled),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(taps.either(
                own_work(self._make_post_hook(name)),
                functools.partial(taps.post, tid, name, bool(name) or self.root_output_grads),
                post=True, around=self.compiled), with_kwargs=True))
        if self.compiled:  # Dynamo does not guard on hooks: code compiled before they were added
            torch._dynamo.reset()  # would run without them, and code compiled with them outlive them
        for _, (mod, leaf, p) in self.param_owner.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(own_work(self._grad_hook)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(
                own_work(lambda opt, args, kwargs: self._capture_after_update())))
        self._active = True
        if self.compiled:
            self._snapshot_norms()
        self._capture_state("params")
        return self

    def pause(self) -> None:
        """Ignore model calls until resume(): a training loop's evaluation or logging between
        the traced steps is not part of any step."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def detach(self) -> None:
        for h in self._handles + self._node_handles:
            h.remove()
        self._handles.clear()
        self._node_handles.clear()
        self._active = False
        if getattr(self, "_tap_id", None) is not None:
            self._untap()
            if taps.compiled(self.model) or self.compiled:
                torch._dynamo.reset()  # the user's next compile is without the taps

    def _reset_step(self) -> None:
        self._order = 0
        self._seen_keys: set[str] = set()
        self._calls: dict[str, int] = {}
        self._stack: list[tuple[str, int]] = []
        self._grads: dict[int, Any] = {}  # id(param) -> a copy, or (tensor, (stats row, sample))
        self._updated = False
        self._bn_before: dict[tuple[str, int], Any] = {}
        # (module, call) -> what its code did, as the watch saw it (record/watch.py): |logit| max,
        # CTC frames, margin counts of its decisions and roundings, float tensors taken to the host
        self._logits, self._ctc, self._decisions, self._roundings, self._host_decisions = {}, {}, {}, {}, {}
        # a tapped call's backward meta; the output slots and tensors that forward_taps hooked;
        # (module, call, slot) -> the enclosing calls' output gradients that are that gradient
        self._tap_ctx, self._tapped_out, self._tapped_tensors, self._grad_aliases = {}, {}, {}, {}
        self._bn_deferred: list[tuple[str, int, torch.Tensor]] = []  # tapped norms' calls
        self._call_inputs: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self._start_seq: dict[tuple[str, int], int] = {}
        self._span_start: dict[tuple[str, int], int] = {}  # a call's first sequence number
        self._spans: list[tuple[int, int, str]] = []  # (first, end, "<module>#<call>"), in post-order
        self._summaries: dict[int, tuple[Any, ...]] = {}  # id -> (ref, identity, row, key, sample)
        self._carried: dict[int, tuple[Any, ...]] = {}  # the step before's, for its parameters
        self._weight_sq: dict[Any, tuple] = {}  # meta.magnitude_sq's column sums
        # id(output node) -> (start sequence number, the node, exit edges) of this step's calls
        self._exits: dict[int, tuple[int, Any, list[tuple[Any, int, Any, int]]]] = {}

    def record_loss(self, loss: torch.Tensor) -> None:
        """Capture the step's loss (phase ``loss``)."""
        logits = self._logits.pop(LOSS_CODE, None)
        host = self._host_decisions.pop(LOSS_CODE, None)  # the loss code's (record/watch.py)
        if self._capturing("loss") and isinstance(loss, torch.Tensor):
            self._capture("", "loss", 0, "loss", loss, extra={"host_decisions": host} if host else None,
                          dev_meta={"logit_absmax": logits} if logits is not None else None)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the current step: capture what is left, write it out, start the next step."""
        with torch._C.DisableTorchFunction():
            self._step(loss)

    def _step(self, loss: torch.Tensor | None) -> None:
        if loss is not None:
            self.record_loss(loss)
        if self._capturing("grads"):
            for pid, g in self._grads.items():
                mod, leaf, _ = self.param_owner[pid]
                if not self._selected(mod):
                    continue
                if isinstance(g, tuple):  # summarised in its hook: the live tensor gives the shape
                    self._capture(mod, "grads", 0, f"param.{leaf}", g[0], copy=False, summary=g[1])
                else:
                    self._capture(mod, "grads", 0, f"param.{leaf}", g, copy=False)
        if not self._updated:
            self._capture_after_update()
        if self._bn_deferred or self.compiled:
            self._audit_deferred()
        self.flush()
        for h in self._node_handles:
            h.remove()
        self._node_handles.clear()
        self.step_index += 1
        known = self._summaries
        self._reset_step()
        if self._active:  # the parameters after the update, unless changed (_carried_summary)
            self._carried = known
            self._capture_state("params")
            self._carried = {}

    # -- state captures ------------------------------------------------------------------------
    def _capture_state(self, phase: str) -> None:
        if not self._capturing(phase):
            return
        for mod_name, module in self.model.named_modules():
            if not self._selected(mod_name):
                continue
            for leaf, p in module.named_parameters(recurse=False):
                if self.param_owner.get(id(p), (mod_name,))[0] == mod_name:
                    self._capture(mod_name, phase, 0, f"param.{leaf}", p)
            for leaf, b in module.named_buffers(recurse=False):
                if b is not None:
                    self._capture(mod_name, phase, 0, f"buffer.{leaf}", b)

    def _capture_after_update(self) -> None:
        if self._updated:
            return
        self._updated = True
        if not self._capturing("optimizer"):
            return
        self._capture_state("optimizer")
        if self.optimizer is None:
            return
        for p, state in self.optimizer.state.items():
            owner = self.param_owner.get(id(p))
            if owner is None or not self._selected(owner[0]):
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    self._capture(owner[0], "optimizer", 0, f"state.{owner[1]}.{k}", v)

    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        g = p.grad.detach()
        mod, leaf, _ = self.param_owner[id(p)]
        if type(g) is torch.Tensor and g.layout == torch.strided and g.numel() >= tstats.BIG \
                and self._capturing("grads") and self._selected(mod):
            # A large gradient is taken now as any capture is (stats mode: its summary, rather
            # than a copy for the end of the step; a later in-place op, clipping or zero_grad,
            # cannot reach either). With gradient accumulation the last backward's is kept.
            # Kept: (the live gradient, or the copy full mode keeps; its summary), or the copy.
            sk = fmt.sample_key(self.step_index, "grads", mod, 0, f"param.{leaf}")
            with self._quiet():  # the tracer's own ops stay out of the view audit
                summary, data = self._take(g, g, mod, "grads", sk, True)
            self._grads[id(p)] = data if summary is None else (g if summary[1] is not None else data, summary)
        else:
            self._grads[id(p)] = g.clone()


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
        force: overwrite an existing trace directory.
        run: extra run metadata for the manifest.

    Under torchrun (a process group of more than one process) every rank writes
    ``out/rank-<r>``, with its rank, world size and ``parallel`` ("ddp", or "fsdp" where the
    parameters are FSDP2 DTensors) in the run metadata; a DistributedDataParallel model is traced
    through its ``.module``. ``driftcheck compare`` then compares rank by rank.
        **kwargs: passed to :class:`Tracer` (include, exclude, phases, steps, transfer, seed).

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
        try:
            with tracer.logit_watch("loop"):
                yield tracer
        finally:
            tracer._active = False
            tracer.detach()
            if account is not None:
                account.stop()
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
        meta.update(run or {})
        writer.close(meta, extra=tracer.manifest_extra())


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

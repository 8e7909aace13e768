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
import math
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from driftcheck import format as fmt
from driftcheck import stats as tstats
from driftcheck.audit import batchnorm as bn_audit
from driftcheck.store import TraceWriter

SAMPLE_SIZE = tstats.SAMPLE_SIZE  # elements kept per tensor in stats mode
_SELECTED_BY = {"params": "forward", "loss": "forward"}  # phases --phases does not name


# -- nested structures -----------------------------------------------------------------------
def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) for every tensor inside nested tuples/lists/dicts/ModelOutputs."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict) or _is_model_output(obj):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}.{i}")
    elif hasattr(obj, "to_legacy_cache") or hasattr(obj, "layers") and hasattr(obj, "get_seq_length"):
        # Hugging Face Cache objects: keys/values per layer.
        layers = getattr(obj, "layers", None)
        if isinstance(layers, (list, tuple)):
            for i, layer in enumerate(layers):
                for name in ("keys", "values"):
                    v = getattr(layer, name, None)
                    if isinstance(v, torch.Tensor):
                        yield f"{prefix}.{i}.{name}", v


def _is_model_output(obj: Any) -> bool:
    # transformers.utils.ModelOutput is an OrderedDict subclass; stay import-free.
    return hasattr(obj, "to_tuple") and hasattr(obj, "items")


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _dtype_name(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _module_kind(m: nn.Module) -> tuple[str, int | None]:
    """A coarse op kind and reduction length for the noise floor."""
    if isinstance(m, nn.Linear):
        return "linear", m.in_features
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        # each output sums in_channels/groups x (kernel taps landing on it: kernel / stride)
        return "conv", max((m.in_channels // m.groups) * math.prod(m.kernel_size)
                           // math.prod(m.stride), 1)
    if isinstance(m, nn.modules.conv._ConvNd):
        return "conv", (m.in_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.Embedding):
        return "embedding", None
    if isinstance(m, (nn.LayerNorm, nn.GroupNorm)) or type(m).__name__.lower().endswith("rmsnorm"):
        return "norm", None
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return "batchnorm", None
    if not any(True for _ in m.children()):
        return "elementwise", None
    return "composite", None


def _static_meta(m: nn.Module) -> dict[str, Any]:
    """The part of a forward entry's meta that depends on the module alone."""
    kind, k = _module_kind(m)
    meta: dict[str, Any] = {"module_type": type(m).__name__, "kind": kind}
    if k is not None:
        meta["k"] = k
    if kind == "conv":
        meta["kernel"] = math.prod(m.kernel_size)
    return meta


def _is_leaf(m: nn.Module) -> bool:
    return not any(True for _ in m.children())


def _magnitude_sq(m: nn.Module, x: torch.Tensor,
                  weight_sq: dict[int, tuple[int, torch.Tensor]] | None = None) -> torch.Tensor | None:
    """mean over output elements of sum_i x_i^2 w_i^2: the squared rms of sqrt(|x|^2 @ |W|^2).

    The probabilistic scale of a dot product's rounding error (Higham & Mary 2019) is
    u * sqrt(sum_i (x_i w_i)^2); computed from column sums, it costs O(input + weight).
    ``weight_sq`` caches a Linear's column sums of w^2 by weight (id -> (version, sums)): the
    weights do not change between optimizer steps, and a module may be called many times.
    """
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or not _floating(x):
        return None
    # float32 is plenty for a magnitude (a scale, not a value) and keeps the cost near one
    # pass over the input and the weight
    acc = torch.float32
    with torch.no_grad():
        if isinstance(m, nn.Linear) and x.shape[-1] == w.shape[1]:
            k = w.shape[1]
            xs = x.detach().reshape(-1, k)
            if xs.dtype != acc:
                xs = xs.to(acc)
            cached = weight_sq.get(id(w)) if weight_sq is not None else None
            if cached is not None and cached[0] == w._version:
                sw = cached[1]
            else:
                wd = w.detach() if w.dtype == acc else w.detach().to(acc)
                sw = (wd * wd).sum(0)  # (K,)
                if weight_sq is not None:
                    weight_sq[id(w)] = (w._version, sw)
            rows = max(x.numel() // k, 1)
            return torch.dot((xs * xs).sum(0), sw) / (rows * w.shape[0])
        if isinstance(m, nn.modules.conv._ConvNd) and x.dim() >= 2 and x.shape[1] == m.in_channels:
            # weight (C_out, C_in/g, *kernel); a transposed one's is (C_in, C_out/g, *kernel),
            # and an output position of it gets ~kernel/stride taps
            g = m.groups
            dims = [0] + list(range(2, x.dim()))
            ex = x.detach().to(acc).pow(2).mean(dim=dims).reshape(g, -1)  # (g, C_in/g)
            wsq = w.detach().to(acc).pow(2).reshape(w.shape[0], w.shape[1], -1).sum(-1)
            wsq = wsq.reshape(g, w.shape[0] // g, w.shape[1])  # weight rows/g x columns
            if m.transposed:
                return (wsq * ex[:, :, None]).sum() / m.out_channels / math.prod(m.stride)
            return (wsq * ex[:, None, :]).sum() / m.out_channels
    return None


# Modules whose gradient switches off where the input crosses zero: two runs' gradients differ
# in full at the few elements whose input rounding carried across it, a sparse error a stats-mode
# sample rarely holds. KINK_BINS + 1 counts of the input's magnitudes (kink_profile) let compare
# estimate how many elements came that close to zero (compare._kink_estimate).
KINK_MODULES = (nn.ReLU,)
KINK_BINS = 40


def _kink_profile(x: torch.Tensor) -> torch.Tensor:
    """counts[k] = elements with |x| <= absmax * 2^-k (finite ones; k = 0..KINK_BINS, zeros in
    every bin), on x's device: no sync."""
    with torch.no_grad():
        a = x.detach().reshape(-1).abs().float()
        a = torch.where(torch.isfinite(a), a, torch.full_like(a, -1.0))  # -1: left out
        m = a.max().clamp(min=torch.finfo(torch.float32).tiny) if a.numel() else a.new_ones(())
        mant, exp = torch.frexp(a / m)  # a/m = mant * 2^exp, mant in [0.5, 1)
        # k: the largest with a/m <= 2^-k (a/m in (2^-k-1, 2^-k])
        k = (exp.neg() + (mant == 0.5).to(exp.dtype)).clamp(0, KINK_BINS)
        k = torch.where(a == 0, KINK_BINS, k)
        k = torch.where(a < 0, KINK_BINS + 1, k)
        hist = torch.bincount(k.reshape(-1), minlength=KINK_BINS + 2)[:KINK_BINS + 1]
        return hist.flip(0).cumsum(0).flip(0)  # counts[k] = elements in bins >= k


class _Pending:
    __slots__ = ("entry", "tensor", "dev_meta", "summary")

    def __init__(self, entry: dict[str, Any], tensor: torch.Tensor | None,
                 dev_meta: dict[str, torch.Tensor] | None,
                 summary: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        self.entry = entry
        self.tensor = tensor
        self.dev_meta = dev_meta
        self.summary = summary  # (stats row, sample), taken at hook time instead of a copy


class Tracer:
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
    """

    def __init__(self, model: nn.Module, writer: TraceWriter, *, mode: str = "full",
                 optimizer: torch.optim.Optimizer | None = None,
                 include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
                 full_modules: Iterable[str] | None = None,
                 phases: Iterable[str] | None = None, steps: Iterable[int] | None = None,
                 transfer: str = "batched", seed: int = 0, audits: bool = True,
                 view_audit: bool = False, max_pending_bytes: int = 1 << 30,
                 local: Any = None) -> None:
        if mode not in fmt.MODES:
            raise ValueError(f"mode must be one of {fmt.MODES}, not {mode!r}")
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
        self.local = local  # a local.LocalReplay: replay leaf modules on the reference's inputs
        self._replaying = False
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
    def attach(self) -> "Tracer":
        for module, name in self.names.items():
            self._handles.append(module.register_forward_pre_hook(
                self._make_pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                self._make_post_hook(name), with_kwargs=True))
        for _, (mod, leaf, p) in self.param_owner.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self._capture_after_update()))
        self._active = True
        self._capture_state("params")
        return self

    def detach(self) -> None:
        for h in self._handles + self._node_handles:
            h.remove()
        self._handles.clear()
        self._node_handles.clear()
        self._active = False

    def _reset_step(self) -> None:
        self._order = 0
        self._seen_keys: set[str] = set()
        self._calls: dict[str, int] = {}
        self._stack: list[tuple[str, int]] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._updated = False
        self._bn_before: dict[tuple[str, int], Any] = {}
        self._call_inputs: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self._start_seq: dict[tuple[str, int], int] = {}
        self._summaries: dict[int, tuple[Any, tuple | None, torch.Tensor]] = {}
        self._weight_sq: dict[int, tuple[int, torch.Tensor]] = {}
        # id(output node) -> (start sequence number, the node, exit edges) of this step's calls
        self._exits: dict[int, tuple[int, Any, list[tuple[Any, int, Any, int]]]] = {}

    def record_loss(self, loss: torch.Tensor) -> None:
        """Capture the step's loss (phase ``loss``)."""
        if self._capturing("loss") and isinstance(loss, torch.Tensor):
            self._capture("", "loss", 0, "loss", loss)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the current step: capture what is left, write it out, start the next step."""
        if loss is not None:
            self.record_loss(loss)
        if self._capturing("grads"):
            for pid, g in self._grads.items():
                mod, leaf, _ = self.param_owner[pid]
                if self._selected(mod):
                    self._capture(mod, "grads", 0, f"param.{leaf}", g, copy=False)
        if not self._updated:
            self._capture_after_update()
        self.flush()
        for h in self._node_handles:
            h.remove()
        self._node_handles.clear()
        self.step_index += 1
        self._reset_step()
        if self._active:
            self._capture_state("params")

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
        if p.grad is not None:
            self._grads[id(p)] = p.grad.detach().clone()

    # -- forward / backward hooks -------------------------------------------------------------
    def _make_pre_hook(self, name: str) -> Callable:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying:
                return  # a local replay of this module: not a call of the traced run
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            parent = self._stack[-1] if self._stack else None
            self._stack.append((name, call))
            if not self._selected(name):
                return
            ctx = {"parent": f"{parent[0]}#{parent[1]}" if parent else None,
                   "call_start": self._order}
            if self.local is not None:
                self.local.before_call(name, call)
            inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
            if self._capturing("forward"):
                kink = type(module) in KINK_MODULES and not self._full(name) \
                    and self._capturing("backward")
                for i, (slot, t) in enumerate(inputs):
                    dev_meta = None
                    if kink and i == 0 and t.is_floating_point():
                        with self._quiet():
                            try:
                                dev_meta = {"kink_profile": _kink_profile(t)}
                            except (RuntimeError, NotImplementedError):
                                pass  # a backend without frexp/bincount: compare goes without
                    self._capture(name, "forward", call, slot, t, extra=ctx, dev_meta=dev_meta)
            if self.audits and bn_audit.is_tracked_norm(module) and inputs:
                with self._quiet():
                    self._bn_before[(name, call)] = (bn_audit.snapshot(module),
                                                     inputs[0][1].detach().clone())
            if self._capturing("backward") and torch.is_grad_enabled():
                # Remember each input's autograd node now: an in-place op inside the module
                # (ReLU(inplace=True)) replaces the tensor's grad_fn during the call.
                grad_inputs = [(s, t, t.grad_fn, t.output_nr) for s, t in inputs
                               if t.requires_grad and _floating(t)]
                if grad_inputs:
                    self._call_inputs[(name, call)] = grad_inputs
                    # Nodes created from here on belong to this call: mark the sequence number.
                    self._start_seq[(name, call)] = self._next_sequence_nr()
        return pre_hook

    def _make_post_hook(self, name: str) -> Callable:
        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._replaying:
                return
            name_, call = self._stack.pop() if self._stack else (name, 0)
            if not self._selected(name):
                return
            parent = self._stack[-1] if self._stack else None
            static = self._static.get(name)
            if static is None:  # what the module is does not change between calls
                static = self._static[name] = _static_meta(module)
            ctx: dict[str, Any] = {"parent": f"{parent[0]}#{parent[1]}" if parent else None}
            ctx.update(static)
            kind = static["kind"]
            outputs = list(flatten(output, "output"))
            dev_meta = None
            if kind in ("linear", "conv") and args and isinstance(args[0], torch.Tensor):
                with self._quiet():
                    try:
                        mag = _magnitude_sq(module, args[0], self._weight_sq)
                    except (RuntimeError, ValueError, NotImplementedError):
                        mag = None  # a layer shape it does not know: the floor goes without
                if mag is not None:
                    dev_meta = {"mag_sq": mag}
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
            if self._capturing("backward") and torch.is_grad_enabled():
                self._hook_backward(name, call, outputs, ctx)
            if self.local is not None and self._capturing("forward") and _is_leaf(module):
                self._local_replay(name, call, module, args, kwargs, ctx)
        return post_hook

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
        bctx = {k: ctx[k] for k in ("parent", "module_type", "kind") if k in ctx}
        order = self._order  # local entries must not shift the order numbers of the real ones
        for phase, slot, t in results:
            self._capture(name, phase, call, slot, t, extra=ctx if phase == "forward" else bctx,
                          copy=False)
        self._order = order

    def _hook_backward(self, name: str, call: int, outputs: list[tuple[str, torch.Tensor]],
                       ctx: dict[str, Any]) -> None:
        bctx = {"parent": ctx["parent"], "module_type": ctx["module_type"], "kind": ctx["kind"]}
        for slot, t in outputs:
            if t.requires_grad and _floating(t) and t.grad_fn is not None:
                gslot = "grad_" + slot
                t.register_hook(self._make_grad_output_hook(name, call, gslot, bctx))
        inputs = self._call_inputs.pop((name, call), None)
        start = self._start_seq.pop((name, call), None)
        if not inputs or start is None:
            return
        # Targets: the autograd node (and output index) of each input tensor.
        targets: dict[tuple[int, int], str] = {}
        for slot, t, node, nr in inputs:
            if node is not None:
                targets[(id(node), nr)] = slot
        leaf_targets = {id(t): slot for slot, t, node, _ in inputs if node is None}
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
            acc = _GradAccumulator(self, name, call, "grad_" + slot, len(edge_list), bctx)
            by_node: dict[int, list[int]] = {}
            nodes: dict[int, Any] = {}
            for node, i in edge_list:
                by_node.setdefault(id(node), []).append(i)
                nodes[id(node)] = node
            for nid, idxs in by_node.items():
                self._node_handles.append(nodes[nid].register_hook(acc.node_hook(idxs)))

    def _make_grad_output_hook(self, name: str, call: int, slot: str,
                               ctx: dict[str, Any]) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self._active and grad is not None:
                self._capture(name, "backward", call, slot, grad, extra=ctx)
        return hook

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple | None:
        """What makes a tensor the same data as when last seen: the object itself (held weakly,
        so a freed tensor's id or memory can never match), its version counter (bumped by every
        in-place write) and its view geometry."""
        try:
            return (t._version, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
        except RuntimeError:  # inference tensors have no version counter
            return None

    def _known_summary(self, t: torch.Tensor) -> torch.Tensor | None:
        """The stats row of ``t`` if this step already summarised this very tensor, unchanged
        (a module's output is the next module's input, a parent's output its last child's)."""
        known = self._summaries.get(id(t))
        if known is None:
            return None
        ref, ident, row = known
        return row if ref() is t and ident is not None and ident == self._identity(t) else None

    def _remember_summary(self, t: torch.Tensor, row: torch.Tensor) -> None:
        try:
            self._summaries[id(t)] = (weakref.ref(t), self._identity(t), row)
        except TypeError:  # not weak-referenceable: never reused
            pass

    def _next_sequence_nr(self) -> int:
        """The sequence number the next autograd node created on this thread will get."""
        peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
        if peek is not None:
            return peek()
        with self._quiet():  # a torch without the peek: make a node and read its number
            probe = torch.zeros((), requires_grad=True) * 1.0
        return probe.grad_fn._sequence_nr() + 1

    # -- the capture itself ---------------------------------------------------------------------
    def _capture(self, module: str, phase: str, call: int, slot: str, t: torch.Tensor, *,
                 extra: dict[str, Any] | None = None, copy: bool = True,
                 dev_meta: dict[str, torch.Tensor] | None = None) -> None:
        # Runs ~10^2-10^3 times a step: the cost of this function is stats mode's overhead on a
        # small model, hence plain tuples, cached names and no context managers on its fast path.
        if type(t) is not torch.Tensor and hasattr(t, "placements") and hasattr(t, "to_local"):
            # An FSDP/tensor-parallel DTensor: record this rank's shard. Anything else (stats,
            # .cpu()) would run collectives from inside a hook and could deadlock the ranks.
            t = t.to_local()
        if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): dense
            t = t.to_dense()
        skey = fmt.key_string(self.step_index, phase, module, call, slot)
        if skey in self._seen_keys:
            return  # the same tensor reached twice (e.g. an output hook fired twice)
        entry: dict[str, Any] = {
            "key": skey, "module": module, "phase": phase, "step": self.step_index,
            "call": call, "slot": slot, "order": self._order, "shape": list(t.shape),
            "dtype": _dtype_name(t), "stats": {},
        }
        if extra:
            entry["meta"] = dict(extra)
        self._order += 1
        data = t.detach()  # no autograd history: what follows records no graph
        if self.audit is None:
            summary, data = self._take(data, t, module, phase, skey, copy)
        else:
            with self.audit.paused():  # the tracer's own ops stay out of the view audit
                summary, data = self._take(data, t, module, phase, skey, copy)
        self._pending.append(_Pending(entry, data, dev_meta, summary))
        self._pending_bytes += data.numel() * data.element_size()
        self._seen_keys.add(skey)
        if self.transfer == "per-capture" or self._pending_bytes > self.max_pending_bytes:
            self.flush()

    def _take(self, data: torch.Tensor, t: torch.Tensor, module: str, phase: str, skey: str,
              copy: bool) -> tuple[tuple | None, torch.Tensor]:
        """(summary or None, what the pending capture holds) for detached ``data`` of ``t``."""
        keep = phase == "loss" or self._full(module)  # the whole tensor goes to the trace
        if not keep and tstats.HostSummaries.eligible(data):
            got = self._host.take(data, skey)
            if got is not None:
                # Stats mode, a small host tensor: summarised now, only its sample is kept.
                sample = torch.from_numpy(got[1])
                return (got[0], sample), sample
        if not keep and data.numel() >= tstats.BIG:
            # Stats mode, a large tensor: summarise it now (on its device, no sync) rather
            # than copy it for later; the copy would cost more than the summary.
            row = self._known_summary(t)
            if row is None:
                rows, samples = tstats.summarize([data], [skey], self.seed)
                row, sample = rows[0], samples[0]
                self._remember_summary(t, row)
            else:  # the same tensor, unchanged, seen earlier this step: only the sample
                sample = tstats.sample_of(data, skey, self.seed)
            return (row, sample), sample
        # copy at hook time: later in-place ops must not leak in
        return None, (data.clone() if copy else data)

    def flush(self) -> None:
        """Move pending captures to the host in one batched transfer and hand them to the writer."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        with torch.no_grad(), self._quiet():
            fulls = [self._full(p.entry["module"]) or p.entry["phase"] == "loss" for p in pending]
            # Stats of all captures and the samples of the non-full ones, a few kernels per dtype,
            # except those summarised in their hook (rows on the host or on the device).
            todo = [i for i, p in enumerate(pending) if p.summary is None]
            rows, got = tstats.summarize(
                [pending[i].tensor for i in todo],
                [None if fulls[i] else pending[i].entry["key"] for i in todo], self.seed)
            samples: list[torch.Tensor | None] = [p.summary[1] if p.summary else None for p in pending]
            for j, i in enumerate(todo):
                samples[i] = got[j]
            stat_lists: list[list[float] | None] = [None] * len(pending)
            on_device = []
            for i, p in enumerate(pending):
                if p.summary is not None:
                    if isinstance(p.summary[0], torch.Tensor):
                        on_device.append(i)
                    else:  # a HostSummaries row: on the host already
                        stat_lists[i] = p.summary[0].tolist()
            if on_device:
                like = rows if todo else pending[on_device[0]].summary[0]
                extra = torch.stack([pending[i].summary[0].to(like) for i in on_device])
                rows = torch.cat([rows, extra]) if todo else extra
            order = todo + on_device
            metas = [(i, k, v) for i, p in enumerate(pending) if p.dev_meta
                     for k, v in p.dev_meta.items()]
            meta_vals = torch.cat([v.to(tstats.acc_dtype(v.device)).reshape(-1)
                                   for _, _, v in metas]) if metas else None
            host_tensors = _to_host([p.tensor if f else s for p, f, s in zip(pending, fulls, samples)])
            for i, row in zip(order, rows.cpu().tolist() if order else []):
                stat_lists[i] = row
            meta_host = meta_vals.cpu().tolist() if meta_vals is not None else []
        at = 0
        for i, k, dev in metas:
            n = dev.numel()
            v = meta_host[at:at + n]
            at += n
            if k == "mag_sq":
                pending[i].entry.setdefault("meta", {})["mag_rms"] = math.sqrt(max(v[0], 0.0))
            else:  # kink_profile: counts
                pending[i].entry.setdefault("meta", {})[k] = [int(c) for c in v]
        for p, row, full, host in zip(pending, stat_lists, fulls, host_tensors):
            p.entry["stats"] = tstats.to_dict(row)
            if full:
                self.writer.add(p.entry, host)
            else:
                self.writer.add(p.entry, None, sample=host)


class _GradAccumulator:
    """Sums the gradient reaching one module input over all edges leaving the module."""

    def __init__(self, tracer: Tracer, name: str, call: int, slot: str, n_edges: int,
                 ctx: dict[str, Any]) -> None:
        self.tracer, self.name, self.call, self.slot = tracer, name, call, slot
        self.remaining = n_edges
        self.total: torch.Tensor | None = None
        self.ctx = ctx

    def node_hook(self, idxs: list[int]) -> Callable:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            for i in idxs:
                g = grad_inputs[i] if i < len(grad_inputs) else None
                if g is not None:
                    g = g.detach()
                    self.total = g.clone() if self.total is None else self.total + g
                self.remaining -= 1
            if self.remaining == 0 and self.total is not None and self.tracer._active:
                self.tracer._capture(self.name, "backward", self.call, self.slot, self.total,
                                     extra=self.ctx, copy=False)
        return hook


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One device-to-host transfer per dtype for all tensors (none on CPU)."""
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return tensors
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idxs in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in idxs]).cpu()
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset:offset + n].reshape(tensors[i].shape).clone()
            offset += n
    return out  # type: ignore[return-value]


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
        **kwargs: passed to :class:`Tracer` (include, exclude, phases, steps, transfer, seed).

    Example:
        >>> with driftcheck.trace(model, out="trace", optimizer=opt) as t:
        ...     for batch in batches:
        ...         loss = loss_fn(model(batch)); loss.backward(); opt.step(); opt.zero_grad()
        ...         t.step(loss)
    """
    from driftcheck.runner import run_metadata

    with TraceWriter(out, force=force) as writer:
        tracer = Tracer(model, writer, mode=mode, optimizer=optimizer, **kwargs).attach()
        try:
            yield tracer
        finally:
            tracer._active = False
            tracer.detach()
        tracer.flush()
        meta = run_metadata(model=model, device=_model_device(model), mode=mode,
                            steps=tracer.step_index)
        meta.update(run or {})
        writer.close(meta, extra=tracer.manifest_extra())


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

"""The state captures: parameters and buffers before the step (phase ``params``), parameter
gradients (``grads``, taken as each is accumulated), and parameters, buffers and optimizer state
after the optimizer step (``optimizer``). Parameters are captured under the module that owns
them; tied parameters (a shared embedding and head) once, and named in the manifest."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.numerics import stats as tstats
from driftcheck.record.capture import Capture
from driftcheck.record.host_summaries import Held
from driftcheck.store.keys import sample_key
from driftcheck.targets import deferred

Owner = tuple[str, str, torch.Tensor]  # (owning module, parameter name, the parameter)


def parameter_owners(model: nn.Module) -> dict[int, Owner]:
    """id(parameter) -> (the module that owns it, its name there, the parameter)."""
    owners: dict[int, Owner] = {}
    for name, p in model.named_parameters():
        mod, _, leaf = name.rpartition(".")
        owners[id(p)] = (mod, leaf, p)
    return owners


def tied_parameters(names: dict[nn.Module, str], owners: dict[int, Owner]) -> list[dict[str, str]]:
    """Parameters a module holds but another owns (tied embeddings and heads, shared weights):
    captured once, under the owner; compare needs to know who else computes with them."""
    return [{"module": name, "param": leaf, "owner": owners[id(p)][0], "owner_param": owners[id(p)][1]}
            for module, name in names.items()
            for leaf, p in module.named_parameters(recurse=False)
            if id(p) in owners and owners[id(p)][:2] != (name, leaf)]


class StateCapture:
    """Parameters, buffers, gradients and optimizer state, taken into ``capture``.

    Args:
        model: the traced model. capture: where they go.
        selected: whether a module path is captured. optimizer: its state after ``step()``.
    """

    def __init__(self, model: nn.Module, capture: Capture, selected: Any,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.capture = capture
        self.selected = selected
        self.optimizer = optimizer
        self.owners = parameter_owners(model)
        self.late_buffers = False  # buffers after the update captured by the tracer, later
        self.reset()

    def reset(self) -> None:
        self.grads: dict[int, Any] = {}  # id(param) -> a copy, or (tensor, (stats row, sample))
        self.updated = False

    def owner(self, p: torch.Tensor) -> tuple[str, str] | None:
        """The (module, name) a parameter is recorded under, or None where the model has none."""
        got = self.owners.get(id(p))
        return None if got is None else (got[0], got[1])

    def params(self, phase: str, *, params: bool = True, buffers: bool = True) -> None:
        """Every selected module's own parameters and buffers, as phase ``phase``."""
        if not self.capture.wants(phase):
            return
        for mod_name, module in self.model.named_modules():
            if not self.selected(mod_name):
                continue
            for leaf, p in module.named_parameters(recurse=False):
                if params and self.owners.get(id(p), (mod_name,))[0] == mod_name:
                    self.capture(mod_name, phase, 0, f"param.{leaf}", p)
            for leaf, b in module.named_buffers(recurse=False):
                if buffers and b is not None:
                    self.capture(mod_name, phase, 0, f"buffer.{leaf}", b)

    def after_update(self) -> None:
        """After the optimizer step (once a step): parameters, buffers and optimizer state."""
        if self.updated:
            return
        self.updated = True
        if not self.capture.wants("optimizer"):
            return
        # a deferred device's buffers are read after the step's sync point (late_buffers): its
        # backend may update one in place unordered with a read in the same graph (BatchNorm's)
        self.params("optimizer", buffers=not self.late_buffers)
        if self.optimizer is None:
            return
        for p, state in self.optimizer.state.items():
            owner = self.owners.get(id(p))
            if owner is None or not self.selected(owner[0]):
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    self.capture(owner[0], "optimizer", 0, f"state.{owner[1]}.{k}", v)

    def optimizer_hooks(self, optimizer: torch.optim.Optimizer, wrap: Callable[[Callable], Callable],
                        deferred: bool) -> list[Any]:
        """The optimizer's step hooks (each ``wrap``ped); their handles. Before the update: the
        gradients, final now, to the writer, so they are written while it runs and their copies
        are free for the state's (a deferred device's stay in the step's graph to its end, as do
        those of a step with no update). After it: the parameters and the optimizer's state."""
        pre = [] if deferred else [optimizer.register_step_pre_hook(
            wrap(lambda opt, args, kwargs: self.capture_grads()))]
        return pre + [optimizer.register_step_post_hook(wrap(lambda opt, args, kwargs: self.after_update()))]

    def grad_hook(self, p: torch.Tensor) -> None:
        """A post-accumulate-grad hook: the parameter's gradient, kept for the step's end (nothing
        where the ``grads`` phase or the parameter's module is not captured)."""
        if p.grad is None:
            return
        mod, leaf, _ = self.owners[id(p)]
        if not (self.capture.wants("grads") and self.selected(mod)):
            return  # capture_grads would drop it (a copy of every gradient held for nothing)
        g = p.grad.detach()
        if type(g) is torch.Tensor and g.layout == torch.strided and g.numel() >= tstats.BIG:
            # A large gradient is taken now as any capture is (stats mode: its summary, rather
            # than a copy for the end of the step; a later in-place op, clipping or zero_grad,
            # cannot reach either). With gradient accumulation the last backward's is kept; with
            # two updates in one step, the first's (optimizer_hooks), as for its state.
            # Kept: (the live gradient, or the copy full mode keeps; its summary), or the copy.
            sk = sample_key(self.capture.step, "grads", mod, 0, f"param.{leaf}")
            with self.capture.quiet():  # the tracer's own ops stay out of the view audit
                summary, data = self.capture.take(g, g, mod, "grads", sk, True)
            sampled = summary is not None and (isinstance(summary, Held) or summary[1] is not None)
            self.grads[id(p)] = data if summary is None else (g if sampled else data, summary)
        else:
            self.grads[id(p)] = deferred.copy(g)

    def capture_grads(self) -> None:
        """The step's parameter gradients, as phase ``grads``."""
        if not self.capture.wants("grads"):
            return
        # taken out as captured: the writer holds each copy alone, and gives its memory back
        grads, self.grads = self.grads, {}
        for pid in list(grads):
            g = grads.pop(pid)
            mod, leaf, _ = self.owners[pid]
            if not self.selected(mod):
                continue
            if isinstance(g, tuple):  # summarised in its hook: the live tensor gives the shape
                self.capture(mod, "grads", 0, f"param.{leaf}", g[0], copy=False, summary=g[1])
            else:
                self.capture(mod, "grads", 0, f"param.{leaf}", g, copy=False)

"""An optimizer-update fault: the update of one module's parameters is ``factor`` times the right
one (a fused optimizer kernel a few percent off), in the target run only.

Installed as ``record(target_hooks=scale_update(module, factor))``: a global optimizer step
pre-hook copies the module's parameters before each step, and a post-hook of that optimizer,
run before any other (before the tracer captures the parameters after the step), sets
``p = before + factor * (p - before)``. ``remove()`` undoes it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from driftcheck.errors import DriftcheckError


class ScaleUpdate:
    """The optimizer's update of ``module``'s parameters times ``factor``."""

    def __init__(self, module: str, factor: float) -> None:
        self.module, self.factor = module, factor
        self.params: list[nn.Parameter] = []
        self.hits = 0
        self._before: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._hooked: set[int] = set()

    def __call__(self, model: nn.Module) -> ScaleUpdate:
        try:
            self._mod = model.get_submodule(self.module)
        except AttributeError:
            raise DriftcheckError(f"scale_update: the model has no submodule {self.module!r}") from None
        self._handles.append(register_optimizer_step_pre_hook(self._pre))
        return self

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.params = list(self._mod.parameters())  # as the run holds them (after any move)
        self._before = [p.detach().clone() for p in self.params]
        if id(opt) not in self._hooked:
            self._hooked.add(id(opt))
            h = opt.register_step_post_hook(self._post)
            # first among the optimizer's post-hooks: the tracer's capture of the updated
            # parameters is one of them
            hooks = opt._optimizer_step_post_hooks
            ordered = {h.id: hooks.pop(h.id), **hooks}
            hooks.clear()
            hooks.update(ordered)
            self._handles.append(h)

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p, b in zip(self.params, self._before):
                p.copy_(b + (p - b) * self.factor)
        self.hits += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def describe(self) -> str:
        return f"scale_update({self.module}, factor={self.factor:g})"


def scale_update(module: str, factor: float) -> ScaleUpdate:
    """The optimizer's update of ``module``'s parameters times ``factor`` (target only)."""
    return ScaleUpdate(module, factor)

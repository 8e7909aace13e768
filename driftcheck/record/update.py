"""The optimizer step's own error: each parameter's update computed again, ideally, from the
inputs the target's step consumed.

A defect in the target's optimizer kernel (a fused AdamW a few percent off) hides in the
propagated comparison: a parameter after the step differs from the reference's by the whole
run's gradient drift, which an adaptive optimizer turns into sign flips of near-zero gradients,
and the floor must allow those. What the step itself adds is seen directly by redoing it: just
before the target's ``step()``, each parameter's step is replayed on the host in float32 (the
parameter's own dtype where wider), from the target's own parameter, gradient and optimizer
state, with the optimizer's own class and the group's hyperparameters (the learning rate a
scheduler set for this step). ``compare`` judges the target's updated parameter against that
ideal rounded to the parameter's dtype (numerics/update.py).

The replay leaves nothing behind: it steps a fresh optimizer over host copies (no state, step
counter or parameter of the run is touched), with the global optimizer hooks off (a user's, an
injected fault's) and outside any dispatch or function mode around the step (an emulation, an
audit). An optimizer that cannot step one parameter on its own (LBFGS wants a closure) leaves the
run without the check, as the warning ``update.replay_failed``: never a failed record.

Captured as phase ``optimizer``, slot ``local.param.<name>`` beside ``param.<name>``, under
the module that owns the parameter. Recorded with the local replay (``--local``, ``run``'s
default in full mode), on eagerly executing devices; a deferred device's (lazy, xla) step is
one graph that a host copy in the middle would split.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.optim.optimizer as optim_hooks
from torch.utils._python_dispatch import _disable_current_modes

from driftcheck.numerics.update import update_error
from driftcheck.store.keys import LOCAL_PREFIX

# options that choose an implementation, not the arithmetic: the host replay takes the plain one
NOISE = "param_noise."  # slot local.param_noise.<name>: the ideal's move per rounded input
IMPLEMENTATION = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}


@contextlib.contextmanager
def no_global_hooks() -> Iterator[None]:
    """The global optimizer step hooks (``register_optimizer_step_pre_hook``) off."""
    saved = (dict(optim_hooks._global_optimizer_pre_hooks), dict(optim_hooks._global_optimizer_post_hooks))
    optim_hooks._global_optimizer_pre_hooks.clear()
    optim_hooks._global_optimizer_post_hooks.clear()
    try:
        yield
    finally:
        optim_hooks._global_optimizer_pre_hooks.update(saved[0])
        optim_hooks._global_optimizer_post_hooks.update(saved[1])


def _host(v: Any) -> Any:
    """A state value on the host: float tensors with elements in float64, scalars (a step
    counter) as they are; anything else as it is."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        if v.is_floating_point() and v.dim() > 0:
            return v.to("cpu", torch.float64, copy=True)
        return v.to("cpu", copy=True)
    return v


def _steps(cls: type, hyper: dict[str, Any], ps: list[torch.Tensor], grads: list[torch.Tensor],
           states: list[dict[str, Any]]) -> list[torch.Tensor]:
    """``ps`` after one step of a fresh ``cls`` with ``hyper`` (one group), their ``grads`` and
    ``states`` (copies; none of them changes)."""
    cs = [p.clone().requires_grad_(True) for p in ps]
    for c, g in zip(cs, grads):
        c.grad = g.clone()
    accepted = inspect.signature(cls).parameters
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    replay = cls(cs, **{k: v for k, v in hyper.items() if takes_any or k in accepted})
    replay.param_groups[0].update(hyper)  # keys the constructor does not take (a group's name)
    for c, state in zip(cs, states):
        if state:
            replay.state[c] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    replay.step()
    return [c.detach() for c in cs]


def _perturbable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()


def ideal_steps(opt: torch.optim.Optimizer, group: dict[str, Any],
                params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each of ``params`` (of ``group``, each with a gradient): the parameter after one step
    of ``opt``'s algorithm with the group's hyperparameters, from the parameter, its gradient and
    its optimizer state as they are now, computed on the host in float64; how much that result
    moves when each other input (the gradient, each state tensor) is rounded once at the
    parameter's precision (the sum over them of the moves, each input scaled by 1 + u in turn):
    what a correct step's own arithmetic may add where its terms cancel (a momentum buffer
    against a gradient); and the same step by torch's host kernels at the parameter's own dtype
    (one correct implementation at that precision: a decoupled weight decay rounds the
    parameter between two roundings, a learning rate rounded to bf16 scales the update). One
    replay of the whole list per question (the parameters' steps are independent of each other
    in every per-parameter optimizer). Raises what the optimizer raises."""
    hyper = {k: (float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
             for k, v in group.items() if k != "params"}
    hyper.update({k: v for k, v in IMPLEMENTATION.items() if k in hyper})
    cls = type(opt)
    owns = [opt.state.get(p) or {} for p in params]
    us = [torch.finfo(p.dtype).eps / 2 for p in params]
    xs = [p.detach().to("cpu", torch.float64, copy=True) for p in params]
    gs = [p.grad.detach().to("cpu", torch.float64, copy=True) for p in params]  # type: ignore[union-attr]
    states = [{k: _host(v) for k, v in own.items()} for own in owns]
    ideals = _steps(cls, hyper, xs, gs, states)
    moved = [(y - i).abs() for y, i in zip(_steps(cls, hyper, xs, [g * (1 + u) for g, u in zip(gs, us)], states),
                                          ideals)]
    for k in sorted({k for st in states for k, v in st.items() if _perturbable(v)}):
        bumped = [dict(st, **{k: st[k] * (1 + u)}) if _perturbable(st.get(k)) else st for st, u in zip(states, us)]
        for m, y, i in zip(moved, _steps(cls, hyper, xs, gs, bumped), ideals):
            m += (y - i).abs()
    at_dtype = _steps(cls, hyper, [p.detach().to("cpu", copy=True) for p in params],
                      [p.grad.detach().to("cpu", copy=True) for p in params],  # type: ignore[union-attr]
                      [{k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                        for k, v in own.items()} for own in owns])
    return list(zip(ideals, moved, at_dtype))


def ideal_step(opt: torch.optim.Optimizer, group: dict[str, Any],
               p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ideal_steps` of one parameter."""
    return ideal_steps(opt, group, [p])[0]


BATCH_ELEMS = 1 << 24  # parameters replayed together: at most this many elements (float64 copies)


class IdealUpdate:
    """The step pre-hook that replays each selected parameter's step (:func:`ideal_step`) and
    captures the result.

    Args:
        optimizer: the run's optimizer. capture: where the ideals go (record/capture.py).
        owner: the (module, name) a parameter is recorded under, or None.
        selected: whether a module path is captured.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, capture: Any,
                 owner: Callable[[torch.Tensor], tuple[str, str] | None],
                 selected: Callable[[str], bool]) -> None:
        self.optimizer, self.capture, self.owner, self.selected = optimizer, capture, owner, selected
        self.failed: tuple[int, str] | None = None
        self.pending: list[tuple[str, str, torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        self._handle: Any = None

    def attach(self) -> list[Any]:
        """The step pre-hook (the replay) and a post-hook (:meth:`last`)."""
        self._handle = self.optimizer.register_step_pre_hook(self.pre)
        return [self._handle, self.optimizer.register_step_post_hook(self.post)]

    def last(self) -> None:
        """Ours the last of the optimizer's own pre-hooks (a user's gradient clipping registered
        later runs before it): called outside the step, where the hooks are not being run."""
        hooks = self.optimizer._optimizer_step_pre_hooks
        if self._handle is not None and self._handle.id in hooks:
            hooks[self._handle.id] = hooks.pop(self._handle.id)

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.failed is not None or not self.capture.wants("optimizer"):
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._C.DisableTorchFunction())
            stack.enter_context(_disable_current_modes())
            stack.enter_context(no_global_hooks())
            stack.enter_context(self.capture.quiet())
            stack.enter_context(torch.no_grad())
            for group in opt.param_groups:
                todo = [(p, named) for p in group["params"] for named in [self.owner(p)]
                        if p.grad is not None and not p.grad.is_sparse and p.is_floating_point()
                        and not p.is_complex() and named is not None and self.selected(named[0])]
                while todo:
                    batch: list[tuple[torch.Tensor, tuple[str, str]]] = []
                    n = 0
                    while todo and (not batch or n + todo[0][0].numel() <= BATCH_ELEMS):
                        batch.append(todo.pop(0))
                        n += batch[-1][0].numel()
                    try:
                        got = ideal_steps(opt, group, [p for p, _ in batch])
                    except Exception as e:  # the optimizer's own refusal: no check, a warning
                        self.failed = (self.capture.step, f"{type(e).__name__}: {str(e).strip()[:200]}")
                        return
                    for (p, named), (ideal, moved, at_dtype) in zip(batch, got):
                        self._judged(p, named, ideal, moved, at_dtype)

    def _judged(self, p: torch.Tensor, named: tuple[str, str], ideal: torch.Tensor, moved: torch.Tensor,
                at_dtype: torch.Tensor) -> None:
        wide = torch.promote_types(p.dtype, torch.float32)
        # an element where one correct implementation at the dtype (torch's host kernels)
        # already lands elsewhere than the ideal rounded (a tie that its rounded learning rate
        # tips) is as fragile as that: its arithmetic's scale
        moved = torch.maximum(moved, (at_dtype.double() - ideal.to(p.dtype).double()).abs())
        # and what that implementation shows as a whole, as compare will judge the target
        host = update_error(at_dtype, ideal.to(wide), p.detach().to("cpu"), moved)
        meta = {"coherent_at_dtype": host.get("coherent", 0.0), "ratio_at_dtype": host["ratio"]}
        self.pending.append((*named, ideal.to(wide), moved.to(torch.bfloat16), meta))

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.last()

    def flush(self) -> None:
        """The step's ideals captured: at the step's end, after every real capture (which keep
        the order numbers they have without the replay)."""
        for module, name, ideal, moved, meta in self.pending:
            self.capture(module, "optimizer", 0, f"{LOCAL_PREFIX}param.{name}", ideal, copy=False, extra=meta)
            self.capture(module, "optimizer", 0, f"{LOCAL_PREFIX}{NOISE}{name}", moved, copy=False)
        self.pending = []

    def findings(self) -> list[dict[str, Any]]:
        """``update.replay_failed`` (a warning) where the optimizer refused the replay."""
        if self.failed is None:
            return []
        step, err = self.failed
        return [{"kind": "update.replay_failed", "severity": "warning", "module": "", "step": step,
                 "message": f"replaying {type(self.optimizer).__name__}'s step per parameter raised {err}; "
                            "the parameters' updates have no local error and are judged as propagated "
                            "(the record itself is complete)"}]


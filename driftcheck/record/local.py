"""Local replay: run each leaf module on the target again, on the reference's inputs for that call.

The propagated error of a module's output mixes what the module adds with what it inherits from
everything upstream. Replaying the module on the *reference's* recorded inputs (cast to the
target's dtype and device) isolates the first part: the difference between that replay and the
reference's output is the module's local error. With the reference's gradient of the outputs,
``torch.autograd.grad`` through the replay gives the local error of the backward as well.

The replay runs inside the tracer's forward post-hook of the real call and leaves nothing behind:
- the tracer's own hooks are off during it (no call counters, no captures, no backward hooks);
- the module runs with the reference's parameters of the step (cast to the target's dtype);
  its parameters and buffers (BatchNorm running statistics, ``num_batches_tracked``) are swapped
  out during the replay, so neither their values nor their version counters change;
- the CPU/device RNG is forked, and CPU-drawn dropout masks are replayed from the same index as
  the real call, so a Dropout replays with the mask the real call used;
- autograd: the replay's graph starts at fresh leaves and ``autograd.grad`` only asks for the
  inputs' gradients, so no ``.grad`` is written and the training graph is untouched;
- the module's forward hooks (the model's output collectors) are off during it;
- a replay the model's code refuses (it raises) leaves that module without a local error, as the
  warning ``local.replay_failed``: never a failed record.

Captured as extra entries of the target trace, slot ``local.<slot>`` next to ``<slot>``:
``local.output.*`` (phase forward) and ``local.grad_input.*`` (phase backward).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.nested import substitute
from driftcheck.store.keys import LOCAL_PREFIX, TraceKey

_POST_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class LocalReplay:
    """The reference's tensors, looked up per (step, module, call), and the replay itself.

    Args:
        ref_dir: a full-mode reference trace (the one the target replays).
        dropout: the run's ``DropoutControl`` (its mask index is rewound for a Dropout replay).
    """

    def __init__(self, ref_dir: str | os.PathLike, dropout: Any = None) -> None:
        from driftcheck.store.reader import TraceReader

        self.reader = TraceReader(ref_dir)
        self.dropout = dropout
        self.by_key: dict[TraceKey, dict[str, Any]] = {}
        for e in self.reader.entries:
            if e["phase"] in ("params", "forward", "backward") and e.get("tensor") is not None:
                self.by_key[TraceKey.of(e)] = e
        if not self.by_key and self.reader.entries:
            raise DriftcheckError(f"--local {ref_dir}: the reference holds no full forward/backward "
                                  "tensors (recorded with --mode stats?); record it with --mode full")
        self.replay_id = self.reader.run.get("replay_id")
        self._mask_mark: dict[tuple[str, int], tuple[int, int]] = {}
        self._rng_mark: dict[tuple[str, int], Any] = {}
        self.failed: dict[str, tuple[int, str]] = {}  # module -> (step, error) of a replay that raised

    def tensor(self, step: int, phase: str, module: str, call: int, slot: str) -> torch.Tensor | None:
        """The reference's full tensor of that entry, or None where it holds none."""
        e = self.by_key.get(TraceKey(step, phase, module, call, slot))
        return None if e is None else self.reader.tensor(e)

    def before_call(self, name: str, call: int, device: torch.device | None = None) -> None:
        """At the real call's pre-hook: remember where the dropout mask stream and the RNG
        stand, so the replay draws what the real call drew (stochastic depth, random masks)."""
        if self.dropout is not None:
            self._mask_mark[(name, call)] = (self.dropout.index, len(self.dropout.masks))
        self._rng_mark[(name, call)] = rng_state(device)

    def replay(self, step: int, name: str, call: int, module: nn.Module, args: tuple,
               kwargs: dict, *, backward: bool,
               owner: Callable[[torch.Tensor], tuple[str, str] | None] = lambda p: None,
               ) -> list[tuple[str, str, torch.Tensor]]:
        """Run ``module`` on the reference inputs of this call: (phase, slot, tensor) captures.

        The module runs with the reference's parameters of this step (cast to the target's
        dtype): from step 1 on the target's own parameters carry the drift of earlier steps,
        which the params/optimizer entries judge; the replay measures the module's op alone.
        ``owner(param)`` names the (module, name) a parameter is recorded under (tied weights).
        Nothing is returned for a call whose reference inputs were not recorded."""
        mark = self._mask_mark.pop((name, call), None)
        rng = self._rng_mark.pop((name, call), None)
        results: list[tuple[str, str, torch.Tensor]] = []
        missing: list[str] = []
        needs_grad: set[str] = set()  # the inputs whose gradient the real call produced

        def ref_input(slot: str, t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad and t.is_floating_point():
                needs_grad.add(slot)
            r = self.tensor(step, "forward", name, call, slot)
            if r is None or tuple(r.shape) != tuple(t.shape):
                missing.append(slot)
                return t
            r = r.to(device=t.device, dtype=t.dtype) if t.is_floating_point() else r.to(t.device)
            # laid out as the live input (a channels_last map): a kernel may take another path,
            # and sum in another order, on another layout (diffusers' GroupNorm: 72 u apart)
            if t.layout != torch.strided:
                return r.clone()
            return torch.empty_like(t, dtype=r.dtype).copy_(r)

        r_args = substitute(args, "input", ref_input)
        r_kwargs = substitute(kwargs, "input", ref_input)
        ref_params = self._ref_params(step, name, module, owner)
        if missing or ref_params is None:
            return results
        leaves: list[tuple[str, torch.Tensor]] = []
        if backward:
            # Fresh leaves requiring grad; the module sees a non-leaf copy so in-place modules
            # (ReLU(inplace=True)) may write into it.
            def as_leaf(slot: str, t: torch.Tensor) -> torch.Tensor:
                if slot not in needs_grad:
                    return t
                leaf = t.detach().requires_grad_(True)
                leaves.append((slot, leaf))
                return leaf.clone()
            r_args = substitute(r_args, "input", as_leaf)
            r_kwargs = substitute(r_kwargs, "input", as_leaf)
        try:
            with self._isolated(module, mark, ref_params, rng), torch.set_grad_enabled(backward):
                out = module(*r_args, **r_kwargs)
                outs: list[tuple[str, torch.Tensor]] = []
                substitute(out, "output", lambda s, t: outs.append((s, t)))
                for slot, t in outs:
                    results.append(("forward", LOCAL_PREFIX + slot, t.detach()))
                if backward and leaves:
                    results += self._replay_backward(TraceKey(step, "backward", name, call, ""),
                                                     outs, leaves)
        except Exception as e:  # the model's code refused the replay: no local error, never a crash
            self.failed.setdefault(name, (step, f"{type(e).__name__}: {str(e).strip()[:200]}"))
            return []
        return results

    def findings(self) -> list[dict[str, Any]]:
        """``local.replay_failed`` (a warning) for each module whose replay raised: its entries
        have no local error and are judged by their propagated drift alone."""
        return [{"kind": "local.replay_failed", "severity": "warning", "module": name, "step": step,
                 "message": f"the local replay of {name} raised {err}; it has no local error, and its "
                            "drift is judged as propagated (the record itself is complete)"}
                for name, (step, err) in sorted(self.failed.items())]

    def _ref_params(self, step: int, name: str, module: nn.Module,
                    owner: Callable[[torch.Tensor], tuple[str, str] | None]
                    ) -> dict[str, nn.Parameter] | None:
        """The module's parameters as the reference had them at this step (cast to the
        target's dtype), or None where the reference holds one of them not."""
        ref_params: dict[str, nn.Parameter] = {}
        for k, p in module._parameters.items():
            if p is None:
                continue
            key = owner(p) or (name, k)
            rp = self.tensor(step, "params", key[0], 0, f"param.{key[1]}")
            if rp is None or tuple(rp.shape) != tuple(p.shape):
                return None
            ref_params[k] = nn.Parameter(rp.to(device=p.device, dtype=p.dtype), requires_grad=False)
        return ref_params

    def _replay_backward(self, at: TraceKey, outs: list[tuple[str, torch.Tensor]],
                         leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, torch.Tensor]]:
        """The replay's input gradients from the reference's output gradients (``at``: the
        call's backward key, its slot left empty)."""
        pairs = []
        for slot, t in outs:
            g = self.tensor(*at.with_slot("grad_" + slot))
            if t.requires_grad and g is not None and tuple(g.shape) == tuple(t.shape):
                g = g.to(device=t.device, dtype=t.dtype)
                pairs.append((t, g))
                # The recorded gradient of an output is its total: where the module also
                # computes another output from it (a router's scores from its logits), the
                # other output's share is already in it. The hook makes the replay's total at
                # this tensor the recorded one instead of adding that share a second time.
                t.register_hook(lambda _total, g=g: g)
        if not pairs:
            return []
        grads = torch.autograd.grad([t for t, _ in pairs], [x for _, x in leaves],
                                    grad_outputs=[g for _, g in pairs], allow_unused=True)
        return [("backward", LOCAL_PREFIX + "grad_" + slot, g.detach())
                for (slot, _), g in zip(leaves, grads) if g is not None]

    @contextlib.contextmanager
    def _isolated(self, module: nn.Module, mark: tuple[int, int] | None,
                  params: dict[str, nn.Parameter], rng: Any = None) -> Iterator[None]:
        # The replay works on copies of the buffers: writing the originals back afterwards would
        # bump their version counters, and BatchNorm saves running stats for its backward.
        originals = {k: b for k, b in module._buffers.items() if b is not None}
        for k, b in originals.items():
            module._buffers[k] = b.detach().clone()
        own_params = {k: module._parameters[k] for k in params}
        module._parameters.update(params)
        # The model's own forward hooks do not see the replay: an output collector (transformers
        # records router logits for an auxiliary loss that way) would take the replay's output
        # into the training graph. Pre-hooks stay: they may make the forward's inputs or weights.
        post_hooks = [(attr, getattr(module, attr)) for attr in _POST_HOOKS if getattr(module, attr, None)]
        for attr, hooks in post_hooks:
            setattr(module, attr, type(hooks)())
        dev = next((t.device for t in list(module.parameters()) + list(module.buffers())),
                   torch.device("cpu"))
        drop_state = None
        if self.dropout is not None and mark is not None:
            drop_state = (self.dropout.index, len(self.dropout.masks))
            self.dropout.index = mark[0]  # the real call's first mask index
        try:
            with fork_rng(dev):
                set_rng_state(rng)
                yield
        finally:
            for attr, hooks in post_hooks:
                setattr(module, attr, hooks)
            module._buffers.update(originals)
            module._parameters.update(own_params)
            if drop_state is not None:
                self.dropout.index = drop_state[0]
                del self.dropout.masks[drop_state[1]:]

    def close(self) -> None:
        self.reader.close()


def fork_rng(dev: torch.device) -> Any:
    if dev.type == "cpu" or not hasattr(torch, dev.type):  # lazy: no torch.lazy, no RNG of its own
        return torch.random.fork_rng(devices=[])
    try:
        return torch.random.fork_rng(devices=[dev.index or 0], device_type=dev.type)
    except (RuntimeError, AttributeError, TypeError):  # a backend without RNG state access
        return torch.random.fork_rng(devices=[])


def rng_state(device: torch.device | None) -> tuple[torch.Tensor, Any]:
    """The CPU generator's state, and the device's where it has one (no copy on the device)."""
    dev_state = None
    if device is not None and device.type != "cpu":
        try:
            mod = getattr(torch, device.type)
            dev_state = (mod, mod.get_rng_state(device.index or 0))
        except (AttributeError, RuntimeError, TypeError):  # a backend without RNG state access
            dev_state = None
    return torch.random.get_rng_state(), dev_state


def set_rng_state(state: tuple[torch.Tensor, Any] | None) -> None:
    if state is None:
        return
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        mod, dev_state = state[1]
        try:
            mod.set_rng_state(dev_state)
        except (AttributeError, RuntimeError, TypeError):
            pass

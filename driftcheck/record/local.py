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
- the forward hooks of the module and its submodules (the model's output collectors) are off,
  and their public Python attributes (a list the forward clears, a counter) are put back after;
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
from driftcheck.nested import flatten, substitute
from driftcheck.numerics.dtypes import unit_roundoff
from driftcheck.record.isolation import (
    POST_HOOKS,
    ModuleState,
    as_leaves,
    collected,
    drew,
    fork_rng,
    no_saved_tensors_hooks,
    ours,
    passed_through,
    rng_state,
    set_rng_state,
)
from driftcheck.record.own import Captured, ChildCall, Children, own_backward
from driftcheck.store.keys import LOCAL_PREFIX, TraceKey
from driftcheck.targets.faults import rerounded, stochastic_rounding


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
        # a compiled target's: fn -> that fn compiled with its settings (runner sets it)
        self.regional: Callable[[Any], Any] | None = None
        self._compiled: dict[int, Any] = {}  # id(module) -> its forward, compiled on its own
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

    def mask_index(self) -> int | None:
        """Where the dropout mask stream stands now (None without CPU-drawn masks)."""
        return None if self.dropout is None else self.dropout.index

    def replay(self, step: int, name: str, call: int, module: nn.Module, args: tuple,
               kwargs: dict, *, backward: bool,
               owner: Callable[[torch.Tensor], tuple[str, str] | None] = lambda p: None,
               compiled: bool = False) -> list[tuple[str, str, torch.Tensor]]:
        """Run ``module`` on the reference inputs of this call: (phase, slot, tensor) captures.

        The module runs with the reference's parameters of this step (cast to the target's
        dtype): from step 1 on the target's own parameters carry the drift of earlier steps,
        which the params/optimizer entries judge; the replay measures the module's op alone.
        ``owner(param)`` names the (module, name) a parameter is recorded under (tied weights).
        Nothing is returned for a call whose reference inputs were not recorded.

        ``compiled``: a call a compiled graph made (its inputs as the graph handed them, without
        autograd): replayed after the step through the module's forward compiled on its own
        (``regional``), its inputs' gradients where the reference has them; a call that draws
        random numbers (a dropout mask) gives nothing (the graph drew its own)."""
        mark = self._mask_mark.pop((name, call), None)
        rng = self._rng_mark.pop((name, call), None)
        results: list[tuple[str, str, torch.Tensor]] = []
        needs_grad: set[str] = set()  # the inputs whose gradient the real call produced
        refs = self._ref_inputs(step, name, call, args, kwargs, needs_grad)
        run: Callable[..., Any] = module
        if compiled:
            if self.regional is None:
                return results
            needs_grad |= {s for s, _ in list(flatten(args, "input")) + list(flatten(kwargs, "input"))
                           if self.tensor(step, "backward", name, call, "grad_" + s) is not None}
            run = self._compiled.get(id(module)) or self._compiled.setdefault(
                id(module), self.regional(module.forward))
            if self.dropout is not None:
                mark = (self.dropout.index, len(self.dropout.masks))
        drawn = len(self.dropout.masks) if self.dropout is not None else 0
        ref_params = self._ref_params(step, name, module, owner)
        if refs is None or ref_params is None:
            return results
        r_args, r_kwargs = refs
        leaves: list[tuple[str, torch.Tensor]] = []
        if backward:
            r_args, r_kwargs = as_leaves((r_args, r_kwargs), needs_grad, leaves)
        with self._isolated([(module, ref_params)], mark, rng), torch.set_grad_enabled(backward):
            dev = next((p.device for p in ref_params.values()), None)
            before = rng_state(dev) if compiled else None
            try:
                out = run(*r_args, **r_kwargs)
            except Exception as e:
                # a graph's tap hands positional tensors only: a call that took keywords (a
                # rotary embedding's position_ids) cannot be rebuilt, and gets no local entries;
                # an eager call the model's code refused: no local error, never a failed record
                if not compiled:
                    self.refused(name, step, e)
                return []
            if compiled and ((self.dropout is not None and len(self.dropout.masks) != drawn)
                             or drew(before, rng_state(dev))):
                return []  # it drew random numbers: not those the graph drew
            outs: list[tuple[str, torch.Tensor]] = []
            substitute(out, "output", lambda s, t: outs.append((s, t)))
            for slot, t in outs:
                results.append(("forward", LOCAL_PREFIX + slot, t.detach()))
            if backward and leaves:
                try:
                    results += self._replay_backward(TraceKey(step, "backward", name, call, ""),
                                                     outs, leaves)
                except Exception as e:
                    self.refused(name, step, e)
                    return []
        return results

    def refused(self, name: str, step: int, e: BaseException) -> None:
        """A replay the model's code refused (it raised): ``local.replay_failed``."""
        self.failed.setdefault(name, (step, f"{type(e).__name__}: {str(e).strip()[:200]}"))

    def findings(self) -> list[dict[str, Any]]:
        """``local.replay_failed`` (a warning) for each module whose replay raised: its entries
        have no local error and are judged by their propagated drift alone."""
        return [{"kind": "local.replay_failed", "severity": "warning", "module": name, "step": step,
                 "message": f"the local replay of {name} raised {err}; it has no local error, and its "
                            "drift is judged as propagated (the record itself is complete)"}
                for name, (step, err) in sorted(self.failed.items())]

    def replay_own(self, step: int, name: str, call: int, module: nn.Module, args: tuple,
                   kwargs: dict, children: list[ChildCall], *, backward: bool,
                   owner: Callable[[torch.Tensor], tuple[str, str] | None] = lambda p: None,
                   ) -> list[Captured]:
        """Run the composite ``module`` on the reference inputs of this call with each of its
        ``children`` calls answered from the reference's trace (record/own.py): only its own
        code computes. (module, call, phase, slot, tensor, meta) captures; none where the reference
        cannot answer every child call as the real run made it."""
        mark = self._mask_mark.pop((name, call), None)
        rng = self._rng_mark.pop((name, call), None)
        needs_grad: set[str] = set()
        refs = self._ref_inputs(step, name, call, args, kwargs, needs_grad)
        covered = {id(m) for c in children for m in c.module.modules()}
        swaps = []
        for path, m in module.named_modules(prefix=name):
            if id(m) in covered:
                continue
            params = self._ref_params(step, path, m, owner)
            if params is None:
                return []
            swaps.append((m, params))
        if refs is None or not swaps:
            return []
        # the coarsest operand the parent's code gets: its inputs and its children's answers
        # are rounded to their live dtypes, whatever dtype its own code computes in
        operand_u = max([unit_roundoff(t.dtype) for _, t in list(flatten(args, "input"))
                         + list(flatten(kwargs, "input")) + [x for c in children
                                                             for x in flatten(c.output, "output")]
                         if t.is_floating_point()], default=0.0)

        def one_pass(noise: bool) -> dict[tuple, torch.Tensor] | None:
            for c in children:
                c.done = False
            copies: dict[int, torch.Tensor] = {}  # one tensor in several inputs stays one
            fresh = substitute(refs, "input", lambda _s, t: copies.get(id(t)) if id(t) in copies
                               else copies.setdefault(id(t), t.clone()))
            return self._own_pass(step, name, call, module, fresh, children, swaps, mark, rng,
                                  needs_grad if backward else None, noise)
        results = one_pass(False)
        if not results:
            return []
        # A child whose outputs the model's own hooks collect (router logits for an auxiliary
        # loss) passes them on outside the parent's code: their gradient is not the parent's alone
        escaping = {c.name for c in children if collected(c.module)}
        results = {k: t for k, t in results.items()
                   if not (k[0] in escaping and k[2] == "backward" and k[3].startswith(LOCAL_PREFIX + "grad_output"))}
        # The same code once more with every op's result re-rounded stochastically: how much
        # its ops' rounding moves each result (a sum that cancels moves it by its terms' size)
        noisy = one_pass(True) or {}
        out: list[Captured] = []
        for key, t in results.items():
            meta: dict[str, Any] = {"operand_u": operand_u}
            n = noisy.get(key)
            if n is not None and n.shape == t.shape:
                a, b = n.double(), t.double()
                d = torch.where(a.isfinite() & b.isfinite(), a - b, 0.0).abs()  # -inf masks: 0
                meta["local_noise"] = [float(d.pow(2).mean().sqrt()) if d.numel() else 0.0,
                                       float(d.max()) if d.numel() else 0.0]
            out.append((*key, t, meta))
        return out

    def _own_pass(self, step: int, name: str, call: int, module: nn.Module, refs: tuple,
                  children: list[ChildCall], swaps: list, mark: Any, rng: Any,
                  needs_grad: set[str] | None, noise: bool) -> dict[tuple, torch.Tensor] | None:
        """One replay of a composite's own code: {(module, call, phase, slot): tensor}, or
        None where it could not run as the real call did. ``needs_grad``: the inputs to take
        gradients of (None: no backward); ``noise``: under stochastic rounding."""
        leaves: list[tuple[str, torch.Tensor]] = []
        r_args, r_kwargs = refs
        if needs_grad is not None:
            r_args, r_kwargs = as_leaves((r_args, r_kwargs), needs_grad, leaves)
        anchor = torch.zeros((), requires_grad=True)

        def lookup(phase: str, mod: str, c: int, slot: str) -> torch.Tensor | None:
            return self.tensor(step, phase, mod, c, slot)
        mode: Any = stochastic_rounding(step) if noise else contextlib.nullcontext()
        # the noisy pass re-rounds its operands too (the inputs, each child's answers, the
        # output gradients): their rounding, amplified where the code cancels, is noise as well
        operand = (lambda t: rerounded(mode, t)) if noise else None
        answers = Children(lookup, children, anchor, self.dropout, operand)
        results: dict[tuple, torch.Tensor] = {}
        try:
            with self._isolated(swaps, mark, rng), torch.set_grad_enabled(needs_grad is not None), mode:
                if operand is not None:
                    rounded: dict[int, torch.Tensor] = {}  # one tensor in several inputs stays one
                    r_args, r_kwargs = substitute((r_args, r_kwargs), "input", lambda _s, t: (
                        rounded.get(id(t)) if id(t) in rounded else rounded.setdefault(
                            id(t), operand(t) if t.is_floating_point() else t)))
                answers.install()
                try:
                    out = module(*r_args, **r_kwargs)
                finally:
                    answers.remove()
                outs = list(flatten(out, "output"))
                results.update({(name, call, "forward", LOCAL_PREFIX + s): t.detach() for s, t in outs})
                grads = own_backward(outs, lambda s: lookup("backward", name, call, s), leaves,
                                     anchor, operand) if needs_grad is not None else None
        except Exception:  # Abort, or the parent's code refusing an answer: no local entries
            return None
        if grads is not None and answers.backward_ok:
            results.update({(name, call, "backward", LOCAL_PREFIX + s): g for s, g in grads})
        results.update({c[:4]: c[4] for c in answers.captures if c[2] == "forward" or answers.backward_ok})
        return results

    def _ref_inputs(self, step: int, name: str, call: int, args: tuple, kwargs: dict,
                    needs_grad: set[str]) -> tuple[tuple, dict] | None:
        """(args, kwargs) with every tensor replaced by the reference's of this call (cast to
        the live one's dtype, on its device, in its layout), or None where one is missing.
        ``needs_grad`` receives the slots of the live inputs that require grad."""
        missing: list[str] = []
        # one live tensor passed as several inputs (attention's (h, h, h)) is one replayed
        # tensor too: its gradient is the sum of its uses, as the recorded one (record/autograd.py)
        same: dict[Any, torch.Tensor] = {}

        def ref_input(slot: str, t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad and t.is_floating_point():
                needs_grad.add(slot)
            key = (id(t.grad_fn), t.output_nr) if t.grad_fn is not None else id(t)
            if key in same:
                return same[key]
            r = self.tensor(step, "forward", name, call, slot)
            if r is None or tuple(r.shape) != tuple(t.shape):
                missing.append(slot)
                return t
            r = r.to(device=t.device, dtype=t.dtype) if t.is_floating_point() else r.to(t.device)
            # laid out as the live input (a channels_last map): a kernel may take another path,
            # and sum in another order, on another layout (diffusers' GroupNorm: 72 u apart)
            same[key] = r.clone() if t.layout != torch.strided else torch.empty_like(t, dtype=r.dtype).copy_(r)
            return same[key]

        r_args = substitute(args, "input", ref_input)
        r_kwargs = substitute(kwargs, "input", ref_input)
        return None if missing else (r_args, r_kwargs)

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
            if t.requires_grad and g is not None and tuple(g.shape) == tuple(t.shape) and not passed_through(t):
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
    def _isolated(self, swaps: list[tuple[nn.Module, dict[str, nn.Parameter]]],
                  mark: tuple[int, int] | None, rng: Any = None) -> Iterator[None]:
        """Each module of ``swaps`` runs with those parameters and copies of its buffers; the
        dropout stream rewound to ``mark``, the RNG forked and set to ``rng``."""
        # The replay works on copies of the buffers: writing the originals back afterwards would
        # bump their version counters, and BatchNorm saves running stats for its backward.
        undo: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        for module, params in swaps:
            originals = {k: b for k, b in module._buffers.items() if b is not None}
            for k, b in originals.items():
                module._buffers[k] = b.detach().clone()
            undo.append((module, originals, {k: module._parameters[k] for k in params}))
            module._parameters.update(params)
        module = swaps[0][0]
        # The model's own forward hooks do not see the replay (nor its children's answers): an
        # output collector (transformers records router logits for an auxiliary loss that way)
        # would take the replay's output into the training graph. Pre-hooks stay: they may make
        # the forward's inputs or weights.
        hooked = [(m, attr, getattr(m, attr)) for m in module.modules() for attr in POST_HOOKS
                  if getattr(m, attr, None)]
        for m, attr, hooks in hooked:  # driftcheck's own stay: its taps, an injected fault's
            keep = {i for i, h in getattr(m, "_forward_hooks", {}).items() if ours(h)}
            setattr(m, attr, type(hooks)((i, h) for i, h in hooks.items() if i in keep))
        state = [ModuleState(m) for m in module.modules()]  # its code's own Python state
        dev = next((t.device for t in list(module.parameters()) + list(module.buffers())),
                   torch.device("cpu"))
        drop_state = None
        if self.dropout is not None and mark is not None:
            drop_state = (self.dropout.index, len(self.dropout.masks))
            self.dropout.index = mark[0]  # the real call's first mask index
        try:
            with fork_rng(dev), no_saved_tensors_hooks():
                set_rng_state(rng)
                yield
        finally:
            for m, attr, hooks in hooked:
                setattr(m, attr, hooks)
            for st in state:
                st.restore()
            for module, originals, own_params in undo:
                module._buffers.update(originals)
                module._parameters.update(own_params)
            if drop_state is not None:
                self.dropout.index = drop_state[0]
                del self.dropout.masks[drop_state[1]:]

    def close(self) -> None:
        self.reader.close()

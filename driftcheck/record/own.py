"""Local replay of a composite module's own code: the code between its children.

A leaf module's local replay (record/local.py) reruns it on the reference's inputs. A composite
module's output mixes its children's errors with its own code's (a SwiGLU's product, a residual
add, an attention's softmax between its projections). Its *own* local error is measured by
rerunning it on the reference's inputs with every child call it made answered from the
reference's trace: a child's forward returns the reference's recorded outputs of that call, and
its backward returns the reference's recorded input gradients of that call. Only the parent's
own ops then differ from the reference. The replay captures what the parent's code computed:
- ``local.output.*`` / ``local.grad_input.*`` of the parent call (as a leaf's replay does);
- ``local.input.*`` of each child call (the inputs the parent's code made for it) and
  ``local.grad_output.*`` (the output gradients its backward made for it).

Dropout masks drawn by the parent's own code keep their index in the step's stream: a child
answered from the trace moves the stream to where the real child call left it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from driftcheck.nested import flatten, substitute
from driftcheck.record.isolation import passed_through
from driftcheck.store.keys import LOCAL_PREFIX

Capture = tuple[str, int, str, str, torch.Tensor]  # (module, call, phase, slot, tensor)
# with the meta of the entry: operand_u (the coarsest operand's unit roundoff), local_noise
Captured = tuple[str, int, str, str, torch.Tensor, dict]


@dataclasses.dataclass
class ChildCall:
    """One child call the parent made in the real run: what answers it in the replay."""

    module: nn.Module
    name: str
    call: int
    output: Any = None  # the real call's output (its structure; tensors replaced in the replay)
    mask_end: int | None = None  # the dropout stream's index when the call returned
    done: bool = False
    versions: dict[int, int] = dataclasses.field(default_factory=dict)  # id(input) -> its version then
    passed: dict[str, str] = dataclasses.field(default_factory=dict)  # output slot -> the input it is


class Abort(Exception):
    """The replay cannot answer a child call as the real run made it: no local entries."""


class Children:
    """The child calls of one parent call, answered from the reference's trace.

    Args:
        lookup: ``lookup(phase, module, call, slot)`` -> the reference's tensor or None.
        calls: the child calls of the real parent call, in order.
        anchor: a leaf every answer depends on, so autograd runs each answer's backward.
        dropout: the run's DropoutControl, or None.
    """

    def __init__(self, lookup: Any, calls: list[ChildCall], anchor: torch.Tensor,
                 dropout: Any, operand: Any = None) -> None:
        self.lookup, self.anchor, self.dropout = lookup, anchor, dropout
        self.operand = operand or (lambda t: t)  # what each answer goes through once cast
        self.queues: dict[int, list[ChildCall]] = {}
        for c in calls:
            self.queues.setdefault(id(c.module), []).append(c)
        self.captures: list[Capture] = []
        self.backward_ok = True
        self._saved: list[tuple[nn.Module, Any]] = []

    def install(self) -> None:
        """Each child's ``forward`` answers from the trace (hooks still fire around it)."""
        for calls in self.queues.values():
            mod = calls[0].module
            self._saved.append((mod, mod.__dict__.get("forward")))
            mod.forward = self._answer(mod)

    def remove(self) -> None:
        for mod, fwd in self._saved:
            if fwd is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = fwd
        self._saved = []

    def _answer(self, mod: nn.Module) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            queue = [c for c in self.queues[id(mod)] if not c.done]
            if not queue:
                raise Abort("a child called more often than in the real run")
            c = queue[0]
            c.done = True
            return self.answer(c, args, kwargs)
        return forward

    def answer(self, c: ChildCall, args: tuple, kwargs: dict) -> Any:
        """The reference's outputs of call ``c``, through an autograd node whose backward is
        the reference's input gradients of that call."""
        inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
        for slot, t in inputs:
            if t.is_floating_point() and self.lookup("forward", c.name, c.call, slot) is not None:
                self.captures.append((c.name, c.call, "forward", LOCAL_PREFIX + slot,
                                      t.detach().clone()))
        outs = list(flatten(c.output, "output"))
        ref: dict[str, torch.Tensor] = {}
        given = dict(inputs)
        for slot, t in outs:
            if given.get(c.passed.get(slot, "")) is not None:
                # an input the child returned as it is: the parent's own tensor, whose gradient
                # reaches it outside the child's code (the child's recorded input gradient lacks it)
                ref[slot] = given[c.passed[slot]]
                continue
            r = self.lookup("forward", c.name, c.call, slot)
            if r is None or tuple(r.shape) != tuple(t.shape):
                if t.is_floating_point():
                    raise Abort(f"{c.name}#{c.call} {slot}: not in the reference")
                continue
            ref[slot] = self.operand(r.to(device=t.device, dtype=t.dtype)) if t.is_floating_point() \
                else r.to(device=t.device, dtype=t.dtype)
        if self.dropout is not None and c.mask_end is not None:
            self.dropout.index = c.mask_end  # the masks the real child call drew
        float_slots = [s for s, t in outs if s in ref and t.is_floating_point() and s not in c.passed]
        grads_of = [(s, t) for s, t in inputs if t.requires_grad and t.is_floating_point()]
        if not float_slots:
            return substitute(c.output, "output", lambda s, t: ref.get(s, t))
        answered = Recorded.apply(self, c, float_slots, [s for s, _ in grads_of], self.anchor,
                                  *[ref[s] for s in float_slots], *[t for _, t in grads_of])
        by_slot = dict(zip(float_slots, answered))
        return substitute(c.output, "output",
                          lambda s, t: by_slot.get(s, ref.get(s, t)))

    def backward(self, c: ChildCall, out_slots: list[str], in_slots: list[str],
                 grads: tuple[torch.Tensor | None, ...], like: list[torch.Tensor]) -> list[Any]:
        """Capture the output gradients the parent's backward made; return the reference's
        input gradients of the call (cast as the inputs)."""
        for slot, g in zip(out_slots, grads):
            if g is not None and self.lookup("backward", c.name, c.call, "grad_" + slot) is not None:
                self.captures.append((c.name, c.call, "backward", LOCAL_PREFIX + "grad_" + slot,
                                      g.detach().clone()))
        out: list[Any] = []
        for slot, t in zip(in_slots, like):
            r = self.lookup("backward", c.name, c.call, "grad_" + slot)
            if r is None or tuple(r.shape) != tuple(t.shape):
                self.backward_ok = False  # the parent's input gradient would miss a term
                out.append(torch.zeros_like(t))
            else:
                out.append(self.operand(r.to(device=t.device, dtype=t.dtype)))
        return out


class Recorded(torch.autograd.Function):
    """A child call answered from the trace: forward gives the reference's outputs, backward
    the reference's input gradients (and hands the output gradients to ``Children``)."""

    @staticmethod
    def forward(ctx: Any, children: Children, c: ChildCall, out_slots: list[str],
                in_slots: list[str], anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        n = len(out_slots)
        ctx.children, ctx.c, ctx.out_slots, ctx.in_slots = children, c, out_slots, in_slots
        ctx.like = [torch.empty_like(t, device="meta") for t in tensors[n:]]
        ctx.devices = [t.device for t in tensors[n:]]
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        like = [torch.empty(t.shape, dtype=t.dtype, device=d) for t, d in zip(ctx.like, ctx.devices)]
        gin = ctx.children.backward(ctx.c, ctx.out_slots, ctx.in_slots, grads, like)
        return (None, None, None, None, None) + (None,) * len(ctx.out_slots) + tuple(gin)


def own_backward(outs: list[tuple[str, torch.Tensor]], ref_grad: Any, leaves: list[tuple[str, torch.Tensor]],
                 anchor: torch.Tensor, operand: Any = None) -> list[tuple[str, torch.Tensor]] | None:
    """The parent replay's input gradients from the reference's output gradients
    (``ref_grad(slot)``, each cast gone through ``operand``): (grad_input slot, gradient); None
    where no output has one."""
    pairs = []
    for slot, t in outs:
        g = ref_grad("grad_" + slot)
        if t.requires_grad and g is not None and tuple(g.shape) == tuple(t.shape) and not passed_through(t):
            g = g.to(device=t.device, dtype=t.dtype)
            g = operand(g) if operand is not None else g
            pairs.append((t, g))
            t.register_hook(lambda _total, g=g: g)  # the recorded total, as record/local.py
    if not pairs:
        return None
    grads = torch.autograd.grad([t for t, _ in pairs], [x for _, x in leaves] + [anchor],
                                grad_outputs=[g for _, g in pairs], allow_unused=True)
    return [("grad_" + slot, g.detach()) for (slot, _), g in zip(leaves, grads) if g is not None]

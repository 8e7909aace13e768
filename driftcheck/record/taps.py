"""Taps: capture that is part of a compiled graph (``torch.compile``: Dynamo, AOT autograd,
then inductor, aot_eager or a device's backend).

Under Dynamo the tracer's module hooks are traced into the user's graph, so they must be graph
code: no autograd-node walks, no tracer state read (each read would be a guard, each change a
recompilation). A hook traced there only calls two operators, registered here as ordered
side effects (``torch.library._register_effectful_op``: never dead-code eliminated, never
reordered among themselves, forward and backward alike):

- ``driftcheck::tap(tensors, tracer, module, where, slots) -> call``: a module call's inputs
  ("pre") or inputs and outputs ("post"). Its body runs when the compiled graph runs, on the
  real tensors, and hands them to the tracer's ordinary capture (copies or stats, meta, kink
  profiles), which numbers the call; the call's number comes back as a 0-d tensor, saved for
  the backward like any activation.
- ``driftcheck::grad_tap(grad, call, tracer, module, slot)``: the gradient of one output
  (a tensor hook on it) or of one input (a hook on a view of it that the module receives in
  its place: the gradient that flows through this module's own uses).

Everything else in the graph is the user's and fuses as it would untraced; what the taps read
must exist as a tensor, which is the one thing capture changes in the compiled code.
"""
from __future__ import annotations

import functools
import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.nested import flatten
from driftcheck.record import regroup
from driftcheck.store.keys import Slot

SEP = "\n"  # slot names travel as one string (a custom op takes no list of strings)
_TRACERS: dict[int, Any] = {}  # tracer id -> the tracer (weakly: a dropped tracer taps nothing)
_IDS = itertools.count(1)


# Defined with torch.library directly, not ``torch.library.custom_op``: its Python autograd
# layers cost ~10 us a call (~50 us where an input requires grad), paid ~10^2 times a step.
_LIB = torch.library.Library("driftcheck", "FRAGMENT")
_LIB.define("tap(Tensor[] tensors, int tracer, str module, str where, str slots) -> Tensor")
_LIB.define("grad_tap(Tensor grad, Tensor call, int tracer, str module, str slot) -> ()")


def tap(tensors: list[torch.Tensor], tracer: int, module: str, where: str, slots: str) -> torch.Tensor:
    """A module call's tensors, handed to the tracer when the compiled graph runs; returns the
    call's number (0-d int64) for its gradient taps."""
    owner = _owner(tracer)
    call = -1 if owner is None else owner.on_tap(module, where, slots.split(SEP), tensors)
    return torch.tensor(call, dtype=torch.int64)


def grad_tap(grad: torch.Tensor, call: torch.Tensor, tracer: int, module: str, slot: str) -> None:
    """One gradient of a module call, handed to the tracer when the backward graph runs."""
    owner = _owner(tracer)
    if owner is not None:
        owner.on_grad_tap(module, int(call), slot, grad)


_LIB.impl("tap", tap, "CompositeExplicitAutograd")
_LIB.impl("grad_tap", grad_tap, "CompositeExplicitAutograd")


@torch.library.register_fake("driftcheck::tap", lib=_LIB)
def _tap_fake(tensors: list[torch.Tensor], tracer: int, module: str, where: str,
              slots: str) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.register_fake("driftcheck::grad_tap", lib=_LIB)
def _grad_tap_fake(grad: torch.Tensor, call: torch.Tensor, tracer: int, module: str,
                   slot: str) -> None:
    return None


for _op in (torch.ops.driftcheck.tap.default, torch.ops.driftcheck.grad_tap.default):
    torch.library._register_effectful_op(_op, torch.library.EffectType.ORDERED)


def register(tracer: Any) -> int:
    """A number for ``tracer`` (what takes the taps: record/tapping.py ``GraphTaps``) that
    graph code can carry as a constant."""
    tid = next(_IDS)
    _TRACERS[tid] = weakref.ref(tracer)
    return tid


def unregister(tid: int) -> None:
    _TRACERS.pop(tid, None)


def _owner(tid: int) -> Any:
    ref = _TRACERS.get(tid)
    return ref() if ref is not None else None


# -- hooks as graph code ------------------------------------------------------------------------
def either(eager: Callable, compiled: Callable, post: bool, around: bool = True) -> Callable:
    """A module hook that runs ``compiled`` while Dynamo traces it into a graph and ``eager``
    otherwise (a model compiled whole, a submodule compiled alone, or no compile at all).

    Every hook shares one code object per kind (``AROUND_GRAPH``), which runs eagerly when
    Dynamo meets it as a frame of its own (``_run_eagerly_as_frames``). ``around``: the model
    runs compiled code, so the eager hook may run inside a compiled call, where nothing it
    calls may become a frame Dynamo compiles (off for an eager model: that guard costs
    microseconds a call)."""
    if around:
        eager = torch._dynamo.disable(eager)

    def tap_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.compiler.is_compiling():
            return compiled(module, args, kwargs)
        return eager(module, args, kwargs)

    def tap_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(module, args, kwargs, output)
        return eager(module, args, kwargs, output)

    return tap_post_hook if post else tap_pre_hook


def _run_eagerly_as_frames(*codes: Any) -> None:
    """Called as a frame of its own (a module called between the model's own graph breaks, or
    a compiled model's hooks around its graph) a hook runs eagerly, never compiled: each
    module's hook is a closure of its own, so compiling them as frames would recompile the same
    code once per module. Inlined into a frame Dynamo traces, the hook is still traced. The
    same for ``codes`` (graph code that does nothing outside a graph)."""
    skip = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    if skip is None:
        return
    for code in codes:
        skip(code)


AROUND_GRAPH = ("tap_pre_hook", "tap_post_hook")  # hook frames, never a break of the model's
_run_eagerly_as_frames(either(lambda *a: None, lambda *a: None, False, False).__code__,
                       either(lambda *a: None, lambda *a: None, True, False).__code__)


def _wants_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def pre(tid: int, name: str, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The pre-hook as graph code: tap the inputs; hand the module a view of each input that
    needs a gradient, hooked for this module's share of it (an in-place module, ReLU(inplace),
    gets the input itself: a hook on a view it rewrites would never fire)."""
    inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
    call = torch.ops.driftcheck.tap([t for _, t in inputs], tid, name, "pre",
                                    SEP.join(s for s, _ in inputs))
    if not any(_wants_grad(t) for _, t in inputs) or passes_through(module):
        return None
    inplace = getattr(module, "inplace", False) is True

    def hooked(slot: str, t: torch.Tensor) -> torch.Tensor:
        v = t if inplace else t.view_as(t)
        v.register_hook(functools.partial(_grad_hook, tid, name, "grad_" + slot, call))
        return v

    def one(slot: str, v: Any) -> Any:
        if _wants_grad(v):
            return hooked(slot, v)
        if type(v) in (tuple, list) and any(_wants_grad(x) for x in v):
            return type(v)(hooked(f"{slot}.{i}", x) if _wants_grad(x) else x
                           for i, x in enumerate(v))
        return v

    # Only tensors at the top of the call, or in a plain tuple/list there, are replaced: a
    # ModelOutput or cache object passes as it is (its tensors are tapped, not hooked).
    new_args = tuple(one(f"input.{i}", a) for i, a in enumerate(args))
    new_kwargs = {k: one(f"input.{k}", v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def passes_through(module: nn.Module) -> bool:
    """A call that returns its input as it is in eager mode (an Identity; a Dropout with p=0 or
    in eval): eager autograd gives it no node of its own, so an eager trace has no input
    gradient for it and its output gradient is its input's; its taps hook nothing in place of
    the input, so a compiled trace has the same entries."""
    if isinstance(module, nn.Identity):
        return True
    return isinstance(module, nn.modules.dropout._DropoutNd) and (module.p == 0 or not module.training)


def post(tid: int, name: str, hook_outputs: bool, module: nn.Module, args: tuple, kwargs: dict,
         output: Any) -> None:
    """The post-hook as graph code: tap the inputs (a floor's magnitudes read them) and the
    outputs; hook each output that needs a gradient where ``hook_outputs`` (not the root's
    where the loop's outputs are not the loss's)."""
    inputs = list(flatten(args, "input")) + list(flatten(kwargs, "input"))
    outputs = list(flatten(output, "output"))
    pairs = inputs + outputs
    call = torch.ops.driftcheck.tap([t for _, t in pairs], tid, name, "post",
                                    SEP.join(s for s, _ in pairs))
    if hook_outputs:
        _hook_outputs(tid, name, outputs, call)
    if not name:  # the root's call: the forward is in this graph, its gradient sums are known
        _report_regrouped(tid)
    return None


def _hook_outputs(tid: int, name: str, outputs: list[tuple[str, Any]], call: torch.Tensor) -> None:
    for slot, t in outputs:
        if _wants_grad(t):
            t.register_hook(functools.partial(_grad_hook, tid, name, "grad_" + slot, call))


# -- a module's forward compiled as a frame of its own ------------------------------------------
FORWARD_FRAME = "tap_forward_"  # the code name of each forward_tap (one code object per module)
# The lines where a forward_tap calls the module's forward: a graph break placed there is the
# module's own (an nn.LSTM, which Dynamo does not trace), not the capture's (record/compilation.py)
FORWARD_CALL_LINES: set[int] = set()
_MISSING = object()


def forward_tap(tid: int, name: str, root_grads: bool, module: nn.Module) -> Callable | None:
    """The forward of ``module`` with its output gradients hooked as graph code, for a model
    that runs compiled code: None where it cannot be (a forward without Python code of its own)
    or need not (Dynamo would never compile the forward as a frame of its own).

    Dynamo runs a module's hooks eagerly around its ``forward`` where it compiles the forward
    as a frame of its own (``module.compile()``; a module called from a frame Dynamo skipped),
    and an eager hook on an output sees only the gradient from outside the compiled code, not
    the share of a use inside it. Called in place of ``forward`` (``GraphTaps.tap_forwards``), this is
    that frame: its output hooks are traced into the graph and get the whole gradient, as where
    Dynamo inlines the module's hooks. Each module gets a code object of its own, so the frames
    of two modules are two compiles, not recompilations of one code. Its output tap numbers
    the call the module's pre-hook opened (``GraphTaps.on_tap``), eager or traced alike."""
    forward = module.forward
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    if code is None:
        return None
    inbuilt = type(module).__module__.startswith(("torch.nn.", "torch.ao."))
    if not inbuilt and torch._dynamo.trace_rules.check(code):
        return None  # skipped as a frame (torch's own code, a disabled forward): left as it is
    before = module.__dict__.get("forward", _MISSING)
    frame = f"{FORWARD_FRAME}{next(_IDS)}"
    if before is _MISSING:
        # The class's forward, bound to the module: a deep copy of the module (an EMA model)
        # gets a forward_tap bound to itself, never a call of this module's forward.
        wrapped = type(module).forward

        def tap_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            output = wrapped(self, *args, **kwargs)
            _tap_outputs(tid, name, root_grads, output, frame)
            return output
    else:  # a forward the module was given (a hook library's): called as it is
        wrapped = before

        def tap_forward(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            output = before(*args, **kwargs)
            _tap_outputs(tid, name, root_grads, output, frame)
            return output

    FORWARD_CALL_LINES.add(tap_forward.__code__.co_firstlineno + 1)  # its body's first line
    own = tap_forward.__code__.replace(co_name=frame)
    fn: Any = types.FunctionType(own, tap_forward.__globals__, own.co_name, None, tap_forward.__closure__)
    fn = functools.update_wrapper(fn, wrapped)  # its signature is the forward's (Trainer reads it)
    fn.__name__ = own.co_name
    fn._driftcheck_replaces = before
    return types.MethodType(fn, module) if before is _MISSING else fn


def _tap_outputs(tid: int, name: str, root_grads: bool, output: Any, frame: str) -> None:
    """A forward_tap's graph code: tap the outputs that need a gradient (the tap numbers the
    call the module's pre-hook opened) and hook them in the graph; only where the forward tap
    is the frame Dynamo compiles (``frame``, or a resume function of it). Inlined into an
    enclosing frame, the module's hooks are traced too, and its post-hook hooks the outputs."""
    if torch.compiler.is_compiling() and (name or root_grads) and _compiling_frame(frame):
        outputs = [(s, t) for s, t in flatten(output, "output") if _wants_grad(t)]
        if outputs:
            call = torch.ops.driftcheck.tap([t for _, t in outputs], tid, name, "out",
                                            SEP.join(s for s, _ in outputs))
            _hook_outputs(tid, name, outputs, call)
        _report_regrouped(tid)


@torch._dynamo.assume_constant_result  # called while Dynamo traces, a constant in the graph
def _compiling_frame(frame: str) -> bool:
    """Whether the frame Dynamo compiles now is ``frame`` or a resume function of it (True
    where Dynamo does not say: an output tap too many is ignored, one too few is a gap)."""
    output = _tracing()
    if output is None:
        return True
    root = output.root_tx.f_code.co_name
    return root == frame or root.startswith(f"torch_dynamo_resume_in_{frame}_at_")


def _tracing() -> Any:
    """What Dynamo is building now (its OutputGraph: the graph, the root frame), or None where
    it does not say; for the ``assume_constant_result`` functions called while it traces."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().output
    except (AttributeError, ImportError, RuntimeError):
        return None


_run_eagerly_as_frames(_tap_outputs.__code__)  # from a forward tap run eagerly: not compiled


def _report_regrouped(tid: int) -> None:
    """Graph code: the modules whose input view (``pre``) regroups a gradient sum in the graph
    traced so far, handed to the tracer (``tracer.findings``, "compile.regrouped_gradients")."""
    names = _regrouped()
    if names:
        torch.ops.driftcheck.tap([], tid, names, REGROUPED, "")


REGROUPED = "regrouped"  # the ``where`` of that tap


@torch._dynamo.assume_constant_result  # called while Dynamo traces, a constant in the graph
def _regrouped() -> str:
    output = _tracing()
    if output is None:
        return ""
    try:
        return SEP.join(sorted(regroup.regrouping(output.graph)))
    except Exception:  # a graph it does not know: no finding, never a failed compile
        return ""


def where(t: torch.Tensor) -> tuple:
    """Where a tensor's values are: the same graph output, seen inside and outside its graph."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def uninstall(module: nn.Module) -> None:
    fn: Any = module.__dict__.get("forward")
    if hasattr(fn, "_driftcheck_replaces"):
        before = fn._driftcheck_replaces
        if before is _MISSING:
            del module.forward
        else:
            module.forward = before


def _grad_hook(tid: int, name: str, slot: str, call: torch.Tensor, grad: torch.Tensor) -> None:
    if grad is not None:
        torch.ops.driftcheck.grad_tap(grad, call, tid, name, slot)
    return None


def positional(pairs: list[tuple[str, torch.Tensor]]) -> tuple:
    """The call's positional tensor arguments, rebuilt from tapped slots ("input.0", ...)."""
    out: list[torch.Tensor] = []
    for slot, t in pairs:
        s = Slot.parse(slot)
        if s.kind == "input" and s.path.isdigit() and int(s.path) == len(out):
            out.append(t)
    return tuple(out)


# -- compiled models ----------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside ``torch.compile(model)``: its paths carry no ``_orig_mod.``."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) and \
            type(model).__name__ == "OptimizedModule":
        model = model._orig_mod  # type: ignore[assignment]  # an nn.Module: checked above
    return model


def compiled(model: nn.Module) -> bool:
    """Whether calling ``model`` runs compiled code: the model compiled whole
    (``torch.compile(model)``) or a submodule compiled in place (``module.compile()``)."""
    if type(model).__name__ == "OptimizedModule":
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())

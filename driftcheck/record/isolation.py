"""What a local replay leaves as it found it (record/local.py): the model's own forward hooks
(off during it; driftcheck's taps and injected faults stay), its modules' public Python
attributes (put back after it), and the random number generators (forked, set to the real call's
state), the live parameters' gradients (kept). Also the fresh autograd leaves a replay's
backward starts from."""
from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from driftcheck.nested import CACHE, LEAF, MAPPING, SEQUENCE, fold, substitute

POST_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def ours(hook: Any) -> bool:
    """Whether a hook is driftcheck's own (a tap, an injected fault), not the model's."""
    fn = getattr(hook, "func", hook)  # a functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return str(getattr(fn, "__module__", "") or "").startswith("driftcheck.")


def collected(m: nn.Module) -> bool:
    """Whether ``m`` has forward hooks of the model's own (an output collector)."""
    return any(not ours(h) for h in getattr(m, "_forward_hooks", {}).values())


class ModuleState:
    """A module's public attributes as they stand (a collector list, a counter, a cache dict),
    put back after a replay: the model's own code run again must not change what the real run
    reads next (a forward that clears a list of router logits before the loss reads it)."""

    def __init__(self, m: nn.Module) -> None:
        self.m = m
        self.bound = {k: v for k, v in vars(m).items() if not k.startswith("_")}
        self.contents = {k: copy.copy(v) for k, v in self.bound.items() if type(v) in (list, dict, set)}

    def restore(self) -> None:
        d = vars(self.m)
        for k in [k for k in d if not k.startswith("_") and k not in self.bound]:
            del d[k]
        d.update(self.bound)
        for k, saved in self.contents.items():
            v = self.bound[k]
            v.clear()
            v.update(saved) if not isinstance(v, list) else v.extend(saved)


def as_leaves(args_kwargs: tuple[tuple, dict], needs_grad: set[str],
              leaves: list[tuple[str, torch.Tensor]]) -> tuple[tuple, dict]:
    """Fresh leaves requiring grad for the inputs ``needs_grad`` names (into ``leaves``); the
    module sees a non-leaf copy so in-place modules (ReLU(inplace=True)) may write into it. One
    tensor in several inputs is one leaf, its gradient the sum of its uses, listed under the
    last of those inputs (as the recorded gradient is: record/autograd.py)."""
    made: dict[int, torch.Tensor] = {}

    def as_leaf(slot: str, t: torch.Tensor) -> torch.Tensor:
        if slot not in needs_grad:
            return t
        leaf = made.get(id(t))
        if leaf is None:
            leaf = made[id(t)] = t.detach().requires_grad_(True)
        else:
            leaves[:] = [(s, x) for s, x in leaves if x is not leaf]
        leaves.append((slot, leaf))
        given = leaf.clone()
        given._driftcheck_input = given._version  # type: ignore[attr-defined]  # passed_through()
        return given
    args, kwargs = args_kwargs
    return private_state(substitute(args, "input", as_leaf)), private_state(substitute(kwargs, "input", as_leaf))


def _containers_copied(o: Any, depth: int) -> Any:
    """A copy of ``o`` whose lists, dicts, sets and objects are copies down to ``depth`` and
    whose tensors are the same tensors (a cache's update reassigns them: torch.cat)."""
    container = isinstance(o, (list, dict, set, tuple))
    if isinstance(o, (torch.Tensor, nn.Module)) or depth < 0 or (type(o).__module__ == "builtins"
                                                                 and not container):
        return o
    if isinstance(o, (list, tuple, set)):
        return type(o)(_containers_copied(v, depth - 1) for v in o)
    if isinstance(o, dict):
        return {k: _containers_copied(v, depth - 1) for k, v in o.items()}
    try:
        c = copy.copy(o)
        for k, v in vars(c).items():
            setattr(c, k, _containers_copied(v, depth - 1))
        return c
    except Exception:
        return o


def _stateful(o: Any, k: str) -> bool:
    return k == CACHE or (k == LEAF and not isinstance(o, nn.Module) and type(o).__module__ != "builtins"
                          and any(callable(getattr(o, a, None)) for a in ("get_seq_length", "update")))


def holds_state(obj: Any) -> bool:
    """Whether ``obj`` holds a cache (``private_state``'s), anywhere in its structure."""
    def found(path: str, o: Any, k: str, children: Any) -> bool:
        return _stateful(o, k) or (k in (MAPPING, SEQUENCE) and any(v for _, v in children()))
    return fold(obj, "", found)


def private_state(obj: Any) -> Any:
    """``obj`` with every cache in it (a Hugging Face ``Cache``; any object that keeps state
    across calls the way one does: ``get_seq_length``, ``update``) replaced by a deep copy: the
    replay's attention must not write into the live run's cache (Reformer's bucket cache took a
    replay's buckets, and the next layer joined float32 to its int64 ones)."""
    def own(o: Any, k: str) -> Any:
        if not _stateful(o, k):
            return o
        try:
            return copy.deepcopy(o)
        except Exception:  # tensors of the live graph (deepcopy takes leaves only)
            return _containers_copied(o, 3)
    return substitute(obj, "", lambda _s, t: t, own)


def passed_through(t: torch.Tensor) -> bool:
    """Whether a replay's output is an input the module was given, returned as it is (a
    Bottleneck's ``hidden_states``, an attention's ``position_bias``): its gradient reaches the
    input outside the module's code, which the recorded input gradient does not hold."""
    given = getattr(t, "_driftcheck_input", None)
    return given is not None and given == t._version  # not written in place (ReLU(inplace=True))


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


def drew(before: Any, after: tuple[torch.Tensor, Any]) -> bool:
    """Whether the generators moved between two ``rng_state`` readings."""
    if not torch.equal(before[0], after[0]):
        return True
    b, a = before[1], after[1]
    return b is not None and a is not None and not torch.equal(b[1].cpu(), a[1].cpu())


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


@contextlib.contextmanager
def no_saved_tensors_hooks() -> Iterator[None]:
    """The saved-tensor hooks in force suspended for the block (torch.utils.checkpoint's
    non-reentrant recomputation counts and checks every tensor its region saves; activation
    offloading moves them): a replay's saved tensors are not the run's, and the run's own
    recomputation must find exactly what its forward saved."""
    stack = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


class KeptGrads:
    """The live parameters' gradients, as they are while a replay runs: a replay's backward
    that reaches code calling ``torch.autograd.backward`` itself (a reversible layer's custom
    Function recomputes its blocks and backpropagates through them with the live parameters)
    would accumulate into their ``.grad``. Each parameter's tensor hook (registered once, at
    attach) hands autograd zeros instead while a replay runs; a gradient that was None is put
    back to None after it. ``forget``: called with such a parameter (the record drops what its
    post-accumulate hook took)."""

    def __init__(self, forget: Callable[[torch.Tensor], None]) -> None:
        self.active = False
        self.forget = forget
        self._none: dict[int, torch.Tensor] = {}

    def hook(self, p: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor | None]:
        ref = weakref.ref(p)

        def keep(g: torch.Tensor) -> torch.Tensor | None:
            if not self.active:
                return None
            q = ref()
            if q is not None and q.grad is None:
                self._none[id(q)] = q
            return torch.zeros_like(g)
        return keep

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for p in self._none.values():
                p.grad = None
                self.forget(p)
            self._none.clear()

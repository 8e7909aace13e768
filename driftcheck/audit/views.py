"""The view/in-place audit: a dispatch mode that records what every view and write did to memory.

On a correct backend a view shares its base's storage and a write through it reaches the base.
``ViewAudit`` records, per aten call, whether that held (storage identity, ``_base``), the layout
(sizes, strides, storage offset) and a cheap fingerprint of the written base's values; run it on
the reference and on the target, then ``compare_events`` aligns the two logs per step and module
and names what the target got wrong:

- ``view.alias_lost``: the target made a copy where the reference made a view;
- ``inplace.base_not_updated``: a write through a view did not reach its base on the target;
- ``inplace.value_mismatch``: after a write through a view, the base's values differ beyond
  tolerance although both sides aliased;
- ``view.layout_mismatch``: sizes, strides or offset of a view differ although its input's did not.

Cost: host-side storage checks per op, plus O(numel) float reductions of the base for writes
through views only, kept on the device (no sync) until ``events()`` is read. Active only inside
``with ViewAudit(...):``; ``paused()`` excludes the tracer's own captures.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck import dtypes
from driftcheck.report import Finding

__all__ = ["ViewAudit", "compare_events"]

_WEIGHT_PERIOD = 251  # checksum weights 1 + (i mod 251)/251: position-sensitive, never zero


class ViewAudit(TorchDispatchMode):
    """Record view and in-place aten ops while active.

    Args:
        module_of: returns the module path currently running (the tracer's module stack).
        step_of: returns the current training step (None: every event has step 0).

    Example:
        >>> audit = ViewAudit(lambda: tracer.current_module)
        >>> with audit:
        ...     loss = model(x).sum(); loss.backward()
        >>> findings = compare_events(ref_events, audit.events(), value_tolerance=1e-2)
    """

    def __init__(self, module_of: Callable[[], str], step_of: Callable[[], int] | None = None):
        super().__init__()
        self._module_of = module_of
        self._step_of = step_of
        self._events: list[dict[str, Any]] = []
        self._pending: list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]] = []
        self._counts: dict[tuple[int, str], int] = {}
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside this block are not recorded (the tracer's own clones and copies)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def events(self) -> list[dict[str, Any]]:
        """The recorded events, in execution order, as plain JSON-ready dicts."""
        for event, before, after in self._pending:  # one host transfer per event, done late
            if after is not None:
                values = after.to("cpu", torch.float64).tolist()
                event["value"] = dict(zip(("sum", "abs_sum", "checksum", "checksum_scale"), values))
                if before is not None:
                    event["base_changed"] = not _same(before.to("cpu", torch.float64).tolist(),
                                                      values)
        self._pending.clear()
        return self._events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func)
        if self._paused or kind is None:
            return func(*args, **kwargs)
        step = self._step_of() if self._step_of is not None else 0
        module = self._module_of()
        if kind == "view":
            out = func(*args, **kwargs)
            source = next((a for a in args if _strided(a)), None)
            outs = out if isinstance(out, (list, tuple)) else [out]
            for i, o in enumerate(outs):
                if _strided(o):
                    event = self._event(step, module, func, kind, f"return.{i}", o)
                    event["aliased"] = _shares(o, source) if source is not None else None
                    if source is not None:
                        event["input_layout"] = _layout(source)
            return out
        written = [(name, t) for name, t in _written(func, args, kwargs) if _strided(t)]
        starts = []
        for name, t in written:
            base = _base_of(t)
            aliased = base is not None and _shares(t, base)
            starts.append((name, t, base if aliased else None,
                           _fingerprint(base) if aliased else None, aliased))
        out = func(*args, **kwargs)
        for name, t, base, before, aliased in starts:
            event = self._event(step, module, func, kind, name, t)
            event["aliased"] = aliased
            event["base_changed"] = None
            # Only writes through views are fingerprinted: a plain write's values are the
            # numeric comparison's business, and skipping them keeps optimizer steps cheap.
            event["value"] = None
            if aliased:
                self._pending.append((event, before, _fingerprint(base)))
        return out

    def _event(self, step: int, module: str, func: Any, kind: str, arg: str,
               t: torch.Tensor) -> dict[str, Any]:
        index = self._counts.get((step, module), 0)
        self._counts[(step, module)] = index + 1
        event = {"step": step, "module": module, "op": str(func), "kind": kind, "index": index,
                 "arg": arg, "dtype": str(t.dtype).removeprefix("torch."), **_layout(t)}
        self._events.append(event)
        return event


def compare_events(
    ref: list[dict[str, Any]],
    tgt: list[dict[str, Any]],
    value_tolerance: Callable[[dict[str, Any], dict[str, Any]], float] | float | None = None,
) -> list[Finding]:
    """Findings where the target's view/in-place behaviour departs from the reference's.

    Events are aligned per (step, module) by their sequence of (op, argument), so an extra or
    missing op on one side (a backend decomposing differently) shifts nothing else.

    Args:
        ref, tgt: ``ViewAudit.events()`` of the reference and the target run.
        value_tolerance: the largest accepted relative difference of the written base's
            fingerprint (difference over the fingerprint's magnitude): a float, a callable
            ``(ref_event, tgt_event) -> float``, or None for 16 unit roundoffs of the less
            precise of the two dtypes (enough for one op; pass more when drift accumulates
            upstream, e.g. fp32 vs bf16 end to end).
    """
    found: list[tuple[int, Finding]] = []
    order = {id(e): i for i, e in enumerate(tgt)}
    for r_events, t_events in _groups(ref, tgt).values():
        matcher = difflib.SequenceMatcher(None, [_label(e) for e in r_events],
                                          [_label(e) for e in t_events], autojunk=False)
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                r, t = r_events[block.a + k], t_events[block.b + k]
                finding = _judge(r, t, value_tolerance)
                if finding is not None:
                    found.append((order[id(t)], finding))
    return [f for _, f in sorted(found, key=lambda pair: pair[0])]  # target execution order


def _judge(r: dict[str, Any], t: dict[str, Any], tolerance: Any) -> Finding | None:
    where = f"{r['op']} ({r['arg']}, op #{t['index']} of {r['module'] or '<model>'})"

    def finding(kind: str, message: str, **details: Any) -> Finding:
        return Finding(kind=kind, module=r["module"], step=r["step"],
                       message=f"{where}: {message}",
                       details={"op": r["op"], "arg": r["arg"], "index": t["index"], **details})

    if r.get("aliased") and t.get("aliased") is False:
        what = "returned a copy" if r["kind"] == "view" else "wrote into a copy"
        return finding("view.alias_lost",
                       f"the target {what} where the reference aliased its input's storage; "
                       "writes through it will not reach the original tensor")
    if not (r.get("aliased") and t.get("aliased")):
        return None
    if r["kind"] == "view":
        same_input = r.get("input_layout") == t.get("input_layout")
        if r["sizes"] != t["sizes"] or (same_input and _layout_of(r) != _layout_of(t)):
            return finding("view.layout_mismatch",
                           f"view layout {_layout_of(t)} on the target, {_layout_of(r)} on the "
                           "reference", reference=_layout_of(r), target=_layout_of(t))
        return None
    if r.get("base_changed") and t.get("base_changed") is False:
        return finding("inplace.base_not_updated",
                       "a write through a view changed its base on the reference but left it "
                       "unchanged on the target")
    rv, tv = r.get("value"), t.get("value")
    if rv and tv:
        tol = tolerance(r, t) if callable(tolerance) else tolerance
        if tol is None:
            tol = 16 * max(dtypes.unit_roundoff(r["dtype"]), dtypes.unit_roundoff(t["dtype"]))
        err = _value_error(rv, tv)
        if err > tol:
            return finding("inplace.value_mismatch",
                           f"the base after the write differs by {err:.3g} (relative to its "
                           f"magnitude; tolerance {tol:.3g})", error=err, tolerance=tol)
    return None


# Aliases autograd makes for itself (saving tensors for backward, .detach() in hooks): which
# tensors get saved depends on the dtype path (a bf16 run casts where an fp32 run does not), so
# they say nothing about the backend's view semantics and would misalign the two runs' events.
_AUTOGRAD_ALIASES = frozenset({"detach", "alias", "lift_fresh"})


@functools.lru_cache(maxsize=None)
def _kind(func: Any) -> str | None:
    """"view", "inplace", "out" or None, from the op's schema alias annotations."""
    schema = func._schema
    if schema.name.split("::")[-1] in _AUTOGRAD_ALIASES:
        return None
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if writes:
        return "out" if any(a.kwarg_only for a in writes) else "inplace"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return None


def _written(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, torch.Tensor):
            out.append((arg.name, value))
        elif isinstance(value, (list, tuple)):  # _foreach_*_: one event per list element
            out.extend((f"{arg.name}.{j}", v) for j, v in enumerate(value)
                       if isinstance(v, torch.Tensor))
    return out


def _strided(t: Any) -> bool:
    # Sparse, nested and meta tensors have no storage/strides to compare: not audited.
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def _base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a write to ``t`` must reach: its autograd base, else its whole storage."""
    if t._is_view() and t._base is not None:
        return t._base
    if t.numel() == 0 or t.is_quantized:
        return None
    itemsize = t.element_size()
    whole = t.untyped_storage().nbytes() // itemsize
    if t.storage_offset() == 0 and t.numel() == whole and t.is_contiguous():
        return None  # not a view of anything: it is all of its storage
    # ``.data`` of a view, ``set_``: a partial window on a storage with no autograd base.
    return t.new_empty(0).set_(t.untyped_storage(), 0, (whole,), (1,))


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, functional)
        return False


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """(sum, sum |x|, sum x*w, sum |x|*w) on t's device: cheap, dtype-robust, position-aware."""
    if t.is_quantized:
        return None
    acc = torch.float64 if t.device.type in ("cpu", "cuda") else torch.float32
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(acc)
    w = 1.0 + torch.remainder(torch.arange(x.numel(), device=x.device, dtype=acc),
                              _WEIGHT_PERIOD) / _WEIGHT_PERIOD
    a = x.abs()
    return torch.stack([x.sum(), a.sum(), (x * w).sum(), (a * w).sum()])


def _layout(t: torch.Tensor) -> dict[str, Any]:
    return {"sizes": list(t.shape), "strides": list(t.stride()),
            "storage_offset": int(t.storage_offset())}


def _layout_of(e: dict[str, Any]) -> dict[str, Any]:
    return {"sizes": e["sizes"], "strides": e["strides"], "storage_offset": e["storage_offset"]}


def _label(e: dict[str, Any]) -> str:
    return f"{e['op']}|{e['arg']}"


def _groups(ref: list[dict[str, Any]], tgt: list[dict[str, Any]]) -> dict[tuple, tuple]:
    groups: dict[tuple, tuple[list, list]] = {}
    for side, events in ((0, ref), (1, tgt)):
        for e in events:
            groups.setdefault((e["step"], e["module"]), ([], []))[side].append(e)
    return groups


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _value_error(r: dict[str, float], t: dict[str, float]) -> float:
    """Largest fingerprint difference over its magnitude (not over the possibly-cancelled value)."""
    err = 0.0
    for value, scale in (("sum", "abs_sum"), ("checksum", "checksum_scale")):
        a, b = r[value], t[value]
        if (math.isnan(a) and math.isnan(b)) or a == b:
            continue
        magnitude = max(r[scale], t[scale])
        diff = abs(a - b)
        if math.isnan(diff) or math.isinf(diff):
            return math.inf
        err = max(err, diff / magnitude if magnitude > 0 else math.inf)
    return err

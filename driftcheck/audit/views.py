"""The view/in-place audit: a dispatch mode that records what every view and write did to memory.

On a correct backend a view shares its base's storage and a write through it reaches the base.
``ViewAudit`` records, per aten call, whether that held (storage identity, ``_base``), the layout
(sizes, strides, storage offset; for views also the input's layout and the op's non-tensor
arguments) and a cheap fingerprint of the written base's values before and after the write; run
it on the reference and on the target, then ``compare_events`` pairs each event per step and
module with the same observable event of the other run (events a backend's other lowering of
an op adds, drops or reorders have none, and are not judged) and names what the target got wrong:

- ``view.alias_lost``: the target made a copy where the reference made a view;
- ``inplace.base_not_updated``: a write through a view did not reach its base on the target;
- ``inplace.value_mismatch``: a write through a view left the base with other values although
  both sides aliased and the bases agreed before it (exactly for integer and bool tensors);
- ``view.layout_mismatch``: the same view op, on an input of the same layout, with the same
  arguments and output sizes, gave other strides or another offset;
- ``view.write_not_through_view``: a write the reference made through a view, the target made
  into a tensor of its own (its view op returned a copy: audit/writes.py).

Cost: host-side storage checks per op, plus O(numel) reductions of the base for writes through
views only (float64, or exact int64 for integer/bool tensors), kept on the device (no sync) until
``events()`` is read. Active only inside ``with ViewAudit(...):``; ``paused()`` excludes the
tracer's own captures.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck import nested
from driftcheck.audit import aliasing, fingerprint as fp, writes
from driftcheck.gate.report import Finding
from driftcheck.numerics import dtypes
from driftcheck.targets import devices

__all__ = ["ViewAudit", "compare_events", "not_observed"]



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
        self._storage: dict[str, bool] = {}  # device type -> its storage can be inspected
        self._fresh: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

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
                values = after.cpu().tolist()  # floats, or exact ints for integer/bool bases
                event["value"] = dict(zip(fp.FIELDS, values))
                if before is not None:
                    old = before.cpu().tolist()
                    event["value_before"] = dict(zip(fp.FIELDS, old))
                    event["base_changed"] = not fp.same(old, values)
        self._pending.clear()
        return self._events

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = aliasing.op_kind(func)
        if kind is None and not self._paused and aliasing.allocates_uninitialised(func):
            out = func(*args, **kwargs)  # uninitialised memory: its writes are marked ``fresh``
            if aliasing.strided(out) and self._inspectable((out,)):
                self._fresh_memory(out)
            return out
        if self._paused or not self._inspectable(args) or kind is None:
            return func(*args, **kwargs)
        step = self._step_of() if self._step_of is not None else 0
        module = self._module_of()
        if kind == "view":
            out = func(*args, **kwargs)
            source = next((a for a in args if aliasing.strided(a)), None)
            outs = out if isinstance(out, (list, tuple)) else [out]
            plain = [nested.fold(a, "", _plain) for a in (*args, *sorted(kwargs.items()))]
            for i, o in enumerate(outs):
                if aliasing.strided(o):
                    event = self._event(step, module, func, kind, f"return.{i}", o)
                    event.update(aliased=aliasing.shares(o, source) if source is not None else None,
                                 args=plain)
                    if source is not None:
                        event["input_layout"] = aliasing.layout(source)
            return out
        written = [(name, t) for name, t in aliasing.written(func, args, kwargs) if aliasing.strided(t)]
        starts = []
        for name, t in written:
            base = aliasing.base_of(t)
            aliased = base is not None and aliasing.shares(t, base)
            starts.append((name, t, base if aliased else None,
                           fp.fingerprint(base) if aliased and base is not None else None, aliased))
        out = func(*args, **kwargs)
        for name, t, base, before, aliased in starts:
            event = self._event(step, module, func, kind, name, t)
            event["aliased"] = aliased
            event["base_changed"] = None
            # Only writes through views are fingerprinted: a plain write's values are the
            # numeric comparison's business, and skipping them keeps optimizer steps cheap.
            event["value"] = None
            if aliased and base is not None:  # a view's base: aliased says it is there
                self._pending.append((event, before, fp.fingerprint(base)))
                if base.untyped_storage().data_ptr() in self._fresh:
                    event["fresh"] = True  # into memory an allocation left uninitialised
        return out

    def _fresh_memory(self, t: torch.Tensor) -> None:
        """``t``'s memory is uninitialised (held weakly: the entry goes with the tensor)."""
        try:
            self._fresh[t.untyped_storage().data_ptr()] = t
        except (RuntimeError, NotImplementedError):  # no storage to name it by
            pass

    def _inspectable(self, args: tuple) -> bool:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None:
            return True
        kind = first.device.type
        if kind not in self._storage:
            self._storage[kind] = devices.storage_inspectable(kind)
        return self._storage[kind]

    def unobservable(self) -> Finding | None:
        """``not_observed`` for the device types whose ops ran unrecorded, or None."""
        return not_observed(sorted(k for k, seen in self._storage.items() if not seen))

    def _event(self, step: int, module: str, func: Any, kind: str, arg: str,
               t: torch.Tensor) -> dict[str, Any]:
        index = self._counts.get((step, module), 0)
        self._counts[(step, module)] = index + 1
        event = {"step": step, "module": module, "op": str(func), "kind": kind, "index": index,
                 "arg": arg, "dtype": str(t.dtype).removeprefix("torch."), **aliasing.layout(t)}
        self._events.append(event)
        return event


def not_observed(device_types: list[str]) -> Finding | None:
    """The ``view.audit_unobservable`` warning for devices the audit cannot see (None if none):
    their tensors have no storage to inspect (``devices.storage_inspectable``)."""
    if not device_types:
        return None
    return Finding(
        kind="view.audit_unobservable", module="", step=None, severity="warning",
        message=(f"the view audit does not apply on {', '.join(device_types)}: its tensors have no "
                 "storage to inspect and its views are functionalized (view ops run as *_copy, "
                 "writes through views as *_scatter), and a dispatch mode there breaks the "
                 "backward; no view/in-place finding comes from this run: check the backend with "
                 f"`driftcheck probe --device {device_types[0]}`"),
        details={"devices": device_types})


def compare_events(
    ref: list[dict[str, Any]],
    tgt: list[dict[str, Any]],
    value_tolerance: Callable[[dict[str, Any], dict[str, Any]], float] | float | None = None,
) -> list[Finding]:
    """Findings where the target's view/in-place behaviour departs from the reference's.

    Within each (step, module) an event is compared only with the same observable event of the
    other run (``_key``): the same op and argument, on a tensor as exact (or not) as it; for a
    view the same input layout, arguments and output sizes (these fix its strides and offset),
    for a write the same written layout. Events a backend's other lowering adds, drops or
    reorders (other views, other shapes) have no counterpart and are not judged, except a
    reference write through a view met by a target write of the same op and sizes into a
    non-view (``writes.cross_layout``).

    Args:
        ref, tgt: ``ViewAudit.events()`` of the reference and the target run.
        value_tolerance: the largest accepted relative difference of the written base's
            fingerprint (difference over the fingerprint's magnitude): a float, a callable
            ``(ref_event, tgt_event) -> float``, or None for 16 unit roundoffs of the less
            precise of the two dtypes (enough for one op; pass more when drift accumulates
            upstream, e.g. fp32 vs bf16 end to end). Integer and bool bases take 0 whatever is
            passed: they are exact or wrong.
    """
    found: list[tuple[int, Finding]] = []
    order = {id(e): i for i, e in enumerate(tgt)}
    # Older manifests lack the views' arguments: strides and offset then identify a view (_key).
    with_args = any("args" in e for e in ref) and any("args" in e for e in tgt)
    for r_events, t_events in _groups(ref, tgt).values():
        paired = _pairs(r_events, t_events, with_args)
        for r, t in paired:
            finding = _judge(r, t, value_tolerance)
            if finding is not None:
                found.append((order[id(t)], finding))
        used = {id(e) for pair in paired for e in pair}  # left over: writes of another layout
        found.extend((order[id(t)], f) for t, f in writes.cross_layout(
            [e for e in r_events if id(e) not in used], [e for e in t_events if id(e) not in used]))
    return [f for _, f in sorted(found, key=lambda pair: pair[0])]  # target execution order


def _pairs(r_events: list[dict], t_events: list[dict], with_args: bool) -> list[tuple[dict, dict]]:
    """(reference, target) pairs of the same observable event, each event in one pair at most:
    equal keys in order of occurrence (a view's key fixes its layout, so reorderings are compared
    too); writes only where both runs issue their key equally often (else which is which is
    ambiguous: a backward lowered otherwise writes other bases through equal views); then
    reference views the target returned as copies, by op, arguments and sizes (a copy's own views
    have another input layout, yet a view op that does not alias breaks its schema anyway)."""
    rk = [_key(e, with_args) for e in r_events]
    tk = [_key(e, with_args) for e in t_events]
    counts = Counter(rk), Counter(tk)
    ambiguous = {k for k in counts[0] | counts[1] if counts[0][k] != counts[1][k]}
    pairs: list[tuple[int, int]] = []
    _in_order(pairs, *([None if k in ambiguous and e["kind"] != "view" else k
                        for e, k in zip(events, keys)]
                       for events, keys in ((r_events, rk), (t_events, tk))))
    _in_order(pairs, [_loose(e, True, with_args) for e in r_events],
              [_loose(e, False, with_args) for e in t_events])
    return [(r_events[i], t_events[j]) for i, j in pairs]


def _in_order(pairs: list[tuple[int, int]], r_keys: list, t_keys: list) -> None:
    """Add to ``pairs`` the unpaired events of equal keys (None: not eligible), in order."""
    r_used, t_used = {i for i, _ in pairs}, {j for _, j in pairs}
    free: dict[Any, deque] = defaultdict(deque)
    for j, k in enumerate(t_keys):
        if k is not None and j not in t_used:
            free[k].append(j)
    for i, k in enumerate(r_keys):
        if k is not None and i not in r_used and free.get(k):
            pairs.append((i, free[k].popleft()))


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
    if r["kind"] == "view":  # paired by input layout, arguments and sizes: the rest must agree
        if _layout_of(r) != _layout_of(t):
            return finding("view.layout_mismatch",
                           f"view layout {_layout_of(t)} on the target, {_layout_of(r)} on the "
                           "reference", reference=_layout_of(r), target=_layout_of(t))
        return None
    rv, tv = r.get("value"), t.get("value")
    if _exact(r["dtype"]) or _exact(t["dtype"]):
        tol = 0.0  # token ids, labels, masks: exact or wrong, whatever tolerance was passed
    elif (tol := tolerance(r, t) if callable(tolerance) else tolerance) is None:
        tol = 16 * max(dtypes.unit_roundoff(r["dtype"]), dtypes.unit_roundoff(t["dtype"]))
    rb, tb = r.get("value_before"), t.get("value_before")
    if r.get("base_changed") and t.get("base_changed") is False:
        if not (fp.finite(tv) and fp.finite(tb)):
            return None  # uninitialised memory (new_empty) of NaN/Inf bit patterns: unobservable
        if (r.get("fresh") or t.get("fresh")) and rb and tb and fp.value_error(rb, tb) > tol:
            # uninitialised memory filled a view at a time: the two bases held other garbage
            # before this write, and the target's may have held the values written already
            return None
        return finding("inplace.base_not_updated",
                       "a write through a view changed its base on the reference but left it "
                       "unchanged on the target")
    if rv and tv:
        if (rb or tb) and not (fp.finite(rb) and fp.finite(tb)):
            return None  # the same: not comparable
        if rb and tb and fp.value_error(rb, tb) > tol:
            return None  # the bases differed before the write: upstream drift, not this write
        err = fp.value_error(rv, tv)
        if err > tol:
            return finding("inplace.value_mismatch",
                           f"the base after the write differs by {err:.3g} (relative to its "
                           f"magnitude; tolerance {tol:.3g})", error=err, tolerance=tol)
    return None


def _layout_of(e: dict[str, Any]) -> dict[str, Any]:
    return {"sizes": e["sizes"], "strides": e["strides"], "storage_offset": e["storage_offset"]}


def _exact(dtype: str) -> bool:
    """Integer and bool dtypes, by event name (an unknown name counts as floating)."""
    d = getattr(torch, str(dtype), None)
    return isinstance(d, torch.dtype) and not (d.is_floating_point or d.is_complex)


def _key(e: dict[str, Any], with_args: bool) -> tuple:
    """What makes two events the same observable thing (see ``compare_events``)."""
    same = (e["op"], e["arg"], _exact(e["dtype"]))
    if e["kind"] != "view":
        return (*same, _frozen(_layout_of(e)))
    rest = _frozen(e.get("args")) if with_args else (tuple(e["strides"]), e["storage_offset"])
    return (*same, _frozen(e.get("input_layout")), tuple(e["sizes"]), rest)


def _loose(e: dict[str, Any], aliased: bool, with_args: bool) -> tuple | None:
    """A view's op, arguments and sizes, if its ``aliased`` is as asked (else None)."""
    if e["kind"] != "view" or e.get("aliased") is not aliased:
        return None
    sizes = (e.get("input_layout") or {}).get("sizes")
    return (e["op"], e["arg"], _frozen(sizes), tuple(e["sizes"]), _frozen(e.get("args")) if with_args else None)


def _frozen(x: Any) -> Any:
    x = sorted(x.items()) if isinstance(x, dict) else x
    return tuple(_frozen(v) for v in x) if isinstance(x, (list, tuple)) else x


def _plain(_: str, a: Any, k: str, children: nested.Children[Any]) -> Any:
    """A view op's argument, JSON-ready (tensors by placeholder: their layout is recorded)."""
    if k == nested.TENSOR:
        return "<tensor>"
    if k == nested.SEQUENCE:
        return [v for _, v in children()]
    if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
        return a
    return int(a) if isinstance(a, torch.SymInt) else str(a)


def _groups(ref: list[dict[str, Any]], tgt: list[dict[str, Any]]) -> dict[tuple, tuple]:
    groups: dict[tuple, tuple[list, list]] = {}
    for side, events in ((0, ref), (1, tgt)):
        for e in events:
            groups.setdefault((e["step"], e["module"]), ([], []))[side].append(e)
    return groups

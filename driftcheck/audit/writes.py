"""Writes the reference made through a view and the target made into a tensor of its own.

A backend whose view op returns a copy hands the following in-place op a tensor of another
layout (contiguous, offset 0): the write's observable key (op, argument, written layout) then
differs from the reference's, ``views.compare_events`` pairs nothing with it, and the write that
never reached its base would go unjudged. Here the events left unpaired in a (step, module) group
are matched by what identifies a write besides its layout (the op, the argument written, the
written sizes, integer or floating, and the order within the module's calls of the step), and
a reference write through a view met by a target write into a non-view is named
``view.write_not_through_view``.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import torch

from driftcheck.gate.report import Finding

__all__ = ["KIND", "cross_layout"]

KIND = "view.write_not_through_view"
_WRITES = ("inplace", "out")


def cross_layout(ref: list[dict[str, Any]], tgt: list[dict[str, Any]]) -> list[tuple[dict, Finding]]:
    """(target event, finding) for each reference write through a view whose counterpart on the
    target wrote into a tensor that is no view of anything.

    Args:
        ref, tgt: the events of one (step, module) group that ``compare_events`` left unpaired,
            each in execution order.
    """
    free: dict[tuple, deque] = defaultdict(deque)
    for t in tgt:
        if t["kind"] in _WRITES and t.get("aliased") is False:
            free[_identity(t)].append(t)
    found = []
    for r in ref:
        if r["kind"] not in _WRITES or not r.get("aliased") or r.get("base_changed") is False:
            continue
        queue = free.get(_identity(r))
        if queue:
            t = queue.popleft()
            found.append((t, _finding(r, t)))
    return found


def _identity(e: dict[str, Any]) -> tuple:
    return (e["kind"], e["op"], e["arg"], _exact(e["dtype"]), tuple(e["sizes"]))


def _exact(dtype: str) -> bool:
    d = getattr(torch, str(dtype), None)
    return isinstance(d, torch.dtype) and not (d.is_floating_point or d.is_complex)


def _finding(r: dict[str, Any], t: dict[str, Any]) -> Finding:
    module = r["module"] or "<model>"
    layout = {k: t[k] for k in ("sizes", "strides", "storage_offset")}
    view = {k: r[k] for k in ("sizes", "strides", "storage_offset")}
    return Finding(
        kind=KIND, module=r["module"], step=r["step"],
        message=(f"{r['op']} ({r['arg']}, op #{t['index']} of {module}): the reference wrote "
                 f"through a view (strides {view['strides']}, offset {view['storage_offset']}) and "
                 f"its base changed; the target wrote into a tensor that is no view (strides "
                 f"{layout['strides']}, offset {layout['storage_offset']}): its view op returned a "
                 "copy, so the write never reaches the tensor the module goes on to use"),
        details={"op": r["op"], "arg": r["arg"], "index": t["index"], "reference": view,
                 "target": layout})

"""The trace address: one captured tensor's semantic key, and the slot grammar.

An entry is addressed by (step, phase, module, call, slot), never by a global counter: two runs
whose op order differs still align. ``TraceKey`` is that address; its text form is the entry's
``key`` (``0/forward/layers.0.mlp/0/output.0``). A slot names the tensor within the module call:
``input.<path>`` / ``output.<path>`` (forward), ``grad_output.<path>`` / ``grad_input.<path>``
(backward), ``param.<name>`` / ``buffer.<name>``, ``state.<param>.<key>``, ``loss``; a local-replay
capture (record --local) is ``local.<slot>`` beside the entry it replays. Parsed here only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

SLOT_KINDS = ("input", "output", "grad_output", "grad_input", "param", "buffer", "state", "loss")

# Slots: input.<path> / output.<path> (forward), grad_output.<path> / grad_input.<path>
# (backward), param.<name> / buffer.<name>, state.<param>.<key>, loss; a local-replay capture
# (record --local) is local.<slot> beside the entry it replays.
LOCAL_PREFIX = "local."


def is_local_slot(slot: str) -> bool:
    """Whether ``slot`` is a local-replay capture (``local.output.0``, ``local.grad_input.0``)."""
    return slot.startswith(LOCAL_PREFIX)


def base_slot(slot: str) -> str:
    """``local.output.0`` -> ``output.0``: the propagated entry a local capture stands beside."""
    return slot[len(LOCAL_PREFIX):] if is_local_slot(slot) else slot



@dataclasses.dataclass(frozen=True)
class Slot:
    """A parsed slot: ``kind`` (one of SLOT_KINDS), ``path`` (what follows the kind: ``0``,
    ``x.0``, a parameter name, ``<param>.<key>``) and whether it is a local-replay capture."""

    kind: str
    path: str = ""
    local: bool = False

    @classmethod
    def parse(cls, slot: str) -> Slot:
        local = is_local_slot(slot)
        kind, _, path = base_slot(slot).partition(".")
        return cls(kind, path, local)

    @property
    def index(self) -> int | None:
        """The first path component as an integer (``output.1`` -> 1), else None."""
        head = self.path.partition(".")[0]
        return int(head) if head.isdigit() else None

    @property
    def head(self) -> str:
        """The first path component (``state.w.exp_avg`` -> ``w``; a parameter's full name for
        ``param.<name>`` is ``path``)."""
        return self.path.partition(".")[0]

    def __str__(self) -> str:
        text = f"{self.kind}.{self.path}" if self.path else self.kind
        return LOCAL_PREFIX + text if self.local else text


def slot_kind(slot: str) -> str:
    """``grad_input.0`` -> ``grad_input``; ``local.output.0`` -> ``output``."""
    return base_slot(slot).partition(".")[0]


class TraceKey(NamedTuple):
    """(step, phase, module, call, slot): what two runs' entries are matched on."""

    step: int
    phase: str
    module: str
    call: int
    slot: str

    @classmethod
    def of(cls, entry: Mapping[str, Any] | Any) -> TraceKey:
        """The key of a manifest entry (a mapping) or of an object with those attributes."""
        if isinstance(entry, Mapping):
            return cls(entry["step"], entry["phase"], entry["module"], entry["call"], entry["slot"])
        return cls(entry.step, entry.phase, entry.module, entry.call, entry.slot)

    @classmethod
    def parse(cls, text: str) -> TraceKey:
        """The inverse of ``str(key)``: ``0/forward/./0/loss`` -> TraceKey(0, "forward", "", 0, "loss")."""
        parts = text.split("/")
        if len(parts) != 5 or not parts[0].isdigit() or not parts[3].isdigit():
            raise ValueError(f"not a trace key: {text!r} (step/phase/module/call/slot)")
        step, phase, module, call, slot = parts
        return cls(int(step), phase, "" if module == "." else module, int(call), slot)

    def __str__(self) -> str:
        return key_string(*self)

    def with_slot(self, slot: str) -> TraceKey:
        return self._replace(slot=slot)

    @property
    def kind(self) -> str:
        """The slot's kind (``output``, ``grad_input`` ...)."""
        return slot_kind(self.slot)


def key_string(step: int, phase: str, module: str, call: int, slot: str) -> str:
    """An entry's ``key``: the semantic address of one captured tensor, never a global counter.
    Human-readable and stable; the fields are stored separately too, so the string never has
    to be parsed back."""
    return f"{step}/{phase}/{module or '.'}/{call}/{slot}"


def sample_key(step: int, phase: str, module: str, call: int, slot: str) -> str:
    """The key whose seeded positions a stats-mode sample holds (stats.sample_indices): the
    entry's own, except for a local replay (``local.<slot>``: the replayed entry's) and a
    parameter or buffer after the optimizer step (the same tensor's before it, phase
    ``params``), so that the two samples hold the same positions."""
    if is_local_slot(slot):
        return key_string(step, phase, module, call, base_slot(slot))
    if phase == "optimizer" and slot.startswith(("param.", "buffer.")):
        return key_string(step, "params", module, call, slot)
    return key_string(step, phase, module, call, slot)


def entry_align(entry: Mapping[str, Any]) -> TraceKey:
    """(step, phase, module, call, slot): what two runs' entries are matched on."""
    return TraceKey.of(entry)

"""TraceEntry: one manifest entry as compare sees it, typed, its alignment key made once."""
from __future__ import annotations

import dataclasses
from typing import Any

from driftcheck.store.keys import Slot, TraceKey, is_local_slot, slot_kind


def slot_is(slot: str, *kinds: str) -> bool:
    """Whether ``slot`` is an entry's own slot (not a local replay's ``local.*``) of one of
    ``kinds`` (``input``, ``output``, ``grad_output``, ``grad_input``, ``param``, ...)."""
    return not is_local_slot(slot) and slot_kind(slot) in kinds


def forward_slot(slot: str) -> str:
    """The forward tensor's slot a gradient slot is the gradient of: ``grad_input.0`` ->
    ``input.0``, ``grad_output`` -> ``output``."""
    s = Slot.parse(slot)
    return str(dataclasses.replace(s, kind=s.kind.removeprefix("grad_")))


def gradient_slot(slot: str) -> str:
    """The gradient slot of a forward slot: ``input.0`` -> ``grad_input.0``."""
    s = Slot.parse(slot)
    return str(dataclasses.replace(s, kind="grad_" + s.kind))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TraceEntry:
    """A captured tensor of one trace: where it was captured, what it is, its statistics.

    ``raw`` is the manifest entry itself: the reader finds the entry's tensor and sample by it.
    Compared by identity (two entries are the same entry, never equal values)."""

    key: str
    module: str
    phase: str
    step: int
    call: int
    slot: str
    order: int
    shape: list[int]
    dtype: str
    stats: dict[str, Any]
    meta: dict[str, Any]  # {} when the manifest has none
    align: TraceKey  # (step, phase, module, call, slot): what runs match on
    raw: dict[str, Any]

    @property
    def has_tensor(self) -> bool:
        """Whether the full tensor is stored (full mode), not only statistics and a sample."""
        return "tensor" in self.raw

    def slot_is(self, *kinds: str) -> bool:
        """Whether the slot is of one of ``kinds`` (a local replay's ``local.*`` is of none)."""
        return slot_is(self.slot, *kinds)

    @classmethod
    def of(cls, e: dict[str, Any]) -> TraceEntry:
        return cls(e["key"], e["module"], e["phase"], e["step"], e["call"], e["slot"], e["order"],
                   e["shape"], e["dtype"], e["stats"], e.get("meta") or {}, TraceKey.of(e), e)


def entries_of(reader: Any) -> list[TraceEntry]:
    """A reader's manifest entries, typed."""
    return [TraceEntry.of(e) for e in reader.entries]


def identical(d: TraceEntry, r: TraceEntry) -> bool:
    """Whether the reference recorded the same nonzero values for ``d`` and ``r`` (the same
    tensor, passed on unchanged), by their whole-tensor statistics."""
    a, b = d.stats, r.stats
    return bool(a.get("l2")) and all(a.get(k) == b.get(k) for k in ("numel", "l2", "mean", "min", "max"))

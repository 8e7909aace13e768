"""TraceEntry: one manifest entry as compare sees it, typed, its alignment key made once."""
from __future__ import annotations

import dataclasses
from typing import Any


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
    align: tuple[int, str, str, int, str]  # (step, phase, module, call, slot): what runs match on
    raw: dict[str, Any]

    @property
    def has_tensor(self) -> bool:
        """Whether the full tensor is stored (full mode), not only statistics and a sample."""
        return "tensor" in self.raw

    @classmethod
    def of(cls, e: dict[str, Any]) -> TraceEntry:
        return cls(e["key"], e["module"], e["phase"], e["step"], e["call"], e["slot"], e["order"],
                   e["shape"], e["dtype"], e["stats"], e.get("meta") or {},
                   (e["step"], e["phase"], e["module"], e["call"], e["slot"]), e)


def entries_of(reader: Any) -> list[TraceEntry]:
    """A reader's manifest entries, typed."""
    return [TraceEntry.of(e) for e in reader.entries]

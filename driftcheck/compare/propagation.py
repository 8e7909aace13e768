"""Error propagation: what a judged entry passes on to the entries that depend on it, and the
ledger where it is kept."""
from __future__ import annotations

from typing import NamedTuple

from driftcheck.numerics import floor as fl
from driftcheck.store.keys import TraceKey


class Propagated(NamedTuple):
    """What a judged entry passes on to the entries that depend on it."""

    rel_rms: float  # rms error / magnitude
    rel_max: float  # max error / max magnitude
    rms: float  # absolute rms error
    max: float  # absolute max error
    mu: float = 1.0  # magnitude / rms of the reference (> 1 where terms cancel)
    sparse: float = 0.0  # relative error a sample cannot show (kink flips upstream)
    sparse_max: float = 0.0  # ... and its largest element (a flip: a whole gradient element)


WRONG = Propagated(fl.REL_CAP, fl.REL_CAP, 0.0, 0.0)  # misaligned: fully wrong, no measured size
NONE = Propagated(0.0, 0.0, 0.0, 0.0)


class Ledger:
    """What the entries judged so far pass on, by align key (entries are judged in execution
    order, so an entry's dependencies are in it), and the floors optimizer entries were allowed
    (the next step's parameters are the same tensors)."""

    def __init__(self) -> None:
        self.errors: dict[TraceKey, Propagated] = {}
        self.floors: dict[TraceKey, tuple[float, float]] = {}  # optimizer entries: (rms, max) floor

"""Slices: whether a reference tensor is a block cut from another one it depends on (a class
token split off a stage's output, ``h[:, 0]``; the tokens after it, ``h[:, 1:]``).

A slice holds some of its source's very values, so it holds their absolute error: where the
source's error stems from its operands' magnitude (a matmul's input rounding, its accumulation
order), a slice that is small by cancellation carries the same absolute error as its
neighbours, not its source's relative error times its own small size. Decided on the
reference's full tensors: a selection along one axis (``select``) or a window along one axis
(``narrow``) whose values are equal to the candidate's, bit for bit; shapes and the value range
rule out most candidates before any data is read.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.compare.entries import TraceEntry
from driftcheck.numerics import dtypes
from driftcheck.store.reader import TraceReader

MAX_ELEMS = 1 << 24  # a source larger than this is not read to decide
MAX_INDICES = 16  # positions tried along an axis (the first ones and the last)


def _positions(n: int) -> list[int]:
    return sorted(set(range(min(n, MAX_INDICES))) | {n - 1})


def cuts(small: list[int], big: list[int]) -> list[tuple[str, int, int]]:
    """The ways ``small`` can be cut from ``big``: ("select", axis, size) where ``small`` is
    ``big`` without one axis, ("narrow", axis, size) where it is ``big`` shorter along one."""
    out = []
    if len(small) == len(big) - 1:
        out += [("select", k, big[k]) for k in range(len(big)) if big[:k] + big[k + 1:] == small]
    elif len(small) == len(big):
        diff = [k for k in range(len(big)) if small[k] != big[k]]
        if len(diff) == 1 and small[diff[0]] < big[diff[0]]:
            out.append(("narrow", diff[0], big[diff[0]]))
    return out


class Slices:
    """Whether an entry's reference values are cut from a dependency's (cached per pair)."""

    def __init__(self, ref: TraceReader) -> None:
        self.ref = ref
        self._known: dict[tuple[str, str], bool] = {}

    def cut_from(self, r: TraceEntry, d: TraceEntry) -> bool:
        """Whether ``r``'s reference tensor is a select or narrow of ``d``'s, values equal."""
        key = (r.key, d.key)
        if key not in self._known:
            self._known[key] = self._decide(r, d)
        return self._known[key]

    def _decide(self, r: TraceEntry, d: TraceEntry) -> bool:
        if not (r.has_tensor and d.has_tensor and r.dtype == d.dtype and dtypes.is_float(r.dtype)):
            return False
        n_r, n_d = math.prod(r.shape), math.prod(d.shape)
        ways = cuts(list(r.shape), list(d.shape))
        if not ways or not 0 < n_r < n_d or n_d > MAX_ELEMS or not _within(r.stats, d.stats):
            return False
        small, big = self.ref.tensor(r.raw), self.ref.tensor(d.raw)
        if small is None or big is None or not bool(small.ne(0).any()):
            return False  # zeros are cut from anything
        for how, axis, size in ways:
            if how == "select":
                if any(torch.equal(big.select(axis, i), small) for i in _positions(size)):
                    return True
            else:
                n = small.shape[axis]
                if any(torch.equal(big.narrow(axis, o, n), small) for o in _positions(size - n + 1)):
                    return True
        return False


def _within(small: dict[str, Any], big: dict[str, Any]) -> bool:
    """Whether ``small``'s value range lies inside ``big``'s (by their recorded statistics)."""
    try:
        return float(small["min"]) >= float(big["min"]) and float(small["max"]) <= float(big["max"])
    except (KeyError, TypeError, ValueError):
        return True  # no statistics to rule it out: the data decides

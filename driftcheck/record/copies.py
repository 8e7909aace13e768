"""Copies: what a step's full-mode captures copied, by where their data lies, so that a later
capture of the same bytes, unchanged, names that copy's stored tensor instead of copying them
again (a module's output is the next module's input; q, k and v share theirs; a gradient
reaches two hooks). At 40M parameters (`bench/record_overhead.py`'s Llama) that is half of the
forward's copied bytes and two fifths of the backward's."""
from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from driftcheck.numerics import chunks
from driftcheck.numerics.passes import flat_view


class Same:
    """A capture whose data a capture of this step copied already: its entry names the same
    stored tensor as ``first``'s, and its statistics are ``summary``, that capture's
    (``checksum``: the stored bytes' CRC32C)."""

    __slots__ = ("checksum", "first", "summary")
    device = torch.device("cpu")  # what the capture's flush asks of a pending host tensor
    is_cpu = True
    nbytes = 0

    def __init__(self, first: dict[str, Any], summary: Any, checksum: int) -> None:
        self.first = first
        self.summary = summary
        self.checksum = checksum


class Copies:
    """The step's copies: (data pointer, shape, strides, dtype) -> the captured tensor (held
    weakly), its entry, its summary and the copy's CRC32C. Nothing of a copy
    is held. A capture that names an earlier copy is remembered as that copy's, so a frozen
    parameter is copied once, not again at every step's start.

    The last ``RECENT`` captured tensors are also held strongly: a backward hook's gradient is a
    Python object that dies when the hook returns (its memory may then serve another tensor),
    while the next module's hook gets the same gradient as a new object. Held, the first stays
    alive, so its memory is still its own when the second arrives.

    Across steps (``carry``): a parameter at a step's start is the one the step before captured
    after its update, if nothing wrote it since. Within a step and across, the bytes decide:
    their CRC32C (read on as many threads as torch has, ~20 GB/s on two) against the copy's,
    taken when it was made; a version counter is not enough (``same``)."""

    RECENT = 4

    def __init__(self) -> None:
        self._by_where: dict[tuple, tuple] = {}
        self._recent: collections.deque[torch.Tensor] = collections.deque(maxlen=self.RECENT)
        self._last: dict[tuple, tuple] = {}  # the step before's
        self._carried: dict[tuple, tuple] = {}  # its parameters after the update, while carried

    def clear(self) -> None:
        """A new step."""
        self._last, self._by_where = self._by_where, {}
        self._recent.clear()
        self._carried = {}

    def carry(self, on: bool) -> None:
        """While on: the step before's copies may stand for this step's captures (a parameter at
        the step's start is the one after the update), their bytes checked as within a step."""
        self._carried = self._last if on else {}
        if not on:
            self._last = {}

    @staticmethod
    def _where(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def same(self, data: Any) -> Same | None:
        """A ``Same`` where these very bytes were copied already: the same memory, shape,
        strides and dtype as a capture whose tensor is still alive there (so the memory is still
        its) and whose bytes still have the copy's CRC32C. A version counter alone does not
        tell: fused optimizers, in-place collectives, compiled graphs' in-place buffers and
        writes through ``.data`` change bytes without moving it."""
        if not (self._by_where or self._carried) or type(data) is not torch.Tensor or not data.is_cpu \
                or data.is_neg() or data.is_conj():  # (a negative view's bytes are not its values)
            return None
        where = self._where(data)
        hit = self._by_where.get(where) or self._carried.get(where)  # (ref, entry, summary, checksum)
        if hit is None:
            return None
        first = hit[0]()
        if first is None or self._where(first) != where or chunks.checksum(flat_view(data)) != hit[3]:
            return None
        return Same(hit[1], hit[2], hit[3])

    def remember(self, t: torch.Tensor, entry: dict[str, Any], summary: Any, checksum: int) -> None:
        """``t`` was just copied for ``entry`` (whose statistics are ``summary``; the copy's
        CRC32C ``checksum``)."""
        try:
            self._by_where[self._where(t)] = (weakref.ref(t), entry, summary, checksum)
        except TypeError:  # not weak-referenceable
            return
        self._recent.append(t)

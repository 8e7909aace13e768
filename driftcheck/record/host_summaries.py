"""HostSummaries: the stats rows and samples of host captures, taken in the capture hook into
blocks of mapped memory, and held there (``Held``: a block and an index) until the step's flush.

Why held and not returned as arrays or tensors: a stats-mode step of a 349M Llama takes ~2,700
captures, and each sample or row made an object of its own (``torch.from_numpy``: four small
malloc'd parts; a numpy view: its dimensions), ~19,000 allocations of 16-256 bytes living from
their hook to the end of the step. Taken from the free space between the model's tensors, they
fragmented glibc's heap: the traced process's heap grew ~1 GB more than the untraced one's
during the first backward, and the optimizer's first step, creating its state, faulted in fresh
memory at twice the time. A ``Held`` is a Python object (Python's own allocator, outside
malloc's heap) and the blocks are mappings of their own (store/buffers.py ``mapped_empty``).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from driftcheck.numerics.passes import NARROW, bits_or_values, narrow_view
from driftcheck.numerics.stats import (
    BIG,
    COLUMNS,
    FIELDS,
    HOST_DTYPES,
    SAMPLE_SIZE,
    base_points,
    compiled_kernels,
    large_row,
)
from driftcheck.store.buffers import mapped_empty


class _Block:
    """BLOCK captures' rows and samples, in mapped memory; the numpy views the kernels write
    through are made once here (a view per capture would be an allocation per capture)."""

    __slots__ = ("columns", "rows", "samples", "samples_np", "used")

    def __init__(self, dtype: torch.dtype, size: int) -> None:
        self.rows = mapped_empty((size, len(COLUMNS)), torch.float64).numpy()
        self.rows.fill(np.nan)  # fp8 columns: NaN, not fp8
        self.columns = self.rows[:, :len(FIELDS)]  # what the kernels fill
        self.samples = mapped_empty((size, SAMPLE_SIZE), dtype)
        self.samples_np = bits_or_values(self.samples)  # (narrow floats: bits, as the capture is read)
        self.used = 0


class Held:
    """One capture's stats row and sample in a HostSummaries block: ``row()`` (a float64 numpy
    row as ``stats.summarize`` makes it) and ``sample()`` (the tensor the trace stores), made
    when asked (at the step's flush)."""

    __slots__ = ("block", "k", "n")

    def __init__(self, block: _Block, k: int, n: int) -> None:
        self.block = block
        self.k = k
        self.n = n  # sample length

    @property
    def nbytes(self) -> int:
        return self.n * self.block.samples_np.itemsize

    def row(self) -> np.ndarray:
        return self.block.rows[self.k]

    def sample(self) -> torch.Tensor:
        """A view into the block (transfer.pack_samples packs it, or copies it out where it is
        alone); a short sample copied out now: a view would pin the whole block (up to 512x
        its own bytes) in the writer's queue, whose memory bound counts the sample's bytes."""
        values = self.block.samples[self.k]
        return values if self.n == SAMPLE_SIZE else values[:self.n].clone()


class HostSummaries:
    """Stats rows and samples of float32/float64 host tensors, taken in the capture hook by one
    compiled call each into preallocated blocks: small tensors whole (``take``:
    ``kernels.summarize_into``), large ones (bfloat16/float16 too: widened a chunk at a time)
    by their one-pass row and gathered sample (``take_large``, ``take_sample``). Nothing of the
    tensor is copied or kept but its sample; on the host this is cheaper than copying a tensor
    for ``summarize``, and it gives the same samples bit for bit and the same statistics up to
    the association of float64 sums (tested)."""

    BLOCK = 256  # captures per block of rows and samples

    def __init__(self, seed: int) -> None:
        self.base = base_points(seed)
        self._blocks: dict[torch.dtype, _Block] = {}  # the block being filled, per dtype
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # dtype -> a mapped block, reused

    @staticmethod
    def eligible(t: torch.Tensor) -> bool:
        """Whether ``take`` summarises ``t`` (a small float host tensor)."""
        return t.is_cpu and t.dtype in HOST_DTYPES and 0 < t.numel() < BIG

    @staticmethod
    def eligible_large(t: torch.Tensor) -> bool:
        """Whether ``take_large`` and ``take_sample`` may (a large float host tensor, bfloat16
        and float16 included)."""
        return t.is_cpu and (t.dtype in HOST_DTYPES or t.dtype in NARROW) and t.numel() >= BIG

    @staticmethod
    def _array(t: torch.Tensor) -> np.ndarray:
        """A contiguous capture as the kernels read it (narrow floats: their bits)."""
        x = narrow_view(t) if t.dtype in NARROW else compiled_kernels().flat_view(t)
        assert x is not None
        return x

    def _slot(self, dtype: torch.dtype) -> tuple[_Block, int]:
        blk = self._blocks.get(dtype)
        if blk is None or blk.used == self.BLOCK:
            blk = self._blocks[dtype] = _Block(dtype, self.BLOCK)
        blk.used += 1
        return blk, blk.used - 1

    def take(self, t: torch.Tensor, key: str) -> Held | None:
        """The stats row and sample of an ``eligible`` tensor without autograd history, or None
        where it has no numpy view: the caller copies it instead."""
        try:
            x = compiled_kernels().flat_view(t.contiguous())  # a copy only when t is not contiguous
        except (RuntimeError, TypeError):
            return None
        blk, k = self._slot(t.dtype)
        compiled_kernels().summarize_into(x, self.base, zlib.crc32(key.encode()) / 2.0**32, blk.columns,
                                          blk.samples_np, k)
        return Held(blk, k, min(x.size, SAMPLE_SIZE))

    def _contiguous(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where its elements lie in order in its memory; else their copy in a scratch
        block kept from capture to capture and mapped on its own: a large copy freed through
        malloc would move glibc's mmap threshold (store/buffers.py ``mapped_empty``)."""
        if t.is_contiguous() and not t.is_neg() and not t.is_conj():
            return t
        n = t.numel()
        scratch = self._scratch.get(t.dtype)
        if scratch is None or scratch.numel() < n:
            grown = max(n, 2 * scratch.numel()) if scratch is not None else n
            scratch = self._scratch[t.dtype] = mapped_empty((grown,), t.dtype)
        out = scratch[:n].view(t.shape)
        out.copy_(t)
        return out

    def take_large(self, t: torch.Tensor, key: str) -> Held | None:
        """``stats.summarize_one`` of an ``eligible_large`` tensor, held: None where its values
        are not all finite (the caller takes the exact path)."""
        t = self._contiguous(t)
        row = large_row(t)
        return None if row is None else self.take_sample(t, key, row)

    def sample(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """``stats.large_sample`` of an ``eligible_large`` tensor, not held (a check's copy)."""
        out = torch.empty(SAMPLE_SIZE, dtype=t.dtype)
        x = self._array(self._contiguous(t.detach()))
        compiled_kernels().gather_sample(x, self.base, zlib.crc32(key.encode()) / 2.0**32, bits_or_values(out))
        return out

    def take_sample(self, t: torch.Tensor, key: str, row: Held | np.ndarray) -> Held:
        """The sample of an ``eligible_large`` tensor whose stats row is known already (the same
        tensor summarised earlier), held with that row."""
        x = self._array(self._contiguous(t.detach()))
        blk, k = self._slot(t.dtype)
        blk.columns[k] = row.row()[:len(FIELDS)] if isinstance(row, Held) else row[:len(FIELDS)]
        compiled_kernels().gather_sample(x, self.base, zlib.crc32(key.encode()) / 2.0**32, blk.samples_np[k])
        return Held(blk, k, SAMPLE_SIZE)

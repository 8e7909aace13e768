"""HostBuffers: the host memory that captured copies live in until the writer has written them,
recycled from step to step.

A full-mode step copies every captured tensor (the 16M-parameter Llama: ~1.1 GB a step) and
frees each copy once its shard is written. Fresh allocations of that size are fresh pages:
every one faults in and is zeroed by the kernel, and freeing it unmaps it again; measured, the
kernel's share of such a step was larger than the copies themselves. The same shapes come back
every step, so a copy is made into a buffer that the writer gave back.

Memory given back to the system and mapped again is the costly part (each page faulted in and
zeroed by the kernel; on a VM that reports free memory to its host, faulted in from the host
too: the 349M Llama's optimizer step ran 4x slower in a traced process with the same number of
faults). So the pool keeps what a step needs at once: the free list holds up to ``limit``
bytes, or more where the copies lent out at the busiest moment so far (``peak``: a step's
gradients are held from their hooks until the update begins, beyond the writer's queue) would
otherwise be unmapped and mapped again next step. Its total never exceeds the larger of that peak and what is lent out
now plus ``limit``. A copy takes the smallest free buffer that fits, up to ``FIT`` times its
size (a step's phases capture different sizes: activations, then parameter-shaped gradients
and optimizer state), the one given back last; the oldest given back make room.

A buffer goes back to the free list only when it is one of the pool's own and nothing but the
writer's reference holds its storage (the storage's use count): a copy somebody kept is never
written over, and memory the pool did not allocate is never taken.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
import mmap
import threading
import weakref

import torch

MIN_BYTES = 1 << 18  # smaller copies come from the allocator's own free lists (cheap already);
#                      and each buffer is a mapping of its own: few and large, far below
#                      vm.max_map_count (65530) even with a whole queue of them in flight
FIT = 2  # a copy may take a free buffer up to this many times its size (the smallest that fits)
PAGE = 4096  # buffers start on a page and run on to the next page boundary: a direct write
#              (direct.DirectStage) takes a copy straight from its memory


def mapped_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous host tensor in anonymous memory of its own (``mmap``), not
    malloc's: page-aligned, and returned to the system when the last tensor over it goes.

    For the tracer's own large working buffers. glibc raises its mmap threshold to the size of
    any mmapped block freed (up to 32 MB): a tracer buffer of, say, 16 MB allocated and freed
    through malloc would move every later model allocation below that size from fresh mappings
    into the heap, and change how the model's own memory is laid out and faulted in (a 349M
    Llama's first traced step paid ~2 GB more heap). Memory mapped here never moves it."""
    nbytes = max(1, math.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    memory = mmap.mmap(-1, nbytes + (-nbytes % PAGE), flags=mmap.MAP_PRIVATE)  # as malloc's own
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # holds ``memory`` for as long as it lives
    return raw[:nbytes].view(dtype)[:math.prod(shape)].view(shape)


class HostBuffers:
    """Recycled host buffers for captured copies. ``copy(t)`` makes a contiguous host copy of
    ``t``; the writer ``give(t)``s each tensor back once its bytes are written. The free list
    holds at most ``limit`` bytes beyond the most lent out at once so far (module docstring);
    ``clear()`` drops it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.RLock()  # a finalizer (_forget) may run inside give() on this thread
        # byte size -> {address: uint8 buffer}, each in the order given back (no empty ones)
        self._free: dict[int, dict[int, torch.Tensor]] = {}
        self._sizes: list[int] = []  # the keys of _free, ascending
        self._order: collections.OrderedDict[int, int] = collections.OrderedDict()  # address -> size, oldest first
        self._free_bytes = 0
        # address -> (capacity, serial, storage) of each buffer it mapped, for give() to know its
        # own; serial -> capacity of those mapped and not yet unmapped (an address can be mapped
        # again before the finalizer of the memory unmapped there has run)
        self._ours: dict[int, tuple[int, int, int]] = {}
        self._caps: dict[int, int] = {}
        self._serials = itertools.count()
        self._live = 0  # the capacities in _caps: lent out, or free
        self.peak = 0  # the most bytes lent out at once so far
        self.reused = 0  # copies made into a given-back buffer (tests, benchmarks)
        self.mapped = 0  # buffers mapped (tests, benchmarks)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (same shape and dtype), in a recycled buffer where ``t`` is
        a dense host tensor of at least MIN_BYTES; ``t.clone()`` otherwise."""
        out = self.empty_like(t)
        if out is None:
            return t.clone()
        out.copy_(t)
        return out

    def empty_like(self, t: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised contiguous tensor shaped like ``t`` in a recycled (or new, page-
        aligned) buffer; None where ``t`` is not a dense host tensor of at least MIN_BYTES."""
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.device.type != "cpu" or t.layout != torch.strided \
                or t.is_quantized:
            return None
        cap = nbytes + (-nbytes % PAGE)
        buf, evicted = None, []
        with self._lock:
            at = bisect.bisect_left(self._sizes, cap)
            if at < len(self._sizes) and self._sizes[at] <= cap * FIT:  # the smallest that fits
                size = self._sizes[at]
                address, buf = self._free[size].popitem()  # the one given back last: in cache
                self._unlist(size, address)
                self.reused += 1
        if buf is None:  # anonymous memory of its own: page-aligned, private (as malloc's)
            memory = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE)
            buf = torch.frombuffer(memory, dtype=torch.uint8)
            serial = next(self._serials)
            with self._lock:
                self._ours[buf.data_ptr()] = (cap, serial, buf.untyped_storage()._cdata)
                self._caps[serial] = cap
                self._live += cap
                self.mapped += 1
                lent = self._lent()
                evicted = self._trim(max(self.limit, max(self.peak, lent) - lent))
            weakref.finalize(memory, self._forget, buf.data_ptr(), serial)  # when the memory goes
        with self._lock:
            self.peak = max(self.peak, self._lent())
        del evicted  # unmapped here, outside the lock
        # a tensor of its own over the buffer's storage (a view would hold the buffer as its base)
        return torch.empty(0, dtype=t.dtype).set_(  # type: ignore[call-overload]  # (source, offset, size): no stub
            buf.untyped_storage(), 0, t.shape)

    def give(self, t: torch.Tensor) -> None:
        """``t`` is written and nobody will read it again: where ``t`` is all of its storage and
        nothing else holds that storage (no other tensor or view: its use count), the memory
        may serve a later copy."""
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.device.type != "cpu" or t.layout != torch.strided \
                or t.is_quantized or t.storage_offset() != 0 or t.data_ptr() % PAGE:
            return
        ours = self._ours.get(t.data_ptr())
        storage = t.untyped_storage()
        # one of ours (the storage it mapped, whole), held by ``t`` and the storage object just
        # asked for alone
        if ours is None or storage._cdata != ours[2] or storage.nbytes() != ours[0] \
                or torch._C._storage_Use_Count(storage._cdata) != 2:
            return
        cap = ours[0]
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            lent = self._lent() - cap  # lent out, once this one is back
            room = max(self.limit, self.peak - lent)
            if cap > room:
                return
            evicted = self._trim(room - cap)  # the oldest given back make room
            if cap not in self._free:
                bisect.insort(self._sizes, cap)
                self._free[cap] = {}
            self._free[cap][t.data_ptr()] = buf
            self._order[t.data_ptr()] = cap
            self._free_bytes += cap
        del evicted  # unmapped here, outside the lock

    def _lent(self) -> int:
        """Bytes of its buffers lent out now (the lock held)."""
        return self._live - self._free_bytes

    def _unlist(self, size: int, address: int) -> None:
        """Bookkeeping of a buffer taken off the free list (the lock held)."""
        del self._order[address]
        self._free_bytes -= size
        if not self._free[size]:
            del self._free[size]
            self._sizes.remove(size)

    def _trim(self, room: int) -> list[torch.Tensor]:
        """The oldest free buffers off the list until it holds at most ``room`` bytes (the lock
        held); they are no longer counted as mapped, and are unmapped once the caller drops them."""
        evicted = []
        while self._free_bytes > room:
            address, size = next(iter(self._order.items()))
            evicted.append(self._free[size].pop(address))
            self._unlist(size, address)
            self._live -= self._caps.pop(self._ours.pop(address)[1])
        return evicted

    def _forget(self, address: int, serial: int) -> None:
        """The memory mapped as ``serial`` is unmapped (a finalizer)."""
        with self._lock:
            self._live -= self._caps.pop(serial, 0)  # (0: evicted, counted off then)
            if self._ours.get(address, (0, -1))[1] == serial:
                del self._ours[address]

    def clear(self) -> None:
        with self._lock:
            self._trim(0)

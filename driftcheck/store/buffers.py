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
        # byte size -> {address: uint8 buffer}, each in the order given back
        self._free: dict[int, dict[int, torch.Tensor]] = {}
        self._sizes: list[int] = []  # the keys of _free, ascending
        self._order: collections.OrderedDict[int, int] = collections.OrderedDict()  # address -> size, oldest first
        self._free_bytes = 0
        self._ours: dict[int, int] = {}  # address -> capacity of each live buffer it allocated
        self._live = 0  # their total: lent out, or free
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
        buf = None
        with self._lock:
            for size in self._sizes[bisect.bisect_left(self._sizes, cap):]:
                if size > cap * FIT:
                    break
                free = self._free[size]
                if free:  # the one given back last: the likeliest still in cache
                    address, buf = free.popitem()
                    del self._order[address]
                    self._free_bytes -= size
                    self.reused += 1
                    break
        if buf is None:  # anonymous memory of its own: page-aligned, private (as malloc's)
            memory = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE)
            buf = torch.frombuffer(memory, dtype=torch.uint8)
            with self._lock:
                self._ours[buf.data_ptr()] = cap
                self._live += cap
                self.mapped += 1
            weakref.finalize(memory, self._forget, buf.data_ptr())  # when the memory goes
        with self._lock:
            self.peak = max(self.peak, self._live - self._free_bytes)
        # a tensor of its own over the buffer's storage (a view would hold the buffer as its base)
        return torch.empty(0, dtype=t.dtype).set_(  # type: ignore[call-overload]  # (source, offset, size): no stub
            buf.untyped_storage(), 0, t.shape)

    def give(self, t: torch.Tensor) -> None:
        """``t`` is written and nobody will read it again: where ``t`` is all of its storage and
        nothing else holds that storage (no other tensor or view: its use count), the memory
        may serve the next copy of that byte size."""
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.device.type != "cpu" or t.layout != torch.strided \
                or t.is_quantized or t.storage_offset() != 0 or t.data_ptr() % PAGE:
            return
        cap = self._ours.get(t.data_ptr())
        storage = t.untyped_storage()
        # one of ours, held by ``t`` and the storage object just asked for alone
        if cap is None or storage.nbytes() != cap \
                or torch._C._storage_Use_Count(storage._cdata) != 2:
            return
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
        evicted = []
        with self._lock:
            lent = self._live - self._free_bytes - cap  # lent out, once this one is back
            room = max(self.limit, self.peak - lent)
            if cap > room:
                return
            while self._free_bytes + cap > room:  # the oldest make room
                address, size = self._order.popitem(last=False)
                evicted.append(self._free[size].pop(address))
                self._free_bytes -= size
            if cap not in self._free:
                bisect.insort(self._sizes, cap)
                self._free[cap] = {}
            self._free[cap][t.data_ptr()] = buf
            self._order[t.data_ptr()] = cap
            self._free_bytes += cap
        del evicted  # unmapped here, outside the lock

    def _forget(self, address: int) -> None:
        with self._lock:
            self._live -= self._ours.pop(address, 0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._sizes.clear()
            self._order.clear()
            self._free_bytes = 0

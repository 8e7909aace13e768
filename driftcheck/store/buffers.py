"""HostBuffers: the host memory that captured copies live in until the writer has written them,
recycled from step to step.

A full-mode step copies every captured tensor (the 16M-parameter Llama: ~1.1 GB a step) and
frees each copy once its shard is written. Fresh allocations of that size are fresh pages:
every one faults in and is zeroed by the kernel, and freeing it unmaps it again; measured, the
kernel's share of such a step was larger than the copies themselves. The same shapes come back
every step, so a copy is made into a buffer of the same byte size that the writer gave back.

A buffer goes back to the free list only when nothing but the pool and the writer's reference
holds its storage (the storage's use count): a copy somebody kept is never written over.
"""
from __future__ import annotations

import threading

import torch

MIN_BYTES = 1 << 16  # smaller copies come from the allocator's own free lists: cheap already


class HostBuffers:
    """Recycled host buffers for captured copies. ``copy(t)`` makes a contiguous host copy of
    ``t``; the writer ``give(t)``s each tensor back once its bytes are written. At most
    ``limit`` bytes wait in the free list; ``clear()`` drops them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}  # byte size -> uint8 buffers
        self._free_bytes = 0
        self.reused = 0  # copies made into a given-back buffer (tests, benchmarks)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (same shape and dtype), in a recycled buffer where ``t`` is
        a dense host tensor of at least MIN_BYTES; ``t.clone()`` otherwise."""
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.device.type != "cpu" or t.layout != torch.strided \
                or t.is_quantized:
            return t.clone()
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= nbytes
                self.reused += 1
        if buf is None:
            return t.clone(memory_format=torch.contiguous_format)
        out = buf.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def give(self, t: torch.Tensor) -> None:
        """``t`` is written and nobody will read it again: where ``t`` is all of its storage and
        nothing else holds that storage (no other tensor or view: its use count), the memory
        may serve the next copy of that byte size."""
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.device.type != "cpu" or t.layout != torch.strided \
                or t.is_quantized or t.storage_offset() != 0:
            return
        storage = t.untyped_storage()
        # ``t`` and the storage object just asked for: nobody else.
        if storage.nbytes() != nbytes or torch._C._storage_Use_Count(storage._cdata) != 2:
            return
        with self._lock:
            if self._free_bytes + nbytes > self.limit:
                return
            self._free_bytes += nbytes
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            self._free.setdefault(nbytes, []).append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

"""DirectStage: shards written with direct I/O (``O_DIRECT``), from the tensors' own memory or
through two reused staging blocks, in a layout any safetensors reader loads (shard.py writes
the buffered files and reads them all)."""
from __future__ import annotations

import errno
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import crc32c
import torch

from driftcheck.store.shard import header_entry, raw_bytes, strict_json


class DirectStage:
    """Writes safetensors files with direct I/O (``O_DIRECT``): the bytes go to the device by
    DMA, not through the page cache.

    A buffered write copies every byte into the page cache inside the kernel, page by page, on
    whatever core is free; with the training step's threads on every core that copy, not the
    disk, bounded full mode's throughput (the 16M-parameter Llama: ~430 MB/s, where the disk
    takes 1.3-2 GB/s). Here a large tensor whose memory is page-aligned with room to the next
    page (a copy in ``buffers.HostBuffers``) is written from its own memory; the rest is
    copied, in file order, into one of two reused staging blocks (checksummed there, while the
    bytes are in cache). A helper thread does the writes, in order, while the next block fills.

    Layout: the header, padded with spaces so the data starts on an ALIGN boundary; then each
    tensor written from its memory, followed by a uint8 tensor named ``PAD + "<k>"`` up to the
    next boundary (safetensors allows no holes; what it holds means nothing); then the staged
    tensors back to back, by element size then name. Every tensor stays aligned to its element
    size. Where the file system refuses direct I/O (tmpfs, some network file systems: EINVAL),
    ``usable`` turns False and the caller writes buffered, as before.
    """

    ALIGN = 4096  # offsets, lengths and addresses of direct writes: the largest usual block size
    BLOCK = 16 << 20
    FROM_MEMORY = 1 << 18  # tensors at least this large are written from their own memory
    PAD = "__driftcheck_pad__."

    def __init__(self) -> None:
        self.usable = hasattr(os, "O_DIRECT")
        self._blocks: list[mmap.mmap] = []  # two, page-aligned
        self._io: Any = None  # the helper thread writing, in order (an executor of one)

    def _own_memory(self, t: torch.Tensor, n: int) -> memoryview | None:
        """The ALIGN-rounded bytes of ``t`` in its own memory, where a direct write can take
        them: page-aligned, and the storage runs on to the rounded end."""
        if n < self.FROM_MEMORY or t.data_ptr() % self.ALIGN:
            return None
        start = t.storage_offset() * t.element_size()
        rounded = n + (-n % self.ALIGN)
        storage = t.untyped_storage()
        if storage.nbytes() - start < rounded:
            return None
        whole = torch.empty(0, dtype=torch.uint8).set_(  # type: ignore[call-overload]  # (source, offset, size): no stub
            storage, start, (rounded,))
        return memoryview(whole.numpy())

    def write_file(self, path: str | os.PathLike, order: list[tuple[str, torch.Tensor]],
                   metadata: dict[str, str] | None, checksums: dict[str, int] | None,
                   fsync: bool) -> int | None:
        """Write ``order`` (contiguous host tensors) as a safetensors file in the layout above;
        the file size, or None where this file system does not take direct I/O (nothing is
        left written then)."""
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        own, staged = [], []
        for name, t in order:
            n = t.numel() * t.element_size()
            mem = self._own_memory(t, n)
            if mem is not None:
                own.append((name, t, n, mem))
            elif n:
                staged.append((name, t, n))
            elif checksums is not None:
                checksums[name] = crc32c.crc32c(b"")  # written nowhere: the empty checksum
        offset = 0
        for k, (name, t, n, _) in enumerate(own):
            header[name] = header_entry(name, t, offset, n)
            offset += n
            pad = -offset % self.ALIGN
            if pad:
                header[f"{self.PAD}{k}"] = {"dtype": "U8", "shape": [pad],
                                            "data_offsets": [offset, offset + pad]}
                offset += pad
        staged_at = offset
        for name, t in order:
            if name not in header:
                n = t.numel() * t.element_size()
                header[name] = header_entry(name, t, offset, n)
                offset += n
        raw = strict_json(header)
        raw += b" " * (-(8 + len(raw)) % self.ALIGN)  # the data starts on a block boundary
        head = struct.pack("<Q", len(raw)) + raw
        if len(head) > self.BLOCK:
            return None  # a header of over 16 MiB (~100k tensors): this file goes buffered
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.usable = False
            return None
        if not self._blocks:
            from concurrent.futures import ThreadPoolExecutor

            self._blocks = [mmap.mmap(-1, self.BLOCK), mmap.mmap(-1, self.BLOCK)]
            self._io = ThreadPoolExecutor(1, thread_name_prefix="driftcheck-direct-io")
        writes: list[Any] = []  # in flight, in order
        try:
            base = len(head)
            head_block = memoryview(self._blocks[0])
            head_block[:base] = head
            _pwrite_all(fd, head_block[:base], 0)
            for name, _, n, mem in own:
                writes.append(self._io.submit(_pwrite_all, fd, mem, base + int(header[name]["data_offsets"][0])))
                if checksums is not None and name not in checksums:  # (else known: see shard.py)
                    checksums[name] = crc32c.crc32c(mem[:n])
            self._stage(fd, base + staged_at, staged, checksums, writes)
            for w in writes:
                w.result()
            os.ftruncate(fd, base + offset)  # the last write's rounding is not part of the file
            if fsync:
                os.fsync(fd)
        except BaseException as e:
            for w in writes:
                w.exception()  # wait: no write may land after the file is gone
            os.close(fd)
            if not isinstance(e, OSError) or e.errno != errno.EINVAL:
                raise
            self.usable = False  # the device wants another alignment: buffered from now on
            Path(path).unlink(missing_ok=True)
            return None
        os.close(fd)
        return base + offset

    def _stage(self, fd: int, at_file: int, staged: list[tuple[str, torch.Tensor, int]],
               checksums: dict[str, int] | None, writes: list[Any]) -> None:
        """Copy ``staged`` into the blocks in turn, each full block written by the helper from
        ``at_file`` on; a block is filled again once its last write is done."""
        blocks = [memoryview(b) for b in self._blocks]
        last: list[Any] = [None, None]  # the write in flight from each block
        cur, fill = 0, 0
        for name, t, n in staged:
            view = raw_bytes(t)
            crc, at = 0, 0
            known = checksums is None or name in checksums
            while at < n:
                k = min(n - at, self.BLOCK - fill)
                dst = blocks[cur][fill:fill + k]
                dst[:] = view[at:at + k]
                if not known:
                    crc = crc32c.crc32c(dst, crc)
                fill += k
                at += k
                if fill == self.BLOCK:  # hand it to the helper, fill the other one
                    last[cur] = self._io.submit(_pwrite_all, fd, blocks[cur], at_file)
                    writes.append(last[cur])
                    at_file += fill
                    cur, fill = 1 - cur, 0
                    if last[cur] is not None:
                        last[cur].result()
            if not known:
                checksums[name] = crc  # type: ignore[index]
        if fill:
            pad = -fill % self.ALIGN
            blocks[cur][fill:fill + pad] = bytes(pad)
            writes.append(self._io.submit(_pwrite_all, fd, blocks[cur][:fill + pad], at_file))

    def close(self) -> None:
        """Stop the helper thread and free the blocks (a later write makes them again)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        self._blocks = []  # unmapped when the last view of them goes (an error's traceback)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (direct I/O: a short write leaves an aligned
    remainder, or fails)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n

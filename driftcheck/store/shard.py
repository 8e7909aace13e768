"""The safetensors file layout of shards and replay files: one writer, one reader.

``write_safetensors`` writes a standard safetensors file straight from the tensors' memory;
``MappedShard`` memory-maps one, checks its header against the file and reads tensors whole or
as bounded chunks. Nothing here knows about manifests or entries (reader.py and writer.py do).
"""
from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import crc32c
import orjson
import torch

from driftcheck import dtypes
from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.store.format import json_safe


def code_of(dtype: torch.dtype, name: str) -> str:
    """The safetensors code of a dtype a trace can store; a clear error for one it cannot."""
    code = dtypes.SAFETENSORS_CODES.get(dtypes.name_of(dtype))
    if code is None:
        raise DriftcheckError(f"tensor {name!r} has dtype {dtype}, which a safetensors trace cannot "
                              "store; cast it (complex128 -> complex64, float64 real/imag) first")
    return code


def write_error(trace_dir: Path, e: OSError) -> DriftcheckError:
    return DriftcheckError(
        f"writing trace {trace_dir} failed: {e.strerror or e} "
        f"({errno.errorcode.get(e.errno or 0, 'OSError')}); free space on that disk, or "
        "record to another --out, or capture less (--mode stats, --include, --phases)")


def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None, fsync: bool = True,
                      checksums: dict[str, int] | None = None,
                      stage: "DirectStage | None" = None) -> int:
    """Write contiguous CPU tensors as one safetensors file, straight from their memory.

    A standard safetensors file (header padded to 8 bytes, tensors ordered by element size then
    name, so each is aligned) written without ``safetensors.torch.save_file``'s intermediate
    ``bytes`` copy of every tensor. Returns the file size. ``checksums``: filled with the CRC32C
    of each tensor's bytes, as written. ``stage``: write with direct I/O through it where the
    file system allows (``DirectStage``: its layout), else buffered.
    """
    order = sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))
    if checksums is not None:
        checksums.update((name, crc32c.crc32c(b"")) for name, t in order if not t.numel())
    if stage is not None and stage.usable:
        size = stage.write_file(path, order, metadata, checksums, fsync)
        if size is not None:
            return size
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    views = []
    for name, t in order:
        view = _raw_bytes(t)
        n = view.nbytes
        header[name] = {"dtype": code_of(t.dtype, name), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
        if n:
            views.append((name, view))
    raw = strict_json(header)
    raw += b" " * (-len(raw) % 8)
    if checksums is not None:
        for name, view in views:
            checksums[name] = crc32c.crc32c(view)
    views = [v for _, v in views]
    # Buffered: stats-mode shards hold thousands of 1-2 KiB samples (one syscall each would
    # dominate); a tensor larger than the buffer still goes straight from its memory.
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.writelines(views)  # BufferedWriter: whole buffers, partial raw writes retried
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return 8 + len(raw) + offset


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
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, start, (rounded,))
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
        offset = 0
        for k, (name, t, n, _) in enumerate(own):
            header[name] = {"dtype": code_of(t.dtype, name), "shape": list(t.shape),
                            "data_offsets": [offset, offset + n]}
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
                header[name] = {"dtype": code_of(t.dtype, name), "shape": list(t.shape),
                                "data_offsets": [offset, offset + n]}
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
                if checksums is not None:
                    checksums[name] = crc32c.crc32c(mem[:n])
            self._stage(fd, base + staged_at, staged, checksums, writes)
            for w in writes:
                w.result()
            os.ftruncate(fd, base + offset)  # the last write's rounding is not part of the file
            if fsync:
                os.fsync(fd)
        except OSError as e:
            for w in writes:
                w.exception()  # wait: no write may land after the file is gone
            os.close(fd)
            if e.errno != errno.EINVAL:
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
            view = _raw_bytes(t)
            crc, at = 0, 0
            while at < n:
                k = min(n - at, self.BLOCK - fill)
                dst = blocks[cur][fill:fill + k]
                dst[:] = view[at:at + k]
                if checksums is not None:
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
            if checksums is not None:
                checksums[name] = crc
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


_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def strict_json(obj: Any) -> bytes:
    """``obj`` (a manifest, a shard header) as compact, strict JSON (UTF-8): NaN/Inf become null,
    as ``format.json_safe`` makes them; non-string keys become strings and other objects
    ``str()``, as json.dumps with ``json_default`` does. orjson: a 720-entry manifest takes
    0.3 ms instead of 5.5 ms."""
    try:
        return orjson.dumps(obj, default=json_default, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, a very deep nesting
        return json.dumps(json_safe(obj, default=json_default), allow_nan=False,
                          separators=(",", ":")).encode()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (through numpy where it has the
    dtype: cheaper than torch's reshape and view for the many small tensors of a shard)."""
    try:
        return memoryview(t.numpy()).cast("B")
    except (TypeError, RuntimeError):  # bfloat16, fp8: no numpy dtype
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def json_default(o: Any) -> Any:
    if isinstance(o, float):
        return repr(o)
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    return str(o)


def shares_storage(t: torch.Tensor, others: dict[str, torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return True
    return any(o.untyped_storage().data_ptr() == ptr for o in others.values())


def unshare(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out = {}
    for k, v in d.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


# ---------------------------------------------------------------------------------------


class MappedShard:
    """One safetensors file (a shard; ``what`` names it in errors), memory-mapped, its header parsed
    and checked against the file."""

    def __init__(self, path: Path, what: str = "shard") -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise TraceError(f"{what} {path} is not a safetensors file (bad header length); "
                                 "the trace is corrupt")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise TraceError(f"{what} {path} has an unreadable safetensors header") from None
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        if not isinstance(header, dict):
            raise TraceError(f"{what} {path} has an unreadable safetensors header")
        base = 8 + n
        meta = header.get("__metadata__")
        self.metadata: dict[str, str] = meta if isinstance(meta, dict) else {}
        self.tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = dtypes.torch_dtype(dtypes.CODE_NAMES[info["dtype"]])
                shape = [int(d) for d in info["shape"]]
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise TraceError(f"{what} {path}: tensor {name!r} has a malformed header entry") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if b < 0 or e - b != nbytes or base + e > size or any(d < 0 for d in shape):
                raise TraceError(f"{what} {path}: tensor {name!r} lies outside the file or its size "
                                 "disagrees with its shape; the trace is corrupt")
            self.tensors[name] = (dtype, shape, base + b, base + e)

    def read(self, dtype: torch.dtype, shape: list[int], begin: int, end: int) -> torch.Tensor:
        """One whole tensor, copied out of the mapping (its pages released after the copy)."""
        n = (end - begin) // dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on a mapping: fine, we never write
            out = torch.frombuffer(self.mm, dtype=dtype, count=n, offset=begin).reshape(shape).clone()
        page = mmap.PAGESIZE
        self._release(begin - begin % page, min(len(self.mm), -(-end // page) * page))
        return out

    def checksum(self, begin: int, end: int) -> int:
        """CRC32C of the bytes [begin, end) (pages released after)."""
        if end <= begin:
            return crc32c.crc32c(b"")
        value = crc32c.crc32c(memoryview(self.mm)[begin:end])
        page = mmap.PAGESIZE
        self._release(begin - begin % page, min(len(self.mm), -(-end // page) * page))
        return value

    def iter_chunks(self, dtype: torch.dtype, begin: int, end: int,
                    chunk_elems: int) -> Iterator[torch.Tensor]:
        item = dtype.itemsize
        total = (end - begin) // item
        if total == 0:
            return
        page = mmap.PAGESIZE
        try:
            for start in range(0, total, chunk_elems):
                n = min(chunk_elems, total - start)
                off = begin + start * item
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # frombuffer on a mapping: fine, we never write
                    yield torch.frombuffer(self.mm, dtype=dtype, count=n, offset=off)
                # Drop the chunk's pages from this process: the file stays in the page cache,
                # and a later access simply faults them in again. Keep a page the next chunk
                # shares.
                hi = off + n * item
                self._release(off - off % page, hi - hi % page)
        finally:
            # The whole range once more, also when the reader stopped early (zip stops at the
            # shorter iterator): pages the kernel mapped around our faults (fault-around, large
            # folios), here or from another thread reading a neighbouring range, go too.
            self._release(begin - begin % page, min(len(self.mm), -(-end // page) * page))

    def _release(self, lo: int, hi: int) -> None:
        if hi > lo and hasattr(self.mm, "madvise"):
            try:
                self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                pass

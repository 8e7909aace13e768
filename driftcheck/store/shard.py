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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import orjson
import torch

from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.numerics import dtypes
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
                      stage: Any = None) -> int:
    """Write contiguous CPU tensors as one safetensors file, straight from their memory.

    A standard safetensors file (header padded to 8 bytes, tensors ordered by element size then
    name, so each is aligned) written without ``safetensors.torch.save_file``'s intermediate
    ``bytes`` copy of every tensor. Returns the file size. ``checksums``: filled with the CRC32C
    of each tensor's bytes, as written (a name already in it: its bytes' checksum is known,
    taken where they were copied, and not computed again). ``stage``: write with direct I/O through it where the
    file system allows (``direct.DirectStage``: its layout), else buffered.
    """
    order = sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))
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
        view = raw_bytes(t)
        n = view.nbytes
        header[name] = header_entry(name, t, offset, n)
        offset += n
        if checksums is not None and name not in checksums:
            checksums[name] = crc32c.crc32c(view)
        if n:
            views.append(view)
    raw = strict_json(header)
    raw += b" " * (-len(raw) % 8)
    # Buffered: stats-mode shards hold thousands of 1-2 KiB samples (one syscall each would
    # dominate); a tensor larger than the buffer still goes straight from its memory.
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.writelines(views)  # BufferedWriter: whole buffers, partial raw writes retried
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return 8 + len(raw) + offset


def header_entry(name: str, t: torch.Tensor, offset: int, n: int) -> dict[str, Any]:
    """A tensor's safetensors header entry: ``n`` bytes at ``offset`` of the data."""
    return {"dtype": code_of(t.dtype, name), "shape": list(t.shape), "data_offsets": [offset, offset + n]}


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


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (through numpy where it has the
    dtype: cheaper than torch's reshape and view for the many small tensors of a shard)."""
    try:
        return t.numpy().data.cast("B")
    except (TypeError, RuntimeError):  # bfloat16, fp8: no numpy dtype
        return t.reshape(-1).view(torch.uint8).numpy().data


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
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # size >= 10: checked above
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

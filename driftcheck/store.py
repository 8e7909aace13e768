"""Trace I/O: the only module that reads or writes trace files.

Writer: shards of bounded size, written to a temp name and renamed; ``manifest.json`` last and
atomically. Reader: validates the manifest before touching a shard, refuses paths outside the
trace, reads tensors lazily through safetensors' memory-mapped ``safe_open``. Nothing is ever
unpickled: safetensors and JSON only.
"""
from __future__ import annotations

import collections
import errno
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

import orjson
import torch
from safetensors import safe_open

from driftcheck import format as fmt
from driftcheck.errors import DriftcheckError, TraceError

INCOMPLETE = "INCOMPLETE"  # marker file left by an interrupted record


def _fsync_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare_out_dir(out: str | os.PathLike, force: bool) -> Path:
    """Create ``out`` for a new trace; never overwrite an existing one without ``force``."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise DriftcheckError(f"--out {p} exists and is not a directory; choose another path")
    if p.exists() and any(p.iterdir()):
        if not force:
            raise DriftcheckError(f"--out {p} already exists and is not empty; "
                                  "pass --force to overwrite it or choose another directory")
        if not ((p / fmt.MANIFEST).exists() or (p / INCOMPLETE).exists()):
            # --force replaces a trace, never an arbitrary directory (think --out ~ --force).
            raise DriftcheckError(f"--out {p} is not empty and is not a driftcheck trace; "
                                  "--force only replaces traces: choose another directory")
        # Remove the manifest first so a crash mid-delete never leaves a "complete" trace.
        (p / fmt.MANIFEST).unlink(missing_ok=True)
        for child in p.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    p.mkdir(parents=True, exist_ok=True)
    return p


class TraceWriter:
    """Writes one trace directory. Use as a context manager: an exception aborts the trace.

    Tensors handed to :meth:`add` are grouped into shards of at most ``shard_bytes`` and written
    by a background thread, so writing overlaps the training step. Host memory is bounded:
    tensors accepted but not yet on disk never exceed ``queue_bytes`` (``add`` waits for the
    writer when they would; one tensor larger than that is written on its own). A failure in the
    writer thread (disk full, quota) is raised on the calling thread by the next ``add``,
    ``flush`` or ``close``; the trace is then aborted, so no manifest is ever written over a
    shard that failed.

    Args:
        out: the trace directory to create.
        force: overwrite an existing trace directory.
        shard_bytes: target shard size; a shard is handed to the writer when full.
        queue_bytes: bound on host memory held by tensors waiting to be written.
        background: write on a background thread (False: on the caller's thread, same files).
        fsync: fsync every shard before the manifest is written (a manifest never outlives
            a shard after a power loss).

    ``add`` keeps a reference to the tensor until it is written: callers pass copies they will
    not modify (the tracer does, it copies at hook time).
    """

    def __init__(self, out: str | os.PathLike, *, force: bool = False,
                 shard_bytes: int = 64 << 20, queue_bytes: int = 512 << 20,
                 background: bool = True, fsync: bool = True) -> None:
        self.dir = prepare_out_dir(out, force)
        (self.dir / INCOMPLETE).write_text("record in progress or interrupted\n")
        self.shard_bytes = shard_bytes
        self.queue_bytes = max(queue_bytes, 1)
        self.background = background
        self.fsync = fsync
        self.entries: list[dict[str, Any]] = []
        self.shards: dict[str, int] = {}
        self._shard_index = 0
        self._shard_name = fmt.shard_name(0)  # the shard being filled
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._keys: set[tuple] = set()
        self.closed = False
        # Bytes accepted and not yet on disk (current shard + queued + being written).
        self._held = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, list[tuple[str, torch.Tensor]], int] | None] = \
            collections.deque()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- tensors -------------------------------------------------------------------------
    def add(self, entry: dict[str, Any], tensor: torch.Tensor | None,
            sample: torch.Tensor | None = None) -> None:
        """Add one manifest entry; ``tensor`` (a host tensor) is stored in the current shard."""
        self._raise_if_failed()
        k = fmt.entry_align(entry)
        if k in self._keys:
            raise RuntimeError(f"duplicate trace key {entry['key']}")
        self._keys.add(k)
        if tensor is not None:
            entry["tensor"] = self._stash(entry["key"], tensor)
        if sample is not None:
            entry["sample"] = self._stash(entry["key"] + "#sample", sample)
        self.entries.append(entry)

    def _stash(self, name: str, tensor: torch.Tensor) -> dict[str, str]:
        t = tensor.detach() if tensor.requires_grad else tensor
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype not in _ST_NAMES:
            _st_dtype(t.dtype, name)  # refuse an unstorable dtype now, not in the writer thread
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self._reserve(nbytes)
        self._pending.append((name, t))
        self._pending_bytes += nbytes
        return {"shard": self._shard_name, "name": name}

    def _reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit in the host-memory bound (backpressure on the caller)."""
        with self._cond:
            if self._held + nbytes <= self.queue_bytes or self._held == 0:
                self._held += nbytes
                return
        # The shard being filled is part of what is held: hand it over so the wait can end.
        if self._pending:
            self.flush()
        with self._cond:
            while self._held and self._held + nbytes > self.queue_bytes and self._error is None:
                self._cond.wait()
            self._held += nbytes
        self._raise_if_failed()

    def flush(self, inline: bool = False) -> None:
        """Hand the current shard to the writer (it is written in the background; ``inline``:
        on this thread, now)."""
        self._raise_if_failed()
        if not self._pending:
            return
        name = self._shard_name
        job = (name, self._pending, self._pending_bytes)
        self._shard_index += 1
        self._shard_name = fmt.shard_name(self._shard_index)
        self._pending, self._pending_bytes = [], 0
        if not self.background or inline:
            self._write_job(job)
            self._raise_if_failed()
            return
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"driftcheck-writer:{self.dir.name}",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
            if job is None:
                return
            self._write_job(job)

    def _write_job(self, job: tuple[str, list[tuple[str, torch.Tensor]], int]) -> None:
        name, tensors, nbytes = job
        try:
            if self._error is None:
                path = self.dir / name
                tmp = self.dir / f".{name}.tmp"
                # fsync at close, once for all shards: a sync per shard would stall the pipeline
                # on the device while the next shard waits (dd's conv=fsync does the same).
                write_safetensors(tmp, tensors, fsync=False)
                os.replace(tmp, path)
                size = path.stat().st_size
                with self._cond:
                    self.shards[name] = size
        except BaseException as e:  # surfaced on the caller's thread
            with self._cond:
                self._error = e
        finally:
            tensors.clear()
            with self._cond:
                self._held -= nbytes
                self._cond.notify_all()

    def drain(self) -> None:
        """Flush and wait until every shard handed over so far is on disk."""
        # No shard went to the background yet (a stats-mode trace is often one small shard):
        # the caller would only wait for it, so it is written here, without a thread to start.
        self.flush(inline=self._thread is None)
        with self._cond:
            while (self._queue or self._held) and self._error is None:
                self._cond.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        e = self._error
        if e is None:
            return
        if isinstance(e, OSError):
            raise _write_error(self.dir, e) from e
        raise DriftcheckError(f"writing trace {self.dir} failed: {type(e).__name__}: {e}") from e

    def _sync_shards(self) -> None:
        """Every shard durable before the manifest that points to it is written."""
        try:
            for name in self.shards:
                fd = os.open(self.dir / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(self.dir, os.O_RDONLY)  # the renames
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _write_error(self.dir, e) from e

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    # -- replay --------------------------------------------------------------------------
    def write_replay(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        tmp = self.dir / f".{fmt.REPLAY}.tmp"
        host = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        host = {k: (v.clone() if _shares_storage(v, {}) else v) for k, v in host.items()}
        try:
            # write_safetensors raises a plain OSError on a full disk (save_file wraps it).
            write_safetensors(tmp, sorted(_unshare(host).items()),
                              metadata={"driftcheck": json.dumps(meta)}, fsync=self.fsync)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_error(self.dir, e) from e
        os.replace(tmp, self.dir / fmt.REPLAY)

    # -- finish --------------------------------------------------------------------------
    def close(self, run: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Write every shard, then the manifest last, atomically. Returns the manifest path."""
        self.drain()
        self._stop_thread()
        if self.fsync:
            self._sync_shards()
        manifest = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "run": run,
                    "shards": dict(sorted(self.shards.items())), "entries": self.entries}
        if (self.dir / fmt.REPLAY).exists():
            manifest["replay"] = fmt.REPLAY
        manifest.update(extra or {})
        # Strict JSON: statistics of a tensor without finite values (all NaN, zero-size) are
        # null. What is validated is what is written: the text, parsed back.
        text = strict_json(manifest)
        fmt.validate_manifest(orjson.loads(text))
        try:
            _fsync_write(self.dir / fmt.MANIFEST, text)
        except OSError as e:
            raise _write_error(self.dir, e) from e
        (self.dir / INCOMPLETE).unlink(missing_ok=True)
        self.closed = True
        return self.dir / fmt.MANIFEST

    def abort(self, reason: str) -> None:
        """Leave a directory that can never pass as complete: no manifest, partial shards gone."""
        self._pending = []
        with self._cond:
            self._queue.clear()
            if self._error is None:
                self._error = RuntimeError(f"trace aborted: {reason}")
            self._cond.notify_all()
        self._stop_thread()
        for p in self.dir.glob(".*.tmp"):
            p.unlink(missing_ok=True)
        (self.dir / fmt.MANIFEST).unlink(missing_ok=True)
        try:
            (self.dir / INCOMPLETE).write_text(f"record did not finish: {reason}\n")
        except OSError:
            pass
        self.closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.closed:
            self.abort(f"{exc_type.__name__}: {exc}")


# safetensors dtype names (the file format's own, see safetensors' format description).
_ST_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}


def _st_dtype(dtype: torch.dtype, name: str) -> str:
    st = _ST_NAMES.get(dtype)
    if st is None:
        raise DriftcheckError(f"tensor {name!r} has dtype {dtype}, which a safetensors trace cannot "
                              "store; cast it (complex128 -> complex64, float64 real/imag) first")
    return st


def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None, fsync: bool = True) -> int:
    """Write contiguous CPU tensors as one safetensors file, straight from their memory.

    A standard safetensors file (header padded to 8 bytes, tensors ordered by element size then
    name, so each is aligned) written without ``safetensors.torch.save_file``'s intermediate
    ``bytes`` copy of every tensor. Returns the file size.
    """
    order = sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    views = []
    for name, t in order:
        view = _raw_bytes(t)
        n = view.nbytes
        header[name] = {"dtype": _st_dtype(t.dtype, name), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
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


_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def strict_json(obj: Any) -> bytes:
    """``obj`` (a manifest, a shard header) as compact, strict JSON (UTF-8): NaN/Inf become null,
    as ``format.json_safe`` makes them; non-string keys become strings and other objects
    ``str()``, as json.dumps with ``_json_default`` does. orjson: a 720-entry manifest takes
    0.3 ms instead of 5.5 ms."""
    try:
        return orjson.dumps(obj, default=_json_default, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, a very deep nesting
        return json.dumps(fmt.json_safe(obj, default=_json_default), allow_nan=False,
                          separators=(",", ":")).encode()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (through numpy where it has the
    dtype: cheaper than torch's reshape and view for the many small tensors of a shard)."""
    try:
        return memoryview(t.numpy()).cast("B")
    except (TypeError, RuntimeError):  # bfloat16, fp8: no numpy dtype
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_error(trace_dir: Path, e: OSError) -> DriftcheckError:
    return DriftcheckError(
        f"writing trace {trace_dir} failed: {e.strerror or e} "
        f"({errno.errorcode.get(e.errno or 0, 'OSError')}); free space on that disk, or "
        "record to another --out, or capture less (--mode stats, --include, --phases)")


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return repr(o)
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    return str(o)


def _shares_storage(t: torch.Tensor, others: dict[str, torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return True
    return any(o.untyped_storage().data_ptr() == ptr for o in others.values())


def _unshare(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out = {}
    for k, v in d.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


# ---------------------------------------------------------------------------------------
class TraceReader:
    """A complete trace, opened read-only. Tensors are read lazily, one at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.dir = Path(path)
        if not self.dir.exists():
            raise TraceError(f"trace {self.dir} does not exist")
        if not self.dir.is_dir():
            raise TraceError(f"trace {self.dir} is not a directory")
        mpath = self.dir / fmt.MANIFEST
        if not mpath.is_file():
            why = ""
            if (self.dir / INCOMPLETE).exists():
                why = ": " + (self.dir / INCOMPLETE).read_text(errors="replace").strip()[:200]
            raise TraceError(f"trace {self.dir} is incomplete (no {fmt.MANIFEST}){why}; "
                             "re-run the record")
        if mpath.is_symlink():
            raise TraceError(f"{mpath} is a symbolic link; a trace's manifest must be a plain file")
        if mpath.stat().st_size > 1 << 30:
            raise TraceError(f"{mpath} is larger than 1 GiB; not a driftcheck manifest")
        try:
            raw = json.loads(mpath.read_bytes())
        except (ValueError, RecursionError) as e:  # bad UTF-8/JSON, absurd numbers, nesting bombs
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise TraceError(f"{mpath} does not parse as JSON ({why}); the trace is corrupt") from None
        try:
            self.manifest = fmt.validate_manifest(raw)
        except fmt.FormatError as e:
            raise TraceError(f"{mpath}: {e}") from None
        self.run: dict[str, Any] = self.manifest["run"]
        self.entries: list[dict[str, Any]] = self.manifest["entries"]
        self._handles: dict[str, Any] = {}
        self._maps: dict[str, _MappedShard] = {}
        self._map_lock = threading.Lock()
        for shard in self.manifest["shards"]:
            self._shard_path(shard)  # refuse links/escapes up front
        self._check_shards()

    def _check_shards(self) -> None:
        """Hold the manifest to the shards' own headers before any tensor is read: every
        referenced tensor exists with the declared shape and dtype. Headers only (their sizes
        checked against the file first), so this costs no tensor reads and no allocation
        from a size the files declare."""
        for e in self.entries:
            for which in ("tensor", "sample"):
                ref = e.get(which)
                if ref is None:
                    continue
                info = self._mapped(ref["shard"]).tensors.get(ref["name"])
                if info is None:
                    raise TraceError(f"shard {self.dir / ref['shard']} has no tensor {ref['name']!r} "
                                     f"(entry {e['key']}); the trace is corrupt")
                dtype, shape = str(info[0]).replace("torch.", ""), info[1]
                if which == "tensor" and (shape != list(e["shape"]) or dtype != e["dtype"]):
                    raise TraceError(f"entry {e['key']}: the manifest says {e['dtype']} {e['shape']}, "
                                     f"shard {ref['shard']} holds {dtype} {shape}; the trace is corrupt")

    def _shard_path(self, shard: str, *, check_size: bool = False) -> Path:
        fmt.check_shard_name(shard)
        p = self.dir / shard
        if p.is_symlink():
            raise TraceError(f"{p} is a symbolic link; shards must be plain files inside the trace")
        if not p.is_file():
            raise TraceError(f"shard {p} is missing; the trace is incomplete or was copied partially")
        if check_size:
            expected = self.manifest["shards"][shard]
            if p.stat().st_size != expected:
                raise TraceError(f"shard {p} has {p.stat().st_size} bytes, the manifest says "
                                 f"{expected}: the file is truncated or was replaced")
        return p

    def _handle(self, shard: str) -> Any:
        h = self._handles.get(shard)
        if h is None:
            p = self._shard_path(shard, check_size=True)
            try:
                h = safe_open(str(p), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise TraceError(f"shard {p} is not a readable safetensors file ({e})") from None
            self._handles[shard] = h
        return h

    def tensor(self, entry: dict[str, Any], which: str = "tensor") -> torch.Tensor | None:
        """The stored tensor of an entry (``which``: "tensor" or "sample"), or None in stats mode."""
        ref = entry.get(which)
        if ref is None:
            return None
        h = self._handle(ref["shard"])
        try:
            sl = h.get_slice(ref["name"])
            shape = list(sl.get_shape())
            dtype = str(sl.get_dtype())
        except Exception as e:
            raise TraceError(f"shard {ref['shard']} has no readable tensor {ref['name']!r} ({e})") from None
        if which == "tensor" and shape != list(entry["shape"]):
            raise TraceError(f"entry {entry['key']}: manifest shape {entry['shape']} disagrees with "
                             f"shard {ref['shard']} shape {shape}; the trace is corrupt")
        if which == "tensor" and not _dtype_matches(dtype, entry["dtype"]):
            raise TraceError(f"entry {entry['key']}: manifest dtype {entry['dtype']} disagrees with "
                             f"shard dtype {dtype}; the trace is corrupt")
        try:
            return h.get_tensor(ref["name"])
        except Exception as e:
            raise TraceError(f"shard {ref['shard']}: tensor {ref['name']!r} cannot be read ({e})") from None

    def chunks(self, entry: dict[str, Any], chunk_elems: int = 1 << 20,
               which: str = "tensor", part: tuple[int, int] | None = None
               ) -> Iterator[torch.Tensor] | None:
        """The stored tensor of an entry as flat row-major chunks of at most ``chunk_elems``
        (only its flat elements [lo, hi) with ``part``; complex counts real and imaginary parts).

        Chunks are zero-copy views of the memory-mapped shard; the pages of each chunk are
        released from this process once the next one is requested, so memory stays bounded by
        the chunk size whatever the tensor or trace size. None when the entry has no ``which``.
        """
        ref = entry.get(which)
        if ref is None:
            return None
        shard = self._mapped(ref["shard"])
        info = shard.tensors.get(ref["name"])
        if info is None:
            raise TraceError(f"shard {ref['shard']} has no tensor {ref['name']!r}; the trace is corrupt")
        dtype, shape, begin, end = info
        if which == "tensor" and (shape != list(entry["shape"]) or str(dtype).replace("torch.", "") != entry["dtype"]):
            raise TraceError(f"entry {entry['key']}: manifest shape/dtype {entry['shape']} "
                             f"{entry['dtype']} disagree with shard {ref['shard']} ({shape} {dtype}); "
                             "the trace is corrupt")
        if part is not None:
            item = dtype.itemsize
            lo, hi = part
            if not 0 <= lo <= hi <= (end - begin) // item:
                raise ValueError(f"part {part} outside the {(end - begin) // item} elements of {entry['key']}")
            begin, end = begin + lo * item, begin + hi * item
        return shard.iter_chunks(dtype, begin, end, max(1, chunk_elems))

    def _mapped(self, shard: str) -> "_MappedShard":
        with self._map_lock:
            m = self._maps.get(shard)
            if m is None:
                m = self._maps[shard] = _MappedShard(self._shard_path(shard, check_size=True))
            return m

    def read_replay(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return read_replay(self.dir)

    def close(self) -> None:
        self._handles.clear()
        self._maps.clear()


_TORCH_DTYPES = {v: getattr(torch, k) for v, k in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"),
    ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"))}


class _MappedShard:
    """One safetensors shard, memory-mapped, its header parsed and checked against the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise TraceError(f"shard {path} is not a safetensors file (bad header length); "
                                 "the trace is corrupt")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise TraceError(f"shard {path} has an unreadable safetensors header") from None
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        if not isinstance(header, dict):
            raise TraceError(f"shard {path} has an unreadable safetensors header")
        base = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _TORCH_DTYPES[info["dtype"]]
                shape = [int(d) for d in info["shape"]]
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TraceError(f"shard {path}: tensor {name!r} has a malformed header entry") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if b < 0 or e - b != nbytes or base + e > size or any(d < 0 for d in shape):
                raise TraceError(f"shard {path}: tensor {name!r} lies outside the file or its size "
                                 "disagrees with its shape; the trace is corrupt")
            self.tensors[name] = (dtype, shape, base + b, base + e)

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


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "C64": "complex64", "C128": "complex128"}


def _dtype_matches(st: str, declared: str) -> bool:
    return _ST_DTYPES.get(st, st.replace("torch.", "")) == declared or st.replace("torch.", "") == declared


def read_replay(trace_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a trace's replay file."""
    p = Path(trace_dir) / fmt.REPLAY
    if not Path(trace_dir).is_dir():
        raise TraceError(f"--replay {trace_dir} is not a trace directory; pass the reference trace "
                         "recorded by driftcheck record")
    if not p.is_file() or p.is_symlink():
        raise TraceError(f"{p} is missing (or not a plain file): --replay needs a trace recorded "
                         "by driftcheck record")
    if not (Path(trace_dir) / fmt.MANIFEST).is_file():
        # The replay file is written first: without a manifest the reference record never finished.
        raise TraceError(f"--replay {trace_dir} is an incomplete trace (no {fmt.MANIFEST}); "
                         "re-record the reference first")
    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("driftcheck", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except TraceError:
        raise
    except Exception as e:
        raise TraceError(f"{p} is not a readable replay file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "driftcheck.replay":
        raise TraceError(f"{p} has no driftcheck replay metadata; re-record the reference")
    return tensors, meta

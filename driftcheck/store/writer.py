"""TraceWriter: the one writer of trace directories.

Shards of bounded size, written by a background thread to a temp name and renamed;
``manifest.json`` last and atomically (its presence means the trace is complete); an
``INCOMPLETE`` marker while a record runs or after it failed.
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import orjson
import torch

from driftcheck.errors import DriftcheckError
from driftcheck.store import format as fmt
from driftcheck.store.buffers import HostBuffers
from driftcheck.store.direct import DirectStage
from driftcheck.store.remote import Remote, is_url, prepare_url, staging_dir
from driftcheck.store.replay import write_replay
from driftcheck.store.shard import code_of, strict_json, write_error, write_safetensors


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; the shards are 0666 & ~umask
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
        if not ((p / fmt.MANIFEST).exists() or (p / fmt.INCOMPLETE).exists()):
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
        direct: write shards with direct I/O where the file system takes it
            (``direct.DirectStage``: no copy into the page cache), buffered elsewhere.

    ``add`` keeps a reference to the tensor until it is written: callers pass copies they will
    not modify (the tracer does, it copies at hook time, into ``buffers``), nor read after
    ``add``: a tensor that is all of its storage, held by nothing else once written, is recycled
    for a later copy (store/buffers.py).
    """

    def __init__(self, out: str | os.PathLike, *, force: bool = False,
                 shard_bytes: int = 64 << 20, queue_bytes: int = 512 << 20,
                 background: bool = True, fsync: bool = True, direct: bool = True) -> None:
        # A URL (store/remote.py): shards staged in a local directory, each uploaded once written
        self.remote: Remote | None = None
        if is_url(out):
            self.remote = prepare_url(str(out), force)
            self.remote.put_bytes(b"record in progress or interrupted\n", fmt.INCOMPLETE)
            self.dir, self.where = staging_dir(), self.remote.url
        else:
            self.dir = prepare_out_dir(out, force)
            self.where = str(self.dir)
        (self.dir / fmt.INCOMPLETE).write_text("record in progress or interrupted\n")
        self.shard_bytes = shard_bytes
        self.queue_bytes = max(queue_bytes, 1)
        self.background = background
        self.fsync = fsync
        self.entries: list[dict[str, Any]] = []
        self.tensor_bytes = 0  # bytes of the tensors added so far (the progress a record shows)
        self.shards: dict[str, int] = {}
        self._shard_index = 0
        self._shard_name = fmt.shard_name(0)  # the shard being filled
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._refs: dict[str, dict[str, Any]] = {}  # tensor name -> its entry's reference
        self._pending_bytes = 0
        self._keys: set[tuple] = set()
        self.closed = False
        # Bytes accepted and not yet on disk (current shard + queued + being written).
        self._held = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, list[tuple[str, torch.Tensor]], int, dict] | None] = \
            collections.deque()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # copies waiting to be written, recycled once they are (store/buffers.py)
        self.buffers = HostBuffers(self.queue_bytes)
        self._stage = DirectStage() if direct else None  # the writer thread's staging block

    # -- tensors -------------------------------------------------------------------------
    def add(self, entry: dict[str, Any], tensor: torch.Tensor | None,
            sample: torch.Tensor | None = None, checksum: int | None = None,
            same: dict[str, Any] | None = None) -> None:
        """Add one manifest entry; ``tensor`` (a host tensor) is stored in the current shard.
        ``checksum``: the CRC32C of its bytes where the caller took it (in the pass that made
        the copy): the writer does not read them again for it. ``same``: an entry added before
        whose stored tensor this one's is too (the same data, captured twice)."""
        self._raise_if_failed()
        k = fmt.entry_align(entry)
        if k in self._keys:
            raise RuntimeError(f"duplicate trace key {entry['key']}")
        self._keys.add(k)
        if same is not None:
            if same.get("tensor") is None:
                raise RuntimeError(f"entry {entry['key']} names the tensor of {same['key']}, which has none")
            entry["tensor"] = same["tensor"]  # one reference: the writer's checksum reaches both
        elif tensor is not None:
            entry["tensor"] = self._stash(entry["key"], tensor, checksum)
        if sample is not None:
            entry["sample"] = self._stash(entry["key"] + "#sample", sample)
        self.entries.append(entry)

    def _stash(self, name: str, tensor: torch.Tensor, checksum: int | None = None) -> dict[str, Any]:
        t = tensor.detach() if tensor.requires_grad else tensor
        if not t.is_cpu or not t.is_contiguous():  # other bytes than those the checksum read
            t, checksum = t.cpu().contiguous(), None
        code_of(t.dtype, name)  # refuse an unstorable dtype now, not in the writer thread
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self._reserve(nbytes)
        self._pending.append((name, t))
        self._pending_bytes += nbytes
        self.tensor_bytes += nbytes
        # the writer thread adds the CRC32C of the bytes it writes (manifest written after it)
        ref: dict[str, Any] = {"shard": self._shard_name, "name": name}
        if checksum is not None:
            ref["crc32c"] = checksum
        self._refs[name] = ref
        return ref

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
        job = (name, self._pending, self._pending_bytes, self._refs)
        self._shard_index += 1
        self._shard_name = fmt.shard_name(self._shard_index)
        self._pending, self._pending_bytes, self._refs = [], 0, {}
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

    def _write_job(self, job: tuple[str, list[tuple[str, torch.Tensor]], int, dict]) -> None:
        name, tensors, nbytes, refs = job
        try:
            if self._error is None:
                path = self.dir / name
                tmp = self.dir / f".{name}.tmp"
                # fsync at close, once for all shards: a sync per shard would stall the pipeline
                # on the device while the next shard waits (dd's conv=fsync does the same).
                sums = {n: r["crc32c"] for n, r in refs.items() if "crc32c" in r}  # known
                write_safetensors(tmp, tensors, fsync=False, checksums=sums, stage=self._stage)
                for tensor_name, value in sums.items():
                    refs[tensor_name]["crc32c"] = value
                os.replace(tmp, path)
                size = path.stat().st_size
                if self.remote is not None:  # uploaded as soon as it is complete, then dropped here
                    self.remote.put(path, name)
                    path.unlink()
                with self._cond:
                    self.shards[name] = size
        except BaseException as e:  # surfaced on the caller's thread
            with self._cond:
                self._error = e
        finally:
            if self._error is None:
                for _, t in tensors:
                    # this list and the loop hold it (+1 for getrefcount's argument): a tensor
                    # also waiting in another shard, or added twice, is not given back
                    if sys.getrefcount(t) <= 3:
                        self.buffers.give(t)
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
        if self.remote is not None and isinstance(e, DriftcheckError):  # an upload: says the URL
            raise DriftcheckError(str(e)) from e
        if isinstance(e, OSError):
            raise write_error(self.dir, e) from e
        raise DriftcheckError(f"writing trace {self.where} failed: {type(e).__name__}: {e}") from e

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
            raise write_error(self.dir, e) from e

    def _release_memory(self) -> None:
        """Drop the recycled copies and the staging blocks (the writer thread has stopped)."""
        self.buffers.clear()
        if self._stage is not None:
            self._stage.close()

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
        """Write the trace's replay file (driftcheck/store/replay.py)."""
        write_replay(self.dir, tensors, meta, fsync=self.fsync)
        if self.remote is not None:
            self.remote.put(self.dir / fmt.REPLAY, fmt.REPLAY)  # kept here: close() sees it

    # -- finish --------------------------------------------------------------------------
    def close(self, run: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Write every shard, then the manifest last, atomically. Returns the manifest path."""
        self.drain()
        self._stop_thread()
        self._release_memory()
        if self.fsync and self.remote is None:
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
            raise write_error(self.dir, e) from e
        if self.remote is not None:  # every shard is up: the manifest last
            self.remote.put(self.dir / fmt.MANIFEST, fmt.MANIFEST)
            self.remote.remove(fmt.INCOMPLETE)
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            (self.dir / fmt.INCOMPLETE).unlink(missing_ok=True)
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
        self._release_memory()
        for p in self.dir.glob(".*.tmp"):
            p.unlink(missing_ok=True)
        (self.dir / fmt.MANIFEST).unlink(missing_ok=True)
        try:
            (self.dir / fmt.INCOMPLETE).write_text(f"record did not finish: {reason}\n")
        except OSError:
            pass
        if self.remote is not None:
            self._abort_remote(reason)
        self.closed = True

    def _abort_remote(self, reason: str) -> None:
        """The URL says why; the staging directory goes (best effort: the URL has no manifest
        whatever fails here, so it reads as incomplete)."""
        assert self.remote is not None
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.remote.remove(fmt.MANIFEST)
            self.remote.put_bytes(f"record did not finish: {reason}\n".encode(), fmt.INCOMPLETE)
        except DriftcheckError:
            pass

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.closed:
            self.abort(f"{exc_type.__name__}: {exc}")


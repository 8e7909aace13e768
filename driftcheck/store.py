"""Trace I/O: the only module that reads or writes trace files.

Writer: shards of bounded size, written to a temp name and renamed; ``manifest.json`` last and
atomically. Reader: validates the manifest before touching a shard, refuses paths outside the
trace, reads tensors lazily through safetensors' memory-mapped ``safe_open``. Nothing is ever
unpickled: safetensors and JSON only.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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
    """Writes one trace directory. Use as a context manager: an exception aborts the trace."""

    def __init__(self, out: str | os.PathLike, *, force: bool = False,
                 shard_bytes: int = 256 << 20) -> None:
        self.dir = prepare_out_dir(out, force)
        (self.dir / INCOMPLETE).write_text("record in progress or interrupted\n")
        self.shard_bytes = shard_bytes
        self.entries: list[dict[str, Any]] = []
        self.shards: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._keys: set[tuple] = set()
        self.closed = False

    # -- tensors -------------------------------------------------------------------------
    def add(self, entry: dict[str, Any], tensor: torch.Tensor | None,
            sample: torch.Tensor | None = None) -> None:
        """Add one manifest entry; ``tensor`` (a host tensor) is stored in the current shard."""
        k = fmt.entry_key(entry).align
        if k in self._keys:
            raise RuntimeError(f"duplicate trace key {entry['key']}")
        self._keys.add(k)
        if tensor is not None:
            entry["tensor"] = self._stash(entry["key"], tensor)
        if sample is not None:
            entry["sample"] = self._stash(entry["key"] + "#sample", sample)
        self.entries.append(entry)

    def _stash(self, name: str, tensor: torch.Tensor) -> dict[str, str]:
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self._pending[name] = t.clone() if _shares_storage(t, self._pending) else t
        self._pending_bytes += nbytes
        return {"shard": fmt.shard_name(len(self.shards)), "name": name}

    def flush(self) -> None:
        if not self._pending:
            return
        name = fmt.shard_name(len(self.shards))
        path = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        save_file(self._pending, str(tmp))
        os.replace(tmp, path)
        self.shards[name] = path.stat().st_size
        self._pending = {}
        self._pending_bytes = 0

    # -- replay --------------------------------------------------------------------------
    def write_replay(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        tmp = self.dir / f".{fmt.REPLAY}.tmp"
        host = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        host = {k: (v.clone() if _shares_storage(v, {}) else v) for k, v in host.items()}
        save_file(_unshare(host), str(tmp), metadata={"driftcheck": json.dumps(meta)})
        os.replace(tmp, self.dir / fmt.REPLAY)

    # -- finish --------------------------------------------------------------------------
    def close(self, run: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Flush and write the manifest last, atomically. Returns the manifest path."""
        self.flush()
        manifest = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "run": run,
                    "shards": self.shards, "entries": self.entries}
        if (self.dir / fmt.REPLAY).exists():
            manifest["replay"] = fmt.REPLAY
        manifest.update(extra or {})
        fmt.validate_manifest(json.loads(json.dumps(manifest)))
        _fsync_write(self.dir / fmt.MANIFEST, json.dumps(manifest, indent=1, allow_nan=False,
                                                         default=_json_default).encode())
        (self.dir / INCOMPLETE).unlink(missing_ok=True)
        self.closed = True
        return self.dir / fmt.MANIFEST

    def abort(self, reason: str) -> None:
        """Leave a directory that can never pass as complete: no manifest, partial shards gone."""
        self._pending = {}
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
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceError(f"{mpath} does not parse as JSON ({e}); the trace is corrupt") from None
        try:
            self.manifest = fmt.validate_manifest(raw)
        except fmt.FormatError as e:
            raise TraceError(f"{mpath}: {e}") from None
        self.run: dict[str, Any] = self.manifest["run"]
        self.entries: list[dict[str, Any]] = self.manifest["entries"]
        self._handles: dict[str, Any] = {}
        for shard in self.manifest["shards"]:
            self._shard_path(shard)  # refuse links/escapes up front

    def _shard_path(self, shard: str) -> Path:
        fmt.check_shard_name(shard)
        p = self.dir / shard
        if p.is_symlink():
            raise TraceError(f"{p} is a symbolic link; shards must be plain files inside the trace")
        if not p.is_file():
            raise TraceError(f"shard {p} is missing; the trace is incomplete or was copied partially")
        return p

    def _handle(self, shard: str) -> Any:
        h = self._handles.get(shard)
        if h is None:
            p = self._shard_path(shard)
            expected = self.manifest["shards"][shard]
            if p.stat().st_size != expected:
                raise TraceError(f"shard {p} has {p.stat().st_size} bytes, the manifest says "
                                 f"{expected}: the file is truncated or was replaced")
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

    def read_replay(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return read_replay(self.dir)

    def close(self) -> None:
        self._handles.clear()


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "C64": "complex64", "C128": "complex128"}


def _dtype_matches(st: str, declared: str) -> bool:
    return _ST_DTYPES.get(st, st.replace("torch.", "")) == declared or st.replace("torch.", "") == declared


def read_replay(trace_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a trace's replay file."""
    p = Path(trace_dir) / fmt.REPLAY
    if not p.is_file() or p.is_symlink():
        raise TraceError(f"{p} is missing (or not a plain file): --replay needs a trace recorded "
                         "by driftcheck record")
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


def iter_entries(reader: TraceReader) -> Iterator[dict[str, Any]]:
    yield from reader.entries

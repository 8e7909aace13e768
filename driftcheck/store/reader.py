"""TraceReader: the one reader of trace directories.

It validates the manifest before touching a shard, holds the manifest to every shard's header,
refuses paths outside the trace, and reads tensors lazily from memory-mapped shards: whole
(``tensor``) or as bounded flat chunks (``chunks``). Nothing is ever unpickled.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from driftcheck.errors import TraceError
from driftcheck.numerics import dtypes
from driftcheck.store import format as fmt
from driftcheck.store.remote import ShardCache, is_url
from driftcheck.store.replay import read_replay
from driftcheck.store.shard import MappedShard


class TraceReader:
    """A complete trace, opened read-only. Tensors are read lazily, one at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.cache: ShardCache | None = None  # a trace at a URL: read through a local cache
        if is_url(path):
            self._open_url(str(path))
            return
        self.dir = Path(path)
        self.where = str(self.dir)
        if not self.dir.exists():
            raise TraceError(f"trace {self.dir} does not exist")
        if not self.dir.is_dir():
            raise TraceError(f"trace {self.dir} is not a directory")
        mpath = self.dir / fmt.MANIFEST
        if not mpath.is_file():
            why = ""
            if (self.dir / fmt.INCOMPLETE).exists():
                why = ": " + (self.dir / fmt.INCOMPLETE).read_text(errors="replace").strip()[:200]
            raise TraceError(f"trace {self.dir} is incomplete (no {fmt.MANIFEST}){why}; "
                             "re-run the record")
        if mpath.is_symlink():
            raise TraceError(f"{mpath} is a symbolic link; a trace's manifest must be a plain file")
        self._load_manifest(mpath, str(mpath))
        for shard in self.manifest["shards"]:
            self._shard_path(shard)  # refuse links/escapes up front
        self._check_shards()

    def _open_url(self, url: str) -> None:
        """A trace at a URL (store/remote.py): the manifest now, each shard when first read, its
        headers checked then (on disk: all of them now)."""
        self.cache = ShardCache(url)
        self.dir = self.cache.dir
        self.where = self.cache.remote.url
        self._load_manifest(self.cache.manifest(), self.cache.remote.where(fmt.MANIFEST))
        for shard in self.manifest["shards"]:
            fmt.check_shard_name(shard)

    def _load_manifest(self, mpath: Path, shown: str) -> None:
        if mpath.stat().st_size > 1 << 30:
            raise TraceError(f"{shown} is larger than 1 GiB; not a driftcheck manifest")
        try:
            raw = json.loads(mpath.read_bytes())
        except (ValueError, RecursionError) as e:  # bad UTF-8/JSON, absurd numbers, nesting bombs
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise TraceError(f"{shown} does not parse as JSON ({why}); the trace is corrupt") from None
        try:
            self.manifest = fmt.validate_manifest(raw)
        except fmt.FormatError as e:
            raise TraceError(f"{shown}: {e}") from None
        self.run: dict[str, Any] = self.manifest["run"]
        self.entries: list[dict[str, Any]] = self.manifest["entries"]
        self._maps: dict[str, MappedShard] = {}
        self._verified: set[str] = set()  # shards whose entries' checksums held
        self._checksummed: dict[str, list[tuple[dict[str, Any], str]]] | None = None
        self._map_lock = threading.Lock()

    def _check_shards(self) -> None:
        """Hold the manifest to the shards' own headers before any tensor is read: every
        referenced tensor exists with the declared shape and dtype. Headers only (their sizes
        checked against the file first), so this costs no tensor reads and no allocation
        from a size the files declare."""
        for e in self.entries:
            for which in ("tensor", "sample"):
                ref = e.get(which)
                if ref is not None:
                    self._check_header(e, which, self._mapped(ref["shard"]))

    def _check_header(self, e: dict[str, Any], which: str, m: MappedShard) -> None:
        ref = e[which]
        info = m.tensors.get(ref["name"])
        if info is None:
            raise TraceError(f"shard {self._shown(ref['shard'])} has no tensor {ref['name']!r} "
                             f"(entry {e['key']}); the trace is corrupt")
        dtype, shape = str(info[0]).replace("torch.", ""), info[1]
        if which == "tensor" and (shape != list(e["shape"]) or dtype != e["dtype"]):
            raise TraceError(f"entry {e['key']}: the manifest says {e['dtype']} {e['shape']}, "
                             f"shard {ref['shard']} holds {dtype} {shape}; the trace is corrupt")

    def _shown(self, shard: str) -> str:
        """A shard as messages name it: its path, or its URL."""
        return str(self.dir / shard) if self.cache is None else self.cache.remote.where(shard)

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

    def tensor(self, entry: dict[str, Any], which: str = "tensor") -> torch.Tensor | None:
        """The stored tensor of an entry (``which``: "tensor" or "sample"), or None in stats mode."""
        ref = entry.get(which)
        if ref is None:
            return None
        shard = self._mapped(ref["shard"], verify=True)
        dtype, shape, begin, end = self._located(entry, which, shard)
        return shard.read(dtype, shape, begin, end)

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
        shard = self._mapped(ref["shard"], verify=True)
        dtype, _, begin, end = self._located(entry, which, shard)
        if part is not None:
            item = dtype.itemsize
            lo, hi = part
            if not 0 <= lo <= hi <= (end - begin) // item:
                raise ValueError(f"part {part} outside the {(end - begin) // item} elements of {entry['key']}")
            begin, end = begin + lo * item, begin + hi * item
        return shard.iter_chunks(dtype, begin, end, max(1, chunk_elems))

    def _located(self, entry: dict[str, Any], which: str,
                 shard: MappedShard) -> tuple[torch.dtype, list[int], int, int]:
        """Where an entry's tensor lies in its shard, held to the manifest's shape and dtype."""
        ref = entry[which]
        info = shard.tensors.get(ref["name"])
        if info is None:
            raise TraceError(f"shard {ref['shard']} has no tensor {ref['name']!r}; the trace is corrupt")
        dtype, shape = info[0], info[1]
        if which == "tensor" and (shape != list(entry["shape"]) or dtypes.name_of(dtype) != entry["dtype"]):
            raise TraceError(f"entry {entry['key']}: manifest shape/dtype {entry['shape']} "
                             f"{entry['dtype']} disagree with shard {ref['shard']} ({shape} {dtype}); "
                             "the trace is corrupt")
        return info

    def _mapped(self, shard: str, verify: bool = False) -> MappedShard:
        """The mapped shard; ``verify``: its entries' checksums checked first (once a shard, the
        first time its data is read), so a byte changed in place is a corrupt trace, not drift."""
        with self._map_lock:
            m = self._maps.get(shard)
            if m is None and self.cache is not None:
                m = self._fetched(shard)
            if m is None:
                m = self._maps[shard] = MappedShard(self._shard_path(shard, check_size=True))
            if verify and shard not in self._verified:
                self._verify(shard, m)
                self._verified.add(shard)
            return m

    def _fetched(self, shard: str) -> MappedShard:
        """A shard of a trace at a URL, downloaded, its size and headers held to the manifest;
        the shards the cache dropped to make room are forgotten (fetched and verified again if
        read again). Called under the map lock."""
        assert self.cache is not None
        path, dropped = self.cache.fetch(shard, self.manifest["shards"][shard])
        for old in dropped:
            self._maps.pop(old, None)
            self._verified.discard(old)
        expected = self.manifest["shards"][shard]
        if path.stat().st_size != expected:
            raise TraceError(f"shard {self._shown(shard)} has {path.stat().st_size} bytes, the manifest "
                             f"says {expected}: the object is truncated or was replaced")
        m = self._maps[shard] = MappedShard(path)
        for e in self.entries:
            for which in ("tensor", "sample"):
                ref = e.get(which)
                if ref is not None and ref["shard"] == shard:
                    self._check_header(e, which, m)
        return m

    def _verify(self, shard: str, m: MappedShard) -> None:
        if self._checksummed is None:  # shard -> (entry, which) with a checksum, made once
            self._checksummed = {}
            named: set[tuple[str, str]] = set()  # a tensor several entries share: checked once
            for e in self.entries:
                for which in ("tensor", "sample"):
                    ref = e.get(which)
                    if ref is not None and ref.get("crc32c") is not None \
                            and (ref["shard"], ref["name"]) not in named:
                        named.add((ref["shard"], ref["name"]))
                        self._checksummed.setdefault(ref["shard"], []).append((e, which))
        for e, which in self._checksummed.get(shard, ()):
            ref = e[which]
            _, _, begin, end = m.tensors[ref["name"]]
            got = m.checksum(begin, end)
            if got != ref["crc32c"]:
                raise TraceError(
                    f"shard {self._shown(shard)}: the bytes of entry {e['key']} ({which}) fail "
                    f"their checksum (crc32c {got:08x}, the manifest says {ref['crc32c']:08x}): "
                    "the file changed after it was written; the trace is corrupt, re-record it")

    def read_replay(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return read_replay(self.where if self.cache is not None else self.dir)

    def close(self) -> None:
        self._maps.clear()
        if self.cache is not None:
            self.cache.close()

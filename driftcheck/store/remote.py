"""Traces at a URL (``s3://``, ``gs://``, any fsspec URL): the one place that knows about URLs.

A trace at a URL is the same files as on disk (docs/storage.md). It is written through a local
staging directory: each shard is uploaded as soon as it is complete and then removed locally,
the replay file likewise, the manifest last, after every shard is up, so a crash leaves no
manifest at the URL and the trace reads as incomplete, as on disk. It is read through a local
cache: the manifest first, then each shard when its data is first needed, the least recently
used shards dropped beyond a byte budget (``DRIFTCHECK_CACHE_BYTES``, 2 GiB by default).

fsspec (the ``cloud`` extra) is imported only for a URL: a local path never reaches this module
beyond ``is_url``. Credentials are fsspec's and the storage library's own (for S3 the standard
AWS variables, ``AWS_ENDPOINT_URL``, profiles; for GCS ``GOOGLE_APPLICATION_CREDENTIALS``).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.store import format as fmt

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# file systems whose first path component is a bucket (or container) that must exist
_LOCAL_PROTOCOLS = frozenset({"file", "local", "memory"})
CACHE_VAR = "DRIFTCHECK_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 2 << 30
T = TypeVar("T")


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` (a ``str``; a ``Path`` is always local)."""
    return isinstance(path, str) and bool(_SCHEME.match(path))


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise DriftcheckError(f"{url}: traces at a URL need the cloud extra: "
                              "pip install 'driftcheck[cloud]' (fsspec, s3fs, gcsfs)") from None
    try:
        # a new instance each time: the credentials in the environment now, not a cached session's
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except ImportError as e:
        raise DriftcheckError(f"{url}: {str(e).strip()}; pip install 'driftcheck[cloud]'") from None
    except ValueError as e:
        raise DriftcheckError(f"{url}: not a storage URL fsspec knows ({e})") from None
    return fs, str(root).rstrip("/")


class Remote:
    """One trace directory at a URL: its objects listed, read, written and removed, every failure
    a one-line DriftcheckError (a missing bucket, refused credentials, the network)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = _filesystem(self.url)
        self._checked = False

    def where(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def guard(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, its failure as one line naming the URL."""
        try:
            return fn()
        except DriftcheckError:
            raise
        except PermissionError as e:
            raise DriftcheckError(f"{self.url}: access denied while {what} ({_first_line(e)}); check the "
                                  "credentials (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                                  "AWS_PROFILE; for GCS: GOOGLE_APPLICATION_CREDENTIALS)") from None
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise DriftcheckError(f"{self.url}: the bucket does not exist ({_first_line(e)}); "
                                      "create it or fix the URL") from None
            raise
        except Exception as e:  # the storage library's own errors (network, service)
            raise DriftcheckError(f"{self.url}: {what} failed: {type(e).__name__}: {_first_line(e)}") from None

    def check_bucket(self) -> None:
        """The bucket exists and the credentials are accepted (once per URL)."""
        if self._checked:
            return
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        bucket = self.root.split("/", 1)[0]
        if protocol not in _LOCAL_PROTOCOLS and bucket:
            def probe() -> None:
                try:
                    self.fs.info(bucket)  # one HEAD request, whatever the bucket holds
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"bucket {bucket!r}: {_first_line(e)}") from None
            self.guard("checking the bucket", probe)
        self._checked = True

    def names(self) -> list[str]:
        """The names directly under the trace's URL ([] where nothing is there)."""
        self.check_bucket()

        def listing() -> list[str]:
            try:
                found = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
            return sorted({str(p).rstrip("/").rsplit("/", 1)[-1] for p in found} - {""})
        self.fs.invalidate_cache()
        return self.guard("listing", listing)

    def exists(self, name: str) -> bool:
        self.check_bucket()

        def info() -> bool:
            try:
                self.fs.info(self._path(name))
            except FileNotFoundError:
                return False
            return True
        self.fs.invalidate_cache()
        return self.guard(f"looking for {name}", info)

    def get(self, name: str, dest: Path) -> None:
        """Download ``name`` to ``dest`` (a temp name, renamed: a partial download never shows)."""
        self.check_bucket()
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            self.guard(f"downloading {name}", lambda: self.fs.get_file(self._path(name), str(tmp)))
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, name: str = "") -> bytes:
        self.check_bucket()
        return self.guard(f"reading {name or 'it'}",
                          lambda: bytes(self.fs.cat_file(self._path(name) if name else self.root)))

    def put(self, src: Path, name: str) -> None:
        self.check_bucket()
        self.guard(f"uploading {name}", lambda: self.fs.put_file(str(src), self._path(name)))

    def put_bytes(self, data: bytes, name: str = "") -> None:
        self.check_bucket()
        self.guard(f"writing {name or 'it'}",
                   lambda: self.fs.pipe_file(self._path(name) if name else self.root, data))

    def remove(self, name: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass
        self.guard(f"removing {name}", rm)

    def remove_all(self) -> None:
        """Every object under the trace's URL (after the manifest: never a complete-looking half)."""
        if self.exists(fmt.MANIFEST):
            self.remove(fmt.MANIFEST)
        paths = [self._path(name) for name in self.names()]
        if paths:
            self.guard("removing the earlier trace", lambda: self.fs.rm(paths, recursive=True))


def read_url(url: str) -> bytes:
    """The bytes of one object (a saved report)."""
    remote = Remote(url)
    return remote.read_bytes()


def write_url(url: str, data: bytes) -> None:
    """One object (a report output), written whole."""
    Remote(url).put_bytes(data)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# -- writing ------------------------------------------------------------------------------------
def prepare_url(url: str, force: bool) -> Remote:
    """The URL of a new trace: refused where something is there, unless ``force`` and it is a
    driftcheck trace (as ``writer.prepare_out_dir`` on disk), which is then removed."""
    remote = Remote(url)
    names = remote.names()
    if names:
        if not force:
            raise DriftcheckError(f"--out {remote.url} already exists and is not empty; "
                                  "pass --force to overwrite it or choose another URL")
        if fmt.MANIFEST not in names and fmt.INCOMPLETE not in names:
            raise DriftcheckError(f"--out {remote.url} is not empty and is not a driftcheck trace; "
                                  "--force only replaces traces: choose another URL")
        remote.remove_all()
    return remote


def staging_dir() -> Path:
    """A local directory the writer stages a URL's shards in (each removed once uploaded)."""
    return Path(tempfile.mkdtemp(prefix="driftcheck-upload-"))


# -- reading ------------------------------------------------------------------------------------
class ShardCache:
    """A trace at a URL, read through a local temp directory: the manifest, then each shard when
    first needed; beyond ``budget`` bytes the least recently used shards are dropped (a shard in
    use stays readable: its mapping outlives the file's name) and fetched again if needed."""

    def __init__(self, url: str, budget: int | None = None) -> None:
        self.remote = Remote(url)
        self.dir = Path(tempfile.mkdtemp(prefix="driftcheck-cache-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.budget = budget if budget is not None else _budget()
        self._held: OrderedDict[str, int] = OrderedDict()  # shard -> bytes, least recent first

    def manifest(self) -> Path:
        """The manifest, downloaded; a one-line TraceError where the trace is incomplete."""
        if not self.remote.exists(fmt.MANIFEST):
            why = ""
            if self.remote.exists(fmt.INCOMPLETE):
                why = ": " + self.remote.read_bytes(fmt.INCOMPLETE).decode(errors="replace").strip()[:200]
            elif not self.remote.names():
                raise TraceError(f"trace {self.remote.url} does not exist")
            raise TraceError(f"trace {self.remote.url} is incomplete (no {fmt.MANIFEST}){why}; "
                             "re-run the record")
        path = self.dir / fmt.MANIFEST
        self.remote.get(fmt.MANIFEST, path)
        return path

    def fetch(self, name: str, size: int) -> tuple[Path, list[str]]:
        """The shard's local copy (downloaded if absent), and the shards dropped to make room."""
        path = self.dir / name
        if name in self._held and path.is_file():
            self._held.move_to_end(name)
            return path, []
        dropped = []
        while self._held and sum(self._held.values()) + size > self.budget:
            old, _ = self._held.popitem(last=False)
            (self.dir / old).unlink(missing_ok=True)
            dropped.append(old)
        self.remote.get(name, path)
        self._held[name] = size
        return path, dropped

    def file(self, name: str) -> Path | None:
        """A whole file of the trace (the replay file), downloaded; None where it has none."""
        if not self.remote.exists(name):
            return None
        path = self.dir / name
        self.remote.get(name, path)
        return path

    def close(self) -> None:
        self._held.clear()
        self._cleanup()


def _budget() -> int:
    raw = os.environ.get(CACHE_VAR, "")
    try:
        return max(1, int(raw)) if raw else DEFAULT_CACHE_BYTES
    except ValueError:
        raise DriftcheckError(f"{CACHE_VAR}={raw!r}: expected a number of bytes") from None

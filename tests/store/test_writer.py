"""The trace writer: background shard writing, bounded host memory, failures that abort the
trace, and the streamed (memory-mapped, chunked) reading that compare relies on."""
from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.store import INCOMPLETE, TraceReader, TraceWriter, writer as store_writer

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool,
          torch.float8_e4m3fn, torch.uint8]


def _entry(i: int, t: torch.Tensor) -> dict:
    return {"key": f"0/forward/m{i}/0/output", "module": f"m{i}", "phase": "forward", "step": 0,
            "call": 0, "slot": "output", "order": i, "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""), "stats": {}}


def _tensors(n: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(3 + i, 17, generator=g) * 100
        out.append(x.to(DTYPES[i % len(DTYPES)]))
    out.append(torch.tensor(2.5))        # 0-dim
    out.append(torch.zeros(0, 4))        # empty
    out.append(torch.arange(12.0).reshape(3, 4)[1:])  # a view into a larger storage
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1 and a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("background", [True, False])
def test_round_trip_across_many_shards(tmp_path, background):
    ts = _tensors()
    with TraceWriter(tmp_path / "t", shard_bytes=2000, queue_bytes=5000,
                     background=background) as w:
        for i, t in enumerate(ts):
            w.add(_entry(i, t), t)
        w.close({"steps": 1})
    r = TraceReader(tmp_path / "t")
    assert len(r.manifest["shards"]) > 5
    for shard, size in r.manifest["shards"].items():
        assert (tmp_path / "t" / shard).stat().st_size == size
        load_file(tmp_path / "t" / shard)  # each shard is a standard safetensors file
    for e, t in zip(r.entries, ts):
        assert _same(r.tensor(e), t), e["key"]
        chunks = list(r.chunks(e, chunk_elems=7))
        assert all(c.numel() <= 7 for c in chunks)
        flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=t.dtype)
        assert _same(flat, t.reshape(-1)), e["key"]
    assert not (tmp_path / "t" / INCOMPLETE).exists()


def test_add_returns_before_the_write_and_host_memory_stays_bounded(tmp_path, monkeypatch):
    """While the disk is slow, add() hands shards over and returns; once the bytes not yet on
    disk reach queue_bytes, add() waits (backpressure) instead of holding more."""
    gate = threading.Event()
    real = store_writer.write_safetensors

    def slow(*a, **k):
        gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(store_writer, "write_safetensors", slow)
    t = torch.ones(1000)  # 4000 bytes
    w = TraceWriter(tmp_path / "t", shard_bytes=4000, queue_bytes=12000)
    peak = []
    done = threading.Event()

    def producer():
        for i in range(10):
            w.add(_entry(i, t), t.clone())
            peak.append(w._held)
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.5)
    assert not done.is_set(), "add() did not wait for the writer: host memory is unbounded"
    assert len(peak) == 3 and max(peak) <= 12000  # three 4000-byte shards fit, the fourth waits
    gate.set()
    th.join(10)
    assert done.is_set() and max(peak) <= 12000
    w.close({"steps": 1})
    assert len(TraceReader(tmp_path / "t").manifest["shards"]) == 10


def test_a_disk_full_error_in_the_writer_thread_aborts_the_trace(tmp_path, monkeypatch):
    def full(path, *a, **k):
        open(path, "wb").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_writer, "write_safetensors", full)
    t = torch.ones(1000)
    with pytest.raises(DriftcheckError, match="No space left on device"):
        with TraceWriter(tmp_path / "t", shard_bytes=4000) as w:
            for i in range(50):
                w.add(_entry(i, t), t.clone())
                time.sleep(0.002)
            w.close({"steps": 1})
    names = os.listdir(tmp_path / "t")
    assert "manifest.json" not in names and INCOMPLETE in names
    assert not [n for n in names if n.endswith(".tmp")]
    assert "No space left" in (tmp_path / "t" / INCOMPLETE).read_text()
    with pytest.raises(TraceError, match="incomplete"):
        TraceReader(tmp_path / "t")


def test_a_real_file_size_limit_fails_the_record_with_exit_2_and_no_manifest(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the shard write (EFBIG) inside the writer thread."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "record", "llama", "--out", str(out)],
                          preexec_fn=limit, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 2, proc.stderr
    assert "File too large" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "manifest.json").exists() and (out / INCOMPLETE).exists()


def test_a_shard_whose_header_points_outside_the_file_is_refused(tmp_path):
    t = torch.arange(100.0)
    with TraceWriter(tmp_path / "t") as w:
        w.add(_entry(0, t), t)
        w.close({"steps": 1})
    shard = tmp_path / "t" / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = 999  # was 400: now past the end of the file
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    shard.write_bytes(raw[:8] + new + raw[8 + n:])
    with pytest.raises(TraceError, match="outside the file"):
        TraceReader(tmp_path / "t")  # shard headers are checked when the trace is opened


def test_manifest_has_the_shards_file_mode(tmp_path):
    """The manifest is written through a temp file (mkstemp makes it 0600): it ends with the same
    mode as the shards, 0666 less the umask, so whoever can read the shards can read the trace."""
    w = TraceWriter(tmp_path / "t")
    w.add({"key": "0/forward/a/0/output", "module": "a", "phase": "forward", "step": 0, "call": 0,
           "slot": "output", "order": 0, "shape": [3], "dtype": "float32", "stats": {}}, torch.ones(3))
    w.close({"steps": 1})
    shard = next((tmp_path / "t").glob("shard-*.safetensors"))
    assert (tmp_path / "t" / "manifest.json").stat().st_mode & 0o777 == shard.stat().st_mode & 0o777


def test_every_stored_tensor_carries_the_crc32c_of_its_bytes(tmp_path):
    """The writer records each tensor's and sample's CRC32C as written; the reader checks them
    the first time it reads a shard's data (a flipped byte is caught: tests/test_bad_inputs.py)."""
    import crc32c

    from driftcheck.store import TraceReader

    w = TraceWriter(tmp_path / "t", shard_bytes=64)  # several shards
    for i in range(5):
        w.add({"key": f"0/forward/m{i}/0/output", "module": f"m{i}", "phase": "forward", "step": 0,
               "call": 0, "slot": "output", "order": i, "shape": [4], "dtype": "float32", "stats": {}},
              torch.arange(4.0) + i, sample=torch.tensor([float(i)]))
    w.close({"steps": 1})
    r = TraceReader(tmp_path / "t")
    assert len(r.manifest["shards"]) > 1
    for e in r.entries:
        for which in ("tensor", "sample"):
            assert e[which]["crc32c"] == crc32c.crc32c(r.tensor(e, which).numpy().tobytes())


def test_a_null_checksum_means_no_checksum(tmp_path):
    """Found by the manifest fuzzer: "crc32c": null passed validation and then broke the check."""
    import json

    from driftcheck.store import TraceReader

    w = TraceWriter(tmp_path / "t")
    w.add({"key": "0/forward/a/0/output", "module": "a", "phase": "forward", "step": 0, "call": 0,
           "slot": "output", "order": 0, "shape": [3], "dtype": "float32", "stats": {}}, torch.ones(3))
    w.close({"steps": 1})
    path = tmp_path / "t" / "manifest.json"
    m = json.loads(path.read_text())
    m["entries"][0]["tensor"]["crc32c"] = None
    path.write_text(json.dumps(m))
    r = TraceReader(tmp_path / "t")
    assert torch.equal(r.tensor(r.entries[0]), torch.ones(3))

"""Full mode's write path: shards written with direct I/O through staging blocks (and buffered
where the file system refuses it), captured copies in recycled host buffers, and the statistics
of a kept copy taken in its hook."""
from __future__ import annotations

import errno
import json
import mmap
import os
import struct

import crc32c
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import driftcheck
from driftcheck.numerics import stats as tstats
from driftcheck.record.tracer import Tracer
from driftcheck.store import TraceReader, TraceWriter, direct as store_direct
from driftcheck.store.buffers import MIN_BYTES, HostBuffers

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.uint8,
          torch.float8_e4m3fn]


def _entry(i: int, t: torch.Tensor) -> dict:
    return {"key": f"0/forward/m{i}/0/output", "module": f"m{i}", "phase": "forward", "step": 0,
            "call": 0, "slot": "output", "order": i, "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""), "stats": {}}


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # sizes around the (shrunk) staging block: inside one, across two, larger than both
    sizes = [1, 7, 1000, 2047, 2048, 2049, 5000, 9000, 0]
    return [(torch.randn(n, generator=g) * 50).to(DTYPES[i % len(DTYPES)]) for i, n in enumerate(sizes)]


def _data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _write(tmp_path, ts, shard_bytes: int = 12000) -> TraceReader:
    with TraceWriter(tmp_path / "t", shard_bytes=shard_bytes) as w:
        for i, t in enumerate(ts):
            w.add(_entry(i, t), t)
        w.close({"steps": 1})
    return TraceReader(tmp_path / "t")


def _check(r: TraceReader, ts: list[torch.Tensor]) -> None:
    for shard, size in r.manifest["shards"].items():
        assert (r.dir / shard).stat().st_size == size
        load_file(r.dir / shard)  # a standard safetensors file
    for e, t in zip(r.entries, ts):
        got = r.tensor(e)
        a, b = (got.view(torch.uint8), t.view(torch.uint8)) if t.dtype.itemsize == 1 else (got, t)
        assert got.dtype == t.dtype and torch.equal(a, b), e["key"]
        assert e["tensor"]["crc32c"] == crc32c.crc32c(t.contiguous().view(torch.uint8).numpy().tobytes())


def test_direct_shards_round_trip_across_staging_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(store_direct.DirectStage, "BLOCK", 8192)  # tensors span blocks
    ts = _tensors()
    used = []
    real = store_direct.DirectStage.write_file
    monkeypatch.setattr(store_direct.DirectStage, "write_file",
                        lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1])
    r = _write(tmp_path, ts)
    _check(r, ts)
    if not all(used):  # this file system refuses O_DIRECT: every shard went buffered
        pytest.fail(f"{tmp_path} does not take direct I/O here; the fallback is tested below")
    assert len(used) == len(r.manifest["shards"]) > 1
    for shard in r.manifest["shards"]:
        assert _data_start(r.dir / shard) % store_direct.DirectStage.ALIGN == 0


def test_page_aligned_copies_are_written_from_their_own_memory(tmp_path, monkeypatch):
    """Copies in HostBuffers start on a page and own the rest of it: each is written from its
    memory at a page boundary, a padding tensor after it; the small ones are staged behind."""
    monkeypatch.setattr(store_direct.DirectStage, "BLOCK", 8192)
    pool = HostBuffers(limit=1 << 30)
    g = torch.Generator().manual_seed(1)
    big = [pool.copy(torch.randn(n, generator=g).to(dt)) for n, dt in
           [(70_001, torch.float32), (MIN_BYTES // 2 + 3, torch.bfloat16), (80_000, torch.float64)]]
    monkeypatch.setattr(store_direct.DirectStage, "FROM_MEMORY", MIN_BYTES)
    ts = [big[0], torch.randn(5), big[1], torch.arange(7), big[2], torch.randn(3000)]
    r = _write(tmp_path, ts, shard_bytes=1 << 22)
    _check(r, ts)
    (shard,) = r.manifest["shards"]
    with open(r.dir / shard, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    pads = [k for k in header if k.startswith(store_direct.DirectStage.PAD)]
    assert len(pads) == 3  # none of the three ends on a page boundary
    for e, t in zip(r.entries, ts):
        if any(t is b for b in big):
            begin = header[e["tensor"]["name"]]["data_offsets"][0]
            assert (8 + n + begin) % store_direct.DirectStage.ALIGN == 0, e["key"]


def test_a_file_system_without_direct_io_gets_buffered_shards(tmp_path, monkeypatch):
    """tmpfs answers O_DIRECT with EINVAL at open: the writer falls back for good, same files."""
    real_open = os.open
    calls = []

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            calls.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(store_direct.os, "open", no_direct)
    ts = _tensors()
    r = _write(tmp_path, ts)
    _check(r, ts)
    assert len(calls) == 1  # asked once, then buffered for every shard
    assert all(_data_start(r.dir / s) % 8 == 0 for s in r.manifest["shards"])


def test_a_device_refusing_the_alignment_falls_back_without_a_stray_file(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(store_direct.os, "pwrite",
                        lambda fd, data, off: (_ for _ in ()).throw(OSError(errno.EINVAL, "bad align")))
    ts = _tensors()
    r = _write(tmp_path, ts)
    monkeypatch.setattr(store_direct.os, "pwrite", real)
    _check(r, ts)
    assert sorted(p.name for p in r.dir.iterdir()) == sorted(
        list(r.manifest["shards"]) + ["manifest.json"])


def test_a_write_error_in_the_direct_path_aborts_the_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(store_direct.os, "pwrite",
                        lambda fd, data, off: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(driftcheck.errors.DriftcheckError, match="No space left"):
        _write(tmp_path, _tensors())
    assert not (tmp_path / "t" / "manifest.json").exists()


def test_host_buffers_recycle_only_what_nobody_else_holds():
    pool = HostBuffers(limit=1 << 30)
    x = torch.randn(MIN_BYTES // 4 * 2)
    a = pool.copy(x)
    assert torch.equal(a, x) and a.data_ptr() != x.data_ptr()
    ptr = a.data_ptr()
    pool.give(a)
    del a
    b = pool.copy(x + 1)  # the same byte size: the same memory
    assert b.data_ptr() == ptr and pool.reused == 1 and torch.equal(b, x + 1)
    kept = b[3:]  # somebody holds a view: never written over
    pool.give(b)
    c = pool.copy(x + 2)
    assert c.data_ptr() != ptr and torch.equal(kept, (x + 1)[3:])
    small = torch.randn(10)
    s = pool.copy(small)
    pool.give(s)
    assert pool._free_bytes == 0  # below MIN_BYTES: the allocator's business
    theirs = torch.frombuffer(mmap.mmap(-1, MIN_BYTES * 2), dtype=torch.uint8)  # not the pool's
    pool.give(theirs)
    assert pool._free_bytes == 0
    nc = torch.randn(3, MIN_BYTES).t()  # not contiguous: the copy is
    d = pool.copy(nc)
    assert d.is_contiguous() and torch.equal(d, nc)


def test_host_buffers_keep_what_a_step_lends_at_once_and_no_more():
    """Buffers lent out together (a step's gradients held to its end, beyond the queue) come
    back and serve the next step without a mapping made or unmapped; beyond that peak the free
    list keeps at most ``limit`` bytes, the oldest given back unmapped first."""
    pool = HostBuffers(limit=3 * MIN_BYTES)
    for step in range(3):
        copies = [pool.copy(torch.randn(MIN_BYTES // 4)) for _ in range(5)]  # lent at once
        ptrs = {t.data_ptr() for t in copies}
        for t in copies:
            pool.give(t)
        del t
        copies.clear()
        assert pool.mapped == 5 and pool.peak == 5 * MIN_BYTES  # the first step's five, reused
        assert pool._free_bytes == 5 * MIN_BYTES and pool.reused == 5 * step
    # One at a time now: the peak stays, and the five wait for the next step's peak.
    one = pool.copy(torch.randn(MIN_BYTES // 4))
    pool.give(one)
    del one
    assert pool._free_bytes == 5 * MIN_BYTES
    # A size none of them fits (more than FIT times smaller would waste; larger cannot): mapped,
    # and when it comes back the oldest free buffers make room for it.
    big = pool.copy(torch.randn(MIN_BYTES))  # 4 x MIN_BYTES
    assert pool.mapped == 6 and big.data_ptr() not in ptrs
    newest, at = list(pool._order)[-1], big.data_ptr()
    pool.give(big)
    del big
    assert list(pool._order) == [newest, at]  # the four oldest made room
    assert pool._free_bytes == pool._live == 5 * MIN_BYTES  # and were unmapped
    pool.clear()
    assert pool._free_bytes == 0 and not pool._order


def test_host_buffers_take_the_smallest_free_buffer_that_fits():
    pool = HostBuffers(limit=1 << 30)
    four, two = pool.copy(torch.randn(MIN_BYTES)), pool.copy(torch.randn(MIN_BYTES // 2))
    at4, at2 = four.data_ptr(), two.data_ptr()
    pool.give(four)
    pool.give(two)
    del four, two
    x = torch.randn(MIN_BYTES // 4 * 3 // 2)  # 1.5 x MIN_BYTES: fits the two (2x) best
    a = pool.copy(x)
    assert a.data_ptr() == at2 and torch.equal(a, x) and a.shape == x.shape
    b = pool.copy(torch.randn(MIN_BYTES // 4))  # 1 x MIN_BYTES: the four is 4x, beyond FIT
    assert b.data_ptr() != at4 and pool.mapped == 3
    c = pool.copy(torch.randn(MIN_BYTES // 2))  # 2 x MIN_BYTES: the four, at FIT
    assert c.data_ptr() == at4 and pool.reused == 2
    pool.give(c)  # a buffer larger than its copy goes back whole
    del c
    assert pool._free.get(4 * MIN_BYTES) and pool._free_bytes == 4 * MIN_BYTES


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)  # outputs and weights of >= stats.BIG elements
        self.b = nn.Linear(512, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(model, opt, x, writer, steps, after_step=lambda: None):
    """``steps`` traced training steps of ``model`` on ``x``, into ``writer``."""
    tracer = Tracer(model, writer, optimizer=opt).attach()
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        tracer.step(loss)
        after_step()
    tracer.detach()


def test_full_mode_recycles_its_copies_and_takes_kept_statistics_in_the_hook(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 256)
    mapped = []
    # shards written as steps run, through a queue smaller than a step's copies
    with TraceWriter(tmp_path / "t", shard_bytes=1 << 20, queue_bytes=4 * MIN_BYTES) as w:
        _train(model, opt, x, w, 4, lambda: (w.drain(), mapped.append(w.buffers.mapped)))
        reused = w.buffers.reused
        w.close({"steps": 4})
    assert reused > 0  # later steps copied into memory the writer gave back
    # after the first step (and the second, where the gradients' copies first come back),
    # nothing is mapped: each step's copies reuse the memory of the step before's
    assert mapped[1] == mapped[2] == mapped[3], mapped
    r = TraceReader(tmp_path / "t")
    big = [e for e in r.entries if e["shape"] and torch.Size(e["shape"]).numel() >= tstats.BIG]
    assert {e["phase"] for e in big} >= {"forward", "backward", "grads", "optimizer", "params"}
    for e in big:
        want = tstats.to_dict(tstats.stats_vector(r.tensor(e)).tolist())
        for k in ("min", "max", "mean", "std", "absmax", "l2"):
            assert e["stats"][k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (e["key"], k)
    json.dumps(r.manifest)


def test_a_copy_waiting_in_two_shards_is_not_recycled_after_the_first(tmp_path):
    """The same copy added under two keys that land in different shards: the first shard's write
    must not give its memory back while the second still has to write it."""
    pool_writer = TraceWriter(tmp_path / "t", shard_bytes=MIN_BYTES)
    x = pool_writer.buffers.copy(torch.randn(MIN_BYTES // 4))
    want = x.clone()
    pool_writer.add(_entry(0, x), x)
    pool_writer.flush()  # the first shard goes to the writer thread
    pool_writer.drain()
    y = pool_writer.buffers.copy(torch.zeros(MIN_BYTES // 4))  # would reuse x's memory if freed
    pool_writer.add(_entry(1, x), x)
    pool_writer.close({"steps": 1})
    r = TraceReader(tmp_path / "t")
    assert torch.equal(r.tensor(r.entries[1]), want) and y.data_ptr() != x.data_ptr()


def test_host_buffers_stay_within_their_bound_when_a_phase_maps_new_sizes():
    """A phase whose sizes no free buffer fits maps new ones: the free list gives up its oldest
    as it does, so the pool never holds more than the larger of its peak and what is lent out
    now plus ``limit``."""
    pool = HostBuffers(limit=MIN_BYTES)
    lent = [pool.copy(torch.randn(MIN_BYTES // 4)) for _ in range(8)]
    for t in lent:
        pool.give(t)
    del t
    lent.clear()
    other = [pool.copy(torch.randn(MIN_BYTES)) for _ in range(2)]  # 4 x MIN_BYTES each: no fit
    now = pool._live - pool._free_bytes
    assert now == 8 * MIN_BYTES and pool._live <= max(pool.peak, now + pool.limit), (pool._live, pool.peak)
    assert len(other) == 2 and len(pool._sizes) == len(pool._free) == 1  # no empty size kept


def test_host_buffers_count_right_when_an_address_is_mapped_again_before_its_finalizer():
    """A copy dropped on the writer's thread is unmapped before its finalizer runs; the training
    thread may map a new buffer at that address in between. The old finalizer must not take the
    new buffer's entry (it would never be recycled, and the pool would count its bytes forever)."""
    import queue
    import sys
    import threading

    pool = HostBuffers(limit=0)  # nothing kept free: each buffer dropped is unmapped
    q: queue.Queue = queue.Queue(maxsize=4)
    n = 4000

    def writer():
        for _ in range(n):
            q.get()  # dropped at once: the last reference

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        th = threading.Thread(target=writer)
        th.start()
        src = torch.randn(MIN_BYTES // 4)
        for _ in range(n):
            q.put(pool.copy(src))
        th.join()
    finally:
        sys.setswitchinterval(interval)
    assert pool._live == 0 and not pool._ours and pool.peak <= 6 * MIN_BYTES, (pool._live, pool.peak)


def test_full_mode_checksums_its_copies_as_it_makes_them(tmp_path, monkeypatch):
    """A full-mode copy's CRC32C is taken in the pass that makes it (chunk by chunk, on two
    threads, combined): the manifest's checksum is that of the bytes on disk (the reader checks
    each on read), and the writer reads none of those copies again for it."""
    from driftcheck.numerics import chunks
    from driftcheck.store import shard as store_shard

    monkeypatch.setattr(chunks, "threads", lambda n: min(n, 2))  # two, whatever torch has
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 4))  # 2M-element weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(600, 1024)  # a (600, 2048) activation: two chunks and a part
    read = []
    for mod in (store_direct, store_shard):
        real = mod.crc32c.crc32c
        monkeypatch.setattr(mod, "crc32c", type("C", (), {"crc32c": staticmethod(
            lambda b, v=0, real=real: read.append(memoryview(b).nbytes) or real(b, v))}))
    with TraceWriter(tmp_path / "t") as w:
        _train(model, opt, x, w, 2)
        w.close({"steps": 2})
    written = list(read)  # (the reader checksums what it reads, below)
    r = TraceReader(tmp_path / "t")
    large = [e for e in r.entries if torch.Size(e["shape"]).numel() > chunks.CHUNK]
    assert {e["phase"] for e in large} >= {"forward", "backward", "grads", "optimizer", "params"}
    for e in r.entries:
        t = r.tensor(e)  # the reader checks the manifest's checksum against the file's bytes
        assert e["tensor"]["crc32c"] == crc32c.crc32c(t.contiguous().numpy().tobytes()), e["key"]
    # the writer checksummed the small tensors only (none of the large copies' 4+ MiB)
    assert written and max(written) < 4 * chunks.CHUNK, sorted(written)[-3:]

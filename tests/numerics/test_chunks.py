"""numerics/chunks.py: a large host pass cut into fixed chunks and spread over torch's thread
count gives the same numbers on any thread count, the numbers of one pass up to the order of
float64 sums, and never returns while a helper still reads or writes."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from driftcheck.numerics import chunks, stats, summary_kernels as kernels


@pytest.fixture
def thread_counts():
    before = torch.get_num_threads()
    yield (1, 2, 3, 5)
    torch.set_num_threads(before)


def _threads_seen(monkeypatch, name: str, call) -> set[str]:
    """The names of the threads that ran compiled kernel ``name`` while ``call()`` ran."""
    seen: set[str] = set()
    real = getattr(kernels, name)

    def spy(*args):
        seen.add(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(kernels, name, spy)
    call()
    monkeypatch.setattr(kernels, name, real)
    return seen


def test_large_passes_run_on_as_many_threads_as_torch_has(monkeypatch, thread_counts) -> None:
    """The statistics' read pass (and its copy), a Linear's operand magnitudes and the logit
    watch's row maxima: the hook's thread and helpers, as many as torch's thread count."""
    from driftcheck.record import meta, watch

    me = threading.current_thread().name
    t = torch.randn(4 * chunks.CHUNK + 17)
    logits = torch.randn(4, 1024, 1024)
    calls = {"dense_stats": lambda: stats.large_row(t),
             "copy_stats": lambda: stats.large_row(t, into=torch.empty_like(t)),
             "col_sumsq": lambda: meta._col_sumsq(t[:4 * chunks.CHUNK], 256),
             "weighted_absmax": lambda: watch._weighted_absmax(logits, -1)}
    for name, call in calls.items():
        torch.set_num_threads(1)
        assert _threads_seen(monkeypatch, name, call) == {me}, name
        torch.set_num_threads(2)
        seen = _threads_seen(monkeypatch, name, call)
        assert len(seen) == 2 and me in seen, (name, seen)
    torch.set_num_threads(3)
    assert chunks.threads(5) == 3 and chunks.threads(2) == 2  # (a helper may take two runs)
    assert len(_threads_seen(monkeypatch, "dense_stats", calls["dense_stats"])) >= 2
    small = t[:chunks.CHUNK]  # one chunk: the calling thread alone
    assert _threads_seen(monkeypatch, "dense_stats", lambda: stats.large_row(small)) == {me}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_do_not_depend_on_the_thread_count(thread_counts, dtype) -> None:
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(3 * chunks.CHUNK + 1001, generator=g, dtype=torch.float64) * 7 + 0.3).to(dtype)
    rows, copies = [], []
    for n in thread_counts:
        torch.set_num_threads(n)
        rows.append(stats.large_row(t))
        into = torch.empty_like(t)
        copied = stats.large_row(t, into=into)
        assert torch.equal(into, t)  # the copy, every chunk of it, whichever thread made it
        copies.append(copied)
    for r in rows[1:]:
        np.testing.assert_array_equal(r[:9], rows[0][:9])  # bit for bit, one kernel
    for r in copies[1:]:
        np.testing.assert_array_equal(r[:9], copies[0][:9])
    # the copying kernel and the reading one may vectorize their float64 sums differently (and
    # a process may reach either through another compiled specialization): the last bits only
    np.testing.assert_allclose(copies[0][:9], rows[0][:9], rtol=1e-13)
    x = t.double()
    want = [x.min(), x.max(), x.mean(), x.std(correction=0), x.abs().max(), x.norm()]
    np.testing.assert_allclose(rows[0][:6], [float(v) for v in want], rtol=1e-12)


def test_a_nan_or_inf_in_any_chunk_goes_to_the_exact_path(thread_counts) -> None:
    torch.set_num_threads(2)
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(3 * chunks.CHUNK)
        t[2 * chunks.CHUNK + 5] = bad  # in a chunk a helper reads
        assert stats.large_row(t) is None
        row = stats._large_stats(t)  # the masking path's row
        assert int(row[6]) == (1 if bad != bad else 0) and int(row[7]) == (0 if bad != bad else 1)


def test_column_sums_and_row_maxima_do_not_depend_on_the_thread_count(thread_counts) -> None:
    g = torch.Generator().manual_seed(5)
    k = 96
    x = (torch.randn(3 * chunks.CHUNK // k + 7, k, generator=g) * torch.linspace(0.1, 9, k)).reshape(-1).numpy()
    want = (torch.from_numpy(x).double().reshape(-1, k) ** 2).sum(0).numpy()
    single = kernels.weighted_absmax(x, k, 40.0)
    outs = []
    for n in thread_counts:
        torch.set_num_threads(n)
        out = np.empty(k)
        chunks.col_sumsq(kernels.col_sumsq, x, k, out)
        outs.append(out)
        assert chunks.row_max(kernels.weighted_absmax, x, k, 40.0) == single  # a maximum: exact
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], want, rtol=1e-12)


def test_no_helper_is_still_running_when_the_caller_fails(thread_counts) -> None:
    """The caller's own chunks raise: every helper has finished before the error leaves
    ``spread`` (none may go on writing a copy into memory the caller then reuses)."""
    torch.set_num_threads(4)
    done: list[int] = []
    release = threading.Event()

    def fn(i: int) -> int:
        if i == 0:
            release.set()
            raise RuntimeError("the caller's chunk failed")
        release.wait(5)
        threading.Event().wait(0.05)  # still busy when the caller's chunk fails
        done.append(i)
        return i

    with pytest.raises(RuntimeError, match="caller's chunk"):
        chunks.spread(fn, 4)
    assert sorted(done) == [1, 2, 3]
    assert chunks.spread(lambda i: i * i, 7) == [i * i for i in range(7)]  # in order


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_forked_child_makes_its_own_helpers(thread_counts) -> None:
    torch.set_num_threads(2)
    assert chunks.spread(lambda i: i, 4) == [0, 1, 2, 3]  # the parent's helpers exist now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper threads are not here
        try:
            names: set[str] = set()
            ok = chunks.spread(lambda i: names.add(threading.current_thread().name) or i, 4) == [0, 1, 2, 3]
            os.write(w, b"1" if ok and len(names) == 2 else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_a_ctrl_c_while_waiting_leaves_no_helper_running(thread_counts) -> None:
    import signal
    import time

    torch.set_num_threads(2)
    running: set[int] = set()

    def fn(i: int) -> int:
        if i >= 2:  # the helper's share: slow
            running.add(i)
            time.sleep(0.5)
            running.discard(i)
        return i

    timer = threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        chunks.spread(fn, 4)
    timer.join()
    assert not running  # raised once the helper's chunks were done


def test_a_helper_spreading_again_runs_serially(thread_counts) -> None:
    """A chunk function that spreads again (on a helper thread) does not wait for helpers that
    are all busy with the outer chunks."""
    torch.set_num_threads(8)
    res: list[int] = []

    def outer(i: int) -> int:
        threading.Event().wait(0.1)  # every helper holds an outer chunk before inner ones come
        return sum(chunks.spread(lambda j: j, 8))

    t = threading.Thread(target=lambda: res.append(sum(chunks.spread(outer, 8))), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and res == [8 * 28]


def test_narrow_floats_widen_exactly_every_bit_pattern() -> None:
    """The compiled widening of bfloat16 and float16 (taken as uint16 bits) gives every one of
    the 65536 patterns the float32 torch gives it, bit for bit: zeros, subnormals, infinities
    and NaN payloads included."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(1 << 16, dtype=np.float32)
    as_int16 = torch.from_numpy(bits.view(np.int16))
    for dtype, widen in ((torch.bfloat16, kernels.widen_bf16), (torch.float16, kernels.widen_f16)):
        widen(bits, out)
        want = as_int16.view(dtype).float().numpy()
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_floats_are_summarised_a_chunk_at_a_time(dtype, monkeypatch, thread_counts) -> None:
    """A large bfloat16/float16 host capture is widened a chunk at a time into a block each
    thread keeps, not copied whole to float32 first: the same row as that copy's, bit for bit,
    on any thread count; not all finite, the exact path as before (None)."""
    from driftcheck.numerics import passes

    torch.manual_seed(0)
    t = (torch.randn(3 * chunks.CHUNK + 1001) * 7 + 0.25).to(dtype)
    whole = stats.large_row(t.float())  # what widening the whole capture first gives
    widened = []
    real = passes.host_array
    monkeypatch.setattr(kernels, "host_array",  # (a float32 capture's is a view)
                        lambda x: (x.dtype != torch.float32 and widened.append(x.numel())) or real(x))
    for n in thread_counts:
        torch.set_num_threads(n)
        row = stats.large_row(t)
        assert np.array_equal(row, whole, equal_nan=True), (n, row, whole)
    assert widened == []  # no whole float32 copy
    exact = stats.stats_vector(t).numpy()
    assert np.allclose(row[:9], exact[:9], rtol=1e-12, atol=0)
    t[12345] = float("inf")
    assert stats.large_row(t) is None
    strided = torch.randn(600, 800).to(dtype).t()  # not contiguous: widened whole, as before
    want = stats.large_row(strided.float().contiguous())
    assert np.array_equal(stats.large_row(strided), want, equal_nan=True)
    assert widened == [strided.numel()]

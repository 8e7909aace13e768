"""Crash safety (issue 9): Ctrl-C, SIGKILL, an exception in user code or a full disk during a
record never leave a directory that passes as a complete trace; temp shards are removed (or, after
SIGKILL, left only under hidden ``.*.tmp`` names beside the INCOMPLETE marker)."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_not_complete, assert_one_line_error, run_cli, write_scenarios

from driftcheck import store
from driftcheck.errors import TraceError
from driftcheck.store import replay as store_replay, writer as store_writer


@pytest.fixture(scope="module")
def scen(tmp_path_factory) -> Path:
    return write_scenarios(tmp_path_factory.mktemp("crash"))


def _start_slow_record(scen: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    # cwd outside the repo: the installed package (with driftcheck.models) is what runs.
    # SIGINT back to its default in the child: a suite started as a background job of a script
    # inherits it ignored, and Python then never turns it into KeyboardInterrupt (the record
    # ran to its end, rc 0: not what the test is about).
    return subprocess.Popen([sys.executable, "-m", "driftcheck", "record", f"{scen}:slow", "--out",
                             str(out)], cwd=out.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_recording(proc: subprocess.Popen, out: Path, timeout: float = 60.0) -> None:
    """Until the record is under way: the INCOMPLETE marker and the replay file are written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"record ended early: {proc.communicate()}")
        if (out / store.INCOMPLETE).exists() and (out / "replay.safetensors").exists():
            time.sleep(0.5)  # a few steps into the training loop
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("record did not start")


def _refused_as_incomplete(out: Path, capsys) -> None:
    code, _, err = run_cli(["compare", out, out], capsys)
    assert_one_line_error(code, err, "incomplete")
    with pytest.raises(TraceError, match="incomplete"):
        store.TraceReader(out)


def test_ctrl_c_mid_record(scen, tmp_path, capsys):
    out = tmp_path / "t"
    proc = _start_slow_record(scen, out)
    _wait_recording(proc, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["driftcheck: interrupted"], err
    assert_not_complete(out)
    assert "KeyboardInterrupt" in (out / store.INCOMPLETE).read_text()
    _refused_as_incomplete(out, capsys)


def _signalled_while_typing(x):  # pragma: no cover (replaced by its overload in compiled code)
    return x


def test_ctrl_c_while_a_kernel_compiles_waits_for_the_compile():
    """SIGINT arriving while numba compiles a kernel (it calls back into Python through ctypes,
    where a KeyboardInterrupt is lost and the process then dies of the signal: the flake this
    fixed) is raised as KeyboardInterrupt once the compile is done, not inside it."""
    from numba.extending import overload


    @overload(_signalled_while_typing)
    def _typing(x):  # runs while the kernel below compiles
        # to this thread, now (os.kill may hand the process's signal to any other thread that
        # does not block it, to be handled whenever that thread runs: a flake under load)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.05)  # Python's handler runs here, at the next bytecode, without the hold
        return lambda x: x + 1.0

    def kernel(x):
        return _signalled_while_typing(x)

    # Python's own SIGINT handler, whatever an earlier test in this process left installed (a
    # library that ignores SIGINT: the signal would then never be raised at all)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _hold_then_raise(kernel)
    finally:
        signal.signal(signal.SIGINT, before)


def _hold_then_raise(kernel) -> None:
    import numba

    from driftcheck.numerics.kernels import hold_interrupts

    held = hold_interrupts(numba.njit(kernel))  # no cache: every run of the test compiles
    with pytest.raises(KeyboardInterrupt):
        held(1.0)
    assert len(held.overloads) == 1  # the compile ran to its end before the interrupt
    assert held(1.0) == 2.0 and signal.getsignal(signal.SIGINT) is signal.default_int_handler

    bare = numba.njit(kernel)  # the same without the hold: the interrupt lands inside the compile
    with pytest.raises(KeyboardInterrupt):
        bare(1)  # an int: types not seen before, so the overload is typed (and signals) again
    assert len(bare.overloads) == 0


def test_sigkill_mid_record_then_force_rerecord(scen, tmp_path, capsys):
    out = tmp_path / "t"
    proc = _start_slow_record(scen, out)
    _wait_recording(proc, out)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    assert (out / store.INCOMPLETE).exists()  # the marker, written before any tensor
    _refused_as_incomplete(out, capsys)
    # The half-written directory is not overwritten silently either.
    code, _, err = run_cli(["record", f"{scen}:build", "--out", out], capsys)
    assert_one_line_error(code, err, "--force")
    code, _, err = run_cli(["record", f"{scen}:build", "--out", out, "--force"], capsys)
    assert code == 0, err
    assert (out / "manifest.json").exists() and not (out / store.INCOMPLETE).exists()
    assert not list(out.glob(".*.tmp"))
    store.TraceReader(out)


def test_exception_in_user_code_at_a_later_step(scen, tmp_path, capsys):
    """The forward raises at step 1 of 2, after step 0 was captured."""
    out = tmp_path / "t"
    code, _, err = run_cli(["record", f"{scen}:fails_later", "--out", out], capsys)
    assert_one_line_error(code, err, "the forward raised RuntimeError at step 1", "illegal memory")
    assert_not_complete(out)
    assert "at step 1" in (out / store.INCOMPLETE).read_text()


def test_force_over_a_complete_trace_that_then_fails(scen, tmp_path, capsys):
    """--force removes the old manifest first: a failed re-record never leaves the old trace
    looking complete over new, partial files."""
    out = tmp_path / "t"
    assert run_cli(["record", f"{scen}:build", "--out", out], capsys)[0] == 0
    code, _, err = run_cli(["record", f"{scen}:forward_raises", "--out", out, "--force"], capsys)
    assert_one_line_error(code, err, "forward raised")
    assert_not_complete(out)
    assert not list(out.glob("shard-*"))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["shard", "replay", "manifest"])
def test_full_disk(scen, tmp_path, capsys, monkeypatch, where):
    """ENOSPC while writing a shard, the replay file or the manifest."""
    out = tmp_path / "t"
    if where == "shard":
        real = store_writer.write_safetensors

        def partial_then_full(path, tensors, **kw):
            if Path(path).name.startswith(".shard-"):
                Path(path).write_bytes(b"\0" * 100)  # a partial temp shard, as a full disk leaves
                _enospc()
            return real(path, tensors, **kw)

        monkeypatch.setattr(store_writer, "write_safetensors", partial_then_full)
    elif where == "replay":
        real = store_replay.write_safetensors

        def replay_full(path, tensors, **kw):
            if "replay" in Path(path).name:
                Path(path).write_bytes(b"\0" * 100)
                _enospc()
            return real(path, tensors, **kw)

        monkeypatch.setattr(store_replay, "write_safetensors", replay_full)
    else:
        monkeypatch.setattr(store_writer, "_fsync_write", _enospc)
    code, _, err = run_cli(["record", f"{scen}:build", "--out", out], capsys)
    assert_one_line_error(code, err, "No space left on device", str(out))
    assert_not_complete(out)
    assert "No space left" in (out / store.INCOMPLETE).read_text()
    _refused_as_incomplete(out, capsys)

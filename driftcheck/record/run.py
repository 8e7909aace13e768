"""``driftcheck run``: the reference, the optional float64 truth and the target, each recorded in
a fresh ``driftcheck record`` process, into one run directory (store/layout.py names its parts).

A fresh process per side: a backend (torch_tpu) and precision settings loaded for one side can
never leak into the other.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driftcheck.errors import DriftcheckError
from driftcheck.numerics.dtype_names import CLI_DTYPE_NAMES
from driftcheck.store import layout
from driftcheck.targets import devices


@dataclasses.dataclass
class Sides:
    """What ``driftcheck run`` records: one model, a reference and a target (and a truth)."""

    model: str
    out: Path
    reference: str = "cpu"
    target: str = "cpu"
    reference_dtype: str = "fp32"
    target_dtype: str = "fp32"
    autocast: str | None = None
    fp8: str | None = None
    matmul_precision: str | None = None
    emulate: str | None = None  # "tpu": the target computes its matmuls as a TPU does
    mkldnn: str | None = None  # "on"/"off": oneDNN's CPU kernels in the target's process
    truth: str | None = None  # "fp64": a float64 record on CPU from the same replay
    control: bool = True  # record_control: the reference device at the target's precision
    local: bool = False
    steps: int | None = None
    seed: int = 0
    mode: str = "full"
    force: bool = False
    # what both sides capture (``driftcheck record``'s options of the same names)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    full_modules: tuple[str, ...] = ()
    phases: str | None = None
    capture_steps: str | None = None
    transfer: str = "batched"
    view_audit: bool = False
    simulate: str | None = None  # the target only: a simulated faulty backend
    compile: str | None = None  # the target's torch.compile backend
    reference_compile: str | None = None  # the reference's
    compile_mode: str | None = None  # both sides' (where they compile)
    dynamic: bool | None = None
    reference_env: dict[str, str] = dataclasses.field(default_factory=dict)  # the truth's too
    target_env: dict[str, str] = dataclasses.field(default_factory=dict)

    def compile_args(self, backend: str | None) -> list[str]:
        """The ``record`` options of a side compiled with ``backend`` (none: eager)."""
        if not backend:
            return []
        args = ["--compile", backend]
        args += ["--compile-mode", self.compile_mode] if self.compile_mode else []
        args += [] if self.dynamic is None else ["--dynamic" if self.dynamic else "--no-dynamic"]
        return args

    def capture_args(self) -> list[str]:
        """The ``record`` options both sides share, so that their entries line up."""
        args = ["--seed", str(self.seed), "--mode", self.mode, "--force", "--transfer", self.transfer]
        args += ["--steps", str(self.steps)] if self.steps else []
        for flag, values in (("--include", self.include), ("--exclude", self.exclude),
                             ("--full-modules", self.full_modules)):
            for v in values:
                args += [flag, v]
        for flag, val in (("--phases", self.phases), ("--capture-steps", self.capture_steps)):
            if val:
                args += [flag, val]
        return args + (["--view-audit"] if self.view_audit else [])


def prepare_run_dir(out: Path, force: bool) -> Path:
    """Create ``out`` for a run; an earlier run is replaced only with ``force``."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it")
        if not {c.name for c in out.iterdir()} <= layout.RUN_CONTENTS:
            raise DriftcheckError(f"--out {out} is not a driftcheck run directory; --force only "
                                  "replaces earlier runs: choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def record_sides(sides: Sides, *, debug: bool = False, say: Callable[[str], None] | None = None,
                 progress: Any = None, on_started: Callable[[], None] | None = None
                 ) -> tuple[Path, Path, Path, Path | None]:
    """Record every side of ``sides``; (run dir, reference, target, truth or None). Every option
    and device is checked before anything is recorded or any directory made. ``progress``: a
    rich Progress that gets one bar per side, advanced as its process finishes each step.
    ``on_started``: called once every side's process has started (no process starts after it:
    the caller may then change its own environment, e.g. import torch for the compare)."""
    user_autoload = os.environ.get(devices.AUTOLOAD_VAR)
    check(sides)
    # checking torch's own devices set TORCH_DEVICE_BACKEND_AUTOLOAD=0 here: each side must get
    # the user's setting back and choose for itself (a tpu target needs the autoload)
    if user_autoload is None:
        os.environ.pop(devices.AUTOLOAD_VAR, None)
    else:
        os.environ[devices.AUTOLOAD_VAR] = user_autoload
    out = prepare_run_dir(sides.out, sides.force)
    shutil.rmtree(out / layout.CONTROL, ignore_errors=True)  # an earlier run's: recorded anew if needed
    common = sides.capture_args()
    ref_dir, tgt_dir, truth_dir = out / layout.REFERENCE, out / layout.TARGET, out / layout.TRUTH
    ref_env, tgt_env = env_args(sides.reference_env), env_args(sides.target_env)
    tgt_args = [sides.model, "--out", str(tgt_dir), "--device", sides.target, "--dtype",
                sides.target_dtype, "--replay", str(ref_dir)] + common
    for flag, val in (("--autocast", sides.autocast), ("--fp8", sides.fp8),
                      ("--matmul-precision", sides.matmul_precision), ("--simulate", sides.simulate),
                      ("--emulate", sides.emulate), ("--mkldnn", sides.mkldnn)):
        if val:
            tgt_args += [flag, val]
    tgt_args += ["--local", str(ref_dir)] if sides.local else ["--no-local"]
    tgt_args += sides.compile_args(sides.compile)
    # The sides that replay the reference start with it and wait for their turn (wait_for_turn):
    # their imports and model builds overlap the reference's record, their records follow it.
    reference = SideProcess([sides.model, "--out", str(ref_dir), "--device", sides.reference, "--dtype",
                             sides.reference_dtype] + common + sides.compile_args(sides.reference_compile)
                            + ref_env, "reference", debug, say, progress, env=sides.reference_env)
    later = [SideProcess([sides.model, "--out", str(truth_dir), "--device", "cpu", "--dtype", "fp64",
                          "--replay", str(ref_dir), "--no-local"] + common + ref_env, "truth (float64)",
                         debug, say, progress, env=sides.reference_env, gated=True)] if sides.truth else []
    later.append(SideProcess(tgt_args + tgt_env, "target + local replay" if sides.local else "target",
                             debug, say, progress, env=sides.target_env, gated=True))
    try:
        if on_started is not None:
            on_started()
        # the reference's trace is complete before its process has ended: the others record now
        reference.wait_complete()
        for side in later:
            side.go()
        reference.finish()
        for side in later:
            side.finish()
    finally:
        for side in [reference, *later]:
            side.stop()
    return out, ref_dir, tgt_dir, truth_dir if sides.truth else None


THREADS_VAR = "OMP_NUM_THREADS"


def control_side(sides: Sides, ref_dir: Path, ctl_dir: Path) -> tuple[list[str], dict[str, str], str] | None:
    """The control run's ``record`` options, environment and label: the reference device at the
    target's precision (its dtype, autocast, fp8 and matmul precision; none of its backend's
    settings), replaying the reference, with local replays where the target has them. On a CPU
    reference, another intra-op thread count than the reference's and a CPU target's: another
    reduction order, so that it is not the target's own computation again. None where it
    would tell nothing: a reference of another device at the target's own precision."""
    ref_type = devices.parse_device(sides.reference)[0]
    same = sides.reference_dtype.lower() == sides.target_dtype.lower() and not (
        sides.autocast or sides.fp8 or sides.matmul_precision)
    if same and ref_type != "cpu":
        return None
    args = [sides.model, "--out", str(ctl_dir), "--device", sides.reference, "--dtype", sides.target_dtype,
            "--replay", str(ref_dir)] + sides.capture_args()
    for flag, val in (("--autocast", sides.autocast), ("--fp8", sides.fp8),
                      ("--matmul-precision", sides.matmul_precision)):
        if val:
            args += [flag, val]
    args += ["--local", str(ref_dir)] if sides.local else ["--no-local"]
    env = dict(sides.reference_env)
    what = f"the reference device at {sides.target_dtype}"
    if ref_type == "cpu":
        def threads(side_env: dict[str, str]) -> str:
            return side_env.get(THREADS_VAR) or os.environ.get(THREADS_VAR) or str(os.cpu_count() or 1)

        taken = {threads(sides.reference_env)}
        if devices.parse_device(sides.target)[0] == "cpu":
            taken.add(threads(sides.target_env))
        n = next(i for i in range(1, len(taken) + 2) if str(i) not in taken)
        env[THREADS_VAR] = str(n)
        what += f", {n} thread{'s' if n > 1 else ''}"
    return args + env_args(env), env, f"control ({what})"


def record_control(sides: Sides, ref_dir: Path, *, debug: bool = False,
                   say: Callable[[str], None] | None = None, progress: Any = None) -> Path | None:
    """Record the control run (``control_side``) into the run directory beside the reference;
    its directory, or None where no control applies. ``driftcheck run`` records it only when
    the verdict without it fails: the control can only pass an entry the analytic floor
    failed (both must object), so a pass needs no control."""
    ctl_dir = ref_dir.parent / layout.CONTROL
    side = control_side(sides, ref_dir, ctl_dir)
    if side is None:
        return None
    args, env, label = side
    record_side(args, label, debug, say, progress, env=env)
    return ctl_dir


def check(sides: Sides) -> None:
    """What can be known wrong before recording: option combinations and devices (torch's own
    opened here; tpu's package looked up without importing it). This process stays torch-free
    until it compares (a torch_tpu with a broken runtime would make ``import torch`` fail here):
    the dtype names come from the torch-free table (numerics/dtype_names.py)."""
    for flag, name in (("--reference-dtype", sides.reference_dtype), ("--target-dtype", sides.target_dtype)):
        if name.lower() not in CLI_DTYPE_NAMES:
            raise DriftcheckError(f"unsupported {flag} {name!r}: choose fp32, bf16, fp16 or fp64")
    if sides.local and sides.mode != "full":
        raise DriftcheckError(f"--local needs full tensors of the reference: drop --mode {sides.mode} "
                              "or drop --local")
    if (sides.compile_mode or sides.dynamic is not None) and not (sides.compile or sides.reference_compile):
        raise DriftcheckError("--compile-mode and --dynamic set how --compile compiles: add "
                              "--compile [BACKEND]")
    if sides.emulate and devices.parse_device(sides.target)[0] not in ("cpu", "cuda"):
        raise DriftcheckError(f"--emulate tpu runs on a CPU or CUDA target, not {sides.target!r}; on a "
                              "TPU target drop --emulate")
    if sides.full_modules and sides.mode != "auto":
        raise DriftcheckError(f"--full-modules only takes effect with --mode auto (this run is "
                              f"--mode {sides.mode}); add --mode auto or drop --full-modules")
    if sides.steps is not None and sides.steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {sides.steps}")
    for spec in (sides.reference, sides.target):
        dev_type, index = devices.parse_device(spec)
        if dev_type == "cpu" and index in (None, 0):
            continue  # always there: no torch needed to know it
        if dev_type in devices.BUILTIN_TYPES:
            # torch's own devices are checked now, not after minutes of recording the reference
            devices.prepare_environment(dev_type)
            devices.open_device(spec)
        elif (dev_type == "tpu" and devices.torch_tpu_version() is None
              and not devices.backend_entry_points(side_env(sides, spec).get("PYTHONPATH"))):
            # no torch_tpu and no backend that could register "tpu" in that side's process
            raise DriftcheckError(f"device 'tpu' needs torch_tpu: {devices.TPU_FIX}")


def side_env(sides: Sides, spec: str) -> dict[str, str]:
    """The environment variables of the side that runs on ``spec`` (the target's when both do)."""
    return sides.target_env if spec == sides.target else sides.reference_env


PROGRESS_VAR = "DRIFTCHECK_PROGRESS"  # "lines": record prints PROGRESS_PREFIX i/n on stderr
PROGRESS_PREFIX = "driftcheck-progress: "
COMPLETE = "complete"  # PROGRESS_PREFIX + COMPLETE: the trace is closed (its manifest written)


def env_args(env: dict[str, str]) -> list[str]:
    """``--env NAME=VALUE`` for each of a side's variables (``record`` records them)."""
    return [a for k, v in env.items() for a in ("--env", f"{k}={v}")]


def record_side(args: list[str], label: str, debug: bool, say: Callable[[str], None] | None,
                progress: Any = None, env: dict[str, str] | None = None) -> None:
    """Record in a fresh process and wait for it (``SideProcess``)."""
    side = SideProcess(args, label, debug, say, progress, env=env)
    try:
        side.finish()
    finally:
        side.stop()


HASH_SEED_VAR = "PYTHONHASHSEED"
GATE_VAR = "DRIFTCHECK_WAIT_FOR_TURN"  # "1": record reads "go" from stdin before it replays
GO = "go"


def wait_for_turn() -> None:
    """In a record started by ``driftcheck run`` before the reference it replays is complete:
    load what every record loads while the reference records (torch's compiler front end, which
    an optimizer imports), then wait for ``GO`` on stdin. End of input (the
    reference failed, or ``driftcheck run`` was stopped): exit at once, recording nothing."""
    if os.environ.get(GATE_VAR) != "1":
        return
    os.environ.pop(GATE_VAR)
    import torch._dynamo  # noqa: F401  (torch.optim's constructors import it)

    if sys.stdin.readline().strip() != GO:
        raise SystemExit(3)


def progress_words(entries: int, nbytes: int, seconds: float) -> str:
    """What a side has written so far, for a person: "486 tensors, 3.1 MB, 2.4 MB/s"."""
    mb = nbytes / 1e6
    rate = f", {mb / seconds:.1f} MB/s" if seconds > 0 and nbytes else ""
    return f"{entries} tensors, {mb:.1f} MB{rate}"


class SideProcess:
    """One side's ``driftcheck record``, in a fresh process: backends and precision settings
    cannot leak between sides. Its steps come back as progress lines on its stderr (steps done
    of steps, tensors and bytes written); the rest of stderr is its message. ``gated``: it waits
    for ``go()`` before it records (``wait_for_turn``)."""

    def __init__(self, args: list[str], label: str, debug: bool, say: Callable[[str], None] | None,
                 progress: Any = None, env: dict[str, str] | None = None, gated: bool = False) -> None:
        self.label, self.debug, self.say, self.progress = label, debug, say, progress
        cmd = [sys.executable, "-m", "driftcheck", "--quiet"] + (["--debug"] if debug else []) + ["record"] + args
        if say is not None:
            say(f"recording {label}: driftcheck record {' '.join(args)}")
        # One string hash seed for every side (the user's, or 0): a model that iterates a set of
        # strings calls its modules in the same order on both sides (recorded in the manifest).
        extra = {PROGRESS_VAR: "lines", **({GATE_VAR: "1"} if gated else {})}
        if HASH_SEED_VAR not in os.environ and HASH_SEED_VAR not in (env or {}):
            extra[HASH_SEED_VAR] = "0"
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **(env or {}), **extra),
                                     stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.started = time.monotonic()
        self.task = None
        self.steps = self.written = ""
        self.lines: list[str] = []  # its stderr but the progress lines: its message

    def go(self) -> None:
        """The reference is complete: this side records now (it may have failed already: then
        ``finish`` says why)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(GO + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def wait_complete(self) -> None:
        """Follow the side until its trace is complete (or its process has ended: ``finish``
        says how); its process may still be exiting."""
        self._follow(until_complete=True)

    def finish(self) -> None:
        """Follow the side to its end; its failure as one line (DriftcheckError)."""
        self._follow(until_complete=False)
        self.proc.wait()
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None
        if self.proc.returncode != 0:
            stderr = "".join(self.lines)
            msg = (stderr.strip().splitlines() or ["(no message)"])[-1]
            if self.debug:
                sys.stderr.write(stderr)
            raise DriftcheckError(f"the {self.label} record failed: {msg.removeprefix('driftcheck: ')}")
        if self.say is not None and self.steps:
            self.say(f"recorded {self.label}: {self.steps} steps, {self.written} "
                     f"in {time.monotonic() - self.started:.1f} s")

    def _follow(self, until_complete: bool) -> None:
        if self.progress is not None and self.task is None:
            self.task = self.progress.add_task(f"recording {self.label}", total=None)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if not line.startswith(PROGRESS_PREFIX):
                self.lines.append(line)
            elif line[len(PROGRESS_PREFIX):].strip() == COMPLETE:
                if until_complete:
                    return
            else:
                self._advance(line[len(PROGRESS_PREFIX):].split())

    def _advance(self, fields: list[str]) -> None:
        done, _, total = fields[0].partition("/") if fields else ("", "", "")
        if not (done.isdigit() and total.isdigit()):
            return
        self.steps = f"{done}/{total}"
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            self.written = progress_words(int(fields[1]), int(fields[2]), time.monotonic() - self.started)
        if self.task is not None:
            self.progress.update(self.task, completed=int(done), total=int(total), written=self.written)

    def stop(self) -> None:
        """End the process where it still runs (another side failed, or an interrupt)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stderr):
            if stream is not None:
                stream.close()

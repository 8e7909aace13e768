"""``driftcheck run``: the reference, the optional float64 truth and the target, each recorded in
a fresh ``driftcheck record`` process, into one run directory (store/layout.py names its parts).

A fresh process per side: a backend (torch_tpu) and precision settings loaded for one side can
never leak into the other.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
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
                 progress: Any = None) -> tuple[Path, Path, Path, Path | None]:
    """Record every side of ``sides``; (run dir, reference, target, truth or None). Every option
    and device is checked before anything is recorded or any directory made. ``progress``: a
    rich Progress that gets one bar per side, advanced as its process finishes each step."""
    user_autoload = os.environ.get(devices.AUTOLOAD_VAR)
    check(sides)
    # checking torch's own devices set TORCH_DEVICE_BACKEND_AUTOLOAD=0 here: each side must get
    # the user's setting back and choose for itself (a tpu target needs the autoload)
    if user_autoload is None:
        os.environ.pop(devices.AUTOLOAD_VAR, None)
    else:
        os.environ[devices.AUTOLOAD_VAR] = user_autoload
    out = prepare_run_dir(sides.out, sides.force)
    common = sides.capture_args()
    ref_dir, tgt_dir, truth_dir = out / layout.REFERENCE, out / layout.TARGET, out / layout.TRUTH
    ref_env, tgt_env = env_args(sides.reference_env), env_args(sides.target_env)
    record_side([sides.model, "--out", str(ref_dir), "--device", sides.reference, "--dtype",
             sides.reference_dtype] + common + sides.compile_args(sides.reference_compile) + ref_env,
            "reference", debug, say, progress,
            env=sides.reference_env)
    if sides.truth:
        record_side([sides.model, "--out", str(truth_dir), "--device", "cpu", "--dtype", "fp64",
                 "--replay", str(ref_dir), "--no-local"] + common + ref_env, "truth (float64)", debug,
                say, progress, env=sides.reference_env)
    tgt_args = [sides.model, "--out", str(tgt_dir), "--device", sides.target, "--dtype",
                sides.target_dtype, "--replay", str(ref_dir)] + common
    for flag, val in (("--autocast", sides.autocast), ("--fp8", sides.fp8),
                      ("--matmul-precision", sides.matmul_precision), ("--simulate", sides.simulate),
                      ("--emulate", sides.emulate), ("--mkldnn", sides.mkldnn)):
        if val:
            tgt_args += [flag, val]
    tgt_args += ["--local", str(ref_dir)] if sides.local else ["--no-local"]
    tgt_args += sides.compile_args(sides.compile)
    record_side(tgt_args + tgt_env, "target + local replay" if sides.local else "target", debug, say,
            progress, env=sides.target_env)
    return out, ref_dir, tgt_dir, truth_dir if sides.truth else None


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


def env_args(env: dict[str, str]) -> list[str]:
    """``--env NAME=VALUE`` for each of a side's variables (``record`` records them)."""
    return [a for k, v in env.items() for a in ("--env", f"{k}={v}")]


def record_side(args: list[str], label: str, debug: bool, say: Callable[[str], None] | None,
            progress: Any = None, env: dict[str, str] | None = None) -> None:
    """Record in a fresh process: backends and precision settings cannot leak between runs. Its
    steps come back as progress lines on its stderr; the rest of stderr is its message."""
    cmd = [sys.executable, "-m", "driftcheck", "--quiet"] + (["--debug"] if debug else []) + ["record"] + args
    if say is not None:
        say(f"recording {label}: driftcheck record {' '.join(args)}")
    task = progress.add_task(f"recording {label}", total=None) if progress is not None else None
    env = dict(os.environ, **(env or {}), **{PROGRESS_VAR: "lines"})
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        lines = []
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(PROGRESS_PREFIX):
                done, _, total = line[len(PROGRESS_PREFIX):].strip().partition("/")
                if task is not None and done.isdigit() and total.isdigit():
                    progress.update(task, completed=int(done), total=int(total))
            else:
                lines.append(line)
        proc.wait()
    if task is not None:
        progress.remove_task(task)
    if proc.returncode != 0:
        stderr = "".join(lines)
        msg = (stderr.strip().splitlines() or ["(no message)"])[-1]
        if debug:
            sys.stderr.write(stderr)
        raise DriftcheckError(f"the {label} record failed: {msg.removeprefix('driftcheck: ')}")

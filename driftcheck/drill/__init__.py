"""Drill-down: from the module where drift enters to the op, the source line and a repro.

``drill(ref, target)`` reruns one module call (by default the first divergence of their compare)
on the reference's side and on the target's side, each from the reference's recorded inputs and
parameters of that call, under a dispatch-level recorder (driftcheck/drill/side.py); aligns the
two op sequences (align.py); judges each target op's local output against that op's own floor
(judge.py); and names the first op over the limit, with the model-code line that issued it. It
writes ``repro/`` (the op's inputs and a standalone script, repro.py) for a bug report.

Each side runs in its own process under its recorded environment (``run.env`` of its manifest),
as ``driftcheck run`` recorded it; ``in_process=True`` runs both here (tests, benchmarks, and
faults injected through ``target_hooks``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driftcheck.errors import DriftcheckError

__all__ = ["DrillResult", "drill", "point_of"]

DRILLABLE = ("forward", "backward", "grads")


@dataclasses.dataclass
class DrillResult:
    """What a drill found. ``root_cause`` is None where no op exceeds its floor."""

    point: dict[str, Any]
    judged: list[Any]  # judge.OpJudgement, in the target's op order
    root_cause: dict[str, Any] | None
    ops: dict[str, int]  # reference/target op counts, aligned pairs
    unmatched_target_ops: list[str]
    limit: float
    repro: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point, "root_cause": self.root_cause, "ops": self.ops,
                "limit": self.limit, "unmatched_target_ops": self.unmatched_target_ops[:50],
                "judged": [j.to_dict() for j in self.judged], "repro": self.repro}


def point_of(first_divergence: dict[str, Any] | None, module: str | None = None,
             step: int | None = None, phase: str | None = None, call: int | None = None) -> Any:
    """The call to drill: the given module/step/phase/call, the rest from a first divergence."""
    from driftcheck.drill.side import Point

    fd = first_divergence or {}
    if fd.get("status") == "finding" and module is None:
        raise DriftcheckError(f"the first divergence is a finding ({fd.get('finding')} in "
                              f"{fd.get('module') or 'the model'}): it names its own cause, there is "
                              "no op to drill; pass --module to drill a module anyway")
    if module is None and not fd:
        raise DriftcheckError("the target does not diverge: there is nothing to drill (pass "
                              "--module and --step to drill a module anyway)")
    ph = phase or fd.get("phase") or "forward"
    if ph not in DRILLABLE:
        raise DriftcheckError(f"drill-down reruns a module call's forward and backward; the first "
                              f"divergence is in phase {ph!r} ({fd.get('module') or 'the model'}), "
                              "outside any module call")
    if module is None:
        slot = str(fd.get("slot") or "")
        module = fd.get("module") or ""
        if slot.startswith(("input", "grad_output")):  # made by the code around the module
            blame = fd.get("blame_module") or module
            if blame == module and module:
                blame = module.rpartition(".")[0]
            module, call = blame, 0 if call is None else call
    return Point(module=module, step=int(step if step is not None else fd.get("step", 0)),
                 call=int(call if call is not None else fd.get("call", 0) or 0),
                 phase="backward" if ph in ("backward", "grads") else "forward")


def drill(ref: str | os.PathLike, target: str | os.PathLike, *, point: Any = None,
          report: Any = None, limit: float | None = None, out: str | os.PathLike | None = None,
          in_process: bool = False, target_hooks: Callable | None = None,
          scenario: Callable[[], Any] | None = None) -> DrillResult:
    """Drill ``point`` (a side.Point; default: the first divergence of ``report``, compared here
    when not given). ``out``: where ``drill.json`` and ``repro/`` go (nothing written without).
    ``target_hooks``/``scenario`` (a factory of fresh Scenarios) imply ``in_process``."""
    from driftcheck.drill import judge as jd
    from driftcheck.store import TraceReader

    if point is None:
        if report is None:
            from driftcheck.compare import compare

            report = compare(str(ref), str(target), limit=limit)
        point = point_of(report.first_divergence)
    lim = float(limit if limit is not None else (report.limit if report is not None else 3.5))
    from driftcheck.store.layout import is_multirank

    if is_multirank(ref) or is_multirank(target):
        raise DriftcheckError("drill-down reruns single-process records: a torchrun run's ranks "
                              "cannot be rerun one module call at a time; record the model in one "
                              "process (without --parallel) and drill that")
    ref_run, tgt_run = TraceReader(ref).run, TraceReader(target).run
    for label, run in (("REF", ref_run), ("TARGET", tgt_run)):
        if run.get("driver"):
            raise DriftcheckError(f"{label} was recorded by a training-loop callback ({run['driver']}): "
                                  "the drill-down rebuilds a run from a driftcheck record; record the "
                                  "model with driftcheck record (or run) and drill that")
    _check_point(TraceReader(ref), point)
    if tgt_run.get("replay_id") != ref_run.get("replay_id"):
        raise DriftcheckError(f"{target} was not recorded from {ref}'s weights and inputs (another "
                              "replay_id): drill it against the reference it replayed")
    if in_process or target_hooks is not None or scenario is not None:
        from driftcheck.drill.side import run_side

        ref_ops, _ = run_side(ref, ref, point, keep=True, scenario=scenario() if scenario else None)
        tgt_ops, info = run_side(target, ref, point, keep=False, ref_ops=ref_ops,
                                 target_hooks=target_hooks,
                                 scenario=scenario() if scenario else None)
    else:
        ref_ops, tgt_ops, info = _in_processes(ref, target, point)
    pairs = [tuple(p) for p in info.get("pairs", [])]
    emulate = (tgt_run.get("emulation") or {}).get("matmul_precision")
    judged = jd.judge(ref_ops, tgt_ops, pairs, emulate=emulate)
    matched_t = {t for _, t in pairs}
    unmatched = [f"{tgt_ops[i].packet} ({tgt_ops[i].phase})" for i in range(len(tgt_ops))
                 if i not in matched_t]
    first = next((j for j in judged if j.ratio > lim), None)
    pt = dataclasses.asdict(point)
    root: dict[str, Any] | None = None
    if first is not None:
        root = {"module": point.module, "step": point.step, "call": point.call,
                "phase": first.phase, "op": first.op, "ratio": first.ratio, "floor": first.floor,
                "error": first.error, "output": first.output, "source": first.source,
                "inputs": first.inputs, "truth": first.truth, "limit": lim,
                "drilled_phase": point.phase, "call_site": info.get("call_site")}
    result = DrillResult(point=pt, judged=judged, root_cause=root,
                         ops={"reference": len(ref_ops), "target": len(tgt_ops), "aligned": len(pairs),
                              "judged": len(judged)},
                         unmatched_target_ops=unmatched, limit=lim)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if first is not None and root is not None:  # set together
            from driftcheck.drill.repro import write_repro

            path = write_repro(out / "repro", ref_ops[first.ref_index], tgt_ops[first.tgt_index],
                               first, ref_run=TraceReader(ref).run, tgt_run=tgt_run, limit=lim)
            result.repro = str(path)
            root["repro"] = str(path)
        from driftcheck.gate.jsonform import clean  # the reports' JSON spelling of inf/nan

        (out / "drill.json").write_text(json.dumps(clean(result.to_dict()), indent=1),
                                        encoding="utf-8")
    return result


def _check_point(reader: Any, point: Any) -> None:
    """A module or step the reference never recorded is refused before any side runs."""
    import difflib

    start = int(reader.run.get("start_step") or 0)
    steps = int(reader.run.get("steps") or 0)
    if not start <= point.step < start + steps:
        raise DriftcheckError(f"step {point.step} is not in the recorded run (steps {start}-"
                              f"{start + steps - 1}); choose one of them with --step")
    modules = {e["module"] for e in reader.entries}
    if point.module not in modules and (point.module or ".") not in modules:
        near = difflib.get_close_matches(point.module, sorted(m for m in modules if m), n=3, cutoff=0.3)
        raise DriftcheckError(f"the reference records no module {point.module!r}"
                              + (f" (nearest: {', '.join(near)})" if near else "")
                              + "; module paths are named_modules() names")


def _in_processes(ref: Any, target: Any, point: Any) -> tuple[list, list, dict]:
    from driftcheck.drill import oplog

    with tempfile.TemporaryDirectory(prefix="driftcheck-drill-") as tmp:
        ref_out, tgt_out = Path(tmp) / "ref-ops", Path(tmp) / "target-ops"
        _side_process(ref, ref, point, ref_out, None, "reference")
        _side_process(target, ref, point, tgt_out, ref_out, "target")
        ref_ops, _ = oplog.load(ref_out)
        tgt_ops, doc = oplog.load(tgt_out)
    return ref_ops, tgt_ops, doc.get("info", {})


def _side_process(trace: Any, ref: Any, point: Any, out: Path, ref_ops: Path | None, label: str) -> None:
    from driftcheck.store import TraceReader

    args = {"trace": str(trace), "ref": str(ref), "point": dataclasses.asdict(point),
            "out": str(out), "ref_ops": str(ref_ops) if ref_ops else None}
    path = out.parent / f"{label}.json"
    path.write_text(json.dumps(args), encoding="utf-8")
    env = side_env(TraceReader(trace).run)
    proc = subprocess.run([sys.executable, "-m", "driftcheck.drill.side", str(path)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        died = f"(no message; exit status {proc.returncode})"
        msg = (proc.stderr.strip().splitlines() or [died])[-1]
        msg = msg.removeprefix("driftcheck: ").removeprefix("drill: ")
        raise DriftcheckError(f"the {label} side of the drill failed: {msg}")


def side_env(run: dict[str, Any]) -> dict[str, str]:
    """The environment a rerun of this side runs under: ours, with the side's recorded
    ``run.env`` on top; a CPU/CUDA side never autoloads a backend package."""
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (run.get("env") or {}).items()})
    seed = str(run.get("python_hash_seed", "random"))
    if seed != "random":  # the rerun iterates a set of strings in the recorded order
        env["PYTHONHASHSEED"] = seed
    if "TORCH_DEVICE_BACKEND_AUTOLOAD" not in (run.get("env") or {}):
        if str(run.get("device_type", "cpu")) in ("cpu", "cuda"):
            env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        else:
            # tpu or another backend package's device needs the autoload, which this process
            # (having opened a CPU device itself) may have switched off
            env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    return env

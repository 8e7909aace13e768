"""``driftcheck drill``: from the first diverging module to the op, its source line and a repro;
and the drill-down ``driftcheck run`` does by itself when its verdict fails."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from driftcheck.cli.app import Ctx, cli, everywhere, finish, make_progress, outputs_options
from driftcheck.errors import DriftcheckError
from driftcheck.store.remote import is_url


def default_out(target: str | os.PathLike) -> Path:
    """OUT/drill inside a ``driftcheck run`` directory, else TARGET-drill beside the trace."""
    from driftcheck.store import layout

    t = Path(target)
    if t.name == layout.TARGET and (t.parent / layout.REFERENCE).is_dir():
        return t.parent / layout.DRILL
    return t.with_name(t.name + "-drill")


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        if not (out / "drill.json").is_file() and not force:
            raise DriftcheckError(f"--out {out} exists and is not a drill directory; choose another "
                                  "or pass --force")
        shutil.rmtree(out)
    return out


def drill_report(report: Any, ref: str, target: str, out: Path, point: Any = None,
                 limit: float | None = None) -> Any:
    """Drill ``report``'s first divergence (or ``point``) and put the root cause and the known
    signatures it matches into the report; returns the DrillResult."""
    from driftcheck.drill import drill
    from driftcheck.gate.signatures import attach

    result = drill(ref, target, point=point, report=report, limit=limit, out=out)
    report.root_cause = result.root_cause
    attach(report, result)
    return result


@cli.command("drill")
@click.argument("ref", type=click.Path())
@click.argument("target", type=click.Path())
@click.option("--module", default=None, help="Module path to drill  [default: the first divergence's]")
@click.option("--step", type=int, default=None, help="Step  [default: the first divergence's]")
@click.option("--phase", type=click.Choice(["forward", "backward"]), default=None,
              help="Drill the forward, or the backward (which reruns the forward too)  "
                   "[default: the first divergence's]")
@click.option("--call", type=int, default=None, help="Which call of the module in that step  [default: 0]")
@click.option("--out", "-o", type=click.Path(), default=None,
              help="Where drill.json and repro/ go  [default: OUT/drill in a run directory, else TARGET-drill]")
@click.option("--force", is_flag=True, help="Replace --out if it is not a drill directory.")
@click.option("--limit", type=float, default=None, help="Ratio limit per op  [default: the policy's, 3.5]")
@click.option("--policy", "policy_path", type=click.Path(), default=None, help="Policy file.")
@click.option("--top", type=int, default=10, show_default=True, help="Rows of the worst-entries table.")
@outputs_options
@everywhere
@click.pass_obj
def drill_cmd(obj: Ctx, ref: str, target: str, module: str | None, step: int | None,
              phase: str | None, call: int | None, out: str | None, force: bool,
              limit: float | None, policy_path: str | None, top: int, json_path: str | None,
              html_path: str | None, junit_path: str | None, md_path: str | None) -> None:
    """Rerun the first diverging module call of TARGET against REF op by op: name the first ATen
    op whose own error exceeds its floor, the model-code line that issued it, and write a
    standalone repro. Exit 0 when no op exceeds its floor, 1 when one does, 2 bad input."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if limit is not None and not limit > 0:
        raise DriftcheckError(f"--limit must be positive, got {limit}")
    if is_url(ref) or is_url(target) or is_url(out):
        raise DriftcheckError(f"{next(v for v in (ref, target, out) if is_url(v))}: the drill-down reruns "
                              "each side from a local trace directory; copy the traces from the bucket first")
    if step is not None and module is None:
        raise DriftcheckError("--step needs --module (without it the first divergence names both)")
    from driftcheck.compare import compare
    from driftcheck.drill import point_of
    from driftcheck.gate.policy import Policy

    with make_progress(obj) as p:
        task = p.add_task("comparing", total=None)
        report = compare(ref, target, policy=Policy.load(policy_path, "."), limit=limit,
                         on_progress=lambda i, n: p.update(task, completed=i, total=n))
        point = point_of(report.first_divergence, module, step, phase, call)
        dest = _prepare_out(Path(out) if out else default_out(target), force)
        p.add_task(f"drilling {point.module or 'the model'} step {point.step} {point.phase}", total=None)
        result = drill_report(report, ref, target, dest, point=point, limit=limit)
    _say_drill(obj, result, dest)
    _finish_drill(obj, report, result, top, json_path, html_path, junit_path, md_path)


def _say_drill(obj: Ctx, result: Any, dest: Path, say: Callable[[str], None] | None = None) -> None:
    if obj.quiet:
        return
    say = say or (lambda m: click.echo(m, err=True))
    o = result.ops
    say(f"drilled {result.point['module'] or 'the model'} step {result.point['step']} call "
        f"{result.point['call']} ({result.point['phase']}): {o['judged']} of {o['target']} target ops "
        f"judged ({o['aligned']} aligned with the reference's {o['reference']}); {dest / 'drill.json'}")
    if result.root_cause is None:
        say(f"no op exceeds its floor by more than {result.limit:g}x"
            + (f"; {len(result.unmatched_target_ops)} target op(s) have no reference counterpart "
               f"(e.g. {', '.join(result.unmatched_target_ops[:3])})" if result.unmatched_target_ops else ""))


def drill_after_run(obj: Ctx, report: Any, ref_dir: Path, tgt_dir: Path, out_dir: Path,
                    limit: float | None, progress: Any) -> None:
    """``driftcheck run``'s drill-down of a failed verdict, into OUT/drill; a first divergence
    that cannot be drilled (a finding, an optimizer entry) is said in one line, not an error."""
    from driftcheck.drill import point_of
    from driftcheck.store import layout

    say = (lambda m: progress.console.print(m, markup=False, highlight=False)) if not obj.quiet else None
    try:
        point = point_of(report.first_divergence)
    except DriftcheckError as e:
        if say:
            say(f"drill-down: not run ({e})")
        return
    dest = _prepare_out(out_dir / layout.DRILL, True)
    task = progress.add_task(f"drilling {point.module or 'the model'} step {point.step} {point.phase}",
                             total=None)
    try:
        result = drill_report(report, str(ref_dir), str(tgt_dir), dest, point=point, limit=limit)
    except DriftcheckError as e:
        if say:
            say(f"drill-down: failed ({e})")
        return
    finally:
        progress.remove_task(task)
    _say_drill(obj, result, dest, say)


def _finish_drill(obj: Ctx, report: Any, result: Any, top: int, *outputs: str | None) -> None:
    try:
        finish(obj, report, top, *outputs)
    except SystemExit as e:  # the report's verdict, and 1 also where a forced drill found an op
        raise SystemExit(1 if result.root_cause is not None else e.code) from None

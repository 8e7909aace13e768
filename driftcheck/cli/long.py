"""``--long``: ``record``, ``compare`` and ``run`` of many-step runs (driftcheck/record/long.py,
driftcheck/compare/long.py). ``run --long`` records the reference, the target and a control in
their own processes, judges the target against the control's band, and when it fails records
the first bad step in full from the nearest replay point, on both sides, and compares that.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import click

from driftcheck.errors import DriftcheckError
from driftcheck.store.layout import CONTROL, FIRST_BAD, LONG_REPORT_HTML, LONG_REPORT_JSON


def long_options(f: Any, *, record: bool) -> Any:
    """``--long``, ``--every``, ``--points-every`` (and for ``record``: ``--perturb``, ``--start``)."""
    opts = [
        click.option("--long", "long_", is_flag=True,
                     help="A long run: per-step loss, gradient, update and parameter norms, and every "
                          "--every steps a parameter sample and module statistics (docs/long-runs.md)."),
        click.option("--every", type=int, default=10, show_default=True,
                     help="With --long: sampling interval (steps)."),
        click.option("--points-every", type=int, default=None,
                     help="With --long: a replay point (model and optimizer state) every N steps  "
                          "[default: max(50, steps/20)]"),
    ]
    if record:
        opts += [
            click.option("--perturb", is_flag=True,
                         help="With --long: a control run, every weight one ulp off before the first step."),
            click.option("--start", type=int, default=None,
                         help="With --replay LONG_REF: start at this step from its replay point "
                              "(--steps counts from there, --capture-steps names absolute steps)."),
        ]
    for o in reversed(opts):
        f = o(f)
    return f


def record_long_cmd(obj: Any, model: str, out: str, device: str, dtype: str, steps: int | None,
                    seed: int, replay: str | None, force: bool, autocast: str | None, every: int,
                    points_every: int | None, perturb: bool, simulate: str | None = None) -> None:
    from driftcheck.loader import load_scenario
    from driftcheck.numerics.dtypes import parse_cli
    from driftcheck.record.long import record_long
    from driftcheck.targets import devices

    if steps is None:
        raise DriftcheckError("--long needs --steps N (how many training steps to run)")
    parse_cli(dtype)
    torch_device = devices.open_device(device)
    from driftcheck.record.run import PROGRESS_PREFIX, PROGRESS_VAR

    lines = os.environ.get(PROGRESS_VAR) == "lines"

    def on_step(i: int, n: int) -> None:
        if lines and (i % max(1, n // 100) == 0 or i == n):
            click.echo(f"{PROGRESS_PREFIX}{i}/{n}", err=True)

    path = record_long(load_scenario(model, seed), out, steps=steps, device=torch_device, dtype=dtype,
                       every=every, points_every=points_every, replay=replay, seed=seed,
                       autocast=autocast, perturb=perturb, force=force, model_id=model, on_step=on_step,
                       simulate=simulate)
    if not obj.quiet:
        click.echo(f"recorded a long run of {steps} steps into {path}")


def compare_long_cmd(obj: Any, ref: str, target: str, control: str | None,
                     json_path: str | None, html_path: str | None) -> None:
    from driftcheck.compare.long import compare_long
    from driftcheck.report.long import terminal_lines

    rep = compare_long(ref, target, control)
    _write(rep, None, json_path, html_path)
    if not obj.quiet:
        for line in terminal_lines(rep):
            click.echo(line)
    raise SystemExit(0 if rep else 1)


def run_long(obj: Any, *, model: str, out: Path, ref_device: str, tgt_device: str,
             reference_dtype: str, target_dtype: str, autocast: str | None, steps: int | None,
             seed: int, every: int, points_every: int | None, force: bool, html: bool,
             simulate: str | None = None, reference_env: dict[str, str] | None = None,
             target_env: dict[str, str] | None = None) -> None:
    """``driftcheck run --long``: reference, target, control, the band, the first bad step."""
    from driftcheck.record import run as run_mod
    from driftcheck.store import layout

    if steps is None:
        raise DriftcheckError("--long needs --steps N (how many training steps to run)")
    if steps < 1 or every < 1 or (points_every is not None and points_every < 1):
        raise DriftcheckError("--steps, --every and --points-every must be at least 1")
    run_mod.check(run_mod.Sides(model=model, out=out, reference=ref_device, target=tgt_device,
                                reference_dtype=reference_dtype, target_dtype=target_dtype))
    out = run_mod.prepare_run_dir(out, force)
    say = None if obj.quiet else (lambda m: click.echo(m, err=True))
    common = ["--long", "--steps", str(steps), "--every", str(every), "--seed", str(seed), "--force"]
    common += ["--points-every", str(points_every)] if points_every else []
    ref, tgt, ctl = out / layout.REFERENCE, out / layout.TARGET, out / CONTROL
    cast = ["--autocast", autocast] if autocast else []
    sim = ["--simulate", simulate] if simulate else []  # the target only
    renv, tenv = reference_env or {}, target_env or {}
    re_args, te_args = run_mod.env_args(renv), run_mod.env_args(tenv)
    run_mod.record_side([model, "--out", str(ref), "--device", ref_device, "--dtype", reference_dtype]
                    + common + re_args, "reference (long)", obj.debug, say, env=renv)
    run_mod.record_side([model, "--out", str(tgt), "--device", tgt_device, "--dtype", target_dtype,
                     "--replay", str(ref)] + cast + sim + common + te_args, "target (long)", obj.debug,
                    say, env=tenv)
    run_mod.record_side([model, "--out", str(ctl), "--device", ref_device, "--dtype", target_dtype,
                     "--replay", str(ref), "--perturb"] + cast + common + re_args,
                    "control (the target's precision on the reference device, weights 1 ulp off)",
                    obj.debug, say, env=renv)
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    from driftcheck.compare import compare
    from driftcheck.compare.long import compare_long
    from driftcheck.report.long import terminal_lines
    from driftcheck.store.long import LongReader

    rep = compare_long(str(ref), str(tgt), str(ctl))
    full = None
    if rep.first_bad_step is not None:
        s = rep.first_bad_step
        start = max((p for p in LongReader(ref).points if p <= s), default=0)
        fb = out / FIRST_BAD
        seg = ["--replay", str(ref), "--start", str(start), "--steps", str(s - start + 1),
               "--capture-steps", str(s), "--seed", str(seed), "--force"]
        run_mod.record_side([model, "--out", str(fb / layout.REFERENCE), "--device", ref_device,
                         "--dtype", reference_dtype] + seg + re_args, f"step {s} in full, reference",
                        obj.debug, say, env=renv)
        run_mod.record_side([model, "--out", str(fb / layout.TARGET), "--device", tgt_device,
                         "--dtype", target_dtype] + cast + sim + seg + te_args,
                        f"step {s} in full, target", obj.debug, say, env=tenv)
        full = compare(str(fb / layout.REFERENCE), str(fb / layout.TARGET))
        from driftcheck.cli.app import write_outputs

        write_outputs(full, str(fb / layout.REPORT_JSON), str(fb / layout.REPORT_HTML), None, None)
    _write(rep, full, str(out / LONG_REPORT_JSON), str(out / LONG_REPORT_HTML) if html else None)
    if not obj.quiet:
        for line in terminal_lines(rep, full):
            click.echo(line)
        click.echo(f"reports: {out / LONG_REPORT_JSON}" + (f", {out / LONG_REPORT_HTML}" if html else "")
                   + (f", {out / FIRST_BAD / layout.REPORT_HTML}" if full is not None else ""))
    raise SystemExit(0 if rep else 1)


def _write(rep: Any, full: Any, json_path: str | None, html_path: str | None) -> None:
    from driftcheck.report.long import render_long_html

    for path, text in ((json_path, lambda: json.dumps(
            _finite(dict(rep.to_dict(), first_bad_report=full.to_dict() if full is not None else None)),
            allow_nan=False, default=str)), (html_path, lambda: render_long_html(rep, full))):
        if path:
            try:
                Path(path).write_text(text(), encoding="utf-8")
            except OSError as e:
                raise DriftcheckError(f"cannot write {path}: {e.strerror}") from None


def _finite(x: Any) -> Any:
    """Strict JSON: a non-finite number (a diverged run's loss) is null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x

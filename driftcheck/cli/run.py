"""``driftcheck run``: truth (optional), reference and target, each recorded in its own process,
compared, and drilled down to the op when the verdict fails."""
from __future__ import annotations

import functools
import importlib
import os
import threading
from pathlib import Path

import click

from driftcheck.cli.app import (
    SIMULATED,
    Ctx,
    capture_options,
    cli,
    compile_options,
    everywhere,
    finish,
    make_progress,
    parse_env,
    parse_phases,
    parse_ranges,
    precision_options,
)
from driftcheck.cli.long import long_options, run_long
from driftcheck.errors import DriftcheckError
from driftcheck.store.remote import is_url


# -- run ----------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@click.option("--reference", "ref_device", default="cpu", show_default=True,
              help="Reference device: cpu or cuda[:N].")
@click.option("--target", "tgt_device", required=True,
              help="Target device: tpu, cuda[:N], cpu (a precision what-if), mps, xpu or a PrivateUse1 name.")
@click.option("--reference-dtype", default="fp32", show_default=True, help="Reference dtype: fp32, bf16, fp16 or fp64.")
@click.option("--target-dtype", default="fp32", show_default=True, help="Target dtype: fp32, bf16, fp16 or fp64.")
@precision_options("the target's")
@compile_options(True)
@click.option("--truth", type=click.Choice(["fp64"]), default=None,
              help="Also record a float64 truth on CPU from the same replay  [default: none]")
@click.option("--local/--no-local", "local", default=None,
              help="Rerun every module of the target on the reference's inputs (a composite's own "
                   "code with its children's results taken from the reference): separates each "
                   "module's own error from what it inherits  [default: on with --mode full]")
@click.option("--control/--no-control", "control", default=True, show_default=True,
              help="When the verdict fails, record a control run (the reference device at the target's "
                   "precision, another reduction order) into OUT/control and judge again: an entry fails "
                   "only where the target is also further from the reference than the control is; "
                   "where the control drifts as far, the model's code is named as sensitive to the "
                   "precision.")
@click.option("--drill/--no-drill", "drill", default=True, show_default=True,
              help="When the verdict fails, drill the first divergence down to the op, its source "
                   "line and a repro (OUT/drill).")
@click.option("--reference-env", multiple=True, metavar="NAME=VALUE",
              help="An environment variable of the reference's process (repeatable).")
@click.option("--target-env", multiple=True, metavar="NAME=VALUE",
              help="An environment variable of the target's process (repeatable; e.g. "
                   "TORCH_TPU_DEFER_AND_FUSE=1, TPU_LAUNCH_BLOCKING=1, XLA_FLAGS=..., LIBTPU_INIT_ARGS=...).")
@click.option("--out", "-o", required=True, type=click.Path(), help="Run directory (traces and reports).")
@click.option("--force", is_flag=True, help="Replace an earlier run in --out.")
@click.option("--steps", type=int, default=None, help="Training steps  [default: the scenario's]")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the model, inputs and dropout masks.")
@capture_options
@click.option("--view-audit", is_flag=True,
              help="Record view/in-place events on both sides for the BatchNorm/view/in-place audits.")
@click.option("--simulate", type=click.Choice(SIMULATED),
              default=None, help="Run the target on a simulated faulty backend (to see the audits catch it).")
@click.option("--policy", "policy_path", type=click.Path(), default=None,
              help="Policy file  [default: driftcheck.toml or [tool.driftcheck] in pyproject.toml]")
@click.option("--limit", type=float, default=None,
              help="Override every ratio limit  [default: the policy's, 3.5 without one]")
@click.option("--top", type=int, default=10, show_default=True, help="Rows of the worst-entries table.")
@click.option("--html/--no-html", "html", default=True, show_default=True, help="Write OUT/report.html.")
@click.option("--junit", "junit_path", type=click.Path(), default=None, help="Also write JUnit XML here.")
@click.option("--summary-md", "md_path", type=click.Path(), default=None, help="Also write a Markdown summary here.")
@functools.partial(long_options, record=False)
@everywhere
@click.pass_obj
def run(obj: Ctx, model: str, ref_device: str, tgt_device: str, reference_dtype: str,
        target_dtype: str, autocast: str | None, fp8: str | None, matmul_precision: str | None,
        emulate: str | None, mkldnn: str | None, compile_backend: str | None, compile_mode: str | None,
        dynamic: bool | None, reference_compile: str | None, truth: str | None, local: bool | None,
        control: bool, drill: bool, reference_env: tuple, target_env: tuple, out: str, force: bool,
        steps: int | None, seed: int, mode: str, include: tuple, exclude: tuple,
        full_modules: tuple, phases: str | None, capture_steps: str | None, transfer: str,
        view_audit: bool, simulate: str | None,
        policy_path: str | None, limit: float | None, top: int, html: bool, junit_path: str | None,
        md_path: str | None, long_: bool, every: int, points_every: int | None) -> None:
    """Record truth (optional), reference and target, each in its own process, and compare.

    On a TPU VM: driftcheck run MODEL --reference cpu --target tpu --out run/
    Before buying hardware: driftcheck run MODEL --target cpu --target-dtype bf16 --out run/
    Many steps: driftcheck run MODEL --target tpu --long --steps 3000 --out run/
    """
    from driftcheck.record.run import Sides, record_control, record_sides

    if is_url(out):
        raise DriftcheckError(f"--out {out}: driftcheck run writes a local run directory (its sides run "
                              "in their own processes, the drill-down beside them); record each side "
                              "with driftcheck record --out URL and compare the URLs")
    ref_env, tgt_env = parse_env(reference_env, "--reference-env"), parse_env(target_env, "--target-env")
    if long_ and (compile_backend or reference_compile):  # before --long's own run starts
        raise DriftcheckError("--long runs eager steps; --compile is for a run of a few steps")
    if long_ and mkldnn:
        raise DriftcheckError("--mkldnn sets the target of a run of a few steps; for --long, record "
                              "the target with driftcheck record --long --mkldnn")
    if long_:
        return run_long(obj, model=model, out=Path(out), ref_device=ref_device, tgt_device=tgt_device,
                        reference_dtype=reference_dtype, target_dtype=target_dtype, autocast=autocast,
                        steps=steps, seed=seed, every=every, points_every=points_every, force=force,
                        html=html, simulate=simulate, reference_env=ref_env, target_env=tgt_env)
    if local is None:  # the local replay needs the reference's full tensors
        local = mode == "full" and not fp8

    if limit is not None and not limit > 0:
        raise DriftcheckError(f"--limit must be positive, got {limit}")
    parse_phases(phases)
    parse_ranges(capture_steps)
    sides = Sides(model=model, out=Path(out), reference=ref_device, target=tgt_device,
                  reference_dtype=reference_dtype, target_dtype=target_dtype, autocast=autocast,
                  fp8=fp8, matmul_precision=matmul_precision, emulate=emulate, mkldnn=mkldnn,
                  truth=truth, local=local, control=control,
                  steps=steps, seed=seed, mode=mode, force=force, include=include, exclude=exclude,
                  full_modules=full_modules, phases=phases, capture_steps=capture_steps,
                  transfer=transfer, view_audit=view_audit, simulate=simulate,
                  reference_env=ref_env, target_env=tgt_env, compile=compile_backend,
                  reference_compile=reference_compile, compile_mode=compile_mode, dynamic=dynamic)
    progress = make_progress(obj)
    importing: list[threading.Thread] = []
    with progress as p:
        out_dir, ref_dir, tgt_dir, truth_dir = record_sides(
            sides, debug=obj.debug, say=None if obj.quiet else (lambda m: p.console.print(m, markup=False,
                                                                                            highlight=False)),
            progress=p, on_started=lambda: importing.append(_import_compare_meanwhile()))
        for thread in importing:
            thread.join()
        from driftcheck.compare import compare as do_compare
        from driftcheck.gate.policy import Policy

        say = None if obj.quiet else (lambda m: p.console.print(m, markup=False, highlight=False))
        policy = Policy.load(policy_path, ".")
        task = p.add_task("comparing", total=None)
        report = do_compare(str(ref_dir), str(tgt_dir), policy=policy, limit=limit,
                            truth=str(truth_dir) if truth else None,
                            on_progress=lambda i, n: p.update(task, completed=i, total=n))
        ctl_dir = record_control(sides, ref_dir, debug=obj.debug, say=say, progress=p) \
            if control and not report else None
        if ctl_dir is not None:  # judged again: an entry fails where the control also says so
            report = do_compare(str(ref_dir), str(tgt_dir), policy=policy, limit=limit,
                                truth=str(truth_dir) if truth else None, control=str(ctl_dir),
                                on_progress=lambda i, n: p.update(task, completed=i, total=n))
        if drill and not report and mode == "full":
            from driftcheck.cli.drill import drill_after_run

            drill_after_run(obj, report, ref_dir, tgt_dir, out_dir, limit, p)
        elif drill and not report and not obj.quiet:
            p.console.print(f"drill-down: not run (--mode {mode} keeps no full tensors to rerun the "
                            "module from; rerun with --mode full)", markup=False, highlight=False)
    if not obj.quiet:
        click.echo(f"reports: {out_dir / 'report.json'}" + (f", {out_dir / 'report.html'}" if html else ""))
    finish(obj, report, top, str(out_dir / "report.json"), str(out_dir / "report.html") if html else None,
            junit_path, md_path)


def _import_compare_meanwhile() -> threading.Thread:
    """Import what the compare needs (torch above all) in a thread while the sides record: this
    process waits for them anyway. Only once every side has started: torch here must not load a
    device backend (the sides choose for themselves), and the variable that says so would be
    inherited by a side started after it."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

    def work() -> None:
        for name in ("driftcheck.compare", "driftcheck.report.html"):
            try:
                importlib.import_module(name)
            except Exception:  # the compare's own import says what is wrong, in the main thread
                return

    thread = threading.Thread(target=work, name="driftcheck-import", daemon=True)
    thread.start()
    return thread

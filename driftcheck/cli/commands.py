"""The commands: one small function each, that parses and hands off (help text in docstrings).

torch is imported only inside commands, after the device is known, so a CPU/CUDA reference never
autoloads torch_tpu.
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import click

from driftcheck.cli import (
    drill as _drill,  # noqa: F401  (registers driftcheck drill)
    run as _run,  # noqa: F401  (registers driftcheck run)
)
from driftcheck.cli.app import (
    EXIT_FAIL,
    EXIT_PASS,
    SIMULATED,
    Ctx,
    capture_options,
    cli,
    compile_options,
    everywhere,
    finish,
    make_progress,
    outputs_options,
    parse_env,
    parse_phases,
    parse_ranges,
    precision_options,
    write_outputs,
)
from driftcheck.cli.long import compare_long_cmd, long_options, record_long_cmd
from driftcheck.errors import DriftcheckError
from driftcheck.record.run import COMPLETE, PROGRESS_PREFIX, PROGRESS_VAR, progress_words, wait_for_turn
from driftcheck.store.remote import is_url, read_url


# -- models -------------------------------------------------------------------------------------
@cli.command()
@everywhere
@click.pass_obj
def models(obj: Ctx) -> None:
    """List the built-in models and the Hugging Face families."""
    from driftcheck import models as builtin

    click.echo("built-in models:")
    for name, desc in sorted(builtin.BUILTINS.items()):
        click.echo(f"  {name:14s} {desc}")
    try:
        from driftcheck import hf

        avail = hf.is_available()
        click.echo("Hugging Face families (hf:<family>, needs transformers: pip install transformers)"
                   + ("" if avail else " [transformers not installed]") + ":")
        for name, desc in sorted(hf.FAMILIES.items()):
            click.echo(f"  hf:{name:11s} {desc}")
    except ImportError:
        pass
    click.echo("or your own: path/to/file.py:build, package.module:build (returns driftcheck.Scenario)")


# -- record -------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(), help="Trace directory to create.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda[:N], tpu, mps, xpu or a PrivateUse1 name.")
@click.option("--dtype", default="fp32", show_default=True, help="fp32, bf16, fp16 or fp64.")
@click.option("--steps", type=int, default=None, help="Training steps (default: the scenario's).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the model, inputs and dropout masks.")
@click.option("--replay", type=click.Path(), default=None, help="Start from this reference trace's weights and inputs.")
@click.option("--force", is_flag=True, help="Overwrite an existing trace directory.")
@capture_options
@precision_options("the")
@compile_options(False)
@click.option("--view-audit", is_flag=True, help="Record view/in-place events for the semantic audit.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp", "tp", "fsdp-tp"]), default=None,
              help="Under torchrun: wrap the model in DDP or FSDP (fully_shard), or apply its "
                   "tensor-parallel plan (tp: every rank sees the whole batch), or both on a 2-D "
                   "mesh (fsdp-tp: the plan within groups of --tp-size ranks, FSDP2 across them); "
                   "one trace per rank in OUT/rank-N (see docs/performance.md).")
@click.option("--tp-size", type=int, default=None, metavar="N",
              help="With --parallel fsdp-tp: the ranks of each tensor-parallel group  [default: 2]")
@click.option("--dist-backend", default=None, metavar="NAME",
              help="With --parallel: the process-group backend, any registered with "
                   "torch.distributed  [default: the device's own: nccl for cuda, tpu_dist for "
                   "tpu, gloo for cpu and lazy]")
@click.option("--local", "local", type=click.Path(), default=None,
              help="Also rerun every module on this reference's inputs (a composite's own code with "
                   "its children's results taken from it): compare then separates "
                   "each module's own error from what it inherits  [default: the --replay trace, "
                   "where it holds full tensors]")
@click.option("--no-local", is_flag=True, help="No local replay (not even of the --replay trace).")
@click.option("--env", "env_vars", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for this record (repeatable; e.g. "
                   "TORCH_TPU_DEFER_AND_FUSE=1); recorded in the manifest, and every rerun of this "
                   "side (drill-down) runs under it.")
@click.option("--simulate", type=click.Choice(SIMULATED),
              default=None, help="Run on a simulated faulty backend (to see the audits catch it).")
@functools.partial(long_options, record=True)
@everywhere
@click.pass_obj
def record(obj: Ctx, model: str, out: str, device: str, dtype: str, steps: int | None, seed: int,
           replay: str | None, force: bool, mode: str, include: tuple, exclude: tuple,
           full_modules: tuple, phases: str | None, capture_steps: str | None, transfer: str,
           autocast: str | None, matmul_precision: str | None, emulate: str | None, fp8: str | None,
           mkldnn: str | None, compile_backend: str | None, compile_mode: str | None, dynamic: bool | None,
           view_audit: bool, local: str | None, no_local: bool, env_vars: tuple, simulate: str | None,
           parallel: str | None, tp_size: int | None, dist_backend: str | None, long_: bool, every: int,
           points_every: int | None, perturb: bool, start: int | None) -> None:
    """Record MODEL's training steps into a trace directory.

    MODEL is a built-in name (driftcheck models), hf:<family>, hf:PATH,
    path/to/file.py:build or package.module:build.
    """
    env = parse_env(env_vars, "--env")
    os.environ.update(env)  # before torch (and a backend package) is imported
    from driftcheck.targets import devices

    if long_ and compile_backend:
        raise DriftcheckError("--long records eager steps; --compile is for a record of a few steps")
    urls = [f"{flag} {v}" for flag, v in (("--out", out), ("--replay", replay), ("--local", local))
            if is_url(v)]
    if urls and (long_ or parallel):
        raise DriftcheckError(f"{urls[0]}: a URL holds a plain trace; --long and --parallel record "
                              "to a local directory (copy it to the bucket afterwards)")
    if perturb and not long_:
        raise DriftcheckError("--perturb makes a control of a long run: add --long")
    if long_:
        devices.prepare_environment(devices.parse_device(device)[0])
        if mkldnn is not None:  # this process records nothing else: set for all of it
            from driftcheck.targets import precision

            precision.apply_settings(mkldnn=mkldnn == "on")
        return record_long_cmd(obj, model, out, device, dtype, steps, seed, replay, force, autocast,
                               every, points_every, perturb, simulate)

    dev_type, _ = devices.parse_device(device)
    devices.prepare_environment(dev_type)
    if steps is not None and steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {steps}")
    # With --parallel each rank checks its own OUT/rank-N (the ranks create them concurrently).
    if not parallel and not is_url(out) and Path(out).exists() and not force \
            and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it or choose "
                              "another directory")
    from driftcheck.numerics.dtypes import parse_cli

    parse_cli(dtype)
    torch_device = devices.open_device(device)
    emulate_level = _matmul_settings(emulate, matmul_precision, device, dev_type, torch_device)
    from driftcheck.loader import load_scenario
    from driftcheck.record.config import RecordConfig
    from driftcheck.record.runner import default_local, record as do_record

    if no_local and local:
        raise DriftcheckError("--local and --no-local contradict each other; choose one")
    from driftcheck.record.compilation import settings

    compile_ = settings(compile_backend, compile_mode, dynamic, torch_device)
    scenario = load_scenario(model, seed)
    wait_for_turn()  # driftcheck run starts a replaying side while its reference still records
    if local is None and not no_local:
        local = default_local(replay, mode=mode, parallel=parallel, fp8=fp8, start=start)
    progress = make_progress(obj)
    lines = os.environ.get(PROGRESS_VAR) == "lines"  # driftcheck run reads them from our stderr
    written = [0, 0]

    def on_written(entries: int, nbytes: int) -> None:
        written[:] = [entries, nbytes]

    def on_step(i: int, n: int) -> None:
        p.update(task, completed=i, total=n, written=progress_words(written[0], written[1], time.monotonic() - t0))
        if lines:
            click.echo(f"{PROGRESS_PREFIX}{i}/{n} {written[0]} {written[1]}", err=True)

    with progress as p:
        what = f"recording {model} on {device} {dtype}" + (" + local replay" if local else "")
        task = p.add_task(what, total=steps or scenario.steps, written="")
        t0 = time.monotonic()
        recorded = str(do_record(scenario, RecordConfig(
            out, device=torch_device, dtype=dtype, steps=steps, seed=seed, replay=replay,
            mode=mode, force=force, model_id=model, include=include, exclude=exclude,
            full_modules=full_modules, phases=_set(parse_phases(phases)),
            capture_steps=_set(parse_ranges(capture_steps)), transfer=transfer, autocast=autocast,
            fp8=fp8, view_audit=view_audit, local=local, simulate=simulate, parallel=parallel,
            dist_backend=dist_backend, tp_size=tp_size, on_written=on_written,
            emulate=emulate_level, on_step=on_step, start=start, env=env, compile=compile_,
            mkldnn=None if mkldnn is None else mkldnn == "on")))
    if lines:  # a side waiting for this trace may start now, while this process ends
        click.echo(f"{PROGRESS_PREFIX}{COMPLETE}", err=True)
    _say_recorded(obj, out if is_url(out) else recorded, simulate)


def _matmul_settings(emulate: str | None, matmul_precision: str | None, device: str, dev_type: str,
                     torch_device: Any) -> str | None:
    """--emulate's matmul level (None without it), or --matmul-precision applied to torch."""
    if emulate:
        from driftcheck.targets.emulate import level_of

        if dev_type not in ("cpu", "cuda"):
            raise DriftcheckError(f"--emulate tpu runs on a CPU or CUDA device, not {device!r}; on a TPU "
                                  "record without --emulate")
        return level_of(matmul_precision)
    if matmul_precision == "default":
        matmul_precision = "medium"  # torch_tpu's name for torch's medium
    if matmul_precision:
        from driftcheck.targets import precision

        precision.apply_settings(matmul_precision=matmul_precision)
        if torch_device.type == "cpu" and not precision.cpu_matmul_precision_has_effect(matmul_precision):
            click.echo(f"driftcheck: warning: --matmul-precision {matmul_precision} changes nothing in "
                       "this torch's CPU float32 matmuls (bitwise the same as 'highest'); it takes "
                       "effect on CUDA (TF32) and under torch_tpu", err=True)
    return None


def _say_recorded(obj: Ctx, out: str, simulate: str | None) -> None:
    """What the record holds: its size and findings; a --simulate that changed nothing."""
    if obj.quiet and not simulate:
        return  # nothing to say: the trace is not read back
    from driftcheck.report.common import module_label
    from driftcheck.store import TraceReader

    reader = TraceReader(out)
    if simulate and reader.run.get("simulated_changes") == 0:
        click.echo(f"driftcheck: warning: --simulate {simulate} changed nothing in this model (no op it "
                   "alters ran), so this record checks nothing about that defect", err=True)
    if not obj.quiet:
        click.echo(f"recorded {len(reader.entries)} tensors over {reader.run['steps']} step(s) "
                   f"into {out}")
        seen: dict[tuple[str, str], int] = {}
        for f in reader.manifest.get("findings", []):
            seen[(f["kind"], f["module"])] = seen.get((f["kind"], f["module"]), 0) + 1
        for (kind, module), n in seen.items():
            click.echo(f"finding {kind} in {module_label(module)} ({n} call(s)); driftcheck compare shows it")




@cli.command()
@click.argument("ref", type=click.Path())
@click.argument("target", type=click.Path())
@click.option("--truth", type=click.Path(), default=None,
              help="A float64 record of the same replay: a three-way comparison  [default: none]")
@click.option("--policy", "policy_path", type=click.Path(), default=None,
              help="Policy file (default: driftcheck.toml or [tool.driftcheck] in pyproject.toml).")
@click.option("--limit", type=float, default=None,
              help="Override every ratio limit  [default: the policy's, 3.5 without one]")
@click.option("--top", type=int, default=10, show_default=True, help="Rows of the worst-entries table.")
@click.option("--control", type=click.Path(), default=None,
              help="A control run of the same replay (the reference device at the target's precision, "
                   "as driftcheck run records it): an entry fails only where TARGET is also further from "
                   "REF than the control is. Long runs: the control whose distance from REF draws the band.")
@outputs_options
@everywhere
@click.pass_obj
def compare(obj: Ctx, ref: str, target: str, truth: str | None, policy_path: str | None,
            limit: float | None, top: int, control: str | None, json_path: str | None,
            html_path: str | None, junit_path: str | None, md_path: str | None) -> None:
    """Compare TARGET against REF; exit 0 pass, 1 fail, 2 bad input."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    from driftcheck.store.long import is_long

    if is_long(ref) or is_long(target):
        return compare_long_cmd(obj, ref, target, control, json_path, html_path)
    if limit is not None and not limit > 0:
        raise DriftcheckError(f"--limit must be positive, got {limit}")
    from driftcheck.compare import compare as do_compare
    from driftcheck.compare.ranks import compare_ranks
    from driftcheck.gate.policy import Policy
    from driftcheck.store.layout import is_multirank

    policy = Policy.load(policy_path, search_dir=".")
    if is_multirank(ref) or is_multirank(target):
        # Run directories of a torchrun record (rank-0, rank-1, ...): rank by rank, one verdict.
        if control is not None:
            raise DriftcheckError("--control with multi-rank runs is not supported; compare them "
                                  "without --control")
        report = compare_ranks(ref, target, policy=policy, limit=limit, truth=truth)
    else:
        with make_progress(obj) as p:
            task = p.add_task("comparing", total=None)
            report = do_compare(ref, target, policy=policy, limit=limit, truth=truth, control=control,
                                on_progress=lambda i, n: p.update(task, completed=i, total=n))
    finish(obj, report, top, json_path, html_path, junit_path, md_path)




# -- report -------------------------------------------------------------------------------------
@cli.command()
@click.argument("report_json", type=click.Path())
@outputs_options
@everywhere
@click.pass_obj
def report(obj: Ctx, report_json: str, json_path: str | None, html_path: str | None,
           junit_path: str | None, md_path: str | None) -> None:
    """Render a saved REPORT.json as HTML, JUnit or Markdown; exit code as the verdict."""
    from driftcheck.gate.report import Report

    try:
        raw = read_url(report_json) if is_url(report_json) else Path(report_json).read_bytes()
    except OSError as e:
        raise DriftcheckError(f"cannot read {report_json}: {e.strerror}") from None
    try:
        rep = Report.from_dict(json.loads(raw))
    except (ValueError, TypeError, KeyError) as e:
        why = str(e).removeprefix("not a driftcheck report").strip(" ()")
        raise DriftcheckError(f"{report_json} is not a driftcheck report ({why or type(e).__name__})") from None
    if not any((json_path, html_path, junit_path, md_path)):
        raise DriftcheckError("nothing to do: pass --html FILE, --junit FILE, --summary-md FILE or --json FILE")
    write_outputs(rep, json_path, html_path, junit_path, md_path)
    if not obj.quiet:
        from driftcheck.report.common import conclusion

        click.echo(f"{rep.verdict.upper()} {conclusion(rep)}",
                   err="-" in (json_path, html_path, junit_path, md_path))
    raise SystemExit(EXIT_PASS if rep else EXIT_FAIL)


# -- probe --------------------------------------------------------------------------------------
@cli.command()
@click.option("--device", required=True, help="Device to check against CPU.")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Write results as JSON.")
@everywhere
@click.pass_obj
def probe(obj: Ctx, device: str, json_path: str | None) -> None:
    """Run the view/in-place conformance suite on DEVICE against CPU; exit 1 on any mismatch."""
    from driftcheck.targets import devices

    dev_type, _ = devices.parse_device(device)
    devices.prepare_environment(dev_type)
    devices.open_device(device)
    raise SystemExit(probe_main(device, json_path, console=obj.console()))


def probe_main(device: str, json_path: str | None = None, reference: str = "cpu",
               console: Any = None, fault: Any = None) -> int:
    """Run the suite, print its table, optionally write its JSON; the exit code (0 pass, 1 not).
    ``fault``: a context-manager factory (driftcheck.targets.simulate.*) around the device runs."""
    from rich.console import Console

    from driftcheck.probe import probe_document, run_probe
    from driftcheck.report.probe import render_probe

    results = run_probe(device, reference, fault)
    render_probe(results, console or Console(), device, reference)
    if json_path:
        try:
            Path(json_path).write_text(json.dumps(probe_document(results, device, reference), indent=2),
                                       encoding="utf-8")
        except OSError as err:
            raise DriftcheckError(f"cannot write probe JSON to {json_path}: {err.strerror}; "
                                  "choose a writable path for --json") from err
    return 0 if all(results) else 1


def _set(values: list[Any] | None) -> frozenset[Any] | None:
    """A parsed --phases / --capture-steps list as RecordConfig holds it (None: all)."""
    return None if values is None else frozenset(values)

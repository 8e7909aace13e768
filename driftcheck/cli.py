"""The command line: one small function per command that parses and hands off.

Exit codes everywhere: 0 pass, 1 gate failed, 2 bad input (one line on stderr, no traceback
unless --debug). torch is imported only inside commands, after the device is known, so a
CPU/CUDA reference never autoloads torch_tpu.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from driftcheck import __version__
from driftcheck.errors import DriftcheckError

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class _Ctx:
    def __init__(self, debug: bool, quiet: bool, no_color: bool) -> None:
        self.debug, self.quiet = debug, quiet
        self.no_color = no_color or bool(os.environ.get("NO_COLOR"))

    def console(self, stderr: bool = False) -> Any:
        from rich.console import Console

        console = Console(stderr=stderr, no_color=self.no_color, highlight=False,
                          force_terminal=None if not self.no_color else False, soft_wrap=True)
        if not console.is_terminal:
            console.width = 120  # logs and CI pages: rich's 80-column default folds every key
        return console


def _everywhere(f: Any) -> Any:
    """--quiet, --no-color and --debug are accepted after the command name too."""
    def quiet(ctx: click.Context, _p: Any, value: bool) -> None:
        if value:
            ctx.find_object(_Ctx).quiet = True

    def no_color(ctx: click.Context, _p: Any, value: bool) -> None:
        if value:
            ctx.find_object(_Ctx).no_color = True

    f = click.option("--quiet", "-q", is_flag=True, expose_value=False, callback=quiet,
                     help="Print the verdict line only.")(f)
    f = click.option("--no-color", is_flag=True, expose_value=False, callback=no_color,
                     help="No colors.")(f)
    return click.option("--debug", is_flag=True, expose_value=False,
                        help="Show tracebacks for errors.")(f)


def _ranges(spec: str | None) -> list[int] | None:
    """'0-2,5' -> [0, 1, 2, 5]."""
    if not spec:
        return None
    out: list[int] = []
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise DriftcheckError(f"bad step range {spec!r}: use e.g. 0-2,5") from None
    if any(s < 0 for s in out):
        raise DriftcheckError(f"bad step range {spec!r}: steps are non-negative")
    return out


def _phases(spec: str | None) -> list[str] | None:
    from driftcheck.format import SELECTABLE_PHASES

    if not spec:
        return None
    phases = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in phases if p not in SELECTABLE_PHASES]
    if bad or not phases:
        raise DriftcheckError(f"bad --phases {spec!r}: choose from {','.join(SELECTABLE_PHASES)}")
    return phases


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option("--quiet", "-q", is_flag=True, help="Print the verdict line only.")
@click.option("--no-color", is_flag=True, help="No colors (NO_COLOR is respected too).")
@click.version_option(__version__, prog_name="driftcheck")
@click.pass_context
def cli(ctx: click.Context, debug: bool, quiet: bool, no_color: bool) -> None:
    """driftcheck: does the model compute the same numbers on the new accelerator?

    Record a reference and a target training step, then compare them tensor by tensor against
    a precision-aware noise floor. Exit codes: 0 pass, 1 drift or findings beyond policy,
    2 bad input.
    """
    ctx.obj = _Ctx(debug, quiet, no_color)


# -- models -------------------------------------------------------------------------------------
@cli.command()
@_everywhere
@click.pass_obj
def models(obj: _Ctx) -> None:
    """List the built-in models and the Hugging Face families."""
    from driftcheck import models as builtin

    click.echo("built-in models:")
    for name, desc in sorted(builtin.BUILTINS.items()):
        click.echo(f"  {name:14s} {desc}")
    try:
        from driftcheck import hf

        avail = hf.is_available()
        click.echo("Hugging Face families (hf:<family>, needs transformers: pip install 'driftcheck[hf]')"
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
@click.option("--mode", type=click.Choice(["full", "stats", "auto"]), default="full", show_default=True,
              help="full tensors, statistics + a seeded sample, or stats with full tensors for --full-modules.")
@click.option("--include", multiple=True, help="Only these module globs (repeatable).")
@click.option("--exclude", multiple=True, help="Not these module globs (repeatable).")
@click.option("--full-modules", multiple=True, help="With --mode auto: module globs kept in full.")
@click.option("--phases", default=None, help="Subset of forward,backward,grads,optimizer.")
@click.option("--capture-steps", default=None, help="Steps to capture, e.g. 0-1,3 (all by default).")
@click.option("--transfer", type=click.Choice(["batched", "per-capture"]), default="batched", show_default=True,
              help="One device-to-host copy per step, or one per capture (more sync points).")
@click.option("--autocast", type=click.Choice(["bf16", "fp16"]), default=None, help="Run the forward under torch.autocast.")
@click.option("--matmul-precision", type=click.Choice(["highest", "high", "medium"]), default=None,
              help="torch.set_float32_matmul_precision for this run.")
@click.option("--fp8", type=click.Choice(["e4m3", "e5m2", "hybrid"]), default=None,
              help="Emulated fp8 training of Linear layers (torch._scaled_mm).")
@click.option("--view-audit", is_flag=True, help="Record view/in-place events for the semantic audit.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default=None,
              help="Under torchrun: wrap the model in DDP or FSDP (fully_shard); one trace per rank "
                   "in OUT/rank-N (see docs/performance.md).")
@click.option("--local", "local", type=click.Path(), default=None,
              help="Also rerun every leaf module on this reference's inputs (use with --replay REF): "
                   "compare then separates each module's own error from what it inherits.")
@click.option("--simulate", type=click.Choice(["views-become-copies", "drop-view-writes", "skip-bn-stats"]),
              default=None, help="Run on a simulated faulty backend (to see the audits catch it).")
@_everywhere
@click.pass_obj
def record(obj: _Ctx, model: str, out: str, device: str, dtype: str, steps: int | None, seed: int,
           replay: str | None, force: bool, mode: str, include: tuple, exclude: tuple,
           full_modules: tuple, phases: str | None, capture_steps: str | None, transfer: str,
           autocast: str | None, matmul_precision: str | None, fp8: str | None,
           view_audit: bool, local: str | None, simulate: str | None,
           parallel: str | None) -> None:
    """Record MODEL's training steps into a trace directory.

    MODEL is a built-in name (driftcheck models), hf:<family>, hf:PATH,
    path/to/file.py:build or package.module:build.
    """
    from driftcheck import devices

    dev_type, _ = devices.parse_device(device)
    devices.prepare_environment(dev_type)
    if steps is not None and steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {steps}")
    # With --parallel each rank checks its own OUT/rank-N (the ranks create them concurrently).
    if not parallel and Path(out).exists() and not force \
            and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it or choose "
                              "another directory")
    from driftcheck.runner import parse_dtype

    parse_dtype(dtype)
    torch_device = devices.open_device(device)
    if matmul_precision:
        from driftcheck import precision

        precision.apply_settings(matmul_precision=matmul_precision)
    from driftcheck.loader import load_scenario
    from driftcheck.runner import record as do_record

    scenario = load_scenario(model, seed)
    if parallel:
        from driftcheck import distributed

        if fp8 or local or simulate or view_audit:
            raise DriftcheckError("--parallel records plain DDP/FSDP runs: drop --fp8, --local, "
                                  "--simulate and --view-audit, or record a single process")
        out = str(distributed.record_rank(
            scenario, out, parallel=parallel, device=torch_device, dtype=dtype, steps=steps,
            seed=seed, replay=replay, mode=mode, force=force, model_id=model, include=include,
            exclude=exclude, full_modules=full_modules, phases=_phases(phases),
            capture_steps=_ranges(capture_steps), transfer=transfer, autocast=autocast))
    else:
        progress = _progress(obj)
        with progress as p:
            task = p.add_task(f"recording {model} on {device} {dtype}", total=steps or scenario.steps)
            do_record(scenario, out, device=torch_device, dtype=dtype, steps=steps, seed=seed,
                      replay=replay, mode=mode, force=force, model_id=model, include=include,
                      exclude=exclude, full_modules=full_modules, phases=_phases(phases),
                      capture_steps=_ranges(capture_steps), transfer=transfer, autocast=autocast,
                      fp8=fp8, view_audit=view_audit, local=local, simulate=simulate,
                      on_step=lambda i, n: p.update(task, completed=i, total=n))
    if not obj.quiet:
        from driftcheck.store import TraceReader

        reader = TraceReader(out)
        click.echo(f"recorded {len(reader.entries)} tensors over {reader.run['steps']} step(s) "
                   f"into {out}")
        seen: dict[tuple[str, str], int] = {}
        for f in reader.manifest.get("findings", []):
            seen[(f["kind"], f["module"])] = seen.get((f["kind"], f["module"]), 0) + 1
        for (kind, module), n in seen.items():
            click.echo(f"finding {kind} in {module or '(model)'} ({n} call(s)); driftcheck compare shows it")


def _progress(obj: _Ctx) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=obj.console(stderr=True), transient=True,
                    disable=obj.quiet or not sys.stderr.isatty())


# -- compare ------------------------------------------------------------------------------------
def _outputs_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--json", "json_path", type=click.Path(), default=None, help="Write the JSON report."),
        click.option("--html", "html_path", type=click.Path(), default=None, help="Write the HTML report."),
        click.option("--junit", "junit_path", type=click.Path(), default=None, help="Write JUnit XML."),
        click.option("--summary-md", "md_path", type=click.Path(), default=None, help="Write a Markdown summary."),
    ]):
        f = opt(f)
    return f


def _write_outputs(report: Any, json_path: str | None, html_path: str | None,
                   junit_path: str | None, md_path: str | None) -> None:
    def write(path: str, text: str) -> None:
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            raise DriftcheckError(f"cannot write {path}: {e.strerror}") from None

    if json_path:
        write(json_path, json.dumps(report.to_dict(), indent=1, allow_nan=False, default=str))
    if html_path:
        from driftcheck.render.html import render_html

        write(html_path, render_html(report))
    if junit_path:
        from driftcheck.render.junit import render_junit

        write(junit_path, render_junit(report))
    if md_path:
        from driftcheck.render.markdown import render_markdown

        write(md_path, render_markdown(report))


@cli.command()
@click.argument("ref", type=click.Path())
@click.argument("target", type=click.Path())
@click.option("--truth", type=click.Path(), default=None, help="A float64 record of the same replay.")
@click.option("--policy", "policy_path", type=click.Path(), default=None,
              help="Policy file (default: driftcheck.toml or [tool.driftcheck] in pyproject.toml).")
@click.option("--limit", type=float, default=None, help="Override every ratio limit.")
@click.option("--top", type=int, default=10, show_default=True, help="Rows of the worst-entries table.")
@_outputs_options
@_everywhere
@click.pass_obj
def compare(obj: _Ctx, ref: str, target: str, truth: str | None, policy_path: str | None,
            limit: float | None, top: int, json_path: str | None, html_path: str | None,
            junit_path: str | None, md_path: str | None) -> None:
    """Compare TARGET against REF; exit 0 pass, 1 fail, 2 bad input."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if limit is not None and not limit > 0:
        raise DriftcheckError(f"--limit must be positive, got {limit}")
    from driftcheck.compare import compare as do_compare
    from driftcheck.policy import Policy

    from driftcheck import distributed

    policy = Policy.load(policy_path, search_dir=".")
    if distributed.is_multirank(ref) or distributed.is_multirank(target):
        # Run directories of a torchrun record (rank-0, rank-1, ...): rank by rank, one verdict.
        report = distributed.compare_ranks(ref, target, policy=policy, limit=limit, truth=truth)
    else:
        report = do_compare(ref, target, policy=policy, limit=limit, truth=truth)
    _finish(obj, report, top, json_path, html_path, junit_path, md_path)


def _finish(obj: _Ctx, report: Any, top: int, json_path: str | None, html_path: str | None,
            junit_path: str | None, md_path: str | None) -> None:
    from driftcheck.render.terminal import render_terminal

    _write_outputs(report, json_path, html_path, junit_path, md_path)
    render_terminal(report, obj.console(), top=top, quiet=obj.quiet)
    raise SystemExit(EXIT_PASS if report else EXIT_FAIL)


# -- report -------------------------------------------------------------------------------------
@cli.command()
@click.argument("report_json", type=click.Path())
@_outputs_options
@_everywhere
@click.pass_obj
def report(obj: _Ctx, report_json: str, json_path: str | None, html_path: str | None,
           junit_path: str | None, md_path: str | None) -> None:
    """Render a saved REPORT.json as HTML, JUnit or Markdown; exit code as the verdict."""
    from driftcheck.report import Report

    try:
        raw = Path(report_json).read_bytes()
    except OSError as e:
        raise DriftcheckError(f"cannot read {report_json}: {e.strerror}") from None
    try:
        rep = Report.from_dict(json.loads(raw))
    except (ValueError, TypeError, KeyError) as e:
        raise DriftcheckError(f"{report_json} is not a driftcheck report ({e})") from None
    if not any((json_path, html_path, junit_path, md_path)):
        raise DriftcheckError("nothing to do: pass --html FILE, --junit FILE, --summary-md FILE or --json FILE")
    _write_outputs(rep, json_path, html_path, junit_path, md_path)
    if not obj.quiet:
        click.echo(f"{rep.verdict.upper()} {rep.decided_by}")
    raise SystemExit(EXIT_PASS if rep else EXIT_FAIL)


# -- probe --------------------------------------------------------------------------------------
@cli.command()
@click.option("--device", required=True, help="Device to check against CPU.")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Write results as JSON.")
@_everywhere
@click.pass_obj
def probe(obj: _Ctx, device: str, json_path: str | None) -> None:
    """Run the view/in-place conformance suite on DEVICE against CPU; exit 1 on any mismatch."""
    from driftcheck import devices

    dev_type, _ = devices.parse_device(device)
    devices.prepare_environment(dev_type)
    devices.open_device(device)
    from driftcheck.probe import probe_main

    raise SystemExit(probe_main(device, json_path, console=obj.console()))


# -- run ----------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@click.option("--reference", "ref_device", default="cpu", show_default=True, help="Reference device.")
@click.option("--target", "tgt_device", required=True, help="Target device (tpu, cuda, cpu ...).")
@click.option("--reference-dtype", default="fp32", show_default=True)
@click.option("--target-dtype", default="fp32", show_default=True)
@click.option("--autocast", type=click.Choice(["bf16", "fp16"]), default=None, help="Target forward under autocast.")
@click.option("--fp8", type=click.Choice(["e4m3", "e5m2", "hybrid"]), default=None, help="Target Linear layers in emulated fp8.")
@click.option("--matmul-precision", type=click.Choice(["highest", "high", "medium"]), default=None,
              help="Target's float32 matmul precision.")
@click.option("--truth", type=click.Choice(["fp64"]), default=None, help="Also record a float64 truth on CPU.")
@click.option("--local", "local", is_flag=True,
              help="Rerun every leaf module of the target on the reference's inputs: separates each "
                   "module's own error from what it inherits (needs --mode full).")
@click.option("--out", "-o", required=True, type=click.Path(), help="Run directory (traces and reports).")
@click.option("--steps", type=int, default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mode", type=click.Choice(["full", "stats", "auto"]), default="full", show_default=True)
@click.option("--force", is_flag=True, help="Overwrite an existing run directory.")
@click.option("--policy", "policy_path", type=click.Path(), default=None)
@click.option("--limit", type=float, default=None)
@click.option("--html/--no-html", "html", default=True, show_default=True, help="Write report.html.")
@click.option("--junit", "junit_path", type=click.Path(), default=None)
@click.option("--summary-md", "md_path", type=click.Path(), default=None)
@_everywhere
@click.pass_obj
def run(obj: _Ctx, model: str, ref_device: str, tgt_device: str, reference_dtype: str,
        target_dtype: str, autocast: str | None, fp8: str | None, matmul_precision: str | None,
        truth: str | None, local: bool, out: str, steps: int | None, seed: int, mode: str, force: bool,
        policy_path: str | None, limit: float | None, html: bool, junit_path: str | None,
        md_path: str | None) -> None:
    """Record truth (optional), reference and target, each in its own process, and compare.

    On a TPU VM: driftcheck run MODEL --reference cpu --target tpu --out run/
    Before buying hardware: driftcheck run MODEL --target cpu --target-dtype bf16 --out run/
    """
    from driftcheck import devices

    for spec in (ref_device, tgt_device):
        dev_type, _ = devices.parse_device(spec)
        if dev_type in devices.BUILTIN_TYPES:
            # torch's own devices are checked now, not after minutes of recording the reference;
            # tpu and other backends load (and are checked) in their own record process
            devices.prepare_environment(dev_type)
            devices.open_device(spec)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it")
        known = {"reference", "target", "truth", "report.json", "report.html"}
        if not {c.name for c in out_dir.iterdir()} <= known:
            raise DriftcheckError(f"--out {out} is not a driftcheck run directory; --force only "
                                  "replaces earlier runs: choose another directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--seed", str(seed), "--mode", mode, "--force"] + (["--steps", str(steps)] if steps else [])
    ref_dir, tgt_dir, truth_dir = out_dir / "reference", out_dir / "target", out_dir / "truth"
    _sub(obj, [model, "--out", str(ref_dir), "--device", ref_device, "--dtype", reference_dtype] + common,
         "reference")
    if truth:
        _sub(obj, [model, "--out", str(truth_dir), "--device", "cpu", "--dtype", "fp64",
                   "--replay", str(ref_dir)] + common, "truth")
    tgt_args = [model, "--out", str(tgt_dir), "--device", tgt_device, "--dtype", target_dtype,
                "--replay", str(ref_dir)] + common
    for flag, val in (("--autocast", autocast), ("--fp8", fp8), ("--matmul-precision", matmul_precision)):
        if val:
            tgt_args += [flag, val]
    if local:
        tgt_args += ["--local", str(ref_dir)]
    _sub(obj, tgt_args, "target")
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    from driftcheck.compare import compare as do_compare
    from driftcheck.policy import Policy

    report = do_compare(str(ref_dir), str(tgt_dir), policy=Policy.load(policy_path, "."), limit=limit,
                        truth=str(truth_dir) if truth else None)
    if not obj.quiet:
        click.echo(f"reports: {out_dir / 'report.json'}" + (f", {out_dir / 'report.html'}" if html else ""))
    _finish(obj, report, 10, str(out_dir / "report.json"), str(out_dir / "report.html") if html else None,
            junit_path, md_path)


def _sub(obj: _Ctx, args: list[str], label: str) -> None:
    """Record in a fresh process: backends and precision settings cannot leak between runs."""
    cmd = [sys.executable, "-m", "driftcheck", "--quiet"] + (["--debug"] if obj.debug else []) + ["record"] + args
    env = dict(os.environ)
    if not obj.quiet:
        click.echo(f"recording {label}: driftcheck record {' '.join(args)}", err=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        if obj.debug:
            sys.stderr.write(proc.stderr)
        raise DriftcheckError(f"the {label} record failed: {msg.removeprefix('driftcheck: ')}")


def _one_line(text: str) -> str:
    """Messages quote module names from user code: keep them to one printable line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text.replace("\n", " "))


# -- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps errors to exit codes.

    No full (generation-2) garbage collections while a command runs; the young generations are
    still collected as usual. Importing torch, numba and transformers leaves ~300k long-lived
    objects and every full collection walks them all: ~1 s of a 60-step record or of a compare
    of it (25% and 16%, same peak memory; docs/performance.md)."""
    threshold = gc.get_threshold()
    gc.set_threshold(threshold[0], threshold[1], 1 << 30)
    try:
        _main(argv)
    finally:
        gc.set_threshold(*threshold)  # main() called in-process (tests) leaves it as it was


def _main(argv: list[str] | None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="driftcheck", standalone_mode=False)
    except SystemExit as e:
        raise SystemExit(e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_BAD_INPUT))
    except click.exceptions.Abort:
        click.echo("driftcheck: interrupted", err=True)
        raise SystemExit(130)
    except click.ClickException as e:
        e.show()
        raise SystemExit(EXIT_BAD_INPUT)
    except DriftcheckError as e:
        if debug:
            import traceback

            traceback.print_exc()
        click.echo(f"driftcheck: {_one_line(str(e))}", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("driftcheck: interrupted", err=True)
        raise SystemExit(130)
    except MemoryError:
        click.echo("driftcheck: out of memory", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except OSError as e:  # the disk is full, read-only or gone: the user's environment, not a bug
        if debug:
            raise
        where = f" on {e.filename}" if e.filename else ""
        click.echo(f"driftcheck: I/O error{where}: {e.strerror or e}; check free space, permissions "
                   "and the path", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except Exception as e:  # an unexpected failure: still one line, the traceback with --debug
        if debug:
            raise
        click.echo(f"driftcheck: unexpected {type(e).__name__}: {e} (rerun with --debug for the "
                   "traceback and report it)", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    raise SystemExit(EXIT_PASS)

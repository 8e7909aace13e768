"""The command line's shared parts: the context object, the options every command takes, the
argument parsers, and writing a report's outputs. Exit codes: 0 pass, 1 gate failed, 2 bad input.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from driftcheck.errors import DriftcheckError
from driftcheck.gate.jsonform import dumps
from driftcheck.store.remote import is_url, write_url
from driftcheck.version import __version__

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class Ctx:
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


def everywhere(f: Any) -> Any:
    """--quiet, --no-color and --debug are accepted after the command name too."""
    def quiet(ctx: click.Context, _p: Any, value: bool) -> None:
        obj = ctx.find_object(Ctx)  # made by the group: cli()
        if value and obj is not None:
            obj.quiet = True

    def no_color(ctx: click.Context, _p: Any, value: bool) -> None:
        obj = ctx.find_object(Ctx)
        if value and obj is not None:
            obj.no_color = True

    f = click.option("--quiet", "-q", is_flag=True, expose_value=False, callback=quiet,
                     help="Less output: errors, warnings and a verdict line only.")(f)
    f = click.option("--no-color", is_flag=True, expose_value=False, callback=no_color,
                     help="No colors.")(f)
    return click.option("--debug", is_flag=True, expose_value=False,
                        help="Show tracebacks for errors.")(f)


def parse_ranges(spec: str | None) -> list[int] | None:
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


def parse_phases(spec: str | None) -> list[str] | None:
    from driftcheck.store.format import SELECTABLE_PHASES

    if not spec:
        return None
    phases = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in phases if p not in SELECTABLE_PHASES]
    if bad or not phases:
        raise DriftcheckError(f"bad --phases {spec!r}: choose from {','.join(SELECTABLE_PHASES)}")
    return phases


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option("--quiet", "-q", is_flag=True, help="Less output: errors, warnings and a verdict line only.")
@click.option("--no-color", is_flag=True, help="No colors (NO_COLOR is respected too).")
@click.version_option(__version__, prog_name="driftcheck")
@click.pass_context
def cli(ctx: click.Context, debug: bool, quiet: bool, no_color: bool) -> None:
    """driftcheck: does the model compute the same numbers on the new accelerator?

    Record a reference and a target training step, then compare them tensor by tensor against
    a precision-aware noise floor. Exit codes: 0 pass, 1 drift or findings beyond policy,
    2 bad input.
    """
    ctx.obj = Ctx(debug, quiet, no_color)


def make_progress(obj: Ctx) -> Any:
    """Bars on a terminal's stderr (steps done of steps, what the trace holds, MB/s); nothing
    under --quiet or where stderr is a file or a CI log (no carriage returns there)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Written(TextColumn):  # a task's "written" field where it has one (record's sides)
        def render(self, task: Any) -> Text:
            return Text(str(task.fields.get("written", "")))

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    Written(""), TimeElapsedColumn(), console=obj.console(stderr=True), transient=True,
                    disable=obj.quiet or not sys.stderr.isatty())


# -- options record and run share ---------------------------------------------------------------
SIMULATED = ["views-become-copies", "drop-view-writes", "skip-bn-stats",  # simulate.py's backends
             "gelu-tanh", "attention-scale", "sum-bf16", "matmul-bf16", "silu-backward",
             "scaled-mm-wrong-axis"]


def _apply(f: Any, options: list[Any]) -> Any:
    for opt in reversed(options):
        f = opt(f)
    return f


def capture_options(f: Any) -> Any:
    """What a record captures (both sides of ``run`` capture alike, so their entries line up)."""
    return _apply(f, [
        click.option("--mode", type=click.Choice(["full", "stats", "auto"]), default="full", show_default=True,
                     help="full tensors, statistics + a seeded sample, or stats with full tensors for "
                          "--full-modules."),
        click.option("--include", multiple=True, help="Only these module globs (repeatable)  [default: all]"),
        click.option("--exclude", multiple=True, help="Not these module globs (repeatable)  [default: none]"),
        click.option("--full-modules", multiple=True, help="With --mode auto: module globs kept in full (repeatable)."),
        click.option("--phases", default=None, help="Subset of forward,backward,grads,optimizer  [default: all]"),
        click.option("--capture-steps", default=None, help="Steps to capture, e.g. 0-1,3  [default: all]"),
        click.option("--transfer", type=click.Choice(["batched", "per-capture"]), default="batched",
                     show_default=True,
                     help="One device-to-host copy per step, or one per capture (more sync points)."),
    ])


def precision_options(whose: str) -> Any:
    """How a run computes: autocast, fp8, float32 matmul precision, TPU emulation and oneDNN. ``whose``
    names the run they apply to in the help ("the", "the target's")."""
    def decorate(f: Any) -> Any:
        return _apply(f, [
            click.option("--autocast", type=click.Choice(["bf16", "fp16"]), default=None,
                         help=f"Run {whose} forward under torch.autocast  [default: off]"),
            click.option("--fp8", type=click.Choice(["e4m3", "e5m2", "hybrid"]), default=None,
                         help=f"Emulated fp8 training of {whose} Linear layers (torch._scaled_mm)  [default: off]"),
            click.option("--matmul-precision", type=click.Choice(["highest", "high", "medium", "default"]),
                         default=None,
                         help=f"{whose.capitalize()} float32 matmul precision; with --emulate tpu the TPU level "
                              "(default = torch's medium, high, highest)  [default: torch's 'highest', or "
                              "'default' when emulating]"),
            click.option("--emulate", type=click.Choice(["tpu"]), default=None,
                         help=f"Compute {whose} matmuls and convolutions as a TPU does at --matmul-precision "
                              "(bf16 passes), on a CPU or CUDA device  [default: off]"),
            click.option("--mkldnn", type=click.Choice(["on", "off"]), default=None,
                         help=f"oneDNN's CPU kernels for {whose} run (off: ATen's own convolutions and "
                              "bf16 matmuls, a real other-kernels control; recorded as "
                              "precision.cpu_kernels.mkldnn)  [default: torch's, on]"),
        ])
    return decorate


def compile_options(both_sides: bool) -> Any:
    """``torch.compile`` of a record (``both_sides``: ``run``'s target, and its reference by
    ``--reference-compile``)."""
    whose = "the target's" if both_sides else "the"
    opts = [
        click.option("--compile", "compile_backend", is_flag=False, flag_value="inductor", default=None,
                     metavar="[BACKEND]",
                     help=f"Run {whose} model under torch.compile with this backend (inductor when "
                          "given alone; aot_eager, tpu with torch_tpu, any registered one)  [default: eager]"),
        click.option("--compile-mode", default=None,
                     help="inductor's mode: default, reduce-overhead, max-autotune, "
                          "max-autotune-no-cudagraphs  [default: torch's]"),
        click.option("--dynamic/--no-dynamic", "dynamic", default=None,
                     help="torch.compile's dynamic shapes  [default: torch's (automatic)]"),
    ]
    if both_sides:
        opts.append(click.option(
            "--reference-compile", "reference_compile", is_flag=False, flag_value="inductor",
            default=None, metavar="[BACKEND]",
            help="Run the reference under torch.compile too (same --compile-mode/--dynamic)  "
                 "[default: eager]"))
    return lambda f: _apply(f, opts)


# -- compare ------------------------------------------------------------------------------------
def outputs_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--json", "json_path", type=click.Path(), default=None, help="Write the JSON report."),
        click.option("--html", "html_path", type=click.Path(), default=None, help="Write the HTML report."),
        click.option("--junit", "junit_path", type=click.Path(), default=None, help="Write JUnit XML."),
        click.option("--summary-md", "md_path", type=click.Path(), default=None, help="Write a Markdown summary."),
    ]):
        f = opt(f)
    return f


def write_outputs(report: Any, json_path: str | None, html_path: str | None,
                   junit_path: str | None, md_path: str | None) -> None:
    """Write the report's outputs; a path ``-`` is standard output (one of them at most)."""
    if [json_path, html_path, junit_path, md_path].count("-") > 1:
        raise DriftcheckError("only one of --json, --html, --junit and --summary-md can be - "
                              "(standard output); give the others file names")

    def write(path: str, text: str) -> None:
        if path == "-":
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
            return
        if is_url(path):
            write_url(path, text.encode())
            return
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            raise DriftcheckError(f"cannot write {path}: {e.strerror}") from None

    if json_path:
        write(json_path, dumps(report.to_dict()))  # json.dumps(..., indent=1, allow_nan=False, default=str)
    if html_path:
        from driftcheck.report.html import render_html

        write(html_path, render_html(report))
    if junit_path:
        from driftcheck.report.junit import render_junit

        write(junit_path, render_junit(report))
    if md_path:
        from driftcheck.report.markdown import render_markdown

        write(md_path, render_markdown(report))


def finish(obj: Ctx, report: Any, top: int, json_path: str | None, html_path: str | None,
            junit_path: str | None, md_path: str | None) -> None:
    from driftcheck.report.terminal import render_terminal

    write_outputs(report, json_path, html_path, junit_path, md_path)
    # an output written to standard output keeps it to itself: the terminal view goes to stderr
    stdout_taken = "-" in (json_path, html_path, junit_path, md_path)
    render_terminal(report, obj.console(stderr=stdout_taken), top=top, quiet=obj.quiet)
    raise SystemExit(EXIT_PASS if report else EXIT_FAIL)


def one_line(text: str) -> str:
    """Messages quote module names from user code: keep them to one printable line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text.replace("\n", " "))


_ENV_NAME = __import__("re").compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(values: tuple[str, ...] | list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` options as a dict; anything else is refused in one line."""
    env: dict[str, str] = {}
    for v in values:
        name, eq, value = v.partition("=")
        if not eq or not _ENV_NAME.match(name):
            raise DriftcheckError(f"{flag} {v!r}: expected NAME=VALUE with NAME a variable name "
                                  "(e.g. TORCH_TPU_DEFER_AND_FUSE=1)")
        env[name] = value
    return env

"""Terminal output of a Report: one-line verdict, the first divergence, the worst entries, findings."""
from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from driftcheck.gate.report import Report
from driftcheck.report.common import conclusion, module_label, root_cause_lines

# Warnings of one kind printed module by module before the rest are folded into one line (a
# compiled target's capture gaps: one per Dropout of a model); errors are all printed.
WARNINGS_PER_KIND = 3


def _ratio(r: float | None) -> str:
    if r is None:
        return "-"
    if math.isinf(r):
        return "inf"
    return f"{r:.3g}"


def render_terminal(report: Report, console: Console, *, top: int = 10, quiet: bool = False) -> None:
    """Print the report. ``quiet``: the verdict line only."""
    ok = report.verdict == "pass"
    style = "bold green" if ok else "bold red"
    console.print(f"[{style}]{report.verdict.upper()}[/] {escape(conclusion(report))}", highlight=False,
                  markup=True, soft_wrap=True)
    if quiet:
        return
    rows = root_cause_lines(report.root_cause)
    if rows:
        console.print("[bold red]root cause[/] (drill-down):", highlight=False)
        for label, text in rows:
            console.print(f"  {label:12s} {escape(text)}", highlight=False, soft_wrap=True)
    if report.decided_by:
        console.print(f"[dim]decided by: {escape(report.decided_by)}[/]", highlight=False, soft_wrap=True)
    ref, tgt = report.reference, report.target
    console.print(f"reference: {ref.get('model_id')} on {ref.get('device')} {ref.get('dtype')}   "
                  f"target: {tgt.get('device')} {tgt.get('dtype')}"
                  + (f" fp8={tgt.get('fp8')}" if tgt.get("fp8") else ""), highlight=False, markup=False)
    fd = report.first_divergence
    if fd:
        number = ("NaN/Inf the reference lacks" if fd.get("status") == "nonfinite" else
                  "a finding that fails the gate" if fd.get("status") == "finding" else
                  f"local ratio {_ratio(fd['local_ratio'])}, propagated {_ratio(fd.get('ratio'))}"
                  if fd.get("local_ratio") is not None else f"ratio {_ratio(fd.get('ratio'))}")
        console.print(f"first divergence: [bold]{escape(module_label(fd['module']))}[/] step "
                      f"{fd['step']} {fd['phase']} {escape(fd['slot'])} ({number}): "
                      f"{escape(fd.get('where', ''))}", highlight=False)
    elif not ok:
        console.print("first divergence: none (the gate failed on findings)", highlight=False)
    table = Table(title=f"worst {top} entries (ratio = error / noise floor, limit {report.limit:g})",
                  title_justify="left")
    for col in ("step", "phase", "module", "slot", "ratio", "rel_l2", "max_abs", "status"):
        table.add_column(col, justify="left" if col in ("phase", "module", "slot") else "right",
                         overflow="fold")
    for e in report.worst(top):
        m = e.metrics
        table.add_row(str(e.step), e.phase, escape(module_label(e.module)), escape(e.slot),
                      _ratio(e.ratio), _g(m.get("rel_l2")), _g(m.get("max_abs")), e.status)
    console.print(table)
    groups: dict[tuple[str, str, str], list] = {}
    for f in report.findings:  # one line per kind and module; the steps listed
        groups.setdefault((f.kind, f.module, f.severity), []).append(f)
    shown: dict[str, int] = {}
    folded: dict[str, list[str]] = {}
    for (kind, module, severity), fs in groups.items():
        if severity != "error":  # only warnings are folded, and only warnings count
            if shown.get(kind, 0) >= WARNINGS_PER_KIND:
                folded.setdefault(kind, []).append(module_label(module))  # the JSON/HTML list all
                continue
            shown[kind] = shown.get(kind, 0) + 1
        color = "red" if severity == "error" else "yellow"
        steps = sorted({f.step for f in fs if f.step is not None})
        msg = fs[0].message
        if module and msg.startswith(module + ": "):
            msg = msg[len(module) + 2:]
        where = f" step{'s' if len(steps) > 1 else ''} {','.join(map(str, steps))}" if steps else ""
        # run-level findings (precision settings) belong to no module
        who = f" {escape(module_label(module))}" if module or steps else ""
        console.print(f"[{color}]{escape(kind)}[/]{who}{where}: {escape(msg)}",
                      highlight=False, soft_wrap=True)
    for kind, modules in folded.items():
        console.print(f"[yellow]{escape(kind)}[/]: the same warning at {len(modules)} more "
                      f"module(s) ({escape(', '.join(modules[:3]))}{', ...' if len(modules) > 3 else ''}); "
                      "--json and the HTML report list each", highlight=False, soft_wrap=True)
    for w in report.warnings:
        console.print(f"[yellow]warning[/] {escape(w)}", highlight=False)


def _g(x: object) -> str:
    if isinstance(x, (int, float)):
        return "inf" if isinstance(x, float) and math.isinf(x) else f"{x:.3g}"
    return "-" if x is None else str(x)

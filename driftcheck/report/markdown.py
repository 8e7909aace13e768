"""A short Markdown summary for a CI job page (GitHub ``$GITHUB_STEP_SUMMARY``, GitLab, ...).

Verdict, the rule that decided it, the first divergence, the ten worst entries and the findings.
Every value from the report is escaped: job summaries render inline HTML and Markdown.
"""
from __future__ import annotations

import html
import re

from driftcheck.gate.report import Report
from driftcheck.report.common import (
    conclusion,
    entry_limit,
    explain_kind,
    finding_state,
    fmt,
    module_label,
    root_cause_lines,
    worst,
)

WORST = 10
# Values only ever appear mid-line, so line-start syntax (#, -, 1.) cannot trigger; these can.
_SPECIAL = re.compile(r"([\\`*_\[\]|~$])")
_ICON = {"fails gate": "❌", "warning": "⚠️", "ignored": "➖"}


def render_markdown(report: Report) -> str:
    """Render a compact Markdown summary of ``report``.

    Example:
        >>> open(os.environ["GITHUB_STEP_SUMMARY"], "a").write(render_markdown(report))
    """
    ref, tgt = report.reference, report.target
    model = tgt.get("model") or ref.get("model")
    title = "✅ PASS" if report else "❌ FAIL"
    lines = [f"## driftcheck: {title}" + (f" · {md(model)}" if model else ""), ""]
    lines.append(f"**{md(conclusion(report))}**")
    lines.append("")
    rows = root_cause_lines(report.root_cause)
    if rows:
        lines.append("**Root cause (drill-down):**")
        lines.append("")
        lines += [f"- {md(label)}: {md(text)}" for label, text in rows]
        lines.append("")
    lines.append(f"Decided by: {md(report.decided_by or 'no rule recorded')}")
    lines.append("")
    counts: dict[str, int] = {}
    for e in report.entries:
        counts[e.status] = counts.get(e.status, 0) + 1
    lines.append(f"Reference {md(_run(ref))} vs target {md(_run(tgt))} · {len(report.entries)} entries ("
                 + ", ".join(f"{n} {md(s)}" for s, n in sorted(counts.items())) + ")")
    for w in report.warnings:
        lines += ["", f"> ⚠️ {md(w)}"]
    lines.append("")
    fd = report.first_divergence
    if fd:
        local = f" (local {md(fmt(fd['local_ratio']))})" if fd.get("local_ratio") is not None else ""
        lines.append(f"**First divergence:** {md(module_label(fd.get('module')))} · {md(fd.get('phase', ''))} · "
                     f"step {md(fd.get('step'))}" + (f" · {md(fd['slot'])}" if fd.get("slot") else "")
                     + (f" — {md(fd.get('where', ''))}" if fd.get("status") == "finding"
                        else f" — ratio {md(fmt(fd.get('ratio')))}{local}"))
    else:
        lines.append("**First divergence:** none")
    top = worst(report.entries, WORST)
    if top:
        lines += ["", f"### Worst {len(top)} entries", "",
                  "| module | phase | step | slot | status | ratio | limit | max abs | rel L2 | rule |",
                  "|---|---|---:|---|---|---:|---:|---:|---:|---|"]
        for e in top:
            limit, rule = entry_limit(e)
            cells = [module_label(e.module), e.phase, e.step, e.slot, e.status, fmt(e.ratio), fmt(limit),
                     fmt(e.metrics.get("max_abs")), fmt(e.metrics.get("rel_l2")), rule]
            lines.append("| " + " | ".join(md(c) for c in cells) + " |")
    if report.findings:
        states = [(f, finding_state(f)) for f in report.findings]
        failing = sum(1 for _, s in states if s == "fails gate")
        lines += ["", f"### Findings ({len(states)}, {failing} fail the gate)", ""]
        for f, state in sorted(states, key=lambda fs: list(_ICON).index(fs[1])):
            where = module_label(f.module)
            step = f" step {md(f.step)}" if f.step is not None else ""
            lines.append(f"- {_ICON[state]} **{md(f.kind)}** ({md(explain_kind(f.kind)[0])}) at {md(where)}"
                         f"{step}: {md(f.message)}")
    lines += ["", "_Full report: the HTML artifact of this job._", ""]
    return "\n".join(lines)


def md(value: object) -> str:
    """Text safe in Markdown and the HTML it may contain: one line, markup characters escaped."""
    text = " ".join(str(value).split())
    return _SPECIAL.sub(r"\\\1", html.escape(text, quote=False))


def _run(meta: dict) -> str:
    parts = [str(meta.get("device", "?")), str(meta.get("dtype", ""))]
    precision = meta.get("precision")
    if isinstance(precision, dict) and precision.get("matmul"):
        parts.append(f"matmul {precision['matmul']}")
    return " ".join(p for p in parts if p)

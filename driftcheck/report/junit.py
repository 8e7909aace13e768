"""JUnit XML for CI test tabs: one testcase per module, one per finding, one for the verdict.

A module's testcase groups all its entries and fails when any of them drifts, is non-finite or
misaligned; the failure message names the worst entry, its ratio, limit, rule and metrics. A
module whose entries are all ignored by the policy is skipped with the ignore reason.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from driftcheck.gate.report import Entry, Report
from driftcheck.report.common import (
    FAILING,
    as_float,
    conclusion,
    entry_limit,
    execution_order,
    finding_state,
    fmt,
    module_label,
)

MAX_LINES = 50  # failing entries listed per module testcase; the HTML report has them all
# XML 1.0 forbids most control characters even when escaped.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def render_junit(report: Report) -> str:
    """Render ``report`` as a JUnit XML document (``<testsuites>`` with one ``<testsuite>``).

    Example:
        >>> pathlib.Path("driftcheck.xml").write_text(render_junit(report))
    """
    suite = ET.Element("testsuite", name="driftcheck")
    props = ET.SubElement(suite, "properties")
    for name, value in _properties(report).items():
        ET.SubElement(props, "property", name=_x(name), value=_x(value))

    modules: dict[str, list[Entry]] = {}
    for e in execution_order(report.entries):
        modules.setdefault(e.module, []).append(e)
    for module, entries in modules.items():
        _module_case(suite, module, entries)
    for f in report.findings:
        case = _case(suite, "driftcheck.finding", f"{f.kind} @ {module_label(f.module)}"
                     + (f" step {f.step}" if f.step is not None else ""))
        state = finding_state(f)
        text = "\n".join([f.message] + [f"{k}: {v}" for k, v in f.details.items()])
        if state == "fails gate":
            ET.SubElement(case, "failure", message=_x(f.message), type=_x(f.kind)).text = _x(text)
        elif state == "ignored":
            reason = (f.details or {}).get("ignored")
            ET.SubElement(case, "skipped", message=_x(f"ignored: {reason}"))
        else:
            ET.SubElement(case, "system-out").text = _x(f"warning: {text}")
    verdict = _case(suite, "driftcheck.verdict", "verdict")
    if not report:
        ET.SubElement(verdict, "failure", message=_x(conclusion(report)), type="verdict").text = \
            _x(report.decided_by or report.verdict)

    cases = suite.findall("testcase")
    counts = {"tests": len(cases), "failures": sum(1 for c in cases if c.find("failure") is not None),
              "errors": 0, "skipped": sum(1 for c in cases if c.find("skipped") is not None)}
    for key, n in counts.items():
        suite.set(key, str(n))
    suite.set("time", "0")
    root = ET.Element("testsuites", {"name": "driftcheck", **{k: str(v) for k, v in counts.items()}, "time": "0"})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _module_case(suite: ET.Element, module: str, entries: list[Entry]) -> None:
    case = _case(suite, "driftcheck.module", module_label(module))
    failing = [e for e in entries if e.status in FAILING]
    if failing:
        worst = max(failing, key=_severity)
        limit, rule = entry_limit(worst)
        message = (f"{len(failing)} of {len(entries)} entries fail; worst {worst.phase} step {worst.step} "
                   f"{worst.slot}: {_why(worst, limit)} ({rule}); {_metrics(worst)}")
        lines = [_line(e) for e in failing[:MAX_LINES]]
        if len(failing) > MAX_LINES:
            lines.append(f"... and {len(failing) - MAX_LINES} more (see the HTML report)")
        ET.SubElement(case, "failure", message=_x(message), type=worst.status).text = _x("\n".join(lines))
    elif all(e.status == "ignored" for e in entries):
        reasons = sorted({e.rule or "policy ignore rule" for e in entries})
        ET.SubElement(case, "skipped", message=_x("ignored: " + "; ".join(reasons)))
    else:
        judged = [e for e in entries if e.ratio is not None and e.status != "ignored"]
        if judged:
            worst = max(judged, key=_severity)
            ET.SubElement(case, "system-out").text = _x(
                f"{len(entries)} entries within limits; worst {worst.phase} step {worst.step} {worst.slot} "
                f"ratio {fmt(worst.ratio)} / limit {fmt(entry_limit(worst)[0])}")


def _severity(e: Entry) -> tuple[int, float]:
    # Non-finite and misaligned entries outrank any finite ratio.
    ratio = as_float(e.ratio)
    rank = {"nonfinite": 2, "misaligned": 1}.get(e.status, 0)
    return rank, (ratio if ratio is not None and ratio == ratio else -1.0)


def _why(e: Entry, limit: float) -> str:
    if e.status == "nonfinite":
        return f"NaN/Inf in the target only, ratio {fmt(e.ratio)}, limit {fmt(limit)}"
    if e.status == "misaligned":
        return "misaligned (missing on one side, or shape/dtype differ)"
    return f"drift, ratio {fmt(e.ratio)} > limit {fmt(limit)}"


def _metrics(e: Entry) -> str:
    keys = ("max_abs", "rel_l2", "max_ulp", "cosine", "nan_tgt", "inf_tgt")
    return ", ".join(f"{k} {fmt(e.metrics[k])}" for k in keys if k in e.metrics)


def _line(e: Entry) -> str:
    limit, rule = entry_limit(e)
    local = f", local ratio {fmt(e.local_ratio)}" if e.local_ratio is not None else ""
    return f"{e.phase} step {e.step} call {e.call} {e.slot}: {_why(e, limit)}{local} ({rule}); {_metrics(e)}"


def _case(suite: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=classname, name=_x(name), time="0")


def _properties(report: Report) -> dict[str, str]:
    props = {"verdict": report.verdict, "decided_by": report.decided_by, "limit": fmt(report.limit)}
    for side in ("reference", "target"):
        meta: dict[str, Any] = getattr(report, side)
        for key in ("device", "dtype", "model"):
            if meta.get(key) is not None:
                props[f"{side}.{key}"] = str(meta[key])
    fd = report.first_divergence
    if fd:
        props["first_divergence"] = f"{module_label(fd.get('module'))} {fd.get('phase', '')} step {fd.get('step')}"
    return props


def _x(text: Any) -> str:
    return _NOT_XML.sub("\ufffd", str(text))

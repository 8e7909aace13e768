"""The HTML report: one self-contained file (inline CSS, JS and SVG) that opens from disk.

Built with jinja2 (autoescape on) from ``driftcheck/templates/report.html.j2``. The interactive
charts (the drift ratio along execution order, the module x (step, phase) map) are drawn in the
page by plotly.js (a partial bundle: core, scatter, heatmap; ``page_data.py``), inlined, from the
same compact JSON blocks as the entry table; their tooltips are the page's own, filled with
``textContent``, so a module name is never markup. The error histograms are static SVG drawn by
``report/histogram.py`` (text as text).
The JSON travels inside ``<script type="application/json">`` blocks (``</`` escaped); only a page
of table rows is in the DOM at a time, and the chart draws at most ``MAX_CHART_POINTS`` (the worst
of each bin of the visible range, redrawn on zoom): the page stays fast with 50k entries.
"""
from __future__ import annotations

import re
from typing import Any

import jinja2
import markupsafe

from driftcheck.gate.report import Entry, Report
from driftcheck.report.common import (
    as_float,
    conclusion,
    entry_limit,
    execution_order,
    explain_kind,
    finding_state,
    fmt,
    module_label,
    root_cause_lines,
    worst,
)
from driftcheck.report.histogram import histogram_svg
from driftcheck.report.page_data import Strings, compact_json, module_map, plotly_js, script_json, table_data
from driftcheck.store.format import PHASES

__all__ = ["environment", "plotly_js", "render_html", "script_json"]

# Okabe-Ito palette: tells the phases apart for colour-blind readers too.
PHASE_COLORS = {"params": "#999999", "forward": "#0072B2", "loss": "#000000", "backward": "#E69F00",
                "grads": "#009E73", "optimizer": "#CC79A7"}
MAX_CHART_POINTS = 3000  # the chart draws the worst entry of each bin of the visible range
DETAIL_COUNT = 6  # worst entries with a detail section (plus the first divergence)
TABLE_COLUMNS = [  # (id, title, kind, folded): kind "num" sorts numerically; folded columns
    # show with "all columns"
    ("i", "#", "num", False), ("step", "step", "num", False), ("phase", "phase", "str", False),
    ("module", "module", "str", False), ("slot", "slot", "str", False), ("status", "status", "str", False),
    ("ratio", "ratio", "num", False), ("local", "local", "num", False), ("limit", "limit", "num", False),
    ("floor", "floor", "num", False), ("max_abs", "max abs", "num", False), ("rel_l2", "rel L2", "num", False),
    ("call", "call", "num", True), ("max_ulp", "max ULP", "num", True), ("cosine", "cosine", "num", True),
    ("rule", "rule", "str", True),
]
KEY_METRICS = ("max_abs", "rel_l2", "rms", "cosine")  # shown in a detail; the rest folded
META_FIRST = ("model", "device", "dtype", "precision", "seed", "steps", "versions", "host")
METRIC_ROWS = ("max_abs", "mean_abs", "rms", "rel_l2", "cosine", "max_ulp", "frac_outside", "sqnr_db",
               "ref_rms", "ref_absmax", "nan_ref", "nan_tgt", "inf_ref", "inf_tgt")
STAT_ROWS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf")


def render_html(report: Report) -> str:
    """Render ``report`` as one self-contained HTML page (no request to any other host).

    Example:
        >>> pathlib.Path("report.html").write_text(render_html(report))
    """
    ordered = execution_order(report.entries)
    limits = [entry_limit(e) for e in ordered]
    by_key = {e.key: e for e in ordered}
    first = report.first_divergence or None
    first_entry = by_key.get(first["key"]) if first and "key" in first else None
    strings = Strings()
    table = table_data(ordered, limits, first_entry, [c[0] for c in TABLE_COLUMNS], strings)
    map_json = compact_json(module_map(ordered, strings))
    table.update(strings=strings.table(), colors=PHASE_COLORS, max_points=MAX_CHART_POINTS)
    table_json = compact_json(table)
    env = environment()
    context = {
        "report": report,
        "passed": bool(report),
        "conclusion": conclusion(report),
        "model": report.target.get("model") or report.reference.get("model"),
        "counts": _status_counts(report.entries),
        "findings": _findings(report),
        "meta_rows": _meta_rows(report),
        "meta_always": META_ALWAYS,
        "first": first,
        "first_entry": first_entry,
        "first_extra": _first_extra(first),
        "root_cause": root_cause_lines(report.root_cause),
        "chart_points": sum(1 for e in ordered if e.ratio is not None),
        "table_json": table_json,
        "map_json": map_json,
        "plotly_js": plotly_js(),
        "columns": TABLE_COLUMNS,
        "statuses": sorted({e.status for e in report.entries}),
        "phases": [p for p in PHASES if any(e.phase == p for e in ordered)],
        "details": _details(report, first_entry),
        "policy_source": (report.policy or {}).get("source"),
        "css": _resource("report.css"),
        "js": _resource("report.js"),
    }
    return env.get_template("report.html.j2").render(**context)


def _first_extra(first: dict[str, Any] | None) -> dict[str, Any]:
    """The first divergence's other fields, for people: the drift under a finding in words."""
    out: dict[str, Any] = {}
    for k, v in (first or {}).items():
        if k in ("key", "module", "phase", "step", "slot", "ratio", "local_ratio", "call"):
            continue
        if k == "blame_module":
            if v != (first or {}).get("module"):
                out["made by"] = module_label(v)
            continue
        if isinstance(v, dict):  # the drift entry a finding explains
            v = (f"{module_label(v.get('module'))} {v.get('phase')} step {v.get('step')} {v.get('slot')}: "
                 f"ratio {fmt(as_float(v.get('ratio')))}")
        out[k] = v
    return out


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("driftcheck", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt
    env.filters["label"] = module_label
    env.filters["wbr"] = _wbr
    return env


def _wbr(text: Any) -> markupsafe.Markup:
    """A dotted module path that wraps after its dots and underscores, never mid-word."""
    parts = re.split(r"(?<=[._/])", module_label(text) if isinstance(text, str) or text is None else str(text))
    return markupsafe.Markup("<wbr>").join(markupsafe.escape(p) for p in parts)


def _resource(name: str) -> str:
    loader = jinja2.PackageLoader("driftcheck", "templates")
    return loader.get_source(jinja2.Environment(), name)[0]


def _status_counts(entries: list[Entry]) -> list[tuple[str, int]]:
    order = ["ok", "drift", "nonfinite", "misaligned", "ignored"]
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.status] = counts.get(e.status, 0) + 1
    return [(s, counts[s]) for s in sorted(counts, key=lambda s: order.index(s) if s in order else len(order))]


def _findings(report: Report) -> list[dict[str, Any]]:
    """Findings grouped by kind and gate state: one card per group, its modules listed with
    their steps, the first finding's message (without its module prefix) and details."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for f in report.findings:
        groups.setdefault((f.kind, finding_state(f)), []).append(f)
    out = []
    for (kind, state), fs in groups.items():
        title, meaning, todo = explain_kind(kind)
        where: dict[str, set[int]] = {}
        for f in fs:
            where.setdefault(f.module, set()).update({f.step} if f.step is not None else set())
        first = fs[0]
        message = first.message
        if first.module and message.startswith(first.module + ": "):
            message = message[len(first.module) + 2:]
        settings = (first.details or {}).get("settings") if kind == "precision.settings_differ" else None
        if settings:
            todo = _precision_todo(settings)
            message = message.split(": ", 1)[0] + "."
        out.append({"kind": kind, "title": title, "meaning": meaning, "todo": todo, "state": state,
                    "count": len(fs), "message": message, "phase": first.phase,
                    "modules": [(module_label(m), _steps_words(sorted(st))) for m, st in where.items()],
                    "settings": settings or [],
                    "details": [] if settings else _flatten(first.details)})
    rank = {"fails gate": 0, "warning": 1, "ignored": 2}
    return sorted(out, key=lambda d: rank[d["state"]])


def _steps_words(steps: list[int]) -> str:
    if not steps:
        return ""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"


# Settings whose difference a user sets on purpose (the target's precision), and the float32
# matmul settings that may be a surprise.
_MATMUL_SETTINGS = ("matmul_precision", "allow_tf32", "fp32_precision")


def _precision_todo(settings: list[dict[str, Any]]) -> str:
    names = [str(s.get("setting", "")) for s in settings]
    matmul = [n for n in names if n.startswith(_MATMUL_SETTINGS)]
    if matmul:
        return ("The float32 matmul settings differ (" + ", ".join(matmul) + "): set them alike on "
                "both runs (torch.set_float32_matmul_precision('highest') or --matmul-precision) for "
                "a like-for-like comparison; otherwise the floor allows the drift they explain.")
    return ("Nothing to do: the target runs at another precision on purpose (" + ", ".join(names) +
            "), and every floor in this report already allows for it. Record both runs with the same "
            "--dtype/--autocast/--fp8 to compare like for like.")


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(d, dict):
        rows: list[tuple[str, str]] = []
        for k, v in d.items():
            rows.extend(_flatten(v, f"{prefix}{k}."))
        return rows if rows or not prefix else [(prefix[:-1], "{}")]
    if isinstance(d, (list, tuple)):
        return [(prefix[:-1], ", ".join(fmt(v) if not isinstance(v, str) else v for v in d))]
    return [(prefix[:-1], d if isinstance(d, str) else fmt(d))]


# Shown even when equal: what a reader needs to know which runs these are.
META_ALWAYS = ("model_id", "device", "dtype", "mode", "steps", "seed", "host", "created")


def _meta_rows(report: Report) -> list[dict[str, Any]]:
    """Both runs' metadata side by side, flattened to dotted keys; differing values flagged."""
    sides = [dict(_flatten(report.reference)), dict(_flatten(report.target))]
    for other in (report.truth, report.control):
        if other:
            sides.append(dict(_flatten(other)))
    keys: list[str] = []
    for side in sides:
        keys.extend(k for k in side if k not in keys)

    def rank(key: str) -> tuple[int, str]:
        head = key.split(".")[0]
        return (META_FIRST.index(head) if head in META_FIRST else len(META_FIRST), key)

    rows = []
    for key in sorted(keys, key=rank):
        values = [side.get(key) for side in sides]
        rows.append({"key": key, "values": values, "differs": len(set(values[:2])) > 1,
                     "precision": key.startswith(("precision", "dtype"))})
    return rows


def _details(report: Report, first_entry: Entry | None) -> list[dict[str, Any]]:
    chosen = [first_entry] if first_entry is not None else []
    chosen += [e for e in worst(report.entries, DETAIL_COUNT + 1) if e is not first_entry][:DETAIL_COUNT]
    out: list[dict[str, Any]] = []
    for e in chosen:
        ref, tgt = e.details.get("ref_stats") or {}, e.details.get("tgt_stats") or {}
        limit, rule = entry_limit(e)
        hist = e.details.get("histogram")
        out.append({
            "e": e, "anchor": f"detail-{len(out)}", "limit": limit, "rule": rule,
            "is_first": e is first_entry,
            "metrics": [(k, e.metrics[k]) for k in KEY_METRICS if k in e.metrics],
            "more_metrics": [(k, e.metrics[k]) for k in METRIC_ROWS if k in e.metrics and k not in KEY_METRICS]
            + [(k, v) for k, v in e.metrics.items() if k not in METRIC_ROWS and k not in KEY_METRICS],
            "stats": [(k, ref.get(k), tgt.get(k)) for k in STAT_ROWS if k in ref or k in tgt],
            "histogram_svg": histogram_svg(hist, e.floor) if hist else "",
            "exact": (hist or {}).get("exact"),
        })
    return out

"""The HTML report: one self-contained file (inline CSS, JS and SVG) that opens from disk.

Built with jinja2 (autoescape on) from ``driftcheck/templates/report.html.j2``; charts are drawn
by matplotlib's SVG backend with text kept as text (``svg.fonttype: none``) and math parsing off,
so a module name is never interpreted. The entry table travels as JSON inside a
``<script type="application/json">`` block (``</`` escaped) and is built by a small vanilla script
with ``textContent`` only: the page stays fast with tens of thousands of entries.
"""
from __future__ import annotations

import io
import json
import math
import re
from typing import Any

import jinja2

from driftcheck.report import Entry, Report
from driftcheck.report.common import (
    as_float,
    entry_limit,
    execution_order,
    explain_kind,
    finding_state,
    fmt,
    worst,
)
from driftcheck.store.format import PHASES

# Okabe-Ito palette: tells the phases apart for colour-blind readers too.
PHASE_COLORS = {"params": "#999999", "forward": "#0072B2", "loss": "#000000", "backward": "#E69F00",
                "grads": "#009E73", "optimizer": "#CC79A7"}
MAX_CHART_POINTS = 4000  # above this the chart keeps the worst entry of each bin
DETAIL_COUNT = 6  # worst entries with a detail section (plus the first divergence)
TABLE_COLUMNS = [  # (id, title, kind): kind "num" sorts numerically
    ("i", "#", "num"), ("step", "step", "num"), ("phase", "phase", "str"), ("module", "module", "str"),
    ("call", "call", "num"), ("slot", "slot", "str"), ("status", "status", "str"), ("ratio", "ratio", "num"),
    ("local", "local", "num"), ("limit", "limit", "num"), ("max_abs", "max abs", "num"),
    ("rel_l2", "rel L2", "num"), ("max_ulp", "max ULP", "num"), ("cosine", "cosine", "num"),
    ("rule", "rule", "str"),
]
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
    first_entry = by_key.get(first.get("key")) if first else None
    env = _environment()
    context = {
        "report": report,
        "passed": bool(report),
        "model": report.target.get("model") or report.reference.get("model"),
        "counts": _status_counts(report.entries),
        "findings": _findings(report),
        "meta_rows": _meta_rows(report),
        "meta_always": META_ALWAYS,
        "first": first,
        "first_entry": first_entry,
        "first_extra": {k: v for k, v in (first or {}).items()
                        if k not in ("key", "module", "phase", "step", "slot", "ratio", "local_ratio")},
        "chart_svg": _drift_chart(ordered, [lim for lim, _ in limits], first_entry),
        "chart_points": sum(1 for e in ordered if e.ratio is not None),
        "table_json": _script_json(_table_data(ordered, limits)),
        "columns": TABLE_COLUMNS,
        "statuses": sorted({e.status for e in report.entries}),
        "phases": [p for p in PHASES if any(e.phase == p for e in ordered)],
        "details": _details(report, first_entry),
        "policy_source": (report.policy or {}).get("source"),
        "css": _resource("report.css"),
        "js": _resource("report.js"),
    }
    return env.get_template("report.html.j2").render(**context)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("driftcheck", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt
    env.filters["label"] = lambda m: m if m else "(model)"
    return env


def _resource(name: str) -> str:
    loader = jinja2.PackageLoader("driftcheck", "templates")
    return loader.get_source(jinja2.Environment(), name)[0]


def _script_json(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``</``, ``<!--`` or line separators."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _json_num(x: Any, digits: int = 4) -> Any:
    value = as_float(x)
    if value is None:
        return None
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(x, int) and not isinstance(x, bool):
        return int(x)
    return float(f"{value:.{digits}g}")  # the table shows 3 digits; sorting needs no more


def _table_data(ordered: list[Entry], limits: list[tuple[float, str]]) -> dict[str, Any]:
    # Rows are arrays and rules are indices into one list: a few dozen bytes per entry.
    rules: dict[str, int] = {}
    rows = []
    for i, (e, (limit, rule)) in enumerate(zip(ordered, limits)):
        m = e.metrics
        rule_id = rules.setdefault(rule if e.ratio is not None else "", len(rules))
        rows.append([i, e.step, e.phase, e.module, e.call, e.slot, e.status, _json_num(e.ratio),
                     _json_num(e.local_ratio), limit, _json_num(m.get("max_abs")), _json_num(m.get("rel_l2")),
                     _json_num(m.get("max_ulp")), _json_num(m.get("cosine"), 7), rule_id])
    return {"columns": [c[0] for c in TABLE_COLUMNS], "rules": list(rules), "rows": rows}


def _status_counts(entries: list[Entry]) -> list[tuple[str, int]]:
    order = ["ok", "drift", "nonfinite", "misaligned", "ignored"]
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.status] = counts.get(e.status, 0) + 1
    return [(s, counts[s]) for s in sorted(counts, key=lambda s: order.index(s) if s in order else len(order))]


def _findings(report: Report) -> list[dict[str, Any]]:
    out = []
    for f in report.findings:
        title, meaning, todo = explain_kind(f.kind)
        out.append({"f": f, "title": title, "meaning": meaning, "todo": todo, "state": finding_state(f),
                    "details": _flatten(f.details)})
    rank = {"fails gate": 0, "warning": 1, "ignored": 2}
    return sorted(out, key=lambda d: rank[d["state"]])


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
    if report.truth:
        sides.append(dict(_flatten(report.truth)))
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
    out = []
    for e in chosen:
        ref, tgt = e.details.get("ref_stats") or {}, e.details.get("tgt_stats") or {}
        limit, rule = entry_limit(e)
        hist = e.details.get("histogram")
        out.append({
            "e": e, "anchor": f"detail-{len(out)}", "limit": limit, "rule": rule,
            "is_first": e is first_entry,
            "metrics": [(k, e.metrics[k]) for k in METRIC_ROWS if k in e.metrics]
            + [(k, v) for k, v in e.metrics.items() if k not in METRIC_ROWS],
            "stats": [(k, ref.get(k), tgt.get(k)) for k in STAT_ROWS if k in ref or k in tgt],
            "histogram_svg": _histogram_chart(hist, e.floor, f"hist-{len(out)}") if hist else "",
            "exact": (hist or {}).get("exact"),
        })
    return out


# --- charts ---------------------------------------------------------------------------------

def _rc() -> dict[str, Any]:
    return {"svg.fonttype": "none", "text.parse_math": False, "font.family": "sans-serif",
            "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
            "axes.edgecolor": "#888888", "axes.labelcolor": "#333333", "xtick.color": "#555555",
            "ytick.color": "#555555", "svg.image_inline": True}


def _svg(fig: Any, salt: str, label: str) -> str:
    """The figure as an inline ``<svg>``: no XML prolog or metadata, scales to its container."""
    import matplotlib

    buf = io.StringIO()
    # A fixed salt per figure keeps the output deterministic and the element ids unique per page.
    with matplotlib.rc_context({"svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    # Several figures share one page: prefix every id (and every reference to one) per figure.
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{salt}-{m.group(1)}"', svg)
    svg = re.sub(r'(href="#|url\(#)([^")]+)', lambda m: f"{m.group(1)}{salt}-{m.group(2)}", svg)
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
                 lambda m: f'<svg{m.group(1)} class="chart" role="img" aria-label="{_attr(label)}"', svg, count=1)
    return svg


def _attr(text: str) -> str:
    return (text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;"))


def _short(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n // 2 - 1] + "…" + text[-(n // 2 - 1):]


def _decimate(xs: list[int], ys: list[float], keep: set[int]) -> list[int]:
    """Indices to draw: all when few, else the worst of each bin plus the ``keep`` indices."""
    n = len(xs)
    if n <= MAX_CHART_POINTS:
        return list(range(n))
    size = math.ceil(n / MAX_CHART_POINTS)
    chosen = {max(range(s, min(s + size, n)), key=lambda i: ys[i]) for s in range(0, n, size)}
    return sorted(chosen | keep)


def _drift_chart(ordered: list[Entry], limits: list[float], first: Entry | None) -> str:
    """Drift ratio (log scale) along execution order, coloured by phase; limit line; first divergence."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    judged = [(i, as_float(e.ratio)) for i, e in enumerate(ordered) if e.ratio is not None]
    if not judged:
        return ""
    finite = [r for _, r in judged if r is not None and math.isfinite(r) and r > 0]
    top = max(finite + limits) * 3
    bottom = max(min(finite + [min(limits)]) / 3, 1e-4)
    xs = [i for i, _ in judged]
    ys = [(top if r is None or not math.isfinite(r) else max(r, bottom)) for _, r in judged]
    bad = {k for k, (_, r) in enumerate(judged) if r is None or not math.isfinite(r)}
    first_x = ordered.index(first) if first is not None and first in ordered else None
    keep = bad | {k for k, x in enumerate(xs) if x == first_x}
    idx = _decimate(xs, ys, keep)

    with matplotlib.rc_context(_rc()):
        fig = Figure(figsize=(11, 3.4))
        ax = fig.add_subplot()
        ax.set_yscale("log")
        ax.set_ylim(bottom / 1.6, top * 1.5)
        # Plain tick labels: math text is off so that module names are never parsed as TeX.
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(-0.5, len(ordered) - 0.5)
        # Step bands: alternate shading so a multi-step trace reads as repeated passes.
        steps = sorted({e.step for e in ordered})
        for n, step in enumerate(steps):
            lo = next(i for i, e in enumerate(ordered) if e.step == step)
            hi = max(i for i, e in enumerate(ordered) if e.step == step)
            if n % 2:
                ax.axvspan(lo - 0.5, hi + 0.5, color="#f2f2f2", zorder=0, lw=0)
            if len(steps) > 1:
                ax.text((lo + hi) / 2, 1.0, f"step {step}", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", color="#666666", fontsize=8)
        ax.step(range(len(ordered)), limits, where="mid", color="#D55E00", lw=1.2, zorder=2)
        handles = [Line2D([], [], color="#D55E00", lw=1.2, label="limit")]
        for phase in PHASES:
            sel = [k for k in idx if k not in bad and ordered[xs[k]].phase == phase]
            if not sel:
                continue
            ax.plot([xs[k] for k in sel], [ys[k] for k in sel], ls="none", marker="o", ms=3.2,
                    color=PHASE_COLORS[phase], alpha=0.85, zorder=3, mec="none")
            handles.append(Line2D([], [], ls="none", marker="o", ms=5, color=PHASE_COLORS[phase], label=phase))
        if bad:
            ax.plot([xs[k] for k in bad], [ys[k] for k in bad], ls="none", marker="X", ms=6, color="#8b0000",
                    zorder=4)
            handles.append(Line2D([], [], ls="none", marker="X", ms=6, color="#8b0000", label="NaN/Inf"))
        if first_x is not None:
            ax.axvline(first_x, color="#c0392b", ls="--", lw=1, zorder=1)
            ax.annotate(f"first divergence: {_short(first.module or '(model)')} ({first.phase}, step {first.step})",
                        xy=(first_x, 0.97), xycoords=ax.get_xaxis_transform(), xytext=(4, 0),
                        textcoords="offset points", ha="left" if first_x < len(ordered) * 0.6 else "right",
                        va="top", color="#c0392b", fontsize=8.5,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
        ax.set_xlabel("execution order (step → phase → call)")
        ax.set_ylabel("drift ratio (error / floor)")
        ax.grid(axis="y", which="major", color="#e5e5e5", lw=0.6)
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
        return _svg(fig, "driftcheck-drift", "drift ratio along execution order")


def _histogram_chart(hist: dict[str, Any], floor: float | None, salt: str) -> str:
    """The error histogram over log10 |target - reference|, with the noise floor marked."""
    import matplotlib
    from matplotlib.figure import Figure

    edges = [as_float(x) for x in hist.get("edges", [])]
    counts = [as_float(x) or 0.0 for x in hist.get("counts", [])]
    if len(edges) != len(counts) + 1 or not counts or any(x is None or not math.isfinite(x) for x in edges):
        return ""
    with matplotlib.rc_context(_rc()):
        fig = Figure(figsize=(4.2, 1.9))
        ax = fig.add_subplot()
        widths = [b - a for a, b in zip(edges, edges[1:])]
        ax.bar(edges[:-1], counts, width=widths, align="edge", color="#0072B2", alpha=0.8, lw=0)
        if floor is not None and floor > 0 and math.isfinite(floor):
            ax.axvline(math.log10(floor), color="#D55E00", lw=1.2, ls="--")
            ax.text(math.log10(floor), 1.01, "floor", transform=ax.get_xaxis_transform(), color="#D55E00",
                    fontsize=8, va="bottom", ha="center")
        ax.set_xlabel("log10 |target − reference|")
        ax.set_ylabel("elements")
        return _svg(fig, f"driftcheck-{salt}", "error histogram")


"""What the HTML pages carry besides their markup: the entry table's and the module map's JSON
blocks, written compactly, and the plotly.js bundle they inline.

A report is kept by CI for every run, so its size matters (docs/performance.md, "Report size").
The JSON is columnar: one array per column (a column whose values are all alike is one value),
the entry's index implied by its position, every string (module, slot, phase, status, rule) an
index into one shared table, numbers with the digits the page shows and sorts by (4 significant,
7 for the cosine) in their shortest JSON spelling (``7122e-7`` for 0.0007122). The module map
names each cell's worst entry by its index in the table: the page reads its ratio, slot and status
from there. ``report.js`` rebuilds one array per row from the columns when the page loads.

plotly.js is a partial bundle (core, scatter, heatmap: the traces the pages draw; about 1 MB
where the whole library is 4.6 MB) built by ``tools/plotly-bundle/build.js`` and shipped as package
data in ``driftcheck/vendor/`` with its licence.
"""
from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Any

from driftcheck.gate.report import Entry
from driftcheck.report.common import as_float
from driftcheck.store.format import PHASES

__all__ = ["PLOTLY_BUNDLE", "Strings", "compact_json", "json_num", "module_map", "plotly_js", "script_json",
           "table_data"]

PLOTLY_BUNDLE = "plotly-driftcheck.min.js"  # in driftcheck/vendor/, beside plotly.js-LICENSE.txt


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.js (core, scatter, heatmap; MIT) from the package's data, inlined: the page opens offline."""
    text = resources.files("driftcheck").joinpath("vendor", PLOTLY_BUNDLE).read_text(encoding="utf-8")
    return text.replace("</script", "<\\/script")


def script_json(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``</``, ``<!--`` or line separators."""
    return _script_safe(json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False))


def compact_json(data: Any) -> str:
    """``script_json`` with every float in its shortest spelling (``7122e-7``, ``1.5e-12``)."""
    return _script_safe(_dump(data))


def _script_safe(text: str) -> str:
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _dump(x: Any) -> str:
    if isinstance(x, float) and math.isfinite(x):
        return _short_float(x)
    if isinstance(x, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=False) + ":" + _dump(v) for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(map(_item, x)) + "]"
    return json.dumps(x, allow_nan=False, ensure_ascii=False)


def _item(v: Any) -> str:
    """One array element: the columns' ints, floats and nulls without a call into json."""
    kind = type(v)
    if kind is int:
        return str(v)
    if kind is float and math.isfinite(v):
        return _short_float(v)
    return "null" if v is None else _dump(v)


def _short_float(x: float) -> str:
    """The shortest JSON number that reads back as ``x``: repr's digits, as ``1.5e-5`` or ``15e-6``."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    text = repr(x)  # the shortest digits that round-trip: "0.0007122", "1.5e-05", "123.4"
    sign = "-" if text[0] == "-" else ""
    body = text.lstrip("-")
    if "e" in body:
        mantissa, exp_text = body.split("e")
        exp = int(exp_text)
        whole, _, frac = mantissa.partition(".")
        short = f"{sign}{mantissa}e{exp}"
        return min(short, f"{sign}{whole}{frac}e{exp - len(frac)}", key=len)
    if body.startswith("0."):
        frac = body[2:]
        return min(text, f"{sign}{frac.lstrip('0')}e{-len(frac)}", key=len)
    return text


def json_num(x: Any, digits: int = 4) -> Any:
    """A number as the page needs it: ``digits`` significant digits; NaN/Inf as strings."""
    value = as_float(x)
    if value is None:
        return None
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(x, int) and not isinstance(x, bool):
        return int(x)
    return float(f"{value:.{digits}g}")  # the table shows 3 digits; sorting needs no more


class Strings:
    """The shared string table: each distinct string once, referred to by its index."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}

    def __call__(self, text: Any) -> int:
        return self.index.setdefault(text, len(self.index))

    def table(self) -> list[Any]:
        return list(self.index)


def _column(values: list[Any]) -> Any:
    """A column's values, or the one value they all share."""
    return values[0] if values and all(v == values[0] and type(v) is type(values[0]) for v in values) else values


# The columns written as indices into the shared string table (report.js's TEXT).
_STRING_COLUMNS = ("phase", "module", "slot", "status", "rule")


def table_data(ordered: list[Entry], limits: list[tuple[float, str]], first: Entry | None,
               columns: list[str], strings: Strings) -> dict[str, Any]:
    """The entry table, columnar (``strings`` interns the text: the module map shares it)."""
    cols: dict[str, list[Any]] = {c: [] for c in columns if c != "i"}
    for e, (limit, rule) in zip(ordered, limits):
        m = e.metrics
        row = {"step": e.step, "phase": e.phase, "module": e.module, "slot": e.slot, "status": e.status,
               "ratio": json_num(e.ratio), "local": json_num(e.local_ratio), "limit": json_num(limit, 6),
               "floor": json_num(e.floor), "max_abs": json_num(m.get("max_abs")), "rel_l2": json_num(m.get("rel_l2")),
               "call": e.call, "max_ulp": json_num(m.get("max_ulp")), "cosine": json_num(m.get("cosine"), 7),
               "rule": rule if e.ratio is not None else ""}
        for c, values in cols.items():
            values.append(strings(row[c]) if c in _STRING_COLUMNS else row[c])
    first_i = next((i for i, e in enumerate(ordered) if e is first), None)
    bounds: dict[int, list[int]] = {}
    for i, e in enumerate(ordered):
        bounds.setdefault(e.step, [i, i])[1] = i
    return {"n": len(ordered), "columns": columns, "data": {c: _column(v) for c, v in cols.items()},
            "first": first_i, "steps": [[s, *bounds[s]] for s in sorted(bounds)]}


def module_map(ordered: list[Entry], strings: Strings) -> dict[str, Any]:
    """Module x (step, phase): each cell's worst judged entry (its ratio relative to its limit;
    the page colours it and reads its row) and how many judged entries it holds. Rows are the
    modules in order of first appearance, columns (step, phase) in execution order."""
    modules: dict[Any, int] = {}
    cols: dict[tuple[int, str], int] = {}
    rank = {p: i for i, p in enumerate(PHASES)}
    for e in ordered:
        modules.setdefault(e.module, len(modules))
    for step, phase in sorted({(e.step, e.phase) for e in ordered}, key=lambda c: (c[0], rank.get(c[1], 99))):
        cols[(step, phase)] = len(cols)
    cells: dict[tuple[int, int], list[Any]] = {}
    for i, e in enumerate(ordered):
        ratio = as_float(e.ratio)
        if ratio is None or e.status == "ignored":
            continue
        limit = e.limit if e.limit is not None else math.nan
        score = math.inf if math.isnan(ratio) else ratio / limit if limit and limit > 0 else ratio
        key = (modules[e.module], cols[(e.step, e.phase)])
        cell = cells.get(key)
        if cell is None:
            cells[key] = [score, i, 1]
        else:
            cell[2] += 1
            if score > cell[0]:
                cell[0:2] = [score, i]
    return {"modules": [strings(m) for m in modules], "cols": [[s, strings(p)] for s, p in cols],
            "worst": [c[1] for c in cells.values()], "count": _column([c[2] for c in cells.values()]),
            "score": [json_num(c[0], 3) for c in cells.values()]}

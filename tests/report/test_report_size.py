"""The HTML report's size: CI keeps one for every run (docs/performance.md, "Report size").

Budgets, asserted on generated reports: a demo-size report (480 entries with their detail
sections, as ``driftcheck run llama --target-dtype bf16`` writes) at most 1.5 MB, a 10k-entry
report at most 2 MB. The plotly.js bundle is the fixed part (~1.0 MB); the rest grows with the
entries and is held to a few dozen bytes each by the columnar JSON (report/page_data.py).
"""
from __future__ import annotations

import json
import re

from conftest_report import big_report
from hypothesis import example, given, strategies as st

from driftcheck.report.html import render_html
from driftcheck.report.page_data import compact_json, plotly_js

MB = 1_000_000


def _parts(html: str) -> dict[str, int]:
    """Bytes (UTF-8) of the whole page and of its JSON blocks."""
    sizes = {"total": len(html.encode()), "plotly": len(plotly_js().encode())}
    for name in ("entries-data", "map-data"):
        block = re.search(rf'<script type="application/json" id="{name}">(.*?)</script>', html, re.S)
        assert block, name
        sizes[name] = len(block.group(1).encode())
    return sizes


def test_the_plotly_bundle_is_the_partial_one() -> None:
    js = plotly_js()
    assert len(js.encode()) < 1.1 * MB  # the whole library is 4.6 MB
    assert js.startswith("/*! plotly.js v") and "(core, scatter, heatmap)" in js[:200]


def test_a_demo_size_report_stays_under_1_5_mb() -> None:
    report = big_report(n_modules=30, steps=2, histograms=7)  # 482 entries, 7 detail sections
    assert len(report.entries) == 482
    html = render_html(report)
    sizes = _parts(html)
    assert html.count("<svg") >= 7  # the details' histograms are in the page
    assert sizes["total"] <= 1.5 * MB, sizes


def test_a_ten_thousand_entry_report_stays_under_2_mb() -> None:
    report = big_report(n_modules=625, steps=2, histograms=7)  # 10,002 entries
    assert len(report.entries) > 10_000
    html = render_html(report)
    sizes = _parts(html)
    assert sizes["total"] <= 2 * MB, sizes
    data = sizes["entries-data"] + sizes["map-data"]
    assert data / len(report.entries) < 70, sizes  # ~64 bytes an entry: table, then map


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-10**6, 10**6) | st.none()
                | st.text(max_size=8)))
@example(["Infinity", "NaN", 'a"NaN', 1e-7])  # text that says it, found by hypothesis on a loaded host
def test_compact_json_reads_back_exactly(values: list) -> None:
    """The shortest spellings (``7122e-7``) are JSON numbers that read back as the same floats."""
    text = compact_json({"v": values})
    assert json.loads(text) == {"v": values}
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # outside strings (a text value may say "NaN")
    assert "<" not in text and "NaN" not in bare and "Infinity" not in bare

"""The HTML report: self-contained, escaped, complete; the entry table's JSON matches the report."""
from __future__ import annotations

import json
import re
import time
from html.parser import HTMLParser

import pytest
from conftest_report import (
    DIVERGING,
    HOSTILE_NAMES,
    big_report,
    failing_report,
    hostile_report,
    passing_report,
    rejudged,
)

from driftcheck.gate.report import Report
from driftcheck.report.common import execution_order
from driftcheck.report.html import plotly_js, render_html


class Page(HTMLParser):
    """Collects tags, attributes, ids, text and the script blocks of a rendered page."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self._script: dict[str, str | None] | None = None
        self._svg_depth = 0
        self.svg_text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._script = dict(attrs)
        if tag == "svg":
            self._svg_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            self.scripts.append((self._script, data))
            self._script = None
            return
        self.text.append(data)
        if self._svg_depth:
            self.svg_text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)

    def table_data(self) -> dict:
        return self.json_block("entries-data")

    def json_block(self, name: str) -> dict:
        (block,) = [body for attrs, body in self.scripts if attrs.get("id") == name]
        return json.loads(block)

    def rows(self) -> list[dict]:
        """The entry table's rows as report.js rebuilds them from the columnar JSON."""
        data = self.table_data()
        text = {"phase", "module", "slot", "status", "rule"}
        out = []
        for i in range(data["n"]):
            row = {}
            for c in data["columns"]:
                v = data["data"].get(c)
                x = i if c == "i" else v[i] if isinstance(v, list) else v
                row[c] = data["strings"][x] if c in text else x
            out.append(row)
        return out

    def map_cells(self) -> dict[tuple, dict]:
        """The module map's cells by (module, step, phase): the worst entry's row, score, count."""
        rows, mp = self.rows(), self.json_block("map-data")
        count = mp["count"] if isinstance(mp["count"], list) else [mp["count"]] * len(mp["worst"])
        return {(rows[w]["module"], rows[w]["step"], rows[w]["phase"]): {"row": rows[w], "score": s, "count": n}
                for w, s, n in zip(mp["worst"], mp["score"], count)}

    def map_modules(self) -> list:
        return [self.table_data()["strings"][k] for k in self.json_block("map-data")["modules"]]


@pytest.fixture(scope="module")
def fail_html() -> str:
    return render_html(failing_report())


@pytest.fixture(scope="module")
def fail_page(fail_html: str) -> Page:
    return Page(fail_html)


def test_self_contained(fail_html: str, fail_page: Page) -> None:
    for tag, attrs in fail_page.tags:
        assert tag not in ("link", "img", "iframe", "object", "embed", "audio", "video", "source"), tag
        assert "src" not in attrs, (tag, attrs)
        if "href" in attrs or "xlink:href" in attrs:
            assert (attrs.get("href") or attrs.get("xlink:href") or "").startswith("#"), attrs
    # the plotly.js bundle is inlined once (its source names URLs it never fetches here, and
    # the page's CSP forbids any fetch); everywhere else the only absolute URLs allowed are XML
    # namespace names, which are never fetched.
    assert fail_html.count(plotly_js()) == 1
    own = fail_html.replace(plotly_js(), "")
    for match in re.finditer(r"(?:https?:)?//[\w.-]+", own):
        before = own[max(0, match.start() - 20):match.start()]
        assert re.search(r'xmlns(:\w+)?="$', before), own[match.start() - 40:match.end() + 20]
    assert "@import" not in fail_html and "url(http" not in fail_html
    assert "Content-Security-Policy" in fail_html and "default-src 'none'" in fail_html


def test_banner_rule_and_counts(fail_page: Page) -> None:
    text = fail_page.all_text
    banner = [a for t, a in fail_page.tags if t == "header" and "banner" in (a.get("class") or "")]
    assert banner and "fail" in banner[0]["class"]
    assert "FAIL" in text and f"first divergence at {DIVERGING} (forward, step 0)" in text
    assert "35 drift" in text and "2 nonfinite" in text and "1 misaligned" in text
    assert "6 findings (5 fail the gate)" in text
    passed = Page(render_html(passing_report()))
    assert "PASS" in passed.all_text and "None: no entry exceeds its limit." in passed.all_text
    assert any(t == "header" and "pass" in (a.get("class") or "") for t, a in passed.tags)


def test_runs_side_by_side_with_differences(fail_html: str) -> None:
    rows = re.findall(r'<tr class="([^"]*)">\s*<th>([^<]*)</th>\s*<td>([^<]*)</td><td>([^<]*)</td>', fail_html)
    by_key = {key: (cls.split(), ref, tgt) for cls, key, ref, tgt in rows}
    assert by_key["precision.matmul"] == (["differs", "precision"], "highest", "medium")
    assert by_key["device"] == (["differs"], "cpu", "tpu")
    assert by_key["model"] == ([], "tiny_gpt_bn", "tiny_gpt_bn")
    assert by_key["versions.torch_tpu"][1:] == ("—", "0.2.0")


def test_conclusion_on_top(fail_page: Page) -> None:
    """One sentence of conclusion in the banner, in words: the module, what, how far, and why."""
    text = fail_page.all_text
    assert f"{DIVERGING}'s forward output at step 0 is 79.7x what " in text
    assert "a defect on the target, not precision." in text
    passed = Page(render_html(passing_report())).all_text
    assert "The target matches the reference: all " in passed and "x its noise floor" in passed


def test_chart_and_map_data(fail_page: Page) -> None:
    """The chart and the map are drawn in the page from the JSON blocks: the chart knows the
    first divergence's row and the steps, the map holds each module's worst ratio per (step, phase)."""
    ids = {a.get("id") for _, a in fail_page.tags}
    assert {"ratio-chart", "module-map", "tooltip"} <= ids
    data, rows = fail_page.table_data(), fail_page.rows()
    first = rows[data["first"]]
    assert (first["module"], first["phase"], first["step"], first["slot"]) == (DIVERGING, "forward", 0, "output")
    assert [s for s, _, _ in data["steps"]] == [0, 1] and data["steps"][0][1] == 0
    assert set(data["colors"]) >= {"forward", "backward", "optimizer"}
    modules = fail_page.map_modules()
    assert modules[0] == rows[0]["module"] and len(modules) == len({r["module"] for r in rows})
    cell = fail_page.map_cells()[(DIVERGING, 0, "forward")]
    here = [r for r in rows if r["module"] == DIVERGING and r["phase"] == "forward" and r["step"] == 0
            and r["ratio"] is not None and r["status"] != "ignored"]
    worst = max(here, key=lambda r: float(r["ratio"]))
    assert cell["row"] == worst and cell["count"] == len(here)
    assert cell["score"] == pytest.approx(float(worst["ratio"]) / worst["limit"], rel=5e-3)


def test_table_json_has_every_entry_in_execution_order() -> None:
    report = failing_report()
    rows = Page(render_html(report)).rows()
    assert len(rows) == len(report.entries)
    ordered = execution_order(report.entries)
    assert [(r["module"], r["phase"], r["step"], r["slot"]) for r in rows] == \
           [(e.module, e.phase, e.step, e.slot) for e in ordered]
    nonfinite = [r for r in rows if r["status"] == "nonfinite"]
    assert nonfinite and all(r["ratio"] == "inf" and r["max_abs"] == "inf" for r in nonfinite)
    first = next(r for r in rows if r["module"] == DIVERGING and r["phase"] == "forward" and r["slot"] == "output"
                 and r["step"] == 0)
    assert first["local"] == 71.0 and first["rule"] == "default limit 4"


def test_limits_follow_policy_overrides() -> None:
    report = failing_report()
    report.policy = {"source": "driftcheck.toml", "limit": 4.0,
                     "overrides": [{"glob": "lm_head*", "limit": 8.0, "phase": "forward"}]}
    rows = Page(render_html(rejudged(report))).rows()
    lm = [r for r in rows if r["module"] == "lm_head" and r["phase"] == "forward"]
    assert lm and all(r["limit"] == 8.0 for r in lm)
    assert lm[0]["rule"] == "override 'lm_head*' [forward] limit 8 (driftcheck.toml)"
    assert all(r["limit"] == 4.0 for r in rows if r["module"] == "lm_head" and r["phase"] == "backward")


def test_command_line_limit_replaces_policy_limits() -> None:
    report = failing_report()
    report.policy = {"limit": 4.0, "overrides": [{"glob": "lm_head*", "limit": 8.0}], "limit_override": 50.0}
    report.entries[10].rule = "--limit 50"
    rows = Page(render_html(rejudged(report))).rows()
    assert {r["limit"] for r in rows} == {50.0}


def test_details_for_worst_entries(fail_page: Page) -> None:
    details = [a for t, a in fail_page.tags if t == "details" and a.get("class") == "detail"]
    assert 2 <= len(details) <= 7 and details[0]["id"] == "detail-0"
    charts = [a for t, a in fail_page.tags if t == "svg" and a.get("class") == "chart"]
    assert len(charts) == len(details)  # one histogram per detail
    assert "more metrics" in fail_page.all_text  # the few that matter shown, the rest folded
    ids = [a["id"] for _, a in fail_page.tags if "id" in a]
    assert len(ids) == len(set(ids)), "element ids must be unique across the inline SVGs"
    assert "328 elements match exactly" in fail_page.all_text or "elements match exactly" in fail_page.all_text


def test_hostile_names_stay_text() -> None:
    html = render_html(hostile_report())
    page = Page(html)
    scripts = [attrs for t, attrs in page.tags if t == "script"]
    assert scripts == [{"type": "application/json", "id": "entries-data"},
                       {"type": "application/json", "id": "map-data"}, {}, {}]
    assert not [t for t, _ in page.tags if t == "img"]
    assert "view.<b>bold</b>" in page.all_text  # a finding kind with markup
    assert not [(t, k) for t, a in page.tags for k in a if k.startswith("on")]
    for name in HOSTILE_NAMES[:3]:
        assert name in page.all_text, name  # shown as text
    for body in [b for a, b in page.scripts if a.get("type") == "application/json"]:
        assert "</" not in body and "<" not in body
    assert set(HOSTILE_NAMES) <= set(page.map_modules())
    modules = {r["module"] for r in page.rows()}
    assert set(HOSTILE_NAMES) <= modules  # the JSON round-trips the names exactly


def test_tex_in_module_names_is_not_interpreted() -> None:
    report = hostile_report()
    entry = next(e for e in report.entries if e.module == HOSTILE_NAMES[3] and e.phase == "forward")
    report.first_divergence = {"key": entry.key, "module": entry.module, "phase": "forward", "step": 0}
    page = Page(render_html(report))
    assert HOSTILE_NAMES[3] in page.all_text.replace("\u200b", "")  # as text, not typeset


def test_round_trip_through_json_and_empty_report() -> None:
    report = failing_report()
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    page = Page(render_html(again))
    assert len(page.rows()) == len(report.entries)
    empty = Report(verdict="pass", reference={}, target={}, first_divergence=None, entries=[], findings=[], limit=4.0)
    text = Page(render_html(empty)).all_text
    assert "No judged entries to plot." in text and "No findings." in text


def test_thousands_of_entries_stay_small_and_fast() -> None:
    report = big_report(n_modules=1500, steps=3)  # 36,003 entries
    start = time.perf_counter()
    html = render_html(report)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, elapsed
    own = len(html) - len(plotly_js())  # the plotly.js bundle is ~1 MB whatever the report
    assert own / len(report.entries) < 100, own / len(report.entries)  # ~67 B (was ~170 before the columnar JSON)
    worst = max(report.entries, key=lambda e: e.ratio)
    assert len(Page(html).rows()) == len(report.entries)
    assert worst.ratio > 4

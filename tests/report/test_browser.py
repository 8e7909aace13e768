"""The HTML report in a real browser (headless chromium): no errors, no network; sorting and
filtering the table, hovering and clicking the chart and the module map, zooming, all work.

Needs Debian's chromium (``apt-get install -y chromium``) and Playwright used as a driver only
(``pip install playwright``; never ``playwright install``). The screenshots in docs/ are made by
``python docs/screenshots/make.py``, never by a test run.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest_report import HOSTILE_NAMES, big_report, failing_report, hostile_report, passing_report

from driftcheck.gate.report import Report
from driftcheck.report.html import render_html

pytestmark = pytest.mark.browser

CHROMIUM = next((p for p in (os.environ.get("DRIFTCHECK_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        why = "no chromium binary (apt-get install -y chromium, or set DRIFTCHECK_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(why + ": CI installs it in .ci/run, the browser checks must not be skipped")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=FLAGS, headless=True,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()


class Opened:
    """A report opened from disk, with everything the page did recorded."""

    def __init__(self, browser, report: Report, path: Path) -> None:
        path.write_text(render_html(report), encoding="utf-8")
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page = page = browser.new_page()
        page.on("console", lambda m: m.type in ("error", "warning") and self.problems.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        page.on("request", lambda r: r.url.startswith("file:") or self.requests.append(r.url))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        page.goto(path.as_uri())
        page.wait_for_selector("#entries-table tbody tr")
        if report.entries and any(e.ratio is not None for e in report.entries):
            page.wait_for_selector("#ratio-chart .scatterlayer .point")
            page.wait_for_selector("#module-map .hm, #module-map image")

    def points(self) -> list:
        return self.page.query_selector_all("#ratio-chart .scatterlayer .point")

    def hover(self, element_or_box, fx: float = 0.5, fy: float = 0.5) -> str:
        """Move the mouse over an element (or a box) and return the tooltip's text."""
        box = element_or_box if isinstance(element_or_box, dict) else element_or_box.bounding_box()
        x, y = box["x"] + box["width"] * fx, box["y"] + box["height"] * fy
        self.page.mouse.move(x, y)
        self.page.wait_for_timeout(150)
        assert self.page.is_visible("#tooltip"), "no tooltip"
        return self.page.text_content("#tooltip")

    def tooltip(self) -> dict[str, str]:
        return dict(zip(self.page.eval_on_selector_all("#tooltip .k", "ks => ks.map(k => k.textContent)"),
                        self.page.eval_on_selector_all("#tooltip .v", "vs => vs.map(v => v.textContent)")))

    def scroll_to(self, selector: str) -> None:
        self.page.eval_on_selector(selector, "e => e.scrollIntoView({block: 'center'})")
        self.page.wait_for_timeout(50)

    def wait_rows(self, n: int, timeout: float = 5.0) -> None:
        """Wait until the table shows ``n`` rows (polled: the page's CSP forbids eval'd predicates)."""
        deadline = time.monotonic() + timeout
        while (got := self.page.evaluate("document.querySelectorAll('#entries-table tbody tr').length")) != n:
            assert time.monotonic() < deadline, f"table shows {got} rows, expected {n}"
            self.page.wait_for_timeout(20)

    def column(self, name: str) -> list[str]:
        index = self.page.eval_on_selector_all(
            "#entries-table thead th", f"ths => ths.findIndex(th => th.classList.contains('c-{name}'))")
        return self.page.eval_on_selector_all(
            "#entries-table tbody tr", f"trs => trs.map(tr => tr.cells[{index}].textContent)")

    def clean(self) -> None:
        assert self.problems == [] and self.requests == [] and self.dialogs == []


def _num(text: str) -> float:
    return math.nan if text == "—" else float(text)


def test_failing_report(browser, tmp_path) -> None:
    report = failing_report()
    opened = Opened(browser, report, tmp_path / "fail.html")
    page = opened.page
    assert page.text_content("#table-count") == f"{len(report.entries)} entries"
    assert len(opened.column("module")) == len(report.entries)

    page.click("#entries-table th.c-ratio")  # numeric columns sort worst first
    assert page.get_attribute("#entries-table th.c-ratio", "aria-sort") == "descending"
    ratios = [_num(t) for t in opened.column("ratio")]
    finite = [r for r in ratios if not math.isnan(r)]
    assert finite == sorted(finite, reverse=True) and finite[0] == math.inf
    assert all(math.isnan(r) for r in ratios[len(finite):])  # unjudged entries last
    page.click("#entries-table th.c-ratio")
    ascending = [r for r in (_num(t) for t in opened.column("ratio")) if not math.isnan(r)]
    assert ascending == sorted(ascending)
    assert page.get_attribute("#entries-table th.c-ratio", "aria-sort") == "ascending"
    page.click("#entries-table th.c-module")
    modules = opened.column("module")
    assert modules == sorted(modules, key=str.lower) and modules[0] != modules[-1]
    page.click("#entries-table th.c-module")
    assert opened.column("module")[0] == modules[-1]

    page.fill("#filter", "lm_head")
    expected = sum(1 for e in report.entries if "lm_head" in e.module)
    opened.wait_rows(expected)
    assert set(opened.column("module")) == {"lm_head"}
    assert page.text_content("#table-count") == f"{expected} of {len(report.entries)} entries match"
    page.select_option("#status-filter", "nonfinite")
    assert opened.column("status") == ["nonfinite", "nonfinite"]
    page.fill("#filter", "")
    page.select_option("#status-filter", "drift")
    opened.wait_rows(sum(e.status == "drift" for e in report.entries))
    assert set(opened.column("status")) == {"drift"}
    page.select_option("#status-filter", "")
    page.select_option("#phase-filter", "backward")
    assert set(page.eval_on_selector_all("#entries-table tbody td.c-phase", "tds => tds.map(t => t.textContent)")) \
        == {"backward"}
    page.select_option("#phase-filter", "")
    opened.clean()


def test_passing_report(browser, tmp_path) -> None:
    report = passing_report()
    opened = Opened(browser, report, tmp_path / "pass.html")
    assert opened.page.text_content(".banner .verdict").strip() == "PASS"
    assert set(opened.column("status")) == {"ok"}
    assert opened.page.text_content("#conclusion").startswith("The target matches the reference")
    opened.clean()


def test_hostile_names_do_not_run(browser, tmp_path) -> None:
    opened = Opened(browser, hostile_report(), tmp_path / "hostile.html")
    assert set(HOSTILE_NAMES) <= set(opened.column("module"))
    assert opened.page.evaluate("document.querySelectorAll('img').length") == 0
    assert HOSTILE_NAMES[0] in opened.page.text_content("#divergence")
    opened.clean()  # no alert() dialog, no request for 'x'


def test_fifty_thousand_entries_stay_responsive(browser, tmp_path) -> None:
    report = big_report(n_modules=1500, steps=3)
    opened = Opened(browser, report, tmp_path / "big.html")
    page = opened.page
    assert len(opened.column("module")) == 500  # one page of rows in the DOM
    start = time.perf_counter()
    page.click("#entries-table th.c-ratio")
    assert page.get_attribute("#entries-table th.c-ratio", "aria-sort") == "descending"
    page.fill("#filter", "blocks.17.layer3")
    expected = sum(1 for e in report.entries if "blocks.17.layer3" in e.module)
    opened.wait_rows(expected)
    assert time.perf_counter() - start < 5
    page.fill("#filter", "")
    opened.wait_rows(500)
    page.click("#show-more")
    assert len(opened.column("module")) == 1000
    opened.clean()


def test_real_fault_report_on_a_builtin_model(browser, tmp_path, traces) -> None:
    """An injected fault on the built-in Llama (bf16 target, one Linear's output x1.25) and the
    clean bf16 run: both render, the failing one names the module; these are the README's
    screenshots."""
    from conftest import a_middle_linear, record_builtin

    from driftcheck.compare import compare
    from driftcheck.targets.faults import scale_output

    ref = traces["llama"]["fp32"]
    mod = a_middle_linear("llama")
    bad = record_builtin("llama", tmp_path / "bad", dtype="bf16", replay=ref,
                         target_hooks=scale_output(mod, 1.25))
    failing = compare(ref, bad)
    assert failing.verdict == "fail" and failing.first_divergence["module"] == mod
    opened = Opened(browser, failing, tmp_path / "fail.html")
    assert mod in opened.page.text_content("#first-divergence") if opened.page.query_selector(
        "#first-divergence") else mod in opened.page.content()
    opened.page.fill("#filter", mod)
    opened.wait_rows(sum(1 for e in failing.entries if mod in e.key))
    opened.page.fill("#filter", "")
    assert opened.page.text_content("#conclusion").startswith(f"{mod}'s forward output at step 0 is ")
    opened.clean()
    passing = compare(ref, traces["llama"]["bf16"])
    assert passing.verdict == "pass"
    ok = Opened(browser, passing, tmp_path / "pass.html")
    ok.clean()


def test_chart_hover_names_the_point_and_click_shows_its_row(browser, tmp_path) -> None:
    """Hovering a chart point shows its module, phase, step, slot, ratio and floor; clicking it
    brings its row into the table, highlighted, even from a filtered, re-sorted table."""
    report = failing_report()
    opened = Opened(browser, report, tmp_path / "fail.html")
    page = opened.page
    page.fill("#filter", "lm_head")
    page.click("#entries-table th.c-ratio")
    opened.scroll_to("#ratio-chart")
    by_index = {i: e for i, e in enumerate(__import__("driftcheck.report.common", fromlist=["x"])
                                          .execution_order(report.entries))}
    seen = 0
    for point in opened.points()[::7][:6]:
        opened.hover(point)
        tip = opened.tooltip()
        assert set(tip) >= {"module", "phase", "step", "slot", "ratio", "floor", "limit"}
        box = point.bounding_box()  # plotly's drag layer takes the mouse: click where it is
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_timeout(400)  # two clicks within plotly's 300 ms are a double-click
        hit = page.query_selector_all("#entries-table tbody tr.hit")
        assert len(hit) == 1
        i = int(hit[0].get_attribute("data-i"))
        e = by_index[i]
        assert (tip["module"], tip["phase"], tip["step"], tip["slot"]) == (
            e.module or "(model)", e.phase, str(e.step), e.slot)
        assert page.input_value("#filter") == ""  # the filter that hid the row was cleared
        assert hit[0].is_visible()
        seen += 1
        opened.scroll_to("#ratio-chart")
    assert seen == 6
    opened.clean()


def test_module_map_hover_and_click_filter_the_table(browser, tmp_path) -> None:
    """A cell of the module map tells its module, step, phase and worst ratio; clicking it
    shows exactly that cell's entries, worst first; the chip clears it."""
    report = failing_report()
    opened = Opened(browser, report, tmp_path / "fail.html")
    page = opened.page
    opened.scroll_to("#module-map")
    drag = page.query_selector("#module-map .nsewdrag").bounding_box()
    checked = 0
    for fx, fy in ((0.05, 0.04), (0.35, 0.5), (0.6, 0.7)):
        try:
            opened.hover(drag, fx, fy)
        except AssertionError:
            continue  # an empty cell: nothing judged there
        tip = opened.tooltip()
        page.mouse.click(drag["x"] + drag["width"] * fx, drag["y"] + drag["height"] * fy)
        page.wait_for_timeout(400)
        module = tip["module"]
        expected = [e for e in report.entries if (e.module or "(model)") == module and e.phase == tip["phase"]
                    and str(e.step) == tip["step"]]
        assert len(opened.column("module")) == len(expected)
        assert int(tip["entries"]) == sum(1 for e in expected if e.ratio is not None and e.status != "ignored")
        assert set(opened.column("phase")) == {tip["phase"]}
        assert page.is_visible("#cell-filter") and module in page.text_content("#cell-filter-text")
        ratios = [float(t) for t in opened.column("ratio") if t != "—"]
        assert ratios == sorted(ratios, reverse=True)  # worst first
        assert float(tip["worst ratio"]) == pytest.approx(ratios[0], rel=5e-3)
        page.click("#cell-filter-clear")
        assert len(opened.column("module")) == min(500, len(report.entries))
        checked += 1
        opened.scroll_to("#module-map")
        drag = page.query_selector("#module-map .nsewdrag").bounding_box()
    assert checked >= 2
    opened.clean()


def test_chart_zoom_redraws_the_visible_range(browser, tmp_path) -> None:
    """On 50k entries the chart draws at most max_points points; dragging a range zooms in and
    redraws it from the entries inside it (the worst of each bin), so a spike there is seen."""
    report = big_report(n_modules=1500, steps=3)
    opened = Opened(browser, report, tmp_path / "big.html")
    page = opened.page
    limit = page.evaluate("JSON.parse(document.getElementById('entries-data').textContent).max_points")
    assert 0 < len(opened.points()) <= limit + 50
    opened.scroll_to("#ratio-chart")
    drag = page.query_selector("#ratio-chart .nsewdrag").bounding_box()
    page.mouse.move(drag["x"] + drag["width"] * 0.10, drag["y"] + 20)
    page.mouse.down()
    page.mouse.move(drag["x"] + drag["width"] * 0.12, drag["y"] + drag["height"] - 20, steps=4)
    page.mouse.up()
    page.wait_for_timeout(400)
    lo, hi = page.evaluate("document.getElementById('ratio-chart').layout.xaxis.range")
    assert 0 < lo < hi < len(report.entries) and hi - lo < 0.05 * len(report.entries)
    xs = page.evaluate("[].concat(...document.getElementById('ratio-chart').data.slice(1).map(t => t.x))")
    inside = sum(1 for i, e in enumerate(execution_order_of(report)) if lo <= i <= hi and e.ratio is not None)
    assert min(inside, limit) * 0.9 <= len(xs) <= min(inside, limit) + 50  # redrawn from inside the range
    assert all(lo - 1 <= x <= hi + 1 for x in xs)
    opened.clean()


def test_hostile_names_in_tooltips_stay_text(browser, tmp_path) -> None:
    opened = Opened(browser, hostile_report(), tmp_path / "hostile.html")
    opened.scroll_to("#ratio-chart")
    names = set()
    for point in opened.points():
        opened.hover(point)
        names.add(opened.tooltip()["module"])
    assert set(HOSTILE_NAMES) <= names
    assert opened.page.evaluate("document.querySelectorAll('img, #tooltip *:not(div):not(span)').length") == 0
    opened.clean()


def execution_order_of(report: Report) -> list:
    from driftcheck.report.common import execution_order

    return execution_order(report.entries)


def test_a_long_run_draws_a_bounded_chart(browser, tmp_path) -> None:
    """150 steps: the chart labels at most 24 step bands and the map at most ~30 columns, so
    the page does not slow down with the number of steps (docs/performance.md, report_open)."""
    report = big_report(n_modules=24, steps=150)
    opened = Opened(browser, report, tmp_path / "long.html")
    page = opened.page
    annotations = page.evaluate("document.getElementById('ratio-chart').layout.annotations.length")
    shapes = page.evaluate("document.getElementById('ratio-chart').layout.shapes.length")
    ticks = page.evaluate("document.getElementById('module-map').layout.xaxis.tickvals.length")
    assert 0 < annotations <= 25 and shapes <= 14 and 0 < ticks <= 31
    labels = page.evaluate("document.getElementById('ratio-chart').layout.annotations.map(a => a.text)")
    assert labels[0].startswith("steps 0") and labels[-1].endswith("149")
    opened.clean()


def test_long_run_report_draws_loss_distance_band_and_the_first_bad_step(browser, tmp_path) -> None:
    from driftcheck.compare.long import compare_long
    from driftcheck.loader import load_scenario
    from driftcheck.record.long import record_long
    from driftcheck.report.long import render_long_html
    from driftcheck.targets import faults

    def long(name, **kw):
        return record_long(load_scenario("llama"), tmp_path / name, steps=40, every=5, force=True, **kw)

    ref = long("ref")
    ctl = long("ctl", dtype="bf16", replay=ref, perturb=True)
    bad = long("bad", dtype="bf16", replay=ref,
               target_hooks=faults.starting_at(faults.scale_output("layers.1.mlp.down_proj", 2.0), 20))
    rep = compare_long(ref, bad, ctl)
    assert rep.first_bad_step == 20
    path = tmp_path / "long.html"
    path.write_text(render_long_html(rep), encoding="utf-8")
    problems, requests = [], []
    page = browser.new_page()
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("request", lambda r: r.url.startswith("file:") or requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector("#distance .scatterlayer .trace")
    assert len(page.query_selector_all("#loss .scatterlayer .trace")) == 3  # reference, target, control
    assert len(page.query_selector_all("#distance .scatterlayer .trace")) == 3  # target, control, band
    assert page.query_selector_all("#distance .shapelayer path")  # the first bad step's line
    assert "leaves the band at step 20" in page.text_content("#conclusion")
    assert problems == [] and requests == []

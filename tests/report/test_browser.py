"""The HTML report in a real browser (headless chromium): no errors, no network, sort and filter work.

Needs Debian's chromium (``apt-get install -y chromium``) and Playwright used as a driver only
(``pip install playwright``; never ``playwright install``). Saves the screenshots in
docs/screenshots/.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest_report import HOSTILE_NAMES, big_report, failing_report, hostile_report, passing_report
from driftcheck.report.html import render_html
from driftcheck.report import Report

pytestmark = pytest.mark.browser

CHROMIUM = next((p for p in (os.environ.get("DRIFTCHECK_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The screenshots in docs/ are regenerated on purpose (DRIFTCHECK_UPDATE_SCREENSHOTS=1), never as
# a side effect of a test run.
SCREENSHOTS = (Path(__file__).resolve().parents[2] / "docs" / "screenshots"
               if os.environ.get("DRIFTCHECK_UPDATE_SCREENSHOTS") == "1"
               else Path(tempfile.mkdtemp(prefix="driftcheck-screenshots-")))


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
    assert ascending == sorted(ascending) and page.get_attribute("#entries-table th.c-ratio", "aria-sort") == "ascending"
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
    page.click("#entries-table th.c-i")  # back to execution order for the screenshot
    page.evaluate("window.scrollTo(0, 0)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "report-fail.png"), full_page=True)
    opened.clean()


def test_passing_report(browser, tmp_path) -> None:
    report = passing_report()
    opened = Opened(browser, report, tmp_path / "pass.html")
    assert opened.page.text_content(".banner .verdict").strip() == "PASS"
    assert set(opened.column("status")) == {"ok"}
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    opened.page.screenshot(path=str(SCREENSHOTS / "report-pass.png"), full_page=True)
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
    from driftcheck.compare import compare
    from conftest import record_builtin
    from conftest import a_middle_linear
    from driftcheck.faults import scale_output

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
    opened.clean()
    opened.page.evaluate("window.scrollTo(0, 0)")
    opened.page.screenshot(path=str(SCREENSHOTS / "llama-fault.png"), full_page=False)
    passing = compare(ref, traces["llama"]["bf16"])
    assert passing.verdict == "pass"
    ok = Opened(browser, passing, tmp_path / "pass.html")
    ok.clean()
    ok.page.evaluate("window.scrollTo(0, 0)")
    ok.page.screenshot(path=str(SCREENSHOTS / "llama-bf16-pass.png"), full_page=False)

"""How fast the HTML report opens as it grows: real reports of the built-in Llama over more and
more steps (fp32 reference vs bf16 target, stats mode), each rendered and opened in headless
chromium. Prints per report its entries, file size, render time, and the time until the page
is usable (table rows, chart points and module map drawn), and each time over the smallest
report's, measured in one run.

    python bench/report_open.py                 # 2, 40 and 200 steps (~500 to ~50k entries)
    python bench/report_open.py --steps 2,20    # other sizes

Needs chromium (apt-get install -y chromium) and playwright (the dev extra).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="2,40,200", help="Llama steps per report (default: 2,40,200)")
    args = ap.parse_args()
    chromium = os.environ.get("DRIFTCHECK_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        print("report_open.py: no chromium binary", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from _common import llama_stats_report
    from driftcheck.report.html import render_html

    rows = []
    with tempfile.TemporaryDirectory(prefix="dc-bench-open-") as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--headless", "--no-sandbox", "--disable-gpu"])
        for steps in [int(s) for s in args.steps.split(",")]:
            work = Path(tmp) / f"s{steps}"
            report = llama_stats_report(work, steps)
            t0 = time.perf_counter()
            html = render_html(report)
            render = time.perf_counter() - t0
            path = work / "report.html"
            path.write_text(html, encoding="utf-8")
            opened = []
            for _ in range(3):  # the best of three opens, each in a fresh page
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                t0 = time.perf_counter()
                page.goto(path.as_uri())
                page.wait_for_selector("#entries-table tbody tr")
                page.wait_for_selector("#ratio-chart .scatterlayer .point")
                page.wait_for_selector("#module-map .hm, #module-map image")
                opened.append(time.perf_counter() - t0)
                page.close()
            rows.append((steps, len(report.entries), len(html), render, min(opened)))
            shutil.rmtree(work)
        browser.close()
    base = rows[0][4]
    print("| steps | entries | HTML | render | open (usable) | open / smallest |")
    print("|---|---|---|---|---|---|")
    for steps, n, size, render, opened in rows:
        print(f"| {steps} | {n} | {size / 1e6:.1f} MB | {render:.2f} s | {opened:.2f} s | {opened / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

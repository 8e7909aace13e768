"""Regenerate the report screenshots in docs/screenshots/ (the README's picture among them).

    python docs/screenshots/make.py            # needs chromium (apt-get install -y chromium) and playwright

Records the built-in Llama as an fp32 reference and two bf16 targets from its replay, a clean
one and one with a defect injected (one Linear's output x1.25), plus the built-in ResNet on a
backend that never updates BatchNorm running statistics; renders each HTML report and takes its
screenshots in headless chromium. Run it on purpose when the report's look changes; the test
suite never writes into docs/.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("DRIFTCHECK_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def reports(work: Path) -> dict[str, object]:
    from torch import nn

    from driftcheck.compare import compare
    from driftcheck.targets.faults import scale_output
    from driftcheck.loader import load_scenario
    from driftcheck.record.runner import record

    def rec(name: str, out: str, **kw) -> Path:
        return record(load_scenario(name), work / out, force=True, model_id=name, **kw)

    ref = rec("llama", "llama-fp32")
    lins = [n for n, m in load_scenario("llama").model.named_modules() if isinstance(m, nn.Linear)]
    bad = rec("llama", "llama-bad", dtype="bf16", replay=ref, target_hooks=scale_output(lins[len(lins) // 2], 1.25))
    good = rec("llama", "llama-bf16", dtype="bf16", replay=ref)
    bn_ref = rec("resnet", "resnet-ref", view_audit=True)
    bn_bad = rec("resnet", "resnet-bn", replay=bn_ref, view_audit=True, simulate="skip-bn-stats")
    return {"llama-fault": compare(ref, bad), "llama-bf16-pass": compare(ref, good),
            "resnet-batchnorm": compare(bn_ref, bn_bad)}


def main() -> int:
    if CHROMIUM is None:
        print("make.py: no chromium binary (apt-get install -y chromium, or set DRIFTCHECK_CHROMIUM)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from driftcheck.report.html import render_html

    with tempfile.TemporaryDirectory(prefix="driftcheck-shots-") as tmp, sync_playwright() as p:
        work = Path(tmp)
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name, report in reports(work).items():
            html = work / f"{name}.html"
            html.write_text(render_html(report), encoding="utf-8")
            page.goto(html.as_uri())
            page.wait_for_selector("#ratio-chart .scatterlayer .point")
            page.screenshot(path=str(HERE / f"{name}.png"))  # the top: verdict, conclusion, chart
            page.eval_on_selector("#map", "e => e.scrollIntoView()")
            page.screenshot(path=str(HERE / f"{name}-map.png"))
            print(f"docs/screenshots/{name}.png, {name}-map.png: {report.verdict}")
        browser.close()
    for stale in ("report-fail.png", "report-pass.png"):  # made by the tests before this script
        (HERE / stale).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How big the HTML report is, and what it is made of: real reports of the built-in Llama (fp32
reference vs bf16 target, stats mode) over a few step counts, rendered, and each page split into
the plotly.js bundle, the entry table's JSON, the module map's JSON and the rest (markup, CSS,
the page's JS, the details' SVG histograms). Sizes are bytes of UTF-8; MB is 10^6 bytes.

    python bench/report_size.py                        # 2 and 42 steps (482 and ~10k entries)
    python bench/report_size.py --steps 2 --keep DIR   # also keep each report.json and report.html
    python bench/report_size.py --measure A.html ...   # split pages already written (any version)

The budgets (tests/report/test_report_size.py): 1.5 MB for the demo, 2 MB for 10k entries.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def parts(html: str) -> dict[str, int]:
    """The page's bytes by part: its largest inline script is the chart library."""
    out = {"total": len(html.encode()), "entries-data": 0, "map-data": 0}
    scripts = []
    for m in re.finditer(r"<script([^>]*)>(.*?)</script>", html, re.S):
        name = re.search(r'id="([^"]+)"', m.group(1))
        size = len(m.group(2).encode())
        if name and name.group(1) in out:
            out[name.group(1)] = size
        else:
            scripts.append(size)
    out["plotly.js"] = max(scripts, default=0)
    out["rest"] = out["total"] - out["plotly.js"] - out["entries-data"] - out["map-data"]
    return out


def row(label: str, entries: int | str, html: str) -> str:
    p = parts(html)
    per = (p["entries-data"] + p["map-data"]) / entries if isinstance(entries, int) and entries else float("nan")
    return (f"| {label} | {entries} | {p['total'] / 1e6:.2f} MB | {p['plotly.js'] / 1e6:.2f} MB | "
            f"{p['entries-data'] / 1e3:.0f} kB | {p['map-data'] / 1e3:.0f} kB | {p['rest'] / 1e3:.0f} kB | "
            f"{per:.0f} B |")


HEADER = ("| report | entries | HTML | plotly.js | table JSON | map JSON | rest | JSON per entry |\n"
          "|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="2,42", help="Llama steps per report (default: 2,42)")
    ap.add_argument("--keep", type=Path, help="write each report.json and report.html here")
    ap.add_argument("--measure", nargs="+", type=Path, help="only split these HTML files")
    args = ap.parse_args()
    print(HEADER)
    if args.measure:
        for path in args.measure:
            html = path.read_text(encoding="utf-8")
            data = re.search(r'<footer>.*?(\d+) entries', html, re.S)
            print(row(path.name, int(data.group(1)) if data else "?", html))
        return 0

    from _common import llama_stats_report
    from driftcheck.report.html import render_html

    with tempfile.TemporaryDirectory(prefix="dc-bench-size-") as tmp:
        for steps in [int(s) for s in args.steps.split(",")]:
            work = Path(tmp) / f"s{steps}"
            report = llama_stats_report(work, steps)
            html = render_html(report)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"llama-{steps}.json").write_text(json.dumps(report.to_dict()), encoding="utf-8")
                (args.keep / f"llama-{steps}.html").write_text(html, encoding="utf-8")
            print(row(f"llama, {steps} steps", len(report.entries), html), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

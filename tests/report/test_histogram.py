"""The report's error histogram: a small static SVG drawn without a plotting library."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from driftcheck.report.histogram import histogram_svg

NS = "{http://www.w3.org/2000/svg}"


def test_bars_ticks_and_the_floor_line() -> None:
    hist = {"edges": [-8.0, -7.0, -6.0, -5.0, -4.0], "counts": [3, 0, 40, 7]}
    svg = histogram_svg(hist, 10 ** -3.5)
    root = ET.fromstring(svg)  # well-formed XML: inline in the page as it is
    assert root.get("class") == "chart" and root.get("role") == "img"
    rects = root.findall(f"{NS}rect")
    assert len(rects) == 3  # the empty bin draws nothing
    heights = [float(r.get("height")) for r in rects]
    assert heights[1] == max(heights) and math.isclose(heights[1] / heights[0], 40 / 3, rel_tol=1e-2)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "floor" in texts and "40" in texts and "-6" in texts and "elements" in texts
    dashed = [p for p in root.iter(f"{NS}path") if p.get("stroke-dasharray")]
    assert len(dashed) == 1  # the floor, at log10 floor, right of every bar
    x_floor = float(dashed[0].get("d").split()[0][1:])
    assert all(float(r.get("x")) + float(r.get("width")) < x_floor for r in rects)


def test_no_floor_no_line_and_bad_bins_no_chart() -> None:
    hist = {"edges": [-3.0, -2.0], "counts": [5]}
    root = ET.fromstring(histogram_svg(hist, None))
    assert not [p for p in root.iter(f"{NS}path") if p.get("stroke-dasharray")]
    assert histogram_svg({"edges": [-3.0, -2.0], "counts": [1, 2]}, 1e-3) == ""  # edges do not fit counts
    assert histogram_svg({"edges": [-3.0, float("inf")], "counts": [1]}, 1e-3) == ""
    assert histogram_svg({}, 1e-3) == ""


def test_the_label_is_escaped() -> None:
    svg = histogram_svg({"edges": [0.0, 1.0], "counts": [1]}, None, label='"><script>x</script>')
    assert "<script>" not in svg and ET.fromstring(svg).get("aria-label") == '"><script>x</script>'

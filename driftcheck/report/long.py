"""A long run's verdict for people: one line per phase in the terminal, and a self-contained HTML
page with the loss curves of reference, target and control and the target's distance against
the band, the first bad step marked."""
from __future__ import annotations

import math
from typing import Any

from driftcheck.report.html import environment
from driftcheck.report.page_data import plotly_js, script_json


def side_words(run: dict[str, Any] | None) -> str:
    if not run:
        return "none"
    words = f"{run.get('device', '?')} {run.get('dtype', '?')}"
    if run.get("autocast"):
        words += f" under {run['autocast']} autocast"
    if run.get("perturbed"):
        words += ", weights 1 ulp off"
    return words


def terminal_lines(rep: Any, full: Any = None) -> list[str]:
    """The verdict, one line per phase: the run, the band, the first bad step in full."""
    lines = [f"long run: {rep.steps} steps of {rep.reference.get('model_id', '?')}; reference "
             f"{side_words(rep.reference)}, target {side_words(rep.target)}, control "
             f"{side_words(rep.control)}",
             f"{rep.verdict.upper()} band ({rep.band:g}x the control): {rep.sentence}"]
    if full is not None:
        from driftcheck.report.common import conclusion

        lines.append(f"{full.verdict.upper()} step {rep.first_bad_step} in full: {conclusion(full)}")
    return lines


def render_long_html(rep: Any, full: Any = None) -> str:
    from driftcheck.report.common import conclusion

    band_line = None if rep.envelope is None else [rep.band * e for e in rep.envelope]
    data = {"loss": {k: [_num(x) for x in v] for k, v in rep.loss.items()},
            "sample_steps": rep.sample_steps, "target_distance": [_num(x) for x in rep.target_distance],
            "control_distance": None if rep.control_distance is None else [_num(x) for x in rep.control_distance],
            "band_line": None if band_line is None else [_num(x) for x in band_line],
            "first_bad_step": rep.first_bad_step}
    return environment().get_template("long.html.j2").render(
        verdict=rep.verdict, passed=bool(rep), model=rep.reference.get("model_id", "?"), steps=rep.steps,
        sentence=rep.sentence, reference=side_words(rep.reference), target=side_words(rep.target),
        control=side_words(rep.control), band=f"{rep.band:g}", first_bad=rep.first_bad_step,
        module=rep.first_bad_module, full=conclusion(full) if full is not None else None,
        data=script_json(data), plotly_js=plotly_js())


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None

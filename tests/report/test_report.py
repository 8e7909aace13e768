"""The Report value objects and their one JSON form (driftcheck/report/__init__.py)."""
from __future__ import annotations

import json
import math

from driftcheck.gate.report import DRIFT, OK, Entry, Finding, Report, as_float, worst


def _entry(key: str, ratio, status: str = OK) -> Entry:
    return Entry(key=key, module="m", phase="forward", step=0, call=0, slot="output",
                 order=0, metrics={"rms": 1.0}, floor=1.0, ratio=ratio, status=status)


def _report(entries: list[Entry], verdict: str = "pass") -> Report:
    return Report(verdict=verdict, reference={"device": "cpu"}, target={"device": "cpu"},
                  first_divergence=None, entries=entries,
                  findings=[Finding("view.alias_lost", "m", 0, "lost", details={"x": math.inf})],
                  limit=3.5)


def test_truth_value_is_the_verdict():
    assert bool(_report([], "pass")) and not bool(_report([], "fail"))


def test_json_round_trip_keeps_inf_and_nan():
    rep = _report([_entry("a", math.inf, DRIFT), _entry("b", math.nan, DRIFT), _entry("c", 1.5)])
    text = json.dumps(rep.to_dict(), allow_nan=False)  # strict JSON: inf/nan spelled as strings
    back = Report.from_dict(json.loads(text))
    ratios = [e.ratio for e in back.entries]
    assert ratios[0] == math.inf and math.isnan(ratios[1]) and ratios[2] == 1.5
    assert back.findings[0].details["x"] == math.inf
    assert back.to_dict() == json.loads(text)


def test_from_dict_refuses_other_documents():
    for doc in ({}, {"schema": "other/1"}, {"schema": "driftcheck.report/99"}, []):
        try:
            Report.from_dict(doc)
        except ValueError:
            continue
        raise AssertionError(f"accepted {doc!r}")


def test_worst_puts_nan_first_and_skips_unjudged():
    es = [_entry("a", 2.0), _entry("b", None), _entry("c", math.nan), _entry("d", 9.0),
          _entry("e", "inf")]
    assert [e.key for e in worst(es, 10)] == ["c", "e", "d", "a"]
    assert [e.key for e in _report(es).worst(2)] == ["c", "e"]


def test_as_float_reads_json_spellings():
    assert as_float("inf") == math.inf and as_float("-inf") == -math.inf
    assert math.isnan(as_float("nan")) and as_float(None) is None and as_float(True) is None
    assert as_float(3) == 3.0 and as_float("x") is None


def test_compare_writes_each_limit_and_gate_and_renderers_only_read_them(traces):
    """The policy is applied once, in compare: a renderer shows the limit compare judged with,
    even when the embedded policy is changed afterwards."""
    from driftcheck.compare import compare
    from driftcheck.report.junit import render_junit
    from driftcheck.report.markdown import render_markdown

    rep = compare(traces["mlp"]["fp32"], traces["mlp"]["bf16"], limit=5.0)
    assert rep.entries and {e.limit for e in rep.entries} == {5.0}
    assert {e.rule for e in rep.entries if e.decided_by != "exact"} == {"--limit 5"}
    kinds = {f.kind: f.gate for f in rep.findings}
    assert kinds.get("precision.settings_differ") == "warning"
    doc = rep.to_dict()
    assert all(e["limit"] == 5.0 for e in doc["entries"]) and all("gate" in f for f in doc["findings"])
    rep.policy = {"limit": 100.0}  # not re-judged by the renderers
    assert "| 100 |" not in render_markdown(rep)
    assert "limit 100" not in render_junit(rep) and "limit 5" in render_junit(rep)


def test_json_form_of_a_real_report_is_what_asdict_and_json_dumps_made(traces):
    """Entries and findings are turned into dicts directly, the report's JSON text written by
    jsonform.dumps (both faster): the same dicts as clean(dataclasses.asdict(...)) and the same
    text as json.dumps(..., indent=1, allow_nan=False, default=str), on a compare's report."""
    import dataclasses

    from driftcheck.compare import compare
    from driftcheck.gate.jsonform import clean, dumps

    rep = compare(traces["llama"]["fp32"], traces["llama"]["bf16"])
    assert rep.entries and rep.findings
    for e in rep.entries:
        assert e.to_dict() == clean(dataclasses.asdict(e))
    for f in rep.findings:
        old = clean(dataclasses.asdict(f))
        if old["gate"] is None:
            del old["gate"]
        assert f.to_dict() == old
    doc = rep.to_dict()
    assert dumps(doc) == json.dumps(doc, indent=1, allow_nan=False, default=str)


def test_a_report_saved_without_limits_gets_them_from_its_policy():
    """A report JSON from before limits and gates were written: loading it applies its embedded
    policy once (an override, an ignore rule), so the renderers still only read."""
    rep = _report([_entry("a", 2.0)])
    doc = rep.to_dict()
    for e in doc["entries"]:
        del e["limit"]
    for f in doc["findings"]:
        del f["gate"]
    doc["policy"] = {"limit": 3.5, "overrides": [{"glob": "m", "limit": 9.0}],
                     "ignore": [{"kind": "view", "reason": "known"}]}
    back = Report.from_dict(doc)
    assert back.entries[0].limit == 9.0
    assert back.findings[0].gate == "ignored" and back.findings[0].details["ignored"] == "known"


def test_the_terminal_folds_many_warnings_of_a_kind_and_prints_every_error():
    """A compiled target's capture gaps come one per Dropout of the model (Hugging Face's
    TimeSformer: 16): past the third module the terminal names them in one line; errors are
    never folded."""
    import io

    from rich.console import Console

    from driftcheck.report.terminal import WARNINGS_PER_KIND, render_terminal

    gaps = [Finding("compile.capture_gap", f"layer.{i}.dropout", 0, "2 gradient(s) not judged",
                    severity="warning") for i in range(WARNINGS_PER_KIND + 4)]
    errors = [Finding("view.alias_lost", f"block.{i}", 0, "lost") for i in range(WARNINGS_PER_KIND + 2)]
    rep = Report(verdict="fail", reference={"device": "cpu"}, target={"device": "cpu"},
                 first_divergence=None, entries=[_entry("a", 1.0)], findings=gaps + errors, limit=3.5)
    out = io.StringIO()
    render_terminal(rep, Console(file=out, width=400, color_system=None))
    lines = out.getvalue().splitlines()
    assert [ln for ln in lines if ln.startswith("compile.capture_gap layer.")] == \
        [f"compile.capture_gap layer.{i}.dropout step 0: 2 gradient(s) not judged"
         for i in range(WARNINGS_PER_KIND)]
    folded = [ln for ln in lines if ln.startswith("compile.capture_gap: ")]
    assert len(folded) == 1 and "at 4 more module(s) (layer.3.dropout, layer.4.dropout, " \
        "layer.5.dropout, ...)" in folded[0]
    assert sum(ln.startswith("view.alias_lost block.") for ln in lines) == len(errors)

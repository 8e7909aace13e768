"""JUnit XML and the Markdown summary: counts, failures, messages and escaping."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from conftest_report import DIVERGING, HOSTILE_NAMES, MODULES, failing_report, hostile_report, passing_report, rejudged

from driftcheck.gate.report import DRIFT
from driftcheck.report.junit import MAX_LINES, render_junit
from driftcheck.report.markdown import md, render_markdown


def cases(xml: str) -> dict[tuple[str, str], ET.Element]:
    root = ET.fromstring(xml)
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    out = {(c.get("classname"), c.get("name")): c for c in suite.findall("testcase")}
    for el in (root, suite):  # the counts agree with the testcases
        assert int(el.get("tests")) == len(out)
        assert int(el.get("failures")) == sum(c.find("failure") is not None for c in out.values())
        assert int(el.get("skipped")) == sum(c.find("skipped") is not None for c in out.values())
    return out


def test_failing_report_junit() -> None:
    got = cases(render_junit(failing_report()))
    modules = {n for (cls, n) in got if cls == "driftcheck.module"}
    assert modules == {m or "(model)" for m in MODULES}
    failed = {n for (cls, n), c in got.items() if cls == "driftcheck.module" and c.find("failure") is not None}
    # Drift enters at layers.1.mlp and propagates downstream; layers.0.attn has a misaligned entry.
    assert failed == {DIVERGING, "norm.bn", "lm_head", "(model)", "layers.0.attn"}
    failure = got[("driftcheck.module", DIVERGING)].find("failure")
    message = failure.get("message")
    assert failure.get("type") == "drift"
    assert "worst forward step 1 output: drift, ratio 95.3 > limit 4 (default limit 4)" in message
    assert "max_abs" in message and "rel_l2" in message
    assert "forward step 0 call 0 output: drift, ratio 79.7 > limit 4, local ratio 71 (default limit 4)" in failure.text
    lm_head = got[("driftcheck.module", "lm_head")].find("failure")
    assert lm_head.get("type") == "nonfinite" and "NaN/Inf in the target only" in lm_head.get("message")
    assert got[("driftcheck.module", "layers.0.attn")].find("failure").get("type") == "misaligned"

    findings = {n: c for (cls, n), c in got.items() if cls == "driftcheck.finding"}
    assert len(findings) == 6
    failing = {n for n, c in findings.items() if c.find("failure") is not None}
    assert failing == {"batchnorm.running_stats_not_updated @ norm.bn step 0",
                       "view.aliasing_lost @ layers.0.attn step 0",
                       "inplace.overlap @ layers.1.mlp step 0", "nonfinite.target_only @ lm_head step 1",
                       "alignment.missing @ layers.0.attn step 1"}
    assert "warning:" in findings["precision.matmul_differs @ (model)"].find("system-out").text
    verdict = got[("driftcheck.verdict", "verdict")].find("failure")
    # the conclusion in words on the failure, the rule that decided it in its text
    assert verdict.get("message").startswith(f"{DIVERGING}'s forward output at step 0 is ")
    assert "a defect on the target, not precision" in verdict.get("message")
    assert verdict.text.startswith(f"first divergence at {DIVERGING}")
    props = {p.get("name"): p.get("value") for p in ET.fromstring(render_junit(failing_report())).iter("property")}
    assert props["verdict"] == "fail" and props["target.device"] == "tpu"
    assert props["first_divergence"] == f"{DIVERGING} forward step 0"


def test_passing_report_junit() -> None:
    got = cases(render_junit(passing_report()))
    assert not [k for k, c in got.items() if c.find("failure") is not None]
    assert got[("driftcheck.verdict", "verdict")].find("failure") is None
    assert "within limits" in got[("driftcheck.module", "lm_head")].find("system-out").text


def test_ignored_entries_and_findings_are_skipped() -> None:
    report = failing_report()
    for e in report.entries:
        if e.module == "embed":
            e.status, e.rule = "ignored", "embedding differs by design"
    report.policy["ignore"].append({"glob": "norm.bn", "kind": "batchnorm", "reason": "known torch_tpu bug #7"})
    got = cases(render_junit(rejudged(report)))
    skipped = got[("driftcheck.module", "embed")].find("skipped")
    assert skipped is not None and skipped.get("message") == "ignored: embedding differs by design"
    bn = got[("driftcheck.finding", "batchnorm.running_stats_not_updated @ norm.bn step 0")]
    assert bn.find("failure") is None and bn.find("skipped").get("message") == "ignored: known torch_tpu bug #7"


def test_long_failure_lists_are_capped() -> None:
    report = failing_report()
    template = next(e for e in report.entries if e.module == DIVERGING and e.status == DRIFT)
    for call in range(1, MAX_LINES + 20):
        report.entries.append(type(template)(**{**template.__dict__, "call": call, "key": f"{template.key}#{call}"}))
    failure = cases(render_junit(report))[("driftcheck.module", DIVERGING)].find("failure")
    lines = failure.text.splitlines()
    assert len(lines) == MAX_LINES + 1 and lines[-1].startswith("... and ")


def test_hostile_names_are_valid_xml() -> None:
    report = hostile_report()
    report.entries[0].module = "bad\x1b[31mname\x00"
    xml = render_junit(report)
    got = cases(xml)  # parses: control characters are replaced, markup is escaped
    names = {n for _, n in got}
    assert HOSTILE_NAMES[0] in names and "bad\ufffd[31mname\ufffd" in names


def test_markdown_failing() -> None:
    text = render_markdown(failing_report())
    assert text.startswith("## driftcheck: ❌ FAIL · tiny\\_gpt\\_bn")
    assert f"\n**{DIVERGING}'s forward output at step 0 is 79.7x what " in text  # the conclusion first
    assert f"Decided by: first divergence at {DIVERGING} (forward, step 0)" in text
    assert f"**First divergence:** {DIVERGING} · forward · step 0 · output — ratio 79.7 (local 71)" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 10  # header + worst 10
    assert table[1].startswith("| lm\\_head | backward | 1 | grad\\_output.0 | nonfinite | inf |")
    assert "### Findings (6, 5 fail the gate)" in text
    bullets = [line for line in text.splitlines() if line.startswith("- ")]
    assert [b[2] for b in bullets].count("❌") == 5 and bullets[-1].startswith("- ⚠️ **precision.matmul\\_differs**")
    assert "at norm.bn step 0:" in text


def test_markdown_passing() -> None:
    text = render_markdown(passing_report())
    assert text.startswith("## driftcheck: ✅ PASS")
    assert "**First divergence:** none" in text and "130 ok" in text


def test_markdown_escapes_markup() -> None:
    text = render_markdown(hostile_report())
    assert "<script>" not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert md("a|b*c_`d`$x^2$\nnext") == "a\\|b\\*c\\_\\`d\\`\\$x^2\\$ next"
    for line in text.splitlines():
        if line.startswith("| "):
            assert line.count(" | ") == 9, line  # no cell broke out of the table

"""The pytest plugin in a user's own suite (pytester, a fresh pytest process each): goldens
recorded once, the target checked against them, a fault failing the test with the verdict line
and the reports written beside pytest's JUnit file."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ["pytester"]

SCENARIO = textwrap.dedent('''
    import os
    import torch
    from torch import nn
    from driftcheck import Scenario
    from driftcheck.targets import faults

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32),
                              nn.Linear(32, 4))
        if os.environ.get("DC_FAULT"):
            faults.scale_output("2", 1.2)(model)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(16, 8, generator=g) for _ in range(2)]
        return Scenario(model=model, inputs=xs, loss=lambda out, x: out.pow(2).mean(),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2, name="mlp")
''')

TEST = textwrap.dedent('''
    def test_mlp_on_the_target(driftcheck_gate):
        report = driftcheck_gate.check("model_code.py:build", name="mlp")
        assert report.verdict == "pass"
''')


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    monkeypatch.delenv("DC_FAULT", raising=False)
    pytester.makepyfile(model_code=SCENARIO, test_gate=TEST)
    return pytester


def test_golden_then_pass_then_fault_fails_with_the_verdict(suite, monkeypatch):
    rec = suite.runpytest_subprocess("--driftcheck-record-golden", "-p", "no:cacheprovider", "-rs")
    rec.assert_outcomes(skipped=1)
    rec.stdout.fnmatch_lines(["*driftcheck: recorded the golden trace *golden/mlp*"])
    assert (suite.path / "golden" / "mlp" / "manifest.json").is_file()

    ok = suite.runpytest_subprocess("--driftcheck-dtype", "bf16", "-p", "no:cacheprovider")
    ok.assert_outcomes(passed=1)
    results = suite.path / "driftcheck-results" / "test_gate.py_test_mlp_on_the_target" / "mlp"
    assert {"report.html", "junit.xml", "summary.md", "report.json", "target"} <= {p.name for p in results.iterdir()}

    monkeypatch.setenv("DC_FAULT", "1")
    bad = suite.runpytest_subprocess("--driftcheck-dtype", "bf16", "-p", "no:cacheprovider",
                                     "--junitxml", "out/pytest.xml")
    bad.assert_outcomes(failed=1)
    bad.stdout.fnmatch_lines(["*driftcheck FAIL 2's forward output at step 0 is *x what bfloat16 vs "
                              "float32 explains: a defect on the target, not precision.*"])
    beside = suite.path / "out" / "driftcheck" / "test_gate.py_test_mlp_on_the_target" / "mlp"
    assert (beside / "report.html").is_file()
    junit = (suite.path / "out" / "pytest.xml").read_text()
    assert 'name="driftcheck_report"' in junit and str(beside / "report.html") in junit


def test_a_missing_golden_or_device_fails_the_test_in_one_line(suite):
    missing = suite.runpytest_subprocess("-p", "no:cacheprovider")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*driftcheck: no golden trace *golden/mlp: record it on the "
                                  "reference machine with pytest --driftcheck-record-golden*"])
    suite.runpytest_subprocess("--driftcheck-record-golden", "-p", "no:cacheprovider").assert_outcomes(skipped=1)
    tpu = suite.runpytest_subprocess("--driftcheck-device", "tpu", "-p", "no:cacheprovider")
    tpu.assert_outcomes(failed=1)
    tpu.stdout.fnmatch_lines(["*driftcheck: *torch_tpu*"])


def test_the_plugin_is_registered_and_cheap_without_the_fixture(pytester):
    pytester.makepyfile(test_plain="def test_nothing():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--trace-config")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*driftcheck.integrations.pytest_plugin*"])
    # every user of the package loads the plugin: it must not import torch until a test asks
    proc = subprocess.run([sys.executable, "-c", "import sys, driftcheck.integrations.pytest_plugin; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr

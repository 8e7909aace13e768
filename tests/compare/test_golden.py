"""Golden traces (golden/, made by golden/make.sh): a fresh CPU record from each golden replay
must match its golden trace. This is the CI gate of a hardware migration, run on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BUILTINS, record_builtin

from driftcheck.compare import compare
from driftcheck.store import TraceReader

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


@pytest.mark.parametrize("name", BUILTINS)
def test_rerecord_matches_golden(name, tmp_path):
    golden = GOLDEN / name
    assert (golden / "manifest.json").is_file(), f"golden/{name} is missing: run bash golden/make.sh"
    steps = TraceReader(golden).run["steps"]
    fresh = record_builtin(name, tmp_path / name, replay=golden, steps=steps)
    rep = compare(golden, fresh)
    assert rep.verdict == "pass", rep.decided_by
    assert not rep.findings or all(f.severity != "error" for f in rep.findings)


def test_golden_catches_a_changed_model(tmp_path):
    from conftest import a_middle_linear

    from driftcheck.targets.faults import scale_output

    golden = GOLDEN / "llama"
    mod = a_middle_linear("llama")
    fresh = record_builtin("llama", tmp_path / "t", replay=golden, steps=1,
                           target_hooks=scale_output(mod, 1.01))
    rep = compare(golden, fresh)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == mod

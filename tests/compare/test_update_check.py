"""The optimizer update's own error, end to end: a target whose optimizer scales the update of
one module's parameters by 2% (bf16) or 0.1% (fp32) fails, and the first divergence is that
module's parameter after the step, judged by its local ratio (the step redone ideally on the
host from the target's own inputs, record/update.py); the clean targets pass with every
parameter's update well inside the limit."""
from __future__ import annotations

import pytest

from driftcheck.compare import compare
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record
from driftcheck.store import TraceReader
from driftcheck.targets import stepfaults

LEAF = "layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("update")
    record(load_scenario("llama"), root / "ref", dtype="fp32")
    return root


def _target(root, dtype, factor):
    fault = stepfaults.scale_update(LEAF, factor) if factor else None
    out = root / f"{dtype}-{factor}"
    try:
        record(load_scenario("llama"), out, dtype=dtype, replay=root / "ref", local=root / "ref",
               force=True, target_hooks=fault)
    finally:
        if fault is not None:
            fault.remove()
    return out, compare(root / "ref", out)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_clean_target_passes_with_every_update_judged(ref, dtype):
    out, rep = _target(ref, dtype, None)
    assert rep.verdict == "pass"
    updates = [e for e in rep.entries if e.phase == "optimizer" and e.slot.startswith("param.")]
    judged = [e for e in updates if e.local_ratio is not None]
    assert judged and len(judged) == len(updates)  # every parameter's step redone and judged
    assert max(e.local_ratio for e in judged) < rep.limit / 1.5
    slots = {e["slot"] for e in TraceReader(out).entries if e["phase"] == "optimizer"}
    assert "local.param.weight" in slots and "local.param_noise.weight" in slots


@pytest.mark.parametrize("dtype,factor", [("bf16", 1.02), ("fp32", 1.001)])
def test_a_scaled_update_fails_and_names_the_module(ref, dtype, factor):
    _, rep = _target(ref, dtype, factor)
    assert rep.verdict == "fail"
    fd = rep.first_divergence
    assert fd["phase"] == "optimizer" and fd["module"] == LEAF and fd["step"] == 0
    assert fd["local_ratio"] > rep.limit and fd["ratio"] <= rep.limit  # the propagated floor allows it
    assert "redone ideally" in rep.decided_by

"""Diagnosis: local replay (what a module adds vs what it inherits), the three-way comparison
against a float64 truth, and the NaN/Inf origin."""
from __future__ import annotations

import pytest
import torch

from driftcheck.cli import main
from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record
from driftcheck.store import TraceReader
from driftcheck.targets import faults


def _by_key(path):
    r = TraceReader(path)
    return r, {e["key"]: e for e in r.entries}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    for name in ("mlp", "resnet"):
        record(load_scenario(name), root / name / "ref", dtype="fp32")
    return root


# -- local replay --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "resnet"])  # dropout masks; BatchNorm + in-place ReLU
def test_local_replay_disturbs_nothing(refs, name):
    d = refs / name
    record(load_scenario(name), d / "plain", dtype="bf16", replay=d / "ref", force=True)
    record(load_scenario(name), d / "local", dtype="bf16", replay=d / "ref", local=d / "ref", force=True)
    a, am = _by_key(d / "plain")
    b, bm = _by_key(d / "local")
    local = [k for k, e in bm.items() if e["slot"].startswith("local.")]
    assert local and set(bm) - set(local) == set(am)
    for k, e in am.items():  # every real capture bitwise the same, BatchNorm buffers included
        assert torch.equal(a.tensor(e), b.tensor(bm[k])), k
        assert e["order"] == bm[k]["order"], k


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_fp32_local_replay_reproduces_the_reference_exactly(refs, name):
    d = refs / name
    record(load_scenario(name), d / "fp32local", dtype="fp32", replay=d / "ref", local=d / "ref", force=True)
    r, rm = _by_key(d / "ref")
    t, tm = _by_key(d / "fp32local")
    # (the optimizer phase's local entries are the step redone ideally, record/update.py)
    local = [e for e in tm.values() if e["slot"].startswith("local.") and e["phase"] != "optimizer"]
    phases = {e["phase"] for e in local}
    assert phases == {"forward", "backward"}
    for e in local:  # same inputs, same parameters, same dropout mask: the same numbers
        ref_key = e["key"].replace("/local.", "/")
        assert torch.equal(t.tensor(e), r.tensor(rm[ref_key])), e["key"]


def test_local_needs_replay_of_the_same_reference(refs, tmp_path):
    d = refs / "mlp"
    with pytest.raises(DriftcheckError, match="needs --replay"):
        record(load_scenario("mlp"), tmp_path / "x", dtype="bf16", local=d / "ref")
    record(load_scenario("mlp"), tmp_path / "other", dtype="fp32")
    with pytest.raises(DriftcheckError, match="not the trace replayed"):
        record(load_scenario("mlp"), tmp_path / "y", dtype="bf16", replay=d / "ref",
               local=tmp_path / "other")


def test_cli_record_local(refs, tmp_path, capsys):
    d = refs / "mlp"
    with pytest.raises(SystemExit) as exc:
        main(["--quiet", "record", "mlp", "--out", str(tmp_path / "t"), "--dtype", "bf16",
              "--replay", str(d / "ref"), "--local", str(d / "ref")])
    assert exc.value.code == 0
    assert any(e["slot"].startswith("local.") for e in TraceReader(tmp_path / "t").entries)


def test_compare_reports_local_beside_propagated_error(refs):
    d = refs / "mlp"
    record(load_scenario("mlp"), d / "local", dtype="bf16", replay=d / "ref", local=d / "ref", force=True)
    rep = compare(d / "ref", d / "local")
    assert rep.verdict == "pass"
    leaf_out = next(e for e in rep.entries if e.key == "0/forward/fc2/0/output")
    assert leaf_out.local_ratio is not None and 0 < leaf_out.local_ratio < rep.limit
    assert leaf_out.details["local"]["floor"] <= leaf_out.floor  # no inherited part
    assert next(e for e in rep.entries if e.key == "0/backward/fc2/0/grad_input.0").local_ratio is not None
    assert not any(f.kind.startswith("alignment") for f in rep.findings)  # local.* are not extra
    # the model itself is a composite: its own code is replayed with its children answered
    # from the reference (record/own.py), and a clean bf16 target's is within the limit
    own = [e for e in rep.entries if e.module == "" and e.local_ratio is not None]
    assert own and all(e.local_ratio < rep.limit for e in own)


def test_first_divergence_uses_local_error(refs):
    """An error that enters between modules (the parent's code) propagates into the next leaf;
    the leaf's propagated error is over the limit but its local error is not, so it is not
    blamed: the divergence is placed in the parent's code."""
    d = refs / "mlp"
    # fc2's input, computed by the parent MLP.forward from drop1's output, is off by 2%.
    fault = faults.scale_output("drop1", 1.0)

    def hooks(model):
        fault(model)
        orig = model.fc2.forward
        model.fc2.forward = lambda x: orig(x * 1.02)  # inside fc2: fc2's own (local) error

    record(load_scenario("mlp"), d / "t", dtype="bf16", replay=d / "ref", local=d / "ref",
           force=True, target_hooks=hooks)
    rep = compare(d / "ref", d / "t")
    fd = rep.first_divergence
    assert fd["module"] == "fc2" and fd["local_ratio"] > rep.limit
    # The same error made by the parent's code: fc2 inherits it and is not blamed.
    record(load_scenario("mlp"), d / "t2", dtype="bf16", replay=d / "ref", local=d / "ref",
           force=True, target_hooks=faults.scale_output("drop1", 1.02))
    rep2 = compare(d / "ref", d / "t2")
    fc2 = next(e for e in rep2.entries if e.key == "0/forward/fc2/0/output")
    assert fc2.local_ratio < rep2.limit
    assert rep2.first_divergence["module"] == "drop1"


# -- truth ---------------------------------------------------------------------------------------
def test_truth_comparison_records_both_judges(refs):
    d = refs / "mlp"
    record(load_scenario("mlp"), d / "truth", dtype="fp64", replay=d / "ref", force=True)
    record(load_scenario("mlp"), d / "bf16", dtype="bf16", replay=d / "ref", force=True)
    rep = compare(d / "ref", d / "bf16", truth=d / "truth")
    assert rep.verdict == "pass" and rep.truth["dtype"] == "float64"
    judged = [e for e in rep.entries if e.ratio is not None and e.decided_by != "exact"]
    assert judged and all("truth" in e.details for e in judged)
    assert all(e.decided_by in ("analytic", "truth") for e in judged)
    # An fp32 reference is far closer to the truth than any bf16 run: the analytic floor decides.
    assert all(e.decided_by == "analytic" for e in judged)
    assert rep.to_dict()["truth"]["run_id"] == TraceReader(d / "truth").run["run_id"]


def test_truth_clears_a_target_as_close_to_the_truth_as_a_same_precision_reference(tmp_path):
    """bf16 reference vs bf16 target with a different rounding (stochastic): with a limit far
    too tight for bf16 the analytic floor alone fails, the truth rule sees that the target is
    as close to float64 as the reference is, and decides those entries."""
    record(load_scenario("llama"), tmp_path / "ref", dtype="bf16")
    record(load_scenario("llama"), tmp_path / "truth", dtype="fp64", replay=tmp_path / "ref")
    with faults.stochastic_rounding(seed=5):
        record(load_scenario("llama"), tmp_path / "tgt", dtype="bf16", replay=tmp_path / "ref")
    alone = compare(tmp_path / "ref", tmp_path / "tgt", limit=0.5)
    three = compare(tmp_path / "ref", tmp_path / "tgt", limit=0.5, truth=tmp_path / "truth")
    n_alone = sum(e.status == "drift" for e in alone.entries)
    n_three = sum(e.status == "drift" for e in three.entries)
    assert n_alone > 0 and n_three < n_alone
    assert any(e.decided_by == "truth" and e.status == "ok" for e in three.entries)


# -- NaN / Inf origin ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,module", [("bf16", "layers.0.mlp.up_proj"), ("fp16", "layers.1.attn.v_proj")])
def test_nonfinite_origin_names_the_overflowing_module(tmp_path, dtype, module):
    record(load_scenario("llama"), tmp_path / "ref", dtype="fp32")
    record(load_scenario("llama"), tmp_path / "tgt", dtype=dtype, replay=tmp_path / "ref",
           target_hooks=faults.overflow(module))
    rep = compare(tmp_path / "ref", tmp_path / "tgt")
    origin = [f for f in rep.findings if f.kind == "nonfinite.origin"]
    assert len(origin) == 1
    assert (origin[0].module, origin[0].step, origin[0].phase) == (module, 0, "forward")
    assert origin[0].key == f"0/forward/{module}/0/output"
    assert rep.verdict == "fail"


# -- a replay the model cannot see (issue 47, class 2) ------------------------------------------
class _Collecting(torch.nn.Module):
    """A router whose logits a forward hook collects for an auxiliary loss (as transformers'
    output recorders do for MoE router logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 2)
        self.collected: list[torch.Tensor] = []
        self.gate.register_forward_hook(lambda m, a, out: self.collected.append(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.collected.clear()
        return self.head(torch.relu(self.gate(x)))


class _Once(torch.nn.Module):
    """A leaf that refuses a second call per forward of its parent: the local replay is one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("called twice in one step")
        return x @ self.weight


class _Refusing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.once, self.out = _Once(), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.once.calls = 0
        return self.out(torch.relu(self.once(x)))


def _scenario(model: torch.nn.Module, aux: bool):
    from driftcheck import Scenario

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 8, generator=g) for _ in range(2)]

    def loss(out, x):
        main = out.pow(2).mean()
        return main + 0.1 * sum(c.pow(2).mean() for c in model.collected) if aux else main

    return Scenario(model=model, inputs=xs, loss=loss, steps=2,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_the_replay_is_invisible_to_the_models_hooks(tmp_path):
    """An output collector on a replayed leaf used to take the replay's output into the loss:
    every record with a local replay crashed ("backward through the graph a second time")."""
    torch.manual_seed(0)
    ref = record(_scenario(_Collecting(), aux=True), tmp_path / "ref")
    torch.manual_seed(0)
    tgt = record(_scenario(_Collecting(), aux=True), tmp_path / "tgt", dtype="bf16", replay=ref, local=ref)
    r = TraceReader(tgt)
    assert any(e["slot"].startswith("local.") and e["module"] == "gate" for e in r.entries)
    assert not [f for f in r.manifest.get("findings", []) if f["kind"] == "local.replay_failed"]
    assert compare(str(ref), str(tgt))


def test_a_replay_that_raises_is_a_warning_not_a_failed_record(tmp_path):
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _Refusing()

    ref = record(_scenario(build(), aux=False), tmp_path / "ref")
    tgt = record(_scenario(build(), aux=False), tmp_path / "tgt", dtype="bf16", replay=ref, local=ref)
    r = TraceReader(tgt)
    failed = [f for f in r.manifest["findings"] if f["kind"] == "local.replay_failed"]
    assert [f["module"] for f in failed] == ["once"] and "called twice in one step" in failed[0]["message"]
    assert not any(e["slot"].startswith("local.output") and e["module"] == "once" for e in r.entries)
    assert any(e["slot"].startswith("local.") and e["module"] == "out" for e in r.entries)  # the others replay
    report = compare(str(ref), str(tgt))
    assert report and any(f.kind == "local.replay_failed" for f in report.findings)

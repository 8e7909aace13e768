"""Issue 47, class 7 (and class 2): a reversible network, whose custom autograd Function reruns
its blocks in backward and backpropagates through them itself.

- The local replay of the block (its own code, record/own.py) runs that backward too, which
  called torch.autograd.backward with the live parameters: every parameter gradient of the
  target came out twice the reference's. The replay now leaves the live gradients as they are
  (record/isolation.py ``KeptGrads``).
- A defect in the Function's backward first shows in the gradient it hands a rerun child (or
  the input it recomputes for it): blamed on the block whose code reran it, not on the child
  (compare/index.py ``rerun_by``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import DATA, dc

from driftcheck.compare import compare
from driftcheck.compare.index import DependencyIndex
from driftcheck.record.runner import record
from driftcheck.store.reader import TraceReader

_spec = importlib.util.spec_from_file_location("reversible", DATA / "reversible.py")
rev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rev)


def _record(root, name, dtype, **fault):
    old = dict(rev.FAULT)
    rev.FAULT.update(fault)
    try:
        return record(rev.scenario(), root / name, dtype=dtype, replay=root / "ref", local=root / "ref")
    finally:
        rev.FAULT.update(old)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rev")
    record(rev.scenario(), root / "ref")
    for dtype in ("fp32", "bf16"):
        _record(root, f"clean_{dtype}", dtype)
        _record(root, f"dy1_{dtype}", dtype, dy1=1.05)
    _record(root, "x2_fp32", "fp32", x2=1.05)
    return root


def test_the_replay_leaves_the_live_gradients_alone(runs):
    ref, tgt = TraceReader(runs / "ref"), TraceReader(runs / "clean_fp32")
    grads = {e["key"]: e for e in tgt.entries if e["phase"] == "grads"}
    ref_grads = [e for e in ref.entries if e["phase"] == "grads"]
    assert len(ref_grads) == len(grads) > 20
    for e in ref_grads:  # the same code in the same precision on the same host: bit for bit
        assert torch.equal(ref.tensor(e), tgt.tensor(grads[e["key"]])), e["key"]
    assert any(e["slot"].startswith("local.") and e["module"] == "blocks.1" for e in tgt.entries)
    assert compare(runs / "ref", runs / "clean_fp32").verdict == "pass"


@pytest.mark.parametrize("fault,slot", [("dy1", "grad_output"), ("x2", "input.0")])
def test_a_defect_in_the_functions_backward_is_blamed_on_the_block(runs, fault, slot, monkeypatch):
    rep = compare(runs / "ref", runs / f"{fault}_fp32")
    fd = rep.first_divergence
    assert rep.verdict == "fail"
    # the first wrong tensor is the rerun child's (blocks.2.f, its second call: the rerun)
    assert fd["module"].startswith("blocks.2.f") and fd["call"] == 1 and fd["slot"] == slot, fd
    assert fd["blame_module"] == "blocks.2" and "reran" in fd["where"], fd
    monkeypatch.setattr(DependencyIndex, "rerun_by", lambda self, e: None)
    before = compare(runs / "ref", runs / f"{fault}_fp32").first_divergence
    assert before["blame_module"].startswith("blocks.2.f"), before


def test_at_bf16_clean_passes_and_the_defect_is_the_blocks(runs):
    assert compare(runs / "ref", runs / "clean_bf16").verdict == "pass"
    rep = compare(runs / "ref", runs / "dy1_bf16")
    assert rep.verdict == "fail" and rep.first_divergence["blame_module"] == "blocks.2", rep.first_divergence


def test_driftcheck_run_passes_it_clean(tmp_path):
    p = dc("run", f"{DATA / 'reversible.py'}:scenario", "--target", "cpu", "--target-dtype", "bf16",
           "--out", str(tmp_path / "out"), "--no-drill")
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_module_the_loss_code_calls_keeps_its_blame(tmp_path):
    """A call outside the model's forward made before the backward (the loss code reusing a
    module) is no rerun: a defect in the loss code's gradient stays with that call's module."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(torch.tanh(self.body(x)))

    scale = {"g": 1.0}

    class Hurt(torch.autograd.Function):  # the loss code's own backward, 5% off when asked
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * scale["g"]

    def scenario():
        torch.manual_seed(0)
        m = Net()
        x = torch.randn(4, 8)
        return rev.Scenario(model=m, inputs=[x] * 2, loss=lambda out, b: Hurt.apply(m.proj(out)).square().mean(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)

    record(scenario(), tmp_path / "ref")
    scale["g"] = 1.05
    record(scenario(), tmp_path / "tgt", replay=tmp_path / "ref")
    fd = compare(tmp_path / "ref", tmp_path / "tgt").first_divergence
    assert (fd["module"], fd["call"], fd["slot"]) == ("proj", 1, "grad_output"), fd
    assert fd["blame_module"] == "proj", fd

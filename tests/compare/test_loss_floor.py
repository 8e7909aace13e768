"""Issue 47, class 5: the loss after a step that made the model confident. A cross-entropy that
fell from 2.7 to 0.005 in one SGD step moves by its logits' margin's absolute error (it is
exponential in the margin), not by the logits' relative error times the loss: the loss inherits
its inputs' error through the loss function to first order, ||dL/dz||_1 |dz| (compare/
inheritance.py ``loss_of_outputs``). A defect of the loss itself is still caught."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.compare.inheritance import Inheritance
from driftcheck.record.runner import record
from driftcheck.targets import opfaults


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(256, 16)

    def forward(self, x, y):
        return self.fc2(self.act(self.fc1(x)))


def _scenario(seed: int = 0) -> Scenario:
    torch.manual_seed(seed)
    m = _Classifier()
    x, y = torch.randn(8, 32), torch.randint(0, 16, (8,))
    return Scenario(model=m, inputs=[(x, y)] * 2,
                    loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=1.5), steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss")
    record(_scenario(), root / "ref")
    record(_scenario(), root / "bf16", dtype="bf16", replay=root / "ref", local=root / "ref")
    fault = opfaults.scale_op(None, "_log_softmax", 1.05)()
    try:
        record(_scenario(), root / "fault", dtype="bf16", replay=root / "ref", local=root / "ref")
    finally:
        fault.remove()
    return root


def test_a_loss_that_fell_in_one_step_passes_at_bf16(runs, monkeypatch):
    rep = compare(runs / "ref", runs / "bf16")
    losses = {e.step: e for e in rep.entries if e.phase == "loss"}
    assert losses[1].metrics["ref_rms"] < 0.01 < losses[0].metrics["ref_rms"]  # it fell 2.7 -> 0.005
    assert rep.verdict == "pass", rep.decided_by
    assert losses[1].details.get("loss_through_outputs")
    # the loss's floor from the logits' relative error alone: 7.5x on the code before it
    monkeypatch.setattr(Inheritance, "loss_of_outputs", lambda self, x, rel: rel)
    before = compare(runs / "ref", runs / "bf16")
    assert before.verdict == "fail" and before.first_divergence["phase"] == "loss"


def test_a_wrong_loss_is_still_caught(runs):
    rep = compare(runs / "ref", runs / "fault")
    assert rep.verdict == "fail"
    fd = rep.first_divergence
    assert (fd["phase"], fd["step"]) == ("loss", 0), fd

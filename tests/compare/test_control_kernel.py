"""A control run whose own kernel is wrong vouches for nothing (issue 47, the control run). A CPU
bf16 Conv2d for few input channels and a large kernel is ~120% off on AMX CPUs
(bench/kernel_check.py): a CPU bf16 control shares that kernel with a CPU bf16 target and, both
equally wrong, passed the target there and named the model's code as sensitive. Now the
control's local replay of a Linear or convolution is checked against rounding the op's operands
to the precision (compare/products.py, the arithmetic after exact): further off than that, it
gives no word (``precision.control_kernel``). Simulated here by the same 5% fault in the
convolution of the target and of the control, so the test does not depend on the CPU."""
from __future__ import annotations

import pytest
import torch
from conftest import record_side
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.compare.opinions import Opinions
from driftcheck.record.runner import record
from driftcheck.targets import opfaults


class _Patches(nn.Module):
    def __init__(self, weight_norm: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 32, 3, padding=1)
        self.act = nn.Tanh()
        self.proj = nn.Conv2d(32, 32, 4, stride=4)  # a patch embedding (32 channels: a shape this CPU gets right)
        self.head = nn.Linear(32 * 4 * 4, 10)
        if weight_norm:  # its weight a parametrization, as wav2vec2's positional convolution's
            self.proj = nn.utils.parametrizations.weight_norm(self.proj, dim=2)

    def forward(self, x, y):
        return self.head(self.proj(self.act(self.stem(x))).flatten(1))


def _scenario(weight_norm: bool = False) -> Scenario:
    torch.manual_seed(0)
    x, y = torch.randn(2, 4, 16, 16), torch.randint(0, 10, (2,))
    return Scenario(model=_Patches(weight_norm), inputs=[(x, y)] * 2,
                    loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)


def _record(root, name, threads, fault=None, weight_norm=False):
    return record_side(_scenario(weight_norm), root / name, threads=threads, fault=fault, dtype="bf16",
                       replay=root / "ref", local=root / "ref")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctlkernel")
    record(_scenario(), root / "ref")
    wrong = lambda: opfaults.scale_op("proj", "convolution", 1.05)  # noqa: E731
    _record(root, "target", 2, wrong)
    _record(root, "control", 1, wrong)  # the same device's kernel: as wrong
    _record(root, "clean_control", 1)
    return root


def test_a_control_with_the_targets_wrong_kernel_vouches_for_nothing(runs, monkeypatch):
    assert compare(runs / "ref", runs / "target").verdict == "fail"
    rep = compare(runs / "ref", runs / "target", control=runs / "control")
    assert rep.verdict == "fail", rep.decided_by
    assert rep.first_divergence["module"] == "proj", rep.first_divergence
    kinds = {(f.kind, f.module) for f in rep.findings}
    assert ("precision.control_kernel", "proj") in kinds
    assert ("precision.model_sensitive", "proj") not in kinds
    # without the check the control, as wrong as the target, passed it as the model's doing
    monkeypatch.setattr(Opinions, "_control_kernel", lambda self, r, tol, limit: None)
    before = compare(runs / "ref", runs / "target", control=runs / "control")
    assert before.verdict == "pass" and ("precision.model_sensitive", "proj") in {
        (f.kind, f.module) for f in before.findings}


def test_a_correct_control_still_judges(runs):
    rep = compare(runs / "ref", runs / "target", control=runs / "clean_control")
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "proj", rep.first_divergence
    assert not any(f.kind == "precision.control_kernel" for f in rep.findings)
    # and a wrong control cannot fail a correct target: the control only ever passes entries
    assert compare(runs / "ref", runs / "clean_control", control=runs / "control").verdict == "pass"


def test_a_parametrized_weight_is_rebuilt_for_the_check(tmp_path):
    """A weight_norm'd convolution: the check takes the weight its call computed with."""
    record(_scenario(True), tmp_path / "ref")
    wrong = lambda: opfaults.scale_op("proj", "convolution", 1.05)  # noqa: E731
    _record(tmp_path, "target", 2, wrong, weight_norm=True)
    _record(tmp_path, "control", 1, wrong, weight_norm=True)
    rep = compare(tmp_path / "ref", tmp_path / "target", control=tmp_path / "control")
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "proj", rep.first_divergence
    assert any(f.kind == "precision.control_kernel" and f.module == "proj" for f in rep.findings)

"""A data-parallel side whose loss is a mean of its ranks' means over counts that differ between
their parts (compare/normalization.py): against one process's mean over the global batch the
numbers really differ, and compare names why (layout.loss_normalization), with the factors and
each rank's share of the count (where every rank counts alike there is nothing to name:
tests/record/test_layouts.py).
Recorded under torchrun (gloo, CPU), as a user would."""
from __future__ import annotations

import textwrap

import pytest
from conftest import record_cli

from driftcheck.compare.ranks import compare_ranks
from driftcheck.report.common import conclusion

SCENARIO = textwrap.dedent('''
    import torch
    from torch import nn
    from driftcheck import Scenario

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

        def forward(self, x, mask):
            return self.body(x)

    def loss(out, batch):  # a mean over the rows the mask keeps, as a causal LM's over unmasked labels
        mask = batch[1]
        return (out.pow(2).sum(-1) * mask).sum() / mask.sum()

    def build():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last row masked: 2 ranks count 2 and 1 rows
        xs = [(torch.randn(4, 8, generator=g), mask) for _ in range(2)]
        return Scenario(model=Net(), inputs=xs, loss=loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), steps=2)
''')


def _record(tmp, out, *args, ranks=0):
    record_cli(tmp, str(tmp / "sc.py:build"), "--out", str(tmp / out), *args, ranks=ranks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("normalization")
    (tmp / "sc.py").write_text(SCENARIO)
    for mode in ("full", "stats"):
        _record(tmp, f"ref-{mode}", "--mode", mode)
        _record(tmp, f"ddp-{mode}", "--mode", mode, "--parallel", "ddp", "--replay", str(tmp / f"ref-{mode}"), ranks=2)
    return tmp


def _named(report):
    return [f for f in report.findings if f.kind == "layout.loss_normalization"]


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_mean_of_the_ranks_means_is_named_with_its_factors(runs, mode):
    report = compare_ranks(runs / f"ref-{mode}", runs / f"ddp-{mode}")
    assert report.verdict == "fail"  # the numbers really differ: 2 and 1 rows counted, not 3
    found = _named(report)
    assert len(found) == 1, [f.kind for f in report.findings]
    f = found[0]
    # rank r's part is the single process's times N / (W N_r): 3 / (2 * 2), 3 / (2 * 1)
    assert f.details["factors"] == pytest.approx([0.75, 1.5], rel=1e-3)
    assert f.details["counted_shares"] == pytest.approx([2 / 3, 1 / 3], rel=1e-3)
    assert f.module == "body.2" and f.phase == "backward" and f.severity == "warning"
    assert "mean of its 2 ranks' means" in f.message and f.details["data_parallel_side"] == "target"
    # the headline says it is the layout, not "a defect on the target"
    assert "a difference of the layout" in conclusion(report) and "defect on the target" not in conclusion(report)


def test_the_other_way_round_names_the_reference(runs):
    found = _named(compare_ranks(runs / "ddp-full", runs / "ref-full"))
    assert len(found) == 1 and found[0].details["data_parallel_side"] == "reference"
    assert found[0].details["factors"] == pytest.approx([0.75, 1.5], rel=1e-3)


def test_a_uniform_scale_is_no_layout_effect():
    """Equal counts make every factor 1: a target that scales the whole gradient by one factor
    (a defect of its own) is not explained away as a loss normalized per rank."""
    import numpy as np

    from driftcheck.compare.normalization import _factors

    x = np.random.default_rng(0).standard_normal(4 * 64)
    rows = np.arange(x.size) // 64
    e = {"module": "head", "step": 0, "key": "0/backward/head/0/grad_output"}
    for c in (1.03, 0.97, 1.2):
        assert _factors(e, (x, c * x, rows), [2, 2], target_split=True) is None, c
    # the layout's own factors, 3 / (2 * 2) and 3 / (2 * 1) on 2 + 2 rows: named
    y = np.where(rows < 2, 0.75, 1.5) * x
    got = _factors(e, (x, y, rows), [2, 2], target_split=True)
    assert got is not None and got.details["factors"] == pytest.approx([0.75, 1.5])


def test_the_conclusion_names_the_layout_only_where_it_can_explain(runs):
    """A divergence the per-rank loss cannot make (a forward tensor before the loss, NaN/Inf)
    keeps the conclusion's own words."""
    report = compare_ranks(runs / "ref-full", runs / "ddp-full")
    fd = report.first_divergence
    assert fd["phase"] != "forward" and "a difference of the layout" in conclusion(report)
    first = next(e for e in report.entries if e.phase == "forward" and e.metrics.get("count", 0) > 1)
    report.first_divergence = dict(fd, key=first.key, phase="forward", step=0, module=first.module,
                                   slot=first.slot)
    assert "a difference of the layout" not in conclusion(report)
    report.first_divergence = dict(fd, status="nonfinite")
    assert "a difference of the layout" not in conclusion(report)

"""A mean-subtracting norm over groups whose spread is below its eps (issue 47, stats mode on the
corpus: hf_deformable_detr's input projection, a GroupNorm of one channel a group over a 1x1 map,
1.4e5 between 1 and 2 threads). x - mean is then rounding noise, u |x|, and the norm divides it by
sqrt(var + eps), about sqrt(eps): the output is noise of size u |x| / sqrt(eps) |gamma| whatever
its own tiny rms. The floor took that rms as its scale (times the recorded gain |x| / sqrt(eps)),
so the noise of a run whose input differs by one rounding failed by 1e5; the scale of a norm's
output is now at least its weight's rms (the normalized unit), which changes nothing where the
groups' spread is above eps (the output is then about gamma in size)."""
from __future__ import annotations

import pytest
import torch
from test_floor_classes import _pair, _worst
from test_floor_classes2 import _scenario
from torch import nn

from driftcheck.targets.faults import scale_output

C = 32


def _net():
    # a GroupNorm of one channel a group after a convolution to a 1x1 map (DETR's input projection)
    return nn.Sequential(nn.Conv2d(64, C, 3, stride=2, padding=1), nn.GroupNorm(C, C), nn.ReLU(),
                         nn.Flatten(), nn.Linear(C, 4))


def _make(seed: int = 0):
    return _scenario(_net, lambda g: torch.randn(2, 64, 2, 2, generator=g), lambda out, b: out.float().pow(2).mean(),
                     seed=seed)


def _rounding(module: str):
    """Another kernel's rounding of the convolution: its output moved by at most one ulp."""
    return scale_output(module, 1.0 + 2.0 ** -23)


@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("seed", [0, 1])
def test_norm_of_groups_below_eps_after_one_rounding_pass(tmp_path, mode, seed):
    rep = _pair(tmp_path, lambda: _make(seed), dtype="fp32", local=False, mode=mode, hooks=_rounding("0"))
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    gn = next(e for e in rep.entries if e.key == "0/forward/1/0/output")
    # the output really is noise that one rounding of its input replaced (what failed before)
    assert gn.metrics["rms"] > 0.3 * gn.details["ref_stats"]["std"] and gn.details["norm_gain"] > 10


@pytest.mark.parametrize("module", ["0", "4"])
def test_a_defect_around_the_degenerate_norm_still_fails(tmp_path, module):
    rep = _pair(tmp_path, _make, dtype="fp32", local=False, mode="stats", hooks=scale_output(module, 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == module, rep.first_divergence

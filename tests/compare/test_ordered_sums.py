"""Sums whose terms cancel in total but not along the way (issue 47, found by stats mode on the
corpus: hf_perceiver_image's cross-attention LayerNorm, whose two samples' gradients are near
mirror images over 1024 image positions each).

- A bf16 norm kernel summing its bias gradient in one thread adds near-equal terms of one sign
  (one sample's positions), then of the other: the partial sum grows to half the terms' l1 norm
  and stagnates there (an add below half an ulp is lost), so the kernel's error is a share of
  sum|g|, not of the terms' l2 norm the stats-mode allowance took (4.7-6.1 on this model).
- Where the cancellation is exact, the fp32 reference's gradient is exactly zero (two threads,
  one sample each, mirror images) while the bf16 target's is not: the max floor was the dtype's
  smallest normal (1e29).
"""
from __future__ import annotations

import math

import pytest
import torch
from test_floor_classes import _worst
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.record.runner import record
from driftcheck.targets.faults import scale_output

N, C = 1024, 32  # positions per sample, channels


class _MirroredPositions(nn.Module):
    """A LayerNorm over image positions, a projection, a pool, a head: the gradient reaching the
    norm's output is the same at every position of a sample."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.proj = nn.Linear(C, C)
        self.head = nn.Linear(C, 2)

    def forward(self, x):
        return self.head(self.proj(self.norm(x)).mean(1))


def _scenario(seed: int) -> Scenario:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, N, C, generator=g).expand(2, -1, -1).clone()  # one image, twice
    # the two samples pull opposite ways (two labels of a near-even classifier, exactly)
    return Scenario(model=_MirroredPositions(), inputs=[x, x], loss=lambda out, b: (out[0] - out[1]).float().sum(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


def _run(tmp_path, seed: int, *, threads: int, mode: str, dtype: str = "bf16", hooks=None, ref_hooks=None):
    """Reference (fp32) and target with ``threads`` intra-op threads each."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ref = record(_scenario(seed), tmp_path / "ref", force=True, target_hooks=ref_hooks)
        ref_m = ref if mode == "full" else record(_scenario(seed), tmp_path / "ref-m", force=True,
                                                  replay=ref, mode=mode, target_hooks=ref_hooks)
        tgt = record(_scenario(seed), tmp_path / "tgt", dtype=dtype, replay=ref, force=True, mode=mode,
                     local=ref if mode == "full" else None, target_hooks=hooks)
    finally:
        torch.set_num_threads(before)
    return compare(ref_m, tgt)


def _entry(rep, key):
    return next(e for e in rep.entries if e.key == key)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_norm_bias_summed_along_ordered_positions_from_samples_pass(tmp_path, seed):
    rep = _run(tmp_path, seed, threads=1, mode="stats")
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    bias = _entry(rep, "0/grads/norm/0/param.bias")
    gout = _entry(rep, "0/backward/norm/0/grad_output").details["ref_stats"]
    l2 = gout["l2"] / math.sqrt(C)  # the terms' l2 norm per channel (rms over channels)
    # the kernel really lost a multiple of the l2 norm (what failed before): not a vacuous pass
    assert bias.metrics["rms"] > 3.5 * l2, (bias.metrics["rms"], l2)


def _exact_cancellation(model: nn.Module):
    """The projection's weight gradient as it is exactly: zero (the two samples' terms are
    mirror images). A BLAS that sums one sample per thread gives it so (the host this was found
    on, two threads); another split leaves a residue of ~1e-8 (an AMD host, AVX2): the hook
    gives every host the exact cancellation the case is about."""
    return model.proj.weight.register_hook(torch.zeros_like)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_exactly_cancelling_reference_gradient_pass(tmp_path, mode):
    rep = _run(tmp_path, 0, threads=2, mode=mode, ref_hooks=_exact_cancellation)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    w = _entry(rep, "0/grads/proj/0/param.weight")
    assert w.details["ref_stats"]["absmax"] == 0.0 and w.details["tgt_stats"]["absmax"] > 0.0


@pytest.mark.parametrize("module", ["norm", "proj"])
def test_a_defect_on_the_mirrored_model_still_fails(tmp_path, module):
    rep = _run(tmp_path, 0, threads=1, mode="stats", dtype="fp32", hooks=scale_output(module, 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == module, rep.first_divergence

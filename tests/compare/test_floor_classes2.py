"""More floor classes of the third-party corpus (bench/zoo.py), after test_floor_classes.py: each
clean control failed on the code before it, and the defect of each class is still caught.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.compare.norms import group_length
from driftcheck.faults import scale_output
from driftcheck.record.runner import record


def _scenario(model_fn, inputs_fn, loss, steps: int = 2, seed: int = 0, lr: float = 1e-3) -> Scenario:
    torch.manual_seed(seed)
    model = model_fn()
    g = torch.Generator().manual_seed(seed + 1)
    return Scenario(model=model, inputs=[inputs_fn(g) for _ in range(steps)], loss=loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=lr), steps=steps)


def _pair(tmp_path, make, *, dtype="bf16", threads=None, local=True, mode="full", hooks=None):
    ref, tgt = tmp_path / "ref", tmp_path / f"tgt-{dtype}-{threads}-{mode}-{local}"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0] if threads else before)
        if not ref.exists():
            record(make(), ref, force=True)
        ref_m = ref if mode == "full" else record(make(), tmp_path / f"ref-{mode}", force=True,
                                                  replay=ref, mode=mode)
        if threads:
            torch.set_num_threads(threads[1])
        record(make(), tgt, dtype="fp32" if threads else dtype, replay=ref, force=True,
               local=ref if local else None, mode=mode, target_hooks=hooks)
    finally:
        torch.set_num_threads(before)
    return compare(ref_m, tgt)


def _worst(rep):
    bad = [e for e in rep.entries if e.status != "ok"]
    return [(e.key, e.ratio, e.local_ratio) for e in sorted(bad, key=lambda e: -(e.ratio or 0))[:3]]


# -- a norm's statistics sum over its group: another summation order is sqrt(K) u apart -----------
@pytest.mark.parametrize("shape,dims,groups,k", [
    ([2, 16, 32, 32], [2], 8, 2 * 32 * 32),        # GroupNorm: (N, G, -1)
    ([2, 16, 32, 32], [0, 2, 3], None, 2 * 32 * 32),  # BatchNorm2d: N and the map
    ([4, 7, 64], [2], None, 64),                    # LayerNorm over the last dim
    ([4, 7, 64], [-1], None, 64),
    ([2, 15, 4], [2], 4, None),                     # groups that do not divide: no length
    ([2, 16], [5], None, None),                     # a dim the tensor does not have
])
def test_group_length(shape, dims, groups, k):
    assert group_length(shape, dims, groups) == k


class _ChannelsLast(nn.Module):
    def forward(self, x):
        return x.contiguous(memory_format=torch.channels_last)


def _groupnorm_net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), _ChannelsLast(), nn.GroupNorm(8, 16), nn.SiLU(),
                         nn.Flatten(), nn.Linear(16 * 32 * 32, 4))


def _gn(seed=0):
    return _scenario(_groupnorm_net, lambda g: torch.randn(2, 3, 32, 32, generator=g) * 0.35 + 0.03,
                     lambda out, b: out.pow(2).mean(), seed=seed)


@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("threads", [(1, 1), (1, 2)])
def test_groupnorm_of_a_channels_last_map_under_local_replay_pass(tmp_path, mode, threads):
    """diffusers' autoencoders: a GroupNorm over 2,048 elements a group, on a channels_last map,
    was replayed on a contiguous copy of its input, where the kernel sums in another order (7-10
    floors with an fp32 target). The replay now lays its inputs out as the live ones, and a norm's
    floor counts its group's length, since any other kernel (a TPU's) sums in its own order."""
    rep = _pair(tmp_path, _gn, threads=threads, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    out = next(e for e in rep.entries if e.key == "0/forward/2/0/output")
    assert out.details["floor"]["k"] == 2 * 32 * 32  # 16 channels / 8 groups x 32 x 32
    if mode == "full":
        assert out.local_ratio == 0.0  # the same kernel on the same layout: bitwise


def test_groupnorm_fault_still_caught_on_fp32(tmp_path):
    rep = _pair(tmp_path, _gn, dtype="fp32", hooks=scale_output("2", 1.001))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "2", rep.decided_by


# -- a parameter updated in place: its value before the step is a term of its value after ---------
class _KeyBiasAttention(nn.Module):
    """Attention whose key bias cannot change the softmax (q . b_k is the same for every key):
    its gradient is rounding noise, which Adam turns into a full lr step where it is over eps."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        nn.init.zeros_(self.k.bias)

    def forward(self, x):  # (B, T, d)
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 4.0, dim=-1)
        return self.o(a @ self.v(x))


def _kb(seed=0, steps=3):
    return _scenario(_KeyBiasAttention, lambda g: torch.randn(2, 8, 16, generator=g),
                     lambda out, b: out.pow(2).mean(), seed=seed, steps=steps)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_key_bias_stepped_from_noise_pass(tmp_path, mode):
    """hf_clip's k_proj bias: Adam stepped it by +-lr in bf16 from a gradient of 1e-5 noise and
    by 1e-5 in fp32 from 1e-10 (under eps); at the next step the update was judged against the
    reference's tiny parameter, as if the step before had not happened (4.7-5.0)."""
    rep = _pair(tmp_path, _kb, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


def _five_times_on_output(params):
    """AdamW that steps the output projection's weight (the 7th parameter) with 5x the lr."""
    ps = list(params)
    return torch.optim.AdamW([{"params": ps[:6] + ps[7:]}, {"params": [ps[6]], "lr": 5e-3}], lr=1e-3)


def test_optimizer_fault_after_a_noisy_step_still_caught(tmp_path):
    ref = tmp_path / "ref"
    record(_kb(), ref, force=True)
    sc = _kb()
    sc.optimizer = _five_times_on_output
    record(sc, tmp_path / "tgt", dtype="fp32", replay=ref, force=True)
    rep = compare(ref, tmp_path / "tgt")
    assert rep.verdict == "fail", rep.decided_by
    fd = rep.first_divergence
    assert (fd["module"], fd["phase"], fd["step"], fd["slot"]) == ("o", "optimizer", 0, "param.weight")


# -- a contrastive loss: cross-entropy over scaled logits makes the model's output gradients --------
class _TwoTowers(nn.Module):
    def __init__(self, d: int = 32, e: int = 16) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, e))
        self.b = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, e))

    def forward(self, x):  # (2, B, d) -> two (B, e) embeddings, unit length
        return F.normalize(self.a(x[0]), dim=-1), F.normalize(self.b(x[1]), dim=-1)


def _contrastive_loss(out, _batch):
    logits = 50.0 * out[0] @ out[1].t()  # CLIP's learned scale, clamped at 100
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _tt(seed=0):
    return _scenario(_TwoTowers, lambda g: torch.randn(2, 16, 32, generator=g), _contrastive_loss, seed=seed)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_contrastive_loss_over_scaled_logits_pass(tmp_path, mode):
    """hf_clip: the output gradients of the image and text embeddings come out of a cross-entropy
    over logits scaled by 14-100, which amplifies their rounding as a softmax does (3.4 in
    bf16, 6.1 with 2 threads)."""
    rep = _pair(tmp_path, _tt, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    g = next(e for e in rep.entries if e.key == "0/backward/./0/grad_output.0")
    assert g.details["floor"]["softmax_logit_max"] > 10.0


def test_contrastive_tower_fault_still_caught(tmp_path):
    rep = _pair(tmp_path, _tt, dtype="fp32", hooks=scale_output("a.2", 1.01), local=False)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "a.2", rep.decided_by

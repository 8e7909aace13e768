"""More floor classes of the third-party corpus (bench/zoo.py), after test_floor_classes.py: each
clean control failed on the code before it, and the defect of each class is still caught.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_floor_classes import _pair, _worst
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.compare.norms import group_length
from driftcheck.record.runner import record
from driftcheck.targets.faults import scale_output


def _scenario(model_fn, inputs_fn, loss, steps: int = 2, seed: int = 0, lr: float = 1e-3) -> Scenario:
    torch.manual_seed(seed)
    model = model_fn()
    g = torch.Generator().manual_seed(seed + 1)
    return Scenario(model=model, inputs=[inputs_fn(g) for _ in range(steps)], loss=loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=lr), steps=steps)


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


# -- an output its own module's later children consume too (torchvision's IntermediateLayerGetter) --
class _Getter(nn.Module):
    """Returns the features of two stages; the first also feeds the second inside this module."""

    def __init__(self) -> None:
        super().__init__()
        self.s1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.s2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())

    def forward(self, x):
        f1 = self.s1(x)
        return {"0": f1, "1": self.s2(f1)}


class _GetterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Getter()
        self.head0 = nn.Conv2d(8, 4, 1)
        self.head1 = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        f = self.body(x)
        return self.head0(f["0"]).mean() * 1e-2 + self.head1(f["1"]).pow(2).mean()


def _getter(seed=0):
    return _scenario(_GetterNet, lambda g: torch.randn(2, 3, 16, 16, generator=g), lambda out, b: out, seed=seed)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_output_gradient_with_a_share_from_inside_pass(tmp_path, mode):
    """tv_fpn_mobilenet: the backbone's first feature map also feeds its next stages, so its
    output gradient is the FPN's share plus the share of those stages' input gradients (recorded
    before it); it inherited only the FPN's (4.7 in bf16)."""
    rep = _pair(tmp_path, _getter, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


# -- the same values recorded twice: an nn.Identity's input is the conv output before it ----------
class _CancellingBlock(nn.Module):
    """A 1x1 conv whose output cancels (two near-equal channels, weights of opposite sign: 1% of
    its terms), then an nn.Identity (timm's drop_path at rate 0) and a residual."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * c, c, 1, bias=False)
        with torch.no_grad():
            v = torch.randn(c, c, 1, 1) * 0.3
            self.conv3.weight.copy_(torch.cat([v, -v], 1))
        self.drop_path = nn.Identity()

    def forward(self, x):
        h = self.conv1(x)
        a = torch.cat([h, h + 0.01 * torch.tanh(h)], 1)
        return x + self.drop_path(self.conv3(a)) * 30.0


def _skip(seed=0):
    net = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _CancellingBlock(),
                                nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    return _scenario(net, lambda g: torch.randn(2, 3, 8, 8, generator=g), lambda out, b: out.pow(2).mean(),
                     seed=seed)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_identity_of_a_cancelling_conv_pass(tmp_path, mode):
    """timm_nfnet: a conv's output far smaller than its terms carries an error of their size (its
    floor's scale); the nn.Identity after it records the very same values as its input, which
    were judged relative to their own small value (20x) instead of carrying the conv's error."""
    rep = _pair(tmp_path, _skip, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


def test_identity_input_fault_still_caught(tmp_path):
    rep = _pair(tmp_path, _skip, dtype="fp32", hooks=scale_output("1.drop_path", 1.01), local=False)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "1.drop_path", rep.decided_by


# -- from samples: an error a few rows carry, passed on ------------------------------------------
class _WideLeVit(nn.Module):
    """LeViT's Linear + BatchNorm1d over two values per channel, 512 channels wide: the channels
    whose two values lie close make the Linear's gradient pure noise in their rows only."""

    def __init__(self, d: int = 32, h: int = 512) -> None:
        super().__init__()
        from test_floor_classes import _LinearNorm, _NormLinear

        self.ln1, self.ln2, self.head = _LinearNorm(d, h), _LinearNorm(h, d), _NormLinear(d, 4)

    def forward(self, x):  # (B, 1, d)
        h = x + self.ln2(F.hardswish(self.ln1(x)))
        return self.head(h.mean(1))


@pytest.mark.parametrize("seed", [3, 5])
def test_sparse_noise_rows_from_samples_pass(tmp_path, seed):
    """timm_levit in stats mode: what an entry passes on came from its 512-element sample, which
    can miss the few noisy rows that the next entry's sample meets (an Adam moment at 27-422, a
    weight gradient at 9.3). What is passed on is now at least the gap of the two runs'
    whole-tensor rms, which no sample can miss."""
    rep = _pair(tmp_path, lambda: _scenario(_WideLeVit, lambda g: torch.randn(2, 1, 32, generator=g),
                                            lambda out, b: out.float().pow(2).mean(), seed=seed),
                mode="stats", local=False)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


def test_sparse_noise_rows_fault_still_caught_from_samples(tmp_path):
    rep = _pair(tmp_path, lambda: _scenario(_WideLeVit, lambda g: torch.randn(2, 1, 32, generator=g),
                                            lambda out, b: out.float().pow(2).mean(), seed=3),
                dtype="fp32", mode="stats", local=False, hooks=scale_output("ln2.linear", 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "ln2.linear", rep.first_divergence



# -- from samples: a bf16 norm kernel's sum of terms that cancel ------------------------------------
class _PooledNormHead(nn.Module):
    """hf_focalnet's head: a final LayerNorm over 64 tokens, pooled, a classifier. With labels
    of both classes, its bias gradient sums terms that cancel across the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 2)

    def forward(self, x):  # (2, 64, 16)
        return self.head(self.norm(self.proj(x)).mean(1))


def _pooled_head(seed=0):
    return _scenario(_PooledNormHead, lambda g: torch.randn(2, 64, 16, generator=g),
                     lambda out, b: F.cross_entropy(out.float(), torch.tensor([0, 1])), seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_bias_summed_in_bf16_over_cancelling_terms_from_samples_pass(tmp_path, seed):
    """hf_focalnet in stats mode: the last LayerNorm's bias gradient, summed by the bf16 kernel
    over 128 positions whose terms cancel, was 4x its own size off (5.6-6.0). A sum accumulated
    in bf16 loses u |partial sum| at each add, and the partial sums grow with the terms' l2
    norm, not with their small total: the allowance now takes the larger of the two."""
    rep = _pair(tmp_path, lambda: _pooled_head(seed), mode="stats", local=False)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


# -- a kink flip after a per-channel scaling: the input gradient's max is not where the flip is ------
class _Depthwise(nn.Module):
    """A depthwise 1x1 conv with one channel of weight 1 among weights of 0.01, then a depthwise
    3x3 conv, a ReLU and a gain 100x larger on the small-weight channels: the 1x1's output
    gradient is largest where its weights are small, while ReLU flips reach the channel of
    weight 1 as sparse errors (timm_fastvit's conv_scale, 3.86)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 1, groups=8, bias=False)
        self.dw2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        with torch.no_grad():
            self.dw.weight.fill_(0.01)
            self.dw.weight[0] = 1.0
        self.register_buffer("gain", torch.tensor([1.0] + [100.0] * 7).reshape(1, 8, 1, 1))

    def forward(self, x):
        return F.relu(self.dw2(self.dw(self.conv(x)))) * self.gain


def _dw(seed=0):
    # a loss linear in the output: the gradient does not vanish at the kink
    return _scenario(_Depthwise, lambda g: torch.randn(8, 3, 16, 16, generator=g),
                     lambda out, b: out.float().mean(), seed=seed)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_kink_flip_through_a_per_channel_weight_pass(tmp_path, mode):
    rep = _pair(tmp_path, _dw, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


def test_depthwise_fault_still_caught(tmp_path):
    rep = _pair(tmp_path, _dw, dtype="fp32", local=False, hooks=scale_output("dw", 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "dw", rep.decided_by


# -- a mean the parent's code takes over a child's output whose terms cancel ---------------------
class _GlobalContext(nn.Module):
    """FocalNet's modulation: a global context, the mean of a map over its positions (20-30x
    below the map's rms), through an activation module, gating the map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.GELU()
        self.gate = nn.GELU()
        self.head = nn.Conv2d(16, 4, 1)
        with torch.no_grad():  # inputs of mean 1: the bias cancels what the weights make of it
            self.conv.bias.copy_(0.005 - self.conv.weight.sum((1, 2, 3)))

    def forward(self, x):
        h = self.conv(x + 1.0)
        ctx = h.mean((2, 3), keepdim=True)
        return self.head(self.act(h) * self.gate(ctx))


def _gc(seed=0):
    return _scenario(_GlobalContext, lambda g: torch.randn(8, 3, 32, 32, generator=g),
                     lambda out, b: out.float().pow(2).mean(), seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_over_a_cancelling_map_pass(tmp_path, seed):
    rep = _pair(tmp_path, lambda: _gc(seed))
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))


def test_fault_before_the_mean_still_caught(tmp_path):
    rep = _pair(tmp_path, _gc, dtype="fp32", local=False, hooks=scale_output("conv", 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "conv", rep.decided_by


def test_smooth_activations_are_told_from_piecewise_ones():
    from driftcheck.compare.magnitude import smooth_activation

    for name in ("GELU", "GELUActivation", "QuickGELUActivation", "SiLU", "Mish", "Tanh", "Sigmoid",
                 "ELU", "SELU", "Softplus"):
        assert smooth_activation(name), name
    for name in ("ReLU", "LeakyReLU", "ReLU6", "PReLU", "Hardswish", "Hardsigmoid", "Linear", None):
        assert not smooth_activation(name), name


# -- an output gradient the parent's own code sums: a matmul after the module, in other order ------
class _ExactDown(torch.autograd.Function):
    """F.linear whose input gradient sums in float64 (then rounds): the same sum as the float32
    kernel's, in another order and rounding (as another thread count or kernel gives)."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return F.linear(h, w)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return (g.double() @ w.double()).float(), g.flatten(0, -2).t() @ h.flatten(0, -2)


class _Experts(nn.Module):
    """Mixtral's experts: the activation a module, the projections functional on the parent's
    own weights (``exact``: the down projection's input gradient summed another way)."""

    def __init__(self, exact: bool = False, hidden: int = 1024) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(64, hidden) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(hidden, 64) / 8)
        self.act, self.exact = nn.SiLU(), exact

    def forward(self, x):
        h = self.act(F.linear(x, self.up))
        return _ExactDown.apply(h, self.down) if self.exact else F.linear(h, self.down)


def _experts(exact: bool) -> Scenario:
    return _scenario(lambda: nn.Sequential(_Experts(exact), nn.LayerNorm(1024)),
                     lambda g: torch.randn(64, 1024, generator=g), lambda out, x: out.pow(2).mean())


def test_an_output_gradient_summed_by_the_parents_code_has_that_sums_floor(tmp_path):
    """hf_mixtral's act_fn output gradient between 1 and 2 threads (an AMD EPYC): 3.5 floors. Its
    parent's code made it by a matmul over the hidden dimension (F.linear on down_proj[e]) that
    no module records; the floor took one rounding. It now takes the sum over the parent's
    output gradient's last dimension (K = 1024 here)."""
    ref, tgt, bad = tmp_path / "ref", tmp_path / "tgt", tmp_path / "bad"
    record(_experts(False), ref, force=True)
    record(_experts(True), tgt, replay=ref, force=True)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.decided_by
    g = next(e for e in rep.entries if e.key == "0/backward/0.act/0/grad_output")
    assert g.details["floor"]["k"] == 1024 and g.metrics["rms"] > 0
    record(_experts(True), bad, replay=ref, force=True, target_hooks=scale_output("0.act", 1.001))
    rep = compare(ref, bad)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "0.act", rep.decided_by

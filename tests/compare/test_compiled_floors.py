"""Floor classes found by the calibration corpus with compiled targets (`python bench/zoo.py
--compile inductor`): each clean case failed on the code before it, and a defect is still caught.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.record.runner import record
from driftcheck.targets.faults import scale_output


# -- a norm computed by its module's own code, then handed to a child (timm's BatchNormAct2d) ------
class _BNAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d: F.batch_norm in the module's own code, then its ``drop`` and
    ``act`` children, so drop's input is the norm's result, not a norm module's output."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.drop, self.act = nn.Identity(), nn.ReLU()

    def normed(self, x):
        self.num_batches_tracked.add_(1)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum, self.eps)

    def forward(self, x):
        return self.act(self.drop(self.normed(x)))


class _BNActByHand(_BNAct):
    """The same norm summed in another order (as a compiled target's fused reduction does)."""

    def normed(self, x):
        self.num_batches_tracked.add_(1)
        mean = x.mean((0, 2, 3), keepdim=True)
        var = (x - mean).pow(2).mean((0, 2, 3), keepdim=True)
        with torch.no_grad():
            n = x.numel() / x.shape[1]
            self.running_mean.lerp_(mean.flatten(), self.momentum)
            self.running_var.lerp_(var.flatten() * n / (n - 1), self.momentum)
        y = (x - mean) * torch.rsqrt(var + self.eps)
        return y * self.weight[:, None, None] + self.bias[:, None, None]


def _bn_net(norm):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), norm(16), nn.Conv2d(16, 32, 3, padding=1, stride=2),
                              norm(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(2, 3, 32, 32, generator=g) * 2 + 1 for _ in range(2)]
        return Scenario(model=model, inputs=xs, loss=lambda out, x: out.pow(2).mean(),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)
    return build


def test_a_norm_summed_in_another_order_inside_its_module_passes(tmp_path):
    """timm_mobilenetv3 and timm_cspnet against inductor targets failed at `bn1.drop`'s input (5.7
    and 5.0 floors): the BatchNorm computed in BatchNormAct2d's own code carried no norm floor,
    where a norm module's output does (its group's length, its gain). A child's input that its
    parent norm's code normalized now has its parent's."""
    ref, tgt = tmp_path / "ref", tmp_path / "tgt"
    record(_bn_net(_BNAct)(), ref, force=True)
    record(_bn_net(_BNActByHand)(), tgt, replay=ref, force=True)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.decided_by
    drop_in = next(e for e in rep.entries if e.key == "0/forward/1.drop/0/input.0")
    assert drop_in.details["floor"]["k"] == 2 * 32 * 32 and drop_in.metrics["rms"] > 0
    bad = tmp_path / "bad"
    record(_bn_net(_BNActByHand)(), bad, replay=ref, force=True, target_hooks=scale_output("2", 1.01))
    rep = compare(ref, bad)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "2", rep.decided_by


# -- a module that returns an input it was given (torchvision's LastLevelMaxPool) ---------------------
class _AppendPool(nn.Module):
    def forward(self, xs: list):
        xs.append(F.max_pool2d(xs[-1], 1, 2, 0))
        return xs


class _Pyramid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, stride=2)
        self.extra = _AppendPool()

    def forward(self, x):
        a = self.a(x)
        feats = self.extra([a, self.b(a)])
        return sum(f.pow(2).mean() for f in feats)


def _pyramid():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Scenario(model=_Pyramid(), inputs=[torch.randn(2, 3, 16, 16, generator=g) for _ in range(2)],
                    loss=lambda out, x: out, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


def test_an_input_returned_by_its_module_is_not_judged_against_a_compiled_target(tmp_path):
    """tv_fpn_mobilenet against any compiled target failed at `fpn.extra_blocks`'s input gradient
    (ratio inf): eager capture holds the gradient of the module's own pool only, a compiled
    capture's input view also what reaches the list element it returns. Not judged, reported."""
    ref, tgt = tmp_path / "ref", tmp_path / "tgt"
    record(_pyramid(), ref, force=True)
    record(_pyramid(), tgt, replay=ref, force=True,
           compile={"backend": "aot_eager", "mode": None, "dynamic": None})
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.decided_by
    gap = [f for f in rep.findings if f.kind == "compile.capture_gap" and f.module == "extra"
           and "unchanged" in f.message]
    assert gap and "0/backward/extra/0/grad_input.0.1" in gap[0].details["keys"]
    assert not any(e.key == "0/backward/extra/0/grad_input.0.1" for e in rep.entries)
    # eager against eager: the same entry is judged (the rule is the compiled capture's)
    eager = tmp_path / "eager"
    record(_pyramid(), eager, replay=ref, force=True)
    assert any(e.key == "0/backward/extra/0/grad_input.0.1" for e in compare(ref, eager).entries)

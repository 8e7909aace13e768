"""This machine's own kernels checked against float64, for the benchmarks and tests that assume a
bf16 CPU run is a clean target.

PyTorch 2.13's oneDNN bf16 grouped conv1d is wrong on CPUs with AMX (Sapphire Rapids and later):
with kernel 16 or 128 and 4 or 16 groups (the positional convolution of wav2vec2, HuBERT, WavLM,
SEW) its output is ~110% off. Reproduce: python bench/kernel_check.py. A bf16 target of such a
model is then not a clean run: driftcheck fails it at that convolution, a true positive.

Its bf16 Conv2d is wrong too for few input channels and a large kernel (8, 16 or 24 channels,
kernel 4 to 16, stride 1 or the kernel: a patch embedding after a small stem, VOLO's), ~120% off:
found 2026-12-06 behind timm_volo's clean bf16 failure at patch_embed.proj (local 267).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def wrong_bf16_convs(model: torch.nn.Module, length: int = 79, tol: float = 0.1) -> list[str]:
    """The grouped Conv1d modules of ``model`` whose bf16 CPU kernel is more than ``tol`` off
    float64 (relative L2) on random data of ``length`` steps."""
    g = torch.Generator().manual_seed(0)
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Conv1d) and m.groups > 1
            and _off(m, F.conv1d, (2, m.in_channels, length), g) > tol]


def _off(m: torch.nn.Module, conv: Any, shape: tuple[int, ...], g: torch.Generator) -> float:
    """Relative L2 error of convolution ``m``'s bf16 CPU kernel against float64 on random data
    of ``shape`` and a random weight of its shape (drawn from ``g``)."""
    x = torch.randn(shape, generator=g)
    w = torch.randn(tuple(m.weight.shape), generator=g) * 0.1
    kw = dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
    want = conv(x.double(), w.double(), **kw)
    got = conv(x.bfloat16(), w.bfloat16(), **kw).double()
    return float((got - want).norm() / want.norm())


def wrong_bf16_conv2ds(model: torch.nn.Module, tol: float = 0.1, narrow: int = 32) -> list[str]:
    """The Conv2d modules of ``model`` with at most ``narrow`` input channels per group whose bf16
    CPU kernel is more than ``tol`` off float64 (relative L2) on random 2 x C x H x H data (H 32,
    or twice the kernel): where this machine's kernel fails (the module docstring); wider
    convolutions are not checked (cost)."""
    g = torch.Generator().manual_seed(0)
    return [name for name, m in model.named_modules()
            if type(m) is torch.nn.Conv2d and m.in_channels // m.groups <= narrow
            and _off(m, F.conv2d, (2, m.in_channels) + (max(32, 2 * max(m.kernel_size)),) * 2, g) > tol]


def main() -> int:
    rows = []
    for c, k, groups in [(32, 16, 4), (32, 16, 2), (32, 16, 16), (32, 15, 4), (64, 128, 16)]:
        m = torch.nn.Conv1d(c, c, k, padding=k // 2, groups=groups)
        rows.append((c, k, groups, "WRONG" if wrong_bf16_convs(torch.nn.Sequential(m)) else "ok"))
    print("| channels | kernel | groups | bf16 conv1d on this CPU |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    rows = []
    for c, k, stride in [(3, 16, 16), (8, 8, 8), (16, 4, 4), (16, 3, 1), (24, 4, 4), (32, 4, 4), (64, 4, 4)]:
        m = torch.nn.Conv2d(c, 32, k, stride=stride)
        rows.append((c, k, stride, "WRONG" if wrong_bf16_conv2ds(torch.nn.Sequential(m)) else "ok"))
    print("\n| in channels | kernel | stride | bf16 conv2d on this CPU |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

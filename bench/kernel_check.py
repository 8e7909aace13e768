"""This machine's own kernels checked against float64, for the benchmarks and tests that assume a
bf16 CPU run is a clean target.

PyTorch 2.13's oneDNN bf16 grouped conv1d is wrong on CPUs with AMX (Sapphire Rapids and later):
with kernel 16 or 128 and 4 or 16 groups (the positional convolution of wav2vec2, HuBERT, WavLM,
SEW) its output is ~110% off. Reproduce: python bench/kernel_check.py. A bf16 target of such a
model is then not a clean run: driftcheck fails it at that convolution, a true positive.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def wrong_bf16_convs(model: torch.nn.Module, length: int = 79, tol: float = 0.1) -> list[str]:
    """The grouped Conv1d modules of ``model`` whose bf16 CPU kernel is more than ``tol`` off
    float64 (relative L2) on random data of ``length`` steps."""
    wrong = []
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv1d) and m.groups > 1:
            x = torch.randn(2, m.in_channels, length, generator=g)
            w = torch.randn(tuple(m.weight.shape), generator=g) * 0.1
            kw = dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
            want = F.conv1d(x.double(), w.double(), **kw)
            got = F.conv1d(x.bfloat16(), w.bfloat16(), **kw).double()
            if float((got - want).norm() / want.norm()) > tol:
                wrong.append(name)
    return wrong


def main() -> int:
    rows = []
    for c, k, groups in [(32, 16, 4), (32, 16, 2), (32, 16, 16), (32, 15, 4), (64, 128, 16)]:
        m = torch.nn.Conv1d(c, c, k, padding=k // 2, groups=groups)
        rows.append((c, k, groups, "WRONG" if wrong_bf16_convs(torch.nn.Sequential(m)) else "ok"))
    print("| channels | kernel | groups | bf16 conv1d on this CPU |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

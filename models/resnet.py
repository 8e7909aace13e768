"""A ResNet-style conv net: stem, two BasicBlocks (the second downsamples), pool, linear head.

Written like torchvision's BasicBlock on purpose: BatchNorm2d followed by ``ReLU(inplace=True)``,
``out += identity`` in place, and one ReLU module called twice per block. Those are the patterns
that break on new backends: BatchNorm running statistics that never update, in-place writes into
views, and a module called more than once per step (trace entries with call index 0 and 1).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.scenario import Scenario


@dataclasses.dataclass
class ResNetConfig:
    in_channels: int = 3   # RGB images
    image_size: int = 16   # square inputs (H = W)
    width: int = 16        # stem and first block channels; the second block doubles it
    n_classes: int = 10    # output logits
    batch_size: int = 4    # images per step
    lr: float = 0.05       # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    steps: int = 2         # training steps recorded


class BasicBlock(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus identity (or a 1x1 conv+BN), -> ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)  # called twice per forward, as in torchvision
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x                                      # (B, in_ch, H, W)
        out = self.relu(self.bn1(self.conv1(x)))          # (B, out_ch, H/s, W/s)
        out = self.bn2(self.conv2(out))                   # (B, out_ch, H/s, W/s)
        if self.downsample is not None:
            identity = self.downsample(x)                 # (B, out_ch, H/s, W/s)
        out += identity  # in place, as torchvision does
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        w = config.width
        self.conv1 = nn.Conv2d(config.in_channels, w, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(w, w, stride=1)
        self.layer2 = BasicBlock(w, 2 * w, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * w, config.n_classes)
        # torchvision's init: He-normal convs; BatchNorm keeps its default (weight 1, bias 0).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # Batches carry their targets for the loss (Scenario convention: model(**batch));
        # the model itself never reads them.
        x = self.relu(self.bn1(self.conv1(x)))  # (B, w, H, W)
        x = self.layer1(x)                      # (B, w, H, W)
        x = self.layer2(x)                      # (B, 2w, H/2, W/2)
        x = self.pool(x).flatten(1)             # (B, 2w)
        return self.fc(x)                       # (B, n_classes)


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the logits (B, n_classes) against the integer targets (B,)."""
    return F.cross_entropy(logits, batch["targets"])


def build(seed: int = 0) -> Scenario:
    """The ResNet scenario: seeded weights, 2 batches of (4, 3, 16, 16) images, SGD momentum."""
    config = ResNetConfig()
    with torch.random.fork_rng(devices=[]):  # seed init without touching the caller's RNG
        torch.manual_seed(seed)
        model = ResNet(config)
    g = torch.Generator().manual_seed(seed)
    shape = (config.batch_size, config.in_channels, config.image_size, config.image_size)
    inputs = [
        {
            "x": torch.randn(shape, generator=g),  # (B, C, H, W)
            "targets": torch.randint(0, config.n_classes, (config.batch_size,), generator=g),
        }
        for _ in range(config.steps)
    ]
    return Scenario(
        model=model,
        inputs=inputs,
        loss=loss,
        optimizer=functools.partial(torch.optim.SGD, lr=config.lr, momentum=config.momentum),
        steps=config.steps,
        name="resnet",
    )

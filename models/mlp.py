"""A small MLP classifier with Dropout: the simplest model that has randomness in its forward.

Dropout is why it is here: a target device must reproduce the reference's dropout masks
(made on CPU, see driftcheck/record/rng.py) or every activation after the first Dropout differs.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.scenario import Scenario


@dataclasses.dataclass
class MLPConfig:
    in_features: int = 32   # width of each synthetic input vector
    hidden: int = 64        # width of both hidden layers
    n_classes: int = 10     # output logits
    dropout: float = 0.1    # p of both Dropout layers
    batch_size: int = 8     # rows per step
    lr: float = 0.05        # SGD learning rate
    momentum: float = 0.9   # SGD momentum (gives the optimizer a state to compare)
    steps: int = 2          # training steps recorded


# Tensor parallelism (driftcheck record --parallel tp): every Linear split along its outputs,
# the output gathered on every rank (colwise_rep), so each Dropout acts on a whole, replicated
# tensor and draws the single process's mask (a colwise -> rowwise pair would leave drop1 on
# each rank's part of the hidden units, with a mask of its own).
TP_PLAN = {"fc1": "colwise_rep", "fc2": "colwise_rep", "head": "colwise_rep"}


class MLP(nn.Module):
    """Linear -> GELU -> Dropout -> Linear -> ReLU -> Dropout -> Linear."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.in_features, config.hidden)
        self.act1 = nn.GELU()
        self.drop1 = nn.Dropout(config.dropout)
        self.fc2 = nn.Linear(config.hidden, config.hidden)
        self.act2 = nn.ReLU()
        self.drop2 = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.hidden, config.n_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # Batches carry their targets for the loss (Scenario convention: model(**batch));
        # the model itself never reads them.
        x = self.drop1(self.act1(self.fc1(x)))  # (B, hidden)
        x = self.drop2(self.act2(self.fc2(x)))  # (B, hidden)
        return self.head(x)                     # (B, n_classes)


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the logits (B, n_classes) against the integer targets (B,)."""
    return F.cross_entropy(logits, batch["targets"])


def build(seed: int = 0) -> Scenario:
    """The MLP scenario: seeded weights, 2 synthetic batches, cross-entropy, SGD with momentum."""
    config = MLPConfig()
    # fork_rng: seed the global RNG that nn.Linear's init uses without disturbing the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(config)
    g = torch.Generator().manual_seed(seed)
    inputs = [
        {
            "x": torch.randn(config.batch_size, config.in_features, generator=g),    # (B, in)
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
        name="mlp",
        tp_plan=TP_PLAN,
    )

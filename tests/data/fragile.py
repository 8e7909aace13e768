import torch
from torch import nn
from driftcheck import Scenario


class Mix(nn.Module):
    """Two branches, one of them fed (x + 256) - 256: exact in float32, x on a grid of 2 in
    bfloat16 (issue 47, class 8: the model's code computes something else at bf16)."""
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        big = x.new_full((), 256.0)
        return self.a(x) + self.b((x + big) - big)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mix = Mix()
        self.act = nn.SiLU()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.act(self.mix(self.inp(x))))


def build(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Net(), inputs=[torch.randn(16, 8), torch.randn(16, 8)],
                    loss=lambda out, batch: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)

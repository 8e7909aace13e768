"""A reversible network (RevNet, Reformer's reversible residual): y1 = x1 + f(x2), y2 = x2 +
g(y1), the forward run without a graph and its inputs recomputed from its outputs in a custom
autograd Function's backward, which backpropagates through f and g itself. ``FAULT`` scales what
that backward computes (issue 47, class 7: a defect in the block's own backward code)."""
import torch
from torch import nn

from driftcheck import Scenario

FAULT = {"dy1": 1.0, "x2": 1.0}


class _Rev(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, block):
        with torch.no_grad():
            y1 = x1 + block.f(x2)
            y2 = x2 + block.g(y1)
        ctx.block = block
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        block = ctx.block
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = block.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = (y2 - gy1) * FAULT["x2"]
            dy1 = (dy1 + y1.grad) * FAULT["dy1"]
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            fx2 = block.f(x2)
            torch.autograd.backward(fx2, dy1)
        with torch.no_grad():
            dx2 = dy2 + x2.grad
        return dy1, dx2, None


class RevBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(c, c), nn.Tanh(), nn.Linear(c, c))
        self.g = nn.Sequential(nn.Linear(c, c), nn.Tanh(), nn.Linear(c, c))

    def forward(self, x1, x2):
        return _Rev.apply(x1, x2, self)


class RevNet(nn.Module):
    def __init__(self, c=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(8, 2 * c)
        self.blocks = nn.ModuleList(RevBlock(c) for _ in range(depth))
        self.head = nn.Linear(2 * c, 4)

    def forward(self, x, y):
        x1, x2 = self.embed(x).chunk(2, -1)
        for b in self.blocks:
            x1, x2 = b(x1, x2)
        return self.head(torch.cat([x1, x2], -1))


def scenario(seed: int = 0) -> Scenario:
    torch.manual_seed(seed)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    return Scenario(model=RevNet(), inputs=[(x, y)] * 2,
                    loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)

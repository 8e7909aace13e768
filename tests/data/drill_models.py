"""Models for the drill-down tests: a model that reads its process environment, an fp8 GEMM
with row-wise scales, and a LayerNorm over many rows."""
import os

import torch
from torch import nn
from driftcheck import Scenario


class EnvScaled(nn.Module):
    """fc1 -> tanh -> * DC_TEST_SCALE -> fc2: a target whose environment changes its numbers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.block = Block()
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(self.block(self.fc1(x)))


class Block(nn.Module):
    def forward(self, x):
        h = torch.tanh(x)
        return h * float(os.environ.get("DC_TEST_SCALE", "1"))  # the line the drill must name


def _mse(out, batch):
    return out.pow(2).mean()


def env_scaled(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=EnvScaled(), inputs=[torch.randn(6, 8), torch.randn(6, 8)], loss=_mse,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)


class RowwiseFp8(nn.Module):
    """A square fp8 GEMM with row-wise scales (torch._scaled_mm), as fp8 training recipes run it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64) * 0.2)
        self.gemm = Gemm()

    def forward(self, x):
        return self.gemm(x, self.w)


class Gemm(nn.Module):
    def forward(self, x, w):
        fmax = torch.finfo(torch.float8_e4m3fn).max
        sa = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fmax   # (M, 1)
        sb = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fmax   # (N, 1)
        a = (x / sa).to(torch.float8_e4m3fn)
        b = (w / sb).to(torch.float8_e4m3fn)
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.float32)


def rowwise_fp8(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=RowwiseFp8(), inputs=[torch.randn(32, 64)], loss=None, optimizer=None,
                    steps=1)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.proj(x))


def layernorm_rows(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Norm(), inputs=[torch.randn(8192, 32)], loss=_mse,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), steps=1)


class Scores(nn.Module):
    def forward(self, x, mask):
        return torch.softmax(x @ x.transpose(-1, -2) + mask, dim=-1) @ x


class Masked(nn.Module):
    """A causal mask of finfo(dtype).min built in the run's own dtype, passed to a submodule (as
    Hugging Face attention does): cast from float32, it would be -inf in bf16."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.scores = Scores()

    def forward(self, x):
        h = self.proj(x)
        n = h.shape[-2]
        mask = torch.full((n, n), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)
        return self.scores(h, mask)


def masked(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Masked(), inputs=[torch.randn(2, 8, 16), torch.randn(2, 8, 16)], loss=_mse,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)


class BiasedAttention(nn.Module):
    """SDPA with a learned additive bias (relative positions, as timm's CoAtNet): a mask that
    requires grad sends CPU SDPA down its math path (bmm), a plain one to a fused kernel."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 1, 1, 16))  # q, k, v without a matmul of their own
        self.bias = nn.Parameter(torch.randn(1, 4, 8, 8) * 0.1)

    def forward(self, x):
        q, k, v = (x * self.w).view(3, 2, 8, 4, 4).transpose(2, 3).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.transpose(1, 2).reshape(2, 8, 16)


class BiasedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = BiasedAttention()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.attn(x))


def biased_attention(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=BiasedModel(), inputs=[torch.randn(2, 8, 16)], loss=_mse,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1)

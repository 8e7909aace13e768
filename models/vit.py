"""A tiny Vision Transformer: conv patch embedding, class token, pre-norm blocks, class-token head.

Attention is written out (q @ k^T, softmax, @ v) rather than calling SDPA, so the softmax and the
two batched matmuls are visible ops of their own; llama.py covers the fused SDPA path.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.scenario import Scenario


@dataclasses.dataclass
class ViTConfig:
    in_channels: int = 3       # RGB images
    image_size: int = 16       # square inputs (H = W)
    patch_size: int = 4        # P: (16 / 4)^2 = 16 patches, plus the class token: N = 17
    dim: int = 64              # C: token width
    n_layer: int = 2           # transformer blocks
    n_head: int = 4            # attention heads; head_dim = 16
    mlp_ratio: int = 4         # MLP hidden = mlp_ratio * dim
    n_classes: int = 10        # output logits
    batch_size: int = 4        # images per step
    lr: float = 1e-3           # AdamW learning rate
    weight_decay: float = 0.05  # AdamW decoupled weight decay
    steps: int = 2             # training steps recorded


class Attention(nn.Module):
    """Multi-head self-attention from one qkv Linear and one output projection."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.dim // config.n_head
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_head, self.head_dim)  # (B, N, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)               # 3 x (B, nh, N, hs)
        att = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5        # (B, nh, N, N)
        att = att.softmax(dim=-1)
        y = att @ v                                                   # (B, nh, N, hs)
        y = y.transpose(1, 2).reshape(B, N, C)                        # (B, N, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, N, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))  # (B, N, C)
        return x + self.mlp(self.norm2(x))  # (B, N, C)


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        n_patches = (config.image_size // config.patch_size) ** 2
        self.patch_embed = nn.Conv2d(
            config.in_channels, config.dim, config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, config.dim))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.n_classes)
        # timm's init for the learned tokens; Linear/Conv/LayerNorm keep PyTorch's defaults.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # Batches carry their targets for the loss (Scenario convention: model(**batch));
        # the model itself never reads them.
        B = x.shape[0]
        x = self.patch_embed(x)                        # (B, C, H/P, W/P)
        x = x.flatten(2).transpose(1, 2)               # (B, n_patches, C)
        cls = self.cls_token.expand(B, -1, -1)         # (B, 1, C)
        x = torch.cat((cls, x), dim=1) + self.pos_embed  # (B, N, C)
        for block in self.blocks:
            x = block(x)                               # (B, N, C)
        x = self.norm(x)
        return self.head(x[:, 0])                      # (B, n_classes), from the class token


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the logits (B, n_classes) against the integer targets (B,)."""
    return F.cross_entropy(logits, batch["targets"])


def build(seed: int = 0) -> Scenario:
    """The ViT scenario: seeded weights, 2 batches of (4, 3, 16, 16) images, AdamW."""
    config = ViTConfig()
    with torch.random.fork_rng(devices=[]):  # seed init without touching the caller's RNG
        torch.manual_seed(seed)
        model = ViT(config)
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
        optimizer=functools.partial(
            torch.optim.AdamW, lr=config.lr, weight_decay=config.weight_decay
        ),
        steps=config.steps,
        name="vit",
    )

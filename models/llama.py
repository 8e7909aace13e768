"""A tiny Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied lm_head.

The parts that matter for drift: RMSNorm normalises in float32 and casts back (as Llama does),
so a bf16 run differs from fp32 only where bf16 really costs; RoPE angles are computed in
float32 at every forward for the same reason; the lm_head shares the embedding's storage, so
one parameter is used twice per step (once as an Embedding table, once as a Linear weight).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.scenario import Scenario


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 128      # token ids are drawn uniformly from [0, vocab_size)
    seq_len: int = 16          # T: tokens per sequence
    d_model: int = 64          # C: residual stream width
    n_layer: int = 2           # decoder blocks
    n_head: int = 4            # query heads; head_dim = d_model // n_head = 16
    n_kv_head: int = 2         # key/value heads (grouped-query attention: 2 q heads per kv)
    hidden: int = 192          # SwiGLU width: 2/3 * 4 * d_model rounded up to a multiple of 32
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5     # RMSNorm epsilon
    batch_size: int = 2        # B: sequences per step
    lr: float = 1e-3           # AdamW learning rate
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    steps: int = 2             # training steps recorded


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, head_dim), computed in float32."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )                                                               # (head_dim/2,)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)   # (T,)
    angles = torch.outer(t, inv_freq)                               # (T, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)                    # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+hs/2}) of x (B, nh, T, hs) by the angles in cos/sin (T, hs)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # "rotate half" (HF Llama's form), written into slices of one buffer as hand-written
    # kernels do: writes through views, which driftcheck's view/in-place audit checks.
    rotated = torch.zeros_like(x)                                     # (B, nh, T, hs)
    rotated[..., :half] = -x2
    rotated[..., half:] = x1
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention: n_head query heads share n_kv_head key/value heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.d_model // config.n_head
        kv_dim = config.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.head_dim
        # Head counts read off the projections (-1): under tensor parallelism (TP_PLAN) each
        # rank's q/k/v hold its own heads only, nh / ranks and nkv / ranks of them.
        q = self.q_proj(x).view(B, T, -1, hs).transpose(1, 2)              # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, hs).transpose(1, 2)              # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)              # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Each kv head serves n_head // n_kv_head consecutive query heads. Repeated explicitly
        # rather than with SDPA's enable_gqa, which not every backend implements.
        n_rep = self.n_head // self.n_kv_head  # the same on every rank: nh / nkv
        k = k.repeat_interleave(n_rep, dim=1)                              # (B, nh, T, hs)
        v = v.repeat_interleave(n_rep, dim=1)                              # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)                  # (B, T, C)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))           # (B, T, C)


# Tensor parallelism (driftcheck record --parallel tp, Megatron style): q/k/v and gate/up split
# along their outputs (heads, hidden units), o/down along their inputs, whose partial outputs
# are summed across the ranks; norms, embedding and the tied lm_head replicated. The number of
# ranks must divide n_kv_head (and so n_head): each rank keeps whole heads.
TP_PLAN = {
    "layers.*.attn.q_proj": "colwise", "layers.*.attn.k_proj": "colwise",
    "layers.*.attn.v_proj": "colwise", "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, one storage
        # GPT-2/Llama-style init: N(0, 0.02) for every matrix, norms stay at 1.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # Batches carry their targets for the loss (Scenario convention: model(**batch));
        # the model itself never reads them.
        B, T = idx.shape
        x = self.tok_emb(idx)                                           # (B, T, C)
        hs = self.config.d_model // self.config.n_head
        cos, sin = rope_cos_sin(T, hs, self.config.rope_theta, x.device, x.dtype)  # (T, hs)
        for block in self.layers:
            x = block(x, cos, sin)                                      # (B, T, C)
        return self.lm_head(self.norm(x))                               # (B, T, vocab)


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy: logits (B, T, vocab) against targets (B, T) = idx shifted by 1."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["targets"].reshape(-1))


def build(seed: int = 0) -> Scenario:
    """The Llama scenario: seeded weights, 2 batches of (2, 16) random tokens, AdamW."""
    config = LlamaConfig()
    with torch.random.fork_rng(devices=[]):  # seed init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Llama(config)
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(config.steps):
        tokens = torch.randint(
            0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=g
        )                                                   # (B, T+1)
        # Cloned so each is its own contiguous storage, not a view of `tokens` (traces and
        # replay files refuse tensors that share memory).
        inputs.append({"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()})
    return Scenario(
        model=model,
        inputs=inputs,
        loss=loss,
        optimizer=functools.partial(
            torch.optim.AdamW, lr=config.lr, weight_decay=config.weight_decay
        ),
        steps=config.steps,
        name="llama",
        tp_plan=TP_PLAN,
    )

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


def mixtral_aux(seed=0):
    """transformers' Mixtral with its router auxiliary loss: the router logits' output gradient
    at bf16 is ~11x what the analytic floor allows, on a correct run at that precision too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                        max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 64, (2, 16), generator=g) for _ in range(2)]
    return Scenario(model=MixtralForCausalLM(cfg), inputs=[{"input_ids": i, "labels": i} for i in ids],
                    loss=lambda out, batch: out.loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


class CastWrite(nn.Module):
    """``h[:, :4].to(float32)`` is a view of ``h`` in float32 and a copy in bfloat16: the write
    through it reaches ``h`` only in float32 (DeepSeek-V2's rotary part is cast and written so)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        part = h[:, :4].to(torch.float32)
        part.mul_(0.5)
        return self.out(h)


def cast_write(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=CastWrite(), inputs=[torch.randn(8, 8), torch.randn(8, 8)],
                    loss=lambda out, batch: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)

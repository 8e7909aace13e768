"""Decisions a module's code takes (argmax routing, a VQ codebook's argmin) flip on near ties
between two clean runs: how many may flip comes from the reference's recorded margins, a flip
that reroutes tokens changes expert shapes (a warning, not a failure), and a flipped index's
consumer carries a sparse error in stats mode. Each clean case failed before
compare/decisions.py; each fault must still fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_floor_classes import _pair, _worst
from torch import nn

from driftcheck import Scenario
from driftcheck.record.watch import decision_profile
from driftcheck.targets.faults import scale_output


def test_decision_profile_counts_margins():
    x = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.999, 0.0]])
    prof = decision_profile("argmax", (x, -1), {})
    # margins 2.0 and 0.001 over twice their rows' largest |score| (3 and 1): 1/3 and 1/2000
    assert prof[0] == 2 and prof[1] == 2 and prof[2] == 1 and prof[10] == 1 and prof[11] == 0
    top2 = decision_profile("topk", (x, 2), {})
    assert top2[0] == 4  # two indices per row, each with its margin to its neighbours
    assert decision_profile("max", (x,), {}) is None  # a value, not an index
    assert decision_profile("argmin", (x, 1), {})[0] == 2


# -- routing: a top-1 router whose near ties move a token to another expert ------------------------
class _Router(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(d, n, bias=False)

    def forward(self, x):
        return self.classifier(x).softmax(-1).argmax(-1)


class _MoeBlock(nn.Module):
    """A top-1 router and its experts in one block (a Hugging Face sparse MLP's layout)."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.router = _Router(d, n)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
                                     for _ in range(n))
        with torch.no_grad():  # experts 0 and 1 score alike: many near ties between them
            w = self.router.classifier.weight
            w[1] = w[0] + 1e-3 * torch.randn_like(w[0])

    def forward(self, h):
        idx = self.router(h)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            y[sel] = expert(h[sel])
        return y


class _Moe(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.moe = _MoeBlock(d, n)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x).reshape(-1, x.shape[-1])
        return self.out(self.moe(h) + h)


def _moe(seed=0):
    torch.manual_seed(seed)
    model = _Moe()
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(8, 16, 16, generator=g) for _ in range(2)]
    return Scenario(model=model, inputs=inputs, loss=lambda out, b: out.float().pow(2).mean(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_rerouted_tokens_after_a_near_tie_flip_pass(tmp_path, mode):
    rep = _pair(tmp_path, _moe, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    rerouted = [f for f in rep.findings if f.kind == "alignment.rerouted"]
    assert rerouted and rerouted[0].severity == "warning"
    assert rerouted[0].details["decision"].split("/")[2] == "moe.router"
    assert all(m.startswith("moe.experts.") for f in rerouted for m in f.details["modules"])
    flips = [e for e in rep.entries if e.module == "moe.router" and e.details.get("integer_mismatch_fraction")]
    assert flips and all(e.details["decisions"]["near_tie_share"] > 0 for e in flips)


def test_a_router_that_picks_the_least_likely_expert_is_caught(tmp_path):
    def wrong(model):
        r = model.moe.router
        r.forward = lambda x: r.classifier(x).softmax(-1).argmin(-1)
    rep = _pair(tmp_path, _moe, dtype="fp32", local=False, hooks=wrong)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "moe.router", rep.decided_by
    assert not any(f.kind == "alignment.rerouted" for f in rep.findings)


def test_a_shape_change_without_a_flip_still_fails(tmp_path):
    """An expert that drops its last token: shapes differ with every decision alike."""
    def wrong(model):
        seq = model.moe.experts[2]
        fwd = seq.forward
        seq.forward = lambda x: fwd(x[:-1]) if x.shape[0] > 1 else fwd(x)
    with pytest.raises(Exception):  # noqa: B017 (the target fails in the model's own code, any error)
        _pair(tmp_path, _moe, dtype="fp32", local=False, hooks=wrong)


def test_a_shape_change_outside_the_routing_block_still_fails(tmp_path):
    """A bf16 target whose router flips (as the clean one does) and whose head drops a row: the
    head is not inside the block the router routes within, so its shape is a defect."""
    def wrong(model):
        fwd = model.out.forward
        model.out.forward = lambda x: fwd(x)[:-1]
    rep = _pair(tmp_path, _moe, hooks=wrong)
    assert rep.verdict == "fail", rep.decided_by
    assert any(f.kind == "alignment.shape_mismatch" and f.module == "out" for f in rep.findings)


class _Ids(nn.Module):
    """Token ids handed down to an embedding by the model's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 4)
        self.corrupt = False

    def forward(self, ids):
        if self.corrupt:  # one id in 256 off by one: within the 5% a decision may flip
            ids = ids.clone()
            ids[0, 0] = (ids[0, 0] + 1) % 64
        return self.head(self.emb(ids))


def _ids(seed=0):
    torch.manual_seed(seed)
    model = _Ids()
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randint(0, 64, (8, 32), generator=g) for _ in range(2)]
    return Scenario(model=model, inputs=inputs, loss=lambda out, b: out.float().pow(2).mean(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


def test_ids_handed_down_must_match_exactly(tmp_path):
    def wrong(model):
        model.corrupt = True
    rep = _pair(tmp_path, _ids, dtype="fp32", local=False, hooks=wrong)
    assert rep.verdict == "fail", rep.decided_by
    e = next(e for e in rep.entries if e.module == "emb" and e.slot == "input.0" and e.step == 0)
    assert e.status != "ok" and e.rule == "integer tensors must match exactly"


# -- a VQ codebook: argmin over distances, an embedding lookup of the indices -----------------------
class _Quantize(nn.Module):
    def __init__(self, codes: int = 16, dim: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(codes, dim)

    def forward(self, z):
        zf = z.permute(0, 2, 3, 1)
        d = (zf.unsqueeze(-2) - self.embedding.weight).pow(2).sum(-1)
        idx = d.argmin(-1)
        q = self.embedding(idx).permute(0, 3, 1, 2)
        return z + (q - z).detach(), idx


class _Vq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.quantize = _Quantize()
        self.post = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        q, _ = self.quantize(self.enc(x))
        return self.head(F.gelu(self.post(q)))


def _vq(seed=0):
    torch.manual_seed(seed)
    model = _Vq()
    with torch.no_grad():  # codes in close pairs: many positions sit near a tie between two
        base = torch.randn(8, 4) * 0.3
        model.quantize.embedding.weight.copy_(torch.cat([base, base + 3e-3 * torch.randn(8, 4)]))
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(2)]
    return Scenario(model=model, inputs=inputs, loss=lambda out, b: (out.float() - b).pow(2).mean(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=2)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_codebook_indices_flipped_on_near_ties_pass(tmp_path, mode):
    rep = _pair(tmp_path, _vq, mode=mode)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    flipped = [e for e in rep.entries if e.module == "quantize.embedding" and e.slot == "input.0"
               and e.details.get("integer_mismatch_fraction")]
    assert flipped, "the clean target flips no code: the case shows nothing"


def test_a_codebook_that_picks_the_farthest_code_is_caught(tmp_path):
    def wrong(model):
        q = model.quantize

        def far(z):
            zf = z.permute(0, 2, 3, 1)
            idx = (zf.unsqueeze(-2) - q.embedding.weight).pow(2).sum(-1).argmax(-1)
            return z + (q.embedding(idx).permute(0, 3, 1, 2) - z).detach(), idx
        q.forward = far
    rep = _pair(tmp_path, _vq, dtype="fp32", local=False, hooks=wrong)
    assert rep.verdict == "fail" and rep.first_divergence["module"].startswith("quantize"), rep.decided_by


def _vq_plain(seed):
    def make():
        sc = _vq(seed)
        with torch.no_grad():  # codes drawn at random: flips are rare, a sample often holds none
            torch.manual_seed(seed + 7)
            sc.model.quantize.embedding.weight.normal_(0, 0.3)
        return sc
    return make


@pytest.mark.parametrize("seed", [2, 4])
def test_rare_code_flips_from_samples_pass(tmp_path, seed):
    """A flip or two in a thousand codes: the indices' sample holds none or one, the lookup's
    or the conv's after it one (36.8 and 14 before: seeds found by scanning 0-11)."""
    rep = _pair(tmp_path, _vq_plain(seed), mode="stats")
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    assert any(e.details.get("flip_estimate") for e in rep.entries)


def test_a_lookup_fault_after_rare_flips_still_caught_from_samples(tmp_path):
    rep = _pair(tmp_path, _vq_plain(2), mode="stats", dtype="fp32", local=False,
                hooks=scale_output("quantize.embedding", 1.3))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "quantize.embedding", rep.decided_by


# -- rounding to a grid in the model's own code: a VAE whose latents are stored as uint8 levels ----
def test_rounding_profile_counts_margins_to_the_boundary():
    from driftcheck.record.watch import rounding_profile

    x = torch.tensor([0.5001, 1.9, 2.25, -3.0])  # margins to .5 boundaries: 1e-4, 0.4, 0.25, 0.5
    prof = rounding_profile("round", (x,), {})
    # over 2 x absmax (6): 1.7e-5, 0.067, 0.042, 0.083
    assert prof[0] == 4 and prof[3] == 4 and prof[4] == 2 and prof[5] == 1 and prof[15] == 1 and prof[16] == 0
    floor = rounding_profile("floor", (torch.tensor([2.999, 1.5]),), {})  # margins 1e-3, 0.5
    assert floor[0] == 2 and floor[3] == 2 and floor[4] == 1 and floor[12] == 1 and floor[13] == 0
    assert rounding_profile("round", (torch.arange(3),), {}) is None  # integers: nothing rounded


def test_grid_step_reads_the_spacing_of_quantized_values():
    from driftcheck.compare.decisions import _grid_step

    levels = (torch.tensor([3, 5, 5, 9, 3, 3, 8, 5, 9, 9]).float() - 127.5) * (6 / 255)
    assert _grid_step(levels) == pytest.approx(6 / 255, rel=1e-5)
    assert _grid_step(torch.randn(100)) is None  # continuous values: no grid
    assert _grid_step(torch.tensor([0.0, 0.0, 1.0, 1.0, 2.5, 2.5, 0.0, 1.0])) is None  # 1 and 1.5 apart


class _Quantized(nn.Module):
    """An encoder whose latents are rounded to 256 levels around zero (a boundary at 0, as
    AutoencoderTiny's scale_latents puts it), then decoded."""

    def __init__(self, floor_instead: bool = False) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.dec = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 3, 1))
        self.floor_instead = floor_instead

    def forward(self, x):
        z = self.enc(x)
        scaled = z.float().div(6.0).add(0.5).clamp(0, 1).mul(255)
        q = scaled.floor() if self.floor_instead else scaled.round()
        return self.dec((q / 255 - 0.5).mul(6.0).to(z.dtype))


def _quantized(floor_instead=False):
    def make():
        torch.manual_seed(0)
        model = _Quantized(floor_instead)
        with torch.no_grad():
            model.enc.weight.mul_(0.05)  # small latents: many sit next to the boundary at 0
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(2, 3, 16, 16, generator=g) for _ in range(2)]
        return Scenario(model=model, inputs=inputs, loss=lambda out, b: out.float().pow(2).mean(),
                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), steps=2)
    return make


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_latents_rounded_to_a_grid_pass_where_rounding_flips_them(tmp_path, mode):
    rep = _pair(tmp_path, _quantized(), mode=mode, local=False)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    rounded = [e for e in rep.entries if e.module == "dec" and e.slot == "input.0"
               and e.details.get("rounding") and e.metrics.get("max_abs")]
    assert rounded, "the clean target flips no level: the case shows nothing"


def test_latents_floored_instead_of_rounded_are_caught(tmp_path):
    def wrong(model):
        model.floor_instead = True
    rep = _pair(tmp_path, _quantized(), dtype="fp32", local=False, hooks=wrong)
    assert rep.verdict == "fail" and rep.first_divergence["module"] in ("", "dec"), rep.decided_by


# -- a decision taken on the host: a DETR-style loss matching queries to boxes with scipy ----------
class _Boxes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, target=None):  # the target is the loss's
        return self.head(torch.tanh(self.embed(x))).sigmoid()


def _matched_loss(out, batch):
    from scipy.optimize import linear_sum_assignment

    _x, target = batch
    loss = out.new_zeros(())
    for b in range(out.shape[0]):  # Hungarian matching on the host, as transformers' DETR loss
        with torch.no_grad():
            cost = torch.cdist(out[b].float(), target[b:b + 1].float(), p=1)
        rows, _ = linear_sum_assignment(cost.cpu())
        # the matched query regressed to a box away from it (not to ~0: a loss of pure noise)
        loss = loss + (out[b, int(rows[0])].float() - target[b].float() - 0.3).square().sum()
    return loss


def _detr(seed=0):
    def make():
        torch.manual_seed(seed)
        model = _Boxes()
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(4, 6, 8, generator=g)
        x[:, 2] = x[:, 1] + 1e-4 * torch.randn(4, 8, generator=g)  # two queries nearly alike
        with torch.no_grad():
            boxes = model(x)
        target = (boxes[:, 1] + boxes[:, 2]) / 2  # a box between them: a near tie to match
        return Scenario(model=model, inputs=[(x, target)] * 2, loss=_matched_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), steps=2)
    return make


def test_queries_matched_otherwise_on_near_ties_pass(tmp_path):
    rep = _pair(tmp_path, _detr(), local=False)
    assert rep.verdict == "pass", (rep.decided_by, _worst(rep))
    moved = [e for e in rep.entries if e.slot == "grad_output" and e.module == ""
             and (e.details.get("kink_flips") or {}).get("count")]
    assert moved, "the clean target matches every box as the reference: the case shows nothing"


def test_a_box_head_fault_is_still_caught_after_host_matching(tmp_path):
    rep = _pair(tmp_path, _detr(), dtype="fp32", local=False, hooks=scale_output("head", 1.05))
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "head", rep.decided_by

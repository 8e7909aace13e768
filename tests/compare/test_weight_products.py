"""Issue 47, class 6: coherent updates. After one AdamW step the two runs' weights differ where a
near-zero gradient flipped its sign; a query over the one class token of each sample has a rank-
one weight gradient, so a flipped row's difference is a multiple of the class token's sign
pattern, and the product sums it coherently: sqrt(K) times the random walk the floor assumed.
The error a product gets from its weight's difference is computed exactly where the floor
objects (compare/products.py): the clean bf16 run passes; a defect still fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import Comparison, compare
from driftcheck.compare.alignment import Alignment
from driftcheck.compare.judge import Judge
from driftcheck.compare.products import Products
from driftcheck.record.runner import record
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

C = 512


class _ClassQueries(nn.Module):
    """Class attention as CaiT's: each block's query is a Linear over one class token
    (a buffer here: its input is the same in both runs, the weight's difference alone moves
    the query)."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(16, C)
        self.register_buffer("cls", torch.randn(blocks, 1, 1, C) * 0.02)
        self.q = nn.ModuleList(nn.Linear(C, C, bias=False) for _ in range(blocks))
        self.k = nn.Linear(C, C)
        self.head = nn.Linear(C, 10)

    def forward(self, x, y):
        t = self.embed(x)
        k = self.k(t)
        out = 0
        for i, q in enumerate(self.q):
            cls = self.cls[i].expand(x.shape[0], -1, -1)
            a = torch.softmax(q(cls) @ k.transpose(1, 2) / 8, -1)
            out = out + (a @ t)[:, 0]
        return self.head(out)


def _scenario(seed: int = 2) -> Scenario:
    torch.manual_seed(seed)
    m = _ClassQueries()
    x, y = torch.randn(2, 8, 16), torch.randint(0, 10, (2,))
    return Scenario(model=m, inputs=[(x, y)] * 2,
                    loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("products")
    record(_scenario(), root / "ref")
    record(_scenario(), root / "bf16", autocast="bf16", replay=root / "ref", local=root / "ref")
    return root


def test_a_coherent_weight_difference_passes(runs, monkeypatch):
    rep = compare(runs / "ref", runs / "bf16")
    assert rep.verdict == "pass", rep.decided_by
    queries = [e for e in rep.entries if e.step == 1 and e.phase == "forward"
               and e.module.startswith("q.") and e.slot == "output"]
    assert len(queries) == 3 and any("weight_difference" in e.details for e in queries)
    # the layers' own error is small: the drift is the weights' difference, not the code
    assert all(e.local_ratio is not None and e.local_ratio < 1.5 for e in queries)
    # the random-walk floor alone fails the clean run at a query after the step
    monkeypatch.setattr(Judge, "weight_difference", lambda self, c, fi, f: (fi, f))
    before = compare(runs / "ref", runs / "bf16")
    assert before.verdict == "fail"
    fd = before.first_divergence
    assert (fd["step"], fd["phase"], fd["slot"]) == (1, "forward", "output") and fd["module"].startswith("q."), fd


def test_a_defect_after_the_step_is_still_caught(runs, tmp_path, monkeypatch):
    """A 5% wrong product after the step fails, the weight's difference computed for it."""
    def hurt(module, args, out):
        hurt.calls += 1
        return out * 1.05 if hurt.calls == 2 else out
    hurt.calls = 0
    s = _scenario()
    s.model.embed.register_forward_hook(hurt)
    record(s, tmp_path / "fault", autocast="bf16", replay=runs / "ref")
    asked = []
    inherited = Products.inherited
    monkeypatch.setattr(Products, "inherited", lambda self, r: asked.append(r.key) or inherited(self, r))
    rep = compare(runs / "ref", tmp_path / "fault")
    assert rep.verdict == "fail"
    fd = rep.first_divergence
    assert (fd["step"], fd["module"], fd["phase"], fd["slot"]) == (1, "embed", "forward", "output"), fd
    assert "1/forward/embed/0/output" in asked


@pytest.mark.parametrize("layer", [
    nn.Conv2d(4, 8, 3, stride=2, padding=1, dilation=2, groups=2),
    nn.Conv1d(4, 6, 5, padding="same"),
    nn.Linear(12, 7),
])
def test_the_difference_is_what_the_layer_makes_of_it(layer, tmp_path):
    """What products.py computes is the layer's own output (and input gradient) with the
    target's weights minus with the reference's, on the reference's operand."""
    shape = {nn.Conv2d: (3, 4, 9, 9), nn.Conv1d: (3, 4, 11), nn.Linear: (3, 5, 12)}[type(layer)]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer
            self.gain = nn.Parameter(torch.ones(()))  # the layer's input needs a gradient

        def forward(self, x):
            return self.layer(x * self.gain).tanh().sum()

    torch.manual_seed(0)
    sc = Scenario(model=Net(), inputs=[torch.randn(shape)] * 2, loss=lambda out, batch: out,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=2)
    record(sc, tmp_path / "ref")
    record(sc, tmp_path / "bf16", dtype="bf16", replay=tmp_path / "ref")
    c = Comparison(TraceReader(tmp_path / "ref"), TraceReader(tmp_path / "bf16"))
    al = Alignment.of(c.ref_entries, c.tgt_entries, [], None, [])
    products = Products(al.index, c.ref, c.tgt, al.tgt_map)

    def tensor(reader, phase, slot, entries=al.index.by_align):
        e = entries[TraceKey(1, phase, "layer", 0, slot)]
        if reader is c.tgt:
            e = al.tgt_map[e.align]
        return reader.tensor(e.raw).double()

    x = tensor(c.ref, "forward", "input.0").requires_grad_()
    g = tensor(c.ref, "backward", "grad_output")
    outs, grads = [], []
    for reader in (c.ref, c.tgt):
        m = layer.double()
        with torch.no_grad():
            m.weight.copy_(tensor(reader, "params", "param.weight"))
            m.bias.copy_(tensor(reader, "params", "param.bias"))
        y = m(x)
        outs.append(y.detach())
        grads.append(torch.autograd.grad(y, x, g)[0])
    for slot, pair in (("output", outs), ("grad_input.0", grads)):
        phase = "forward" if slot == "output" else "backward"
        r = al.index.by_align[TraceKey(1, phase, "layer", 0, slot)]
        want = pair[1] - pair[0]
        if phase == "backward":
            want = torch.autograd.grad(  # the input gradient of the weight's difference alone
                nn.functional.linear(x, tensor(c.tgt, "params", "param.weight")
                                     - tensor(c.ref, "params", "param.weight")) if isinstance(layer, nn.Linear)
                else layer.double()._conv_forward(x, tensor(c.tgt, "params", "param.weight")
                                                  - tensor(c.ref, "params", "param.weight"), None),
                x, g)[0]
        got = products.inherited(r)
        assert got is not None and float(want.abs().max()) > 0
        assert got[0] == pytest.approx(float(want.pow(2).mean().sqrt()), rel=1e-6)
        assert got[1] == pytest.approx(float(want.abs().max()), rel=1e-6)

"""The local replay leaves the run's state alone (issue 47, class 2): a cache handed to a module
(a Hugging Face Cache, or any object that keeps state across calls the way one does) is the
replay's own copy. Reformer's bucket cache took a replay's buckets, and the next layer joined
float32 to its int64 ones; here a layer that reads how much its cache holds would compute
another value in the live run after a replay wrote into it."""
from __future__ import annotations

import torch
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.record.isolation import private_state
from driftcheck.record.runner import record


class _Cache:
    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def update(self, t):
        self.seen.append(t)
        return len(self.seen)

    def get_seq_length(self):
        return len(self.seen)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        n = cache.update(x)  # a replay that wrote here would change every later layer's n
        return self.lin(x) * n


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer(), _Layer()])

    def forward(self, x):
        cache = _Cache()
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _scenario() -> Scenario:
    torch.manual_seed(0)
    return Scenario(model=_Net(), inputs=[torch.randn(4, 8), torch.randn(4, 8)],
                    loss=lambda out, batch: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), steps=2)


def test_a_replay_does_not_write_into_the_runs_cache(tmp_path):
    record(_scenario(), tmp_path / "ref")
    record(_scenario(), tmp_path / "t", replay=tmp_path / "ref", local=tmp_path / "ref")
    rep = compare(tmp_path / "ref", tmp_path / "t")
    assert rep.verdict == "pass", rep.decided_by
    worst = max(e.ratio for e in rep.entries if e.ratio is not None)
    assert worst == 0.0  # fp32 on both sides, one thread: the replay changed nothing of the run
    assert any(e.local_ratio is not None for e in rep.entries if e.module == "layers.1")


def test_private_state_copies_caches_and_keeps_tensors_and_modules():
    cache, lin, t = _Cache(), nn.Linear(2, 2), torch.ones(2, requires_grad=True) * 2
    cache.update(t)  # a tensor of the live graph: deepcopy refuses it, the containers are copied
    args, kw = private_state(((t, cache, lin), {"c": cache, "n": 3}))
    assert args[0] is t and args[2] is lin and kw["n"] == 3
    assert args[1] is not cache and kw["c"] is not cache
    args[1].update(t)
    assert cache.get_seq_length() == 1 and args[1].get_seq_length() == 2
    assert args[1].seen[0] is t

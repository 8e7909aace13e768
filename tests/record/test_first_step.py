"""A record's first step pays nothing once that later steps do not: the compiled kernels of
the host's statistics are loaded (or compiled) when the tracer attaches, not inside step 0
(bench/record_overhead.py --size 350m: stats mode <= 1.25x on every step, the first included).

Each case runs in a fresh process: numba's loaded kernels are per process, and another test of
this session would have loaded them already."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import json, sys
import torch
from torch import nn
import driftcheck
from driftcheck.numerics import stats, summary_kernels

if sys.argv[3] == "no-warm":
    stats.warm = lambda device, params: None  # what attach did before


class Net(nn.Module):  # large enough for every compiled path: captures >= stats.BIG elements,
    def __init__(self):  # a Linear input and a softmax over more than passes.SMALL
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        h = self.a(x)
        att = torch.softmax(h @ h.transpose(1, 2) / 16, dim=-1)
        return self.b(att @ h)


def loaded():
    return {name: len(d.signatures) for name, d in vars(summary_kernels).items()
            if hasattr(d, "signatures")}


torch.manual_seed(0)
model, x = Net(), torch.randn(8, 128, 256)
opt = torch.optim.AdamW(model.parameters())
with driftcheck.trace(model, out=sys.argv[1], mode=sys.argv[2], optimizer=opt) as t:
    attached = loaded()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    t.step(loss)
    stepped = loaded()
print(json.dumps({"attached": attached, "stepped": stepped}))
'''


def _run(tmp_path: Path, mode: str, warm: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / f"{mode}-{warm}"), mode, warm],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["stats", "full"])
def test_the_first_step_loads_no_kernel(tmp_path, mode):
    got = _run(tmp_path, mode, "warm")
    grew = {k: (got["attached"][k], n) for k, n in got["stepped"].items() if n > got["attached"][k]}
    assert not grew, f"kernels first loaded inside step 0 (name: (after attach, after the step)): {grew}"
    # the step did reach the compiled paths the warm-up loads
    used = {"dense_stats", "col_sumsq", "weighted_absmax"} | ({"summarize_into", "gather_sample"}
                                                              if mode == "stats" else {"copy_stats"})
    assert all(got["attached"][k] >= 1 for k in used), got["attached"]


def test_without_the_warm_up_step_0_loads_them(tmp_path):
    """The check above can fail: with attach's warm-up taken out, step 0 loads kernels."""
    got = _run(tmp_path, "stats", "no-warm")
    grew = [k for k, n in got["stepped"].items() if n > got["attached"][k]]
    assert {"col_sumsq", "weighted_absmax"} <= set(grew), got

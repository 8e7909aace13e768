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
dtype = getattr(torch, sys.argv[4])
model, x = Net().to(dtype), torch.randn(8, 128, 256, dtype=dtype)
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


def _run(tmp_path: Path, mode: str, warm: str, dtype: str = "float32") -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / f"{mode}-{warm}-{dtype}"), mode, warm, dtype],
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


@pytest.mark.parametrize("mode", ["stats", "full"])
def test_a_bfloat16_models_first_step_loads_no_kernel(tmp_path, mode):
    """A bfloat16 model's large captures are widened a chunk at a time (``widen_bf16``) for the
    float32 kernels: those are loaded when the tracer attaches too."""
    got = _run(tmp_path, mode, "warm", "bfloat16")
    grew = {k: (got["attached"][k], n) for k, n in got["stepped"].items() if n > got["attached"][k]}
    assert not grew, f"kernels first loaded inside step 0 (name: (after attach, after the step)): {grew}"
    assert got["attached"]["widen_bf16"] >= 1 and got["attached"]["dense_stats"] >= 1, got["attached"]


def test_without_the_warm_up_step_0_loads_them(tmp_path):
    """The check above can fail: with attach's warm-up taken out, step 0 loads kernels."""
    got = _run(tmp_path, "stats", "no-warm")
    grew = [k for k, n in got["stepped"].items() if n > got["attached"][k]]
    assert {"col_sumsq", "weighted_absmax"} <= set(grew), got


THRESHOLD_SCRIPT = r'''
import contextlib, ctypes, json, sys
import torch
from torch import nn
import torch.nn.functional as F
import driftcheck


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                 "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


class Attention(nn.Module):  # every tensor the model frees <= 400 KB; its logits 16 x 512 x 512 (16 MB)
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)
        # captured each step (buffers, params phase): not contiguous, a copy to summarise it
        self.register_buffer("table", torch.randn(2048, 2048).t())

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, 512, 3, 16, 4).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        .transpose(1, 2).reshape(1, 512, 64))


torch.manual_seed(0)
model, x = Attention(), torch.randn(1, 512, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
traced = sys.argv[2] == "traced"
with driftcheck.trace(model, out=sys.argv[1], mode="stats", optimizer=opt) if traced \
        else contextlib.nullcontext() as t:
    for _ in range(2):  # two steps: the tracer's block, kept from step to step, goes at the end
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if traced:
            t.step(loss)
before = libc.mallinfo2().hblks
probe = torch.empty(1 << 21)  # 8 MB: a fresh mapping while glibc's mmap threshold is below it
print(json.dumps({"mapped": libc.mallinfo2().hblks - before}))
'''


def _threshold_run(tmp_path: Path, how: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", THRESHOLD_SCRIPT, str(tmp_path / how), how],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (mallinfo2)")
def test_the_tracers_own_buffers_leave_mallocs_mmap_threshold_alone(tmp_path):
    """glibc raises its mmap threshold to the size of any mapped block freed: a block of
    recomputed attention logits (16 MB here) allocated and freed through malloc moved every later
    allocation below that size into the heap, the model's included (a 349M Llama's first traced
    step: ~1.3 GB more heap before the optimizer's step). The tracer's working buffers are mapped
    on their own (store/buffers.py mapped_empty), and so is the copy through which a large
    capture that is not contiguous (a 16 MB transposed buffer here) is summarised: after traced
    steps an 8 MB allocation is still a mapping of its own, as after the same steps untraced. (The interpreter's own growth, the
    modules driftcheck imports, moves the threshold to ~2-4 MB, not 8.)"""
    assert _threshold_run(tmp_path, "untraced")["mapped"] == 1  # the probe works: 8 MB is mapped
    assert _threshold_run(tmp_path, "traced")["mapped"] == 1

"""Training loops under torchrun (2 processes, gloo, CPU): driftcheck.trace() around DDP and
FSDP2, a Lightning FSDP2 fit and a Hugging Face Trainer under DDP (tests/data/dist_loops.py).
One trace per rank; a clean bf16 target passes rank by rank, a fault on rank 1 is named there."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from driftcheck.compare.ranks import compare_ranks
from driftcheck.store import TraceReader
from driftcheck.store.layout import rank_dirs

SCRIPT = Path(__file__).parent.parent / "data" / "dist_loops.py"
FAULTY = {"api-ddp": "net.2", "api-fsdp": "net.2", "lightning-fsdp": "net.2",
          "trainer-ddp": "model.layers.1.mlp"}
PARALLEL = {"api-ddp": "ddp", "api-fsdp": "fsdp", "lightning-fsdp": "fsdp", "trainer-ddp": "ddp"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=sorted(FAULTY))
def loop(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           str(SCRIPT), str(out), request.param]
    # a hook that communicated could leave the ranks waiting on each other: a timeout, not a hang
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, out


def test_one_trace_per_rank_a_clean_target_passes_and_the_fault_is_named(loop):
    name, out = loop
    assert sorted(rank_dirs(out / "ref")) == [0, 1]
    for r, d in rank_dirs(out / "ref").items():
        run = TraceReader(d).run
        assert (run["rank"], run["world_size"], run["parallel"]) == (r, 2, PARALLEL[name])
    clean = compare_ranks(out / "ref", out / "clean")
    assert clean, clean.decided_by
    bad = compare_ranks(out / "ref", out / "fault")
    assert not bad
    assert bad.first_divergence["module"] == FAULTY[name] and bad.first_divergence["rank"] == 1


def test_a_shard_passes_on_the_whole_parameters_error(loop):
    """FSDP2 records each rank's shard of a parameter; the module computes with all of it. The
    rows rank 0 holds barely move in step 0 while rank 1's carry the bf16 update error, so rank
    0's net.0 output at step 1 was judged against its own shard's error: ratio 3.33 of 3.5 on a
    clean target before compare_ranks measured the whole parameter."""
    name, out = loop
    if PARALLEL[name] != "fsdp":
        assert not any(e.get("meta", {}).get("shard") for e in TraceReader(out / "ref" / "rank-0").entries)
        return
    shards = [e for e in TraceReader(out / "ref" / "rank-0").entries if e.get("meta", {}).get("shard")]
    assert {e["phase"] for e in shards} >= {"params", "grads", "optimizer"}
    clean = compare_ranks(out / "ref", out / "clean")
    worst = max(e.ratio for e in clean.entries if e.ratio is not None and e.phase == "forward")
    assert worst < 2.0

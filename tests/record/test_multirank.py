"""Multi-rank records: two real processes under torchrun (gloo, CPU) with DDP and FSDP, one trace
per rank, and a rank-by-rank comparison that names the rank where a fault enters."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import dc

from driftcheck.compare.ranks import compare_ranks
from driftcheck.errors import DriftcheckError
from driftcheck.record.ranks import choose_backend, shard_batch
from driftcheck.store import TraceReader
from driftcheck.store.layout import is_multirank, rank_dirs

SCENARIO = textwrap.dedent('''
    import os
    import torch
    from torch import nn
    from driftcheck import Scenario

    class Scale(nn.Module):
        """x * 1, except on the target's rank 1 when DC_FAULT is set: a 1% defect (same graph)."""
        def forward(self, x):
            fault = os.environ.get("DC_FAULT") and os.environ.get("RANK") == "1"
            return x * (1.01 if fault else 1.0)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Scale(), nn.Linear(16, 4))
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
        return Scenario(model=model, inputs=xs, loss=lambda out, x: out.pow(2).mean(),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=2)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, *args: str, fault: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    env.pop("DC_FAULT", None)
    if fault:
        env["DC_FAULT"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "driftcheck", "--quiet", "record", str(tmp_path / "sc.py:build"), *args]
    # A hook that communicated could leave the ranks waiting on each other: the timeout turns a
    # deadlock into a failure instead of a hang.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank")
    (tmp / "sc.py").write_text(SCENARIO)
    out = {}
    for par in ("ddp", "fsdp"):
        ref, tgt = tmp / f"{par}-ref", tmp / f"{par}-tgt"
        # the device's own backend (gloo on CPU), and the same one by name
        by_name = ("--dist-backend", "gloo") if par == "fsdp" else ()
        _torchrun(tmp, "--out", str(ref), "--parallel", par, *by_name)
        _torchrun(tmp, "--out", str(tgt), "--parallel", par, "--replay", str(ref), fault=True)
        out[par] = (ref, tgt)
    return out


@pytest.mark.parametrize("par", ["ddp", "fsdp"])
def test_one_complete_trace_per_rank_with_rank_metadata(runs, par):
    ref, _ = runs[par]
    assert is_multirank(ref) and list(rank_dirs(ref)) == [0, 1]
    readers = [TraceReader(d) for d in rank_dirs(ref).values()]
    for r, reader in enumerate(readers):
        assert (reader.run["rank"], reader.run["world_size"], reader.run["parallel"]) == (r, 2, par)
        assert reader.run["backend"] == "gloo"
        phases = {e["phase"] for e in reader.entries}
        assert {"params", "forward", "backward", "grads", "optimizer", "loss"} <= phases
        # Module paths are the model's own, without a wrapper's prefix.
        assert {e["module"] for e in reader.entries} >= {"0", "1", "2", "3"}
    # Each rank ran its half of the global batch of 4.
    x0 = next(e for e in readers[0].entries if e["phase"] == "forward" and e["module"] == "0"
              and e["slot"] == "input.0")
    assert x0["shape"] == [2, 8]
    w = next(e for e in readers[0].entries if e["phase"] == "params" and e["module"] == "0"
             and e["slot"] == "param.weight")
    # DDP replicates parameters; FSDP records this rank's shard of the (16, 8) weight.
    assert w["shape"] == ([16, 8] if par == "ddp" else [8, 8])


def test_ddp_ranks_end_each_step_with_the_same_parameters(runs):
    ref, _ = runs["ddp"]
    r0, r1 = (TraceReader(d) for d in rank_dirs(ref).values())
    by_key = {e["key"]: e for e in r1.entries}
    opt = [e for e in r0.entries if e["phase"] == "optimizer" and e["slot"].startswith("param.")]
    assert opt
    for e in opt:  # the all-reduce worked, and the hooks recorded after it
        assert torch.equal(r0.tensor(e), r1.tensor(by_key[e["key"]])), e["key"]
    losses = [r.tensor(e).item() for r in (r0, r1) for e in r.entries if e["phase"] == "loss"]
    assert losses[0] != losses[2]  # each rank saw different data


@pytest.mark.parametrize("par", ["ddp", "fsdp"])
def test_compare_reports_rank_by_rank_and_names_the_faulty_rank(runs, par, tmp_path):
    ref, tgt = runs[par]
    report = compare_ranks(ref, tgt)
    assert report.verdict == "fail" and "rank 1: fail" in report.decided_by
    fd = report.first_divergence
    assert fd["rank"] == 1 and fd["module"] == "2" and fd["phase"] == "forward", fd
    rank0 = [e for e in report.entries if e.details["rank"] == 0 and e.status == "drift"]
    if par == "ddp":
        # Rank 0 records its gradients before the all-reduce: its run stays within the floor.
        assert "rank 0: pass" in report.decided_by and not rank0
    else:
        # FSDP's reduce-scatter carries rank 1's defect into rank 0's gradient shard: rank 0
        # drifts too, but only from the grads phase on, never in its own forward.
        assert rank0 and all(e.phase in ("grads", "optimizer", "params") for e in rank0)
    assert {e.details["rank"] for e in report.entries} == {0, 1}
    # The CLI takes the run directories as they are and exits 1.
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "compare", str(ref), str(tgt),
                           "--json", str(tmp_path / "r.json")], capture_output=True, text=True,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), timeout=120)
    assert proc.returncode == 1, proc.stderr
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["first_divergence"]["key"].startswith("rank1:")


def test_a_clean_target_passes_on_every_rank(runs):
    ref, _ = runs["ddp"]
    report = compare_ranks(ref, ref)
    assert report.verdict == "pass" and report.decided_by.count(": pass") == 2


def test_a_run_directory_missing_a_rank_is_one_line_naming_it(runs, tmp_path):
    ref, tgt = runs["ddp"]
    for gone in (1, 0):
        part = tmp_path / f"without-{gone}"
        shutil.copytree(tgt, part)
        shutil.rmtree(part / f"rank-{gone}")
        for a, b in ((ref, part), (part, ref), (part, ref / "rank-0")):
            proc = dc("compare", str(a), str(b))
            assert proc.returncode == 2, proc.stderr
            assert f"{part}: rank-{gone} is missing (the run had 2 ranks" in proc.stderr, proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (tmp_path / "without-0" / "rank-1" / "manifest.json").unlink()  # a record that did not finish
    proc = dc("compare", str(ref), str(tmp_path / "without-0"))
    assert proc.returncode == 2 and "rank 1's record did not finish" in proc.stderr, proc.stderr


def test_shard_batch_splits_dim0_and_refuses_uneven_batches():
    b = {"x": torch.arange(8).reshape(4, 2), "n": 3}
    assert shard_batch(b, 1, 2)["x"].tolist() == [[4, 5], [6, 7]] and shard_batch(b, 1, 2)["n"] == 3
    with pytest.raises(DriftcheckError, match="multiple of 3"):
        shard_batch(torch.zeros(4, 2), 0, 3)


def test_the_process_group_backend_is_the_devices_own_or_any_registered_one_by_name():
    import torch.distributed as dist

    assert choose_backend("cpu") == choose_backend("lazy") == choose_backend("cpu", "gloo") == "gloo"
    if dist.is_nccl_available():
        assert choose_backend("cuda") == "nccl"
    else:  # a CPU build: nccl is the default of cuda, and its absence is one line
        with pytest.raises(DriftcheckError, match="of device 'cuda', nccl, is not available"):
            choose_backend("cuda")
    # torch_tpu registers tpu_dist; without it the record stops in one line that says so
    with pytest.raises(DriftcheckError, match=r"device 'tpu', tpu_dist, is not available.*torch_tpu") as e:
        choose_backend("tpu")
    assert "\n" not in str(e.value) and "gloo" in str(e.value)
    with pytest.raises(DriftcheckError, match="--dist-backend nope is not available"):
        choose_backend("cpu", "nope")
    # any backend registered with torch.distributed, by name
    dist.Backend.register_backend("dctest", lambda *a: None, devices=["cpu"])
    assert choose_backend("cpu", "dctest") == "dctest"


def test_a_backend_that_is_not_registered_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "sc.py").write_text(SCENARIO)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    for extra, says in ((["--parallel", "ddp", "--dist-backend", "tpu_dist"],
                         "--dist-backend tpu_dist is not available in this torch"),
                        (["--dist-backend", "gloo"], "--dist-backend chooses the process group")):
        proc = subprocess.run([sys.executable, "-m", "driftcheck", "record", str(tmp_path / "sc.py:build"),
                               "--out", str(tmp_path / "o"), *extra], capture_output=True, text=True,
                              env=env, timeout=120, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

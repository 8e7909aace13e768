"""Compare across layouts (issue 46): a single-process trace against a 2-rank torchrun run (gloo,
CPU), DDP and FSDP2, 2-rank DDP against 2-rank FSDP2, 2 ranks against 4, each judged as one
logical trace (driftcheck/compare/layouts.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import record_cli

from driftcheck.compare.layouts import logical_shapes, logical_tensor
from driftcheck.compare.ranks import compare_ranks, different_layouts
from driftcheck.errors import DriftcheckError
from driftcheck.store import TraceReader
from driftcheck.store.layout import rank_dirs

SCENARIO = textwrap.dedent('''
    import os
    import torch
    from torch import nn
    from driftcheck import Scenario

    class Scale(nn.Module):
        """x * 1, or x * 1.05 with DC_FAULT: a 5% defect in module 2 (same graph)."""
        def forward(self, x):
            return x * (1.05 if os.environ.get("DC_FAULT") else 1.0)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Scale(), nn.Linear(16, 16),
                              nn.LayerNorm(16), nn.Linear(16, 4))
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
        return Scenario(model=model, inputs=xs, loss=lambda out, x: out.pow(2).mean(),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=2)
''')


def _record(tmp: Path, *args: str, ranks: int = 0, fault: bool = False) -> None:
    record_cli(tmp, str(tmp / "sc.py:build"), *args, ranks=ranks, env={"DC_FAULT": "1" if fault else ""})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    (tmp / "sc.py").write_text(SCENARIO)
    _record(tmp, "--out", str(tmp / "ref"))  # single process, fp32
    for name, extra, fault in (("ddp", ("--parallel", "ddp"), False),
                               ("fsdp-bf16", ("--parallel", "fsdp", "--dtype", "bf16"), False),
                               ("fsdp-fault", ("--parallel", "fsdp", "--dtype", "bf16"), True)):
        _record(tmp, "--out", str(tmp / name), "--replay", str(tmp / "ref"), *extra, ranks=2, fault=fault)
    _record(tmp, "--out", str(tmp / "ref2"), "--parallel", "ddp", ranks=2)  # 2-rank reference
    _record(tmp, "--out", str(tmp / "single-bf16"), "--replay", str(tmp / "ref2"), "--dtype", "bf16")
    for name, extra, n, fault in (("fsdp-of-ddp", ("--parallel", "fsdp"), 2, True),
                                  ("ddp4", ("--parallel", "ddp"), 4, False)):
        _record(tmp, "--out", str(tmp / name), "--replay", str(tmp / "ref2"), "--dtype", "bf16",
                *extra, ranks=n, fault=fault)
    return tmp


def test_a_2_rank_ddp_fp32_target_rebuilds_the_single_process_tensors(runs):
    report = compare_ranks(runs / "ref", runs / "ddp")
    assert report.verdict == "pass", report.decided_by
    assert report.target["world_size"] == 2 and report.target["layout"] == "logical"
    assert len(report.entries) == len(TraceReader(runs / "ref").entries)
    # Batch slices joined, backward gradients scaled by 1/world, DDP's local gradients averaged:
    # the same numbers as one process, up to float32 rounding of a different summation order.
    assert max(e.metrics["rel_l2"] for e in report.entries) < 1e-5
    assert not any("differ" in w for w in report.warnings), report.warnings
    # every rank's loss a mean over as many rows: nothing for compare/normalization.py to name
    assert not [f for f in report.findings if f.kind.startswith("layout.")]


def test_a_single_fp32_reference_against_2_rank_fsdp2_bf16_passes_and_a_fault_is_named(runs, tmp_path):
    # each rank records its FSDP2 shards with their layout
    r1 = TraceReader(rank_dirs(runs / "fsdp-bf16")[1])
    w = next(e for e in r1.entries if e["key"] == "0/params/0/0/param.weight")
    assert w["shape"] == [8, 8] and w["meta"]["layout"] == {
        "placements": ["S0"], "mesh": [2], "coord": [1], "global_shape": [16, 8], "offset": [8, 0]}
    report = compare_ranks(runs / "ref", runs / "fsdp-bf16")
    assert report.verdict == "pass"
    # the gradients were reduce-scattered across the 2 ranks in bf16: their floors allow it
    grads = [e for e in report.entries if e.phase == "grads"]
    assert grads and all(e.details.get("rank_split_allowance", 0) > 0 for e in grads)
    report = compare_ranks(runs / "ref", runs / "fsdp-fault")
    assert report.verdict == "fail"
    fd = report.first_divergence
    assert (fd["module"], fd["phase"], fd["step"]) == ("2", "forward", 0), fd
    # the CLI takes the two directories as they are: exit 1
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "compare", str(runs / "ref"),
                           str(runs / "fsdp-fault")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 1, proc.stderr
    assert "FAIL 2's forward output" in proc.stdout


def test_a_2_rank_reference_against_a_single_process_target_passes(runs):
    # the single process replayed the global batch (the ranks' parts joined in rank order)
    report = compare_ranks(runs / "ref2", runs / "single-bf16")
    assert report.verdict == "pass", report.decided_by
    assert report.reference["layout"] == "logical" and report.target.get("layout") is None


def test_a_float64_truth_across_layouts(runs, tmp_path):
    """--truth with a single-process reference and a 2-rank target: a float64 truth of one process,
    or of 2 ranks (rebuilt into its logical trace as the others are)."""
    (tmp_path / "sc.py").write_text(SCENARIO)
    _record(tmp_path, "--out", str(tmp_path / "truth"), "--replay", str(runs / "ref"), "--dtype", "fp64")
    _record(tmp_path, "--out", str(tmp_path / "truth2"), "--replay", str(runs / "ref"), "--dtype", "fp64",
            "--parallel", "ddp", ranks=2)
    for truth in ("truth", "truth2"):
        report = compare_ranks(runs / "ref", runs / "fsdp-bf16", truth=str(tmp_path / truth))
        assert report.verdict == "pass" and report.truth, (truth, report.decided_by)
        report = compare_ranks(runs / "ref", runs / "fsdp-fault", truth=str(tmp_path / truth))
        assert report.verdict == "fail" and report.first_divergence["module"] == "2", report.first_divergence
        # the truth judged the target: the fault's entry was measured against the float64 run
        out = next(e for e in report.entries if e.key == "0/forward/2/0/output")
        assert "truth" in out.details and out.details["truth"]["ratio"] > 3.5, out.details.get("truth")


def test_ddp_against_fsdp2_and_2_ranks_against_4_are_judged_as_one(runs):
    assert not different_layouts(runs / "ref2", runs / "ref2")  # same layout: rank by rank
    assert different_layouts(runs / "ref2", runs / "fsdp-of-ddp") and different_layouts(runs / "ref2", runs / "ddp4")
    # a 2-rank DDP fp32 reference, a 2-rank FSDP2 bf16 target with the 5% fault in module 2
    report = compare_ranks(runs / "ref2", runs / "fsdp-of-ddp")
    assert report.verdict == "fail" and report.first_divergence["module"] == "2", report.first_divergence
    assert report.reference["layout"] == report.target["layout"] == "logical"
    # 4 ranks replayed the 2 ranks' global batch, each its quarter
    assert [e["shape"] for e in TraceReader(rank_dirs(runs / "ddp4")[3]).entries
            if e["key"] == "0/forward/0/0/input.0"] == [[1, 8]]
    report = compare_ranks(runs / "ref2", runs / "ddp4")
    assert report.verdict == "pass" and report.target["world_size"] == 4, report.decided_by
    assert compare_ranks(runs / "ref", runs / "ddp4").verdict == "pass"


# -- stats mode across layouts: tensors whose parts are larger than a sample ----------------------
STATS_SCENARIO = SCENARIO
for _small, _large in (("nn.Linear(8, 16)", "nn.Linear(32, 64)"), ("nn.Linear(16, 16)", "nn.Linear(64, 64)"),
                       ("nn.LayerNorm(16)", "nn.LayerNorm(64)"), ("nn.Linear(16, 4)", "nn.Linear(64, 4)"),
                       ("torch.randn(4, 8, generator=g)", "torch.randn(64, 32, generator=g)")):
    assert _small in STATS_SCENARIO
    STATS_SCENARIO = STATS_SCENARIO.replace(_small, _large)


@pytest.fixture(scope="module")
def stats_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts-stats")
    (tmp / "sc.py").write_text(STATS_SCENARIO)
    _record(tmp, "--out", str(tmp / "ref"), "--mode", "stats")  # single process, fp32
    for name, extra, fault in (("ddp", ("--parallel", "ddp"), False),
                               ("fsdp-bf16", ("--parallel", "fsdp", "--dtype", "bf16"), False),
                               ("fsdp-fault", ("--parallel", "fsdp", "--dtype", "bf16"), True)):
        _record(tmp, "--out", str(tmp / name), "--replay", str(tmp / "ref"), "--mode", "stats", *extra,
                ranks=2, fault=fault)
    # the 2-rank fp32 run serves as a reference too: the same weights and inputs as one process
    _record(tmp, "--out", str(tmp / "single-bf16"), "--replay", str(tmp / "ref"), "--mode", "stats",
            "--dtype", "bf16")
    return tmp


def test_stats_mode_a_2_rank_ddp_fp32_target_rebuilds_the_single_process_samples(stats_runs):
    r1 = TraceReader(rank_dirs(stats_runs / "ddp")[1])
    x = next(e for e in r1.entries if e["key"] == "0/forward/3/0/output")  # (32, 64) of (64, 64)
    part = x["meta"]["part"]
    assert part["global_shape"] == [64, 64] and (part["dim"], part["start"]) == (0, 32)
    assert 0 < len(part["values"]) < 512  # its share of the 512 logical positions
    report = compare_ranks(stats_runs / "ref", stats_runs / "ddp")
    assert report.verdict == "pass", report.decided_by
    assert report.target["layout"] == "logical" and report.target["world_size"] == 2
    assert len(report.entries) == len(TraceReader(stats_runs / "ref").entries)
    # the samples at the single process's positions, the joined parts' statistics combined: the
    # same numbers as one process up to float32 rounding of another summation order
    joined = [e for e in report.entries if e.phase in ("forward", "backward") and e.metrics.get("count") == 512]
    assert joined and max(e.metrics["rel_l2"] for e in joined) < 1e-5
    out = next(e for e in report.entries if e.key == "0/forward/3/0/output")
    assert out.details["tgt_stats"]["numel"] == 4096
    assert abs(out.details["tgt_stats"]["l2"] / out.details["ref_stats"]["l2"] - 1) < 1e-6


def test_stats_mode_single_fp32_against_2_rank_fsdp2_bf16_passes_and_a_fault_is_named(stats_runs):
    w = next(e for e in TraceReader(rank_dirs(stats_runs / "fsdp-bf16")[1]).entries
             if e["key"] == "0/params/3/0/param.weight")
    assert w["meta"]["part"]["global_shape"] == [64, 64] and w["meta"]["part"]["start"] == 32
    report = compare_ranks(stats_runs / "ref", stats_runs / "fsdp-bf16")
    assert report.verdict == "pass", report.decided_by
    report = compare_ranks(stats_runs / "ref", stats_runs / "fsdp-fault")
    assert report.verdict == "fail"
    fd = report.first_divergence
    assert (fd["module"], fd["phase"], fd["step"]) == ("2", "forward", 0), fd


def test_stats_mode_a_2_rank_reference_against_a_single_process_target_passes(stats_runs):
    report = compare_ranks(stats_runs / "ddp", stats_runs / "single-bf16")
    assert report.verdict == "pass", report.decided_by
    assert report.reference["layout"] == "logical"


def test_stats_mode_ranks_without_their_share_are_one_line(stats_runs, tmp_path):
    import json
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(stats_runs / "ddp", copy)
    for d in rank_dirs(copy).values():  # as a record made before the shares were kept
        m = json.loads((d / "manifest.json").read_text())
        for e in m["entries"]:
            (e.get("meta") or {}).pop("part", None)
        (d / "manifest.json").write_text(json.dumps(m))
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "compare", str(stats_runs / "ref"), str(copy)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 2 and "holds no share of the logical sample" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_ranks_of_a_training_loop_callback_are_a_warning(runs, tmp_path):
    import json
    import shutil

    copy = tmp_path / "loop"
    shutil.copytree(runs / "ddp", copy)
    for d in rank_dirs(copy).values():  # as the Trainer callback's records say
        m = json.loads((d / "manifest.json").read_text())
        m["run"]["driver"] = "transformers.Trainer"
        (d / "manifest.json").write_text(json.dumps(m))
    report = compare_ranks(runs / "ref", copy)
    assert any("transformers.Trainer" in w and "contiguous" in w for w in report.warnings)
    assert not any("contiguous" in w for w in compare_ranks(runs / "ref", runs / "ddp").warnings)


def test_logical_shapes():
    single, two, four = ({"x": [4, 3], "w": [5]}, 1), ({"x": [2, 3], "w": [5]}, 2), ({"x": [1, 3], "w": [5]}, 4)
    assert logical_shapes(single, two) == logical_shapes(two, single) == {"x": [4, 3], "w": [5]}
    assert logical_shapes(two, four) == logical_shapes(four, two) == {"x": [4, 3], "w": [5]}
    # as many ranks on both sides: slices of the same shape, joined alike on both sides
    assert logical_shapes(two, two) == {"x": [4, 3], "w": [10]}


def test_logical_tensor_rules():
    def e(phase, layout=None, rank=0):
        return {"key": f"0/{phase}/m/0/x", "phase": phase,
                "meta": {"layout": dict(layout, coord=[rank])} if layout else {}}

    a, b = torch.arange(6.).reshape(2, 3), torch.arange(6., 12.).reshape(2, 3)
    shard = {"placements": ["S0"], "mesh": [2], "global_shape": [4, 3]}
    # shards joined in mesh order, whatever the order of the ranks' entries
    t, how = logical_tensor([e("params", shard, 1), e("params", shard, 0)], [b, a], None, "fsdp")
    assert how == "gathered" and torch.equal(t, torch.cat([a, b]))
    t, how = logical_tensor([e("forward"), e("forward")], [a, b], [4, 3], "ddp")
    assert how == "batch" and torch.equal(t, torch.cat([a, b]))
    t, how = logical_tensor([e("backward"), e("backward")], [a, b], [4, 3], "ddp")
    assert how == "batch" and torch.equal(t, torch.cat([a, b]) / 2)
    t, how = logical_tensor([e("grads"), e("grads")], [a, b], [2, 3], "ddp")
    assert how == "mean" and torch.equal(t, (a + b) / 2)
    assert logical_tensor([e("params"), e("params")], [a, b], [2, 3], "ddp")[1] == "replicated-differs"
    # a scalar the model's own code computed from each rank's part (output.loss): the ranks' mean
    t, how = logical_tensor([e("forward"), e("forward")], [torch.tensor(2.0), torch.tensor(3.0)], [], "ddp")
    assert how == "mean-scalar" and float(t) == 2.5
    # under TP every rank ran the whole batch: a differing scalar is rank 0's, with a warning
    assert logical_tensor([e("forward"), e("forward")], [torch.tensor(2.0), torch.tensor(3.0)], [], "tp")[1] \
        == "replicated-differs"
    with pytest.raises(DriftcheckError, match="neither its batch slice"):
        logical_tensor([e("forward"), e("forward")], [a, b], [5, 3], "ddp")
    with pytest.raises(DriftcheckError, match="1-D meshes"):
        logical_tensor([e("params", dict(shard, mesh=[2, 2]))] * 2, [a, b], None, "fsdp")


def test_a_ranks_dropout_mask_is_its_part_of_the_single_process_mask():
    from driftcheck.record.rng import DropoutControl

    x = torch.ones(4, 6)
    with DropoutControl(3) as one:
        one.set_step(1)
        whole = torch.nn.functional.dropout(x, 0.5, training=True)
    parts = []
    for rank in range(2):
        with DropoutControl(3, rank, 2) as ctl:
            ctl.set_step(1)
            parts.append(torch.nn.functional.dropout(x[:2], 0.5, training=True))
    assert torch.equal(torch.cat(parts), whole)


def test_a_batchnorm_in_training_across_layouts_is_a_warning_once():
    from driftcheck.compare.layouts import batch_statistics

    bn = {"key": "0/forward/bn1/0/output", "module": "bn1", "phase": "forward",
          "meta": {"kind": "batchnorm", "norm_dims": [0, 2, 3], "module_type": "BatchNorm2d"}}
    said = batch_statistics(bn, "batch", [])
    assert len(said) == 1 and "bn1: a BatchNorm in training" in said[0]
    assert batch_statistics(bn, "batch", said) == []  # once a module
    assert batch_statistics(dict(bn, meta=dict(bn["meta"], module_type="SyncBatchNorm")), "batch", []) == []
    assert batch_statistics(dict(bn, meta=dict(bn["meta"], norm_dims=None)), "batch", []) == []  # eval

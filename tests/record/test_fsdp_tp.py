"""FSDP2 and tensor parallelism together (issue 46): ``driftcheck record --parallel fsdp-tp``
under torchrun (gloo, CPU, 4 ranks: a (dp 2, tp 2) mesh) applies the model's plan within each
pair of ranks and FSDP2 across the pairs; each pair takes its half of the batch. Parameters,
gradients and optimizer state are DTensors on both mesh dims (strided shards), recorded with
their block's offset; compare rebuilds one logical trace from the blocks (compare/blocks.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LLAMA_FAULT_SCENARIO, dc, record_cli

from driftcheck.compare import blocks
from driftcheck.compare.ranks import compare_ranks
from driftcheck.errors import DriftcheckError
from driftcheck.numerics import stats as tstats
from driftcheck.store import TraceReader
from driftcheck.store.layout import rank_dirs

SCENARIO = LLAMA_FAULT_SCENARIO


def _record(tmp: Path, *args: str, ranks: int = 0, fault: bool = False) -> None:
    record_cli(tmp, str(tmp / "sc.py:build"), *args, ranks=ranks, env={"DC_FAULT": "1" if fault else ""})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_tp")
    (tmp / "sc.py").write_text(SCENARIO)
    for mode in ("full", "stats"):
        ref = tmp / f"ref-{mode}"
        _record(tmp, "--out", str(ref), "--mode", mode)  # single process, fp32
        for name, extra, fault in (("bf16", ("--dtype", "bf16"), False), ("fault", (), True)):
            _record(tmp, "--out", str(tmp / f"{name}-{mode}"), "--replay", str(ref), "--mode", mode,
                    "--parallel", "fsdp-tp", *extra, ranks=4, fault=fault)
    return tmp


def _entries(run: Path, rank: int) -> dict[str, dict]:
    return {e["key"]: e for e in TraceReader(rank_dirs(run)[rank]).entries}


def test_each_rank_records_its_blocks(runs):
    e = _entries(runs / "bf16-full", 1)  # dp group 0, tp coordinate 1

    def layout(key):
        return (e[key].get("meta") or {}).get("layout")

    assert TraceReader(rank_dirs(runs / "bf16-full")[1]).run["tensor_parallel"]["mesh"] == {"dp": 2, "tp": 2}
    assert e["0/forward/./0/input.idx"]["shape"] == [1, 16]  # its pair's half of the batch
    # a colwise weight: TP's rows [32, 64), of which FSDP2 keeps a strided half: rows 32-47
    q = layout("0/params/layers.0.attn.q_proj/0/param.weight")
    assert q == {"placements": ["S0", "S0"], "mesh": [2, 2], "coord": [0, 1], "global_shape": [64, 64],
                 "offset": [32, 0]} and e["0/params/layers.0.attn.q_proj/0/param.weight"]["shape"] == [16, 64]
    assert layout("0/grads/layers.0.mlp.down_proj/0/param.weight")["offset"] == [0, 96]
    # a colwise output: its pair's batch part and this rank's part of the last dim
    assert layout("0/forward/layers.0.mlp.up_proj/0/output") == {
        "placements": ["S0", "S2"], "mesh": [2, 2], "coord": [0, 1], "global_shape": [2, 16, 192],
        "offset": [0, 0, 96], "batch": True}
    # a DTensor input on the tensor-parallel mesh (replicated there): its pair's batch part
    assert layout("0/forward/layers.0.mlp.up_proj/0/input.0")["placements"] == ["S0", "R"]
    # a rowwise Linear's input gradient, a partial sum within the pair: its block to sum
    g = layout("0/backward/layers.0.mlp.gate_proj/0/grad_input.0")
    assert g["placements"] == ["S0", "P"] and g["offset"] == [0, 0, 0] and g["global_shape"] == [2, 16, 64]


def test_a_4_rank_fsdp_tp_bf16_target_against_a_single_fp32_reference_passes(runs):
    report = compare_ranks(runs / "ref-full", runs / "bf16-full")
    assert report.verdict == "pass", report.decided_by
    assert report.target["world_size"] == 4 and report.target["layout"] == "logical"
    assert len(report.entries) == len(TraceReader(runs / "ref-full").entries)
    assert not any("differ" in w for w in report.warnings), report.warnings
    # the other way round: the multi-rank run as the reference
    back = compare_ranks(runs / "bf16-full", runs / "ref-full")
    assert back.verdict == "pass", back.decided_by


def test_a_5_percent_fault_in_one_module_is_named(runs):
    for mode in ("full", "stats"):
        report = compare_ranks(runs / f"ref-{mode}", runs / f"fault-{mode}")
        fd = report.first_divergence
        assert report.verdict == "fail" and (fd["module"], fd["phase"], fd["step"]) == \
            ("layers.1.mlp.up_proj", "forward", 0), (mode, fd)
    proc = dc("compare", str(runs / "ref-full"), str(runs / "fault-full"))
    assert proc.returncode == 1, proc.stderr
    assert "FAIL layers.1.mlp.up_proj's forward output" in proc.stdout


def test_stats_mode_rebuilds_the_blocks_statistics_and_sample(runs):
    report = compare_ranks(runs / "ref-stats", runs / "bf16-stats")
    assert report.verdict == "pass", report.decided_by
    assert len(report.entries) == len(TraceReader(runs / "ref-stats").entries)
    # an activation function between a colwise and a rowwise Linear has no layout: each rank
    # keeps two shares, its pair's batch part and that with its part of the last dim
    act = _entries(runs / "bf16-stats", 3)["0/forward/layers.0.mlp.down_proj/0/input.0"]
    assert act["meta"]["part"]["global_shape"] == [2, 16, 192]  # a DTensor-less local shard: the style's
    parts = _entries(runs / "bf16-stats", 3)["0/forward/layers.0.mlp/0/output"]["meta"]
    assert parts["part"]["offset"] == [1, 0, 0] and parts["part_tp"]["offset"] == [1, 0, 64]


def test_a_4_rank_fsdp_tp_reference_against_a_single_target_that_replays_it(runs, tmp_path):
    """A reference recorded under fsdp-tp (its replay: each pair's half of the batch) and a single
    process replaying it: the global batch is the pairs' halves joined; the two pass."""
    (tmp_path / "sc.py").write_text(SCENARIO)
    _record(tmp_path, "--out", str(tmp_path / "ref"), "--parallel", "fsdp-tp", ranks=4)
    _record(tmp_path, "--out", str(tmp_path / "one"), "--replay", str(tmp_path / "ref"), "--dtype", "bf16")
    ref, one = TraceReader(runs / "ref-full"), TraceReader(tmp_path / "one")
    key = "0/forward/./0/input.idx"
    [a] = [x for x in one.entries if x["key"] == key]
    [b] = [x for x in ref.entries if x["key"] == key]
    assert torch.equal(one.tensor(a), ref.tensor(b))  # the scenario's global batch, as one process's
    report = compare_ranks(tmp_path / "ref", tmp_path / "one")
    assert report.verdict == "pass", report.decided_by
    assert report.reference["world_size"] == 4 and report.reference["layout"] == "logical"


def test_blocks_tile_the_logical_tensor():
    def e(phase, layout=None):
        return {"key": f"0/{phase}/m/0/x", "phase": phase, "meta": {"layout": layout} if layout else {}}

    whole = torch.arange(32.).reshape(8, 4)
    # FSDP2 over a TP-sharded dim 0 on 2x2: strided shards, offsets 0, 4, 2, 6 in rank order
    offsets = [[0, 0], [4, 0], [2, 0], [6, 0]]
    group = [e("params", {"placements": ["S0", "S0"], "mesh": [2, 2], "global_shape": [8, 4], "offset": o})
             for o in offsets]
    p = blocks.plan(group, [[2, 4]] * 4, [8, 4], (2, 2))
    t, same = blocks.place("k", p, [whole[o[0]:o[0] + 2] for o in offsets])
    assert p.how == "blocks" and same and torch.equal(t, whole)
    # partial sums at one offset add up; copies that differ are said
    summed = [e("backward", {"placements": ["S0", "P"], "mesh": [2, 2], "global_shape": [2, 3],
                             "offset": [r // 2, 0], "batch": True}) for r in range(4)]
    parts = [torch.full((1, 3), float(r)) for r in range(4)]
    t, _ = blocks.place("k", blocks.plan(summed, [[1, 3]] * 4, [2, 3], (2, 2)), parts)
    assert torch.equal(t, torch.tensor([[1.0] * 3, [5.0] * 3]) / 2)  # a batch-split gradient / 2 groups
    # a plain activation: its pair's batch part, or that and its part of the last dim
    plain = [e("forward")] * 4
    assert blocks.plan(plain, [[1, 3]] * 4, [2, 3], (2, 2)).offsets == [[0, 0], [0, 0], [1, 0], [1, 0]]
    assert blocks.plan(plain, [[1, 3]] * 4, [2, 6], (2, 2)).offsets == [[0, 0], [0, 3], [1, 0], [1, 3]]
    assert blocks.plan(plain, [[1, 3]] * 4, [1, 3], (2, 2)).how == "replicated"
    with pytest.raises(DriftcheckError, match="neither their part of the batch"):
        blocks.plan(plain, [[1, 3]] * 4, [3, 5], (2, 2))
    with pytest.raises(DriftcheckError, match="cover 24 of the logical tensor's 32"):
        blocks.place("k", p._replace(offsets=[[0, 0], [0, 0], [2, 0], [6, 0]]),
                     [whole[:2], whole[:2], whole[2:4], whole[6:]])
    replicas = blocks.Plan("blocks", [2, 4], [[0, 0], [0, 0]])
    assert blocks.place("k", replicas, [whole[:2], whole[:2]])[1]
    assert not blocks.place("k", replicas, [whole[:2], whole[:2] + 1])[1]  # copies that differ
    assert blocks.logical_shape([1, 16, 96], (2, 2), [2, 16, 192], (1, 1)) == [2, 16, 192]
    assert blocks.logical_shape([1, 16, 64], (2, 2), [1, 16, 64], (2, 1)) == [2, 16, 64]  # vs 2 DDP ranks


def test_a_block_s_share_holds_the_logical_sample_at_its_positions():
    logical, key = [6, 10, 20], "0/forward/m/0/output"
    t = torch.randn(logical)
    sample = tstats.sample_of(t, key, 0)
    got = torch.full_like(sample, float("nan"))
    for off in ([0, 0, 0], [0, 0, 10], [3, 0, 0], [3, 0, 10]):
        block = t[off[0]:off[0] + 3, :, off[2]:off[2] + 10]
        j, idx = tstats.part_positions(key, 0, logical, off, [3, 10, 10])
        got[torch.from_numpy(j)] = block.reshape(-1)[torch.from_numpy(idx)]
    assert torch.equal(got, sample)


def test_a_tp_size_that_does_not_divide_the_ranks_is_one_line_exit_2(runs):
    """Checked before the process group is joined (as torchrun's environment says the world)."""
    cases = ((("--parallel", "fsdp-tp", "--tp-size", "3"), {"WORLD_SIZE": "4", "RANK": "0"},
              "--tp-size 3 does not make a (data-parallel, tensor-parallel) mesh of the 4 ranks"),
             (("--tp-size", "2"), {}, "--tp-size sets the tensor-parallel groups of --parallel fsdp-tp"))
    for extra, env, words in cases:
        proc = subprocess.run([sys.executable, "-m", "driftcheck", "record", str(runs / "sc.py:build"),
                               "--out", str(runs / "bad"), *extra], capture_output=True, text=True,
                              timeout=120, cwd=runs, env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **env))
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_where_shapes_cannot_tell_a_copy_from_a_part_the_ranks_values_do(runs):
    """Both sides split along a tensor-parallel dim (fsdp-tp against TP): an activation outside
    the plan of [1, 16, 96] on a 2x2 rank and [2, 16, 96] on a TP rank is either each group's
    copy or each rank's half of [2, 16, 192]; whether the first two ranks hold equal values says
    which, the same whichever side is the reference."""
    for copies, want in ((False, [2, 16, 192]), (True, [2, 16, 96]), (None, [2, 16, 96])):
        assert blocks.logical_shape([1, 16, 96], (2, 2), [2, 16, 96], (1, 2), lambda c=copies: c) == want
        assert blocks.logical_shape([2, 16, 96], (1, 2), [1, 16, 96], (2, 2), lambda c=copies: c) == want
    probe = blocks.Copies(rank_dirs(runs / "bf16-full"))
    assert probe("0/forward/layers.0.mlp/0/output") is True  # all-reduced: a copy on both ranks
    assert probe("0/forward/layers.0.mlp.up_proj/0/output") is False  # each rank's half
    stats = blocks.Copies(rank_dirs(runs / "bf16-stats"))  # stats mode: statistics and samples
    assert stats("0/forward/layers.0.mlp/0/output") is True
    assert stats("0/forward/layers.0.mlp.up_proj/0/output") is False


def test_partial_sums_with_copies_and_unlifted_activations_are_refused():
    def e(layout, phase="backward"):
        return {"key": "0/backward/m/0/x", "phase": phase, "meta": {"layout": layout}}

    for placements in (["P", "P"], ["R", "P"]):
        with pytest.raises(DriftcheckError, match="partial or replicated along another mesh dim"):
            blocks.plan([e({"placements": placements, "mesh": [2, 2], "global_shape": [2, 3],
                            "offset": [0, 0]})] * 4, [[2, 3]] * 4, [2, 3], (2, 2))
    with pytest.raises(DriftcheckError, match="not a block of the 2-D mesh"):
        blocks.plan([e({"placements": ["S0"], "mesh": [2], "global_shape": [4, 3], "offset": [0, 0]})] * 4,
                    [[2, 3]] * 4, [4, 3], (2, 2))


def test_stats_mode_says_when_copies_of_a_block_differ():
    shape, key = [4, 300], "0/forward/m/0/output"
    t = torch.randn(shape)
    group = []
    for r in range(4):  # two groups of two copies of one block (batch only)
        g = r // 2
        block = t[2 * g:2 * g + 2] + (1.0 if r == 3 else 0.0)  # rank 3's copy differs
        _, idx = tstats.part_positions(key, 0, shape, [2 * g, 0], [2, 300])
        group.append({"key": key, "step": 0, "phase": "forward", "module": "m", "call": 0, "slot": "output",
                      "shape": [2, 300], "stats": tstats.to_dict(tstats.stats_vector(block).tolist()),
                      "meta": {"part": {"global_shape": shape, "offset": [2 * g, 0],
                                        "values": block.reshape(-1)[torch.from_numpy(idx)].tolist()}}})
    plan = blocks.plan(group, [[2, 300]] * 4, shape, (2, 2))
    got, sample, estimated, same = blocks.stats(plan, group, 0, torch.float32)
    assert not same and not estimated
    group[3] = group[2]
    got, sample, _, same = blocks.stats(plan, group, 0, torch.float32)
    assert same and torch.allclose(sample, tstats.sample_of(t, key, 0))
    assert got["numel"] == t.numel() and abs(got["max"] - float(t.max())) < 1e-6


def test_two_fsdp_tp_runs_of_other_meshes_are_rebuilt_not_compared_rank_by_rank(runs, tmp_path):
    from driftcheck.compare.ranks import different_layouts

    other = tmp_path / "1x4"
    shutil.copytree(runs / "bf16-full", other)
    assert not different_layouts(runs / "bf16-full", other)
    for d in rank_dirs(other).values():
        m = json.loads((d / "manifest.json").read_text())
        m["run"]["tensor_parallel"]["mesh"] = {"dp": 1, "tp": 4}
        (d / "manifest.json").write_text(json.dumps(m))
    assert different_layouts(runs / "bf16-full", other)

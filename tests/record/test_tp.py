"""Tensor parallelism (issue 46): ``driftcheck record --parallel tp`` under torchrun (gloo, CPU,
2 ranks) applies the model's plan (models/llama.py TP_PLAN: q/k/v, gate/up colwise; o, down
rowwise); every rank sees the whole batch; the shards are recorded with their layout and
compare rebuilds one logical trace (driftcheck/compare/layouts.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import LLAMA_FAULT_SCENARIO, record_cli

from driftcheck.compare.layouts import logical_tensor
from driftcheck.compare.ranks import compare_ranks
from driftcheck.errors import DriftcheckError
from driftcheck.store import TraceReader
from driftcheck.store.layout import rank_dirs

SCENARIO = LLAMA_FAULT_SCENARIO + textwrap.dedent('''
    def no_plan():
        return Scenario(model=nn.Linear(4, 4), inputs=[__import__("torch").ones(2, 4)],
                        loss=lambda out, x: out.sum(), steps=1)
''')


def _record(tmp: Path, *args: str, ranks: int = 0, fault: bool = False) -> None:
    record_cli(tmp, str(tmp / "sc.py:build"), *args, ranks=ranks, env={"DC_FAULT": "1" if fault else ""})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "sc.py").write_text(SCENARIO)
    _record(tmp, "--out", str(tmp / "ref"))  # single process, fp32
    for name, extra, fault in (("tp-bf16", ("--dtype", "bf16"), False), ("tp-fault", (), True)):
        _record(tmp, "--out", str(tmp / name), "--replay", str(tmp / "ref"), "--parallel", "tp",
                *extra, ranks=2, fault=fault)
    return tmp


def _entries(run: Path, rank: int) -> dict[str, dict]:
    return {e["key"]: e for e in TraceReader(rank_dirs(run)[rank]).entries}


def test_each_rank_records_its_shards_with_their_layout(runs):
    e = _entries(runs / "tp-bf16", 1)

    def layout(key):
        return (e[key].get("meta") or {}).get("layout")

    # the whole batch on every rank (not DDP's half)
    assert e["0/forward/./0/input.idx"]["shape"] == [2, 16] and layout("0/forward/./0/input.idx") is None
    # parameters, their gradients and optimizer state: DTensor shards
    assert layout("0/params/layers.0.attn.q_proj/0/param.weight") == {
        "placements": ["S0"], "mesh": [2], "coord": [1], "global_shape": [64, 64], "offset": [32, 0]}
    assert layout("0/grads/layers.0.attn.o_proj/0/param.weight")["placements"] == ["S1"]
    assert layout("0/optimizer/layers.0.mlp.down_proj/0/state.weight.exp_avg")["placements"] == ["S1"]
    # a colwise output and its gradient, a rowwise input and its gradient: local shards of the
    # last dim, their layout from the plan's style
    for key, shape, whole in (("0/forward/layers.0.attn.k_proj/0/output", [2, 16, 16], [2, 16, 32]),
                              ("0/backward/layers.0.attn.k_proj/0/grad_output", [2, 16, 16], [2, 16, 32]),
                              ("0/forward/layers.0.mlp.down_proj/0/input.0", [2, 16, 96], [2, 16, 192]),
                              ("0/backward/layers.0.mlp.down_proj/0/grad_input.0", [2, 16, 96], [2, 16, 192])):
        got = dict(layout(key))
        assert got.pop("offset", [0, 0, shape[-1]]) == [0, 0, shape[-1]], key  # a DTensor's: its block's
        assert e[key]["shape"] == shape and got == {
            "placements": ["S2"], "mesh": [2], "coord": [1], "global_shape": whole}, key
    # replicated: the norms, the all-reduced outputs, the loss
    for key in ("0/params/norm/0/param.weight", "0/forward/layers.0.mlp.down_proj/0/output",
                "0/forward/layers.0.attn/0/output", "0/loss/./0/loss"):
        assert layout(key) is None, key
    assert TraceReader(rank_dirs(runs / "tp-bf16")[0]).run["parallel"] == "tp"


def test_a_2_rank_tp_bf16_target_against_a_single_fp32_reference_passes(runs):
    report = compare_ranks(runs / "ref", runs / "tp-bf16")
    assert report.verdict == "pass", report.decided_by
    assert report.target["world_size"] == 2 and report.target["layout"] == "logical"
    assert len(report.entries) == len(TraceReader(runs / "ref").entries)
    assert not any("differ" in w for w in report.warnings), report.warnings  # replicated alike


def test_a_5_percent_fault_in_one_sharded_module_is_named(runs):
    report = compare_ranks(runs / "ref", runs / "tp-fault")
    assert report.verdict == "fail"
    fd = report.first_divergence
    assert (fd["module"], fd["phase"], fd["step"]) == ("layers.1.mlp.up_proj", "forward", 0), fd
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "compare", str(runs / "ref"),
                           str(runs / "tp-fault")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 1, proc.stderr
    assert "FAIL layers.1.mlp.up_proj's forward output" in proc.stdout


def test_stats_mode_a_2_rank_tp_bf16_target_against_a_single_fp32_reference(runs, tmp_path):
    """Stats mode across layouts: each shard (parameters, the colwise Linears' outputs) keeps its
    share of the logical sample (record/parts.py); compare puts them together (compare/parts.py)."""
    (tmp_path / "sc.py").write_text(SCENARIO)
    _record(tmp_path, "--out", str(tmp_path / "ref"), "--replay", str(runs / "ref"), "--mode", "stats")
    for name, extra, fault in (("tp", ("--dtype", "bf16"), False), ("tp-fault", (), True)):
        _record(tmp_path, "--out", str(tmp_path / name), "--replay", str(runs / "ref"), "--mode", "stats",
                "--parallel", "tp", *extra, ranks=2, fault=fault)
    up = _entries(tmp_path / "tp", 1)["0/forward/layers.1.mlp.up_proj/0/output"]  # (2, 16, 96) of 192
    assert up["meta"]["part"]["global_shape"] == [2, 16, 192] and up["meta"]["part"]["start"] == 96
    report = compare_ranks(tmp_path / "ref", tmp_path / "tp")
    assert report.verdict == "pass", report.decided_by
    assert len(report.entries) == len(TraceReader(tmp_path / "ref").entries)
    assert not any("differ" in w for w in report.warnings), report.warnings
    report = compare_ranks(tmp_path / "ref", tmp_path / "tp-fault")
    fd = report.first_divergence
    assert report.verdict == "fail" and fd["module"] == "layers.1.mlp.up_proj", fd


def test_tp_replays_a_ddp_reference_with_the_whole_batch(runs, tmp_path):
    (tmp_path / "sc.py").write_text(SCENARIO)
    _record(tmp_path, "--out", str(tmp_path / "ddp"), "--parallel", "ddp", ranks=2)
    _record(tmp_path, "--out", str(tmp_path / "tp"), "--replay", str(tmp_path / "ddp"),
            "--parallel", "tp", ranks=2)
    # DDP's ranks took one sequence each; each TP rank the two of them, in rank order
    ddp = [_entries(tmp_path / "ddp", r)["0/forward/./0/input.idx"] for r in (0, 1)]
    tp = _entries(tmp_path / "tp", 1)["0/forward/./0/input.idx"]
    assert [d["shape"] for d in ddp] == [[1, 16], [1, 16]] and tp["shape"] == [2, 16]
    joined = torch.cat([TraceReader(rank_dirs(tmp_path / "ddp")[r]).tensor(d) for r, d in enumerate(ddp)])
    assert torch.equal(TraceReader(rank_dirs(tmp_path / "tp")[1]).tensor(tp), joined)
    # both sides rebuilt: DDP's slices joined, TP's shards joined, TP's loss not averaged
    report = compare_ranks(tmp_path / "ddp", tmp_path / "tp")
    assert report.verdict == "pass", report.decided_by
    assert max(e.metrics["rel_l2"] for e in report.entries) < 1e-5


def test_tp_on_a_model_without_a_plan_is_one_line_exit_2(runs):
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "record", str(runs / "sc.py:no_plan"),
                           "--out", str(runs / "none"), "--parallel", "tp"], capture_output=True,
                          text=True, timeout=120, cwd=runs,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 2, proc.stderr
    assert "has no tensor-parallel plan" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_tp_side_is_rebuilt_without_batch_joining():
    def e(phase, layout=None, rank=0):
        return {"key": f"0/{phase}/m/0/x", "phase": phase,
                "meta": {"layout": dict(layout, coord=[rank])} if layout else {}}

    a, b = torch.arange(6.).reshape(2, 3), torch.arange(6., 12.).reshape(2, 3)
    shard = {"placements": ["S1"], "mesh": [2], "global_shape": [2, 6]}
    t, how = logical_tensor([e("forward", shard, 1), e("forward", shard, 0)], [b, a], [2, 6], "tp")
    assert how == "gathered" and torch.equal(t, torch.cat([a, b], dim=1))
    partial = {"placements": ["P"], "mesh": [2], "global_shape": [2, 3]}
    t, how = logical_tensor([e("backward", partial, 0), e("backward", partial, 1)], [a, b], [2, 3], "tp")
    assert how == "summed" and torch.equal(t, a + b)
    # the whole batch on every rank: replicated, never joined along dim 0 nor averaged (as a
    # data-parallel side's would be)
    for phase in ("forward", "backward", "loss", "grads"):
        t, how = logical_tensor([e(phase), e(phase)], [a, a.clone()], [2, 3], "tp")
        assert how == "replicated" and torch.equal(t, a), phase
    assert logical_tensor([e("forward"), e("forward")], [a, b], [4, 3], "ddp")[1] == "batch"
    assert logical_tensor([e("loss"), e("loss")], [a, b], None, "tp")[1] == "replicated-differs"


def test_a_plan_is_resolved_against_the_module_paths():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from driftcheck.models import llama
    from driftcheck.record.tensor_parallel import plan_of, resolve, sharded_sides

    model = llama.build().model
    styles, tied = resolve(model, llama.TP_PLAN, 2)
    assert tied == {}
    assert len(styles) == 14 and isinstance(styles["layers.1.attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["layers.0.mlp.down_proj"], RowwiseParallel)
    assert sharded_sides(styles["layers.0.attn.q_proj"]) == ("output",)
    assert sharded_sides(styles["layers.0.attn.o_proj"]) == ("input",)
    rep = "layers.0.attn.q_proj"
    assert sharded_sides(resolve(model, {rep: "colwise_rep"}, 2)[0][rep]) == ()
    # the tied lm_head is left replicated (sharding it would cut the tie)
    styles, tied = resolve(model, {"lm_head": "colwise_rep", rep: "colwise"}, 2)
    assert list(styles) == [rep] and tied == {"lm_head": "tok_emb.weight"}
    with pytest.raises(DriftcheckError, match="matches no module"):
        resolve(model, {"layers.*.attn.qkv": "colwise"}, 2)
    with pytest.raises(DriftcheckError, match="is not one of colwise, rowwise"):
        resolve(model, {"lm_head": "rowwise_rep"}, 2)
    with pytest.raises(DriftcheckError, match="not a multiple of the 3 ranks"):
        resolve(model, llama.TP_PLAN, 3)
    with pytest.raises(DriftcheckError, match=r"shard nn\.Linear"):
        resolve(model, {"norm": "colwise"}, 2)
    with pytest.raises(DriftcheckError, match="has no tensor-parallel plan"):
        plan_of(torch.nn.Linear(2, 2), None, "x.py:build")


def test_a_hugging_face_model_runs_its_own_plan(tmp_path):
    # LlamaForCausalLM's tp_plan (its config's base_model_tp_plan, the head's, the embedding's
    # embedding_rowwise) applied with torch's styles; its act_fn and attention weights lie
    # outside the plan: parts along one dim, joined by compare
    pytest.importorskip("transformers")
    (tmp_path / "sc.py").write_text("from driftcheck.hf import build as hf\n\n"
                                    "def build():\n    return hf('llama')\n")
    _record(tmp_path, "--out", str(tmp_path / "ref"))
    _record(tmp_path, "--out", str(tmp_path / "tp"), "--replay", str(tmp_path / "ref"),
            "--parallel", "tp", "--dtype", "bf16", ranks=2)
    e = _entries(tmp_path / "tp", 0)
    emb = e["0/params/model.embed_tokens/0/param.weight"]
    assert emb["meta"]["layout"]["placements"] == ["S0"]  # split along the vocabulary
    act = e["0/forward/model.layers.0.mlp.act_fn/0/output"]
    assert act["shape"][-1] * 2 == e["0/forward/model.layers.0.mlp.down_proj/0/input.0"]["meta"][
        "layout"]["global_shape"][-1] and "layout" not in (act.get("meta") or {})
    report = compare_ranks(tmp_path / "ref", tmp_path / "tp")
    assert report.verdict == "pass", report.decided_by
    assert len(report.entries) == len(TraceReader(tmp_path / "ref").entries)


def test_logical_shapes_with_a_tensor_parallel_side():
    from driftcheck.compare.layouts import logical_shapes

    single = ({"act": [2, 16, 64], "w": [8, 4], "x": [2, 16]}, 1)
    tp2 = ({"act": [2, 16, 32], "w": [8, 4], "x": [2, 16]}, 2, True)
    tp4 = ({"act": [2, 16, 16], "w": [8, 4], "x": [2, 16]}, 4, True)
    ddp2 = ({"act": [1, 16, 64], "w": [8, 4], "x": [1, 16]}, 2)
    want = {"act": [2, 16, 64], "w": [8, 4], "x": [2, 16]}
    for a, b in ((single, tp2), (tp2, single), (ddp2, tp2), (tp2, ddp2), (tp2, tp4), (tp4, tp2)):
        assert logical_shapes(a, b) == want, (a, b)
    t = logical_tensor([{"key": "k", "phase": "forward", "meta": {}}] * 2,
                       [torch.zeros(2, 3), torch.ones(2, 3)], [2, 6], "tp")
    assert t[1] == "gathered" and torch.equal(t[0], torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], 1))
    with pytest.raises(DriftcheckError, match="neither the whole tensor nor its part"):
        logical_tensor([{"key": "k", "phase": "forward", "meta": {}}] * 2,
                       [torch.zeros(2, 3), torch.ones(2, 3)], [4, 6], "tp")


def test_the_mlp_with_dropout_under_tp_draws_the_single_process_masks(tmp_path):
    # mlp's plan gathers each colwise output (colwise_rep): its Dropouts act on replicated
    # tensors, and every TP rank draws the whole batch's mask, as one process does
    (tmp_path / "sc.py").write_text("from driftcheck.models import mlp\n\n"
                                    "def build():\n    return mlp.build()\n")
    _record(tmp_path, "--out", str(tmp_path / "ref"))
    _record(tmp_path, "--out", str(tmp_path / "tp"), "--replay", str(tmp_path / "ref"),
            "--parallel", "tp", ranks=2)
    e = _entries(tmp_path / "tp", 1)
    assert e["0/params/fc1/0/param.weight"]["meta"]["layout"]["placements"] == ["S0"]
    assert e["0/forward/drop1/0/output"]["shape"] == [8, 64]  # whole, replicated
    assert TraceReader(rank_dirs(tmp_path / "tp")[1]).run["tensor_parallel"]["plan"]["fc1"] \
        == "ColwiseParallel"
    report = compare_ranks(tmp_path / "ref", tmp_path / "tp")
    assert report.verdict == "pass", report.decided_by
    assert max(e.metrics["rel_l2"] for e in report.entries) < 1e-5

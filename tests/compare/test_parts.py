"""The logical stats-mode entry of a multi-rank run from its ranks' statistics and samples
(compare/parts.py), against the same entry of the whole tensor: what a single process records."""
from __future__ import annotations

import pytest
import torch

from driftcheck.compare.layouts import how_of, logical_tensor, logical_trace
from driftcheck.compare.parts import combined, logical, of_tensor, whole as all_whole
from driftcheck.errors import DriftcheckError
from driftcheck.numerics import stats as tstats
from driftcheck.record.parts import Parts, dtensor_part
from driftcheck.store.keys import key_string

SEED = 3


def _stats(t):
    return tstats.to_dict(tstats.stats_vector(t).tolist())


def _ranks(whole: torch.Tensor, phase: str, world: int, *, parallel: str, layout=None, dim=0):
    """Each rank's stats-mode entry of its part of ``whole`` (its share, as record/parts.py
    keeps it) and its sample."""
    key = key_string(0, phase, "m", 0, "output" if phase == "forward" else "grad_input.0")
    group, samples = [], []
    for r, t in enumerate(whole.chunk(world, dim=dim)):
        meta = {"layout": dict(layout, coord=[r])} if layout else {}
        e = {"key": key, "phase": phase, "module": "m", "step": 0, "call": 0, "slot": key.split("/")[-1],
             "shape": list(t.shape), "stats": _stats(t), "meta": meta}
        if phase == "backward":
            e["slot"] = "grad_input.0"
        parts = Parts((r, world) if parallel in ("ddp", "fsdp") else None,
                      (r, world) if parallel == "tp" else None, SEED)
        got = parts.shares_of(e, t, key)
        if got:
            e["meta"]["part"] = dict(got[0][1], values=got[0][2].double().tolist())
        group.append(e)
        samples.append(tstats.sample_of(t, key, SEED))
    return key, group, samples


@pytest.mark.parametrize("parallel,layout,dim", [
    ("ddp", None, 0),                                                        # a batch slice
    ("fsdp", {"placements": ["S0"], "mesh": [2], "global_shape": [64, 48]}, 0),  # FSDP2 shard
    ("tp", {"placements": ["S1"], "mesh": [2], "global_shape": [64, 48]}, 1),    # a colwise output
    ("tp", None, 1),                                                         # outside the plan
])
def test_a_joined_part_is_the_single_process_entry(parallel, layout, dim):
    whole = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    key, group, samples = _ranks(whole, "forward", 2, parallel=parallel, layout=layout, dim=dim)
    how = how_of(group, [g["shape"] for g in group], [64, 48], parallel)
    assert how == ("batch" if parallel == "ddp" else "gathered")
    assert not all_whole(group, samples)
    shape, stats, sample, estimated = logical(group, samples, how, SEED)
    assert shape == [64, 48] and not estimated
    assert torch.equal(sample, tstats.sample_of(whole, key, SEED))  # the positions one process samples
    single = _stats(whole)
    for k in ("min", "max", "absmax", "nan", "inf", "numel"):
        assert stats[k] == single[k], k
    for k in ("mean", "std", "l2"):
        assert stats[k] == pytest.approx(single[k], rel=1e-12, abs=1e-15), k


def test_integer_inputs_join_too():
    """Token ids of a batch, more than a sample's worth: their shares are kept as any tensor's."""
    whole = torch.randint(0, 32000, (8, 128), generator=torch.Generator().manual_seed(4))
    key, group, samples = _ranks(whole, "forward", 2, parallel="ddp")
    assert all("part" in e["meta"] for e in group)
    _, stats, sample, _ = logical(group, samples, how_of(group, [g["shape"] for g in group], [8, 128], "ddp"), SEED)
    assert sample.dtype == torch.int64 and torch.equal(sample, tstats.sample_of(whole, key, SEED))
    assert stats["max"] == _stats(whole)["max"] and stats["numel"] == 1024


def test_a_batch_gradient_is_divided_by_the_ranks_and_a_mean_is_estimated():
    whole = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    key, group, samples = _ranks(whole, "backward", 2, parallel="ddp")
    _, stats, sample, _ = logical(group, samples, "batch", SEED)
    assert torch.equal(sample, tstats.sample_of(whole / 2, key, SEED))
    assert stats["l2"] == pytest.approx(_stats(whole / 2)["l2"], rel=1e-12)
    # a gradient every rank holds whole (a replicated input's): the mean of the same positions
    a, b = torch.randn(64, 48), torch.randn(64, 48)
    group = [dict(group[0], shape=[64, 48], meta={}), dict(group[1], shape=[64, 48], meta={})]
    assert how_of(group, [g["shape"] for g in group], [64, 48], "ddp") == "mean"
    _, stats, sample, estimated = logical(group, [tstats.sample_of(a, key, SEED), tstats.sample_of(b, key, SEED)],
                                          "mean", SEED)
    assert estimated and stats["numel"] == 64 * 48
    assert torch.allclose(sample, tstats.sample_of((a + b) / 2, key, SEED), rtol=0, atol=1e-6)


def test_small_parts_rebuild_the_tensor_itself():
    full = torch.randn(8, 48, generator=torch.Generator().manual_seed(2))  # 384 elements: sampled whole
    key, group, samples = _ranks(full, "forward", 2, parallel="ddp")
    assert all_whole(group, samples)
    t, how = logical_tensor(group, [s.reshape(g["shape"]) for s, g in zip(samples, group)], [8, 48], "ddp")
    shape, stats, sample = of_tensor(group[0], t, SEED)
    assert how == "batch" and shape == [8, 48] and torch.equal(sample, full.reshape(-1)) and stats == _stats(full)


def test_what_cannot_be_rebuilt_is_one_line():
    whole = torch.randn(64, 48)
    _, group, samples = _ranks(whole, "forward", 2, parallel="ddp")
    for e in group:
        e["meta"].pop("part")
    with pytest.raises(DriftcheckError, match="holds no share of the logical sample"):
        logical(group, samples, "batch", SEED)
    mesh2 = {"placements": ["S0", "S1"], "mesh": [2, 2], "global_shape": [64, 48]}
    _, group, _ = _ranks(whole, "forward", 2, parallel="fsdp", layout=mesh2)
    with pytest.raises(DriftcheckError, match="only 1-D meshes"):  # as full mode says it
        how_of(group, [g["shape"] for g in group], [64, 48], "fsdp")
    _, group, samples = _ranks(whole, "forward", 2, parallel="tp", dim=0)  # split along dim 0, not the last
    how = how_of(group, [g["shape"] for g in group], [64, 48], "tp")  # a part along dim 0, by shape
    with pytest.raises(DriftcheckError, match="not their part along the dim a stats-mode record keeps"):
        logical(group, samples, how, SEED, [64, 48])


def test_parts_of_shards_and_combined_statistics():
    assert dtensor_part({"placements": ["S0"], "mesh": [4], "coord": [3], "global_shape": [10, 2]}, [1, 2]) \
        == ([10, 2], [9, 0])  # torch's chunks: 3, 3, 3, 1
    assert dtensor_part({"placements": ["R"], "mesh": [2], "coord": [0], "global_shape": [4]}, [4]) is None
    assert dtensor_part({"placements": ["S0", "S1"], "mesh": [2, 2], "coord": [0, 1], "global_shape": [4, 4]},
                        [2, 2]) is None  # a 2-D mesh without its block's offset: no part
    assert dtensor_part({"placements": ["S0", "S1"], "mesh": [2, 2], "coord": [0, 1], "global_shape": [4, 4],
                         "offset": [0, 2]}, [2, 2]) == ([4, 4], [0, 2])
    a = torch.tensor([1.0, float("nan"), 3.0])
    b = torch.tensor([-2.0, float("inf")])
    got, single = combined([_stats(a), _stats(b)]), _stats(torch.cat([a, b]))
    assert {k: got[k] for k in ("min", "max", "nan", "inf", "numel")} == \
        {k: single[k] for k in ("min", "max", "nan", "inf", "numel")}
    assert got["mean"] == pytest.approx(single["mean"]) and got["std"] == pytest.approx(single["std"])


class _Pending:
    def __init__(self, entry):
        self.entry = entry


def _rank_traces(root, whole_tensor, world, *, parallel, dim, nonfinite=False):
    """Rank traces (stats mode, as torchrun writes them) of one forward entry of ``whole_tensor``
    split along ``dim``, through the writer and the manifest (JSON) as a record's are."""
    from driftcheck.record.transfer import apply_meta
    from driftcheck.store.writer import TraceWriter

    key, group, samples = _ranks(whole_tensor, "forward", world, parallel=parallel, dim=dim)
    dirs = {}
    for r, (e, smp) in enumerate(zip(group, samples)):
        if "part" in e["meta"]:  # the values as the capture writes them into the manifest
            vals = e["meta"]["part"].pop("values")
            apply_meta([_Pending(e)], [(0, "part_sample", torch.tensor(vals))], vals)
        dirs[r] = root / f"rank-{r}"
        with TraceWriter(dirs[r]) as w:
            w.add(dict(e, dtype="float32", order=0), None, sample=smp)
            w.close({"mode": "stats", "seed": SEED, "rank": r, "world_size": world, "parallel": parallel})
    return key, dirs


def test_nonfinite_shares_survive_the_manifest(tmp_path):
    from driftcheck.store.reader import TraceReader

    full = torch.randn(64, 48, generator=torch.Generator().manual_seed(5))
    full[10, 3], full[50, 7], full[40, 1] = float("nan"), float("inf"), float("-inf")
    key, dirs = _rank_traces(tmp_path, full, 2, parallel="ddp", dim=0)
    logical_trace(dirs, tmp_path / "logical", {key: [64, 48]})
    r = TraceReader(tmp_path / "logical")
    e = r.entries[0]
    got, want = r.tensor(e, "sample"), tstats.sample_of(full, key, SEED)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert (e["stats"]["nan"], e["stats"]["inf"], e["stats"]["numel"]) == (1, 2, 3072)


def test_a_small_tensor_parallel_activation_is_rebuilt_whole(tmp_path):
    """A TP activation outside the plan whose logical tensor is small: no share is kept (its
    parts are whole in their samples), and it is rebuilt as full mode does, not refused."""
    from driftcheck.store.reader import TraceReader

    full = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    key, dirs = _rank_traces(tmp_path, full, 2, parallel="tp", dim=1)
    logical_trace(dirs, tmp_path / "logical", {key: [4, 64]})
    e = TraceReader(tmp_path / "logical").entries[0]
    assert e["shape"] == [4, 64] and e["stats"] == _stats(full)


def test_a_shard_ignores_the_batch_shape_two_multi_rank_sides_expect():
    """DDP against FSDP2 at the same world size: logical_shapes takes every key of equal shapes
    for a batch slice (its dim 0 times the ranks); a DTensor's own layout says where it lies, so
    a shard of global [64, 48] is rebuilt as that, not refused against [128, 48]."""
    whole = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    layout = {"placements": ["S0"], "mesh": [2], "global_shape": [64, 48]}
    key, group, samples = _ranks(whole, "params", 2, parallel="fsdp", layout=layout)
    expect = [128, 48]
    how = how_of(group, [g["shape"] for g in group], expect, "fsdp")
    shape, _, sample, _ = logical(group, samples, how, SEED, expect)
    assert how == "gathered" and shape == [64, 48]

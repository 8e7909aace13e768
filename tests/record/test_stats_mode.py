"""Stats and auto modes end to end: what is stored, samples at the same seeded indices on both
runs, compare's estimates from them, fp8 under/overflow counts, and no effect on the numbers."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from driftcheck.compare import compare
from driftcheck.loader import load_scenario
from driftcheck.numerics import stats
from driftcheck.record.host_summaries import Held, HostSummaries
from driftcheck.record.rng import DropoutControl
from driftcheck.record.runner import record, train
from driftcheck.record.tracer import Tracer
from driftcheck.store import TraceReader, TraceWriter, format as fmt


def _rec(out, mode, **kw):
    return record(load_scenario("llama"), out, mode=mode, force=True, model_id="llama", **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    ref = _rec(root / "full", "full")
    return {
        "full": ref,
        "stats": _rec(root / "stats", "stats", replay=ref),
        "stats_bf16": _rec(root / "stats_bf16", "stats", replay=ref, dtype="bf16"),
        "full_bf16": _rec(root / "full_bf16", "full", replay=ref, dtype="bf16"),
        "auto": _rec(root / "auto", "auto", replay=ref, full_modules=["layers.0.*"]),
        "auto_bf16": _rec(root / "auto_bf16", "auto", replay=ref, dtype="bf16",
                          full_modules=["layers.0.*"]),
        "stats_fault": _rec(root / "stats_fault", "stats", replay=ref,
                            target_hooks=_scale_output("layers.1.mlp.up_proj", 1.02)),
    }


def _scale_output(name, factor):
    def hook(model):
        dict(model.named_modules())[name].register_forward_hook(lambda m, a, out: out * factor)
    return hook


def test_stats_mode_stores_samples_not_tensors(llama):
    r = TraceReader(llama["stats"])
    for e in r.entries:
        if e["phase"] == "loss":
            continue  # the loss is one number: kept in full
        assert "tensor" not in e, e["key"]
        sample = r.tensor(e, "sample")
        assert sample.numel() == min(e["stats"]["numel"], stats.SAMPLE_SIZE)
        assert set(stats.FIELDS) <= set(e["stats"])
    full = sum(p.stat().st_size for p in llama["full"].iterdir() if p.name.startswith("shard"))
    small = sum(p.stat().st_size for p in llama["stats"].iterdir() if p.name.startswith("shard"))
    assert small < full / 3


def test_samples_are_the_full_tensor_at_the_seeded_indices(llama):
    """The same positions on both runs: a stats-mode sample equals the full-mode tensor of the
    same (bitwise identical) run at sample_indices(key, numel, seed)."""
    full, st = TraceReader(llama["full"]), TraceReader(llama["stats"])
    by_key = {e["key"]: e for e in full.entries}
    checked = 0
    for e in st.entries:
        if "sample" not in e or e["stats"]["numel"] <= stats.SAMPLE_SIZE:
            continue
        key = fmt.sample_key(e["step"], e["phase"], e["module"], e["call"], e["slot"])
        idx = torch.from_numpy(stats.sample_indices(key, e["stats"]["numel"], 0))
        whole = full.tensor(by_key[e["key"]]).reshape(-1)
        assert torch.equal(st.tensor(e, "sample"), whole[idx]), e["key"]
        checked += 1
    assert checked > 100


def test_sample_indices_spread_over_the_tensor_and_differ_per_key():
    a = stats.sample_indices("0/forward/x/0/output", 10_000_000, 0)
    b = stats.sample_indices("1/forward/x/0/output", 10_000_000, 0)
    assert len(a) == stats.SAMPLE_SIZE and a.min() >= 0 and a.max() < 10_000_000
    assert not (a == b).all()
    # Every tenth of the tensor gets about a tenth of the sample.
    counts = [((a >= i * 1_000_000) & (a < (i + 1) * 1_000_000)).sum() for i in range(10)]
    assert min(counts) > 25
    assert (stats.sample_indices("k", 100, 0) == list(range(100))).all()


def test_compare_estimates_elementwise_error_and_ulps_from_samples(llama):
    est = compare(llama["full"], llama["stats_bf16"])
    exact = compare(llama["full"], llama["full_bf16"])
    est2 = compare(llama["stats"], llama["stats_bf16"])
    assert est.verdict == exact.verdict == est2.verdict == "pass"
    by_key = {e.key: e for e in exact.entries}
    ratios = []
    for e in est2.entries:
        if e.details["measured_on"] != "sample" or e.metrics.get("count", 0) < stats.SAMPLE_SIZE:
            continue
        x = by_key[e.key]
        assert e.metrics["estimated_from"] == "sample"
        assert 0 <= e.metrics["max_ulp"] <= x.metrics["max_ulp"]  # a subset's max
        if x.metrics["rms"] > 0:
            ratios.append(e.metrics["rms"] / x.metrics["rms"])
    assert len(ratios) > 100
    ratios.sort()
    median = ratios[len(ratios) // 2]
    assert 0.8 < median < 1.25, median  # 512 samples estimate the rms error to ~5%


def test_stats_mode_catches_an_injected_fault_at_its_module(llama):
    report = compare(llama["full"], llama["stats_fault"])
    assert report.verdict == "fail"
    fd = report.first_divergence
    assert fd["module"] == "layers.1.mlp.up_proj" and fd["phase"] == "forward", fd


def test_auto_mode_keeps_selected_modules_in_full(llama):
    r = TraceReader(llama["auto"])
    for e in r.entries:
        full = e["module"].startswith("layers.0.") or e["phase"] == "loss"
        assert ("tensor" in e) == full and ("sample" in e) == (not full), e["key"]
    report = compare(llama["auto"], llama["auto_bf16"])
    how = {e.key: e.details["measured_on"] for e in report.entries}
    assert {how[k] for k in how if "/layers.0." in k} == {"full"}
    assert {how[k] for k in how if "/layers.1." in k} == {"sample"}
    assert report.verdict == "pass"


def test_without_samples_compare_falls_back_to_the_statistics(llama):
    ref, tgt = TraceReader(llama["stats"]), TraceReader(llama["stats_fault"])
    for reader in (ref, tgt):
        for e in reader.entries:
            e.pop("sample", None)
    report = compare(ref, tgt)
    assert {e.details["measured_on"] for e in report.entries} <= {"stats", "full"}
    assert report.verdict == "fail"


# -- fp8 ----------------------------------------------------------------------------------------
FP8_CASES = [  # values (cast to fp8), expected underflow (nonzero subnormal), overflow (at max)
    (torch.float8_e4m3fn, [0.0, 1.0, -2.0], 0, 0),
    (torch.float8_e4m3fn, [2.0**-7, -2.0**-9, 2.0**-6, 1.0], 2, 0),
    (torch.float8_e4m3fn, [448.0, -448.0, 416.0, 1.0], 0, 2),  # 416: the next value down
    (torch.float8_e5m2, [57344.0, 2.0**-15, 2.0**-14, 0.0], 1, 1),
]


@pytest.mark.parametrize("dtype,values,under,over", FP8_CASES)
def test_fp8_under_and_overflow_counts(dtype, values, under, over):
    t = torch.tensor(values).to(dtype)
    for row in (stats.stats_vector(t), stats.summarize([t, t], [None, "k"], 0)[0][1]):
        d = stats.to_dict(row.tolist())
        assert (d["fp8_underflow"], d["fp8_overflow"]) == (under, over)
    assert "fp8_underflow" not in stats.to_dict(stats.stats_vector(torch.ones(3)).tolist())


def test_batched_summary_matches_one_tensor_at_a_time():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 300, generator=g) * 5 + 2  # takes the large-tensor path
    odd = torch.randn(40, generator=g)
    odd[3], odd[7] = float("nan"), float("-inf")
    ts = [torch.randn(5, 7, generator=g), big, big.bfloat16(), odd, torch.zeros(0),
          torch.tensor(3.0), torch.arange(10), torch.randn(9, generator=g).to(torch.float8_e5m2),
          torch.full((4,), float("nan")), torch.randn(3, dtype=torch.complex64, generator=g)]
    rows, samples = stats.summarize(ts, [f"k{i}" for i in range(len(ts))], 0)
    for i, (t, row, s) in enumerate(zip(ts, rows, samples)):
        want = stats.stats_vector(t)
        for name, a, b in zip(stats.COLUMNS, row.tolist(), want.tolist()):
            if math.isnan(b):
                assert math.isnan(a), (t.dtype, name)
            else:
                assert a == pytest.approx(b, rel=1e-5, abs=1e-12), (t.dtype, name)  # float32 sums
        idx = torch.from_numpy(stats.sample_indices(f"k{i}", t.numel(), 0))
        flat = t.reshape(-1)[idx]
        bits = (lambda x: x.view(torch.uint8)) if t.dtype.itemsize == 1 else (lambda x: x)
        assert s.dtype == t.dtype
        assert torch.equal(bits(s), bits(flat)) or torch.allclose(s, flat, equal_nan=True, rtol=0, atol=0)


# -- no effect on the numbers -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "stats", "auto"])
@pytest.mark.parametrize("background", [True, False])
def test_traced_equals_untraced_bitwise_in_every_mode(mode, background, tmp_path):
    results, states = [], []
    for traced in (False, True):
        sc = load_scenario("llama", 0)
        model = sc.model
        opt = sc.optimizer(model.parameters())
        batches = [sc.batch(i) for i in range(sc.steps)]
        tracer = writer = None
        if traced:
            writer = TraceWriter(tmp_path / "t", force=True, shard_bytes=1 << 16,
                                 background=background)
            tracer = Tracer(model, writer, optimizer=opt, mode=mode,
                            full_modules=["layers.0.*"]).attach()
        res = train(model, batches, sc, opt, device=torch.device("cpu"), dtype=torch.float32,
                    dropout=DropoutControl(0), tracer=tracer)
        if tracer is not None:
            tracer.detach()
            writer.close({"steps": sc.steps})
            assert len(TraceReader(tmp_path / "t").manifest["shards"]) > (1 if mode != "stats" else 0)
        results.append(res)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for a, b in zip(*results):
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["output"], b["output"])
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def _reference_positions(key: str, numel: int, seed: int) -> np.ndarray:
    """The sample positions as specified, in plain numpy (the compiled kernel must match)."""
    if numel <= stats.SAMPLE_SIZE:
        return np.arange(numel, dtype=np.int64)
    base = np.random.default_rng(seed).random(stats.SAMPLE_SIZE)
    shift = zlib.crc32(key.encode()) / 2.0**32
    return np.minimum(((base + shift) % 1.0 * numel).astype(np.int64), numel - 1)


def test_sample_positions_follow_the_reference_formula_one_by_one_and_batched():
    # Both runs rely on these positions: the compiled path must pick exactly the specified ones.
    g = np.random.default_rng(0)
    lengths = [int(x) for x in g.choice([0, 1, 5, 511, 512, 513, 700, 100_000, 10**9], 40)]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    keys = [f"0/forward/m{i}/0/output" for i in range(40)]
    for k, n in zip(keys, lengths):
        assert np.array_equal(stats.sample_indices(k, n, 3), _reference_positions(k, n, 3))
    chosen = sorted(g.choice(40, 25, replace=False).tolist())
    got = stats._flat_sample_indices([keys[i] for i in chosen], [lengths[i] for i in chosen],
                                     offsets[chosen], 3)
    want = np.concatenate([_reference_positions(keys[i], lengths[i], 3) + offsets[i]
                           for i in chosen])
    assert np.array_equal(got, want)


class _Make(torch.nn.Module):
    def forward(self, x):
        return x.repeat(1, stats.BIG // x.shape[1] + 1)  # a large tensor (summarised at capture)


class _DoubleInPlace(torch.nn.Module):
    def forward(self, y):
        return y.mul_(2.0)  # the same tensor object comes back, changed


def test_a_tensor_changed_in_place_is_summarised_again(tmp_path):
    # Stats mode reuses the summary of a tensor seen earlier in the step (a module's output is
    # the next one's input) only while it is unchanged: here "double"'s output is its input
    # object, written in place, and must not inherit the input's statistics.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Make(), _DoubleInPlace())
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w, mode="stats").attach()
        with torch.no_grad():
            model(torch.randn(3, 4) + 5.0)
        tracer.step()
        tracer.detach()
        w.close({"steps": 1})
    st = {(e["module"], e["slot"]): e["stats"] for e in TraceReader(tmp_path / "t").entries}
    made, before, after = st[("1", "output")], st[("2", "input.0")], st[("2", "output")]
    assert made["numel"] >= stats.BIG
    assert before["mean"] == made["mean"]  # the same tensor, unchanged: the same summary
    assert after["mean"] == pytest.approx(2 * before["mean"], rel=1e-6)
    assert after["absmax"] == pytest.approx(2 * before["absmax"], rel=1e-6)


def test_complex_nan_and_inf_are_counted_on_the_complex_values():
    # |inf + nan j| is inf (C99 hypot), yet the element holds a NaN: counted as NaN, not Inf.
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([complex(inf, nan), complex(nan, inf), complex(inf, 0.0), complex(1.0, 2.0)])
    d = stats.to_dict(stats.stats_vector(z).tolist())
    assert (d["nan"], d["inf"], d["numel"]) == (2, 1, 4)
    assert d["max"] == pytest.approx(abs(complex(1.0, 2.0)))


def _host_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    odd = torch.randn(700, generator=g)
    odd[[5, 9]] = torch.tensor([float("nan"), float("inf")])
    return [torch.randn(2, 16, 64, generator=g), torch.randn(64, generator=g),  # >= / < sample
            torch.randn(8, 300, generator=g).t(),  # not contiguous
            torch.randn(33, generator=g, dtype=torch.float64) * 1e3 + 1e6,  # |mean| >> std
            odd, torch.full((3,), float("nan")), torch.tensor(2.5), torch.ones(1, 1)]


def test_host_summaries_in_the_hook_equal_the_batched_summary():
    """Stats mode summarises small host tensors in their capture hook (HostSummaries) instead
    of copying them for summarize() at the end of the step: the same samples bitwise, the same
    counts, minima and maxima, and sums equal up to their association (the kernels let LLVM
    reorder float64 sums, and the order it picks can differ between two compilations: with one
    numba cache state the two paths differed in the last bit of one mean), across more captures
    than a block holds."""
    cases = _host_cases() * 40  # 320 captures: a second block of rows and samples
    keys = [f"0/forward/m{i}/0/output" for i in range(len(cases))]
    host = HostSummaries(seed=7)
    got = [(h.row(), h.sample()) for h in (host.take(t, k) for t, k in zip(cases, keys))]
    want_rows, want_samples = stats.summarize(cases, keys, 7)
    for t, (row, sample), want_row, want_sample in zip(cases, got, want_rows, want_samples):
        assert HostSummaries.eligible(t)
        want = want_row.numpy()  # fp8 columns NaN in both
        exact = [stats.COLUMNS.index(c) for c in ("min", "max", "absmax", "nan", "inf", "numel",
                                                   "fp8_underflow", "fp8_overflow")]
        np.testing.assert_array_equal(row[exact], want[exact])
        np.testing.assert_allclose(row, want, rtol=1e-14, atol=0)  # mean, std, l2
        assert sample.dtype == t.dtype and sample.shape == want_sample.shape
        assert sample.numpy().tobytes() == want_sample.numpy().tobytes()
    for t, (_, sample) in zip(cases, got):  # a short sample: its own bytes (no pinned block)
        owns = sample.untyped_storage().nbytes() == sample.nbytes
        assert owns == (t.numel() < stats.SAMPLE_SIZE)
    assert not HostSummaries.eligible(torch.zeros(0))  # zero-size: the general path
    assert not HostSummaries.eligible(torch.ones(3, dtype=torch.bfloat16))
    assert not HostSummaries.eligible(torch.ones(stats.BIG))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_held_large_summaries_equal_summarize_one(dtype):
    """Large host captures are held too (HostSummaries.take_large, take_sample): the row and the
    sample of summarize_one, bit for bit, across blocks; a tensor whose values are not all
    finite is left to the exact path (None). bfloat16 and float16 as well: the sample is the
    capture's own values, gathered as bits."""
    g = torch.Generator().manual_seed(3)
    host = HostSummaries(seed=5)
    cases = [torch.randn(stats.BIG + i, generator=g, dtype=dtype) * (i + 1) for i in range(300)]
    for i, t in enumerate(cases):
        held = host.take_large(t, f"0/backward/m{i}/0/grad_input.0")
        row, sample = stats.summarize_one(t, f"0/backward/m{i}/0/grad_input.0", 5)
        assert isinstance(held, Held) and held.nbytes == sample.nbytes
        np.testing.assert_array_equal(held.row()[:len(stats.FIELDS)], row[:len(stats.FIELDS)])
        assert held.sample().contiguous().view(torch.uint8).numpy().tobytes() == sample.contiguous().view(torch.uint8).numpy().tobytes()
        again = host.take_sample(t, "1/forward/other/0/output", held)  # the row known, a new key
        assert np.array_equal(again.row(), held.row(), equal_nan=True)
        assert torch.equal(again.sample(), stats.large_sample(t, "1/forward/other/0/output", 5))
    for n in (400, 600):  # not contiguous: copied into the scratch block (600: it grows)
        nc = torch.randn(300, n, generator=g, dtype=dtype).t()
        held = host.take_large(nc, f"k/{n}")
        row, sample = stats.summarize_one(nc, f"k/{n}", 5)
        np.testing.assert_array_equal(held.row()[:len(stats.FIELDS)], row[:len(stats.FIELDS)])
        assert held.sample().contiguous().view(torch.uint8).numpy().tobytes() == sample.contiguous().view(torch.uint8).numpy().tobytes()
        assert torch.equal(host.sample(nc, f"k/{n}"), stats.large_sample(nc, f"k/{n}", 5))
    bad = torch.randn(stats.BIG, dtype=dtype)
    bad[7] = float("nan")
    assert host.take_large(bad, "k") is None


def test_a_lone_sample_reaches_the_writer_without_its_block():
    """A flush packs its samples into one block per dtype; a sample alone in its dtype (one
    capture a flush, ``transfer="per-capture"``) is copied out of the HostSummaries block, which
    it would otherwise keep alive in the writer's queue (512 KB for its 2 KB)."""
    from driftcheck.record.transfer import pack_samples

    host = HostSummaries(0)
    sample = host.take_large(torch.randn(stats.BIG), "k").sample()
    assert sample.untyped_storage().nbytes() > sample.nbytes  # a view into the block
    got = [sample]
    pack_samples(got, [False])
    assert got[0].untyped_storage().nbytes() == got[0].nbytes and torch.equal(got[0], sample)


def test_a_large_capture_with_nan_takes_the_exact_path(tmp_path):
    """Not all finite: the one-pass row is not taken (the exact masking path is); its counts
    and sample are those of the values."""
    class Poison(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            y[0, 3] = float("nan")
            y[1, 5] = float("inf")
            return y

    model = torch.nn.Sequential(torch.nn.Linear(300, 300), Poison())
    x = torch.randn(256, 300)
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w, mode="stats").attach()
        with torch.no_grad():
            want = model(x)
        tracer.step()
        tracer.detach()
        w.close({})
    reader = TraceReader(tmp_path / "t")
    e = next(e for e in reader.entries if e["module"] == "1" and e["slot"] == "output")
    assert (e["stats"]["nan"], e["stats"]["inf"], e["stats"]["numel"]) == (1, 1, want.numel())
    idx = torch.from_numpy(stats.sample_indices(e["key"], want.numel(), 0))
    torch.testing.assert_close(reader.tensor(e, "sample"), want.reshape(-1)[idx], rtol=0, atol=0,
                               equal_nan=True)


def test_stats_mode_holds_host_captures_without_a_tensor_each(tmp_path):
    """Until the step's flush a stats-mode host capture is a Held (a block and an index): the
    thousands of small tensors and arrays it replaced (a 349M Llama: ~19,000 malloc'd parts
    living through the step) fragmented the heap between the model's tensors (~1 GB more heap
    before the first optimizer step; numerics/host_summaries.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))
    x = torch.randn(256, 300)
    seen: list = []
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w, mode="stats").attach()
        real = tracer.capture.flush
        tracer.capture.flush = lambda: (seen.extend(type(p.tensor) for p in tracer.capture.pending), real())[1]
        model(x).square().mean().backward()
        tracer.step()
        tracer.detach()
        w.close({})
    assert seen and set(seen) == {Held}, seen
    reader = TraceReader(tmp_path / "t")
    big = [e for e in reader.entries if e["stats"]["numel"] >= stats.BIG]
    assert big and all(reader.tensor(e, "sample").numel() == stats.SAMPLE_SIZE for e in big)


def test_a_bfloat16_records_large_host_captures_are_held(tmp_path):
    """A bfloat16 model's large host captures are held too (a block and an index, the sample's
    bits gathered into it), and the trace has the statistics and samples of the values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))
    model = model.to(torch.bfloat16)
    x = torch.randn(256, 300, dtype=torch.bfloat16)
    seen: list = []
    outputs: dict = {}
    model[0].register_forward_hook(lambda m, i, o: outputs.setdefault("0", o.detach().clone()))
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w, mode="stats").attach()
        real = tracer.capture.flush
        tracer.capture.flush = lambda: (seen.extend((type(p.tensor), p.entry["key"]) for p in tracer.capture.pending),
                                        real())[1]
        model(x).float().square().mean().backward()
        tracer.step()
        tracer.detach()
        w.close({})
    reader = TraceReader(tmp_path / "t")
    big = {e["key"] for e in reader.entries if e["stats"]["numel"] >= stats.BIG}
    assert big and all(kind is Held for kind, key in seen if key in big), seen
    out = next(e for e in reader.entries if e["key"].endswith("/0/output") and e["module"] == "0")
    want = outputs["0"]
    assert out["stats"]["max"] == float(want.max()) and out["stats"]["min"] == float(want.min())
    assert out["stats"]["mean"] == pytest.approx(float(want.double().mean()), rel=1e-12)
    sample = reader.tensor(out, "sample")
    assert sample.dtype == torch.bfloat16
    assert torch.equal(sample, stats.sample_of(want, out["key"], 0))  # the seeded positions' values


def test_a_small_tensor_changed_in_place_after_its_capture_keeps_its_statistics(tmp_path):
    # The hook summarises (or copies) at capture time: ReLU(inplace=True) after a Linear must
    # not change what was recorded for the Linear's output.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True))
    x = torch.randn(5, 4)
    want = model[0](x).detach()
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w, mode="stats").attach()
        with torch.no_grad():
            model(x)
        tracer.step()
        tracer.detach()
        w.close({"steps": 1})
    reader = TraceReader(tmp_path / "t")
    e = next(e for e in reader.entries if (e["module"], e["phase"], e["slot"]) == ("0", "forward", "output"))
    assert e["stats"]["min"] == pytest.approx(float(want.min())) and e["stats"]["min"] < 0
    assert torch.equal(reader.tensor(e, "sample"), want.reshape(-1))


def test_to_dict_nulls_exactly_the_non_finite_statistics():
    finite = stats.to_dict([-1.0, 2.0, 0.5, 1.0, 2.0, 3.0, 0.0, 0.0, 4.0, math.nan, math.nan])
    assert finite == {"min": -1.0, "max": 2.0, "mean": 0.5, "std": 1.0, "absmax": 2.0, "l2": 3.0,
                      "nan": 0, "inf": 0, "numel": 4}
    assert all(type(finite[k]) is int for k in ("nan", "inf", "numel"))
    empty = stats.to_dict([math.nan] * 5 + [0.0, 2.0, 1.0, 3.0, 1.0, 0.0])
    assert empty == {"min": None, "max": None, "mean": None, "std": None, "absmax": None,
                     "l2": 0.0, "nan": 2, "inf": 1, "numel": 3, "fp8_underflow": 1,
                     "fp8_overflow": 0}
    huge = stats.to_dict([-1e308, 1e308, 0.0, 1e308, 1e308, math.inf, 0.0, 0.0, 2.0])
    assert huge["min"] == -1e308 and huge["max"] == 1e308 and huge["l2"] is None
    for col in range(6):  # any one statistic non-finite: that one alone is null
        vec = [-1.0, 2.0, 0.5, 1.0, 2.0, 3.0, 0.0, 0.0, 4.0]
        vec[col] = math.inf
        d = stats.to_dict(vec)
        assert [d[k] is None for k in stats.FIELDS[:6]] == [i == col for i in range(6)]


def test_kink_profile_counts_magnitudes_against_the_absmax():
    from driftcheck.record.meta import KINK_BINS, kink_profile as _kink_profile

    x = torch.tensor([4.0, -2.0, 1.0, 0.25, -1e-30, 0.0, float("nan"), float("inf"), 3.0])
    prof = _kink_profile(x).tolist()
    finite = x[torch.isfinite(x)].abs()
    assert len(prof) == KINK_BINS + 1 and prof[0] == finite.numel() == 7
    for k, c in enumerate(prof):  # counts[k] = finite elements with |x| <= absmax * 2^-k
        assert c == int((finite <= 4.0 * 2.0 ** -k).sum()), (k, prof)


def test_stats_mode_judges_relu_gradients_by_their_kinks(tmp_path):
    """A ReLU's input gradient differs in full where rounding moved an input across zero: few
    elements, each a full-size error. A stats-mode sample rarely holds one, but the gradients
    that sum over them (the convolution's, the weights') carry them all: judged against the
    sampled inherited error alone, a clean bf16 target of the built-in ResNet failed (ratio 13
    at a ReLU, 3.7 further down). The ReLU's input magnitudes (kink_profile) estimate the flips,
    and that estimate is passed on; a real fault is still caught at its module."""
    ref = record(load_scenario("resnet"), tmp_path / "ref", mode="stats", force=True)
    clean = record(load_scenario("resnet"), tmp_path / "clean", mode="stats", dtype="bf16",
                   replay=ref, force=True)
    prof = [e for e in TraceReader(ref).entries if "kink_profile" in (e.get("meta") or {})]
    assert prof and all(e["phase"] == "forward" and e["slot"] == "input.0" for e in prof)
    rep = compare(ref, clean)
    assert rep.verdict == "pass", rep.first_divergence
    assert [e for e in rep.entries if e.details.get("kink_estimate")]
    bad = record(load_scenario("resnet"), tmp_path / "bad", mode="stats", dtype="bf16",
                 replay=ref, force=True, target_hooks=_scale_output("layer1.conv1", 1.05))
    rep = compare(ref, bad)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == "layer1.conv1"


def test_stats_mode_update_scale_of_a_small_parameter_is_the_exact_update(tmp_path):
    """An optimizer step's size bounds what a cancelled gradient can make of it (Adam turns
    noise into full steps): in stats mode the parameter before and after the step are samples,
    and for a tensor no larger than a sample they are the whole tensor, so the update is exact
    (the difference of the rms values was used before: a clean bf16 BART failed at 3.6 on an
    attention key bias, whose gradient is zero in exact arithmetic)."""
    from driftcheck.compare.entries import entries_of
    from driftcheck.compare.scale import update_scale
    full = TraceReader(record(load_scenario("mlp"), tmp_path / "full", force=True))
    st = TraceReader(record(load_scenario("mlp"), tmp_path / "stats", mode="stats", force=True))
    full_entries, stats_entries = entries_of(full), entries_of(st)
    small = [e for e in stats_entries if e.phase == "optimizer" and e.slot.startswith("param.")
             and e.stats["numel"] <= stats.SAMPLE_SIZE]
    assert small
    by_key = {e.key: e for e in full_entries}
    for e in small:
        exact = update_scale(by_key[e.key], full, {x.align: x for x in full_entries})
        got = update_scale(e, st, {x.align: x for x in stats_entries})
        assert exact[0] > 0 and got == pytest.approx(exact, rel=1e-12), e.key


def _encoder_scenario():
    from torch import nn

    from driftcheck.scenario import Scenario

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)  # F.relu inside
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(0)
    return Scenario(model=model, inputs=[torch.randn(4, 10, 32, generator=g) for _ in range(2)],
                    loss=lambda out, x: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), steps=2)


def test_stats_mode_estimates_kinks_applied_by_functional_relu(tmp_path):
    """nn.TransformerEncoderLayer applies F.relu to linear1's output: no nn.ReLU to profile, and
    the samples hold no flip. The output gradient's sample has as many exact zeros as the output
    has non-positive values (a ReLU's signature): the flips are estimated from the output's
    sample, and a clean bf16 target passes (it failed at 5.1 on linear1's input gradient).
    Zeros for other reasons are not taken for a kink: Hugging Face's Llama ignores the last
    label, so every gradient below the head has a zero row, and taking that for a kink made
    every one of its backward entries lenient."""
    pytest.importorskip("transformers")
    ref = record(_encoder_scenario(), tmp_path / "r", mode="stats")
    tgt = record(_encoder_scenario(), tmp_path / "t", mode="stats", dtype="bf16", replay=ref)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    est = [e.key for e in rep.entries if e.details.get("kink_estimate")]
    assert "0/backward/0.layers.1.linear1/0/grad_output" in est
    ref = record(load_scenario("hf:llama"), tmp_path / "hr", mode="stats", steps=1)
    tgt = record(load_scenario("hf:llama"), tmp_path / "ht", mode="stats", steps=1, dtype="bf16",
                 replay=ref)
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.first_divergence
    assert not [e.key for e in rep.entries if e.details.get("kink_estimate")]


def test_a_backend_without_the_kink_profile_ops_still_records(tmp_path, monkeypatch):
    """frexp or bincount missing on a backend (torch_tpu implements a subset of ATen) must not
    break a record: the ReLU's input is captured without a profile."""
    import driftcheck.record.hooks as tr

    def unsupported(x, kinks=(0.0,)):
        raise NotImplementedError("aten::frexp is not implemented for the 'tpu' backend")

    monkeypatch.setattr(tr, "kink_profile", unsupported)
    ref = record(load_scenario("mlp"), tmp_path / "r", mode="stats", force=True)
    entries = TraceReader(ref).entries
    assert not [e for e in entries if "kink_profile" in (e.get("meta") or {})]
    assert [e for e in entries if e["module"] == "act2" and e["phase"] == "forward"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_large_gradients_summarised_in_their_hook_are_the_accumulated_ones(tmp_path, set_to_none):
    """A gradient of at least stats.BIG elements is summarised when it is accumulated, not
    copied: with two backward passes per step the trace holds the sum's statistics and sample,
    and a zero_grad (in place or to None) before t.step() does not reach them."""
    import driftcheck

    def run(mode, out):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with driftcheck.trace(model, str(out), mode=mode, optimizer=opt) as t:
            for _ in range(2):
                for _ in range(2):  # two micro-batches
                    model(torch.randn(8, 300, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
                t.step()
        return {e["key"]: e for e in TraceReader(out).manifest["entries"] if e["phase"] == "grads"}

    full, summ = run("full", tmp_path / "full"), run("stats", tmp_path / "stats")
    big = [k for k, e in summ.items() if math.prod(e["shape"]) >= stats.BIG]
    assert big  # the 300 x 300 weights
    rf, rs = TraceReader(tmp_path / "full"), TraceReader(tmp_path / "stats")
    for k in big:
        a, b = full[k]["stats"], summ[k]["stats"]
        assert a["l2"] > 0 and math.isclose(a["l2"], b["l2"], rel_tol=1e-9), (k, a, b)
        assert a["max"] == b["max"] and a["min"] == b["min"]
        whole = rf.tensor(full[k]).reshape(-1)
        idx = torch.from_numpy(stats.sample_indices(k, whole.numel(), 0))
        assert torch.equal(rs.tensor(summ[k], "sample"), whole[idx])


def _big_linear_run(tmp_path, between=None, steps=3):
    """Stats mode over a Linear whose weight is large (>= stats.BIG): after each update, the
    weight's summary; ``between(model)`` runs after optimizer.step() and before t.step()."""
    import driftcheck

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 512)
    with driftcheck.trace(model, str(tmp_path / "t"), mode="stats", optimizer=opt, force=True) as t:
        for _ in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(model)
            t.step(loss)
    return {(e["step"], e["phase"], e["slot"]): e["stats"]
            for e in TraceReader(tmp_path / "t").entries if e["module"] == ""}


def test_parameters_before_a_step_reuse_the_summary_after_the_last_update(tmp_path, monkeypatch):
    calls = []
    real = HostSummaries.take_large  # a large host tensor's one pass (stats.summarize_one's, held)
    monkeypatch.setattr(HostSummaries, "take_large", lambda self, t, k: calls.append(k) or real(self, t, k))
    st = _big_linear_run(tmp_path)
    for step in (1, 2):  # the weight before step N is the weight after step N-1's update
        assert st[(step, "params", "param.weight")] == st[(step - 1, "optimizer", "param.weight")]
    # One pass before step 0 and one after each of the 3 updates (an update's sample key is
    # its step's parameters'); none for the parameters before steps 1 and 2.
    assert len([k for k in calls if k.endswith("params/./0/param.weight")]) == 1 + 3


def test_a_write_through_data_between_update_and_step_is_summarised_again(tmp_path):
    # ``.data`` writes bump no version counter; the sample taken after the update no longer
    # matches, so the weight before the next step is summarised from what it now holds.
    def clamp(model):
        model.weight.data.clamp_(-0.01, 0.01)  # WGAN's weight clipping

    st = _big_linear_run(tmp_path, between=clamp)
    for step in (1, 2):
        before = st[(step, "params", "param.weight")]
        assert before["absmax"] <= 0.01 + 1e-9
        assert st[(step - 1, "optimizer", "param.weight")]["absmax"] > 0.01


def test_a_step_hands_its_samples_to_the_writer_in_one_block(tmp_path):
    # Samples held one by one until their shard is written fragment the heap (resident memory
    # grew every step): a step's samples are views into one block per dtype.
    import driftcheck

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    with driftcheck.trace(model, str(tmp_path / "t"), mode="stats", force=True) as t:
        model(torch.randn(4, 64)).sum().backward()
        t.step()
        held = [x for name, x in t.writer._pending if name.endswith("#sample")]
        assert len(held) > 20
        assert len({x.untyped_storage().data_ptr() for x in held}) == 1
    reader = TraceReader(tmp_path / "t")
    e = next(e for e in reader.entries if e["module"] == "2" and e["slot"] == "output")
    assert reader.tensor(e, "sample").numel() == min(e["stats"]["numel"], stats.SAMPLE_SIZE)


def test_summarising_a_tensor_leaves_its_storage_resizable():
    # Tensor.numpy() marks a storage not resizable for good; FSDP frees an unsharded parameter
    # by resizing its storage to 0, which then raised inside the backward.
    from driftcheck.numerics import kernels

    t = torch.randn(stats.BIG + 5)
    small = torch.randn(100)
    stats.summarize_one(t, "k", 0)
    HostSummaries(0).take(small, "s")
    HostSummaries(0).take_large(t, "k")
    view = kernels.flat_view(t)
    assert np.array_equal(view, t.detach().clone().numpy()) and view.base is not None
    del view
    for x in (t, small):
        x.untyped_storage().resize_(0)  # raised "Trying to resize storage that is not resizable"
        assert x.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_and_copy_stats_give_the_exact_extremes_and_float64_sums(dtype):
    """The one-pass kernels of large captures: min/max bit for bit those of the values (-0.0
    below 0.0, as the keys order them: numpy's min leaves that sign to its SIMD path;
    subnormals, infinities, a length not a multiple of the block), the sums float64's,
    and copy_stats the same four numbers as dense_stats with the copy made."""
    from driftcheck.numerics import summary_kernels as sk

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3 * 1024 + 77) * 3 - 0.5).astype(dtype)
    tiny = np.finfo(dtype).smallest_subnormal
    for case in (x, np.array([0.0, -0.0], dtype), np.array([tiny, -tiny, -0.0], dtype),
                 np.array([-2.5, -1.0, -7.0], dtype), np.append(x, dtype(-np.inf))):
        s, sq, lo, hi = sk.dense_stats(case)
        order = sorted(case.tolist(), key=lambda v: (v, math.copysign(1, v)))  # -0.0 < 0.0
        assert [(v, math.copysign(1, v)) for v in (lo, hi)] == \
            [(v, math.copysign(1, v)) for v in (order[0], order[-1])], (case, lo, hi)
        if np.isfinite(case).all():
            wide = case.astype(np.float64)
            assert s == pytest.approx(wide.sum(), rel=1e-12, abs=1e-12), (case, s)
            assert sq == pytest.approx((wide * wide).sum(), rel=1e-12), (case, sq)
        out = np.empty_like(case)
        got = sk.copy_stats(case, out)
        assert np.array_equal(out, case)
        assert np.array_equal(np.array(got), np.array((s, sq, lo, hi))), (case, got, (s, sq, lo, hi))

"""driftcheck.numerics.metrics: hand-computed tables (bf16/fp8 ULPs, subnormals, zero, inf/nan, integers)
and property tests that results do not depend on the chunk size."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from driftcheck.errors import DriftcheckError
from driftcheck.numerics.dtypes import coarser, default_tolerances, unit_roundoff
from driftcheck.numerics.metrics import (
    ErrorAccumulator,
    _as_array,
    _flat_chunks,
    _Sum,
    error_histogram,
    tensor_error,
    ulp,
)

INF, NAN = math.inf, math.nan
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
E4M3, E4M3UZ, E5M2, E5M2UZ = (torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                              torch.float8_e5m2, torch.float8_e5m2fnuz)


# ---------------------------------------------------------------- dtypes: u, coarser, tolerances
@pytest.mark.parametrize("dtype, u", [
    (FP64, 2**-53), ("fp64", 2**-53), ("double", 2**-53),
    (FP32, 2**-24), ("fp32", 2**-24), ("float32", 2**-24), ("torch.float32", 2**-24),
    ("tf32", 2**-11), ("TF32", 2**-11),
    (FP16, 2**-11), ("fp16", 2**-11), ("half", 2**-11),
    (BF16, 2**-8), ("bf16", 2**-8), ("bfloat16", 2**-8), ("torch.bfloat16", 2**-8),
    (E4M3, 2**-4), ("e4m3", 2**-4), ("float8_e4m3fn", 2**-4), (E4M3UZ, 2**-4),
    (E5M2, 2**-3), ("e5m2", 2**-3), (E5M2UZ, 2**-3),
    (torch.int64, 0.0), ("int8", 0.0), (torch.uint8, 0.0), (torch.bool, 0.0),
    (torch.complex64, 2**-24),  # complex: its component's roundoff
])
def test_unit_roundoff(dtype, u):
    assert unit_roundoff(dtype) == u


@pytest.mark.parametrize("name", ["fp12", "torch.nonsense", "", "e9m9", "Tensor", "__name__"])
def test_unknown_dtype_is_a_user_error(name):
    with pytest.raises(DriftcheckError, match="dtype"):
        unit_roundoff(name)


def test_packed_fp4_is_refused():
    with pytest.raises(DriftcheckError, match="unpack"):
        unit_roundoff(torch.float4_e2m1fn_x2)


@pytest.mark.parametrize("a, b, expected", [
    (FP32, BF16, BF16), ("bf16", FP32, BF16), ("bf16", "e4m3", E4M3), (E4M3, E5M2, E5M2),
    (torch.int64, FP16, FP16), ("tf32", FP32, "tf32"), (FP16, "tf32", FP16),  # tie -> first
    (torch.int32, torch.bool, torch.int32),
])
def test_coarser(a, b, expected):
    assert coarser(a, b) == expected


@pytest.mark.parametrize("dtype, tol", [
    (FP64, (1e-7, 1e-7)), (FP32, (1.3e-6, 1e-5)), ("fp16", (1e-3, 1e-5)), ("bf16", (1.6e-2, 1e-5)),
    ("e4m3", (0.125, 1e-3)), (E5M2, (0.25, 1e-3)), (torch.int64, (0.0, 0.0)), (torch.bool, (0.0, 0.0)),
])
def test_default_tolerances(dtype, tol):
    assert default_tolerances(dtype) == tol


@pytest.mark.parametrize("dtype", [FP64, FP32, FP16, BF16])
def test_tolerances_match_assert_close(dtype):
    # The convention users know: torch.testing's own defaults for that dtype.
    from torch.testing._comparison import default_tolerances as torch_defaults

    assert default_tolerances(dtype) == torch_defaults(dtype)


# ---------------------------------------------------------------- ulp
@pytest.mark.parametrize("x, dtype, spacing", [
    (1.0, BF16, 2**-7), (1.5, BF16, 2**-7), (2.0, BF16, 2**-6), (0.75, BF16, 2**-8),
    (-3.0, BF16, 2**-6), (0.0, BF16, 2**-133), (1e-39, BF16, 2**-133),  # 1e-39 < tiny 2^-126
    (2**-126, BF16, 2**-133), (2**-125, BF16, 2**-132),
    (1.0, FP32, 2**-23), (0.0, FP32, 2**-149), (1e-45, FP32, 2**-149), (2**-126, FP32, 2**-149),
    (2**-127, FP32, 2**-149), (2**-125, FP32, 2**-148), (3e38, FP32, 2**104),
    (1.0, FP16, 2**-10), (65504.0, FP16, 32.0), (0.0, FP16, 2**-24), (6e-5, FP16, 2**-24),
    (1.0, E4M3, 0.125), (448.0, E4M3, 32.0), (0.01, E4M3, 2**-9), (0.0, E4M3, 2**-9),
    (2**-6, E4M3, 2**-9), (1.0, E4M3UZ, 0.125), (0.0, E4M3UZ, 2**-10),
    (1.0, E5M2, 0.25), (57344.0, E5M2, 8192.0), (0.0, E5M2, 2**-16),
    (1.0, E5M2UZ, 0.25), (0.0, E5M2UZ, 2**-17),  # torch.finfo says eps 0.125 here; it is 0.25
    (1.0, "tf32", 2**-10), (0.0, "tf32", 2**-136),
    (1.0, FP64, 2**-52), (0.0, FP64, 2**-1074), (1e-310, FP64, 2**-1074),
    (7.0, torch.int64, 1.0), (0.0, torch.bool, 1.0),
    (INF, BF16, INF), (-INF, FP32, INF),
])
def test_ulp_table(x, dtype, spacing):
    assert ulp(torch.tensor([x], dtype=FP64), dtype).item() == spacing


def test_ulp_of_nan_is_nan():
    assert math.isnan(ulp(torch.tensor([NAN], dtype=FP64), BF16).item())


@pytest.mark.parametrize("dtype, bits", [
    (BF16, torch.int16), (FP16, torch.int16),
    (E4M3, torch.uint8), (E4M3UZ, torch.uint8), (E5M2, torch.uint8), (E5M2UZ, torch.uint8),
])
def test_ulp_is_the_gap_to_the_next_value_exhaustively(dtype, bits):
    # Every non-negative bit pattern: the next pattern is the next representable value, so the
    # gap must equal ulp() at that value, subnormals and zero included.
    top = 0x7FFF if bits == torch.int16 else 0x7F
    codes = torch.arange(0, top + 1, dtype=torch.int64).to(bits)
    vals = codes.view(dtype).to(FP64)
    lo, hi = vals[:-1], vals[1:]
    keep = torch.isfinite(lo) & torch.isfinite(hi) & (hi > lo)
    assert int(keep.sum()) > 100
    assert torch.equal(ulp(lo[keep], dtype), (hi - lo)[keep])


# ---------------------------------------------------------------- ULP error in a pair
@pytest.mark.parametrize("r, t, ref_dtype, tgt_dtype, ulps", [
    (1.0, 1.0078125, BF16, BF16, 1.0),      # next bf16 after 1.0 is 1 + 2^-7
    (1.0, 1.015625, BF16, BF16, 2.0),
    (1.0, 1.0078125, FP32, BF16, 1.0),      # ULP in the coarser dtype (bf16)
    (1.0, 1.0 + 2**-23, FP32, FP32, 1.0),
    (1.0, 1.125, E4M3, E4M3, 1.0),          # next e4m3 after 1.0
    (1.0, 1.25, E5M2, E5M2, 1.0),           # next e5m2 after 1.0
    (448.0, 416.0, FP32, E4M3, 1.0),        # top binade of e4m3: spacing 32
    (2**-149, 2**-148, FP32, FP32, 1.0),    # fp32 subnormals, step 2^-149
    (2**-133, 2**-132, BF16, BF16, 1.0),    # bf16 subnormals, step 2^-133
    (0.0, 2**-133, BF16, BF16, 1.0),        # zero: one subnormal step
    (0.0, 2**-9, FP32, E4M3, 1.0),          # e4m3 smallest subnormal
    (-2.0, -2.0625, BF16, BF16, 4.0),       # spacing 2^-6 at |r| = 2
])
def test_max_ulp_table(r, t, ref_dtype, tgt_dtype, ulps):
    ref, tgt = torch.tensor([r], dtype=ref_dtype), torch.tensor([t], dtype=tgt_dtype)
    assert ref.to(FP64).item() == r and tgt.to(FP64).item() == t  # exactly representable
    assert tensor_error(ref, tgt)["max_ulp"] == ulps


def test_declared_dtype_overrides_storage_dtype():
    # Stored as fp32, computed in tf32: ULPs and tolerances follow the declared precision.
    ref = torch.tensor([1.0, 1.0])
    tgt = torch.tensor([1.0, 1.0 + 2**-10])
    m = tensor_error(ref, tgt, tgt_dtype="tf32")
    assert m["max_ulp"] == 1.0 and (m["rtol"], m["atol"]) == (1e-3, 1e-5)
    assert m["frac_outside"] == 0.0
    assert tensor_error(ref, tgt)["frac_outside"] == 0.5  # fp32 tolerances: 2^-10 is outside


# ---------------------------------------------------------------- small vectors by hand
# r = [1, 2, 2] (||r|| = 3), t = [1, 2, 4]: e = [0, 0, 2]
#   mean_abs 2/3, rms sqrt(4/3), rel_l2 2/3, cosine (1+4+8)/(3*sqrt(21)) = 13/(3 sqrt 21),
#   sqnr 10 log10(9/4) = 3.5218 dB, ref_rms sqrt(9/3) = sqrt 3, tgt_rms sqrt(21/3) = sqrt 7
# r = [1, 0], t = [0, 1]: orthogonal: e = [-1, 1], rel_l2 sqrt 2, sqnr 10 log10(1/2)
# r = [1, 1], t = [-1, -1]: e = [-2, -2], rel_l2 sqrt 8 / sqrt 2 = 2, cosine -1, sqnr 10 log10(2/8)
# r = [1, 2], t = [0, 0]: rel_l2 1, cosine 0 (one side zero), sqnr 0 dB
# r = [0, 0], t = [0, 3]: rel_l2 inf, cosine 0, sqnr -inf
# r = t = [3, 4]: no error: rel_l2 0, cosine 1, sqnr inf
# r = t = [0, 0, 0]: all zero: rel_l2 0, cosine 1, sqnr inf
@pytest.mark.parametrize("r, t, expected", [
    ([1, 2, 2], [1, 2, 4], dict(max_abs=2.0, max_abs_index=2, mean_abs=2 / 3, rms=math.sqrt(4 / 3),
                                rel_l2=2 / 3, cosine=13 / (3 * math.sqrt(21)),
                                sqnr_db=10 * math.log10(9 / 4), ref_rms=math.sqrt(3),
                                ref_absmax=2.0, tgt_rms=math.sqrt(7))),
    ([1, 0], [0, 1], dict(max_abs=1.0, max_abs_index=0, rel_l2=math.sqrt(2), cosine=0.0,
                          sqnr_db=10 * math.log10(0.5))),
    ([1, 1], [-1, -1], dict(max_abs=2.0, rel_l2=2.0, cosine=-1.0, sqnr_db=10 * math.log10(0.25))),
    ([1, 2], [0, 0], dict(max_abs=2.0, max_abs_index=1, rel_l2=1.0, cosine=0.0, sqnr_db=0.0,
                          tgt_rms=0.0)),
    ([0, 0], [0, 3], dict(rel_l2=INF, cosine=0.0, sqnr_db=-INF, ref_rms=0.0, ref_absmax=0.0)),
    ([3, 4], [3, 4], dict(max_abs=0.0, max_abs_index=-1, rel_l2=0.0, cosine=1.0, sqnr_db=INF,
                          max_ulp=0.0, frac_outside=0.0)),
    ([0, 0, 0], [0, 0, 0], dict(max_abs=0.0, max_abs_index=-1, rms=0.0, rel_l2=0.0, cosine=1.0,
                                sqnr_db=INF, ref_rms=0.0, tgt_rms=0.0)),
])
def test_small_vectors_by_hand(r, t, expected):
    m = tensor_error(torch.tensor(r, dtype=FP64), torch.tensor(t, dtype=FP64))
    for key, want in expected.items():
        assert m[key] == pytest.approx(want, rel=1e-15, abs=1e-15), key
    assert m["count"] == m["count_finite"] == len(r)


def test_frac_outside_uses_the_coarser_tolerances():
    # fp32 bound at |r| = 1: 1e-5 + 1.3e-6 = 1.13e-5; bf16 bound: 1e-5 + 1.6e-2.
    r = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=FP64)
    t = torch.tensor([1.0, 1.0 + 1e-5, 1.0 + 2e-5, 1.01], dtype=FP64)
    assert tensor_error(r, t, ref_dtype=FP32, tgt_dtype=FP32)["frac_outside"] == 0.5
    assert tensor_error(r, t, ref_dtype=FP32, tgt_dtype=BF16)["frac_outside"] == 0.0
    assert tensor_error(r, t, rtol=0.0, atol=0.0)["frac_outside"] == 0.75
    assert tensor_error(r, t, rtol=0.0, atol=1.5e-5)["frac_outside"] == 0.5


# ---------------------------------------------------------------- inf and nan on each side
def test_nonfinite_table():
    #        pos:  0    1    2    3     4    5    6    7
    r = [1.0, NAN, INF, -INF, 2.0, INF, NAN, 5.0]
    t = [1.0, NAN, INF, INF, NAN, 3.0, INF, 5.5]
    # 0: equal. 1: NaN/NaN agree. 2: +inf/+inf agree. 3: -inf/+inf mismatch.
    # 4: finite -> NaN: mismatch and new. 5: inf -> finite: mismatch. 6: NaN/inf: mismatch.
    # 7: error 0.5. Error metrics only over positions 0 and 7.
    m = tensor_error(torch.tensor(r, dtype=FP64), torch.tensor(t, dtype=FP64))
    assert (m["count"], m["count_finite"]) == (8, 2)
    assert (m["nan_ref"], m["nan_tgt"], m["inf_ref"], m["inf_tgt"]) == (2, 2, 3, 3)
    assert (m["nonfinite_new"], m["nonfinite_mismatch"]) == (1, 4)
    assert (m["max_abs"], m["max_abs_index"], m["mean_abs"]) == (0.5, 7, 0.25)
    assert m["rel_l2"] == pytest.approx(0.5 / math.sqrt(26))
    assert m["ref_rms"] == pytest.approx(math.sqrt((1 + 4 + 25) / 3))  # finite refs 1, 2, 5
    assert m["ref_absmax"] == 5.0
    assert m["tgt_rms"] == pytest.approx(math.sqrt((1 + 9 + 30.25) / 3))  # finite tgts 1, 3, 5.5


@pytest.mark.parametrize("r, t, new, mismatch", [
    (1.0, NAN, 1, 1), (1.0, INF, 1, 1), (1.0, -INF, 1, 1),   # target side
    (NAN, 1.0, 0, 1), (INF, 1.0, 0, 1), (-INF, 1.0, 0, 1),   # reference side
    (NAN, NAN, 0, 0), (INF, INF, 0, 0), (-INF, -INF, 0, 0),  # agreeing
    (INF, -INF, 0, 1), (NAN, INF, 0, 1), (-INF, NAN, 0, 1),  # both, differing
])
def test_nonfinite_single_position(r, t, new, mismatch):
    m = tensor_error(torch.tensor([r, 2.0]), torch.tensor([t, 2.0]))
    assert (m["nonfinite_new"], m["nonfinite_mismatch"]) == (new, mismatch)
    # The finite position is unaffected: no error leaks out of the non-finite one.
    assert (m["count_finite"], m["max_abs"], m["rel_l2"], m["cosine"]) == (1, 0.0, 0.0, 1.0)


def test_no_finite_pair():
    m = tensor_error(torch.tensor([NAN, 2.0]), torch.tensor([1.0, NAN]))
    assert m["count_finite"] == 0 and m["max_abs_index"] == -1
    assert (m["mean_abs"], m["rms"], m["frac_outside"], m["rel_l2"]) == (0.0, 0.0, 0.0, 0.0)
    assert m["nonfinite_mismatch"] == 2 and m["nonfinite_new"] == 1


def test_empty_tensors():
    m = tensor_error(torch.zeros(0, 3), torch.zeros(0, 3))
    assert (m["count"], m["max_abs_index"], m["cosine"], m["sqnr_db"]) == (0, -1, 1.0, INF)


# ---------------------------------------------------------------- integers, bool, complex
def test_integer_tensors():
    m = tensor_error(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 5]))
    assert (m["max_abs"], m["max_abs_index"], m["max_ulp"]) == (2.0, 2, 2.0)  # int spacing 1
    assert (m["rtol"], m["atol"], m["frac_outside"]) == (0.0, 0.0, 1 / 3)


def test_bool_tensors():
    m = tensor_error(torch.tensor([True, False]), torch.tensor([True, True]))
    assert (m["count"], m["max_abs"], m["max_abs_index"], m["frac_outside"]) == (2, 1.0, 1, 0.5)


def test_integer_reference_float_target_uses_float_precision():
    m = tensor_error(torch.tensor([1, 2]), torch.tensor([1.0, 2.015625], dtype=BF16))
    assert (m["rtol"], m["max_ulp"]) == (1.6e-2, 1.0)  # 2^-6 is one bf16 ULP at 2


def test_complex_compares_real_and_imaginary_parts():
    m = tensor_error(torch.tensor([1 + 1j, 2 + 0j]), torch.tensor([1 + 2j, 2 + 0j]))
    assert (m["count"], m["max_abs"], m["max_abs_index"]) == (4, 1.0, 1)


def test_shape_mismatch_is_a_user_error():
    with pytest.raises(DriftcheckError, match=r"\(2, 3\).*\(3, 2\)"):
        tensor_error(torch.zeros(2, 3), torch.zeros(3, 2))


def test_accumulator_rejects_unequal_chunks():
    with pytest.raises(ValueError, match="chunk sizes differ"):
        ErrorAccumulator(FP32, FP32).update(torch.zeros(3), torch.zeros(4))


def test_accumulator_streams_like_tensor_error():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1000, generator=g)
    t = (r + 1e-3 * torch.randn(1000, generator=g)).to(BF16)
    acc = ErrorAccumulator("fp32", "bf16")
    for i in range(0, 1000, 300):
        acc.update(r[i:i + 300], t[i:i + 300])
    assert acc.result() == pytest.approx(tensor_error(r, t), rel=1e-12)


# ---------------------------------------------------------------- chunking
def _same(a: dict, b: dict) -> None:
    exact = ("count", "count_finite", "max_abs", "max_abs_index", "max_ulp", "frac_outside",
             "ref_absmax", "nan_ref", "nan_tgt", "inf_ref", "inf_tgt", "nonfinite_new",
             "nonfinite_mismatch", "rtol", "atol")
    assert a.keys() == b.keys()
    for k in a:
        if k in exact or not math.isfinite(a[k]):
            assert a[k] == b[k], k
        elif k == "sqnr_db":
            # a log of a ratio: a 1e-12 relative difference in the ratio is ~4e-12 dB absolute,
            # however close to 0 dB the value itself is
            assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-10), k
        else:
            assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-300), k


def test_sums_across_chunks_are_compensated():
    # Errors [2^53, 1, 1, 1, 1] one per chunk: a plain float64 running sum drops every 1
    # (2^53 + 1 rounds to 2^53); the compensated sum keeps 2^53 + 4, which is representable.
    r = torch.zeros(5, dtype=FP64)
    t = torch.tensor([2.0**53, 1, 1, 1, 1], dtype=FP64)
    assert tensor_error(r, t, chunk_elems=1)["mean_abs"] == (2.0**53 + 4) / 5


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
def test_max_abs_index_is_the_first_of_tied_maxima(chunk):
    r = torch.zeros(5)
    t = torch.tensor([0.0, 2.0, -1.0, -2.0, 2.0])
    assert tensor_error(r, t, chunk_elems=chunk)["max_abs_index"] == 1


def test_noncontiguous_and_chunked_match_contiguous():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(37, 23, generator=g)
    t = r + torch.randn(37, 23, generator=g) * 1e-4
    t[5, 7] = 9.0  # the max, at flat index 5*23+7 of the row-major view
    whole = tensor_error(r, t)
    assert whole["max_abs_index"] == 5 * 23 + 7
    rt, tt = r.t().contiguous().t(), t.t().contiguous().t()  # same values, column-major strides
    assert not rt.is_contiguous()
    for chunk in (1, 7, 23, 24, 100, 1 << 20):
        _same(tensor_error(rt, t, chunk_elems=chunk), whole)
        _same(tensor_error(r, tt, chunk_elems=chunk), whole)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    chunk=st.integers(1, 50),
    transpose=st.booleans(),
)
def test_flat_chunks_cover_in_row_major_order(shape, chunk, transpose):
    x = torch.arange(math.prod(shape), dtype=FP32).reshape(shape)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    pieces = list(_flat_chunks(x, chunk))
    assert all(p.numel() <= chunk for p in pieces)
    joined = torch.cat(pieces) if pieces else torch.zeros(0)
    assert torch.equal(joined, x.reshape(-1))


_SPECIAL = [0.0, -0.0, 1.0, -1.0, 2**-149, 2**-133, 1e-40, 65504.0, 448.0, INF, -INF, NAN]
_DTYPES = [FP64, FP32, FP16, BF16, E4M3, E5M2]


def _oracle(r: np.ndarray, t: np.ndarray) -> dict:
    """Whole-array numpy computation of a few metrics, no chunking."""
    both = np.isfinite(r) & np.isfinite(t)
    e = np.abs(t[both] - r[both])
    rr, ee = float(np.sum(r[both] ** 2)), float(np.sum(e**2))
    return {"count_finite": int(both.sum()), "max_abs": float(e.max()) if e.size else 0.0,
            "mean_abs": float(e.mean()) if e.size else 0.0,
            "rel_l2": 0.0 if ee == 0 else (INF if rr == 0 else math.sqrt(ee / rr))}


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=3),
    data=st.data(),
    dtypes=st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES)),
    chunk=st.integers(1, 64),
)
def test_chunk_size_independence(shape, data, dtypes, chunk):
    n = math.prod(shape)
    value = st.one_of(st.sampled_from(_SPECIAL),
                      st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False))
    r64 = torch.tensor(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=FP64)
    t64 = torch.tensor(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=FP64)
    r, t = r64.reshape(shape).to(dtypes[0]), t64.reshape(shape).to(dtypes[1])
    whole = tensor_error(r, t, chunk_elems=1 << 20)
    _same(tensor_error(r, t, chunk_elems=chunk), whole)
    oracle = _oracle(r.reshape(-1).to(FP64).numpy(), t.reshape(-1).to(FP64).numpy())
    for k, want in oracle.items():
        assert whole[k] == pytest.approx(want, rel=1e-12), k


def _full_oracle(r: np.ndarray, t: np.ndarray, dtype: torch.dtype) -> dict:
    """Every metric and the histogram, whole-array numpy in float64 (no chunks, no kernels)."""
    rtol, atol = default_tolerances(dtype)
    fr, ft = np.isfinite(r), np.isfinite(t)
    both = fr & ft
    a, b = r[both], t[both]
    e = np.abs(b - a)
    spacing = ulp(torch.from_numpy(np.abs(a)), dtype).numpy()
    nz = e[e > 0]
    hist = np.bincount(np.frexp(nz)[1] + 1022, minlength=2048) if nz.size else np.zeros(2048)
    return {"count_finite": int(both.sum()), "max_abs": float(e.max()) if e.size else 0.0,
            "max_abs_index": int(np.flatnonzero(both)[int(np.argmax(e))]) if e.size and e.max() > 0
            else -1,
            "max_ulp": float((e / spacing).max()) if e.size else 0.0,
            "frac_outside": float((e > atol + rtol * np.abs(a)).mean()) if e.size else 0.0,
            "mean_abs": float(e.mean()) if e.size else 0.0,
            "ref_absmax": float(np.abs(r[fr]).max()) if fr.any() else 0.0,
            "nan_ref": int(np.isnan(r).sum()), "inf_tgt": int(np.isinf(t).sum()),
            "nonfinite_new": int((fr & ~ft).sum()),
            "exact": int((e == 0).sum()), "binades": hist}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), nonfinite=st.booleans(),
       dtype=st.sampled_from([FP32, FP64, BF16]))
def test_compiled_passes_match_a_numpy_oracle(n, seed, nonfinite, dtype):
    # Blocks of 1024 inside the kernel, chunks of 700 outside: both boundaries are crossed;
    # with NaN/Inf sprinkled in, chunks holding one take the general pass, the rest the fast one.
    g = np.random.default_rng(seed)
    r = g.standard_normal(n) * np.exp2(g.integers(-30, 30, n))
    t = r * (1 + g.standard_normal(n) * 2.0**-9)
    same = g.random(n) < 0.1
    t[same] = r[same]  # exact matches
    if nonfinite:
        for arr in (r, t):
            arr[g.integers(0, n, 3)] = g.choice([np.nan, np.inf, -np.inf], 3)
    rt, tt = torch.from_numpy(r).to(dtype), torch.from_numpy(t).to(dtype)
    acc = ErrorAccumulator(dtype, dtype)
    for a, b in zip(rt.split(700), tt.split(700)):
        acc.update(a, b)
    got, h = acc.result(), acc.histogram(max_bins=4096)
    want = _full_oracle(rt.double().numpy(), tt.double().numpy(), dtype)
    for k in ("count_finite", "max_abs", "max_abs_index", "max_ulp", "nan_ref", "inf_tgt",
              "nonfinite_new", "ref_absmax"):
        assert got[k] == want[k], k
    assert got["frac_outside"] == pytest.approx(want["frac_outside"], abs=1e-12)
    assert got["mean_abs"] == pytest.approx(want["mean_abs"], rel=1e-12)
    assert h.exact == want["exact"]
    nonzero = [int(c) for c in want["binades"] if c]
    assert [c for c in h.counts if c] == nonzero


# ---------------------------------------------------------------- histogram
L2 = math.log10(2.0)


def test_error_histogram_table():
    # errors 0 (exact), 2^-9 (binade [2^-9, 2^-8)), 0.003 (in [2^-9, 2^-8) too), 0.02
    # ([2^-6, 2^-5)), 0.5 ([2^-1, 1)); a NaN and an Inf pair are not finite pairs: ignored.
    r = torch.zeros(7, dtype=FP64)
    t = torch.tensor([0.0, 2.0**-9, -0.003, 0.02, 0.5, NAN, INF], dtype=FP64)
    h = error_histogram(r, t)
    assert h.exact == 1
    assert h.counts == [2, 0, 0, 1, 0, 0, 0, 0, 1]  # one bin per binade, 2^-9 .. 2^0
    assert h.edges == pytest.approx([k * L2 for k in range(-9, 1)], rel=1e-15)
    for chunk in (1, 2, 3):
        assert error_histogram(r, t, chunk_elems=chunk) == h


def test_error_histogram_groups_binades_when_they_are_many():
    r = torch.zeros(3, dtype=FP64)
    t = torch.tensor([2.0**-40, 2.0**-20, 0.75], dtype=FP64)  # binades 2^-40 .. 2^-1: 40 of them
    h = error_histogram(r, t, max_bins=10)
    assert len(h.counts) <= 10 and sum(h.counts) == 3
    width = h.edges[1] - h.edges[0]
    assert width == pytest.approx(4 * L2)  # 40 / 10 = 4 binades a bin
    assert h.edges[0] == pytest.approx(-40 * L2) and h.edges[-1] >= 0.0 - 1e-12
    assert h.counts[0] == 1 and h.counts[-1] == 1


def test_error_histogram_edges_belong_to_the_bin_above():
    # |e| = 0.5, 1 and 2 are powers of two: each opens its own binade [2^k, 2^(k+1)).
    r = torch.zeros(4, dtype=FP64)
    t = torch.tensor([0.5, 0.75, 1.0, 2.0], dtype=FP64)
    h = error_histogram(r, t)
    assert h.counts == [2, 1, 1]
    assert h.edges == pytest.approx([-L2, 0.0, L2, 2 * L2], abs=1e-15)


def test_error_histogram_counts_float64_subnormal_errors():
    r = torch.zeros(2, dtype=FP64)
    t = torch.tensor([5e-324, 0.0], dtype=FP64)  # the smallest subnormal: not exact
    h = error_histogram(r, t)
    assert (sum(h.counts), h.exact) == (1, 1)


def test_error_histogram_without_error():
    h = error_histogram(torch.ones(4), torch.ones(4), 10)
    assert (h.edges, h.counts, h.exact) == ([], [], 4)


def test_error_histogram_rejects_bad_bins():
    with pytest.raises(ValueError, match="max_bins"):
        error_histogram(torch.ones(2), torch.ones(2), 0)


def test_error_histogram_of_a_nan_chunk_counts_only_finite_pairs():
    # a chunk with a NaN takes the general path: its histogram must not count the NaN position
    r = torch.tensor([1.0, 1.0, NAN, 1.0])
    t = torch.tensor([1.5, 1.0, 1.0, 1.25])
    h = error_histogram(r, t, chunk_elems=2)  # chunk 1 all finite, chunk 2 has the NaN
    assert (h.counts, h.exact) == ([1, 1], 1)  # 0.25 in [2^-2, 2^-1), 0.5 in [2^-1, 1)


# ---------------------------------------------------------------- summary statistics
SUMMARY_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel", "zeros")


def summary_stats(t: torch.Tensor, *, chunk_elems: int = 1 << 20) -> dict[str, float | int]:
    """Summary of ``t`` over its finite values, in float64, streamed: the test oracle for stats.py.

    Keys: ``min``, ``max``, ``mean``, ``std`` (population, as stats.py), ``absmax``, ``l2``
    (over finite values), ``nan``, ``inf``, ``numel``, ``zeros`` (exact zeros). With no finite
    value min/max/mean/std are NaN; an empty tensor also has absmax NaN. Complex tensors are
    summarised by their magnitudes, like stats.py.
    """
    n_all = n = 0
    mean = m2 = 0.0
    lo, hi, absmax = math.inf, -math.inf, 0.0
    sq = _Sum()
    nan = inf = zeros = 0
    for chunk in _flat_chunks(t, chunk_elems):
        x = torch.from_numpy(_as_array(chunk.abs() if chunk.is_complex() else chunk)).double()
        n_all += x.numel()
        nan += int(torch.isnan(x).sum())
        inf += int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        zeros += int((x == 0).sum())
        k = x.numel()
        if k == 0:
            continue
        mk = float(x.mean())
        m2k = float(((x - mk) ** 2).sum())
        # Chan et al. pairwise merge of (count, mean, M2): stable where sum x^2 - n mean^2 is not.
        delta = mk - mean
        total = n + k
        mean += delta * k / total
        m2 += m2k + delta * delta * n * k / total
        n = total
        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
        absmax = max(absmax, float(x.abs().max()))
        sq.add(float((x * x).sum()))
    nanv = math.nan
    return {
        "min": lo if n else nanv,
        "max": hi if n else nanv,
        "mean": mean if n else nanv,
        "std": math.sqrt(m2 / n) if n else nanv,
        "absmax": absmax if n_all else nanv,
        "l2": math.sqrt(sq.value),
        "nan": nan,
        "inf": inf,
        "numel": n_all,
        "zeros": zeros,
    }


def test_summary_stats_table():
    # finite: [1, -2, 0, 3]: mean 0.5; deviations .5 -2.5 -.5 2.5 -> var 13/4; l2 sqrt 14
    s = summary_stats(torch.tensor([1.0, -2.0, 0.0, NAN, INF, 3.0]))
    assert s == {"min": -2.0, "max": 3.0, "mean": 0.5, "std": math.sqrt(3.25), "absmax": 3.0,
                 "l2": math.sqrt(14), "nan": 1, "inf": 1, "numel": 6, "zeros": 1}
    for chunk in (1, 2, 5):
        assert summary_stats(torch.tensor([1.0, -2.0, 0.0, NAN, INF, 3.0]),
                             chunk_elems=chunk) == pytest.approx(s, rel=1e-15)


def test_summary_stats_is_stable_for_a_large_mean():
    # 1e8 + [0, 1, 2, 3]: std sqrt(1.25) exactly; sum x^2 - n mean^2 would lose it all in fp32
    # and most of it in fp64. Chunked merge keeps it.
    x = torch.tensor([1e8, 1e8 + 1, 1e8 + 2, 1e8 + 3], dtype=FP64)
    for chunk in (1, 3, 4):
        assert summary_stats(x, chunk_elems=chunk)["std"] == pytest.approx(math.sqrt(1.25), rel=1e-12)


def test_summary_stats_without_finite_values():
    s = summary_stats(torch.tensor([NAN, INF]))
    assert all(math.isnan(s[k]) for k in ("min", "max", "mean", "std"))
    assert (s["absmax"], s["l2"], s["nan"], s["inf"], s["numel"]) == (0.0, 0.0, 1, 1, 2)
    e = summary_stats(torch.zeros(0))
    assert math.isnan(e["absmax"]) and e["numel"] == 0


def test_summary_stats_agrees_with_record_time_stats():
    from driftcheck.numerics.stats import FIELDS, stats_vector

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 300, generator=g) * 3 + 1
    x[0, 0], x[1, 1], x[2, 2] = NAN, -INF, 0.0
    ours = summary_stats(x, chunk_elems=97)
    theirs = stats_vector(x.to(FP64)).tolist()
    for name, v in zip(FIELDS, theirs):
        assert ours[name] == pytest.approx(v, rel=1e-12), name


def test_kernels_work_without_a_writable_cache_location():
    # A read-only install with no writable home: numba finds no cache locator (simulated by
    # allowing only the IPython locator, which declines outside IPython); kernels still compile.
    import os
    import subprocess
    import sys

    code = ("import torch; from driftcheck.numerics import kernels; from driftcheck.numerics.metrics import "
            "tensor_error; print(tensor_error(torch.ones(3), torch.full((3,), 1.5))['max_abs'], "
            "type(kernels.finite_pass._cache).__name__)")
    env = dict(os.environ, NUMBA_CACHE_LOCATOR_CLASSES="_IPythonCacheLocator")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.5", "NullCache"]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), cuts=st.lists(st.integers(0, 2000), max_size=4),
       dtype=st.sampled_from([FP32, BF16, FP64]))
def test_merged_parts_equal_one_stream(seed, cuts, dtype):
    # Compare measures a large tensor in parts on several threads and merges them in order.
    g = np.random.default_rng(seed)
    r = torch.from_numpy(g.standard_normal(2000)).to(dtype)
    t = (r.double() * (1 + torch.from_numpy(g.standard_normal(2000)) * 1e-3)).to(dtype)
    same = g.integers(0, 2000, 5)
    t[same] = r[same]  # exact pairs
    t[int(g.integers(200, 1400))] = NAN
    r[100] = r[1500] = 0.5
    t[100] = t[1500] = 10.5  # a tied maximum error: the first must win
    whole = ErrorAccumulator(dtype, dtype)
    for a, b in zip(r.split(300), t.split(300)):
        whole.update(a, b)
    bounds = [0, *sorted(cuts), 2000]
    merged = ErrorAccumulator(dtype, dtype)
    for lo, hi in itertools.pairwise(bounds):
        part = ErrorAccumulator(dtype, dtype)
        for a, b in zip(r[lo:hi].split(300), t[lo:hi].split(300)):
            part.update(a, b)
        merged.merge(part)
    want, got = whole.result(), merged.result()
    for k, v in want.items():
        if isinstance(v, int) or k in ("max_abs", "max_ulp", "ref_absmax", "frac_outside"):
            assert got[k] == v, k
        else:
            assert got[k] == pytest.approx(v, rel=1e-12, nan_ok=True), k
    assert got["max_abs_index"] == 100
    assert merged.histogram() == whole.histogram()


def test_merge_refuses_other_precisions():
    with pytest.raises(ValueError, match="precisions"):
        ErrorAccumulator(FP32, FP32).merge(ErrorAccumulator(FP32, BF16))


def test_max_ulp_near_the_top_of_float64():
    # |r| >= 2^1023: the fast pass's reciprocal trick has no normal 2^-1023 and must divide.
    r = torch.tensor([1.5 * 2.0**1023, 1.0, -1.25 * 2.0**1023], dtype=FP64)
    step = 2.0 ** (1023 - 52)  # fp64 spacing at 2^1023
    t = r + torch.tensor([3 * step, 2.0**-52, -5 * step], dtype=FP64)
    assert tensor_error(r, t)["max_ulp"] == 5.0
    assert tensor_error(r[:2], t[:2])["max_ulp"] == 3.0

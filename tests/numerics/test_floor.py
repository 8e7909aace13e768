"""The noise floor (driftcheck/floor.py): hand-computed tables, bf16/fp8 roundoffs, zero, tiny,
inf and nan."""
from __future__ import annotations

import math

import pytest

from driftcheck.numerics import floor as fl
from driftcheck.numerics.floor import Floor, FloorInputs

U32, U16B, U8 = 2.0**-24, 2.0**-8, 2.0**-4  # fp32, bf16, fp8 e4m3
INF, NAN = math.inf, math.nan

# (inputs, expected rms, expected max, expected local rms, expected inherited rms)
FLOORS = [
    # elementwise bf16, scale 1: local = C_LOCAL*u, max = C_LOCAL_MAX*u
    (FloorInputs(u=U16B, scale_rms=1.0, scale_max=1.0), U16B, 2 * U16B, U16B, 0.0),
    # a Linear of K=64 in bf16 with fp32 accumulation: (u + sqrt(64) u_acc) * S
    (FloorInputs(u=U16B, u_acc=U32, k=64, scale_rms=2.0, scale_max=4.0),
     (U16B + 8 * U32) * 2.0, (2 * U16B + 8 * U32) * 4.0, (U16B + 8 * U32) * 2.0, 0.0),
    # fp8 e4m3 with K=4096: sqrt(K) = 64
    (FloorInputs(u=U8, u_acc=U32, k=4096, scale_rms=1.0, scale_max=1.0),
     U8 + 64 * U32, 2 * U8 + 64 * U32, U8 + 64 * U32, 0.0),
    # inherited relative error 1e-3, KAPPA = 2: adds 2e-3 * S
    (FloorInputs(u=U32, scale_rms=10.0, scale_max=20.0, inherited_rms=1e-3, inherited_max=2e-3),
     U32 * 10 + 2e-3 * 10, 2 * U32 * 20 + 4e-3 * 20, U32 * 10, 2e-3 * 10),
    # extra (optimizer update) terms add as they are
    (FloorInputs(u=U32, scale_rms=1.0, scale_max=1.0, extra_rms=0.5, extra_max=0.25),
     U32 + 0.5, 2 * U32 + 0.25, U32, 0.0),
    # a zero tensor: only the absolute floor near zero (the smallest normal) is left
    (FloorInputs(u=U16B, scale_rms=0.0, scale_max=0.0, tiny=1.1754943508222875e-38),
     1.1754943508222875e-38, 1.1754943508222875e-38, 1.1754943508222875e-38, 0.0),
    # integers: u = 0, nothing is explained
    (FloorInputs(u=0.0, scale_rms=5.0, scale_max=5.0), 0.0, 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("fi,rms,mx,local,inh", FLOORS)
def test_floor_table(fi, rms, mx, local, inh):
    f = fl.floor(fi)
    assert f.rms == pytest.approx(rms, rel=1e-12, abs=0.0)
    assert f.max == pytest.approx(mx, rel=1e-12, abs=0.0)
    assert f.local_rms == pytest.approx(local, rel=1e-12, abs=0.0)
    assert f.inherited_rms == pytest.approx(inh, rel=1e-12, abs=0.0)


RATIOS = [
    # (floor rms, floor max, err rms, err max, ratio)
    (1.0, 2.0, 0.5, 0.5, 0.5),
    (1.0, 2.0, 0.5, 3.0, 1.5),  # the max error decides
    (1.0, 2.0, 0.0, 0.0, 0.0),  # no error: 0 even over a zero floor
    (0.0, 0.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, 1e-30, 0.0, INF),  # any error over a zero floor (integers)
    (1.0, 1.0, NAN, 0.0, INF),  # a NaN error is never within the floor
    (1.0, 1.0, INF, 0.0, INF),
    (U16B, 2 * U16B, 4 * U16B, 4 * U16B, 4.0),  # 4 bf16 roundings: ratio 4
]


@pytest.mark.parametrize("f_rms,f_max,e_rms,e_max,ratio", RATIOS)
def test_ratio_table(f_rms, f_max, e_rms, e_max, ratio):
    assert Floor(f_rms, f_max, f_rms, 0.0).ratio(e_rms, e_max) == ratio


RELATIVE = [
    (0.0, 0.0, 0.0),  # both sides exactly zero
    (0.0, 1.0, 0.0),
    (1e-3, 1.0, 1e-3),
    (2.0, 1.0, fl.REL_CAP),  # capped: 100% wrong says nothing more
    (1e-3, 0.0, fl.REL_CAP),  # error over a zero scale
    (INF, 1.0, fl.REL_CAP),
    (NAN, 1.0, fl.REL_CAP),
    (1e-3, INF, fl.REL_CAP),
]


@pytest.mark.parametrize("err,scale,rel", RELATIVE)
def test_relative_table(err, scale, rel):
    assert fl.relative(err, scale) == rel


def test_floor_grows_with_sqrt_k_not_k():
    """The probabilistic bound (Higham & Mary): quadrupling K doubles the accumulation term."""
    a = fl.floor(FloorInputs(u=0.0, u_acc=U32, k=1024, scale_rms=1.0, scale_max=1.0)).rms
    b = fl.floor(FloorInputs(u=0.0, u_acc=U32, k=4096, scale_rms=1.0, scale_max=1.0)).rms
    assert b == pytest.approx(2 * a)

"""passes.small_pass (numpy, small chunks) against kernels.finite_pass (numba): the same
partials, sums up to their order, so a comparison of small tensors needs no compiled kernel."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from driftcheck.numerics import kernels, passes

SUMS = {"abs", "sq", "rr", "tt", "rt", "ref_sq", "tgt_sq"}


def _both(r: np.ndarray, t: np.ndarray, unit: float, tiny: float) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    h1, h2 = np.zeros(passes.HIST_BINS, np.int64), np.zeros(passes.HIST_BINS, np.int64)
    small = passes.small_pass(r, t, 1e-2, 1e-5, tiny, unit, h1)
    assert small is not None
    fast = dict(zip(passes.FIELDS, kernels.finite_pass(r, t, 1e-2, 1e-5, tiny, unit, h2)))
    if fast["max_abs"] > 0:
        fast["max_index"] = kernels.first_index(r, t, fast["max_abs"])
    return dict(zip(passes.FIELDS, small)), fast, h1, h2


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_pass_is_the_kernels_pass(seed: int, dtype: type) -> None:
    g = np.random.default_rng(seed)
    n = int(g.integers(1, 5000))
    r = (g.standard_normal(n) * 10.0 ** g.integers(-30, 30)).astype(dtype)
    t = (r * (1 + g.standard_normal(n) * 1e-3)).astype(dtype)
    t[g.integers(0, n, max(1, n // 7))] = r[g.integers(0, n, max(1, n // 7))]  # some exact, some swapped
    r[: n // 9] = 0.0  # zeros: the ULP scale of tiny
    eps, tiny = np.finfo(np.float32).eps, float(np.finfo(np.float32).tiny)
    small, fast, h1, h2 = _both(r, t, float(eps), tiny)
    assert np.array_equal(h1, h2)
    for f in passes.FIELDS:
        if f in SUMS:
            assert small[f] == pytest.approx(fast[f], rel=1e-12, abs=1e-300), f
        else:
            assert small[f] == fast[f], (f, small[f], fast[f])


def test_small_pass_of_integers_and_exact_matches() -> None:
    r = np.arange(100, dtype=np.float64)
    small, fast, h1, h2 = _both(r, r + (np.arange(100) % 3 == 0), 0.0, 0.0)
    assert small == fast and np.array_equal(h1, h2) and small["max_ulp"] == 1.0
    small, fast, _, _ = _both(r, r.copy(), 0.0, 0.0)
    assert small["max_abs"] == 0.0 and small["exact"] == 100 and small["max_index"] == -1


def test_small_pass_leaves_non_finite_values_to_the_kernels() -> None:
    h = np.zeros(passes.HIST_BINS, np.int64)
    assert passes.small_pass(np.array([1.0, np.nan]), np.array([1.0, 2.0]), 0, 0, 0, 0, h) is None
    assert passes.small_pass(np.array([1e200, 1.0]), np.array([1e200, 2.0]), 0, 0, 0, 0, h) is None  # |r|^2 overflows
    assert not h.any()


def test_comparing_small_traces_never_imports_numba(traces) -> None:
    """The demo's compare (a built-in model) measures every entry without a compiled kernel: no
    numba import, and no kernel compile on a fresh install (seconds)."""
    code = ("import sys\nfrom driftcheck.compare import compare\n"
            f"r = compare({str(traces['mlp']['fp32'])!r}, {str(traces['mlp']['bf16'])!r})\n"
            "assert len(r.entries) > 10\nprint('numba' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

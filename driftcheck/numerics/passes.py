"""How a chunk pair of a tensor comparison is measured without numba, and how the kernels read a
host tensor. Pure numerics, no I/O, no compiler: importing this costs nothing.

``small_pass`` measures a chunk pair of at most ``SMALL`` elements with numpy and returns the
same partials as ``kernels.finite_pass`` (``FIELDS``): each elementwise result is the same (the
same float64 operations, the ULP scale by the same exact power-of-two reciprocal), the float64
sums are taken in another order (they may differ in their last bits). A comparison of small
tensors (a built-in model, the demo) then never imports numba, nor compiles its kernels on a
fresh install (seconds); large chunks, and any chunk holding NaN or Inf, take the kernels.
"""
from __future__ import annotations

import numpy as np
import torch

HIST_BINS = 2048  # float64 biased exponents
EXPONENT_BITS = np.int64(0x7FF0000000000000)
RECIPROCAL_BITS = np.int64(2046 << 52)  # bits(2^-k) = bits(2046 << 52) - bits(2^k)
SMALL = 1 << 16  # elements: up to this, numpy measures a chunk pair (and record's meta) at once
SMALL_GROUP = 1 << 22  # elements a record summarizes at once: torch ops (a float64 copy, 32 MB at most) up to this

# Partials returned by both passes, in this order.
FIELDS = ("n_pair", "n_ref", "n_tgt", "abs", "sq", "rr", "tt", "rt", "ref_sq", "tgt_sq",
          "max_abs", "max_ulp", "outside", "ref_absmax", "exact",
          "nan_ref", "nan_tgt", "inf_ref", "inf_tgt", "nonfinite_new", "nonfinite_mismatch",
          "max_index")

_NUMPY_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64}


def flat_view(t: torch.Tensor) -> np.ndarray:
    """The elements of a contiguous host float32/float64/int64 tensor as a flat numpy array over
    the same memory, for a kernel call that does not keep it. Not ``Tensor.numpy()``: that
    marks the storage as not resizable for good, and FSDP frees an unsharded parameter by
    resizing its storage to 0 ("Trying to resize storage that is not resizable")."""
    if type(t) is not torch.Tensor or t.is_neg() or t.is_conj() or not t.is_contiguous() \
            or t.requires_grad:
        return t.numpy().reshape(-1)  # what numpy() refuses, it refuses here too
    if t.numel() == 0:
        return np.empty(0, dtype=_NUMPY_OF[t.dtype])
    return np.asarray(_Memory(t, _NUMPY_OF[t.dtype]))  # the array's base holds the tensor: its memory stays


# Narrow floats, which the kernels take as their uint16 bit patterns (numba has no float16
# arithmetic on the host, numpy no bfloat16)
NARROW = frozenset({torch.float16, torch.bfloat16})


def narrow_view(t: torch.Tensor) -> np.ndarray | None:
    """A contiguous host float16 or bfloat16 tensor's elements as a flat numpy array over the
    same memory, as uint16 bit patterns (``NARROW``), as ``flat_view``; None for any
    other tensor (the caller widens it with ``host_array``)."""
    if type(t) is not torch.Tensor or t.dtype not in NARROW or not t.is_cpu or t.is_neg() \
            or not t.is_contiguous() or t.requires_grad or t.numel() == 0:
        return None
    return np.asarray(_Memory(t, np.uint16))


class _Memory:
    """A contiguous host tensor's memory as numpy's array interface, holding the tensor."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, dtype: type) -> None:
        self.tensor = t
        self.__array_interface__ = {"shape": (t.numel(),), "typestr": np.dtype(dtype).str,
                                    "data": (t.data_ptr(), False), "version": 3}


def bits_or_values(t: torch.Tensor) -> np.ndarray:
    """A host tensor's numpy view as the kernels write into it: a narrow float's uint16 bits
    (``NARROW``), any other dtype's values (``Tensor.numpy``: for the tracer's own blocks)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype in NARROW else t.numpy()


def host_array(t: torch.Tensor) -> np.ndarray:
    """A real tensor as the kernels read it: flat, on the host, float32 or float64 as stored,
    narrower floats (fp16, bf16, fp8) widened to float32 and integers/bool to float64, both
    exact (int64 beyond 2^53 excepted). A view where nothing needs converting."""
    x = t.detach().reshape(-1).to("cpu")  # move first, then widen: TPU/MPS have no float64
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float32 if x.is_floating_point() else torch.float64)
    return flat_view(x.contiguous())


@np.errstate(over="ignore", invalid="ignore")  # overflows give inf as in the kernels
def small_pass(r: np.ndarray, t: np.ndarray, rtol: float, atol: float, tiny: float, unit: float,
               hist: np.ndarray) -> tuple | None:
    """``kernels.finite_pass`` of a chunk pair in numpy (``FIELDS``, ``max_index`` the first
    position of the largest error), ``hist`` filled the same way; None where a value is not
    finite or a sum of squares overflows (``kernels.general_pass`` then accounts for it position
    by position, as after ``finite_pass``)."""
    a = r.astype(np.float64)
    b = t.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    n = a.shape[0]
    e = b - a
    ae = np.abs(e)
    ar = np.abs(a)
    ae_bits = ae.view(np.int64)
    ar_bits = ar.view(np.int64)
    rr, tt = float((a * a).sum()), float((b * b).sum())  # not np.dot: BLAS threads cost more here
    if not (np.isfinite(rr) and np.isfinite(tt)):  # |values| near the top of float64: the
        return None  # reciprocal power of two is not normal there (general_pass divides)
    hist += np.bincount(ae_bits >> 52, minlength=HIST_BINS)
    i = int(np.argmax(ae))
    max_abs = float(ae[i])
    if unit > 0.0:
        floor_bits = np.maximum(ar_bits, np.array([tiny], np.float64).view(np.int64)[0])
        scaled = ae * (RECIPROCAL_BITS - (floor_bits & EXPONENT_BITS)).view(np.float64)
        max_ulp = float(scaled.max()) / unit
    else:
        max_ulp = max_abs
    return (n, n, n, float(ae.sum()), float((e * e).sum()), rr, tt, float((a * b).sum()), rr, tt,
            max_abs, max_ulp, int(np.count_nonzero(ae > atol + rtol * ar)), float(ar.max()),
            int(np.count_nonzero(ae == 0.0)), 0, 0, 0, 0, 0, 0, i if max_abs > 0.0 else -1)

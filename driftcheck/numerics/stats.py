"""Per-tensor summary statistics computed on the tensor's own device, without a host sync.

The stats of many tensors are stacked into one small tensor so a step needs one transfer.
"""
from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from driftcheck.numerics import chunks, passes

# Column order of the stats vector; the manifest stores them under these names.
FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel")
# fp8 tensors only (NaN columns otherwise, dropped from the manifest): elements flushed into the
# subnormal range (nonzero, below the smallest normal: precision lost) and elements saturated at
# the largest finite value (overflow clamped by the cast).
FP8_FIELDS = ("fp8_underflow", "fp8_overflow")
COLUMNS = FIELDS + FP8_FIELDS
_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                             "float8_e5m2fnuz") if hasattr(torch, n))


def acc_dtype(device: torch.device) -> torch.dtype:
    # float64 where the backend supports it; TPUs and MPS do not, float32 is enough for a summary.
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def stats_vector(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of len(COLUMNS) on ``t``'s device: stats over the finite values of ``t``."""
    return torch.cat([_base_stats(t), _fp8_stats(t)])


def _fp8_stats(t: torch.Tensor) -> torch.Tensor:
    acc = acc_dtype(t.device)
    if t.dtype not in _FP8:
        return torch.full((len(FP8_FIELDS),), float("nan"), dtype=acc, device=t.device)
    fi = torch.finfo(t.dtype)
    a = t.detach().reshape(-1).float().abs()  # every fp8 value is exact in float32
    under = ((a > 0) & (a < fi.tiny)).sum().to(acc)
    over = (a == fi.max).sum().to(acc)
    return torch.stack([under, over])


def _base_stats(t: torch.Tensor) -> torch.Tensor:
    acc = acc_dtype(t.device)
    nan_count = inf_count = None
    if t.is_complex():
        # Counted on the complex values (a NaN in either part is a NaN, even where |z| = inf
        # by C99's hypot), summarised by magnitude.
        nan_mask = torch.isnan(t)
        nan_count = nan_mask.sum().to(acc)
        inf_count = (torch.isinf(t) & ~nan_mask).sum().to(acc)
        t = t.abs()
    x = t.detach().reshape(-1).to(acc)
    n = x.numel()
    if n == 0:
        nan = torch.tensor(float("nan"), dtype=acc, device=t.device)
        zero = torch.zeros((), dtype=acc, device=t.device)
        return torch.stack([nan, nan, nan, nan, nan, zero, zero, zero, zero])
    finite = torch.isfinite(x)
    count = finite.sum().to(acc)
    xz = torch.where(finite, x, torch.zeros((), dtype=acc, device=x.device))
    safe = torch.clamp(count, min=1)
    mean = xz.sum() / safe
    var = torch.where(finite, (x - mean) ** 2, torch.zeros((), dtype=acc, device=x.device)).sum() / safe
    inf = torch.tensor(float("inf"), dtype=acc, device=x.device)
    mn = torch.where(finite, x, inf).min()
    mx = torch.where(finite, x, -inf).max()
    nofinite = count == 0
    nanv = torch.tensor(float("nan"), dtype=acc, device=x.device)
    return torch.stack([
        torch.where(nofinite, nanv, mn), torch.where(nofinite, nanv, mx),
        torch.where(nofinite, nanv, mean), torch.where(nofinite, nanv, var.sqrt()),
        xz.abs().max(), torch.linalg.vector_norm(xz),
        torch.isnan(x).sum().to(acc) if nan_count is None else nan_count,
        torch.isinf(x).sum().to(acc) if inf_count is None else inf_count,
        torch.tensor(float(n), dtype=acc, device=x.device),
    ])


def to_dict(vec: list[float]) -> dict[str, float | int | None]:
    """Host-side stats vector -> manifest dict (counts as ints)."""
    mn, mx, mean, std, absmax, l2, nan, inf, numel = vec[:9]
    if math.isfinite(mn + mx + mean + std + absmax + l2):  # the common case, one test
        d: dict[str, float | int | None] = {
            "min": mn, "max": mx, "mean": mean, "std": std, "absmax": absmax, "l2": l2}
    else:  # no finite value (all NaN, zero-size): no min/max/mean/std, null in the manifest
        d = {name: (float(v) if math.isfinite(v) else None)
             for name, v in zip(FIELDS[:6], (mn, mx, mean, std, absmax, l2))}
    d["nan"], d["inf"], d["numel"] = int(nan), int(inf), int(numel)
    for name, v in zip(FP8_FIELDS, vec[9:]):
        if v == v:  # NaN: not an fp8 tensor
            d[name] = int(v)
    return d


# -- many tensors at once ---------------------------------------------------------------------
SAMPLE_SIZE = 512  # elements kept per tensor in stats mode, at the same indices on both runs
GROUP_ELEMS = 1 << 22  # elements summarised together: bounds the float64 working memory
BIG = 1 << 16  # host tensors this large are summarised one by one, without a float64 copy


def sample_indices(key: str, numel: int, seed: int) -> np.ndarray:
    """Flat indices of the stats-mode sample of a tensor: a function of (key, numel, seed) only,
    so two runs sample the same positions. One uniform point set per seed, shifted per key
    (a Cranley-Patterson rotation): well spread, different for every key and step."""
    return _flat_sample_indices([key], [numel], np.zeros(1, dtype=np.int64), seed)


def part_positions(key: str, seed: int, logical: list[int], offset: list[int],
                   shape: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(j, local flat index) of a block of shape ``shape`` at ``offset`` in a logical tensor of
    shape ``logical``: which of the logical tensor's sample positions (``sample_indices(key,
    numel(logical))``) fall in the block, and where they are in it."""
    flat = sample_indices(key, math.prod(logical), seed)
    coords = np.unravel_index(flat, logical)
    inside = np.ones(flat.shape, dtype=bool)
    for d, (o, n) in enumerate(zip(offset, shape)):
        if o or n != logical[d]:
            inside &= (coords[d] >= o) & (coords[d] < o + n)
    j = np.nonzero(inside)[0]
    local = [c[j] - o for c, o in zip(coords, offset)]
    return j, (np.ravel_multi_index(tuple(local), shape) if j.size else j)


def sample_of(t: torch.Tensor, key: str, seed: int) -> torch.Tensor:
    """The stats-mode sample of ``t``: its flat elements at ``sample_indices``, on its device."""
    idx = torch.from_numpy(sample_indices(key, t.numel(), seed))
    return t.reshape(-1)[idx.to(t.device)]


def _flat_sample_indices(keys: list[str], lengths: list[int], offsets: np.ndarray,
                         seed: int) -> np.ndarray:
    """``sample_indices`` of many tensors, tensor i starting at ``offsets[i]`` in a flat
    buffer, concatenated, in one compiled pass: all of a tensor when it has at most
    SAMPLE_SIZE elements, else min(floor(((base + crc32(key) / 2^32) mod 1) * numel), numel - 1)
    over the seed's SAMPLE_SIZE uniform base points."""
    lengths_a = np.asarray(lengths, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    big = lengths_a > SAMPLE_SIZE
    out = np.empty((len(keys), SAMPLE_SIZE), dtype=np.int64)
    if big.any():
        kernels = compiled_kernels()
        shift = np.array([zlib.crc32(k.encode()) for k, b in zip(keys, big) if b]) / 2.0**32
        rows = np.empty((int(big.sum()), SAMPLE_SIZE), dtype=np.int64)
        kernels.sample_positions(base_points(seed), shift, lengths_a[big], offsets[big], rows)
        if big.all():
            return rows.reshape(-1)
        out[big] = rows
    parts = [out[i] if b else np.arange(n, dtype=np.int64) + o
             for i, (b, n, o) in enumerate(zip(big, lengths_a, offsets))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def base_points(seed: int) -> np.ndarray:
    return np.random.default_rng(seed & (2**63 - 1)).random(SAMPLE_SIZE)


def summarize(tensors: list[torch.Tensor], sample_keys: list[str | None], seed: int
              ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Stats rows (len(tensors), len(COLUMNS)) and samples (None where ``sample_keys`` is None)
    of many tensors, on their device, with a few kernels per group of same-dtype tensors rather
    than ~20 per tensor: the per-capture cost of stats mode is what makes it cheap or not."""
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    samples: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, (t, key) in enumerate(zip(tensors, sample_keys, strict=True)):
        if t.numel() >= BIG and t.device.type == "cpu" and t.dtype not in _FP8 and t.is_floating_point():
            rows[i] = _large_stats(t)
            if key is not None:
                samples[i] = large_sample(t, key, seed)
            continue
        if t.numel() == 0 or t.is_complex():
            rows[i] = stats_vector(t)
            if key is not None:
                samples[i] = sample_of(t, key, seed)
            continue
        groups.setdefault((t.device, t.dtype), []).append(i)
    for idxs in groups.values():
        start = 0
        while start < len(idxs):  # split so a group holds at most GROUP_ELEMS (or one tensor)
            end, n = start, 0
            while end < len(idxs) and (end == start or n + tensors[idxs[end]].numel() <= GROUP_ELEMS):
                n += tensors[idxs[end]].numel()
                end += 1
            part = idxs[start:end]
            try:
                got_rows, got_samples = _summarize_group([tensors[i] for i in part],
                                                         [sample_keys[i] for i in part], seed)
            except (RuntimeError, NotImplementedError):  # a backend without segment_reduce
                got_rows = [stats_vector(tensors[i]) for i in part]
                got_samples = [None if (key := sample_keys[i]) is None else
                               sample_of(tensors[i], key, seed) for i in part]
            for j, i in enumerate(part):
                rows[i], samples[i] = got_rows[j], got_samples[j]
            start = end
    if not tensors:
        return torch.zeros((0, len(COLUMNS)), dtype=torch.float64), []
    first = rows[0]
    return torch.stack([r.to(device=first.device, dtype=first.dtype) for r in rows]), samples  # type: ignore[union-attr]


HOST_DTYPES = (torch.float32, torch.float64)  # summarised on the host by compiled kernels


@functools.cache
def compiled_kernels():
    from driftcheck.numerics import summary_kernels  # numba: imported where it is used, once

    return summary_kernels


def _widen_bf16(x: np.ndarray, out: np.ndarray) -> None:
    compiled_kernels().widen_bf16(x, out)


def _widen_f16(x: np.ndarray, out: np.ndarray) -> None:
    compiled_kernels().widen_f16(x, out)


# narrow floats (their uint16 bits, passes.narrow_view) into float32, exactly
_WIDEN: dict[torch.dtype, Callable[[np.ndarray, np.ndarray], Any]] = {
    torch.bfloat16: _widen_bf16, torch.float16: _widen_f16}


def large_sample(t: torch.Tensor, key: str, seed: int) -> torch.Tensor:
    """``sample_of`` a large tensor: on the host for float32/float64, gathered by one compiled
    call from the array ``_large_stats`` reads (the same positions, bit for bit)."""
    if t.dtype not in (torch.float32, torch.float64) or t.device.type != "cpu":
        return sample_of(t, key, seed)
    x = compiled_kernels().flat_view(t.detach().contiguous())
    out = np.empty(SAMPLE_SIZE, dtype=x.dtype)
    compiled_kernels().gather_sample(x, base_points(seed), zlib.crc32(key.encode()) / 2.0**32, out)
    return torch.from_numpy(out)


def _large_stats(t: torch.Tensor) -> torch.Tensor:
    """One large host tensor in one compiled pass over its own dtype (float64 accumulation, no
    float64 copy). Any NaN/Inf shows in the sum or sum of squares, and then the masking float64
    path decides."""
    row = large_row(t)
    return stats_vector(t) if row is None else torch.from_numpy(row)


def large_row(t: torch.Tensor, into: torch.Tensor | None = None) -> np.ndarray | None:
    """``_large_stats`` as a float64 numpy row, or None where the values are not all finite (or
    float64 overflows): the caller takes the exact masking path. ``into`` (contiguous, the
    dtype and size of a float32/float64 ``t``): ``t`` is copied there in the same pass."""
    return _row(t, into, False)[0]


def copy_row(t: torch.Tensor, into: torch.Tensor) -> tuple[np.ndarray | None, int]:
    """``large_row(t, into)`` and the CRC32C of the copy's bytes, taken in the same pass (the
    trace's checksum of the copy: the writer need not read it again)."""
    row, value = _row(t, into, True)
    assert value is not None
    return row, value


def _row(t: torch.Tensor, into: torch.Tensor | None, checksum: bool) -> tuple[np.ndarray | None, int | None]:
    kernels = compiled_kernels()
    if into is not None:
        x = kernels.flat_view(into)
        s, sq, mn, mx, value = chunks.stats(kernels.copy_stats, kernels.flat_view(t), x, checksum)
    elif (x := passes.narrow_view(t)) is not None:
        # bfloat16/float16: widened a chunk at a time into a block kept per thread, not as a
        # whole float32 copy first (4 bytes an element of fresh memory to fault in: 8x slower)
        s, sq, mn, mx, value = chunks.stats(kernels.dense_stats, x, widen=_WIDEN[t.dtype])
    else:
        x = kernels.host_array(t)
        s, sq, mn, mx, value = chunks.stats(kernels.dense_stats, x)
    if not (math.isfinite(s) and math.isfinite(sq) and math.isfinite(mn) and math.isfinite(mx)):
        return None, value
    l2 = math.sqrt(sq)
    n = x.size
    mean = s / n
    var = sq / n - mean * mean
    if var > 1e-3 * mean * mean:
        std = math.sqrt(var)  # no cancellation to fear
    else:  # |mean| >> std: E[x^2] - mean^2 cancels; Welford's (in double) does not
        std = float(torch.std(torch.from_numpy(x) if x.dtype.kind == "f" and x.itemsize >= 4
                              else t.detach().reshape(-1).float(), correction=0))
    nan = math.nan
    return np.array([mn, mx, mean, std, max(abs(mn), abs(mx)), l2, 0.0, 0.0, float(n), nan, nan]), value


def summarize_one(t: torch.Tensor, key: str, seed: int) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
    """(stats row, sample) of one capture as ``summarize`` gives them; for a large float
    host tensor the row is a numpy array (no tensor built per capture: stats mode's cost)."""
    if t.numel() >= BIG and t.dtype in HOST_DTYPES and t.device.type == "cpu":
        row = large_row(t)
        if row is not None:
            return row, large_sample(t, key, seed)
    rows, samples = summarize([t], [key], seed)
    return rows[0], samples[0]  # type: ignore[return-value]


def _summarize_group(ts: list[torch.Tensor], keys: list[str | None], seed: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    dev, dtype = ts[0].device, ts[0].dtype
    acc = acc_dtype(dev)
    lengths = [t.numel() for t in ts]
    flat = torch.cat([t.detach().reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].detach().reshape(-1)
    samples: list[torch.Tensor | None] = [None] * len(ts)
    if any(k is not None for k in keys):
        sampled = [i for i, k in enumerate(keys) if k is not None]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        picks = _flat_sample_indices([k for k in keys if k is not None], [lengths[i] for i in sampled],
                                     offsets[sampled], seed)
        gathered = flat.index_select(0, torch.from_numpy(picks).to(dev))
        parts = iter(gathered.split([min(lengths[i], SAMPLE_SIZE) for i in sampled]))
        samples = [next(parts) if k is not None else None for k in keys]
    if dev.type == "cpu" and dtype not in _FP8 and flat.numel() > passes.SMALL_GROUP:
        # On the host: one compiled pass per tensor over the values as stored (widened in
        # registers), no float64 copy of the group and no masking passes. A small group takes
        # the torch ops below (float64 on the host): no numba import, no kernel compile.
        kernels = compiled_kernels()
        out = np.empty((len(ts), len(FIELDS)), dtype=np.float64)
        kernels.segment_stats(kernels.host_array(flat), np.asarray(lengths, dtype=np.int64), out)
        rows = torch.from_numpy(np.concatenate(
            [out, np.full((len(ts), len(FP8_FIELDS)), np.nan)], axis=1))
        return list(rows.unbind(0)), samples
    x = flat.to(acc)
    L = torch.tensor(lengths, device=dev)
    zero = torch.zeros((), dtype=acc, device=dev)
    inf = torch.tensor(float("inf"), dtype=acc, device=dev)

    def seg(v: torch.Tensor, how: str) -> torch.Tensor:
        return torch.segment_reduce(v, how, lengths=L)

    finite = torch.isfinite(x)
    count = seg(finite.to(acc), "sum")
    xz = torch.where(finite, x, zero)
    safe = torch.clamp(count, min=1)
    mean = seg(xz, "sum") / safe
    dev_ = torch.where(finite, x - torch.repeat_interleave(mean, L, output_size=x.numel()), zero)
    std = (seg(dev_ * dev_, "sum") / safe).sqrt()
    mn = seg(torch.where(finite, x, inf), "min")
    mx = seg(torch.where(finite, x, -inf), "max")
    nanv = torch.full_like(count, float("nan"))
    none = count == 0
    absx = xz.abs()
    cols = [torch.where(none, nanv, mn), torch.where(none, nanv, mx), torch.where(none, nanv, mean),
            torch.where(none, nanv, std), seg(absx, "max"), seg(xz * xz, "sum").sqrt(),
            seg(torch.isnan(x).to(acc), "sum"), seg(torch.isinf(x).to(acc), "sum"), L.to(acc)]
    if dtype in _FP8:
        fi = torch.finfo(dtype)
        cols += [seg(((absx > 0) & (absx < fi.tiny)).to(acc), "sum"), seg((absx == fi.max).to(acc), "sum")]
    else:
        cols += [nanv, nanv]
    return list(torch.stack(cols, dim=1).unbind(0)), samples


def warm(device: torch.device, params: list[torch.Tensor]) -> None:
    """Load (or compile) now the compiled kernels a record on the host calls, for the dtypes of
    ``params`` (float32/float64) and float32 (the loss, fp32 state), where a parameter has at
    least BIG elements: then its captures take the kernels in the first step, which would pay
    for it (numba's first call of a kernel per argument type loads it from the disk cache, ~0.5 s
    for the first with numba's own set-up, or compiles it: seconds). Nothing off the host or
    for a small model (no numba import). Tiny arrays of the callers' types (record/meta.py
    ``_col_sumsq``, record/watch.py ``_weighted_absmax``, the functions above)."""
    if device.type != "cpu" or not any(p.numel() >= BIG for p in params):
        return
    dtypes = {p.dtype for p in params}
    kernels = compiled_kernels()
    for dtype in sorted({torch.float32} | (set(dtypes) & set(HOST_DTYPES)), key=str):
        t = torch.linspace(-1.0, 1.0, 2 * SAMPLE_SIZE, dtype=dtype)
        large_row(t)
        large_row(t, into=torch.empty_like(t))
        large_sample(t, "warm", 0)
        x = kernels.flat_view(t)
        rows = np.empty((2, len(COLUMNS)), dtype=np.float64)  # (2 rows: a strided slice, as a block's)
        kernels.summarize_into(x, base_points(0), 0.5, rows[:, :len(FIELDS)],
                               np.empty((2, SAMPLE_SIZE), dtype=x.dtype), 0)  # record/host_summaries.py
        kernels.segment_stats(kernels.host_array(t), np.asarray([t.numel()], dtype=np.int64),
                              np.empty((1, len(FIELDS)), dtype=np.float64))
        kernels.col_sumsq(x, 16, np.empty(16, dtype=np.float64))
        kernels.weighted_absmax(x, 64, 40.0)
    for narrow in passes.NARROW:  # bfloat16/float16 captures (a narrow model, autocast)
        large_row(torch.linspace(-1.0, 1.0, 2 * SAMPLE_SIZE, dtype=narrow))
    wide = kernels.host_array(torch.arange(2 * SAMPLE_SIZE))  # integer and bool captures: float64
    kernels.dense_stats(wide)
    kernels.segment_stats(wide, np.asarray([wide.size], dtype=np.int64), np.empty((1, len(FIELDS)), dtype=np.float64))
    _flat_sample_indices(["warm"], [2 * SAMPLE_SIZE], np.zeros(1, dtype=np.int64), 0)

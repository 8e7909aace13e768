"""The host statistics of one large capture by dtype: what stats mode (and full mode's flush)
pays per capture of a bfloat16 or float16 tensor against a float32 one, and against the way
narrow floats were summarised before (the whole capture widened to a float32 copy first).

    python bench/narrow_stats.py [--threads 2] [--elements 16777216] [--repeats 7]

Each row times ``stats.summarize_one`` (the row and the sample a capture hook takes) on the
same values; "whole copy" is the previous path (``passes.host_array``: a fresh float32 tensor
of the capture, 4 bytes an element of new memory, then the same compiled pass). Interleaved,
the best of ``--repeats``; ratios in one run.
"""
from __future__ import annotations

import time

import _common as c  # noqa: E402  (sets sys.path)
import numpy as np
import torch

from driftcheck.numerics import chunks, stats


def _whole_copy(t: torch.Tensor) -> None:
    """The previous path: widen the whole capture, then the chunked compiled pass."""
    kernels = stats.compiled_kernels()
    chunks.stats(kernels.dense_stats, kernels.host_array(t))
    stats.sample_of(t, "k", 0)


def main() -> None:
    args = c.parse_args(__doc__, elements=dict(type=int, default=1 << 24, help="elements a capture"),
                        repeats=dict(type=int, default=7, help="timings a case (the best is kept)"))
    torch.manual_seed(0)
    base = torch.randn(args.elements)
    cases = {"float32": (base, lambda t: stats.summarize_one(t, "k", 0))}
    for name in ("bfloat16", "float16"):
        t = base.to(getattr(torch, name))
        cases[name] = (t, lambda t: stats.summarize_one(t, "k", 0))
        cases[f"{name}, whole copy"] = (t, _whole_copy)
    for t, fn in cases.values():
        fn(t)  # compiled kernels loaded
    best = {k: float("inf") for k in cases}
    for _ in range(args.repeats):
        for k, (t, fn) in cases.items():
            start = time.perf_counter()
            fn(t)
            best[k] = min(best[k], time.perf_counter() - start)
    f32 = best["float32"]
    rows = []
    for k, s in best.items():
        elements = cases[k][0].numel()
        before = best.get(f"{k}, whole copy")
        rows.append([k, f"{s * 1e3:.1f} ms", f"{elements / s / 1e9:.2f} G elements/s", f"{s / f32:.2f}x",
                     f"{before / s:.1f}x faster" if before else "-"])
    c.print_table([f"capture ({args.elements} elements, {torch.get_num_threads()} threads)", "best",
                   "rate", "vs float32", "vs whole copy"], rows)
    assert np.isfinite(f32)


if __name__ == "__main__":
    main()

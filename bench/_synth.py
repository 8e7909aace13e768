"""Synthetic traces for the compare and writer benchmarks: a few big float32 tensors."""
from __future__ import annotations

from pathlib import Path

import torch

from driftcheck.numerics import stats
from driftcheck.store import TraceWriter


def entry(i: int, t: torch.Tensor) -> dict:
    return {"key": f"0/forward/block{i}/0/output", "module": f"block{i}", "phase": "forward",
            "step": 0, "call": 0, "slot": "output", "order": i, "shape": list(t.shape),
            "dtype": "float32", "stats": stats.to_dict(stats.stats_vector(t).tolist()),
            "meta": {"kind": "elementwise", "module_type": "Synthetic"}}


def write_pair(ref: Path, tgt: Path, total_bytes: int, tensor_bytes: int,
               rel_noise: float = 2.0**-24) -> int:
    """A reference and a target trace of ``total_bytes`` each; the target is the reference with
    relative noise of ``rel_noise`` (fp32 rounding level). Returns the bytes per trace."""
    n = max(1, -(-total_bytes // tensor_bytes))  # at least total_bytes
    elems = tensor_bytes // 4
    g = torch.Generator().manual_seed(0)
    with TraceWriter(ref, force=True) as wr, TraceWriter(tgt, force=True) as wt:
        for i in range(n):
            r = torch.randn(elems // 1024, 1024, generator=g)
            t = torch.randn(r.shape, generator=g).mul_(rel_noise).mul_(r).add_(r)  # r (1 + e)
            wr.add(entry(i, r), r)
            wt.add(entry(i, t), t)
            del r, t
        wr.close({"steps": 1})
        wt.close({"steps": 1})
    return n * elems * 4

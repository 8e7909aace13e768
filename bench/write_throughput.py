"""Full-mode write throughput of the trace writer against the disk's own sequential write
bandwidth, both measured now on the same directory with the same byte count, fsync included.

    python bench/write_throughput.py [--quick] [--dir DIR] [--gb N]

Target: >= 70% of the disk's bandwidth.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import _common as c  # noqa: E402  (sets sys.path)
import torch

from driftcheck.store import TraceWriter
from _synth import entry


def write_trace(out: Path, tensors: list[torch.Tensor], entries: list[dict],
                background: bool) -> float:
    t0 = time.perf_counter()
    with TraceWriter(out, force=True, background=background) as w:
        for e, t in zip(entries, tensors):
            w.add(dict(e), t)
        w.close({"steps": 1})
    return time.perf_counter() - t0


def main() -> None:
    args = c.parse_args(__doc__,
                        dir=dict(default=".", help="where to write (the disk being measured)"),
                        gb=dict(type=float, default=None, help="bytes to write (default 2, quick 0.5)"))
    nbytes = int((args.gb or (0.5 if args.quick else 2.0)) * 1e9)
    tensor_bytes = 16 << 20  # activation-sized pieces, as a large model's step produces
    g = torch.Generator().manual_seed(0)
    # Distinct random tensors, generated before timing.
    tensors = [torch.randn(tensor_bytes // 4, generator=g) for _ in range(max(1, nbytes // tensor_bytes))]
    nbytes = len(tensors) * tensor_bytes
    entries = [entry(i, t) for i, t in enumerate(tensors)]  # statistics: not the writer's work
    rows = []
    with c.scratch(args.dir) as tmp:
        repeats = 2 if args.quick else 3
        best = {"disk": 0.0, "background": 0.0, "foreground": 0.0}
        for _ in range(repeats):  # interleaved, best of: the disk is shared
            best["disk"] = max(best["disk"], c.disk_write_bandwidth(tmp, tensors))
            for mode in ("background", "foreground"):
                dt = write_trace(tmp / mode, tensors, entries, mode == "background")
                best[mode] = max(best[mode], nbytes / dt)
                shutil.rmtree(tmp / mode)
        for mode in ("background", "foreground"):
            ratio = best[mode] / best["disk"]
            rows.append([f"TraceWriter ({mode} writer)", c.gb(nbytes), f"{best[mode] / 1e6:.0f} MB/s",
                         f"{best['disk'] / 1e6:.0f} MB/s", f"{ratio:.0%}",
                         (">= 70% " + ("met" if ratio >= 0.7 else "MISSED")) if mode == "background" else "-"])
            print(rows[-1], flush=True)
    c.print_table(["writer", "bytes", "trace write", "disk (dd, fsync)", "ratio", "target"], rows)


if __name__ == "__main__":
    main()

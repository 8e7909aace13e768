"""Compare throughput (bytes of both traces per second) against memcpy bandwidth, both measured
now on this machine.

    python bench/compare_throughput.py [--quick] [--gb N] [--workers N]

Two synthetic traces of float32 tensors (the target the reference plus fp32-level noise) are
written, then compared in this process: every element of both read from the memory-mapped
shards and measured in float64. Once with 64 MiB tensors (pairs measured side by side), once
with a single tensor of the whole size (measured in parts side by side). Target: >= 25% of
memcpy bandwidth with the default two workers, memcpy measured on as many threads as compare
has workers (the one-worker rows show what threads add).
"""
from __future__ import annotations

import time

import _common as c  # noqa: E402  (sets sys.path)
import torch

from _synth import write_pair
from driftcheck.compare import Comparison
from driftcheck.store import TraceReader


def main() -> None:
    args = c.parse_args(__doc__,
                        gb=dict(type=float, default=None, help="bytes per trace (default 1, quick 0.25)"),
                        workers=dict(default="1,2", help="compare threads to try"))
    nbytes = int((args.gb or (0.25 if args.quick else 1.0)) * 1e9)
    rows = []
    with c.scratch(".") as tmp:
        # Many 64 MiB tensors (pairs measured side by side), then one tensor of the whole size
        # (measured in parts side by side).
        for label, tensor_bytes in (("64 MiB tensors", 64 << 20), ("one tensor", nbytes)):
            per_trace = write_pair(tmp / "ref", tmp / "tgt", nbytes, tensor_bytes)
            # Untimed: loads (or compiles) the kernels and warms the page cache.
            Comparison(TraceReader(tmp / "ref"), TraceReader(tmp / "tgt")).run()
            for w in (int(x) for x in args.workers.split(",")):
                # memcpy on as many threads as compare has workers: like against like.
                threads = torch.get_num_threads()
                torch.set_num_threads(w)
                memcpy = c.memcpy_bandwidth()
                torch.set_num_threads(threads)
                best = float("inf")
                for _ in range(1 if args.quick else 3):
                    t0 = time.perf_counter()
                    rep = Comparison(TraceReader(tmp / "ref"), TraceReader(tmp / "tgt"),
                                     workers=w).run()
                    best = min(best, time.perf_counter() - t0)
                assert rep.verdict == "pass", rep.decided_by
                bw = 2 * per_trace / best
                ratio = bw / memcpy
                target = ">= 25% " + ("met" if ratio >= 0.25 else "MISSED") if w > 1 else "-"
                rows.append([f"{label}, {w} worker(s)", c.gb(2 * per_trace), f"{best:.2f} s",
                             f"{bw / 1e6:.0f} MB/s", f"{memcpy / 1e6:.0f} MB/s", f"{ratio:.1%}",
                             target])
                print(rows[-1], flush=True)
    c.print_table(["compare", "bytes read", "time", "throughput", "memcpy", "ratio",
                   "target"], rows)


if __name__ == "__main__":
    main()

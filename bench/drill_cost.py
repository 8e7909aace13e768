"""What the local replay (on by default) and the drill-down cost, measured in one run.

For the tiny Llama and its 16M configuration: a full-mode target record replaying a reference,
without and with the local replay (every leaf module rerun on the reference's inputs), the
ratio of the two; and one drill of a middle MLP's backward against the target record's time.
Median of ``--repeats``, each pair measured back to back.

    python bench/drill_cost.py [--quick] [--threads 2]
"""
from __future__ import annotations

import statistics
import tempfile
import time

from _common import llama_scenario, parse_args, print_table, scratch

from driftcheck.drill import drill
from driftcheck.drill.side import Point
from driftcheck.record.runner import record


def main() -> None:
    args = parse_args(__doc__, repeats=dict(type=int, default=3, help="measurements per row"))
    sizes = ("tiny",) if args.quick else ("tiny", "16m")
    rows = []
    with scratch(tempfile.gettempdir()) as work:
        for size in sizes:
            ref = record(llama_scenario(size, 2), work / f"{size}-ref", force=True, model_id=size)
            plain, local, drills = [], [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                record(llama_scenario(size, 2), work / f"{size}-t", dtype="bf16", force=True, replay=ref)
                t1 = time.perf_counter()
                tgt = record(llama_scenario(size, 2), work / f"{size}-l", dtype="bf16", force=True,
                             replay=ref, local=ref)
                t2 = time.perf_counter()
                drill(ref, tgt, point=Point("layers.1.mlp", 1, 0, "backward"),
                      scenario=lambda: llama_scenario(size, 2))
                t3 = time.perf_counter()
                plain.append(t1 - t0)
                local.append(t2 - t1)
                drills.append(t3 - t2)
            p, lo, d = (statistics.median(x) for x in (plain, local, drills))
            rows.append([size, f"{p:.2f} s", f"{lo:.2f} s", f"{lo / p:.2f}x", f"{d:.2f} s", f"{d / p:.2f}x"])
    print_table(["model", "target record", "with local replay", "ratio", "one drill (in process)",
                 "drill / record"], rows)


if __name__ == "__main__":
    main()

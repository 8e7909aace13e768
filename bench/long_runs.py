"""Long runs: the cost of a long record per step against the untraced step, its bytes per step,
and the time to compare 10,000 steps.

    python bench/long_runs.py                 # tiny Llama (300 steps) and the 16M one (40 steps)
    python bench/long_runs.py --sizes tiny

Per size, in one run: the untraced training loop (the same batches, optimizer and dtype) timed
right before the long record of the same steps (driftcheck/record/long.py, sampling every 10
steps, a replay point every 50), both with torch threads 1; the ratio is long / untraced, each
the best of --repeats. Bytes per step: the columns (long.safetensors + long.json) over the steps;
the replay points are listed apart (one model + optimizer state each). Compare: three long traces
of 10,000 steps (reference, target, control: synthetic columns of the 16M run's shapes, written
by driftcheck/store/long.py) judged by compare_long.
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import _common
import torch

from driftcheck.compare.long import compare_long
from driftcheck.record.long import SAMPLE_SIZE, record_long
from driftcheck.scenario import call_model
from driftcheck.store.long import write_long

STEPS = {"tiny": 300, "16m": 40}


def plain(sc, steps: int) -> float:
    model = copy.deepcopy(sc.model)
    opt = sc.optimizer(model.parameters())
    t0 = time.perf_counter()
    for i in range(steps):
        batch = sc.batch(i)
        loss = sc.loss(call_model(model, batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def traced(sc, steps: int, out: Path) -> float:
    t0 = time.perf_counter()
    record_long(copy.deepcopy(sc), out, steps=steps, every=10, points_every=50, force=True)
    return time.perf_counter() - t0


def main() -> int:
    args = _common.parse_args(__doc__, sizes={"default": "tiny,16m"}, repeats={"type": int, "default": 2})
    torch.set_num_threads(1)
    rows = []
    with _common.scratch() as tmp:
        for size in args.sizes.split(","):
            n = STEPS[size]
            sc = _common.llama_scenario(size, steps=n)
            plain(sc, 3)  # warm up
            base = min(plain(sc, n) for _ in range(args.repeats))
            long_t = min(traced(sc, n, tmp / f"long-{size}") for _ in range(args.repeats))
            cols = sum(p.stat().st_size for p in (tmp / f"long-{size}").glob("long.*"))
            points = sorted((tmp / f"long-{size}" / "points").glob("*.safetensors"))
            rows.append([size, _common.params(sc.model), n, f"{base / n * 1e3:.1f}", f"{long_t / n * 1e3:.1f}",
                         f"{long_t / base:.3f}x", f"{cols / n / 1024:.1f}",
                         f"{len(points)} x {points[0].stat().st_size / 2**20:.1f} MiB" if points else "-"])
        _common.print_table(["model", "params", "steps", "untraced ms/step", "long ms/step", "ratio",
                             "KiB/step", "replay points"], rows)
        # compare 10,000 steps: columns of the 16M run's shapes
        n, every = 10_000, 10
        modules = 90
        g = torch.Generator().manual_seed(0)
        k = len(range(0, n, every)) + 1
        base_sample = torch.randn(k, SAMPLE_SIZE, generator=g)
        runs = {}
        for name, scale in (("ref", 0.0), ("tgt", 1e-3), ("ctl", 1e-3)):
            out = tmp / f"c-{name}"
            out.mkdir()
            cols = {c: torch.rand(n, generator=g, dtype=torch.float64) for c in
                    ("loss", "grad_norm", "update_norm", "param_norm")}
            cols["sample_steps"] = torch.tensor(sorted(set(range(0, n, every)) | {n - 1}), dtype=torch.float64)
            cols["param_sample"] = base_sample + scale * torch.randn(k, SAMPLE_SIZE, generator=g)
            cols["module_rms"] = 1 + scale * torch.rand(k, modules, generator=g, dtype=torch.float64)
            write_long(out, {"steps": n, "every": every, "replay_id": "bench", "dtype": "float32",
                             "modules": [f"m{i}" for i in range(modules)]}, cols, [])
            runs[name] = out
        t0 = time.perf_counter()
        rep = compare_long(runs["ref"], runs["tgt"], runs["ctl"])
        secs = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in runs["ref"].glob("long.*"))
        print(f"\ncompare of {n} steps (sampled every {every}, {modules} modules, a {SAMPLE_SIZE}-element "
              f"parameter sample): {secs:.2f} s, verdict {rep.verdict}; {size / 2**20:.1f} MiB per long trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())

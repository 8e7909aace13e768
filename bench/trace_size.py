"""Trace size per capture mode: shards, manifest and total, per training step.

    python bench/trace_size.py [--quick] [--sizes tiny,16m]

Also the size of one step's captured tensors relative to the model's parameter bytes, the unit a
user can reason about (full mode stores parameters, gradients, optimizer state and activations).
"""
from __future__ import annotations

import shutil

import _common as c  # noqa: E402  (sets sys.path)

from record_overhead import MODES, run_once


def main() -> None:
    args = c.parse_args(__doc__, sizes=dict(default="tiny,16m", help="models: tiny, 16m"))
    steps = 1 if args.quick else 2
    rows = []
    with c.scratch(".") as tmp:
        for size in args.sizes.split(","):
            sc = c.llama_scenario(size, steps)
            pbytes = c.params(sc.model) * 4
            for name, mode in MODES.items():
                run_once(sc, sc.model, mode, tmp / name)
                shards = sum(p.stat().st_size for p in (tmp / name).glob("shard-*"))
                manifest = (tmp / name / "manifest.json").stat().st_size
                rows.append([f"llama-{size} ({c.params(sc.model) / 1e6:.1f}M)", name,
                             f"{shards / steps / 1e6:.2f} MB", f"{manifest / steps / 1e6:.2f} MB",
                             f"{(shards + manifest) / steps / 1e6:.2f} MB",
                             f"{(shards + manifest) / steps / pbytes:.2f}x"])
                print(rows[-1], flush=True)
                shutil.rmtree(tmp / name)
    c.print_table(["model", "mode", "shards / step", "manifest / step", "total / step",
                            "total / parameter bytes"], rows)


if __name__ == "__main__":
    main()

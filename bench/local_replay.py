"""Why the local replay is on by default: a small fault that a plain compare lets through.

A x1.05 output fault on the middle MLP down-projection of hf:llama (the tiny config, bf16 target),
compared without and with the local replay, next to a clean bf16 target both ways.

    python bench/local_replay.py [--model hf:llama] [--factor 1.05]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from driftcheck.targets import faults
from driftcheck.compare import compare
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf:llama")
    ap.add_argument("--factor", type=float, default=1.05)
    args = ap.parse_args()
    torch.set_num_threads(2)
    sc = load_scenario(args.model)
    mods = [n for n, _ in sc.model.named_modules() if n.endswith("mlp.down_proj")]
    site = mods[len(mods) // 2]
    print(f"{args.model}: {sum(p.numel() for p in sc.model.parameters())} parameters, fault x{args.factor} "
          f"on {site}")
    print("| target | compare | verdict | worst ratio | the site's ratio | its local ratio |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        ref = record(load_scenario(args.model), Path(tmp) / "ref", force=True, model_id=args.model)
        for name, fault in (("clean bf16", None), (f"x{args.factor} bf16", lambda: faults.scale_output(site, args.factor))):
            for local in (False, True):
                tgt = record(load_scenario(args.model), Path(tmp) / f"{name}-{local}", dtype="bf16",
                             force=True, replay=ref, local=ref if local else None,
                             target_hooks=fault() if fault else None, model_id=args.model)
                rep = compare(ref, tgt)
                worst = max(e.ratio for e in rep.entries if e.ratio is not None and e.ratio < float("inf"))
                e = next(x for x in rep.entries if x.module == site and x.phase == "forward"
                         and x.slot == "output" and x.step == 0)
                lr = f"{e.local_ratio:.3g}" if e.local_ratio is not None else "-"
                print(f"| {name} | {'local replay' if local else 'plain'} | {rep.verdict} | {worst:.3g} | "
                      f"{e.ratio:.3g} | {lr} |")


if __name__ == "__main__":
    main()

"""The tied-weight finding on the clean corpus: for every architecture of bench/zoo.py, the alias
structure of a fresh fp32 build against another fresh build converted to bf16 (what a clean
control's target is), through compare's own rule; alias.sharing_differs must never fire.

    python bench/alias_corpus.py             # all 161 architectures, ~4 min on 2 cores
    python bench/alias_corpus.py --limit 5
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import zoo  # noqa: E402

from driftcheck.compare.aliasing import sharing_findings  # noqa: E402
from driftcheck.record.aliases import alias_groups  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="the first N architectures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cat = list(zoo._catalogue().items())[: args.limit or None]
    shared = fired = failed = 0
    for name, (_family, build) in cat:
        try:
            a, b = build().model, build().model.to(torch.bfloat16)
        except Exception as e:  # an architecture that cannot be built is listed, not counted
            failed += 1
            print(f"{name}: could not build: {str(e).splitlines()[0][:100]}")
            continue
        ga, gb = alias_groups(a), alias_groups(b)
        shared += bool(ga)
        found = sharing_findings({"aliases": ga}, {"aliases": gb})
        if found:
            fired += 1
            print(f"{name}: FIRED {[f.message[:120] for f in found]}")
    print(f"architectures {len(cat)}, with shared tensors {shared}, finding fired {fired}, not built {failed}")
    return 1 if fired else 0


if __name__ == "__main__":
    sys.exit(main())

"""How long the README's demo takes, against one ``import torch`` on the same machine: the first
ten minutes of a newcomer (issue 45's target: the demo at most 4x one ``import torch``).

Each round runs, one after the other, ``python -c "import torch"`` and the README's demo
(``driftcheck --quiet run llama --reference cpu --target cpu --target-dtype bf16``) in fresh
processes, so both meet the same machine load; the medians and their ratio are printed. One more
demo runs with an empty numba cache (``NUMBA_CACHE_DIR``): a first run on a fresh install, whose
kernels compile once and are cached beside the package after it.

    python bench/demo_time.py              # 3 rounds and the cold run
    python bench/demo_time.py --rounds 5 --no-cold

Prints the demo's own account of its sides too (``recorded reference: ... in X s``): the
reference records first; the target starts with it (its imports and model build overlap the
reference's record) and records once the reference is complete; the compare and reports follow.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ["run", "llama", "--reference", "cpu", "--target", "cpu", "--target-dtype", "bf16", "--force"]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0,):
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return seconds, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (import torch, demo); default 3")
    ap.add_argument("--no-cold", action="store_true", help="skip the run with an empty numba cache")
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="driftcheck-demo-") as tmp:
        out = str(Path(tmp) / "run")
        demo = [py, "-m", "driftcheck", "--quiet", *DEMO, "--out", out]
        timed(demo)  # warm the numba cache and the OS's file cache once, untimed
        torch_s, demo_s = [], []
        for r in range(args.rounds):
            t, _ = timed([py, "-c", "import torch"])
            torch_s.append(t)
            d, _ = timed(demo)
            demo_s.append(d)
            print(f"round {r + 1}: import torch {t:.2f} s, demo {d:.2f} s ({d / t:.1f}x)", flush=True)
        _, told = timed([py, "-m", "driftcheck", *DEMO, "--out", out, "--no-html"])
        for line in told.splitlines():
            if line.startswith("recorded "):
                print("  " + line)
        it, dm = statistics.median(torch_s), statistics.median(demo_s)
        print(f"median: import torch {it:.2f} s, demo {dm:.2f} s: the demo is {dm / it:.1f}x one import torch")
        if not args.no_cold:
            env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(tmp) / "numba-cache"))
            c, _ = timed(demo, env)
            t, _ = timed([py, "-c", "import torch"])
            print(f"cold numba cache (a first run): demo {c:.2f} s, import torch {t:.2f} s ({c / t:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long the README's demo takes, against one ``import torch`` on the same machine: the first
ten minutes of a newcomer (issue 45's target: the demo at most 4x one ``import torch``).

Each round runs, one after the other, ``python -c "import torch"`` and the README's demo
(``driftcheck --quiet run llama --reference cpu --target cpu --target-dtype bf16``) in fresh
processes, so both meet the same machine load; the medians and their ratio are printed, in wall
time and in CPU time (user + system of every process the command started: what a loaded machine
changes least). ``--before CHECKOUT`` runs an older checkout's demo in the same rounds
(``PYTHONPATH=CHECKOUT``; its ``driftcheck/models`` must exist), for a before/after in one run.
One more demo runs with an empty numba cache (``NUMBA_CACHE_DIR``): a first run on a fresh
install.

    python bench/demo_time.py                              # 3 rounds and the cold run
    python bench/demo_time.py --rounds 5 --before /tmp/old-checkout

Prints the demo's own account of its sides too (``recorded reference: ... in X s``): the
reference records first; the target starts with it (its imports and model build overlap the
reference's record) and records once the reference is complete; the compare and reports follow.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CWD = tempfile.gettempdir()  # not ROOT: ``python -m`` would import the package there, not PYTHONPATH's
DEMO = ["run", "llama", "--reference", "cpu", "--target", "cpu", "--target-dtype", "bf16", "--force"]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the command's processes, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=CWD, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (import torch, demo); default 3")
    ap.add_argument("--before", default=None, help="an older checkout whose demo runs in the same rounds")
    ap.add_argument("--no-cold", action="store_true", help="skip the run with an empty numba cache")
    args = ap.parse_args()
    py = sys.executable
    here = dict(os.environ, PYTHONPATH=str(ROOT))
    old = dict(os.environ, PYTHONPATH=str(Path(args.before).resolve())) if args.before else None
    with tempfile.TemporaryDirectory(prefix="driftcheck-demo-") as tmp:
        demo = [py, "-m", "driftcheck", "--quiet", *DEMO, "--out", str(Path(tmp) / "run")]
        timed(demo, here)  # warm the numba cache and the OS's file cache once, untimed
        if old is not None:
            timed(demo, old)
        rows: dict[str, list[tuple[float, float]]] = {"import torch": [], "demo": [], "demo before": []}
        for r in range(args.rounds):
            rows["import torch"].append(timed([py, "-c", "import torch"])[:2])
            rows["demo"].append(timed(demo, here)[:2])
            if old is not None:
                rows["demo before"].append(timed(demo, old)[:2])
            line = ", ".join(f"{k} {v[-1][0]:.2f} s ({v[-1][1]:.2f} s CPU)" for k, v in rows.items() if v)
            print(f"round {r + 1}: {line}", flush=True)
        told = timed([py, "-m", "driftcheck", *DEMO, "--out", str(Path(tmp) / "run"), "--no-html"], here)[2]
        for line in told.splitlines():
            if line.startswith("recorded "):
                print("  " + line)
        base_wall = statistics.median(w for w, _ in rows["import torch"])
        base_cpu = statistics.median(c for _, c in rows["import torch"])
        for name in ("demo", "demo before"):
            if rows[name]:
                wall = statistics.median(w for w, _ in rows[name])
                cpu = statistics.median(c for _, c in rows[name])
                print(f"median {name}: {wall:.2f} s wall = {wall / base_wall:.1f}x one import torch "
                      f"({base_wall:.2f} s); {cpu:.2f} s CPU = {cpu / base_cpu:.1f}x ({base_cpu:.2f} s)")
        if not args.no_cold:
            env = dict(here, NUMBA_CACHE_DIR=str(Path(tmp) / "numba-cache"))
            c = timed(demo, env)[0]
            t = timed([py, "-c", "import torch"])[0]
            print(f"cold numba cache (a first run): demo {c:.2f} s, import torch {t:.2f} s ({c / t:.1f}x)")
            if old is not None:
                env = dict(old, NUMBA_CACHE_DIR=str(Path(tmp) / "numba-cache-before"))
                c = timed(demo, env)[0]
                print(f"cold numba cache, before: demo {c:.2f} s ({c / t:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

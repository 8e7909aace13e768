"""Peak resident memory of ``driftcheck compare`` on a large trace: a few big tensors.

    python bench/compare_memory.py [--quick] [--gb N]

Writes a reference trace of N GB (default 4; quick 1) and a perturbed copy with the
TraceWriter, runs ``driftcheck compare`` on them in a child process, and reads the child's peak
RSS from the kernel (wait4's rusage; file pages mapped and touched count as resident too).
Target: <= 1 GB on a 4 GB trace.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as c  # noqa: E402  (sets sys.path)

from _synth import write_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(ap)
    ap.add_argument("--gb", type=float, default=None, help="bytes per trace (default 4, quick 1)")
    ap.add_argument("--dir", default=".", help="where to write the traces")
    args = ap.parse_args()
    c.setup(args)
    nbytes = int((args.gb or (1.0 if args.quick else 4.0)) * 1e9)
    tmp = Path(tempfile.mkdtemp(prefix="dc-bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        per_trace = write_pair(tmp / "ref", tmp / "tgt", nbytes, 1 << 30 if nbytes >= 4e9 else 256 << 20)
        print(f"wrote 2 x {c.gb(per_trace)} in {time.perf_counter() - t0:.1f} s", flush=True)
        cmd = [sys.executable, "-m", "driftcheck", "--quiet", "compare", str(tmp / "ref"),
               str(tmp / "tgt"), "--json", str(tmp / "report.json")]
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=str(args.threads))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        rc = os.waitstatus_to_exitcode(status)
        peak = usage.ru_maxrss * 1024  # KiB on Linux
        # The floor of any compare: Python + torch imported, nothing read.
        base = subprocess.Popen([sys.executable, "-c", "import torch, driftcheck.compare"], env=env)
        _, _, u0 = os.wait4(base.pid, 0)
        ok = peak <= 1e9
        rows = [[c.gb(per_trace), f"{rc}", f"{dt:.1f} s", f"{peak / 1e6:.0f} MB",
                 f"{u0.ru_maxrss * 1024 / 1e6:.0f} MB", f"{peak / per_trace:.1%}",
                 "<= 1 GB " + ("met" if ok else "MISSED")]]
        print(rows[0])
        print()
        print(c.markdown_table(["trace size", "exit", "compare time", "peak RSS",
                                "RSS of import torch", "peak / trace", "target"], rows))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Peak resident memory of ``driftcheck compare`` on a large trace: a few big tensors.

    python bench/compare_memory.py [--quick] [--gb N]

Writes a reference trace of N GB (default 4; quick 1) and a perturbed copy with the
TraceWriter, runs ``driftcheck compare`` on them in a child process, and reads the child's peak
RSS (VmHWM: file pages mapped and touched count as resident too).
Target: <= 1 GB on a 4 GB trace.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import _common as c  # noqa: E402  (sets sys.path)

from _synth import write_pair


def main() -> None:
    args = c.parse_args(__doc__,
                        gb=dict(type=float, default=None, help="bytes per trace (default 4, quick 1)"),
                        dir=dict(default=".", help="where to write the traces"))
    nbytes = int((args.gb or (1.0 if args.quick else 4.0)) * 1e9)
    with c.scratch(args.dir) as tmp:
        t0 = time.perf_counter()
        per_trace = write_pair(tmp / "ref", tmp / "tgt", nbytes, 1 << 30 if nbytes >= 4e9 else 256 << 20)
        print(f"wrote 2 x {c.gb(per_trace)} in {time.perf_counter() - t0:.1f} s", flush=True)
        # The child reports its own peak (VmHWM of /proc/self/status): rusage's ru_maxrss would
        # carry this process's peak over fork and exec, and this process held the tensors.
        probe = ("import atexit, re, sys\n"
                 "def hwm():\n"
                 "    kb = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
                 "    sys.stderr.write(f'VmHWM {kb}\\n')\n"
                 "atexit.register(hwm)\n")
        run_cli = probe + "from driftcheck.cli import main\nmain(sys.argv[1:])\n"
        cmd = [sys.executable, "-c", run_cli, "--quiet", "compare", str(tmp / "ref"),
               str(tmp / "tgt"), "--json", str(tmp / "report.json")]
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=str(args.threads))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        dt = time.perf_counter() - t0
        rc = proc.returncode

        def peak_of(stderr: str) -> int:
            return int(stderr.rsplit("VmHWM ", 1)[1].split()[0]) * 1024

        peak = peak_of(proc.stderr)
        # The floor of any compare: Python with torch and driftcheck imported, nothing read.
        base = peak_of(subprocess.run([sys.executable, "-c", probe + "import driftcheck.compare, torch"],
                                      env=env, stderr=subprocess.PIPE, text=True).stderr)
        ok = peak <= 1e9
        rows = [[c.gb(per_trace), f"{rc}", f"{dt:.1f} s", f"{peak / 1e6:.0f} MB",
                 f"{base / 1e6:.0f} MB", f"{peak / per_trace:.1%}",
                 "<= 1 GB " + ("met" if ok else "MISSED")]]
        print(rows[0])
        c.print_table(["trace size", "exit", "compare time", "peak RSS",
                                "RSS of import torch", "peak / trace", "target"], rows)


if __name__ == "__main__":
    main()

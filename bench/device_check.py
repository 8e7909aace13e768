"""The GPU check: a CPU reference against a CUDA target, on a machine with a CUDA GPU.

    python bench/device_check.py --out /tmp/dc            # ~5 min on one GPU; needs CUDA
    python bench/device_check.py --out /tmp/dc --quick    # mlp and llama, fp32 and bf16 only

One prepared script, run where a GPU is lent (CI never has one): `driftcheck run MODEL
--reference cpu --target cuda` for the built-ins and two hf: families, with the target in fp32
and in bf16, then the tests marked `cuda` (`pytest -m cuda`). Each run is a real comparison of two
backends: CPU kernels against cuBLAS/cuDNN (TF32 off unless the target's settings turn it on;
the report names any precision setting that differs). It prints one Markdown table (model,
target dtype, verdict, worst ratio and where, first divergence, seconds) and writes it with the
raw results to OUT (device_check.md, device_check.json, each run's report.json/html) for
docs/measurements.md. Exit 0 when every run finished (a fail verdict is a finding, not an error
of the script), 1 when a run crashed or the cuda tests failed, 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = ["mlp", "resnet", "llama", "vit", "hf:llama", "hf:vit"]
QUICK = ["mlp", "llama"]
DTYPES = ["fp32", "bf16"]


def _cuda_ok() -> str | None:
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() or None


def _one(model: str, dtype: str, out: Path) -> dict:
    d = out / f"{model.replace(':', '_')}-{dtype}"
    cmd = [sys.executable, "-m", "driftcheck", "--quiet", "run", model, "--reference", "cpu", "--target", "cuda",
           "--target-dtype", dtype, "--out", str(d), "--force"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"model": model, "dtype": dtype, "rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "command": " ".join(cmd[2:])}
    report = d / "report.json"
    if report.is_file():
        rep = json.loads(report.read_text())
        judged = [e for e in rep.get("entries", []) if isinstance(e.get("ratio"), (int, float))]
        worst = max(judged, key=lambda e: e["ratio"], default=None)
        row.update(verdict=rep.get("verdict"), worst=worst and round(worst["ratio"], 3),
                   worst_at=worst and f"{worst['module'] or '(model)'} {worst['phase']} {worst['slot']}",
                   first=(rep.get("first_divergence") or {}).get("module"),
                   findings=sorted({f["kind"] for f in rep.get("findings", [])}))
    else:
        row.update(verdict="crashed", error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    return row


def _table(rows: list[dict], gpu: str, tests: str) -> str:
    lines = [f"GPU: {gpu}", "",
             "| model | target dtype | verdict | worst ratio (where) | first divergence | findings | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        where = f"{r.get('worst')} ({r.get('worst_at')})" if r.get("worst") is not None else r.get("error", "")
        lines.append(f"| {r['model']} | {r['dtype']} | {r['verdict']} | {where} | {r.get('first') or ''} | "
                     f"{', '.join(r.get('findings', []))} | {r['seconds']} |")
    return "\n".join([*lines, "", f"pytest -m cuda: {tests}", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="mlp and llama only")
    args = ap.parse_args()
    gpu = _cuda_ok()
    if gpu is None:
        print("device_check: no CUDA device here (torch.cuda.is_available() is False); run it where a GPU is lent",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in QUICK if args.quick else MODELS:
        for dtype in DTYPES:
            rows.append(_one(model, dtype, args.out))
            print(json.dumps(rows[-1]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"],
                           capture_output=True, text=True, env=env)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    text = _table(rows, gpu, summary)
    (args.out / "device_check.md").write_text(text)
    (args.out / "device_check.json").write_text(json.dumps({"gpu": gpu, "runs": rows, "cuda_tests": summary}, indent=1))
    print(text)
    crashed = any(r["verdict"] == "crashed" for r in rows)
    return 1 if crashed or tests.returncode not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())

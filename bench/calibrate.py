"""Calibrate the noise floor: clean fp32-vs-lower-precision records, worst ratio per model/phase.

    python bench/calibrate.py            # built-ins x seeds x {bf16, fp16, the TPU levels}, plus hf families
    python bench/calibrate.py --quick    # built-ins, one seed, bf16
    python bench/calibrate.py --targets tpu:default,tpu:high,tpu:highest --seeds 1   # TPU emulation only

Targets: bf16 and fp16 (the whole model in that dtype) and tpu:<level> (fp32 with every matmul
and convolution computed as a TPU does at that precision level, ``--emulate tpu``).

Prints, per model and target precision, the worst ratio (error / floor) of a clean run, by phase.
A correct floor keeps every clean ratio well under the limit (policy.DEFAULT_LIMIT) while an
injected fault of a few floors exceeds it (bench/faults.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from driftcheck.compare import compare  # noqa: E402
from driftcheck.store.format import PHASES  # noqa: E402
from driftcheck.loader import load_scenario  # noqa: E402
from driftcheck.gate.policy import DEFAULT_LIMIT  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=None, help="comma list (default: built-ins, plus hf:* unless --quick)")
    ap.add_argument("--targets", default=None,
                    help="comma list of bf16, fp16, tpu:default, tpu:high, tpu:highest (default: all; bf16 with --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per model (default: 3; 1 with --quick)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = args.models.split(",") if args.models else ["mlp", "resnet", "llama", "vit"]
    if not args.models and not args.quick:
        models += ["hf:llama", "hf:qwen2", "hf:qwen3", "hf:gemma", "hf:mistral", "hf:deepseek_v3", "hf:vit",
                   "hf:dinov2", "hf:resnet", "hf:convnext", "hf:whisper", "hf:wav2vec2", "hf:unet"]
    seeds = list(range(args.seeds)) if args.seeds else ([0] if args.quick else [0, 1, 2])
    dtypes = args.targets.split(",") if args.targets else (
        ["bf16"] if args.quick else ["bf16", "fp16", "tpu:default", "tpu:high", "tpu:highest"])
    print(f"{'model':16s} {'target':11s} {'seed':>4s} " + " ".join(f"{p:>9s}" for p in PHASES) + "    worst  secs")
    passed_worst, tally = 0.0, {"pass": 0, "real": 0, "false alarm": 0}
    known: dict[str, list[str]] = {}  # known.* signatures on these clean runs, and where
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            for seed in seeds:
                ref = Path(tmp) / f"{m.replace(':', '_')}-{seed}-fp32"
                record(load_scenario(m, seed), ref, seed=seed, force=True, model_id=m)
                for dt in dtypes:
                    t0 = time.perf_counter()
                    tgt = Path(tmp) / f"{m.replace(':', '_')}-{seed}-{dt.replace(':', '_')}"
                    emulate = dt.split(":", 1)[1] if dt.startswith("tpu:") else None
                    record(load_scenario(m, seed), tgt, dtype="fp32" if emulate else dt, seed=seed, replay=ref,
                           force=True, model_id=m, emulate=emulate)
                    rep = compare(ref, tgt)
                    worst = {p: 0.0 for p in PHASES}
                    for e in rep.entries:
                        if e.ratio is not None and e.ratio != float("inf"):
                            worst[e.phase] = max(worst[e.phase], e.ratio)
                    w = max(worst.values())
                    nonfinite = [f for f in rep.findings if f.kind == "nonfinite.origin"]
                    for f in rep.findings:
                        if f.kind.startswith("known."):
                            known.setdefault(f.kind, []).append(f"{m} {dt} seed {seed} {f.module}")
                    if rep.verdict == "pass":
                        flag = ""
                        passed_worst = max(passed_worst, w)
                        tally["pass"] += 1
                    elif nonfinite and (rep.first_divergence or {}).get("status") == "nonfinite":
                        # a real precision failure, not a false alarm: e.g. Adam's eps (1e-8)
                        # is zero in fp16, so pure-fp16 Adam divides by zero
                        flag = f"  real NaN/Inf: {nonfinite[0].key}"
                        tally["real"] += 1
                    else:
                        flag = f"  FAIL (look at it): {rep.decided_by[:80]}"
                        tally["false alarm"] += 1
                    print(f"{m:16s} {dt:11s} {seed:4d} " + " ".join(f"{worst[p]:9.3f}" for p in PHASES)
                          + f" {w:8.3f} {time.perf_counter() - t0:5.1f}{flag}", flush=True)
    print(f"{tally['pass']} runs passed, worst ratio among them {passed_worst:.3f} (limit "
          f"{DEFAULT_LIMIT:g}); {tally['real']} failed on a real NaN/Inf origin; "
          f"{tally['false alarm']} failed otherwise (known cases: docs/noise-floor.md)")
    print(f"known defect signatures on these clean runs: {sum(len(v) for v in known.values())}"
          + "".join(f"\n  {k}: {len(v)} ({'; '.join(v[:4])})" for k, v in known.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real model code: every Hugging Face family, fp32 reference vs bf16 target, and a fault.

    python bench/hf_families.py            # all families
    python bench/hf_families.py --quick    # llama, vit, resnet

Per family: modules traced, tensors recorded, record time (fp32 reference), the fp32-vs-bf16
verdict and worst ratio, and whether a fault (one Linear/Conv output x1.05 on an fp32 target)
is localized to that module. Prints a Markdown table (the one in the README).
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
from torch import nn  # noqa: E402

from driftcheck.compare import compare  # noqa: E402
from driftcheck.targets.faults import scale_output  # noqa: E402
from driftcheck.loader import load_scenario  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402
from driftcheck.store import TraceReader  # noqa: E402


def middle_module(model: nn.Module) -> str:
    """A Linear or Conv in the middle of the model: where the fault goes."""
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    return names[len(names) // 2]


def run_family(spec: str, root: Path) -> dict:
    ref, tgt, bad = root / "ref", root / "bf16", root / "fault"
    t0 = time.perf_counter()
    record(load_scenario(spec), ref, force=True, model_id=spec)
    secs = time.perf_counter() - t0
    record(load_scenario(spec), tgt, dtype="bf16", replay=ref, force=True, model_id=spec)
    mod = middle_module(load_scenario(spec).model)
    record(load_scenario(spec), bad, replay=ref, force=True, model_id=spec,
           target_hooks=scale_output(mod, 1.05))
    reader = TraceReader(ref)
    rep = compare(ref, tgt)
    frep = compare(ref, bad)
    worst = max((e.ratio for e in rep.entries if e.ratio is not None and e.ratio != float("inf")), default=0.0)
    fd = frep.first_divergence or {}
    return {"family": spec, "modules": len({e["module"] for e in reader.entries}),
            "tensors": len(reader.entries), "secs": secs, "verdict": rep.verdict, "worst": worst,
            "errors": [f.kind for f in rep.findings if f.severity == "error"],
            "fault_module": mod, "localized": fd.get("module") == mod and frep.verdict == "fail",
            "report": rep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from driftcheck import hf

    fams = ["llama", "vit", "resnet"] if args.quick else list(hf.FAMILIES)
    print("| family | modules traced | tensors recorded | record time | fp32 vs bf16 | worst ratio | fault (x1.05) in | localized |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for fam in fams:
            r = run_family(f"hf:{fam}", Path(tmp) / fam)
            ok &= r["verdict"] == "pass" and r["localized"]
            print(f"| {fam} | {r['modules']} | {r['tensors']} | {r['secs']:.1f} s | {r['verdict']}"
                  f"{' ' + ','.join(r['errors']) if r['errors'] else ''} | {r['worst']:.2f} | "
                  f"`{r['fault_module']}` | {'yes' if r['localized'] else 'NO'} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

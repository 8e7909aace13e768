"""The drill-down on third-party model code it was not written against (bench/zoo.py's corpus).

Per architecture: an fp32 reference, a clean bf16 target drilled (backward, step 1) at a middle
composite module and a middle leaf module, where no op may exceed its floor; and an fp32 target
whose every float32 matmul is computed from bf16-rounded operands (a backend below the recorded
matmul precision, everywhere), compared, its first divergence drilled: the root cause must be a
matmul op, with a model-code line, and ``known.matmul_below_recorded_precision``.
Architectures without a float32 matmul (convolutions only) skip the fault.

    python bench/drill_zoo.py                      # the default sample
    python bench/drill_zoo.py --only tv_resnet18,hf_bert
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (the corpus; puts bench/.zoo-site on sys.path)

from driftcheck.targets import opfaults  # noqa: E402
from driftcheck.compare import compare  # noqa: E402
from driftcheck.drill import drill, point_of  # noqa: E402
from driftcheck.drill.side import Point  # noqa: E402
from driftcheck.loader import load_scenario  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402
from driftcheck.gate.signatures import attach  # noqa: E402

SAMPLE = ("tv_resnet", "tv_mobilenet_v3_small", "tv_vit", "tv_swin", "tv_convnext", "tv_raft_small",
          "timm_vit", "timm_convnext", "timm_efficientnet", "timm_levit", "timm_mixer",
          "timm_coatnet", "hf_roberta", "hf_opt", "hf_longt5", "hf_mamba", "hf_speecht5", "hf_clip",
          "hf_switch_transformers", "hf_swinv2", "hf_deberta_v2", "diffusers_dit", "diffusers_unet2d_condition")
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_attention_math", "linear", "matmul"}


def _modules(spec: str, ref: Path) -> list[str]:
    from driftcheck.store import TraceReader

    model = load_scenario(spec).model
    called = {e["module"] for e in TraceReader(ref).entries if e["phase"] == "backward"}
    names = [(n, m) for n, m in model.named_modules() if n and n in called]  # containers never run
    composites = [n for n, m in names if any(True for _ in m.children()) and any(True for _ in m.parameters())]
    leaves = [n for n, m in names if not any(True for _ in m.children()) and any(True for _ in m.parameters())]
    out = []
    if composites:
        out.append(composites[len(composites) // 2])
    if leaves:
        out.append(leaves[len(leaves) // 2])
    return out


def one(name: str, work: Path) -> dict:
    spec = f"{zoo.__file__}:{name}"
    sc = lambda: load_scenario(spec)  # noqa: E731
    row: dict = {"arch": name, "clean": [], "fault": None, "error": None}
    t0 = time.perf_counter()
    try:
        ref = record(sc(), work / f"{name}-ref", force=True, model_id=spec)
        tgt = record(sc(), work / f"{name}-bf16", dtype="bf16", force=True, replay=ref, model_id=spec)
        for m in _modules(spec, ref):
            try:
                res = drill(ref, tgt, point=Point(m, 1, 0, "backward"), scenario=sc)
            except Exception as e:  # noqa: BLE001 - the bench reports every failure
                row["clean"].append({"module": m, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            worst = max(res.judged, key=lambda j: j.ratio, default=None)
            row["clean"].append({"module": m, "root_cause": res.root_cause and res.root_cause["op"],
                                 "worst": worst.ratio if worst else None,
                                 "worst_op": worst.op if worst else None, "ops": res.ops})
        fault = opfaults.matmul_bf16_inputs()
        try:
            bad = record(sc(), work / f"{name}-mm", force=True, replay=ref, local=ref,
                         target_hooks=lambda model: fault(), model_id=spec)
        finally:
            fault.remove()
        if fault.hits:
            rep = compare(ref, bad)
            f2 = opfaults.matmul_bf16_inputs()
            try:
                res = drill(ref, bad, point=point_of(rep.first_divergence), report=rep,
                            target_hooks=lambda model: f2(), scenario=sc)
            finally:
                f2.remove()
            rc = res.root_cause or {}
            src = rc.get("source") or {}
            if "/torch/nn/modules/" in str(src.get("file")):  # torch's own module: where it is used
                src = rc.get("call_site") or src
            row["fault"] = {"verdict": rep.verdict, "point": res.point, "op": rc.get("op"),
                            "op_right": str(rc.get("op", "")).split(".")[1:2] and
                            str(rc.get("op")).split(".")[1] in MATMUL,
                            "source": f"{src.get('file')}:{src.get('line')}" if src else None,
                            "known": sorted(f.kind for f in attach(rep, res) if f.kind.startswith("known."))}
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:300] + " | " + traceback.format_exc().splitlines()[-3][:200]
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated corpus names")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else [n for n in SAMPLE if n in zoo.CATALOGUE]
    rows = []
    with tempfile.TemporaryDirectory(prefix="driftcheck-drill-zoo-") as tmp:
        for n in names:
            r = one(n, Path(tmp))
            rows.append(r)
            print(r, flush=True)
    clean = [c for r in rows for c in r["clean"]]
    crashed = [c for c in clean if "error" in c] + [r for r in rows if r["error"]]
    false = [c for c in clean if c.get("root_cause")]
    faults = [r["fault"] for r in rows if r["fault"]]
    print(f"\n{len(rows)} architectures; clean drills {len(clean)}: {len(false)} with a root cause, "
          f"{len(crashed)} failed to run; worst clean op ratio "
          f"{max((c['worst'] or 0) for c in clean if 'worst' in c):.2f}")
    print(f"matmul fault: {len(faults)} architectures; right op {sum(bool(f['op_right']) for f in faults)}, "
          f"with a source line {sum(bool(f['source']) for f in faults)}, signature "
          f"{sum('known.matmul_below_recorded_precision' in f['known'] for f in faults)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Op-level faults inside multi-op modules, and the drill-down that must name them
(``python bench/faults.py --ops``).

Each case injects one wrong ATen kernel (driftcheck/targets/opfaults.py) into one module of the target
run: exact GELU computed with the tanh formula, attention with the wrong scale, a mean
accumulated in bf16, one matmul from bf16-rounded operands, a backward formula missing a term.
The target is compared with its reference and the first divergence drilled
(driftcheck.drill). A case counts where the fault is at least 4x its op's floor, measured at
the faulty op itself (the drill's ``size``: the target's local output minus a correct kernel's,
in floors). It is right when the root cause's op is the faulty op, and its source line (or, for
a module that is torch's own, the line that calls it) is one of the lines the fault saw issue
the op (``OpFault.sites``, from the Python stack when it ran: an independent ground truth).

Every repro the drill writes is then run standalone in a fresh process twice: with the fault
installed for the whole process through a ``sitecustomize`` (a stand-in for the faulty backend
package) it must exit 1; without it, 0.

Controls: clean targets (bf16, autocast, fp32 with another thread count) drilled at every site
must produce no root cause, and the known signatures must fire on their simulated defects only.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from driftcheck.targets import opfaults
from driftcheck.compare import compare
from driftcheck.drill import drill, point_of
from driftcheck.drill.side import Point
from driftcheck.errors import DriftcheckError
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record
from driftcheck.gate.signatures import attach

SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
        "_softmax"}
MATMUL = {"mm", "addmm", "bmm", "baddbmm"}

# (model, fault, its settings, the module it is scoped to, the op packets it changes, signature)
CASES: list[tuple[str, str, dict[str, Any], str, set[str], str | None]] = [
    ("mlp", "gelu_tanh", {}, "", {"gelu"}, None),
    ("vit", "gelu_tanh", {}, "blocks.0.mlp", {"gelu"}, None),
    ("vit", "attention_scale", {}, "blocks.0.attn", {"_softmax"}, None),
    ("vit", "matmul_bf16_inputs", {}, "blocks.1.mlp", MATMUL, "matmul_below_recorded_precision"),
    ("vit", "wrong_backward", {"op": "gelu_backward"}, "blocks.1.mlp", {"gelu_backward"}, None),
    ("llama", "attention_scale", {}, "layers.0.attn", SDPA, None),
    ("llama", "low_precision_sum", {}, "layers.0.attn_norm", {"mean"}, "reduction_low_precision_accumulation"),
    ("llama", "low_precision_sum", {}, "layers.1.mlp_norm", {"mean"}, "reduction_low_precision_accumulation"),
    ("llama", "matmul_bf16_inputs", {}, "layers.0.mlp", MATMUL, "matmul_below_recorded_precision"),
    ("llama", "wrong_backward", {"op": "silu_backward"}, "layers.1.mlp", {"silu_backward"}, None),
    ("resnet", "wrong_backward", {"op": "native_batch_norm_backward", "factor": 1.5}, "layer1",
     {"native_batch_norm_backward"}, None),
    ("hf:vit", "gelu_tanh", {}, "vit.layers.0.mlp", {"gelu"}, None),
    ("hf:vit", "attention_scale", {}, "vit.layers.1.attention", SDPA, None),
    ("hf:llama", "wrong_backward", {"op": "silu_backward"}, "model.layers.0.mlp", {"silu_backward"}, None),
    ("hf:llama", "low_precision_sum", {}, "model.layers.1.input_layernorm", {"mean"},
     "reduction_low_precision_accumulation"),
    ("hf:llama", "matmul_bf16_inputs", {}, "model.layers.1.self_attn", MATMUL,
     "matmul_below_recorded_precision"),
]
SPEC_OF = {"wrong_backward": lambda kw: "wrong_backward:" + ",".join(f"{k}={v}" for k, v in kw.items())}


@dataclasses.dataclass
class OpCase:
    model: str
    fault: str
    module: str
    dtype: str
    size: float | None = None  # the fault at its op, in that op's floors
    root_op: str | None = None
    op_right: bool = False
    line_right: bool = False
    expected_lines: list[str] = dataclasses.field(default_factory=list)
    root_line: str | None = None
    signatures: list[str] = dataclasses.field(default_factory=list)
    signature_expected: str | None = None
    repro_faulty: int | None = None  # exit code with the fault installed
    repro_fixed: int | None = None  # and without
    verdict: str = ""
    note: str = ""
    seconds: float = 0.0


def _fault(name: str, kw: dict[str, Any], module: str) -> opfaults.OpFault:
    return opfaults.FACTORIES[name](module, **kw)


def _site(src: dict[str, Any] | None) -> str | None:
    return f"{src['file']}:{src['line']}" if src else None


def run_case(work: Path, model: str, name: str, kw: dict[str, Any], module: str, packets: set[str],
             signature: str | None, dtype: str, ref: Path) -> OpCase:
    t0 = time.perf_counter()
    c = OpCase(model, name + (f"({kw['op']})" if "op" in kw else ""), module, dtype,
               signature_expected=signature if dtype == "fp32" or "matmul" not in name else None)
    tgt = work / f"{model.replace(':', '_')}-{name}-{module or 'root'}-{dtype}"
    f = _fault(name, kw, module)
    try:
        record(load_scenario(model), tgt, dtype=dtype, force=True, replay=ref, local=ref, target_hooks=f)
    finally:
        f.remove()
    rep = compare(ref, tgt)
    c.verdict = rep.verdict
    f2 = _fault(name, kw, module)
    try:
        point = point_of(rep.first_divergence) if rep.first_divergence else Point(module, 0, 0, "backward")
        res = drill(ref, tgt, point=point, report=rep, target_hooks=f2,
                    scenario=lambda: load_scenario(model), out=tgt.with_name(tgt.name + "-drill"))
    except DriftcheckError as e:
        c.note = f"drill failed: {e}"
        c.seconds = time.perf_counter() - t0
        return c
    finally:
        f2.remove()
    sizes = [j.size for j in res.judged if j.op.split(".")[1] in packets]
    c.size = max(sizes) if sizes else None
    c.expected_lines = sorted(f"{a}:{b}" for a, b in f2.sites)
    rc = res.root_cause
    rep.root_cause = rc
    c.signatures = [x.kind.removeprefix("known.") for x in attach(rep, res) if x.kind.startswith("known.")]
    if rc is not None:
        c.root_op = rc["op"]
        c.op_right = rc["op"].split(".")[1] in packets
        lines = {_site(rc.get("source")), _site(rc.get("call_site"))} - {None}
        c.root_line = _site(rc.get("source"))
        c.line_right = bool(lines & set(c.expected_lines))
        if res.repro:
            c.repro_faulty, c.repro_fixed = _run_repro(Path(res.repro), name, kw, work)
    c.seconds = time.perf_counter() - t0
    return c


def _run_repro(script: Path, name: str, kw: dict[str, Any], work: Path) -> tuple[int, int]:
    """The repro in a fresh process: with the fault as the process's backend, and without."""
    site = work / "faulty-backend"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("from driftcheck.targets.opfaults import install_from_env\n"
                                           "install_from_env()\n", encoding="utf-8")
    spec = SPEC_OF.get(name, lambda _: name)(kw)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), root]), DRIFTCHECK_OP_FAULT=spec)
    faulty = subprocess.run([sys.executable, str(script)], env=env, capture_output=True).returncode
    clean_env = {k: v for k, v in os.environ.items() if k not in ("DRIFTCHECK_OP_FAULT",)}
    fixed = subprocess.run([sys.executable, str(script)], env=clean_env, capture_output=True).returncode
    return faulty, fixed


def run_controls(work: Path, model: str, ref: Path, modules: list[str]) -> list[dict[str, Any]]:
    """Clean targets drilled at every site: no op may exceed its floor."""
    out = []
    for label, dtype, autocast, threads in (("bf16", "bf16", None, None), ("autocast", "fp32", "bf16", None),
                                            ("fp32 threads 1", "fp32", None, 1)):
        tgt = work / f"{model.replace(':', '_')}-clean-{label.replace(' ', '')}"
        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            record(load_scenario(model), tgt, dtype=dtype, autocast=autocast, force=True, replay=ref)
            rep = compare(ref, tgt)
            for m in modules:
                t0 = time.perf_counter()
                res = drill(ref, tgt, point=Point(m, 1, 0, "backward"),
                            scenario=lambda: load_scenario(model))
                worst = max(res.judged, key=lambda j: j.ratio, default=None)
                out.append({"model": model, "control": label, "module": m,
                            "root_cause": res.root_cause and res.root_cause["op"],
                            "worst": worst.ratio if worst else 0.0, "worst_op": worst and worst.op,
                            "signatures": [f.kind for f in attach(rep, res)],
                            "seconds": time.perf_counter() - t0})
        finally:
            torch.set_num_threads(old)
    return out


def run_ops(work: Path, quick: bool = False, models: tuple[str, ...] | None = None) -> tuple[list[OpCase], list[dict]]:
    cases, controls = [], []
    by_model: dict[str, list] = {}
    for case in CASES:
        if models is None or case[0] in models:
            by_model.setdefault(case[0], []).append(case)
    for model, cs in by_model.items():
        ref = work / f"{model.replace(':', '_')}-ref"
        old = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            record(load_scenario(model), ref, dtype="fp32", force=True)
        finally:
            torch.set_num_threads(old)
        for (_, name, kw, module, packets, sig) in cs:
            for dtype in (("fp32",) if quick else ("fp32", "bf16")):
                c = run_case(work, model, name, kw, module, packets, sig, dtype, ref)
                print(f"  {model} {c.fault} in {module or '(model)'} {dtype}: size {c.size if c.size is None else round(c.size, 1)}, "
                      f"root {c.root_op}, op {'ok' if c.op_right else 'WRONG'}, line {'ok' if c.line_right else 'WRONG'}, "
                      f"known {c.signatures}, repro {c.repro_faulty}/{c.repro_fixed} {c.note}", flush=True)
                cases.append(c)
        if not quick:
            controls += run_controls(work, model, ref, sorted({c[3] for c in cs}))
            for r in controls[-3 * len({c[3] for c in cs}):]:
                print(f"  control {model} {r['control']} at {r['module'] or '(model)'}: worst {r['worst']:.2f} "
                      f"({r['worst_op']}), root cause {r['root_cause']}, known {r['signatures']}", flush=True)
    return cases, controls


def summarize_ops(cases: list[OpCase], controls: list[dict]) -> str:
    big = [c for c in cases if c.size is not None and c.size >= 4]
    small = [c for c in cases if c not in big]

    def pct(n: int, d: int) -> str:
        return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "0/0"
    repro = [c for c in big if c.repro_faulty is not None]
    sig_cases = [c for c in cases if c.signature_expected and c in big]
    rows = ["| op-level faults | cases | right op | right source line | repro exits 1 / 0 after the fix | expected signature |",
            "|---|---|---|---|---|---|"]
    for name in sorted({c.fault for c in big}):
        cs = [c for c in big if c.fault == name]
        rp = [c for c in cs if c.repro_faulty is not None]
        sg = [c for c in cs if c.signature_expected]
        rows.append(f"| {name} | {len(cs)} | {pct(sum(c.op_right for c in cs), len(cs))} | "
                    f"{pct(sum(c.line_right for c in cs), len(cs))} | "
                    f"{pct(sum(c.repro_faulty == 1 and c.repro_fixed == 0 for c in rp), len(rp))} | "
                    f"{pct(sum(c.signature_expected in c.signatures for c in sg), len(sg)) if sg else '-'} |")
    rows.append(f"| **all >= 4x their op's floor** | {len(big)} | {pct(sum(c.op_right for c in big), len(big))} | "
                f"{pct(sum(c.line_right for c in big), len(big))} | "
                f"{pct(sum(c.repro_faulty == 1 and c.repro_fixed == 0 for c in repro), len(repro))} | "
                f"{pct(sum(c.signature_expected in c.signatures for c in sig_cases), len(sig_cases))} |")
    rows.append(f"| below 4x (not counted) | {len(small)} | {pct(sum(c.op_right for c in small), len(small))} | | | |")
    wrong_sig = [c for c in cases if any(s != c.signature_expected for s in c.signatures)]
    rows.append("")
    rows.append(f"signatures on a case they do not describe: {len(wrong_sig)}"
                + (" (" + ", ".join(f"{c.model} {c.fault} {c.dtype}: {c.signatures}" for c in wrong_sig) + ")"
                   if wrong_sig else ""))
    if controls:
        fa = [r for r in controls if r["root_cause"]]
        ks = [r for r in controls if r["signatures"]]
        rows.append(f"clean controls drilled at every fault site: {len(controls)}; with a root cause: "
                    f"{len(fa)}; with a known signature: {len(ks)}; worst op ratio "
                    f"{max(r['worst'] for r in controls):.2f}")
    return "\n".join(rows)

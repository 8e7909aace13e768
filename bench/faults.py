"""The fault-injection benchmark: does driftcheck catch real defects, name the module that
introduced them, and stay quiet under legitimate noise?

For every built-in model: record the reference (CPU fp32), the truth (CPU fp64) and a clean
target (CPU bf16, with local replay); measure each entry's floor on the clean comparison; then
record one target per fault, each injected into one named module of the target run only
(driftcheck.targets.faults), and compare it three ways (reference, target, truth). A fault is
*detected* when the verdict fails, *localized* when the first divergence is in the injected
module. Its *size* is measured independently of the judge: the faulty target minus the clean
target at the injected entry (step 0; identical upstream, so exactly the perturbation), in units
of that entry's clean floor. Controls (no fault, legitimate noise) must pass.

    python bench/faults.py                  # every model, every fault (a few minutes on 2 cores)
    python bench/faults.py --quick          # a subset
    python bench/faults.py --capture stats  # every run recorded in stats mode (no local
                                            # replay or truth: they need full tensors; sizes
                                            # measured on the samples)
    python bench/faults.py --compile inductor  # every target (clean and faulty) under
                                            # torch.compile, the faults inside its graph; no
                                            # local replay (it reruns modules eagerly), and no
                                            # stochastic-rounding control (a dispatch mode)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from driftcheck.targets import faults
from driftcheck.compare import compare
from driftcheck.loader import load_scenario
from driftcheck.gate.report import Report
from driftcheck.record.runner import record
from driftcheck.store import TraceReader

MODELS = ("mlp", "resnet", "llama", "vit")
MAGNITUDES = (10.0, 8.0, 4.0, 2.0)

# Where faults go, per model: (a) output sites of several kinds (Linear/Conv, norm, activation,
# a composite block), (b)/(d)/(f) one matmul module, (c) a reduction, (e) a Dropout.
SITES: dict[str, dict[str, Any]] = {
    "mlp": {"output": ["fc2", "act1"], "matmul": "fc2", "grad": "fc2", "overflow": "fc2",
            "reduction": [("fc2", ("linear",))], "dropout": "drop1"},
    "resnet": {"output": ["layer1.conv2", "layer2.bn1", "layer1"], "matmul": "layer1.conv2",
               "grad": "layer1.conv2", "overflow": "layer1.bn2",
               "reduction": [("layer2.bn1", ("batch_norm",))], "dropout": None},
    "llama": {"output": ["layers.1.mlp.down_proj", "layers.0.mlp_norm", "layers.0.attn"],
              "matmul": "layers.1.mlp.down_proj", "grad": "layers.1.mlp.down_proj",
              "overflow": "layers.0.mlp.up_proj",
              "reduction": [("layers.0.mlp_norm", ("mean",))], "dropout": None},
    "vit": {"output": ["blocks.0.mlp.fc1", "blocks.1.norm1", "blocks.0.attn"],
            "matmul": "blocks.0.mlp.fc1", "grad": "blocks.0.mlp.fc1", "overflow": "blocks.0.mlp.fc1",
            "reduction": [("blocks.0.attn", ("softmax",)), ("blocks.1.norm1", ("layer_norm",))],
            "dropout": None},
}


@dataclass
class Case:
    model: str
    category: str  # "a" .. "f" or "control"
    name: str
    module: str | None  # the injected module (None for controls)
    oracle: tuple[str, str] | None = None  # (phase, slot) of the injected entry at step 0
    magnitude: float | None = None  # asked-for size in floors, (a) and (d)
    size: float | None = None  # measured size in floors
    detected: bool = False
    localized: bool = False
    verdict: str = ""
    first: dict[str, Any] | None = None
    origin: dict[str, Any] | None = None
    decided_by: dict[str, int] = field(default_factory=dict)
    worst: float = 0.0  # the largest entry ratio (propagated or local): margin of the controls
    known: list[str] = field(default_factory=list)  # known.* signatures the compare matched
    seconds: float = 0.0


class Bench:
    def __init__(self, work: Path, local: bool = True, truth: bool = True,
                 limit: float | None = None, capture: str = "full",
                 compile: dict[str, Any] | None = None) -> None:
        self.work, self.local, self.truth, self.limit = work, local, truth, limit
        self.capture = capture  # the record mode of every run
        self.compile = compile  # torch.compile settings of every target

    def _record(self, model: str, out: Path, dtype: str, hooks: Callable | None = None,
                threads: int | None = None, mode: Any = None, local: bool = True) -> Path:
        ref = self.work / model / "ref"
        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            ctx = mode if mode is not None else _null()
            with ctx:
                target = out != ref and dtype != "fp64"
                record(load_scenario(model), out, dtype=dtype, force=True, mode=self.capture,
                       replay=None if out == ref else ref, target_hooks=hooks,
                       local=ref if (local and self.local and out != ref) else None,
                       compile=self.compile if target else None)
        finally:
            torch.set_num_threads(old)
        return out

    def prepare(self, model: str) -> Report:
        d = self.work / model
        self._record(model, d / "ref", "fp32", threads=2)
        if self.truth:
            self._record(model, d / "truth", "fp64", local=False)
        self._record(model, d / "clean", "bf16")
        self.clean = self._compare(model, d / "clean")
        self.clean_floor = {(e.step, e.phase, e.module, e.call, e.slot): e.floor for e in self.clean.entries}
        self.ref_reader = TraceReader(d / "ref")
        self.ref_rms = {(e["step"], e["phase"], e["module"], e["call"], e["slot"]):
                        (e["stats"].get("l2") or 0.0) / math.sqrt(max(e["stats"].get("numel") or 1, 1))
                        for e in self.ref_reader.entries}
        return self.clean

    def _compare(self, model: str, target: Path) -> Report:
        d = self.work / model
        return compare(d / "ref", target, truth=(d / "truth") if self.truth else None,
                       limit=self.limit)

    def floor_and_rms(self, module: str, phase: str, slot: str) -> tuple[float, float]:
        key = (0, phase, module, 0, slot)
        return self.clean_floor[key], self.ref_rms[key]

    def run_case(self, case: Case, hooks: Callable | None = None, dtype: str = "bf16",
                 threads: int | None = None, mode: Any = None) -> Case:
        t0 = time.perf_counter()
        out = self.work / case.model / "target"
        self._record(case.model, out, dtype, hooks=hooks, threads=threads, mode=mode)
        rep = self._compare(case.model, out)
        case.seconds = time.perf_counter() - t0
        case.verdict = rep.verdict
        case.known = sorted({f.kind for f in rep.findings if f.kind.startswith("known.")})
        case.detected = not rep
        fd = rep.first_divergence
        case.first = fd and {k: fd.get(k) for k in ("module", "blame_module", "phase", "step", "slot",
                                                     "ratio", "local_ratio")}
        origin = next((f for f in rep.findings if f.kind == "nonfinite.origin"), None)
        case.origin = origin and {"module": origin.module, "step": origin.step, "phase": origin.phase}
        case.localized = bool(fd and case.module is not None and fd.get("blame_module") == case.module)
        case.worst = _worst(rep)
        for e in rep.entries:
            if e.decided_by:
                case.decided_by[e.decided_by] = case.decided_by.get(e.decided_by, 0) + 1
        if case.oracle is not None:
            case.size = self._size(case, out)
        return case

    def _size(self, case: Case, target: Path) -> float | None:
        """The injected perturbation in clean floors: faulty minus clean target, step 0."""
        phase, slot = case.oracle
        key = (0, phase, case.module, 0, slot)
        clean, faulty = TraceReader(self.work / case.model / "clean"), TraceReader(target)
        ce = next((e for e in clean.entries if (e["step"], e["phase"], e["module"], e["call"], e["slot"]) == key), None)
        fe = next((e for e in faulty.entries if (e["step"], e["phase"], e["module"], e["call"], e["slot"]) == key), None)
        if ce is None or fe is None or not self.clean_floor.get(key):
            return None
        a, b = faulty.tensor(fe), clean.tensor(ce)
        if a is None:  # stats mode: the samples (the same positions on both runs: same key, seed)
            a, b = faulty.tensor(fe, "sample"), clean.tensor(ce, "sample")
        diff = a.double() - b.double()
        if not torch.isfinite(diff).all():
            return math.inf
        return float(diff.pow(2).mean().sqrt()) / self.clean_floor[key]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def cases_for(bench: Bench, model: str, quick: bool) -> list[tuple[Case, dict[str, Any]]]:
    """Every (case, recording options) of one model; floors come from the clean comparison."""
    s = SITES[model]
    out: list[tuple[Case, dict[str, Any]]] = []
    mags = (8.0, 4.0, 2.0) if quick else MAGNITUDES
    sites = s["output"][:1] if quick else s["output"]
    for module in sites:
        floor, rms = bench.floor_and_rms(module, "forward", "output")
        for k in mags:
            out.append((Case(model, "a", f"scale x{k:g}", module, ("forward", "output"), k),
                        {"hooks": faults.scale_output(module, 1.0 + k * floor / rms)}))
            if not quick:
                out.append((Case(model, "a", f"offset x{k:g}", module, ("forward", "output"), k),
                            {"hooks": faults.offset_output(module, k * floor)}))
    out.append((Case(model, "b", "fp8 matmul", s["matmul"], ("forward", "output")),
                {"hooks": faults.fp8_matmul(s["matmul"])}))
    for module, ops in (s["reduction"][:1] if quick else s["reduction"]):
        out.append((Case(model, "c", f"bf16 {ops[0]}", module, ("forward", "output")),
                    {"hooks": faults.low_precision_reduction(module, torch.bfloat16, ops)}))
    floor, rms = bench.floor_and_rms(s["grad"], "backward", "grad_input.0")
    for k in ((8.0,) if quick else (8.0, 4.0)):
        out.append((Case(model, "d", f"grad x{k:g}", s["grad"], ("backward", "grad_input.0"), k),
                    {"hooks": faults.scale_grad(s["grad"], 1.0 + k * floor / rms)}))
    if s["dropout"]:
        out.append((Case(model, "e", "other dropout mask", s["dropout"], ("forward", "output")),
                    {"hooks": faults.other_dropout_mask(s["dropout"])}))
    out.append((Case(model, "f", "overflow to Inf", s["overflow"], ("forward", "output")),
                {"hooks": faults.overflow(s["overflow"])}))
    out.append((Case(model, "control", "fp32 vs bf16", None), {}))
    out.append((Case(model, "control", "threads 2 vs 1 (fp32)", None), {"dtype": "fp32", "threads": 1}))
    out.append((Case(model, "control", "stochastic rounding", None),
                {"mode": faults.stochastic_rounding(seed=1)}))
    return out


def run(models: tuple[str, ...], quick: bool, work: Path, local: bool = True,
        truth: bool = True, limit: float | None = None,
        log: Callable[[str], None] = print, capture: str = "full",
        compile: str | None = None) -> list[Case]:
    """Run the benchmark; returns every case (``summarize`` makes the table)."""
    torch.set_num_threads(2)
    full = capture == "full"  # local replay and the truth judge need full tensors
    settings = {"backend": compile, "mode": None, "dynamic": None} if compile else None
    bench = Bench(work, local=local and full and not compile, truth=truth and full, limit=limit,
                  capture=capture, compile=settings)
    results: list[Case] = []
    for model in models:
        t0 = time.perf_counter()
        bench.prepare(model)
        for case, opts in cases_for(bench, model, quick):
            if compile and opts.get("mode") is not None:
                continue  # a dispatch mode around the step: not traced by Dynamo
            if case.name == "fp32 vs bf16":  # the clean target itself
                c0 = time.perf_counter()
                rep = bench._compare(model, work / model / "clean")
                case.verdict, case.detected = rep.verdict, not rep
                case.worst = _worst(rep)
                case.seconds = time.perf_counter() - c0
                results.append(case)
                continue
            results.append(bench.run_case(case, **opts))
            c = results[-1]
            log(f"{model:7s} {c.category:7s} {c.name:24s} {c.module or '':24s} "
                f"size {_num(c.size):>6s} {'DETECTED' if c.detected else 'passed  '} worst {c.worst:6.2f} "
                f"first={(c.first or {}).get('blame_module')} {c.seconds:.2f}s")
        log(f"{model}: {time.perf_counter() - t0:.1f}s")
    return results


def _worst(rep: Report) -> float:
    vals = [v for e in rep.entries for v in (e.ratio, e.local_ratio)
            if v is not None and math.isfinite(v)]
    return max(vals, default=0.0)


def _num(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1f}")


def summarize(results: list[Case]) -> str:
    """The table: detection, exact localization, false positives, time per case."""
    rows = []

    def row(label: str, cs: list[Case]) -> None:
        if not cs:
            return
        n = len(cs)
        det = sum(c.detected for c in cs)
        loc = sum(c.localized for c in cs)
        t = sum(c.seconds for c in cs) / n
        rows.append(f"| {label} | {n} | {det}/{n} ({100 * det / n:.0f}%) | "
                    f"{loc}/{n} ({100 * loc / n:.0f}%) | {t:.2f} s |")

    faulty = [c for c in results if c.category != "control"]
    rows.append("| faults | cases | detected | localized (first divergence = injected module) | time/case |")
    rows.append("|---|---|---|---|---|")
    for k in MAGNITUDES:
        row(f"(a) output scaled/offset, {k:g}x floor", [c for c in faulty if c.category == "a" and c.magnitude == k])
    names = {"b": "(b) fp8 round trip in one matmul", "c": "(c) reduction accumulated in bf16",
             "d": "(d) wrong gradient (4-8x floor)", "e": "(e) other dropout mask",
             "f": "(f) overflow to Inf"}
    for cat, label in names.items():
        row(label, [c for c in faulty if c.category == cat])
    big = [c for c in faulty if c.size is not None and c.size >= 4.0]
    small = [c for c in faulty if c.size is not None and c.size < 4.0]
    row("**all faults measured >= 4x floor**", big)
    row("all faults measured < 4x floor", small)
    controls = [c for c in results if c.category == "control"]
    rows.append("")
    rows.append("| controls (no fault) | cases | false positives | worst ratio | time/case |")
    rows.append("|---|---|---|---|---|")
    for name in sorted({c.name for c in controls}):
        cs = [c for c in controls if c.name == name]
        fp = sum(c.detected for c in cs)
        rows.append(f"| {name} | {len(cs)} | {fp}/{len(cs)} | {max(c.worst for c in cs):.2f} | "
                    f"{sum(c.seconds for c in cs) / len(cs):.2f} s |")
    fp_all = sum(c.detected for c in controls)
    rows.append(f"| **all controls** | {len(controls)} | {fp_all}/{len(controls)} "
                f"({100 * fp_all / max(len(controls), 1):.0f}%) | "
                f"{max((c.worst for c in controls), default=0.0):.2f} | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset: one output site, fewer magnitudes")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated built-in models")
    ap.add_argument("--no-local", action="store_true", help="without local replay (propagated error only)")
    ap.add_argument("--no-truth", action="store_true", help="without the float64 truth run")
    ap.add_argument("--limit", type=float, default=None, help="ratio limit (default: the policy's)")
    ap.add_argument("--work", default=None, help="where traces go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write every case as JSON here")
    ap.add_argument("--capture", choices=("full", "stats"), default="full",
                    help="record mode of every run (stats: without local replay and truth)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="every target under torch.compile with this backend (inductor, aot_eager)")
    ap.add_argument("--ops", action="store_true",
                    help="op-level faults inside multi-op modules and the drill-down (bench/_opfaults.py); "
                         "--models picks among its models (built-in and hf:*)")
    args = ap.parse_args(argv)
    if args.ops:
        return _main_ops(args)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="driftcheck-bench-") as tmp:
        work = Path(args.work or tmp)
        results = run(models, args.quick, work, local=not args.no_local, truth=not args.no_truth,
                      limit=args.limit, capture=args.capture, compile=args.compile)
    print()
    print(summarize(results))
    known = [f"{c.model} {c.name}: {', '.join(c.known)}" for c in results if c.known]
    print(f"\nknown defect signatures matched: {len(known)}" + "".join(f"\n  {k}" for k in known))
    print(f"\n{len(results)} cases, {time.perf_counter() - t0:.0f} s total, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        Path(args.json).write_text(json.dumps([c.__dict__ for c in results], indent=1, default=str))
    return 0


def _main_ops(args: argparse.Namespace) -> int:
    from _opfaults import run_ops, summarize_ops

    t0 = time.perf_counter()
    models = None if args.models == ",".join(MODELS) else tuple(m.strip() for m in args.models.split(","))
    with tempfile.TemporaryDirectory(prefix="driftcheck-bench-ops-") as tmp:
        cases, controls = run_ops(Path(args.work or tmp), quick=args.quick, models=models)
    print()
    print(summarize_ops(cases, controls))
    print(f"\n{len(cases)} cases, {len(controls)} controls, {time.perf_counter() - t0:.0f} s total, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": [c.__dict__ for c in cases], "controls": controls},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

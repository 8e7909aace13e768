"""Sample reports for the renderer and policy tests, built directly from Report/Entry/Finding.

Deterministic (seeded), no torch: the compare engine is not needed to exercise the renderers.
"""
from __future__ import annotations

import math
import random
from typing import Any

from driftcheck.gate.report import DRIFT, IGNORED, MISALIGNED, NONFINITE, OK, Entry, Finding, Report

# A small transformer-ish model with a BatchNorm, in execution order.
MODULES = ["embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp", "norm.bn", "lm_head", ""]
DIVERGING = "layers.1.mlp"  # where the injected defect enters in the failing report
PHASE_SLOTS = {
    "params": ["param.weight"],
    "forward": ["input.0", "output"],
    "loss": ["loss"],
    "backward": ["grad_output.0", "grad_input.0"],
    "grads": ["param.weight"],
    "optimizer": ["param.weight", "state.weight.exp_avg"],
}

HOSTILE_NAMES = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "</script><script>alert('json')</script>",
    "a|b*c_`d`$x^2$",
]


def _stats(rng: random.Random, scale: float) -> dict[str, float]:
    mean = rng.uniform(-0.1, 0.1) * scale
    std = rng.uniform(0.5, 1.5) * scale
    return {"min": mean - 3 * std, "max": mean + 3 * std, "mean": mean, "std": std,
            "absmax": abs(mean) + 3 * std, "l2": std * 64.0, "nan": 0, "inf": 0}


def _histogram(rng: random.Random, center: float) -> dict[str, Any]:
    edges = [center - 4 + 0.5 * i for i in range(17)]  # log10 |err| bins
    counts = [int(1000 * math.exp(-((e + 0.25 - center) ** 2) / 1.5)) + rng.randint(0, 3) for e in edges[:-1]]
    return {"edges": edges, "counts": counts, "exact": rng.randint(0, 500)}


def make_entry(module: str, phase: str, step: int, slot: str, order: int, ratio: float | None,
               status: str, rng: random.Random, call: int = 0, **extra: Any) -> Entry:
    """One entry whose metrics are consistent with ``ratio`` (floor 1e-3 * ref_rms)."""
    ref_rms = rng.uniform(0.2, 3.0)
    floor = 1e-3 * ref_rms
    err = (ratio if ratio is not None and math.isfinite(ratio) else 1.0) * floor
    metrics: dict[str, Any] = {
        "max_abs": err * 4.2, "mean_abs": err * 0.8, "rms": err, "rel_l2": err / ref_rms,
        "cosine": 1.0 - (err / ref_rms) ** 2 / 2, "max_ulp": round(err / ref_rms * 256 * 4),
        "frac_outside": min(1.0, 0.001 * (ratio or 0.0)), "sqnr_db": 20 * math.log10(ref_rms / max(err, 1e-30)),
        "ref_rms": ref_rms, "ref_absmax": ref_rms * 3.5, "nan_ref": 0, "nan_tgt": 0, "inf_ref": 0, "inf_tgt": 0,
    }
    details: dict[str, Any] = {"ref_stats": _stats(rng, ref_rms), "tgt_stats": _stats(rng, ref_rms),
                               "histogram": _histogram(rng, math.log10(max(err, 1e-30)))}
    if status == NONFINITE:
        metrics.update(nan_tgt=17, inf_tgt=2, max_abs=float("inf"))
        details["tgt_stats"].update(nan=17, inf=2)
    key = f"{module}/{phase}/{step}/{call}/{slot}"
    entry = Entry(key=key, module=module, phase=phase, step=step, call=call, slot=slot, order=order,
                  metrics=metrics, floor=floor, ratio=ratio, status=status,
                  decided_by="analytic" if ratio is not None else None, details=details)
    for name, value in extra.items():
        setattr(entry, name, value)
    return entry


def _entries(steps: int, ratio_of, status_of, modules: list[str] = MODULES, seed: int = 0) -> list[Entry]:
    rng = random.Random(seed)
    out: list[Entry] = []
    for step in range(steps):
        order = 0
        for phase, slots in PHASE_SLOTS.items():
            mods = (["" ] if phase == "loss" else
                    list(reversed(modules)) if phase == "backward" else modules)
            for module in mods:
                for slot in slots:
                    ratio = ratio_of(module, phase, step, slot, rng)
                    status = status_of(module, phase, step, slot, ratio)
                    out.append(make_entry(module, phase, step, slot, order, ratio, status, rng))
                    order += 1
    return out


def _run_meta(device: str, dtype: str, precision: dict[str, Any], host: str) -> dict[str, Any]:
    return {"device": device, "dtype": dtype, "precision": precision, "model": "tiny_gpt_bn",
            "seed": 0, "steps": 2, "host": host,
            "versions": {"torch": "2.13.0", "driftcheck": "0.1.0",
                         **({"torch_tpu": "0.2.0"} if device == "tpu" else {})}}


REF_META = _run_meta("cpu", "float32", {"matmul": "highest", "tf32": False, "autocast": None}, "ref-box")
TGT_META = _run_meta("tpu", "float32", {"matmul": "medium", "tf32": False, "autocast": None,
                                         "defer_and_fuse": True}, "tpu-vm-7")


def failing_report(limit: float = 4.0) -> Report:
    """Drift enters at ``layers.1.mlp`` forward step 0; one finding of every kind."""
    downstream = set(MODULES[MODULES.index(DIVERGING):])

    def ratio_of(module: str, phase: str, step: int, slot: str, rng: random.Random) -> float | None:
        if phase == "optimizer" and slot.startswith("state."):
            return None  # not judged (no ratio)
        base = rng.uniform(0.05, 1.8)
        if phase == "forward" and module in downstream and not (module == DIVERGING and slot.startswith("input")):
            return base * 20 + (60.0 if module == DIVERGING else 0.0)
        if phase in ("backward", "grads", "optimizer") and module in downstream:
            return base * 9
        return 0.0 if phase == "params" and step == 0 else base

    def status_of(module: str, phase: str, step: int, slot: str, ratio: float | None) -> str:
        if ratio is None:
            return OK
        if module == "lm_head" and phase == "backward" and step == 1:
            return NONFINITE
        if module.startswith("embed") and phase == "grads":
            return IGNORED
        return DRIFT if ratio > limit else OK

    entries = _entries(2, ratio_of, status_of)
    for e in entries:
        if e.status == NONFINITE:
            e.ratio = float("inf")
        if e.status == IGNORED:
            e.rule = "ignored: sparse embedding gradients differ by design"
    entries.append(make_entry("layers.0.attn", "forward", 1, "output.attn_weights", 999, None, MISALIGNED,
                              random.Random(5)))
    first = next(e for e in entries if e.module == DIVERGING and e.phase == "forward" and e.slot == "output")
    first.local_ratio = 71.0
    findings = [
        Finding("batchnorm.running_stats_not_updated", "norm.bn", 0,
                "running_mean/running_var unchanged after a training step while num_batches_tracked advanced 0 -> 1",
                phase="params", details={"running_mean_change": 0.0, "num_batches_tracked": [0, 1]}),
        Finding("view.aliasing_lost", "layers.0.attn", 0, "output of view() no longer shares storage with its base",
                phase="forward", key="layers.0.attn/forward/0/0/output"),
        Finding("inplace.overlap", "layers.1.mlp", 0, "in-place add_ wrote to an overlapping view (unsupported on tpu)",
                phase="forward"),
        Finding("nonfinite.target_only", "lm_head", 1, "target produced 17 NaN and 2 Inf; reference is finite",
                phase="backward", key="lm_head/backward/1/0/grad_input.0"),
        Finding("precision.matmul_differs", "", None, "fp32 matmul precision: reference 'highest', target 'medium'",
                severity="warning", details={"reference": "highest", "target": "medium"}),
        Finding("alignment.missing", "layers.0.attn", 1, "output.attn_weights exists only in the reference",
                phase="forward", key="layers.0.attn/forward/1/0/output.attn_weights"),
    ]
    return Report(
        verdict="fail", reference=REF_META, target=TGT_META,
        first_divergence={"key": first.key, "module": first.module, "phase": first.phase, "step": first.step,
                          "slot": first.slot, "ratio": first.ratio, "local_ratio": first.local_ratio},
        entries=entries, findings=findings, limit=limit,
        decided_by=f"first divergence at {DIVERGING} (forward, step 0): local ratio 71 > default limit {limit:g}",
        warnings=["precision settings differ: matmul 'highest' (reference) vs 'medium' (target)"],
        policy={"source": None, "limit": limit, "overrides": [], "ignore": [
            {"glob": "embed*", "phase": "grads", "kind": None, "steps": None,
             "reason": "sparse embedding gradients differ by design"}],
            "fail_on": ["batchnorm", "view", "inplace", "nonfinite", "alignment"], "fail_on_explicit": False,
            "steps": None},
    )


def passing_report(limit: float = 4.0) -> Report:
    """Everything within the noise floor; only a precision warning."""
    entries = _entries(2, lambda m, p, s, sl, rng: rng.uniform(0.02, 1.5) if p != "params" else 0.0,
                       lambda m, p, s, sl, r: OK, seed=1)
    meta = dict(REF_META, device="cuda", host="gpu-box")
    return Report(
        verdict="pass", reference=REF_META, target=meta, first_divergence=None, entries=entries,
        findings=[Finding("precision.tf32_enabled", "", None, "TF32 is allowed for cuDNN convolutions on the target",
                          severity="warning")],
        limit=limit,
        decided_by=f"all {len(entries)} entries within their limits (default limit {limit:g}); "
                   "no findings fail the gate",
    )


def hostile_report() -> Report:
    """Module names, metadata and messages that try to inject markup, script and Markdown."""
    entries = _entries(1, lambda m, p, s, sl, rng: 50.0 if m == HOSTILE_NAMES[0] else 0.5,
                       lambda m, p, s, sl, r: DRIFT if r > 4 else OK, modules=HOSTILE_NAMES, seed=2)
    first = next(e for e in entries if e.module == HOSTILE_NAMES[0] and e.phase == "forward")
    evil = HOSTILE_NAMES[1]
    return Report(
        verdict="fail", reference=dict(REF_META, host=evil), target=dict(TGT_META, model=HOSTILE_NAMES[2]),
        first_divergence={"key": first.key, "module": first.module, "phase": "forward", "step": 0,
                          "slot": first.slot, "ratio": first.ratio},
        entries=entries,
        findings=[Finding("view.<b>bold</b>", HOSTILE_NAMES[1], 0, "message " + HOSTILE_NAMES[2])],
        limit=4.0, decided_by="first divergence at " + HOSTILE_NAMES[0], warnings=[evil],
    )


def big_report(n_modules: int = 400, steps: int = 2, histograms: int = 0) -> Report:
    """Thousands of entries (n_modules * steps * 8 slots): for size and speed checks.
    ``histograms``: how many of the worst entries keep their details (as compare keeps them for
    the first divergence and the 8 worst)."""
    modules = [f"blocks.{i // 8}.layer{i % 8}" for i in range(n_modules)]
    entries = _entries(steps, lambda m, p, s, sl, rng: rng.lognormvariate(-1, 1),
                       lambda m, p, s, sl, r: DRIFT if r > 4 else OK, modules=modules, seed=3)
    keep = {id(e) for e in sorted(entries, key=lambda e: -(e.ratio or 0))[:histograms]}
    for e in entries:
        if id(e) not in keep:
            e.details = {}  # a real report keeps details only for some entries
    return Report(verdict="fail", reference=REF_META, target=TGT_META, first_divergence=None, entries=entries,
                  findings=[], limit=4.0, decided_by="many entries drift beyond default limit 4")


def rejudged(report: Report) -> Report:
    """``report`` judged again by its (edited) embedded policy, as compare would have judged it:
    each entry's limit and each finding's gate state are written into the report, renderers
    only read them."""
    for e in report.entries:
        e.limit = None
        if e.rule and not e.rule.startswith("--limit") and e.status != IGNORED:
            e.rule = None
    for f in report.findings:
        f.gate = None
    return Report(**{k: getattr(report, k) for k in report.__dataclass_fields__})

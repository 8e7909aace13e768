"""Known defect signatures: a small registry of defects backends have shipped, each with a name, an
explanation and a workaround, matched from the evidence of a comparison and of a drill-down.

A match is a finding ``known.<name>`` (severity "warning": the evidence it rests on is already
judged, it adds what the defect is). Pure: reports and drill judgements in, findings out.

Each name, and the evidence it is matched from:

- ``batchnorm_running_stats_not_written``: a ``batchnorm.running_stats_not_updated`` finding;
- ``scaled_mm_rowwise_scales_wrong_axis``: a ``_scaled_mm`` over its floor whose error matches its
  scales applied along the other axis;
- ``matmul_below_recorded_precision``: a float32 matmul over its floor whose error matches one
  bf16 pass;
- ``reduction_low_precision_accumulation``: a sum/mean over its floor whose error matches a bf16
  running sum;
- ``layernorm_backward_low_precision_params``: a LayerNorm backward whose weight/bias gradients
  exceed their floor while its input gradient does not; or compare's
  ``precision.low_precision_sum`` on a LayerNorm losing at least 5%.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from driftcheck.gate.finding import Finding
from driftcheck.gate.policy import Policy, gate_state
from driftcheck.gate.report import Report

__all__ = ["SIGNATURES", "Signature", "attach", "match"]


@dataclasses.dataclass(frozen=True)
class Signature:
    name: str
    title: str
    explanation: str
    workaround: str
    report_match: Callable[[Report], list[tuple[str, int | None, dict[str, Any]]]] | None = None
    op_match: Callable[[Any, float], dict[str, Any] | None] | None = None  # (OpJudgement, limit)


def _matches(err: float, alt: float | None, lo: float = 0.5, hi: float = 2.0) -> bool:
    return alt is not None and alt > 0 and lo <= err / alt <= hi


def _bn(report: Report) -> list[tuple[str, int | None, dict[str, Any]]]:
    return [(f.module, f.step, {"finding": f.kind}) for f in report.findings
            if f.kind == "batchnorm.running_stats_not_updated"]


# compare's share of a bias gradient lost to a low-precision sum, above which a LayerNorm's is
# the defect itself: a correct bf16 kernel (fp32 accumulation) loses 0.2%; PyTorch's CPU kernel
# loses 1% over the built-in ViT's 136 rows (within the worst case: not named) and 5-70% over
# ConvNeXt's 56x56 positions.
LN_SHARE = 0.05


def _ln_sums(report: Report) -> list[tuple[str, int | None, dict[str, Any]]]:
    """compare's ``precision.low_precision_sum`` (a bias gradient the kernel summed in low
    precision) on a LayerNorm: the same defect, seen without a drill."""
    types = {e.module: str(e.details.get("module_type", "")) for e in report.entries
             if e.details.get("module_type")}
    return [(f.module, f.step, {"finding": f.kind, "share": (f.details or {}).get("share")})
            for f in report.findings
            if f.kind == "precision.low_precision_sum" and "LayerNorm" in types.get(f.module, "")
            and float((f.details or {}).get("share") or 0.0) >= LN_SHARE]


def _scaled_mm(j: Any, limit: float) -> dict[str, Any] | None:
    if "_scaled_mm" not in j.op:
        return None
    alt = j.alternatives.get("scales_wrong_axis")
    if j.ratio > limit and _matches(j.error, alt):
        return {"error": j.error, "wrong_axis_error": alt}
    return None


def _matmul(j: Any, limit: float) -> dict[str, Any] | None:
    alt = j.alternatives.get("bf16_pass")
    if j.ratio > limit and _matches(j.error, alt):
        return {"error": j.error, "bf16_pass_error": alt}
    return None


def _reduction(j: Any, limit: float) -> dict[str, Any] | None:
    alt = j.alternatives.get("bf16_accumulation")
    if j.ratio > limit and _matches(j.error, alt, 1 / 3, 3.0):
        return {"error": j.error, "bf16_accumulation_error": alt}
    return None


def _layernorm_backward(j: Any, limit: float) -> dict[str, Any] | None:
    if "native_layer_norm_backward" not in j.op or len(j.ratios) < 3:
        return None
    r_in, r_w, r_b = (x if x is not None else 0.0 for x in j.ratios[:3])
    if max(r_w, r_b) > limit and r_in <= limit:
        return {"grad_input_ratio": r_in, "grad_weight_ratio": r_w, "grad_bias_ratio": r_b}
    return None


SIGNATURES: tuple[Signature, ...] = (
    Signature("batchnorm_running_stats_not_written",
              "BatchNorm running statistics never written in training",
              "The training kernel normalises with the batch statistics but never writes "
              "running_mean/running_var, while num_batches_tracked still advances (torch_tpu 0.2.0): "
              "the model trains normally and evaluates wrongly.",
              "Recompute the running statistics on the host after training (a pass in train mode "
              "on CPU, or torch.optim.swa_utils.update_bn), or keep BatchNorm on a backend whose "
              "kernel updates them; upgrade torch_tpu once fixed.", report_match=_bn),
    Signature("scaled_mm_rowwise_scales_wrong_axis",
              "fp8 _scaled_mm with row-wise scales broadcast along the wrong axis",
              "The fp8 GEMM's per-row scale of A and per-column scale of B were applied along the "
              "other axis: the error matches that of the transposed scales (fixed in torch_tpu, "
              "#1820 in its sources).",
              "Use tensor-wise scales, or upgrade torch_tpu to a release with the fix.",
              op_match=_scaled_mm),
    Signature("matmul_below_recorded_precision",
              "float32 matmul computed at lower precision than recorded",
              "A matmul recorded as float32 has the error of one bf16 pass (bf16 operands, float32 "
              "accumulation): the backend ran it at a lower matmul precision than the setting in "
              "force, as when a compile cache serves a result compiled under another "
              "matmul-precision context, or a backend computes one bf16 pass by default without "
              "reporting it (torch.get_float32_matmul_precision() still says 'highest').",
              "Set the precision explicitly before the first compile "
              "(torch.set_float32_matmul_precision('highest') / torch.tpu precision HIGHEST) and "
              "clear compiled caches (torch.compiler.reset()) when changing it; if one bf16 pass "
              "is the backend's default, record the target with --matmul-precision medium so the "
              "floor knows it.",
              op_match=_matmul),
    Signature("reduction_low_precision_accumulation",
              "a reduction accumulated in low precision",
              "A sum/mean has the error of a running sum rounded to bf16 after every addition: it "
              "grows like K*u instead of sqrt(K)*u with the reduction length K.",
              "Compute the reduction in float32 (x.float().sum(...) or dtype=torch.float32), or "
              "report the kernel to the backend.", op_match=_reduction),
    Signature("layernorm_backward_low_precision_params",
              "LayerNorm backward accumulating weight/bias gradients in low precision",
              "The weight and bias gradients of a LayerNorm backward are far beyond their floor "
              "while its input gradient is within it: the kernel sums them over the rows in "
              "bf16/fp16 (PyTorch's own CPU kernel does this in bf16 today; llm.c #428/#476).",
              "Keep the norm in float32 (autocast does; or norm.float() with casts around it), "
              "or keep LayerNorm parameters and gradients in float32.",
              report_match=_ln_sums, op_match=_layernorm_backward),
)


KINDS = frozenset(f"known.{sig.name}" for sig in SIGNATURES)


def match(report: Report, drill: Any = None) -> list[Finding]:
    """The ``known.*`` findings the evidence supports (one per signature and module)."""
    out: list[Finding] = []
    limit = float(getattr(drill, "limit", None) or report.limit or 3.5)
    for sig in SIGNATURES:
        hits: list[tuple[str, int | None, dict[str, Any]]] = []
        if sig.report_match is not None:
            hits += sig.report_match(report)
        if sig.op_match is not None and drill is not None:
            for j in drill.judged:
                ev = sig.op_match(j, limit)
                if ev is not None:
                    hits.append((drill.point.get("module", ""), drill.point.get("step"),
                                 dict(ev, op=j.op, phase=j.phase, ratio=j.ratio)))
                    break  # the first op that shows it
        seen: set[str] = set()
        for module, step, ev in hits:
            if module in seen:
                continue
            seen.add(module)
            out.append(Finding(kind=f"known.{sig.name}", module=module, step=step,
                               message=f"{sig.title}. {sig.explanation} Workaround: {sig.workaround}",
                               phase=ev.get("phase"), severity="warning",
                               details={"evidence": ev, "workaround": sig.workaround}))
    return out


def attach(report: Report, drill: Any = None) -> list[Finding]:
    """Add the matches to ``report`` (once each) and name them in its root cause."""

    policy = Policy.from_dict(report.policy)
    have = {(f.kind, f.module) for f in report.findings}
    new = [f for f in match(report, drill) if (f.kind, f.module) not in have]
    for f in new:
        f.gate = gate_state(f, policy)
    report.findings.extend(new)
    if report.root_cause is not None:
        names = [f.kind for f in report.findings if f.kind.startswith("known.")
                 and f.module == report.root_cause.get("module")]
        if names:
            report.root_cause["known"] = names
    return new

"""What the renderers share (terminal.py, html.py, junit.py, markdown.py: a Report in, text out).

Renderers only render: no trace I/O, no judging. What they share lives here: the phase order,
number formatting, the per-entry limit and gate state (written by compare) and what each
finding kind means and what to do about it.
"""
from __future__ import annotations

import math
import os
from typing import Any

from driftcheck.gate.report import Entry, Finding, as_float, worst
from driftcheck.store.format import PHASES, kind_matches

__all__ = [
    "FAILING",
    "KIND_HELP",
    "ROOT",
    "as_float",
    "conclusion",
    "entry_limit",
    "entry_words",
    "execution_order",
    "explain_kind",
    "finding_state",
    "fmt",
    "module_label",
    "precision_pair",
    "worst",
]

# Entry statuses that fail the gate.
FAILING = ("drift", "nonfinite", "misaligned")

# What each finding kind means and what to do; the longest matching prefix wins.
KIND_HELP: dict[str, tuple[str, str, str]] = {
    "batchnorm": (
        "BatchNorm running statistics",
        "The batch statistics were computed, but running_mean / running_var were not updated the way the "
        "reference updated them (num_batches_tracked may still advance). The model trains normally and "
        "evaluates wrongly: eval-mode outputs use stale statistics.",
        "Check eval-mode outputs after training. On torch_tpu 0.2.0 this is a known backend defect: recompute "
        "the statistics on CPU (torch.optim.swa_utils.update_bn) or update them on CPU, and report it upstream.",
    ),
    "view": (
        "View semantics",
        "A tensor that is a view of another (shares its storage) in the reference is a copy on the target, "
        "or the other way round, so a write through one no longer reaches the other.",
        "Look at the op named in the message. Do not rely on aliasing: assign results explicitly, or clone() where "
        "a copy is intended.",
    ),
    "view.write_not_through_view": (
        "A write that missed its view",
        "The reference wrote in place through a view, so the write reached the tensor the view came from; "
        "on the target the view op returned a copy, the same write landed in that copy, and the original "
        "tensor kept its old values.",
        "Look at the op and module named: replace the in-place write through a view with an explicit "
        "assignment (x = torch.cat(...), x[..., :k] = x[..., :k] * 2 on the base), and report the view op "
        "that copies to the backend.",
    ),
    "view.audit_unobservable": (
        "View audit not applicable",
        "The run's tensors have no storage the view audit can inspect (a lazy or functionalizing backend: "
        "views reach the audit as *_copy ops and writes through them as *_scatter ops), so its view and "
        "in-place semantics were not observed on that side.",
        "Run `driftcheck probe --device DEV`, which checks the same semantics by values; the numeric "
        "comparison still judges every entry.",
    ),
    "inplace": (
        "In-place semantics",
        "An in-place op wrote to memory that overlaps its own input or another live view; the result depends "
        "on the backend's write order. torch_tpu does not support in-place writes to overlapping views.",
        "Use the out-of-place form (x = x.add(y) instead of x.add_(y)) or clone() before writing.",
    ),
    "nonfinite": (
        "NaN / Inf",
        "The target produced NaN or Inf where the reference is finite: usually overflow in a narrow dtype "
        "(bf16/fp16/fp8 range), a division by a tiny value, or unchecked out-of-bounds indexing.",
        "Start at the first module where it appears and check its input range; keep that op in fp32 or add "
        "loss scaling. On torch_tpu set TORCH_TPU_ENABLE_DEBUG_CHECKS=1 to catch bad indices.",
    ),
    "precision": (
        "Precision settings",
        "The runs used different precision settings (fp32 matmul precision, TF32, autocast, dtype). This "
        "explains drift the noise floor already expects; it is a warning, not a defect.",
        "For a like-for-like comparison make them match, e.g. torch.set_float32_matmul_precision('highest') "
        "on both sides; otherwise accept the drift the floor allows.",
    ),
    "alignment": (
        "Alignment",
        "The traces do not line up here: an entry exists in only one run, or its shape or dtype differs. "
        "Different code paths ran (a device branch, a fused op that skips a module) or the model differs.",
        "Check that both runs used the same model, config, inputs and steps; look for data-dependent "
        "control flow or device-specific branches in this module.",
    ),
    "deferred": (
        "A sync point the capture added",
        "On a deferred device (lazy, xla) driftcheck's own code ran a graph inside a step: the traced "
        "step ran as other graphs than the untraced one, so what was measured may not be what runs "
        "untraced. run.lazy in the manifest counts each step's graphs and the capture's own.",
        "Record with the default --transfer batched; if it persists, report it as a driftcheck bug "
        "with the manifest's run.lazy.",
    ),
    "alias": (
        "Shared parameters and buffers",
        "Tensors the reference shares (tied weights, a buffer registered twice, a parameter that is a view "
        "of another) are separate on the target, or the other way round. A tied weight trained as separate "
        "copies gets only part of its gradient in each: forward and loss can agree while its gradient and "
        "update diverge. Moving a model to a lazy, XLA or PrivateUse1 device replaces its parameters and "
        "unties them.",
        "Tie them again after moving the model to the device: model.tie_weights() for Hugging Face models, "
        "or assign the shared parameter again (model.lm_head.weight = model.tok_emb.weight).",
    ),
    "known": (
        "A known backend defect",
        "The evidence matches a defect backends have shipped (driftcheck/gate/signatures.py): the message "
        "names it and says why it matches.",
        "Apply the workaround the message gives, and attach the drill-down's repro (drill/repro/) to a bug "
        "report against the backend.",
    ),
}


def explain_kind(kind: str) -> tuple[str, str, str]:
    """(title, what it means, what to do) for a finding kind; a generic text for unknown kinds."""
    matches = [p for p in KIND_HELP if kind_matches(kind, p)]
    if matches:
        return KIND_HELP[max(matches, key=len)]
    return (kind, "A finding the report does not describe further.", "Read the message and the module named.")


def fmt(x: Any, digits: int = 3) -> str:
    """A number for people: 3 significant digits, ints as they are, None as an em dash."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    value = as_float(x)
    if value is None:
        return str(x)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"


def execution_order(entries: list[Entry]) -> list[Entry]:
    """Entries sorted as they ran: step, then phase, then order within the phase."""
    rank = {p: i for i, p in enumerate(PHASES)}
    return sorted(entries, key=lambda e: (e.step, rank.get(e.phase, len(PHASES)), e.order, e.call, e.slot))


def entry_limit(entry: Entry) -> tuple[float, str]:
    """The limit the entry was judged against and the rule that set it (written by compare)."""
    return entry.limit if entry.limit is not None else math.nan, entry.rule or ""


def finding_state(finding: Finding) -> str:
    """"fails gate", "ignored" or "warning": what compare's policy made of the finding."""
    return finding.gate or "warning"


ROOT = "(model)"  # the model's root module, in every renderer (trace keys spell it ".")


def module_label(module: str | None) -> str:
    """A module path for people: the root is ``(model)`` everywhere."""
    return module if module and module != "." else ROOT


def precision_words(run: dict[str, Any]) -> str:
    """A run's precision in a few words: ``bfloat16``, ``float32 under bf16 autocast``,
    ``float32 with fp8 (hybrid) Linear layers``, ``float32 at matmul precision 'high'``."""
    prec = run.get("precision") or {}
    dtype = str(run.get("dtype") or prec.get("dtype") or "?").removeprefix("torch.")
    words = dtype
    autocast = run.get("autocast") or prec.get("autocast")
    if autocast:
        words += f" under {autocast if isinstance(autocast, str) else 'low-precision'} autocast"
    fp8 = run.get("fp8") or prec.get("fp8")
    if fp8:
        words += f" with fp8 ({fp8}) Linear layers"
    emulation = run.get("emulation") or prec.get("emulation") or {}
    matmul = prec.get("matmul_precision")
    if emulation.get("backend"):
        words += f" with {emulation['backend'].upper()} matmuls at {emulation.get('matmul_precision')!r}"
    elif matmul and matmul != "highest":
        words += f" at float32 matmul precision {matmul!r}"
    return words


def precision_pair(report: Any) -> str:
    """What the noise floor allows for, in words: ``bfloat16 vs float32``, or the run's threads
    and kernels when both runs use the same precision."""
    ref, tgt = precision_words(report.reference), precision_words(report.target)
    return f"{tgt} vs {ref}" if ref != tgt else f"{tgt} rounding"


def entry_words(module: str | None, phase: str, slot: str) -> str:
    """An entry in words: ``conv2's forward output``, ``the gradient of fc.weight``,
    ``bn1.running_mean after the optimizer step``."""
    mod = module_label(module)
    kind, _, name = slot.partition(".")
    dotted = f"{mod}.{name}" if module and module != "." else name
    if phase == "forward":
        return f"{mod}'s forward {'output' if kind == 'output' else slot.replace('.', ' ')}"
    if phase == "backward":
        which = {"grad_output": "output", "grad_input": "input"}.get(kind)
        return f"{mod}'s {which} gradient{'' if name in ('', '0') else ' ' + name}" if which else f"{mod}'s {slot}"
    if phase == "grads":
        return f"the gradient of {dotted}"
    if phase == "optimizer":
        return (f"{mod}'s optimizer state {name}" if kind == "state"
                else f"{dotted} after the optimizer step")
    if phase == "params":
        return f"{dotted} before the first step"
    if phase == "loss":
        return "the loss"
    return f"{mod}'s {phase} {slot}"


def conclusion(report: Any) -> str:
    """The report's conclusion in one sentence, in the user's words: what diverged, by how much
    against what precision explains, and whether that is a defect or the price of precision;
    with a drill-down's root cause, a second sentence naming the op and its line."""
    text = _conclusion(report)
    rc = getattr(report, "root_cause", None)
    if rc and rc.get("op"):
        src = rc.get("source") or {}
        if "/nn/modules/" in str(src.get("file")) and rc.get("call_site"):
            src = rc["call_site"]
        where = f" ({os.path.basename(str(src['file']))}:{src.get('line')})" if src.get("file") else ""
        op = str(rc["op"]).removeprefix("aten.").removesuffix(".default")
        text += (f" Root cause: {op} in {module_label(rc.get('module'))}{where}, "
                 f"{fmt(as_float(rc.get('ratio')))}x its own floor.")
    return text


def _conclusion(report: Any) -> str:
    entries = report.entries
    judged = [e for e in entries if e.ratio is not None and e.status != "ignored"]
    pair = precision_pair(report)
    fd = report.first_divergence or {}
    failing_findings = [f for f in report.findings if finding_state(f) == "fails gate"]
    if report.verdict == "pass":
        top = worst(judged, 1)
        if not top:
            return f"The target matches the reference: {len(entries)} tensors, none judged."
        e = top[0]
        return (f"The target matches the reference: all {len(judged)} tensors are within what {pair} "
                f"explains (the worst, {entry_words(e.module, e.phase, e.slot)}, is at "
                f"{fmt(as_float(e.ratio))}x its noise floor).")
    if fd.get("status") == "finding":
        kind = fd.get("finding") or fd.get("slot", "")
        mods = sorted({module_label(f.module) for f in failing_findings if f.kind == kind})
        listed = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        listed = listed or module_label(fd.get("module"))
        what = _first_clause(str(fd.get("where") or ""), fd.get("module"))
        return (f"{explain_kind(kind)[0]} in {len(mods) or 1} module{'s' if len(mods) > 1 else ''} "
                f"({listed}) from step {fd.get('step')}: {what}. A defect on the target, not precision.")
    layout = [f for f in report.findings if f.kind == "layout.loss_normalization"]
    if fd and layout and _normalization_explains(report, fd, layout[0]):  # compare/normalization.py
        d = layout[0].details
        return (f"{entry_words(fd.get('module'), fd.get('phase', ''), fd.get('slot', ''))} at step "
                f"{fd.get('step')} differs because the {d.get('data_parallel_side')}'s loss is a mean of its "
                f"ranks' means over counts that differ between their parts (each rank's part of the "
                f"gradient scaled by {', '.join(f'{x:.4g}' for x in d.get('factors') or [])}): a "
                "difference of the layout, not precision or a defect of the target.")
    if fd:
        what = f"{entry_words(fd.get('module'), fd.get('phase', ''), fd.get('slot', ''))} at step {fd.get('step')}"
        blame = fd.get("blame_module")
        if blame is not None and blame != fd.get("module"):
            what += f" (made by {module_label(blame)})"
        if fd.get("status") == "nonfinite":
            return f"{what} has NaN/Inf where the reference is finite: overflow or a defect on the target."
        ratio = as_float(fd.get("local_ratio"))
        own = ratio is not None and ratio > (as_float(fd.get("ratio")) or 0)
        ratio = ratio if own else as_float(fd.get("ratio"))
        return (f"{what} is {fmt(ratio)}x what {pair} explains"
                f"{' (its own error, replayed on the reference inputs)' if own else ''}: "
                "a defect on the target, not precision.")
    if failing_findings:
        kinds = sorted({f.kind for f in failing_findings})
        return (f"{len(failing_findings)} finding{'s' if len(failing_findings) > 1 else ''} fail the "
                f"gate ({', '.join(kinds)}); no tensor drifts beyond what {pair} explains.")
    bad = [e for e in entries if e.status in FAILING]
    if bad:
        e = bad[0]
        return (f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} do not line up between the runs "
                f"(first: {module_label(e.module)} {e.phase} {e.slot}): the two runs executed "
                "different code.")
    return "The gate failed."


def _normalization_explains(report: Any, fd: dict[str, Any], found: Any) -> bool:
    """Whether a loss normalized per rank can have made the first divergence: a finite entry
    from the finding's step on, and at that step no forward tensor but a scalar (the loss the
    model's own code computes, the ranks' mean of theirs): the forward before the loss is the
    same computation on every layout."""
    if fd.get("status") == "nonfinite" or int(fd.get("step") or 0) < int(found.step or 0):
        return False
    if fd.get("phase") != "forward" or int(fd.get("step") or 0) > int(found.step or 0):
        return True
    e = next((x for x in report.entries if x.key == fd.get("key")), None)
    return e is not None and e.metrics.get("count") == 1


def _first_clause(message: str, module: str | None) -> str:
    """A finding's message without its module prefix, up to its first colon or semicolon."""
    if module and message.startswith(module + ": "):
        message = message[len(module) + 2:]
    for sep in (": ", "; "):
        message = message.split(sep, 1)[0]
    return message.rstrip(".")


def root_cause_lines(rc: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(label, text) rows of a drill-down's root cause, for every renderer: the op, the model-code
    line, its ratio against its floor, its inputs, and the repro."""
    if not rc:
        return []
    rows = [("op", f"{rc.get('op')} ({rc.get('phase')}) in {module_label(rc.get('module'))}, "
                   f"step {rc.get('step')}")]
    src = rc.get("source") or {}
    if src:
        rows.append(("source", f"{src.get('file')}:{src.get('line')}  {src.get('code', '')}".rstrip()))
    site = rc.get("call_site") or {}
    if site and (not src or "/nn/modules/" in str(src.get("file"))):
        rows.append(("called from", f"{site.get('file')}:{site.get('line')}  {site.get('code', '')}".rstrip()))
    rows.append(("ratio", f"{fmt(rc.get('ratio'))} x its floor (error {fmt(rc.get('error'))}, floor "
                          f"{fmt(rc.get('floor'))}, limit {fmt(rc.get('limit'))})"))
    ins = rc.get("inputs") or []
    if ins:
        rows.append(("inputs", ", ".join(f"{tuple(i.get('shape') or [])} {i.get('dtype')}" for i in ins[:6])
                     + (f", +{len(ins) - 6} more" if len(ins) > 6 else "")))
    for k in rc.get("known", []) or []:
        rows.append(("known", str(k)))
    if rc.get("repro"):
        rows.append(("repro", f"python {rc['repro']}"))
    return rows

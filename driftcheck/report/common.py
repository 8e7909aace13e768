"""What the renderers share (terminal.py, html.py, junit.py, markdown.py: a Report in, text out).

Renderers only render: no trace I/O, no judging. What they share lives here: the phase order,
number formatting, the per-entry limit and gate state (written by compare) and what each
finding kind means and what to do about it.
"""
from __future__ import annotations

import math
from typing import Any

from driftcheck.report import Entry, Finding, as_float, worst
from driftcheck.store.format import PHASES, kind_matches

__all__ = ["KIND_HELP", "explain_kind", "fmt", "as_float", "execution_order", "worst",
           "entry_limit", "finding_state", "FAILING"]

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

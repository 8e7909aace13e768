"""Aliasing findings: parameters and buffers whose sharing differs between the runs.

Each trace records which of its parameters and buffers are one tensor or share storage on its
device (manifest ``aliases``, driftcheck/record/aliases.py). Where the reference shares what the
target keeps apart (tied weights that came apart when the model was moved to a lazy, XLA or
PrivateUse1 device), the target trains separate copies: forward and loss can stay bitwise equal
while the tied weight's gradient and update diverge. Traces made before the field existed are
not judged (nothing to compare)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from driftcheck.gate.report import Finding

KIND = "alias.sharing_differs"


def _groups(manifest: dict[str, Any], how: str) -> list[list[str]] | None:
    got = manifest.get("aliases")
    if got is None:
        return None
    return [list(g["tensors"]) for g in got if g.get("how") == how]


def _group_of(groups: list[list[str]]) -> dict[str, frozenset[str]]:
    return {n: frozenset(g) for g in groups for n in g}


def _components(names: Iterable[frozenset[str]]) -> list[set[str]]:
    """The differing names, joined wherever a group on either side joins them."""
    comps: list[set[str]] = []
    for group in names:
        touching = [c for c in comps if c & group]
        merged = set(group).union(*touching)
        comps = [c for c in comps if not c & group] + [merged]
    return comps


def sharing_findings(ref: dict[str, Any], tgt: dict[str, Any], step: int = 0) -> list[Finding]:
    """One ``alias.sharing_differs`` finding per set of tensors whose sharing differs between
    the reference manifest ``ref`` and the target's ``tgt``; none where either lacks the field.
    Tensors that are one tensor on one side only (tied weights) fail the gate: the gradient and
    update differ for certain. Storage shared on one side only (views) is a warning: it changes
    the result only where a write through one is meant to reach the other."""
    findings = []
    for how in ("tied", "storage"):
        ref_groups, tgt_groups = _groups(ref, how), _groups(tgt, how)
        if ref_groups is None or tgt_groups is None:
            return []
        findings += _differences(ref_groups, tgt_groups, how, step)
    return findings


def _differences(ref_groups: list[list[str]], tgt_groups: list[list[str]], how: str,
                 step: int) -> list[Finding]:
    ref_of, tgt_of = _group_of(ref_groups), _group_of(tgt_groups)
    differing = [ref_of.get(n, frozenset((n,))) | tgt_of.get(n, frozenset((n,)))
                 for n in sorted(set(ref_of) | set(tgt_of))
                 if ref_of.get(n, frozenset((n,))) != tgt_of.get(n, frozenset((n,)))]
    order = [n for g in ref_groups + tgt_groups for n in g]  # the owner (first name) first
    findings = []
    for comp in _components(differing):
        names = sorted(comp, key=order.index)
        ref_in = [g for g in ref_groups if comp & set(g)]
        tgt_in = [g for g in tgt_groups if comp & set(g)]
        # what the reference shares and the target does not (tied weights that came apart)
        split = any(not ref_of[n] <= tgt_of.get(n, frozenset((n,))) for n in comp if n in ref_of)
        findings.append(Finding(
            KIND, names[0].rpartition(".")[0], step, _message(names, ref_in, tgt_in, how, split),
            phase="params", severity="error" if how == "tied" else "warning",
            details={"tensors": names, "how": how, "reference": ref_in, "target": tgt_in,
                     "untied_on_target": split}))
    return findings


def _sharing(names: list[str], shared: list[list[str]], how: str) -> str:
    alone = [n for n in names if not any(n in g for g in shared)]
    parts = [" and ".join(g) + (" are one tensor (tied)" if how == "tied" else " share storage")
             for g in shared]
    if alone:
        parts.append(", ".join(alone) + (" is its own tensor" if len(alone) == 1 else " are separate tensors"))
    return "; ".join(parts)


def _message(names: list[str], ref_in: list[list[str]], tgt_in: list[list[str]], how: str,
             split: bool) -> str:
    head = (f"the sharing of {', '.join(names)} differs: on the reference {_sharing(names, ref_in, how)}; "
            f"on the target {_sharing(names, tgt_in, how)}. ")
    if how == "storage":
        return head + ("A write through one of them no longer reaches the other on the "
                       f"{'target' if split else 'reference'} (views of one buffer, or parameters "
                       "carved out of one flat buffer, moved tensor by tensor). A warning: it changes "
                       "the result only where code relies on that write; make the views again after "
                       "moving the model, or do not rely on them.")
    if not split:
        return head + ("The target trains as one tensor what the reference keeps apart: their "
                       "gradients are summed there. Look for a tie the target's code makes on that "
                       "device only.")
    owner, *held = next(g for g in ref_in if len(g) > 1)
    fix = "; ".join(f"model.{h} = model.{owner}" for h in held[:3])
    return head + ("The target trains them as separate copies, so the gradient and update of the "
                   "shared tensor diverge from the reference's (forward and loss can still agree). "
                   "Moving a model to a device without a compatible shallow-copy type (lazy tensors, "
                   "torch_xla, PrivateUse1 backends) replaces its parameters and unties them. Tie them "
                   "again after moving the model: `model.tie_weights()` for Hugging Face models, or "
                   f"assign the shared tensor again (`{fix}`).")


def explain_extras(findings: list[Finding], untying: list[Finding]) -> None:
    """The target's own entries of a tensor it untied (the head's weight, its gradient and
    optimizer state, recorded apart from the embedding there) are no alignment defect of their
    own: each such ``alignment.extra_in_target`` finding says so and becomes a warning."""
    held: dict[str, list[str]] = {}
    for f in untying:
        if f.severity == "error" and (f.details or {}).get("untied_on_target"):
            for name in f.details["tensors"][1:]:
                mod, _, leaf = name.rpartition(".")
                held.setdefault(mod, []).append(leaf)
    for f in findings:
        if f.kind == "alignment.extra_in_target" and f.module in held:
            names = ", ".join(f"{f.module}.{leaf}" if f.module else leaf for leaf in held[f.module])
            f.severity = "warning"
            f.message += (f": {names} is a tensor of its own on the target, recorded apart "
                          f"from the one it is tied to on the reference ({KIND})")

"""The comparison report: value objects and their JSON form (schema in docs/report-format.md).

Pure data: no torch, no filesystem. ``Report.to_dict()`` / ``Report.from_dict()`` are the JSON
contract that renderers (terminal, HTML, JUnit, Markdown) and ``driftcheck report`` read.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from driftcheck.gate.finding import Finding
from driftcheck.gate.jsonform import as_float, clean, num, plain, unnum
from driftcheck.gate.policy import Policy, gate_state

__all__ = ["DRIFT", "IGNORED", "MISALIGNED", "NONFINITE", "OK", "SCHEMA", "Entry", "Finding", "Report",
           "as_float", "worst"]

SCHEMA = "driftcheck.report/1"

# Entry status values.
OK = "ok"              # within the limit
DRIFT = "drift"        # ratio above the limit: counts against the gate
NONFINITE = "nonfinite"  # NaN/Inf in the target that the reference lacks
MISALIGNED = "misaligned"  # shape/dtype mismatch or missing on one side
IGNORED = "ignored"    # matched a policy ignore rule (reason kept in `rule`)


@dataclasses.dataclass
class Entry:
    """One aligned tensor pair: its metrics, its noise floor and their ratio."""

    key: str
    module: str
    phase: str
    step: int
    call: int
    slot: str
    order: int
    metrics: dict[str, Any]
    floor: float | None
    ratio: float | None
    status: str
    decided_by: str | None = None  # "analytic" | "truth" | "control" | "exact" | None
    local_ratio: float | None = None  # from local replay, when recorded
    rule: str | None = None  # the policy rule that judged this entry
    limit: float | None = None  # the limit its ratio was judged against
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return plain(self)  # clean(dataclasses.asdict(self)), without its deep copies


@dataclasses.dataclass
class Report:
    """The result of comparing a target trace against a reference trace.

    Its truth value means "passed" (``bool(report)`` is ``verdict == "pass"``).
    """

    verdict: str
    reference: dict[str, Any]
    target: dict[str, Any]
    first_divergence: dict[str, Any] | None
    entries: list[Entry]
    findings: list[Finding]
    limit: float
    decided_by: str = ""  # one sentence: the rule that decided the verdict
    truth: dict[str, Any] | None = None
    control: dict[str, Any] | None = None  # the control run's metadata, where one was compared
    warnings: list[str] = dataclasses.field(default_factory=list)
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    root_cause: dict[str, Any] | None = None  # the op a drill-down named (driftcheck/drill)
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        if any(e.limit is None for e in self.entries) or any(f.gate is None for f in self.findings):
            _apply_policy(self)

    def __bool__(self) -> bool:
        return self.verdict == "pass"

    def worst(self, n: int = 10) -> list[Entry]:
        """The ``n`` judged entries with the largest ratio; NaN first."""
        return worst(self.entries, n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "verdict": self.verdict,
            "decided_by": self.decided_by,
            "limit": num(self.limit),
            # run metadata comes from trace files: whatever they hold must still make valid JSON
            "reference": clean(self.reference),
            "target": clean(self.target),
            "truth": clean(self.truth),
            "control": clean(self.control),
            "first_divergence": clean(self.first_divergence),
            "root_cause": clean(self.root_cause),
            "warnings": list(self.warnings),
            "policy": clean(self.policy),
            "entries": [e.to_dict() for e in self.entries],
            "findings": [f.to_dict() for f in self.findings],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        if not isinstance(d, dict) or not str(d.get("schema", "")).startswith("driftcheck.report/"):
            raise ValueError("not a driftcheck report (missing or unknown 'schema')")
        if d["schema"] != SCHEMA:
            raise ValueError(f"report schema {d['schema']!r} is not supported (expected {SCHEMA!r})")
        entries = [Entry(**_only(Entry, e)) for e in d.get("entries", [])]
        findings = [Finding(**_only(Finding, f)) for f in d.get("findings", [])]
        return cls(
            verdict=d["verdict"], reference=d.get("reference", {}), target=d.get("target", {}),
            first_divergence=unnum(d.get("first_divergence")), entries=entries, findings=findings,
            limit=float(unnum(d.get("limit")) or 0.0), decided_by=d.get("decided_by", ""),
            truth=d.get("truth"), control=d.get("control"), warnings=list(d.get("warnings", [])),
            policy=d.get("policy", {}),
            root_cause=unnum(d.get("root_cause")),
        )


def worst(entries: list[Entry], n: int = 10) -> list[Entry]:
    """The ``n`` judged entries with the largest ratio; NaN/Inf (also as JSON strings) first."""
    def key(e: Entry) -> float:
        ratio = as_float(e.ratio)
        return math.inf if ratio is not None and math.isnan(ratio) else (ratio or 0.0)

    return sorted((e for e in entries if e.ratio is not None), key=key, reverse=True)[:n]


def _apply_policy(report: Report) -> None:
    """Each entry's limit and each finding's gate state, from the policy embedded in the report,
    where they are missing: compare writes them (the policy is applied once, there); a report
    saved before they existed, or made by hand, gets them here, so renderers never judge."""
    policy = Policy.from_dict(report.policy)
    override = as_float((report.policy or {}).get("limit_override"))
    if override is not None:
        policy.limit, policy.overrides = override, []
    for e in report.entries:
        if e.limit is None:
            e.limit, rule = policy.limit_for(e.module, e.phase)
            e.rule = e.rule or rule
    for f in report.findings:
        if f.gate is None:
            f.gate = gate_state(f, policy)
            reason = policy.ignore_reason(f.module, f.phase, f.step, f.kind)
            if reason:
                f.details = dict(f.details or {}, ignored=reason)


def _only(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: unnum(v) for k, v in d.items() if k in names}

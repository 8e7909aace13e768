"""The comparison report: value objects and their JSON form (schema in docs/report-format.md).

Pure data: no torch, no filesystem. ``Report.to_dict()`` / ``Report.from_dict()`` are the JSON
contract that renderers (terminal, HTML, JUnit, Markdown) and ``driftcheck report`` read.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

SCHEMA = "driftcheck.report/1"

# Entry status values.
OK = "ok"              # within the limit
DRIFT = "drift"        # ratio above the limit: counts against the gate
NONFINITE = "nonfinite"  # NaN/Inf in the target that the reference lacks
MISALIGNED = "misaligned"  # shape/dtype mismatch or missing on one side
IGNORED = "ignored"    # matched a policy ignore rule (reason kept in `rule`)


@dataclasses.dataclass
class Finding:
    """A named, non-numeric observation: ``kind`` is dotted (``batchnorm.*``, ``view.*`` ...)."""

    kind: str
    module: str
    step: int | None
    message: str
    phase: str | None = None
    key: str | None = None
    severity: str = "error"  # "error" fails the gate by default, "warning" does not
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))


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
    decided_by: str | None = None  # "analytic" | "truth" | "exact" | None
    local_ratio: float | None = None  # from local replay, when recorded
    rule: str | None = None  # the policy rule that judged this entry
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))


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
    warnings: list[str] = dataclasses.field(default_factory=list)
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema: str = SCHEMA

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
            "limit": _num(self.limit),
            # run metadata comes from trace files: whatever they hold must still make valid JSON
            "reference": _clean(self.reference),
            "target": _clean(self.target),
            "truth": _clean(self.truth),
            "first_divergence": _clean(self.first_divergence),
            "warnings": list(self.warnings),
            "policy": _clean(self.policy),
            "entries": [e.to_dict() for e in self.entries],
            "findings": [f.to_dict() for f in self.findings],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        if not isinstance(d, dict) or not str(d.get("schema", "")).startswith("driftcheck.report/"):
            raise ValueError("not a driftcheck report (missing or unknown 'schema')")
        if d["schema"] != SCHEMA:
            raise ValueError(f"report schema {d['schema']!r} is not supported (expected {SCHEMA!r})")
        entries = [Entry(**_only(Entry, e)) for e in d.get("entries", [])]
        findings = [Finding(**_only(Finding, f)) for f in d.get("findings", [])]
        return cls(
            verdict=d["verdict"], reference=d.get("reference", {}), target=d.get("target", {}),
            first_divergence=_unnum(d.get("first_divergence")), entries=entries, findings=findings,
            limit=float(_unnum(d.get("limit")) or 0.0), decided_by=d.get("decided_by", ""),
            truth=d.get("truth"), warnings=list(d.get("warnings", [])), policy=d.get("policy", {}),
        )


def as_float(x: Any) -> float | None:
    """A metric value as a float: numbers, the JSON spellings "inf"/"-inf"/"nan", or None."""
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def worst(entries: list[Entry], n: int = 10) -> list[Entry]:
    """The ``n`` judged entries with the largest ratio; NaN/Inf (also as JSON strings) first."""
    def key(e: Entry) -> float:
        ratio = as_float(e.ratio)
        return math.inf if ratio is not None and math.isnan(ratio) else (ratio or 0.0)

    return sorted((e for e in entries if e.ratio is not None), key=key, reverse=True)[:n]


def _only(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: _unnum(v) for k, v in d.items() if k in names}


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _unnum(x: Any) -> Any:
    # Undo _num: the JSON spellings of inf/nan come back as floats.
    if isinstance(x, str) and x in _SPECIAL:
        return _SPECIAL[x]
    if isinstance(x, dict):
        return {k: _unnum(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unnum(v) for v in x]
    return x


def _num(x: Any) -> Any:
    # JSON has no inf/nan: encode them as strings so the report always parses.
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return _num(x)

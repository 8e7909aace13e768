"""A finding: a named, non-numeric observation of a run (``batchnorm.*``, ``view.*`` ...).

Pure data with its JSON form; the policy (gate/policy.py) decides whether it fails the gate.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from driftcheck.gate.jsonform import plain


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
    gate: str | None = None  # how the policy treats it: "fails gate", "ignored" or "warning"
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = plain(self)  # clean(dataclasses.asdict(self)), without its deep copies
        if d["gate"] is None:  # not judged yet (a trace's own findings, in its manifest)
            del d["gate"]
        return d

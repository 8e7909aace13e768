"""The BatchNorm running-stat audit as the tracer runs it (audit/batchnorm.py judges a call):
eager calls audited at their post-hook, calls inside a compiled graph at the end of the step
(their buffers are written back after the graph)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from driftcheck.audit import batchnorm as bn_audit
from driftcheck.record.calls import CallKey
from driftcheck.record.capture import Capture
from driftcheck.targets import deferred


class NormAudit:
    """Each tracked norm's buffers before its call, audited against them after.

    Args:
        enabled: the audit runs (else every method does nothing).
        capture: for the step being traced and the view audit's pause.
        findings: where the audit's findings go (the run's).
    """

    def __init__(self, enabled: bool, capture: Capture, findings: list[dict[str, Any]]) -> None:
        self.enabled = enabled
        self.capture = capture
        self.findings = findings
        self.step_start: dict[str, Any] = {}  # a tracked norm's buffers at the step's start
        self.reset()

    def reset(self) -> None:
        self._before: dict[CallKey, tuple[Any, torch.Tensor]] = {}
        # a deferred device's calls: (name, call, module, input, before, after) device-side
        # copies, audited after the step's sync point (reading them earlier would be one)
        self.later: list[tuple[str, int, nn.Module, torch.Tensor, Any, Any]] = []
        self.deferred: list[tuple[str, int, torch.Tensor]] = []  # tapped norms' calls

    def enter(self, name: str, call: int, module: nn.Module, x: torch.Tensor, compiled: bool) -> None:
        """A call of ``module`` begins on input ``x``: its buffers and input kept."""
        if not (self.enabled and bn_audit.is_tracked_norm(module)):
            return
        with self.capture.quiet():
            if compiled:  # buffers are written back after the graph: audited at step end
                self.deferred.append((name, call, x.detach().clone()))
            else:
                self._before[(name, call)] = (bn_audit.snapshot(module), deferred.copy(x.detach()))

    def leave(self, name: str, call: int, module: nn.Module) -> None:
        """The call ends: its buffers audited against those kept at its start."""
        if (name, call) not in self._before:
            return
        before, x = self._before.pop((name, call))
        if self.capture.deferred:
            with self.capture.quiet():
                self.later.append((name, call, module, x, before, bn_audit.snapshot(module)))
            return
        self._audit(name, call, module, x, before)

    def audit_later(self) -> None:
        """After a deferred device's sync point: the audits its calls left for then."""
        last = {name: call for name, call, *_ in self.later}
        for name, call, module, x, before, after in self.later:
            if call != last[name]:
                continue  # the buffers are known only at the step's end: its last call's
            # the buffers as the sync point left them (a read in the step's graph may run before
            # the backend's in-place update), all on the host: the audit computes there
            after = bn_audit.snapshot(module)
            x = x.cpu()
            before, after = ({k: None if v is None else v.cpu() for k, v in snap.items()}
                             for snap in (before, after))
            with self.capture.quiet():
                found = bn_audit.audit_call(name, module, x, before, after, module.training,
                                            self.capture.step, call)
            self.findings.extend(f.to_dict() for f in found)
        self.later.clear()

    def _audit(self, name: str, call: int, module: nn.Module, x: torch.Tensor, before: Any) -> None:
        with self.capture.quiet():
            found = bn_audit.audit_call(name, module, x, before, bn_audit.snapshot(module),
                                        module.training, self.capture.step, call)
        self.findings.extend(f.to_dict() for f in found)

    def audit_deferred(self, by_name: dict[str, nn.Module], counts: dict[str, int]) -> None:
        """The audit of calls inside a compiled graph: each call is audited against the buffers
        at the end of the step (exact for a norm called once a step, as nearly all are; later
        calls are skipped). ``counts``: the step's calls of each module."""
        for name, call, x in self.deferred:
            if call != 0 or counts.get(name, 0) != 1:
                continue
            before = self.step_start.get(name)
            if before is None:
                continue
            self._audit(name, call, by_name[name], x, before)
        self.deferred.clear()
        self.snapshot(by_name)

    def snapshot(self, by_name: dict[str, nn.Module]) -> None:
        """The tracked norms' buffers now: the start of the next step."""
        self.step_start = {name: bn_audit.snapshot(m) for name, m in by_name.items()
                           if self.enabled and bn_audit.is_tracked_norm(m)}

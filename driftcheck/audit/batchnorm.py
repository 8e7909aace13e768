"""The BatchNorm running-statistics audit: did each training call update the buffers correctly?

A self-check that needs no reference run. Around every call of a norm layer that tracks running
statistics, the tracer snapshots the buffers before and after; ``audit_call`` recomputes, from the
call's input, the update PyTorch's ``_BatchNorm.forward`` / ``_InstanceNorm`` dictate and compares:

    running_mean <- (1 - f) * running_mean + f * batch_mean
    running_var  <- (1 - f) * running_var  + f * batch_var_unbiased
    f = momentum, or 1 / num_batches_tracked when momentum is None (BatchNorm only;
        InstanceNorm passes 0 and never advances the counter)

The torch_tpu 0.2.0 training kernel never writes ``running_mean``/``running_var`` while the counter
(incremented in Python) still advances: ``batchnorm.running_stats_not_updated``. Models then train
normally and evaluate wrongly, which no activation comparison of a training step would reveal.

Tracer wiring (per tracked norm module ``m`` at module path ``path``):
    forward pre-hook:  before = snapshot(m)
    forward hook:      findings += audit_call(path, m, inputs[0], before, snapshot(m),
                                              m.training, step, call)
"""
from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from driftcheck.gate.report import Finding
from driftcheck.numerics import dtypes
from driftcheck.targets import deferred

__all__ = ["audit_call", "is_tracked_norm", "snapshot"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# Slack on top of the roundoff model: the kernel's own summation order and update formula
# (fused multiply-add or not, Welford or two-pass) are unknown; real defects are far larger.
_SLACK = 4.0


def is_tracked_norm(module: nn.Module) -> bool:
    """True for BatchNorm*/SyncBatchNorm/InstanceNorm* (and subclasses) that track running stats."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and bool(module.track_running_stats)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Device-side clones of ``running_mean``, ``running_var`` and ``num_batches_tracked``.

    Clones, not references: the kernel updates the buffers in place. Buffers that are None or
    not yet materialised (lazy modules) are recorded as None and skipped by ``audit_call``.
    """
    snap: dict[str, torch.Tensor | None] = {}
    for name in _BUFFERS:
        buf = getattr(module, name, None)
        is_lazy = isinstance(buf, nn.parameter.UninitializedBuffer)
        snap[name] = None if buf is None or is_lazy else deferred.copy(buf.detach())
    return snap


def audit_call(
    path: str,
    module: nn.Module,
    input: torch.Tensor,
    before: dict[str, torch.Tensor | None],
    after: dict[str, torch.Tensor | None],
    training: bool,
    step: int,
    call: int,
) -> list[Finding]:
    """Check one call of a tracked norm layer; returns its findings (empty when correct).

    Args:
        path: the module path (``named_modules()``), used in the findings.
        module: the norm module (its momentum, and whether it is an InstanceNorm, are read).
        input: the call's input tensor, as the module received it.
        before, after: ``snapshot(module)`` taken in the forward pre-hook and the forward hook.
        training: ``module.training`` during the call.
        step, call: the training step and this module's call index within it.

    Finding kinds: ``batchnorm.running_stats_not_updated``, ``batchnorm.running_stats_wrong``,
    ``batchnorm.counter_not_advanced``, ``batchnorm.counter_wrong``, ``batchnorm.updated_in_eval``.
    """
    b = {k: _host(v) for k, v in before.items()}
    a = {k: _host(v) for k, v in after.items()}
    details: dict[str, Any] = {"call": call}
    moved = {k: _moved(b.get(k), a.get(k)) for k in _BUFFERS}

    def finding(kind: str, message: str, **extra: Any) -> Finding:
        return Finding(kind=kind, module=path, step=step, phase="forward",
                       message=f"{path or '<model>'}: {message}", details={**details, **extra})

    if not training:
        names = [k for k in _BUFFERS if moved[k]]
        if not names:
            return []
        return [finding("batchnorm.updated_in_eval",
                        f"{', '.join(names)} changed in eval mode; evaluation must leave running "
                        "statistics untouched (is the backend ignoring training=False?)",
                        buffers=names)]

    findings: list[Finding] = []
    instance = isinstance(module, nn.modules.instancenorm._InstanceNorm)
    delta = _counter_delta(b.get("num_batches_tracked"), a.get("num_batches_tracked"))
    expected_delta = 0 if instance else 1  # InstanceNorm never touches the counter
    if delta is not None and delta != expected_delta:
        if delta == 0:
            findings.append(finding(
                "batchnorm.counter_not_advanced",
                "num_batches_tracked did not advance in a training call; momentum=None averages "
                "and checkpoints built on it will be wrong", advanced_by=0))
        else:
            findings.append(finding(
                "batchnorm.counter_wrong",
                f"num_batches_tracked advanced by {delta} in one call (expected {expected_delta})",
                advanced_by=delta))

    if b.get("running_mean") is None or b.get("running_var") is None:
        return findings
    if a.get("running_mean") is None or a.get("running_var") is None:
        return findings + [finding("batchnorm.running_stats_wrong",
                                   "running_mean/running_var disappeared during the call")]

    factor = _factor(module, instance, b.get("num_batches_tracked"))
    details["factor"] = factor
    if instance and input.dim() == cast(Any, module)._get_no_batch_dim():  # _InstanceNorm's own
        input = input.unsqueeze(0)  # unbatched (C, *): _InstanceNorm runs it as a batch of one
    batch_mean, batch_var, scale_mean, scale_var, n = _batch_stats(input, instance)
    u_buf = dtypes.unit_roundoff(_present(before["running_mean"]).dtype)
    u_acc = dtypes.unit_roundoff(_opmath(input.dtype)) + dtypes.unit_roundoff(_acc_dtype(input))
    checks = []
    for name, batch, scale in (("running_mean", batch_mean, scale_mean),
                               ("running_var", batch_var, scale_var)):
        old = _present(b[name]).to(torch.float64)
        new = _present(a[name]).to(torch.float64)
        expected = (1.0 - factor) * old + factor * batch
        # Roundoff of the update (buffer dtype) plus that of the batch statistics (accumulation
        # dtype, ~sqrt(n) growth), both measured against magnitudes, not the result.
        magnitude = (1.0 - factor) * old.abs() + factor * batch.abs() + expected.abs()
        tol = _SLACK * (u_buf * magnitude + factor * u_acc * math.sqrt(n) * scale)
        tol = tol + dtypes.tiny(dtypes.name_of(_present(before[name]).dtype))
        checks.append((name, old, new, expected, tol))

    any_moved = moved["running_mean"] or moved["running_var"]
    update_due = any(bool(((exp - old).abs() > tol).any()) for _, old, _, exp, tol in checks)
    if not any_moved:
        if update_due:
            advanced = delta is not None and delta > 0
            message = ("running_mean/running_var were not updated in a training call"
                       + (" although num_batches_tracked advanced: the torch_tpu 0.2.0 BatchNorm "
                          "signature (the kernel never writes the running buffers); training "
                          "looks normal but evaluation will use stale statistics and be wrong"
                          if advanced else ""))
            findings.append(finding("batchnorm.running_stats_not_updated", message,
                                    counter_advanced=advanced))
        return findings

    worst: dict[str, Any] = {}
    for name, _, new, expected, tol in checks:
        err = (new - expected).abs()
        err = torch.where(torch.isnan(new) & torch.isnan(expected), torch.zeros_like(err), err)
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        ratio = err / tol
        c = int(torch.argmax(ratio))
        if float(ratio[c]) > 1.0 and (not worst or float(ratio[c]) > worst["ratio"]):
            worst = {"buffer": name, "channel": c, "ratio": float(ratio[c]),
                     "max_abs_error": float(err.max()), "tolerance": float(tol[c]),
                     "expected": float(expected[c]), "actual": float(new[c])}
    if worst:
        findings.append(finding(
            "batchnorm.running_stats_wrong",
            f"{worst['buffer']}[{worst['channel']}] = {worst['actual']:.6g}, the update dictates "
            f"{worst['expected']:.6g} (error {worst['max_abs_error']:.3g}, "
            f"{worst['ratio']:.3g}x its roundoff tolerance)", **worst))
    return findings


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu")


def _moved(before: torch.Tensor | None, after: torch.Tensor | None) -> bool:
    if before is None or after is None:
        return (before is None) != (after is None)
    if before.shape != after.shape or before.dtype != after.dtype:
        return True
    if not before.is_floating_point():
        return not torch.equal(before, after)
    # NaN == NaN here: a NaN buffer that stays NaN did not move.
    return not bool(((before == after) | (torch.isnan(before) & torch.isnan(after))).all())


def _counter_delta(before: torch.Tensor | None, after: torch.Tensor | None) -> int | None:
    if before is None or after is None:
        return None
    return int(after.item()) - int(before.item())


def _present(t: torch.Tensor | None) -> torch.Tensor:
    """A running statistic already known to be there (checked before the update is judged)."""
    if t is None:
        raise ValueError("a running statistic disappeared")
    return t


def _factor(module: nn.Module, instance: bool, counter_before: torch.Tensor | None) -> float:
    momentum = cast(Any, module).momentum  # a norm layer's: a float or None
    if momentum is not None:
        return float(momentum)
    if instance:
        return 0.0  # _InstanceNorm passes momentum 0.0 when it is None
    # _BatchNorm: cumulative average over the batches seen, counter already incremented.
    count = 1 if counter_before is None else int(counter_before.item()) + 1
    return 1.0 / float(count)


def _batch_stats(x: torch.Tensor, instance: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-channel batch mean, unbiased variance, their magnitude scales, and the count.

    Computed on the input's device in float64 where it has it (float32 elsewhere: TPU, MPS), so
    only C-sized vectors travel to the host.
    """
    x = x.detach().to(_acc_dtype(x))
    if instance:
        # (N, C, *) -> per-instance stats over the spatial dims, averaged over the batch.
        flat = x.reshape(x.shape[0], x.shape[1], -1)  # (N, C, S)
        n = flat.shape[2]
        mean_i = flat.mean(dim=2)
        var_i = flat.var(dim=2, unbiased=True)
        mean, var = mean_i.mean(dim=0), var_i.mean(dim=0)
        scale_mean = flat.abs().mean(dim=(0, 2))
        scale_var = flat.pow(2).mean(dim=(0, 2)) * n / max(n - 1, 1)
    else:
        c = x.shape[1]
        flat = x.transpose(0, 1).reshape(c, -1)  # (C, N * spatial)
        n = flat.shape[1]
        mean = flat.mean(dim=1)
        var = flat.var(dim=1, unbiased=True)
        scale_mean = flat.abs().mean(dim=1)
        scale_var = flat.pow(2).mean(dim=1) * n / max(n - 1, 1)
    host = [t.to("cpu", torch.float64) for t in (mean, var, scale_mean, scale_var)]
    return host[0], host[1], host[2], host[3], n


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.device.type in ("cpu", "cuda") else torch.float32


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

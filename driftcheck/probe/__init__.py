"""The view/in-place conformance suite behind ``driftcheck probe --device DEV``.

Each program is a few lines of ordinary PyTorch that depend on view and in-place semantics
(index assignment, slices, transposes, ``out=``, ``_foreach_*_`` as optimizers use them, the
BatchNorm buffer update, version counters). It runs on the reference (CPU) and on the device from
identical CPU-made inputs, and returns its results (moved to CPU) plus alias facts: "y is a view
of x", "the base changed", "the version counter bumped", "it raised". A conforming backend matches
the reference in both. Values are exact for the same device type, within a bf16-class tolerance
otherwise (TPU fp32 matmuls run as bf16 passes by default).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.probe import inplace, views
from driftcheck.probe.programs import MEMORY_FACTS, Program
from driftcheck.targets.devices import init_backend, storage_inspectable

# The suite, in order: views written through first, then in-place ops.
PROGRAMS: dict[str, Program] = {**views.PROGRAMS, **inplace.PROGRAMS}

__all__ = ["PROGRAMS", "ProbeResult", "probe_document", "run_probe"]


# Cross-device tolerance (assert_close's bf16 pair): values here are small integers, so only the
# matmul, batch-norm and lerp programs can differ at all on a correct backend.
_RTOL, _ATOL = 1.6e-2, 1e-5


@dataclasses.dataclass
class ProbeResult:
    """One program's verdict; its truth value means "passed"."""

    name: str
    status: str  # "pass" | "mismatch" | "error"
    detail: str = ""

    def __bool__(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def run_probe(device: str, reference: str = "cpu",
              fault: Callable[[], Any] | None = None) -> list[ProbeResult]:
    """Run every program on ``reference`` and on ``device`` and compare values and alias facts.

    Args:
        device: the device under test (``"tpu"``, ``"cuda:0"``, ``"cpu"`` ...).
        reference: the trusted device.
        fault: a context-manager factory (``driftcheck.targets.simulate.*``) applied around the device
            runs only, to prove the suite catches a given defect.
    """
    ref_dev, dev = _device(reference), _device(device)
    exact = ref_dev.type == dev.type
    # On a backend without inspectable storage (lazy: functionalized views, no data_ptr) the
    # memory facts are not compared; each program that has some says which it left out.
    unseen = frozenset() if storage_inspectable(dev.type) else MEMORY_FACTS
    results = []
    for name, program in PROGRAMS.items():
        try:
            expected = program(ref_dev)
        except Exception as err:
            results.append(ProbeResult(name, "error", f"reference {reference} raised: {err!r}"))
            continue
        try:
            with fault() if fault is not None else contextlib.nullcontext():
                actual = program(dev)
        except Exception as err:
            results.append(ProbeResult(name, "error", f"{device} raised: {_short(err)}"))
            continue
        problems = _differences(expected, actual, exact, unseen)
        skipped = sorted(unseen & (expected.keys() | actual.keys()))
        if skipped:
            problems.append(f"not observable on {dev.type} (no storage to inspect): "
                            f"{', '.join(skipped)}")
        failed = len(problems) > bool(skipped)
        results.append(ProbeResult(name, "mismatch" if failed else "pass", "; ".join(problems)))
    return results


def probe_document(results: list[ProbeResult], device: str, reference: str = "cpu") -> dict[str, Any]:
    """The suite's results as the JSON document ``driftcheck probe --json`` writes."""
    passed = sum(bool(r) for r in results)
    return {"schema": "driftcheck.probe/1", "device": device, "reference": reference,
            "passed": passed, "total": len(results), "results": [r.to_dict() for r in results]}


def _device(name: str) -> torch.device:
    try:
        init_backend(torch.device(name).type)
        dev = torch.device(name)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as err:
        raise DriftcheckError(f"device {name!r} is not usable here ({_short(err)}); check its "
                              "backend is installed and visible, or probe --device cpu") from err
    return dev


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _differences(expected: dict[str, Any], actual: dict[str, Any], exact: bool,
                 unseen: frozenset[str] = frozenset()) -> list[str]:
    problems = []
    for key in sorted((set(expected) | set(actual)) - unseen):
        if key not in actual or key not in expected:
            problems.append(f"{key}: present on one side only")
            continue
        e, a = expected[key], actual[key]
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            if e.shape != a.shape or e.dtype != a.dtype:
                problems.append(f"{key}: {tuple(a.shape)} {a.dtype}, expected "
                                f"{tuple(e.shape)} {e.dtype}")
            elif not _close(e, a, exact):
                diff = (e.double() - a.double()).abs().max().item() if e.numel() else 0.0
                problems.append(f"{key}: values differ (max abs {diff:.3g})")
        elif type(e) is not type(a) or e != a:
            problems.append(f"{key}: {a!r}, expected {e!r}")
    return problems


def _close(e: torch.Tensor, a: torch.Tensor, exact: bool) -> bool:
    if not e.is_floating_point():
        return torch.equal(e, a)
    if exact:  # bitwise, except that NaN matches NaN
        return bool(((e == a) | (e.isnan() & a.isnan())).all())
    return torch.allclose(a, e, rtol=_RTOL, atol=_ATOL, equal_nan=True)

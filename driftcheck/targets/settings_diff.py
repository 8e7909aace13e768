"""Which precision settings differ between two runs, and whether each difference can explain drift.

Pure: two settings dicts of :func:`driftcheck.targets.precision.capture_settings` (as a
manifest holds them) in, rows out; compare's precision finding lists them.
"""
from __future__ import annotations

from typing import Any

# Keys whose difference never changes a number (flattened, dotted).
_ATOMIC = ("fp8",)
# The autoload switch only says whether torch_tpu was loaded; torch_tpu_loaded records that fact.
_NOT_NUMERIC = ("host.node", "device.index", "device.count", "matmul_precision_source",
                "env.TORCH_DEVICE_BACKEND_AUTOLOAD")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        # The fp8 recipe is one setting (one row in a diff); an empty dict adds no key, so absent
        # and empty compare equal.
        if isinstance(value, dict) and path not in _ATOMIC:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def explains_drift(key: str) -> bool:
    """Whether a difference in the (dotted) setting ``key`` can change the numbers of a run.

    Everything that selects kernels or rounding does (dtype, autocast, matmul precision, TF32, fp8,
    device type and name, versions, env flags, and the thread count, which changes the order of
    float reductions); the host name and the device index do not.
    """
    return not any(key == name or key.startswith(name + ".") for name in _NOT_NUMERIC)


def diff_settings(ref: dict[str, Any], tgt: dict[str, Any]) -> list[tuple[str, Any, Any, bool]]:
    """The settings that differ between two runs, sorted by dotted key.

    Returns:
        ``(key, reference value, target value, explains_drift)`` per differing leaf; a key absent on
        one side has the value None there.
    """
    flat_ref, flat_tgt = _flatten(ref), _flatten(tgt)
    rows = []
    for key in sorted(set(flat_ref) | set(flat_tgt)):
        a, b = flat_ref.get(key), flat_tgt.get(key)
        if a != b:
            rows.append((key, a, b, explains_drift(key)))
    return rows

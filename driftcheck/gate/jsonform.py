"""The reports' JSON spelling of numbers: JSON has no inf/nan, so they are written as strings
("inf", "-inf", "nan") and read back as floats. Pure: no torch, no filesystem."""
from __future__ import annotations

import math
from typing import Any


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


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def unnum(x: Any) -> Any:
    # Undo _num: the JSON spellings of inf/nan come back as floats.
    if isinstance(x, str) and x in _SPECIAL:
        return _SPECIAL[x]
    if isinstance(x, dict):
        return {k: unnum(v) for k, v in x.items()}
    if isinstance(x, list):
        return [unnum(v) for v in x]
    return x


def num(x: Any) -> Any:
    # JSON has no inf/nan: encode them as strings so the report always parses.
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return num(x)

"""The reports' JSON spelling of numbers: JSON has no inf/nan, so they are written as strings
("inf", "-inf", "nan") and read back as floats; and the reports' JSON text. Pure: no torch, no
filesystem."""
from __future__ import annotations

import dataclasses
import json
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


def plain(x: Any) -> Any:
    """``clean(dataclasses.asdict(x))`` without its deep copies (a report's 480 entries: 60 ->
    10 ms): dataclass instances become dicts of their fields, lists and tuples lists, dicts
    dicts (keys kept), numbers ``num``'s spelling; any other value is kept as it is."""
    t = type(x)
    if t is float:
        return x if x - x == 0.0 else num(x)  # inf - inf and nan - nan are nan
    if t is str or t is int or t is bool or x is None:
        return x
    if t is dict:
        return {k: plain(v) for k, v in x.items()}
    if t is list or t is tuple:
        return [plain(v) for v in x]
    if hasattr(t, "__dataclass_fields__"):  # asdict's order: a dataclass first, then containers
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return num(x)


class _Other(Exception):
    """A value ``dumps`` leaves to the standard library."""


_escape = json.encoder.encode_basestring_ascii  # the standard library's (C) string encoder


def dumps(d: Any) -> str:
    """``json.dumps(d, indent=1, allow_nan=False, default=str)``, the same text twice as fast:
    the standard library indents in its pure-Python encoder (its C encoder cannot indent), a
    generator per container. Here one recursive function writes the reports' JSON (dicts with
    string keys, lists, strings, numbers); anything else (another key or value type, nan or
    inf, a cycle) is left to the standard library, which writes or refuses it as ever."""
    parts: list[str] = []
    try:
        _write(d, "\n", parts)
    except (_Other, RecursionError):
        return json.dumps(d, indent=1, allow_nan=False, default=str)
    return "".join(parts)


def _write(o: Any, nl: str, parts: list[str]) -> None:
    # nl: a newline and the indent of o's own line (one space a level, as indent=1)
    t = type(o)
    if t is str:
        parts.append(_escape(o))
    elif t is float:
        if o - o != 0.0:  # nan or inf: refused with allow_nan=False
            raise _Other
        parts.append(float.__repr__(o))
    elif t is int:
        parts.append(int.__repr__(o))
    elif o is None:
        parts.append("null")
    elif o is True:
        parts.append("true")
    elif o is False:
        parts.append("false")
    elif t is dict:
        if not o:
            parts.append("{}")
            return
        inner = nl + " "
        sep = "{" + inner
        for k, v in o.items():
            if type(k) is not str:
                raise _Other
            parts.append(sep + _escape(k) + ": ")
            _write(v, inner, parts)
            sep = "," + inner
        parts.append(nl + "}")
    elif t is list or t is tuple:
        if not o:
            parts.append("[]")
            return
        inner = nl + " "
        sep = "[" + inner
        for v in o:
            parts.append(sep)
            _write(v, inner, parts)
            sep = "," + inner
        parts.append(nl + "]")
    else:
        raise _Other

"""The reports' JSON text: ``plain`` is ``clean(dataclasses.asdict(x))`` without the deep copies,
``dumps`` is ``json.dumps(d, indent=1, allow_nan=False, default=str)``, the same text."""
from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict, namedtuple
from typing import Any

import pytest

from driftcheck.gate.jsonform import clean, dumps, plain


def _stdlib(d: Any) -> str:
    return json.dumps(d, indent=1, allow_nan=False, default=str)


class _Float(float):
    pass


@dataclasses.dataclass
class _Inner:
    x: float
    names: tuple[str, ...] = ("a", "b")


@dataclasses.dataclass
class _Outer:
    inner: _Inner
    values: list[Any]
    by_name: dict[str, Any]
    other: Any = None


_Pair = namedtuple("_Pair", "a b")

DOCUMENTS = [
    {},
    [],
    "plain",
    "ü ß \u2028 \x00 \"quoted\" \\ </script>",
    0, -1, 2**80, 1.0, -0.0, 1e-300, 5e-324, 1.7976931348623157e308, 0.1 + 0.2,
    True, False, None,
    {"a": [], "b": {}, "c": [[]], "d": [{}], "e": [1, [2, [3, {"f": None}]]]},
    {"t": (1, 2.5, "x"), "nested": {"deeper": {"deepest": [True, False, None]}}},
    [{"k": "v"}, {"k": 1.5e-7}, "s", 3],
    {"ü": "é", "": ""},
    OrderedDict(b=1, a=2),
    {"sub": _Float(2.5), "flag": 1},
    {"pair": _Pair(1, 2)},
    {"set": {1}},                    # not JSON: default=str
    {"path": __import__("pathlib").Path("/x")},
    {1: "int key"}, {2.5: "float key"}, {None: "none key"}, {True: "bool key"},
]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=range(len(DOCUMENTS)))
def test_dumps_writes_what_json_dumps_writes(doc):
    assert dumps(doc) == _stdlib(doc)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, {"x": [1.0, math.nan]}, {"x": _Float("inf")}])
def test_dumps_refuses_nan_and_inf_as_json_dumps_does(bad):
    with pytest.raises(ValueError):
        _stdlib(bad)
    with pytest.raises(ValueError):
        dumps(bad)


def test_dumps_refuses_a_cycle_as_json_dumps_does():
    cyc: list[Any] = []
    cyc.append(cyc)
    with pytest.raises(ValueError, match="Circular"):
        dumps({"c": cyc})


def test_plain_is_clean_asdict():
    """Dataclasses nested anywhere become dicts, tuples and namedtuples lists, nan/inf their
    JSON spellings, dict keys stay as they are, other values as they are."""
    obj = _Outer(_Inner(math.nan), [math.inf, (1, -math.inf), _Inner(2.0, ())], {"k": _Pair(1.0, math.nan),
                 "n": None, "s": {3}, 4: OrderedDict(z=_Float("-inf"))}, other=_Float(1.5))
    got = plain(obj)
    assert got == clean(dataclasses.asdict(obj))
    assert json.dumps(got, default=str) == json.dumps(clean(dataclasses.asdict(obj)), default=str)
    assert got["inner"] == {"x": "nan", "names": ["a", "b"]}
    assert got["by_name"][4] == {"z": "-inf"} and type(got["by_name"][4]) is dict

"""The one walker: slot paths of nested structures (the trace's keys), substitute, and the folds
built on it (the replay batch codec, the op log's argument encoding)."""
from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys

import pytest
import torch

from driftcheck import nested
from driftcheck.drill.oplog import decode_args, encode_args
from driftcheck.errors import DriftcheckError
from driftcheck.store.replay import decode_batch, encode_batch

A, B, C = torch.ones(1), torch.zeros(2), torch.arange(3)
Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Config:
    weight: torch.Tensor
    size: int = 3


class Batch(dict):
    pass


@pytest.mark.parametrize("obj, slots", [
    (A, ["p"]),
    (None, []),
    (7, []),
    ((A, None, [B, {"k": C, 2: A}]), ["p.0", "p.2.0", "p.2.1.k", "p.2.1.2"]),
    ({"b": B, "a": (A, 1.5, "x")}, ["p.b", "p.a.0"]),  # insertion order, not sorted
    (Pair(A, [B]), ["p.0", "p.1.0"]),  # a namedtuple numbered, not named
    (Config(A), []),  # a dataclass is a leaf
    (Batch(x=A), ["p.x"]),  # a dict subclass is walked
    (((((A,),),),), ["p.0.0.0.0"]),
    (torch.Size([2, 3]), []),
])
def test_flatten_slots(obj, slots: list[str]) -> None:
    assert [s for s, _ in nested.flatten(obj, "p")] == slots


def test_flatten_yields_the_tensors_themselves() -> None:
    assert [t for _, t in nested.flatten({"x": [A, B]}, "input")] == [A, B]
    assert all(x is y for (_, x), y in zip(nested.flatten({"x": [A, B]}, "input"), (A, B)))


def test_substitute_rebuilds_plain_containers_with_the_same_slots() -> None:
    seen: list[str] = []
    out = nested.substitute((A, Pair(B, None), {"k": [C, "s"]}), "input",
                            lambda s, t: seen.append(s) or t + 1)
    assert seen == ["input.0", "input.1.0", "input.2.k.0"]
    assert type(out) is tuple and type(out[1]) is tuple  # the namedtuple rebuilt as a tuple
    assert out[1][1] is None and out[2]["k"][1] == "s"
    assert torch.equal(out[0], A + 1) and torch.equal(out[2]["k"][0], C + 1)
    kept = Config(A)
    assert nested.substitute(kept, "x", lambda s, t: t + 1) is kept  # a leaf as it is


def test_fold_lets_a_node_be_refused_before_its_children() -> None:
    visited: list[str] = []

    def fn(path, obj, kind, children):
        visited.append(path)
        if kind == nested.MAPPING:
            raise ValueError(path)
        return [r for _, r in children()]
    with pytest.raises(ValueError, match=r"x\.1"):
        nested.fold((A, {"k": B}), "x", fn)
    assert visited == ["x", "x.0", "x.1"]  # "x.1.k" never visited


def test_hugging_face_cache_and_model_output() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutputWithPast

    cache = transformers.DynamicCache()
    k0, v0, k1, v1 = (torch.full((1, 2, 3, 4), float(i)) for i in range(4))
    cache.update(k0, v0, 0)
    cache.update(k1, v1, 1)
    out = BaseModelOutputWithPast(last_hidden_state=A, hidden_states=(B, C))
    out["cache"] = cache
    slots = dict(nested.flatten(out, "output"))
    assert list(slots) == ["output.last_hidden_state", "output.hidden_states.0",
                           "output.hidden_states.1", "output.cache.0.keys", "output.cache.0.values",
                           "output.cache.1.keys", "output.cache.1.values"]
    assert torch.equal(slots["output.cache.1.values"], v1)
    # substitute keeps the live cache (the model updates it in place) and a plain dict for the output
    rebuilt = nested.substitute(out, "output", lambda s, t: t)
    assert type(rebuilt) is dict and rebuilt["cache"] is cache


def test_batch_codec_round_trip_and_keys() -> None:
    tensors: dict[str, torch.Tensor] = {}
    batch = {"x": (A, [B, None]), "n": 2, "name": "s"}
    desc = encode_batch(batch, "input/3", tensors)
    assert list(tensors) == ["input/3.x.0", "input/3.x.1.0"]
    assert desc["items"]["x"] == {"t": "tuple", "items": [
        {"t": "tensor", "name": "input/3.x.0"},
        {"t": "list", "items": [{"t": "tensor", "name": "input/3.x.1.0"}, {"t": "value", "v": None}]}]}
    back = decode_batch(desc, tensors)
    assert back["n"] == 2 and back["name"] == "s" and back["x"][1][1] is None
    assert back["x"][0] is tensors["input/3.x.0"]


@pytest.mark.parametrize("bad, needle", [({1: A}, "dict keys must be strings"),
                                         ({"x": Config(A)}, "a Config at input/0.x")])
def test_batch_codec_refuses(bad, needle: str) -> None:
    with pytest.raises(DriftcheckError, match=needle):
        encode_batch(bad, "input/0", {})


def test_decode_refuses_a_description_nested_too_deeply() -> None:
    desc: dict = {"t": "value", "v": 1}
    for _ in range(70):
        desc = {"t": "list", "items": [desc]}
    with pytest.raises(DriftcheckError, match="malformed"):
        decode_batch(desc, {})


def test_op_arguments_encode_and_decode() -> None:
    leaves: list[torch.Tensor] = []
    spec = encode_args((A, [B, 2], 0.5), {"dtype": torch.float16, "out": None}, leaves)
    assert leaves == [A, B]
    assert spec == {"args": [{"T": 0}, {"L": [{"T": 1}, 2]}, {"F": "0.5"}],
                    "kwargs": {"dtype": {"dtype": "float16"}, "out": None}}
    args, kwargs = decode_args(spec, leaves)
    assert args[0] is A and args[1][0] is B and args[2] == 0.5 and kwargs["dtype"] is torch.float16
    with pytest.raises(ValueError, match="cannot encode dict"):
        encode_args(({"k": A},), {}, [])


class _Layer:
    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values


class _DuckCache:
    """A Cache by its shape alone (layers with keys/values, get_seq_length), as transformers' are."""

    def __init__(self, layers: list[_Layer]) -> None:
        self.layers = layers

    def get_seq_length(self) -> int:
        return 0


def test_a_cache_is_known_by_its_shape_without_transformers() -> None:
    cache = _DuckCache([_Layer(A, B), _Layer(None, None), _Layer(C, None)])
    assert nested.kind(cache) == nested.CACHE
    assert [s for s, _ in nested.flatten({"past": cache}, "input")] == [
        "input.past.0.keys", "input.past.0.values", "input.past.2.keys"]  # layers not yet filled: none
    code = ("import sys, torch; from driftcheck import nested; "
            "list(nested.flatten(({'a': torch.ones(1)},), 'x')); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr

"""Property-based fuzzing (issue 9) of the manifest reader, the shard reader and the metrics.

The contract under test: whatever the bytes of a trace, reading and comparing it either works or
raises DriftcheckError (one line, exit 2 at the CLI); never another exception, never an allocation
sized by the file. test_metrics.py covers chunking and numpy oracles; here: every dtype the trace
format allows, 0-d and zero-size shapes, and the JSON-safety of what the metrics feed the report.
"""
from __future__ import annotations

import collections
import copy
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import record_trace, write_scenarios
from hypothesis import HealthCheck, event, given, settings, strategies as st

from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.gate.report import Entry, Report
from driftcheck.numerics import stats as tstats
from driftcheck.numerics.metrics import tensor_error
from driftcheck.store import TraceReader, format as fmt

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=20)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    scen = write_scenarios(root)
    ref = record_trace(scen, "build", root / "ref", steps=1)
    tgt = record_trace(scen, "build", root / "tgt", dtype="bf16", replay=ref)
    # stats mode: entries with samples and statistics only, compared on those
    ref_s = record_trace(scen, "build", root / "ref_stats", steps=1, mode="stats")
    tgt_s = record_trace(scen, "build", root / "tgt_stats", dtype="bf16", replay=ref, mode="stats")
    return {"ref": ref, "tgt": tgt, "ref_stats": ref_s, "tgt_stats": tgt_s}


def _read_everything(path: Path) -> None:
    """Open a trace and read every stored tensor both ways (whole and in chunks)."""
    reader = TraceReader(path)
    for e in reader.entries:
        for which in ("tensor", "sample"):
            t = reader.tensor(e, which)
            if t is not None and which == "tensor":
                assert list(t.shape) == list(e["shape"])
            chunks = reader.chunks(e, 7, which)
            if chunks is not None:
                n = sum(c.numel() for c in chunks)
                assert t is None or n == t.numel()
    reader.close()


def _must_work_or_be_a_user_error(fn, *args) -> Any:
    try:
        return fn(*args)
    except DriftcheckError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), msg  # one line
        return e


# -- the manifest reader ----------------------------------------------------------------------
@settings(FUZZ, max_examples=300)
@given(json_values)
def test_validate_manifest_on_arbitrary_json(value):
    try:
        fmt.validate_manifest(value)
    except fmt.FormatError as e:
        assert str(e)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (entries are sampled: a manifest has many alike)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in list(enumerate(obj))[:3] + list(enumerate(obj))[-2:]:
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


@pytest.mark.parametrize("mode", ["full", "stats"])
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_mutated_manifest_reads_and_compares_or_is_a_user_error(traces, mode, data):
    sfx = "_stats" if mode == "stats" else ""
    manifest = json.loads((traces["tgt" + sfx] / "manifest.json").read_text())
    path = data.draw(st.sampled_from(_paths(manifest)), label="path")
    value = data.draw(st.one_of(json_values, st.sampled_from(
        [-1, 0, 2**62, 1.5, float("nan"), "shard-00000.safetensors", "../x", "/etc/passwd", [],
         {}, [2**40], "bfloat16", "int8", "forward", None, True])), label="value")
    delete = data.draw(st.booleans(), label="delete")
    mutated = _set(manifest, path, value, delete)
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "t"
        shutil.copytree(traces["tgt" + sfx], copy)
        (copy / "manifest.json").write_text(json.dumps(mutated))
        if isinstance(_must_work_or_be_a_user_error(_read_everything, copy), DriftcheckError):
            event("refused by the reader")
            return
        result = _must_work_or_be_a_user_error(compare, traces["ref" + sfx], copy)
        event(f"compare: {type(result).__name__}")
        if isinstance(result, Report):
            json.dumps(result.to_dict(), allow_nan=False)  # the report is always strict JSON


class _Opaque:
    def __str__(self) -> str:
        return "opaque"


# What a writer's in-memory manifest may hold that JSON text cannot: tuples, numpy scalars,
# non-string keys, objects ``default`` turns into strings, bools where ints go, float subclasses.
EXOTIC = [np.int64(3), np.float64(1.5), np.float32(2.0), np.bool_(True), _Opaque(), True, False,
          (2, 3), (), {1: "a"}, {"1": 1, 1: 2}, float("nan"), float("inf"), -0.0, 10**30, 0, 1.5,
          "x", None, [1, 2], {}]


def _as_json_would_write(obj: Any) -> Any:
    """What json.dumps(default=str) then json.loads gives: the writer's former encoder."""
    from driftcheck.store.shard import json_default as _json_default

    return fmt.json_safe(obj, default=_json_default)


def test_the_manifest_encoder_writes_what_json_would(traces):
    """store.strict_json (orjson) against the stdlib encoder it replaced, on a real manifest
    with every field set to every awkward value an in-memory manifest may hold: the same data
    back (numpy scalars as numbers, where json wrote some as strings), or the same error."""
    from driftcheck.store import strict_json

    base = json.loads((traces["tgt"] / "manifest.json").read_text())
    stats_entry = next(i for i, e in enumerate(base["entries"]) if e.get("meta"))
    paths = [p for p in _paths(base) if len(p) < 2 or p[:2] in (("entries", 0), ("entries", stats_entry))
             or p[0] != "entries"]
    outcomes = collections.Counter()
    for path in paths:
        for value in EXOTIC:
            m = _set(copy.deepcopy(base), path, value, False)
            try:
                expected = _as_json_would_write(m)
            except (TypeError, ValueError) as e:
                with pytest.raises(type(e)):
                    strict_json(m)
                outcomes["error"] += 1
                continue
            got = json.loads(strict_json(m))  # strict JSON: no NaN tokens
            if isinstance(value, np.generic):  # json called default (str) on most of them
                expected = _set(expected, path, value.item(), False)
            assert got == expected, (path, value)
            outcomes["same"] += 1
    assert outcomes["same"] > 500, outcomes


@settings(FUZZ, max_examples=200)
@given(value=json_values)
def test_the_manifest_encoder_round_trips_any_json(value):
    from driftcheck.store import strict_json

    assert json.loads(strict_json(value)) == value


# -- the shard reader ---------------------------------------------------------------------------
edits = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("header_len"), st.integers(0, 2**64 - 1), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 64), st.integers(0, 255)),
)


@pytest.mark.parametrize("mode", ["full", "stats"])
@settings(FUZZ, max_examples=80)
@given(ops=st.lists(edits, min_size=1, max_size=3), fix_size=st.booleans())
def test_corrupted_shard_bytes_are_caught(traces, mode, ops, fix_size):
    sfx = "_stats" if mode == "stats" else ""
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "t"
        shutil.copytree(traces["tgt" + sfx], copy)
        shard = copy / "shard-00000.safetensors"
        data = bytearray(shard.read_bytes())
        for op, a, b in ops:
            if op == "flip" and data:
                data[a % len(data)] ^= b
            elif op == "truncate":
                del data[a % (len(data) + 1):]
            elif op == "header_len" and len(data) >= 8:
                data[:8] = struct.pack("<Q", a)
            elif op == "append":
                data += bytes([b]) * a
        shard.write_bytes(bytes(data))
        if fix_size:  # the manifest "agrees": only the shard's own header can tell
            m = json.loads((copy / "manifest.json").read_text())
            m["shards"][shard.name] = len(data)
            (copy / "manifest.json").write_text(json.dumps(m))
        result = _must_work_or_be_a_user_error(_read_everything, copy)
        event("refused" if isinstance(result, DriftcheckError) else "read")
        if not isinstance(result, DriftcheckError):  # flipped data bytes: compare still works
            report = _must_work_or_be_a_user_error(compare, traces["ref" + sfx], copy)
            if isinstance(report, Report):
                json.dumps(report.to_dict(), allow_nan=False)


def test_declared_size_is_checked_before_anything_is_allocated(traces, tmp_path):
    """A header declaring 2^61 elements in a small file is refused without a huge allocation."""
    copy = tmp_path / "t"
    shutil.copytree(traces["tgt"], copy)
    shard = copy / "shard-00000.safetensors"
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name].update(shape=[2**61], data_offsets=[0, 2**62])
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    m = json.loads((copy / "manifest.json").read_text())
    m["shards"][shard.name] = shard.stat().st_size
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DriftcheckError, match="outside the file"):
        TraceReader(copy)


# -- the metrics ----------------------------------------------------------------------------------
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
          torch.complex64]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 2**-149, 1e-40, 65504.0, 448.0, 3e38, math.inf, -math.inf,
           math.nan]


def _tensor(values: list[float], shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    x = torch.tensor(values, dtype=torch.float64).reshape(shape)
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1) if x.dim() else x).to(dtype)
    if dtype == torch.bool:
        return x != 0
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.nan_to_num(x, nan=0.0, posinf=info.max, neginf=info.min)
        return x.clamp(info.min, info.max).to(dtype)
    return x.to(dtype)


@settings(FUZZ, max_examples=150)
@given(shape=st.lists(st.integers(0, 5), max_size=3), data=st.data(),
       dtypes=st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)))
def test_metrics_on_any_dtype_shape_and_special_values(shape, data, dtypes):
    if dtypes[0].is_complex != dtypes[1].is_complex:
        dtypes = (dtypes[0], dtypes[0])  # real vs complex is an alignment finding in compare
    n = math.prod(shape)
    value = st.one_of(st.sampled_from(SPECIAL), st.floats(-1e4, 1e4))
    r = _tensor(data.draw(st.lists(value, min_size=n, max_size=n)), shape, dtypes[0])
    t = _tensor(data.draw(st.lists(value, min_size=n, max_size=n)), shape, dtypes[1])
    m = tensor_error(r, t)
    assert m["count"] == n * (2 if r.is_complex() or t.is_complex() else 1)
    assert 0 <= m["count_finite"] <= m["count"]
    for k in ("max_abs", "mean_abs", "rms", "rel_l2", "max_ulp", "frac_outside"):
        assert m[k] >= 0 or math.isinf(m[k]), (k, m[k])  # never NaN, never negative
    if not r.is_complex():
        assert m["nan_ref"] == int(torch.isnan(r).sum()) if r.is_floating_point() else m["nan_ref"] == 0
    same = tensor_error(r, r.clone())
    assert same["max_abs"] == 0 and same["nonfinite_new"] == 0 and same["nonfinite_mismatch"] == 0
    # What the metrics give the report survives strict JSON (inf/nan spelled as strings).
    e = Entry(key="0/forward/m/0/output", module="m", phase="forward", step=0, call=0,
              slot="output", order=0, metrics=m, floor=0.0, ratio=math.inf, status="drift")
    json.dumps(e.to_dict(), allow_nan=False)


@settings(FUZZ, max_examples=100)
@given(shape=st.lists(st.integers(0, 5), max_size=3), data=st.data(), dtype=st.sampled_from(DTYPES))
def test_record_time_stats_always_give_a_valid_manifest_entry(shape, data, dtype):
    """Statistics of any tensor (all-NaN, zero-size, int, bool, complex) are strict JSON once
    written, and the manifest reader accepts them back."""
    n = math.prod(shape)
    x = _tensor(data.draw(st.lists(st.sampled_from(SPECIAL), min_size=n, max_size=n)), shape, dtype)
    stats = tstats.to_dict(tstats.stats_vector(x).tolist())
    entry = {"key": "0/forward/./0/output", "module": "", "phase": "forward", "step": 0, "call": 0,
             "slot": "output", "order": 0, "shape": list(x.shape),
             "dtype": str(dtype).replace("torch.", ""), "stats": stats}
    manifest = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "run": {"steps": 1},
                "shards": {}, "entries": [entry]}
    text = json.dumps(fmt.json_safe(manifest), allow_nan=False)
    back = fmt.validate_manifest(json.loads(text))["entries"][0]["stats"]
    inexact = x.is_floating_point() or x.is_complex()
    assert back["numel"] == n and back["nan"] == (int(torch.isnan(x).sum()) if inexact else 0)

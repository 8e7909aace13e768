"""The trace format: the one place that defines it (docs/trace-format.md is its prose twin).

A trace is a directory:
    manifest.json          written last, atomically; its presence means the trace is complete
    shard-00000.safetensors ...  captured tensors, shards of bounded size
    replay.safetensors     initial parameters/buffers, per-step inputs, seeds (see store.py)

Pure: no filesystem access here (store.py does the I/O), so the reader can validate a manifest
dict before touching any shard.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

FORMAT_NAME = "driftcheck.trace"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLAY = "replay.safetensors"
SHARD_PATTERN = re.compile(r"^shard-\d{5}\.safetensors$")

# Phases in execution order within a step.
PHASES = ("params", "forward", "loss", "backward", "grads", "optimizer")
PHASE_RANK = {p: i for i, p in enumerate(PHASES)}
# The user-facing phase selection (`--phases`): params and loss always come with forward/optimizer.
SELECTABLE_PHASES = ("forward", "backward", "grads", "optimizer")

MODES = ("full", "stats", "auto")

# dtypes a trace may declare (safetensors names them the same way torch does, minus "torch.").
DTYPES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128",
)
FLOAT_DTYPES = frozenset(DTYPES[:8])


@dataclasses.dataclass(frozen=True, order=True)
class Key:
    """The semantic address of one captured tensor. Never a global counter."""

    step: int
    phase: str
    module: str
    call: int
    slot: str

    def __str__(self) -> str:
        # Human-readable and stable; the fields are stored separately too, so the string
        # never has to be parsed back.
        return f"{self.step}/{self.phase}/{self.module or '.'}/{self.call}/{self.slot}"

    @property
    def align(self) -> tuple[int, str, str, int, str]:
        return (self.step, self.phase, self.module, self.call, self.slot)


class FormatError(ValueError):
    """A manifest that does not follow this format."""


_ENTRY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "key": str, "module": str, "phase": str, "step": int, "call": int, "slot": str,
    "order": int, "shape": list, "dtype": str, "stats": dict,
}


def entry_key(entry: dict[str, Any]) -> Key:
    return Key(entry["step"], entry["phase"], entry["module"], entry["call"], entry["slot"])


def validate_manifest(m: Any) -> dict[str, Any]:
    """Check a parsed manifest.json; raise FormatError naming the first problem."""
    if not isinstance(m, dict):
        raise FormatError("manifest is not a JSON object")
    if m.get("format") != FORMAT_NAME:
        raise FormatError(f"manifest 'format' is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    version = m.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError("manifest 'version' is missing or not an integer")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"trace format version {version} is not supported by this driftcheck "
            f"(it reads version {FORMAT_VERSION}); re-record the trace or upgrade driftcheck")
    for name, typ in (("run", dict), ("entries", list), ("shards", dict)):
        if not isinstance(m.get(name), typ):
            raise FormatError(f"manifest field {name!r} is missing or not a {typ.__name__}")
    for shard, size in m["shards"].items():
        check_shard_name(shard)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(f"manifest shard {shard!r} has an invalid byte size")
    seen: set[tuple] = set()
    for i, e in enumerate(m["entries"]):
        if not isinstance(e, dict):
            raise FormatError(f"manifest entry {i} is not an object")
        for f, typ in _ENTRY_FIELDS.items():
            v = e.get(f)
            if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
                raise FormatError(f"manifest entry {i} field {f!r} is missing or has the wrong type")
        if e["phase"] not in PHASE_RANK:
            raise FormatError(f"manifest entry {i} has unknown phase {e['phase']!r}")
        if e["dtype"] not in DTYPES:
            raise FormatError(f"manifest entry {i} has unsupported dtype {e['dtype']!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in e["shape"]):
            raise FormatError(f"manifest entry {i} has an invalid shape {e['shape']!r}")
        if e["step"] < 0 or e["call"] < 0:
            raise FormatError(f"manifest entry {i} has a negative step or call")
        tensor = e.get("tensor")
        if tensor is not None:
            if not isinstance(tensor, dict) or not isinstance(tensor.get("shard"), str) \
                    or not isinstance(tensor.get("name"), str):
                raise FormatError(f"manifest entry {i} has a malformed 'tensor' reference")
            if tensor["shard"] not in m["shards"]:
                raise FormatError(f"manifest entry {i} points to shard {tensor['shard']!r} "
                                  "that the manifest does not list")
        sample = e.get("sample")
        if sample is not None and not (isinstance(sample, dict) and sample.get("shard") in m["shards"]
                                       and isinstance(sample.get("name"), str)):
            raise FormatError(f"manifest entry {i} has a malformed 'sample' reference")
        k = entry_key(e).align
        if k in seen:
            raise FormatError(f"manifest entry {i} repeats key {e['key']!r}")
        seen.add(k)
    return m


def check_shard_name(name: Any) -> str:
    """Shard names are plain file names inside the trace: no paths, no '..', no links out."""
    if not isinstance(name, str) or not SHARD_PATTERN.match(name):
        raise FormatError(f"shard name {name!r} is not of the form shard-NNNNN.safetensors "
                          "(a trace never points outside its directory)")
    return name


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"

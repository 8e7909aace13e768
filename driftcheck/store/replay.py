"""The replay file: what a target needs to start where the reference started.

``replay.safetensors`` holds the initial parameters and buffers (``param/<name>``,
``buffer/<name>``) and every step's input tensors (``input/<step>...``); its safetensors metadata
``driftcheck`` is JSON: format, replay_id, seed, steps, the inputs' structure (encode_batch's
description) and where the randomness comes from. Decoding treats the file as untrusted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from driftcheck import nested
from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.store import format as fmt
from driftcheck.store.remote import ShardCache, is_url
from driftcheck.store.shard import MappedShard, shares_storage, unshare, write_error, write_safetensors

# The replay file's key grammar, in one place: the model's state as ``param/<name>`` and
# ``buffer/<name>``, each step's inputs under ``input/<step>`` (encode_batch adds the path).
REPLAY_FORMAT = "driftcheck.replay"
REPLAY_VERSION = 1
RANDOMNESS = "dropout masks drawn on CPU from (seed, step, call index)"
STATE_KINDS = ("param", "buffer")


def state_key(kind: str, name: str) -> str:
    """The replay key of a model state tensor: ``param/<name>`` or ``buffer/<name>``."""
    if kind not in STATE_KINDS:
        raise ValueError(f"state kind {kind!r} is not one of {STATE_KINDS}")
    return f"{kind}/{name}"


def input_prefix(step: int | str) -> str:
    """The key prefix of one step's inputs (``input/3``; a session's calls: ``input/3.0``)."""
    return f"input/{step}"


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state_dict a replay file holds: its ``param/`` and ``buffer/`` tensors by name."""
    prefixes = tuple(f"{k}/" for k in STATE_KINDS)
    return {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefixes)}


def replay_meta(*, replay_id: str, seed: int, steps: int, inputs: Any, model: Any,
                **extra: Any) -> dict[str, Any]:
    """The replay file's JSON metadata: format, ids, the inputs' structure and where the
    randomness comes from; ``extra`` fields (rank, cycle, driver ...) follow."""
    meta = {"format": REPLAY_FORMAT, "version": REPLAY_VERSION, "replay_id": replay_id, "seed": seed,
            "steps": steps, "inputs": inputs, "model": model}
    meta.update(extra)
    meta.setdefault("randomness", RANDOMNESS)
    return meta


def write_replay(trace_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                 fsync: bool = True) -> None:
    """Write a trace's replay file: ``tensors`` (initial state, inputs) and ``meta`` (JSON)."""
    tmp = trace_dir / f".{fmt.REPLAY}.tmp"
    host = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    host = {k: (v.clone() if shares_storage(v, {}) else v) for k, v in host.items()}
    try:
        # write_safetensors raises a plain OSError on a full disk (save_file wraps it).
        write_safetensors(tmp, sorted(unshare(host).items()),
                          metadata={"driftcheck": json.dumps(meta)}, fsync=fsync)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(trace_dir, e) from e
    os.replace(tmp, trace_dir / fmt.REPLAY)


def read_replay(trace_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a trace's replay file (a trace at a URL: downloaded first)."""
    if is_url(trace_dir):
        return _read_replay_url(str(trace_dir))
    p = Path(trace_dir) / fmt.REPLAY
    if not Path(trace_dir).is_dir():
        raise TraceError(f"--replay {trace_dir} is not a trace directory; pass the reference trace "
                         "recorded by driftcheck record")
    if not p.is_file() or p.is_symlink():
        raise TraceError(f"{p} is missing (or not a plain file): --replay needs a trace recorded "
                         "by driftcheck record")
    if not ((Path(trace_dir) / fmt.MANIFEST).is_file() or (Path(trace_dir) / fmt.LONG_MANIFEST).is_file()):
        # The replay file is written first: without a manifest the reference record never finished.
        raise TraceError(f"--replay {trace_dir} is an incomplete trace (no {fmt.MANIFEST}); "
                         "re-record the reference first")
    return _read_replay_file(p, p)


def _read_replay_url(url: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    cache = ShardCache(url)
    try:
        remote = cache.remote
        if not (remote.exists(fmt.MANIFEST) or remote.exists(fmt.LONG_MANIFEST)):
            # The replay file is uploaded first: without a manifest the reference never finished.
            raise TraceError(f"--replay {remote.url} is an incomplete trace or none (no {fmt.MANIFEST}); "
                             "re-record the reference first")
        p = cache.file(fmt.REPLAY)
        if p is None:
            raise TraceError(f"{remote.where(fmt.REPLAY)} is missing: --replay needs a trace recorded "
                             "by driftcheck record")
        return _read_replay_file(p, remote.where(fmt.REPLAY))
    finally:
        cache.close()


def _read_replay_file(p: Path, shown: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The replay file at ``p`` (``shown``: as messages name it)."""
    try:
        f = MappedShard(p, what="replay file")
    except TraceError as e:
        why = str(e).replace(f"replay file {p}: ", "").replace(f"replay file {p} ", "").removeprefix("is ")
        raise TraceError(f"{shown} is not a readable replay file ({why.removesuffix('; the trace is corrupt')}); "
                         "re-record the reference") from None
    try:
        meta = json.loads(f.metadata.get("driftcheck", "null"))
        tensors = {k: f.read(*f.tensors[k]) for k in sorted(f.tensors)}
    except (ValueError, RuntimeError) as e:
        raise TraceError(f"{shown} is not a readable replay file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != REPLAY_FORMAT:
        raise TraceError(f"{shown} has no driftcheck replay metadata; re-record the reference")
    return tensors, meta


def encode_batch(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON description of a batch; its tensors go into ``tensors`` under ``prefix`` (their
    keys are ``nested``'s paths: ``input/3.0``, ``input/3.x.1``)."""
    return nested.fold(obj, prefix, lambda path, o, k, children: _encode(path, o, k, children, tensors))


def _encode(path: str, obj: Any, k: str, children: nested.Children[Any], tensors: dict[str, torch.Tensor]) -> Any:
    if k == nested.TENSOR:
        tensors[path] = obj.detach()
        return {"t": "tensor", "name": path}
    if k == nested.MAPPING and isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            raise DriftcheckError("Scenario inputs: dict keys must be strings (keyword arguments)")
        return {"t": "dict", "items": dict(children())}
    if k == nested.SEQUENCE:
        return {"t": type(obj).__name__, "items": [v for _, v in children()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"t": "value", "v": obj}
    raise DriftcheckError(f"Scenario inputs contain a {type(obj).__name__} at {path}; inputs may "
                          "hold tensors, tuples, lists, dicts, numbers, strings and None")


def decode_batch(desc: Any, tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    """Rebuild a batch from its JSON description (untrusted: it comes from a replay file)."""
    t = desc.get("t") if isinstance(desc, dict) else None
    items = desc.get("items") if isinstance(desc, dict) else None
    if depth > 64:
        t = None  # deeper than any real batch: refuse rather than recurse without bound
    if t == "tensor":
        name = desc.get("name")
        if not isinstance(name, str) or name not in tensors:
            raise DriftcheckError(f"replay file lacks input tensor {name!r}; re-record the reference")
        return tensors[name]
    if t == "dict" and isinstance(items, dict):
        return {str(k): decode_batch(v, tensors, depth + 1) for k, v in items.items()}
    if t in ("tuple", "list") and isinstance(items, list):
        out = [decode_batch(v, tensors, depth + 1) for v in items]
        return tuple(out) if t == "tuple" else out
    if t == "value" and (desc.get("v") is None or isinstance(desc.get("v"), (bool, int, float, str))):
        return desc.get("v")
    raise DriftcheckError("replay file has a malformed input description; re-record the reference")

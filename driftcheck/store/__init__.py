"""Trace I/O: the only code that reads or writes trace files.

    format.py   THE trace format: names, phases, slot grammar, manifest validation (pure)
    shard.py    the safetensors layout of shards and replay files: write, map, read
    writer.py   TraceWriter: shards in the background, the manifest last and atomically
    reader.py   TraceReader: validated, memory-mapped, tensors whole or in bounded chunks
    replay.py   the replay file: initial state, inputs, randomness; the batch codec
    layout.py   directories of traces: multi-rank runs, ``driftcheck run`` directories
    remote.py   traces at a URL (s3://, gs://, fsspec): staging, uploads, the read cache

Lazy exports: ``driftcheck.store.format`` stays importable without torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["INCOMPLETE", "TraceReader", "TraceWriter", "read_replay", "strict_json"]


def __getattr__(name: str) -> Any:
    if name == "TraceReader":
        from driftcheck.store.reader import TraceReader
        return TraceReader
    if name == "TraceWriter":
        from driftcheck.store.writer import TraceWriter
        return TraceWriter
    if name == "read_replay":
        from driftcheck.store.replay import read_replay
        return read_replay
    if name == "strict_json":
        from driftcheck.store.shard import strict_json
        return strict_json
    if name == "INCOMPLETE":
        from driftcheck.store.format import INCOMPLETE
        return INCOMPLETE
    raise AttributeError(f"module 'driftcheck.store' has no attribute {name!r}")

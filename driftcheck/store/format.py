"""The trace format: the one place that defines it (docs/trace-format.md is its prose twin).

A trace is a directory:
    manifest.json          written last, atomically; its presence means the trace is complete
    shard-00000.safetensors ...  captured tensors, shards of bounded size
    replay.safetensors     initial parameters/buffers, per-step inputs, seeds (see replay.py)

Pure and torch-free at import (the policy and the renderers read its phases): no filesystem
access here (the rest of driftcheck.store does the I/O), so the reader can
validate a manifest dict before touching any shard.
"""
from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from typing import Any

from driftcheck.numerics.dtype_names import TRACE_DTYPES  # the dtypes a shard can store

# The address grammar lives in keys.py; re-exported here, where the trace format's readers look.
from driftcheck.store.keys import (
    LOCAL_PREFIX as LOCAL_PREFIX,
    SLOT_KINDS as SLOT_KINDS,
    Slot as Slot,
    TraceKey as TraceKey,
    base_slot as base_slot,
    entry_align as entry_align,
    is_local_slot as is_local_slot,
    key_string as key_string,
    sample_key as sample_key,
    slot_kind as slot_kind,
)

FORMAT_NAME = "driftcheck.trace"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLAY = "replay.safetensors"
INCOMPLETE = "INCOMPLETE"  # marker file of a record in progress or interrupted
# A long record (driftcheck/store/long.py): per-step columns instead of per-tensor entries.
LONG_FORMAT = "driftcheck.long"
LONG_VERSION = 1
LONG_MANIFEST = "long.json"
LONG_COLUMNS = "long.safetensors"
POINTS_DIR = "points"
SHARD_PATTERN = re.compile(r"^shard-\d{5}\.safetensors$")

# Phases in execution order within a step.
PHASES = ("params", "forward", "loss", "backward", "grads", "optimizer")
PHASE_RANK = {p: i for i, p in enumerate(PHASES)}
# The user-facing phase selection (`--phases`): params and loss always come with forward/optimizer.
SELECTABLE_PHASES = ("forward", "backward", "grads", "optimizer")

MODES = ("full", "stats", "auto")

# Every finding kind driftcheck reports (docs/findings.md explains each): what a policy's
# fail_on and ignore kinds are checked against. tests/test_architecture.py keeps it complete.
FINDING_KINDS = frozenset({
    "alignment.dtype_mismatch", "alignment.extra_in_target", "alignment.missing_in_target",
    "alignment.rerouted", "alignment.shape_mismatch",
    "alias.sharing_differs",
    "compile.capture_gap", "compile.graph_break", "compile.input_gap", "compile.recompile",
    "compile.regrouped_gradients",
    "deferred.capture_sync",
    "batchnorm.counter_not_advanced", "batchnorm.counter_wrong", "batchnorm.running_stats_not_updated",
    "batchnorm.running_stats_wrong", "batchnorm.updated_in_eval",
    "inplace.base_not_updated", "inplace.value_mismatch",
    "layout.loss_normalization",
    "nonfinite.origin", "nonfinite.reference",
    "precision.fp8_casts", "precision.fp8_saturation", "precision.low_precision_sum",
    "precision.model_sensitive", "precision.control_kernel", "precision.settings_differ",
    "view.alias_lost", "view.audit_unobservable", "view.layout_mismatch",
    "view.write_not_through_view",
    # driftcheck/signatures.py (kept equal by tests/drill/test_drill.py)
    "known.batchnorm_running_stats_not_written", "known.layernorm_backward_low_precision_params",
    "known.matmul_below_recorded_precision", "known.reduction_low_precision_accumulation",
    "known.scaled_mm_rowwise_scales_wrong_axis",
})


def kind_matches(kind: str, pattern: str) -> bool:
    """Finding kinds are dotted (``batchnorm.running_stats_not_updated``): ``pattern`` is a dotted
    prefix (``view`` matches ``view.alias_lost``) or an fnmatch glob."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(kind, pattern)
    return kind == pattern or kind.startswith(pattern + ".")


# A tied parameter: ``module`` holds ``param``, which ``owner`` owns as ``owner_param`` (where
# it is captured); optional manifest field ``tied_params``, a list of these.
TIED_FIELDS = ("module", "param", "owner", "owner_param")
# The alias structure (optional manifest field ``aliases``; absent in traces made before it):
# groups of parameters and buffers, by dotted name, that are one tensor ("tied") or share
# storage ("storage") on the run's device (driftcheck/record/aliases.py).
ALIAS_HOW = ("tied", "storage")


class FormatError(ValueError):
    """A manifest that does not follow this format."""


_ENTRY_FIELDS: dict[str, type] = {
    "key": str, "module": str, "phase": str, "step": int, "call": int, "slot": str,
    "order": int, "shape": list, "dtype": str, "stats": dict,
}


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
    for name, kind in (("run", dict), ("entries", list), ("shards", dict)):
        if not isinstance(m.get(name), kind):
            raise FormatError(f"manifest field {name!r} is missing or not a {kind.__name__}")
    _check_run(m["run"])
    if m.get("replay") not in (None, REPLAY):
        raise FormatError(f"manifest 'replay' is {m['replay']!r}; a trace's replay file is always "
                          f"{REPLAY!r} inside the trace")
    for name in ("findings", "view_events", "fp8"):
        v = m.get(name)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            raise FormatError(f"manifest field {name!r} is not a list of objects")
    for i, f in enumerate(m.get("findings") or []):
        if not all(isinstance(f.get(k), str) for k in ("kind", "module", "message")) \
                or not (f.get("step") is None or _is_int(f["step"])) \
                or not all(f.get(k) is None or isinstance(f[k], str) for k in ("phase", "key", "severity")) \
                or not (f.get("details") is None or isinstance(f["details"], dict)):
            raise FormatError(f"manifest finding {i} is malformed (kind, module, message must be "
                              "strings, step an integer or null)")
    tied = m.get("tied_params")
    if tied is not None and not (isinstance(tied, list) and all(
            type(t) is dict and all(type(t.get(k)) is str for k in TIED_FIELDS) for t in tied)):
        raise FormatError("manifest field 'tied_params' is not a list of objects with string "
                          f"fields {', '.join(TIED_FIELDS)}")
    _check_aliases(m.get("aliases"))
    for shard, size in m["shards"].items():
        check_shard_name(shard)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(f"manifest shard {shard!r} has an invalid byte size")
    seen: set[tuple] = set()
    shards = m["shards"]
    for i, e in enumerate(m["entries"]):
        if type(e) is not dict:
            raise FormatError(f"manifest entry {i} is not an object")
        for f, typ in _ENTRY_FIELDS.items():
            v = e.get(f)
            if type(v) is not typ:  # exact: json.loads makes no subclasses, and bool is no int
                raise FormatError(f"manifest entry {i} field {f!r} is missing or has the wrong type")
        if e["phase"] not in PHASE_RANK:
            raise FormatError(f"manifest entry {i} has unknown phase {e['phase']!r}")
        if e["dtype"] not in TRACE_DTYPES:
            raise FormatError(f"manifest entry {i} has unsupported dtype {e['dtype']!r}")
        for d in e["shape"]:
            if type(d) is not int or not 0 <= d < 2**40:
                raise FormatError(f"manifest entry {i} has an invalid shape {e['shape']!r}")
        if e["step"] < 0 or e["call"] < 0:
            raise FormatError(f"manifest entry {i} has a negative step or call")
        tensor = e.get("tensor")
        if tensor is not None:
            if type(tensor) is not dict or type(tensor.get("shard")) is not str \
                    or type(tensor.get("name")) is not str:
                raise FormatError(f"manifest entry {i} has a malformed 'tensor' reference")
            if tensor["shard"] not in shards:
                raise FormatError(f"manifest entry {i} points to shard {tensor['shard']!r} "
                                  "that the manifest does not list")
        sample = e.get("sample")
        if sample is not None and not (type(sample) is dict and type(sample.get("shard")) is str
                                       and sample["shard"] in shards
                                       and type(sample.get("name")) is str):
            raise FormatError(f"manifest entry {i} has a malformed 'sample' reference")
        for ref in (tensor, sample):
            crc = ref.get("crc32c") if ref is not None else None
            if crc is not None and not (type(crc) is int and 0 <= crc < 1 << 32):
                raise FormatError(f"manifest entry {i} has a malformed 'crc32c' checksum")
        _check_stats(i, e["stats"])
        meta = e.get("meta")
        if meta is not None:
            _check_meta(i, meta)
        k = entry_align(e)
        if k in seen:
            raise FormatError(f"manifest entry {i} repeats key {e['key']!r}")
        seen.add(k)
    return m


def _check_aliases(aliases: Any) -> None:
    if aliases is None:
        return
    if not (isinstance(aliases, list) and all(
            type(g) is dict and g.get("how") in ALIAS_HOW and isinstance(g.get("tensors"), list)
            and len(g["tensors"]) >= 2 and all(type(n) is str for n in g["tensors"]) for g in aliases)):
        raise FormatError("manifest field 'aliases' is not a list of objects with 'tensors' (two or "
                          f"more names) and 'how' ({' or '.join(ALIAS_HOW)})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None


# run fields that compare and the renderers compute with: their types are checked, other run
# fields are free-form metadata (shown escaped, never evaluated).
_RUN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "steps": int, "model_id": str, "scenario": str, "device": str, "dtype": str, "mode": str,
    "replay_id": str, "precision": dict, "seed": int, "autocast": str, "fp8": str,
}


_PRECISION_FIELDS: dict[str, type] = {
    "device": dict, "dtype": str, "autocast": str, "matmul_precision": str, "allow_tf32": dict,
    "fp32_precision": dict, "fp8": dict, "versions": dict, "host": dict, "env": dict,
}


def _check_run(run: dict[str, Any]) -> None:
    for f, typ in _RUN_FIELDS.items():
        v = run.get(f)
        if v is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
            raise FormatError(f"manifest run field {f!r} has the wrong type ({type(v).__name__})")
    if run.get("steps") is not None and not 0 <= run["steps"] <= 1 << 31:
        raise FormatError(f"manifest run 'steps' is {run['steps']}, expected a step count")
    for f, typ in _PRECISION_FIELDS.items():  # what the noise floor reads (precision.py)
        v = (run.get("precision") or {}).get(f)
        if v is not None and not isinstance(v, typ):
            raise FormatError(f"manifest run precision field {f!r} has the wrong type "
                              f"({type(v).__name__}, expected {typ.__name__})")


_NUMBER_TYPES = (int, float, type(None))


def _check_stats(i: int, stats: dict[str, Any]) -> None:
    # Summary statistics are numbers, or null where a tensor has no finite value (json_safe).
    for k, v in stats.items():
        if type(v) not in _NUMBER_TYPES:
            raise FormatError(f"manifest entry {i} stat {k!r} is not a number")
    for k in ("nan", "inf", "numel"):
        v = stats.get(k)
        if v is not None and not (type(v) is int and v >= 0):
            raise FormatError(f"manifest entry {i} stat {k!r} is not a non-negative count")


_PARENT = re.compile(r"^.*#\d{1,9}$", re.S)


def _check_meta(i: int, meta: Any) -> None:
    # Fields compare reads from an entry's meta (the noise-floor inputs and the module tree).
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise FormatError(f"manifest entry {i} 'meta' is not an object")
    for k in ("parent", "made_by"):
        v = meta.get(k)
        if v is not None and not (isinstance(v, str) and _PARENT.match(v)):
            raise FormatError(f"manifest entry {i} meta {k!r} is not of the form MODULE#CALL")
    for k in ("kind", "module_type"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise FormatError(f"manifest entry {i} meta {k!r} is not a string")
    if meta.get("k") is not None and not (_is_int(meta["k"]) and meta["k"] >= 0):
        raise FormatError(f"manifest entry {i} meta 'k' is not a non-negative integer")
    for k in ("kink_profile", "decision_profile", "round_profile"):
        prof = meta.get(k)
        if prof is not None and not (isinstance(prof, list) and 0 < len(prof) <= 64
                                     and all(_is_int(c) and 0 <= c <= 2**53 for c in prof)):
            raise FormatError(f"manifest entry {i} meta {k!r} is not a list of counts")
    for k in ("host_decisions", "ctc_frames"):
        if meta.get(k) is not None and not (_is_int(meta[k]) and meta[k] >= 0):
            raise FormatError(f"manifest entry {i} meta {k!r} is not a non-negative integer")
    if meta.get("k_grad") is not None and not (_is_int(meta["k_grad"]) and meta["k_grad"] >= 0):
        raise FormatError(f"manifest entry {i} meta 'k_grad' is not a non-negative integer")
    dims = meta.get("norm_dims")
    if dims is not None and not (isinstance(dims, list) and 0 < len(dims) <= 16
                                 and all(_is_int(d) and 0 <= d < 64 for d in dims)):
        raise FormatError(f"manifest entry {i} meta 'norm_dims' is not a list of dims")
    if meta.get("norm_groups") is not None and not (_is_int(meta["norm_groups"]) and meta["norm_groups"] > 0):
        raise FormatError(f"manifest entry {i} meta 'norm_groups' is not a positive integer")
    if meta.get("norm_rms") is not None and not isinstance(meta["norm_rms"], bool):
        raise FormatError(f"manifest entry {i} meta 'norm_rms' is not true or false")
    for k in ("mag_rms", "logit_absmax", "momentum", "norm_gain", "norm_gain_max", "norm_eps"):
        v = meta.get(k)
        if not (_is_num(v) and (v is None or v >= 0)):
            raise FormatError(f"manifest entry {i} meta {k!r} is not a non-negative number")
    kinks = meta.get("kinks")
    if kinks is not None and not (isinstance(kinks, list) and len(kinks) <= 16
                                  and all(_is_num(c) and c is not None for c in kinks)):
        raise FormatError(f"manifest entry {i} meta 'kinks' is not a list of numbers")
    if meta.get("sampled_as") not in (None, "params"):
        raise FormatError(f"manifest entry {i} meta 'sampled_as' is not \"params\"")
    if meta.get("selection") is not None and not isinstance(meta["selection"], bool):
        raise FormatError(f"manifest entry {i} meta 'selection' is not true or false")
    _check_layouts(i, meta)


# A multi-rank entry's place in the logical tensor (docs/trace-format.md, "Layouts"): meta
# ``layout`` (a DTensor's or a tensor-parallel style's) and its shares of the logical sample
_PLACEMENT = re.compile(r"^(S\d{1,2}|R|P)$")
SHARES = ("part", "part_tp")  # the meta names of a stats-mode entry's shares, likeliest first


def block_of(part: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(logical shape, offset along each dim) of a meta ``part`` of either form: ``offset``, or
    (traces before blocks) a range along ``dim`` from ``start``."""
    logical = [int(x) for x in part["global_shape"]]
    if part.get("offset") is not None:
        return logical, [int(x) for x in part["offset"]]
    offset = [0] * len(logical)
    if logical:
        offset[int(part["dim"])] = int(part["start"])
    return logical, offset


def _ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and len(v) <= 16 and (n is None or len(v) == n) \
        and all(_is_int(x) and 0 <= x < 2**53 for x in v)


def _check_layouts(i: int, meta: dict[str, Any]) -> None:
    lay = meta.get("layout")
    if lay is not None and not (
            isinstance(lay, dict) and isinstance(lay.get("placements"), list)
            and all(isinstance(p, str) and _PLACEMENT.match(p) for p in lay["placements"])
            and _ints(lay.get("mesh"), len(lay["placements"])) and _ints(lay.get("global_shape"))
            and (lay.get("coord") is None or _ints(lay["coord"], len(lay["placements"])))
            and (lay.get("offset") is None or _ints(lay["offset"], len(lay["global_shape"])))):
        raise FormatError(f"manifest entry {i} meta 'layout' is not placements, mesh, coord, "
                          "global_shape and offset of one tensor")
    for k in SHARES:
        part = meta.get(k)
        if part is not None and not (
                isinstance(part, dict) and _ints(part.get("global_shape"))
                and (_ints(part.get("offset"), len(part["global_shape"])) if part.get("offset") is not None
                     else _is_int(part.get("dim")) and 0 <= part["dim"] < max(len(part["global_shape"]), 1)
                     and _is_int(part.get("start")) and part["start"] >= 0)
                and isinstance(part.get("values", []), list)):
            raise FormatError(f"manifest entry {i} meta {k!r} is not a logical shape, its block's "
                              "offset and values")


def json_safe(obj: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` as plain JSON data with every non-finite float replaced by None: strict JSON has
    no NaN/Inf, and a statistic over a tensor without a finite value (all NaN, zero-size) simply
    has no value. ``default`` converts what json cannot encode (as ``json.dumps``'s). One trip
    through the C encoder and decoder: NaN/Infinity tokens come back as None."""
    return json.loads(json.dumps(obj, default=default), parse_constant=lambda _: None)


def check_shard_name(name: Any) -> str:
    """Shard names are plain file names inside the trace: no paths, no '..', no links out."""
    if not isinstance(name, str) or not SHARD_PATTERN.match(name):
        raise FormatError(f"shard name {name!r} is not of the form shard-NNNNN.safetensors "
                          "(a trace never points outside its directory)")
    return name


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"

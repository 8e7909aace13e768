"""Bad input and hostile files (issue 9), through the real CLI entry point.

Every user-facing failure is exit code 2 with one line on stderr (what, where, how to fix) and no
traceback. The catalogue below is the table in docs/bad-inputs.md: each case asserts that its
exact message (temp paths replaced by TRACE/REF/TMP) is the one the doc lists. After changing a
message, regenerate the table with ``DRIFTCHECK_UPDATE_DOCS=1 pytest tests/test_bad_inputs.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-inputs.md"
UPDATE_DOCS = os.environ.get("DRIFTCHECK_UPDATE_DOCS") == "1"

from conftest import (  # noqa: E402  (tests/ on the path: pytest's rootdir conftest)
    assert_not_complete,
    assert_one_line_error,
    record_trace,
    run_cli,
    write_scenarios,
)


def record_ref_and_bf16(scen_fn: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[Path, Path]:
    """Record ``scen_fn`` as an fp32 reference and a bf16 target replaying it; both must succeed."""
    ref, tgt = tmp_path / "ref", tmp_path / "tgt"
    assert run_cli(["record", scen_fn, "--out", ref], capsys)[0] == 0
    assert run_cli(["record", scen_fn, "--out", tgt, "--replay", ref, "--dtype", "bf16"], capsys)[0] == 0
    return ref, tgt






@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    scen = write_scenarios(root)
    ref = record_trace(scen, "build", root / "ref")
    tgt = record_trace(scen, "build", root / "tgt", dtype="bf16", replay=ref)
    return {"root": root, "scen": scen, "ref": ref, "tgt": tgt}


# -- trace surgery helpers (a corpus of corrupted files made from the real trace) -----------------
def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _put_manifest(d: Path, m: dict) -> None:
    (d / "manifest.json").write_text(json.dumps(m))


def _edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        m = _manifest(d)
        fn(m)
        _put_manifest(d, m)
    return mutate


def _first_tensor_entry(m: dict) -> dict:
    return next(e for e in m["entries"] if "tensor" in e and e["shape"])


def _first_forward_entry(m: dict) -> dict:
    return next(e for e in m["entries"] if "tensor" in e and e["phase"] == "forward")


def _shard(d: Path) -> Path:
    return d / "shard-00000.safetensors"


def _rewrite_shard_header(d: Path, change: Callable[[dict], None]) -> None:
    """Rewrite the first shard's safetensors header and keep the manifest's size in step, so the
    reader gets past the size check and must catch the lie in the header itself."""
    p = _shard(d)
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    m = _manifest(d)
    m["shards"][p.name] = p.stat().st_size
    _put_manifest(d, m)


def _huge_tensor(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [1 << 40]
    header[name]["data_offsets"] = [0, 4 << 40]


def _overlapping_offsets(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b, e + 4]


def _truncate(p: Path, keep: float) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def _flip(p: Path, start: int, count: int) -> None:
    data = bytearray(p.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))


def _symlink_shard_out(d: Path) -> None:
    outside = d.parent / f"{d.name}-outside.safetensors"
    shutil.move(_shard(d), outside)
    _shard(d).symlink_to(outside)


def _symlink_manifest(d: Path) -> None:
    outside = d.parent / f"{d.name}-manifest.json"
    shutil.move(d / "manifest.json", outside)
    (d / "manifest.json").symlink_to(outside)


def _sparse_manifest(d: Path) -> None:
    with open(d / "manifest.json", "r+b") as f:
        f.truncate((1 << 30) + 1)  # sparse: costs no disk


def _shards_entry(name: str) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        m = _manifest(d)
        m["shards"][name] = 100
        _put_manifest(d, m)
    return mutate


def _point_tensor_at(name: str) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        _first_tensor_entry(m)["tensor"]["shard"] = name
    return change


def _duplicate_entry(m: dict) -> None:
    m["entries"].append(dict(m["entries"][0]))


def _set_entry(field: str, value) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        _first_tensor_entry(m)[field] = value
    return change


def _findings_bad(m: dict) -> None:
    m["findings"] = [{"kind": 3, "module": "fc1", "message": "x", "step": 0}]


def _tied_bad(m: dict) -> None:
    m["tied_params"] = [{"module": "head", "param": "weight", "owner": ["emb"], "owner_param": "weight"}]


def _aliases_bad(m: dict) -> None:
    m["aliases"] = [{"tensors": ["emb.weight"], "how": "tied"}]


def _incomplete(d: Path) -> None:
    (d / "manifest.json").unlink()
    (d / "INCOMPLETE").write_text("record did not finish: KeyboardInterrupt: \n")


def _remove(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


@dataclasses.dataclass
class Case:
    name: str  # the row of docs/bad-inputs.md
    mutate: Callable[[Path], None] | None = None  # applied to a copy of the target trace
    args: Callable[[dict[str, Path], Path], list] | None = None  # default: compare REF COPY
    needle: str = ""  # a word the message must contain
    group: str = "trace files"
    base: str = "tgt"  # which trace the case starts from ("ref" has the replay file)


def _cmp(env: dict[str, Path], copy: Path) -> list:
    return ["compare", env["ref"], copy]


def _scen(fn: str, *extra: str) -> Callable[[dict[str, Path], Path], list]:
    def args(env: dict[str, Path], copy: Path) -> list:
        return ["record", f"{env['scen']}:{fn}", "--out", copy.parent / f"{copy.name}-out",
                "--force", *extra]
    return args


def _policy_file(copy: Path, body: str) -> Path:
    p = copy.parent / "driftcheck.toml"
    p.write_text(body + "\n")
    return p


def _replay_from(env: dict[str, Path], copy: Path) -> list:
    """record --replay COPY: the mutated copy is the reference being replayed."""
    return ["record", f"{env['scen']}:build", "--out", copy.parent / f"{copy.name}-out", "--force",
            "--replay", copy]


CASES = [
    # -- MODEL specs and scenario files ---------------------------------------------------------
    Case("unknown built-in model", args=lambda e, c: ["record", "mlq", "--out", c.parent / "o"],
         needle="unknown model", group="model specs"),
    Case("empty model spec", args=lambda e, c: ["record", " ", "--out", c.parent / "o"],
         needle="MODEL is empty", group="model specs"),
    Case("model file that does not exist",
         args=lambda e, c: ["record", c.parent / "nope.py:build", "--out", c.parent / "o"],
         needle="does not exist", group="model specs"),
    Case("function missing from the model file", args=_scen("no_such_fn"), needle="has no function",
         group="model specs"),
    Case("not a function name after the colon",
         args=lambda e, c: ["record", f"{e['scen']}:1x", "--out", c.parent / "o"],
         needle="not a function name", group="model specs"),
    Case("module that cannot be imported",
         args=lambda e, c: ["record", "no_such_pkg_xyz.models:build", "--out", c.parent / "o"],
         needle="cannot import", group="model specs"),
    Case("scenario file that raises on import", mutate=None,
         args=lambda e, c: (c.parent.mkdir(parents=True, exist_ok=True),
                            (c.parent / "boom.py").write_text("raise ImportError('no torch_tpu here')\n"),
                            ["record", c.parent / "boom.py:build", "--out", c.parent / "o"])[-1],
         needle="raised ImportError on import", group="model specs"),
    Case("build() that raises", args=_scen("raises"), needle="raised RuntimeError",
         group="model specs"),
    Case("build() that returns the wrong type", args=_scen("wrong_type"),
         needle="expected driftcheck.Scenario", group="model specs"),
    Case("Scenario.model that is not an nn.Module", args=_scen("not_a_module"),
         needle="expected a torch.nn.Module", group="model specs"),
    Case("empty model with a loss", args=_scen("empty"), needle="no parameters", group="model specs"),
    Case("model with no trainable parameters", args=_scen("frozen"),
         needle="no trainable parameters", group="model specs"),
    Case("forward that raises (user code)", args=_scen("forward_raises"),
         needle="the forward raised ValueError at step 0", group="model specs"),
    Case("loss that raises (user code)", args=_scen("loss_raises"),
         needle="loss(output, batch) raised KeyError", group="model specs"),
    Case("loss that is not a scalar", args=_scen("loss_not_scalar"), needle="scalar tensor",
         group="model specs"),
    Case("loss detached from the parameters", args=_scen("loss_detached"),
         needle="does not depend on any trainable parameter", group="model specs"),
    # -- devices, dtypes, options ----------------------------------------------------------------
    Case("unknown device type", args=_scen("build", "--device", "quantum"), needle="unknown device",
         group="devices and options"),
    Case("malformed device", args=_scen("build", "--device", "cuda:x"), needle="bad device",
         group="devices and options"),
    Case("CUDA device on a CPU-only torch", args=_scen("build", "--device", "cuda"), needle="CUDA",
         group="devices and options"),
    Case("TPU device without torch_tpu", args=_scen("build", "--device", "tpu"), needle="tpu",
         group="devices and options"),
    Case("unsupported dtype", args=_scen("build", "--dtype", "int8"), needle="unsupported --dtype",
         group="devices and options"),
    Case("run with a TPU target where torch_tpu is not installed",
         args=lambda e, c: ["run", f"{e['scen']}:build", "--target", "tpu", "--out", c.parent / "run-tpu"],
         needle="needs torch_tpu", group="devices and options"),
    Case("run with a misspelt target dtype",
         args=lambda e, c: ["run", f"{e['scen']}:build", "--target", "cpu", "--target-dtype", "bf61",
                            "--out", c.parent / "run-dtype"],
         needle="unsupported --target-dtype", group="devices and options"),
    Case("run --local with --mode stats",
         args=lambda e, c: ["run", f"{e['scen']}:build", "--target", "cpu", "--local", "--mode", "stats",
                            "--out", c.parent / "run-local"],
         needle="--local needs full tensors", group="devices and options"),
    Case("--compile with a backend torch does not know", args=_scen("build", "--compile", "nosuch"),
         needle="not a registered torch.compile backend", group="devices and options"),
    Case("--compile tpu where torch_tpu is not installed", args=_scen("build", "--compile", "tpu"),
         needle="torch_tpu", group="devices and options"),
    Case("--compile-mode without --compile", args=_scen("build", "--compile-mode", "max-autotune"),
         needle="add --compile", group="devices and options"),
    Case("--compile-mode with a backend other than inductor",
         args=_scen("build", "--compile", "aot_eager", "--compile-mode", "max-autotune"),
         needle="inductor's", group="devices and options"),
    Case("fp8 asked for as a dtype", args=_scen("build", "--dtype", "fp8"), needle="--fp8",
         group="devices and options"),
    Case("--capture-steps beyond the run", args=_scen("build", "--capture-steps", "5"),
         needle="--capture-steps 5", group="devices and options"),
    Case("--include glob that matches no module", args=_scen("build", "--include", "nosuch*"),
         needle="matches no module", group="devices and options"),
    Case("--exclude glob that matches no module", args=_scen("build", "--exclude", "fc9"),
         needle="matches no module", group="devices and options"),
    Case("--full-modules without --mode auto", args=_scen("build", "--full-modules", "*"),
         needle="--mode auto", group="devices and options"),
    Case("--phases and --include that capture nothing",
         args=_scen("build", "--phases", "grads", "--include", "act"),
         needle="captured no tensor", group="devices and options"),
    Case("zero steps", args=_scen("build", "--steps", "0"), needle="--steps",
         group="devices and options"),
    Case("bad --capture-steps range", args=_scen("build", "--capture-steps", "a-b"),
         needle="bad step range", group="devices and options"),
    Case("existing trace without --force",
         args=lambda e, c: ["record", f"{e['scen']}:build", "--out", e["ref"]],
         needle="--force", group="devices and options"),
    Case("--out that is a file",
         args=lambda e, c: ["record", f"{e['scen']}:build", "--out", e["scen"]],
         needle="already exists", group="devices and options"),
    Case("--env without NAME=VALUE", args=_scen("build", "--env", "FOO"),
         needle="NAME=VALUE", group="devices and options"),
    Case("--local with --no-local", args=lambda e, c: ["record", f"{e['scen']}:build", "--out",
                                                       c.parent / "o", "--replay", e["ref"], "--local",
                                                       e["ref"], "--no-local"],
         needle="contradict", group="devices and options"),
    Case("--parallel tp on a model without a tensor-parallel plan",
         args=_scen("build", "--parallel", "tp"), needle="no tensor-parallel plan",
         group="devices and options"),
    # -- drill-down ----------------------------------------------------------------------------
    Case("drill on a target that does not diverge", args=lambda e, c: ["drill", e["ref"], e["ref"]],
         needle="nothing to drill", group="drill-down"),
    Case("drill of a module the model lacks",
         args=lambda e, c: ["drill", e["ref"], e["tgt"], "--module", "fc9", "--step", "0",
                            "--out", c.parent / "d"], needle="no module", group="drill-down"),
    Case("drill of a step the run lacks",
         args=lambda e, c: ["drill", e["ref"], e["tgt"], "--module", "fc1", "--step", "7",
                            "--out", c.parent / "d"], needle="step 7", group="drill-down"),
    Case("drill --step without --module", args=lambda e, c: ["drill", e["ref"], e["tgt"], "--step", "0"],
         needle="--module", group="drill-down"),
    Case("drill --out that holds something else",
         args=lambda e, c: ["drill", e["ref"], e["tgt"], "--module", "fc1", "--step", "0",
                            "--out", e["root"]], needle="not a drill directory", group="drill-down"),
    # -- replay ----------------------------------------------------------------------------------
    Case("--replay directory that does not exist",
         args=lambda e, c: ["record", f"{e['scen']}:build", "--out", c.parent / "o", "--replay",
                            c.parent / "nowhere"], needle="not a trace directory", group="replay"),
    Case("--replay trace without replay.safetensors", mutate=_remove("replay.safetensors"),
         args=_replay_from, base="ref", needle="replay.safetensors is missing", group="replay"),
    Case("--replay from an interrupted reference", mutate=_incomplete, args=_replay_from, base="ref",
         needle="incomplete trace", group="replay"),
    Case("truncated replay.safetensors", mutate=lambda d: _truncate(d / "replay.safetensors", 0.5),
         args=_replay_from, base="ref", needle="not a readable replay file", group="replay"),
    Case("replay.safetensors with a corrupt header",
         mutate=lambda d: _flip(d / "replay.safetensors", 8, 4), args=_replay_from, base="ref",
         needle="not a readable replay file", group="replay"),
    Case("replay.safetensors without driftcheck metadata",
         mutate=lambda d: __import__("safetensors.torch").torch.save_file(
             {"x": __import__("torch").zeros(2)}, str(d / "replay.safetensors")),
         args=_replay_from, base="ref", needle="no driftcheck replay metadata", group="replay"),
    Case("replay.safetensors that is a symlink",
         mutate=lambda d: (shutil.move(d / "replay.safetensors", d.parent / f"{d.name}-r"),
                           (d / "replay.safetensors").symlink_to(d.parent / f"{d.name}-r")),
         args=_replay_from, base="ref", needle="not a plain file", group="replay"),
    Case("--replay of a different model",
         args=lambda e, c: ["record", f"{e['scen']}:other", "--out", c.parent / "o", "--replay",
                            e["ref"]], needle="different model", group="replay"),
    Case("--replay of another configuration of the model",
         args=lambda e, c: ["record", f"{e['scen']}:wide", "--out", c.parent / "o", "--replay",
                            e["ref"]], needle="shapes differ", group="replay"),
    Case("--replay with fewer steps than asked",
         args=lambda e, c: ["record", f"{e['scen']}:build", "--out", c.parent / "o", "--replay",
                            e["ref"], "--steps", "5"], needle="holds 2 step(s)", group="replay"),
    # -- manifest -------------------------------------------------------------------------------
    Case("trace directory that does not exist", mutate=lambda d: shutil.rmtree(d),
         needle="does not exist", group="manifest"),
    Case("trace path that is a file",
         mutate=lambda d: (shutil.rmtree(d), d.write_text("x")), needle="not a directory",
         group="manifest"),
    Case("interrupted record (INCOMPLETE, no manifest)", mutate=_incomplete, needle="incomplete",
         group="manifest"),
    Case("manifest that is not JSON", mutate=lambda d: (d / "manifest.json").write_bytes(b"{\x00oops"),
         needle="does not parse as JSON", group="manifest"),
    Case("manifest that is empty", mutate=lambda d: (d / "manifest.json").write_bytes(b""),
         needle="does not parse as JSON", group="manifest"),
    Case("manifest nested 100000 levels deep",
         mutate=lambda d: (d / "manifest.json").write_text("[" * 100000 + "]" * 100000),
         needle="nested too deeply", group="manifest"),
    Case("manifest larger than 1 GiB (sparse)", mutate=_sparse_manifest, needle="larger than 1 GiB",
         group="manifest"),
    Case("manifest that is a JSON list", mutate=lambda d: (d / "manifest.json").write_text("[]"),
         needle="not a JSON object", group="manifest"),
    Case("manifest of another format", mutate=_edit(lambda m: m.update(format="pytorch")),
         needle="'format'", group="manifest"),
    Case("unknown format version", mutate=_edit(lambda m: m.update(version=99)),
         needle="version 99 is not supported", group="manifest"),
    Case("format version as a string", mutate=_edit(lambda m: m.update(version="1")),
         needle="'version'", group="manifest"),
    Case("entries that are not a list", mutate=_edit(lambda m: m.update(entries={})),
         needle="'entries'", group="manifest"),
    Case("run steps as a string", mutate=_edit(lambda m: m["run"].update(steps="2")),
         needle="'steps'", group="manifest"),
    Case("run precision fp8 recipe that is not an object",
         mutate=_edit(lambda m: m["run"].setdefault("precision", {}).update(fp8=-1)),
         needle="precision field 'fp8'", group="manifest"),
    Case("entry step as a string", mutate=_edit(_set_entry("step", "0")), needle="'step'",
         group="manifest"),
    Case("entry step as a boolean", mutate=_edit(_set_entry("step", True)), needle="'step'",
         group="manifest"),
    Case("entry with an unknown phase", mutate=_edit(_set_entry("phase", "sideways")),
         needle="unknown phase", group="manifest"),
    Case("entry with an unsupported dtype", mutate=_edit(_set_entry("dtype", "object")),
         needle="unsupported dtype", group="manifest"),
    Case("entry with a negative dimension", mutate=_edit(_set_entry("shape", [-1, 3])),
         needle="invalid shape", group="manifest"),
    Case("entry stats that are not numbers", mutate=_edit(_set_entry("stats", {"l2": "big"})),
         needle="not a number", group="manifest"),
    Case("entry meta with a malformed parent", mutate=_edit(_set_entry("meta", {"parent": 7})),
         needle="'parent'", group="manifest"),
    Case("entry meta with a malformed kink profile",
         mutate=_edit(_set_entry("meta", {"kink_profile": [3, -1]})), needle="'kink_profile'",
         group="manifest"),
    Case("entry meta with a malformed decision profile",
         mutate=_edit(_set_entry("meta", {"decision_profile": ["many"]})), needle="'decision_profile'",
         group="manifest"),
    Case("entry meta with a decision profile count beyond 2^53",
         mutate=_edit(_set_entry("meta", {"decision_profile": [1, 2**60]})), needle="'decision_profile'",
         group="manifest"),
    Case("entry meta with a layout whose offset is not one per dim",
         mutate=_edit(_set_entry("meta", {"layout": {"placements": ["S0", "S1"], "mesh": [2, 2], "coord": [0, 1],
                                                     "global_shape": [4, 4], "offset": [0]}})),
         needle="'layout'", group="manifest"),
    Case("entry meta with a layout placement that is not a shard, R or P",
         mutate=_edit(_set_entry("meta", {"layout": {"placements": ["X"], "mesh": [2], "global_shape": [4]}})),
         needle="'layout'", group="manifest"),
    Case("entry meta with a share of the logical sample at a negative offset",
         mutate=_edit(_set_entry("meta", {"part_tp": {"global_shape": [4, 4], "offset": [0, -2], "values": []}})),
         needle="'part_tp'", group="manifest"),
    Case("entry meta with a malformed rounding profile",
         mutate=_edit(_set_entry("meta", {"round_profile": [1.5]})), needle="'round_profile'",
         group="manifest"),
    Case("entry meta with a host decision count that is not an integer",
         mutate=_edit(_set_entry("meta", {"host_decisions": "some"})), needle="'host_decisions'",
         group="manifest"),
    Case("entry meta with a softmax logit maximum that is not a number",
         mutate=_edit(_set_entry("meta", {"logit_absmax": "huge"})), needle="'logit_absmax'",
         group="manifest"),
    Case("entry meta with kinks that are not numbers",
         mutate=_edit(_set_entry("meta", {"kinks": ["zero"]})), needle="'kinks'",
         group="manifest"),
    Case("entry meta with a selection flag that is not a boolean",
         mutate=_edit(_set_entry("meta", {"selection": "yes"})), needle="'selection'",
         group="manifest"),
    Case("entry meta with a negative input-gradient reduction length",
         mutate=_edit(_set_entry("meta", {"k_grad": -3})), needle="'k_grad'",
         group="manifest"),
    Case("duplicate entry keys", mutate=_edit(_duplicate_entry), needle="repeats key",
         group="manifest"),
    Case("findings of the wrong type", mutate=_edit(_findings_bad), needle="finding 0 is malformed",
         group="manifest"),
    Case("tied parameters of the wrong type", mutate=_edit(_tied_bad), needle="'tied_params'",
         group="manifest"),
    Case("an alias group of the wrong form", mutate=_edit(_aliases_bad), needle="'aliases'",
         group="manifest"),
    Case("manifest that is a symlink", mutate=_symlink_manifest, needle="symbolic link",
         group="manifest"),
    Case("manifest checksum that is not a number",
         mutate=_edit(lambda m: _first_tensor_entry(m)["tensor"].update(crc32c="x")),
         needle="malformed 'crc32c'", group="manifest"),
    # -- paths out of the trace ------------------------------------------------------------------
    Case("shard name with '..'", mutate=_shards_entry("../../etc/passwd"), needle="never points outside",
         group="paths"),
    Case("absolute shard path", mutate=_shards_entry("/etc/passwd"), needle="never points outside",
         group="paths"),
    Case("tensor in a shard the manifest does not list",
         mutate=_edit(_point_tensor_at("shard-00042.safetensors")), needle="does not list",
         group="paths"),
    Case("replay field pointing outside", mutate=_edit(lambda m: m.update(replay="../ref/replay.safetensors")),
         needle="'replay'", group="paths"),
    Case("shard that is a symlink out of the trace", mutate=_symlink_shard_out, needle="symbolic link",
         group="paths"),
    # -- shards ---------------------------------------------------------------------------------
    Case("missing shard", mutate=lambda d: _shard(d).unlink(), needle="is missing", group="shards"),
    Case("shard that is a directory", mutate=lambda d: (_shard(d).unlink(), _shard(d).mkdir()),
         needle="is missing", group="shards"),
    Case("truncated shard", mutate=lambda d: _truncate(_shard(d), 0.5), needle="truncated",
         group="shards"),
    Case("truncated shard, manifest size edited to match",
         mutate=lambda d: (_truncate(_shard(d), 0.5),
                           _edit(lambda m: m["shards"].update({_shard(d).name: _shard(d).stat().st_size}))(d)),
         needle="the trace is corrupt", group="shards"),
    Case("shard header length of 2^62 bytes",
         mutate=lambda d: _shard(d).write_bytes(struct.pack("<Q", 1 << 62) + _shard(d).read_bytes()[8:]),
         needle="bad header length", group="shards"),
    Case("shard header bytes flipped", mutate=lambda d: _flip(_shard(d), 8, 6),
         needle="unreadable safetensors header", group="shards"),
    Case("shard data bytes flipped in place (same size)",
         mutate=lambda d: _flip(_shard(d), _shard(d).stat().st_size - 40, 4),
         needle="fail their checksum", group="shards"),
    Case("shard header declaring a 4 TiB tensor",
         mutate=lambda d: _rewrite_shard_header(d, _huge_tensor), needle="outside the file",
         group="shards"),
    Case("shard header offsets that disagree with the shape",
         mutate=lambda d: _rewrite_shard_header(d, _overlapping_offsets), needle="disagrees with its shape",
         group="shards"),
    Case("manifest shape that disagrees with the shard",
         mutate=_edit(lambda m: _first_forward_entry(m).update(shape=[99, 99])),
         needle="the trace is corrupt", group="shards"),
    Case("manifest dtype that disagrees with the shard",
         mutate=_edit(lambda m: _first_forward_entry(m).update(dtype="int32")),
         needle="the trace is corrupt", group="shards"),
    Case("manifest naming a tensor the shard lacks",
         mutate=_edit(lambda m: _first_tensor_entry(m)["tensor"].update(name="nope")),
         needle="no tensor 'nope'", group="shards"),
    Case("shard replaced by a pickle (torch.save)",
         mutate=lambda d: (__import__("torch").save({"x": 1}, _shard(d)),
                           _edit(lambda m: m["shards"].update({_shard(d).name: _shard(d).stat().st_size}))(d)),
         needle="the trace is corrupt", group="shards"),
    # -- comparing two traces --------------------------------------------------------------------
    Case("traces of two different models",
         args=lambda e, c: ["compare", e["ref"], e["other"]], needle="do not describe the same model",
         group="two traces"),
    Case("different step counts", args=lambda e, c: ["compare", e["ref"], e["one_step"]],
         needle="2 step(s) and the target 1", group="two traces"),
    Case("parameter shapes that differ (another configuration)",
         args=lambda e, c: ["compare", e["ref"], e["wide"]], needle="different model configurations",
         group="two traces"),
    Case("--limit that is not positive", args=lambda e, c: ["compare", e["ref"], e["tgt"], "--limit", "0"],
         needle="--limit", group="two traces"),
    Case("report output into a missing directory",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--json", c.parent / "no" / "dir" / "r.json"],
         needle="cannot write", group="two traces"),
    Case("report JSON that is not a report",
         args=lambda e, c: ["report", e["ref"] / "manifest.json", "--html", c.parent / "r.html"],
         needle="not a driftcheck report", group="two traces"),
    Case("a policy whose steps lie outside the traces'",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--policy", _policy_file(c, 'steps = "5-9"')],
         needle="lies outside the traces' steps", group="two traces"),
    Case("a policy fail_on kind that is misspelt",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--policy", _policy_file(c, 'fail_on = ["views"]')],
         needle="matches no finding kind", group="two traces"),
    Case("a policy module glob that matches no module",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--policy",
                            _policy_file(c, '[[module]]\nglob = "fc9*"\nlimit = 8')],
         needle="matches no module of the traces", group="two traces"),
    Case("a policy whose min_entries the compare does not reach",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--policy", _policy_file(c, "min_entries = 100000")],
         needle="fewer than the policy's min_entries", group="two traces"),
    Case("a policy min_entries that is not a count",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--policy", _policy_file(c, "min_entries = 0")],
         needle="'min_entries' must be a whole number", group="two traces"),
    Case("two outputs to standard output",
         args=lambda e, c: ["compare", e["ref"], e["tgt"], "--json", "-", "--summary-md", "-"],
         needle="only one of", group="two traces"),
]


@pytest.fixture(scope="module")
def env2(env) -> dict[str, Path]:
    """Traces for the two-trace cases: another model, one step, another configuration."""
    root, scen = env["root"], env["scen"]
    return dict(env, other=record_trace(scen, "other", root / "other"),
                one_step=record_trace(scen, "build", root / "one", steps=1, replay=env["ref"]),
                wide=record_trace(scen, "wide", root / "wide"))


_RESULTS: dict[str, tuple[str, str]] = {}


def _normalise(line: str, env: dict[str, Path], copy: Path) -> str:
    line = line.removeprefix("driftcheck: ")
    for path, name in ((copy, "TRACE"), (copy.parent, "TMP"), (env["ref"], "REF"),
                       (env["scen"], "SCENARIOS.py")):
        line = line.replace(str(path), name)
    line = line.replace(str(env["root"]), "TMP")
    return re.sub(r"\(line \d+ column \d+ \(char \d+\)\)", "(line L column C (char N))", line)


def _doc_cell(msg: str) -> str:
    return "`" + msg.replace("|", "\\|").replace("`", "'") + "`"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_catalogue(case: Case, env2, tmp_path, capsys):
    copy = tmp_path / "target"
    shutil.copytree(env2[case.base], copy)
    if case.mutate is not None:
        case.mutate(copy)
    args = (case.args or _cmp)(env2, copy)
    code, _out, err = run_cli(args, capsys)
    line = assert_one_line_error(code, err, case.needle)
    msg = _normalise(line, env2, copy)
    _RESULTS[case.name] = (case.group, msg)
    # A failed record never leaves anything that passes as a complete trace.
    if args[0] == "record":
        out_dir = Path(args[args.index("--out") + 1])
        if out_dir != env2["ref"] and out_dir != env2["scen"] and out_dir.exists():
            assert_not_complete(out_dir)
    if not UPDATE_DOCS:
        assert _doc_cell(msg) in DOC.read_text(), (
            f"docs/bad-inputs.md does not list this message; regenerate it with "
            f"DRIFTCHECK_UPDATE_DOCS=1 pytest tests/test_bad_inputs.py\n{msg}")


@pytest.fixture(scope="module", autouse=True)
def _write_doc_table():
    yield
    if not UPDATE_DOCS or len(_RESULTS) != len(CASES):
        return
    rows: list[str] = []
    group = None
    for c in CASES:
        g, msg = _RESULTS[c.name]
        if g != group:
            rows += ["", f"### {g}", "", "| bad input | message (exit code 2) |", "|---|---|"]
            group = g
        rows.append(f"| {c.name} | {_doc_cell(msg)} |")
    text = DOC.read_text()
    begin, end = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    DOC.write_text(head + begin + "\n" + "\n".join(rows).strip("\n") + "\n" + end + tail)


# -- valid but awkward inputs: they record and compare without crashing --------------------------
def test_odd_tensors_record_and_compare(env, tmp_path, capsys):
    """Scalar, zero-size, integer, bool and complex tensors as params, buffers, inputs, outputs."""
    scen = env["scen"]
    ref, same, bf16 = tmp_path / "ref", tmp_path / "same", tmp_path / "bf16"
    for args in (["record", f"{scen}:odd", "--out", ref],
                 ["record", f"{scen}:odd", "--out", same, "--replay", ref],
                 ["record", f"{scen}:odd", "--out", bf16, "--replay", ref, "--dtype", "bf16"]):
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
    m = json.loads((ref / "manifest.json").read_text())
    kinds = {(e["dtype"], len(e["shape"]), 0 in e["shape"]) for e in m["entries"]}
    for want in [("float32", 0, False), ("float32", 2, True), ("int64", 0, False),
                 ("int64", 1, False), ("bool", 1, False), ("complex64", 1, False)]:
        assert want in kinds, want
    # Stats of the zero-size tensor have no finite value: null in strict JSON, not NaN.
    none = next(e for e in m["entries"] if e["slot"] == "output.none")
    assert none["stats"]["numel"] == 0 and none["stats"]["min"] is None
    # The complex parameter trains (its gradient and update are recorded) and stays complex.
    assert any(e["slot"] == "param.rot" and e["phase"] == "grads" and e["dtype"] == "complex64"
               for e in m["entries"])
    b = json.loads((bf16 / "manifest.json").read_text())
    assert {e["dtype"] for e in b["entries"] if e["slot"] == "buffer.phase"} == {"complex64"}

    code, _, err = run_cli(["compare", ref, same, "--json", tmp_path / "same.json"], capsys)
    assert code == 0, err  # a replay of itself: every entry, whatever its dtype, matches exactly
    code, _, err = run_cli(["compare", ref, bf16, "--json", tmp_path / "bf16.json"], capsys)
    assert code in (0, 1) and "Traceback" not in err, err
    rep = json.loads((tmp_path / "bf16.json").read_text())
    slots = {(e["slot"], e["status"]) for e in rep["entries"]}
    assert ("output.idx", "ok") in slots and ("output.flag", "ok") in slots  # exact on both sides


def test_nan_in_the_reference_is_reported_not_a_crash(env, tmp_path, capsys):
    ref, tgt = record_ref_and_bf16(f"{env['scen']}:nan_ref", tmp_path, capsys)
    code, out, err = run_cli(["compare", ref, tgt, "--json", tmp_path / "r.json"], capsys)
    assert code in (0, 1) and not err.strip(), err
    rep = json.loads((tmp_path / "r.json").read_text())
    found = [f for f in rep["findings"] if f["kind"] == "nonfinite.reference"]
    assert found and "0/forward/./0/input.0" in found[0]["message"]
    assert "nonfinite.reference" in out


def test_real_versus_complex_output_is_a_finding_not_a_crash(env, tmp_path, capsys):
    ref, tgt = record_ref_and_bf16(f"{env['scen']}:kind_flip", tmp_path, capsys)
    code, _, err = run_cli(["compare", ref, tgt, "--json", tmp_path / "r.json"], capsys)
    assert code == 1 and not err.strip(), err
    kinds = [f for f in json.loads((tmp_path / "r.json").read_text())["findings"]
             if f["kind"] == "alignment.dtype_mismatch"]
    assert kinds and "complex64" in kinds[0]["message"]


@pytest.mark.parametrize("fn", ["empty_inference", "frozen_inference"])
def test_models_without_training_record_inference_only(env, tmp_path, capsys, fn):
    out = tmp_path / "t"
    code, _, err = run_cli(["record", f"{env['scen']}:{fn}", "--out", out], capsys)
    assert code == 0, err
    phases = {e["phase"] for e in json.loads((out / "manifest.json").read_text())["entries"]}
    assert phases <= {"params", "forward"} and "forward" in phases


def test_html_report_escapes_hostile_module_names(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # wide enough that the terminal table wraps no key
    scen = env["scen"]
    ref, tgt, html = tmp_path / "ref", tmp_path / "tgt", tmp_path / "r.html"
    assert run_cli(["record", f"{scen}:hostile", "--out", ref], capsys)[0] == 0
    assert run_cli(["record", f"{scen}:hostile", "--out", tgt, "--replay", ref, "--dtype", "bf16"],
                   capsys)[0] == 0
    # --limit tiny: every entry fails, so every module name reaches the tables and details.
    code, out, err = run_cli(["compare", ref, tgt, "--html", html, "--limit", "1e-12", "--top", "100"],
                             capsys)
    assert code == 1, err
    assert "[/]x[bold red]y" in out  # rich markup in a name is printed as text, not parsed
    page = html.read_text()
    for payload in ("<script>alert(1)</script>", "<script>alert(2)</script>",
                    "<img src=x onerror=alert(3)>", "q\"'&amp;"):
        assert payload not in page, payload
    # Present, but only as text: HTML-escaped in the page, \u-escaped in the embedded JSON.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the first divergence's module
    for payload in ("<script>alert(1)</script>", "<img src=x onerror=alert(3)>"):
        as_json = payload.replace("<", "\\u003c").replace(">", "\\u003e")  # entry table data
        assert as_json in page, as_json
    # The only script elements are the report's own.
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert all("alert" not in s for s in scripts) and page.count("alert(") >= 3


def test_existing_trace_is_never_overwritten_without_force(env, tmp_path, capsys):
    out = tmp_path / "t"
    shutil.copytree(env["ref"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = run_cli(["record", f"{env['scen']}:build", "--out", out], capsys)
    assert_one_line_error(code, err, "--force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_no_code_runs_from_trace_files():
    """Trace content is read with safetensors and JSON only: no pickle, no torch.load, no eval."""
    pkg = ROOT / "driftcheck"
    forbidden = re.compile(r"\btorch\.load\b|\bpickle\b|\bcPickle\b|\bdill\b|\bmarshal\b|"
                           r"\bjoblib\b|allow_pickle|\byaml\.load\b|(?<![\w.])eval\(|(?<![\w.])exec\(|"
                           r"\bnp\.load\b|\bnumpy\.load\b|weights_only")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted(pkg.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if forbidden.search(line) and "nothing is ever unpickled" not in line.lower()
            and not line.strip().startswith("#")]
    assert hits == []
    # One reader: the trace files are read through our own safetensors header parser and json
    # only (driftcheck/store/shard.py), never through a second parser.
    store = "".join(p.read_text() for p in sorted((pkg / "store").glob("*.py")))
    assert "safe_open" not in store and "json.loads" in (pkg / "store" / "shard.py").read_text()


def test_pickle_payload_in_a_trace_is_never_executed(env, tmp_path, capsys):
    """A shard and a replay file replaced by pickles whose unpickling would write a marker."""
    import torch

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    tgt = tmp_path / "tgt"
    shutil.copytree(env["tgt"], tgt)
    for f in (_shard(tgt), tgt / "replay.safetensors"):
        torch.save({"x": Payload()}, f)
    m = _manifest(tgt)
    m["shards"][_shard(tgt).name] = _shard(tgt).stat().st_size
    _put_manifest(tgt, m)
    code, _, err = run_cli(["compare", env["ref"], tgt], capsys)
    assert_one_line_error(code, err, "corrupt")
    code, _, err = run_cli(["record", f"{env['scen']}:build", "--out", tmp_path / "o",
                            "--replay", tgt], capsys)
    assert_one_line_error(code, err, "replay")
    assert not marker.exists()


def test_debug_shows_the_traceback(env, tmp_path, capsys):
    code, _, err = run_cli(["--debug", "record", f"{env['scen']}:forward_raises", "--out",
                            tmp_path / "t"], capsys)
    assert code == 2
    assert "Traceback" in err and "ValueError: shapes do not line up" in err  # the user's own frame
    assert err.strip().splitlines()[-1].startswith("driftcheck: ")


def test_console_script_process_prints_one_line(env, tmp_path):
    """The real process (python -m driftcheck): stderr is one line, exit 2."""
    import subprocess
    import sys

    bad = tmp_path / "bad"
    shutil.copytree(env["tgt"], bad)
    _flip(_shard(bad), 8, 6)
    proc = subprocess.run([sys.executable, "-m", "driftcheck", "compare", str(env["ref"]), str(bad)],
                          cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 2
    assert_one_line_error(proc.returncode, proc.stderr, "unreadable safetensors header")

"""Behaviour parity of a refactor: record and compare a fixed matrix through the CLI, keep the outputs.

    python bench/parity.py --out /tmp/before               # on the old code: records and reports
    python bench/parity.py --out /tmp/after                # on the new code: records and reports
    python bench/parity.py --recompare /tmp/before --out /tmp/again   # new code, old traces
    python bench/parity.py --diff /tmp/before /tmp/after --what traces   # tensors and manifests
    python bench/parity.py --diff /tmp/before /tmp/again                 # reports, byte for byte
    python bench/parity.py --diff /tmp/before /tmp/again --new-fields limit,gate   # but new fields
    python bench/parity.py --models bench/zoo.py:tv_resnet,bench/zoo.py:hf_rwkv --out /tmp/c   # corpus entries

The matrix: every built-in and hf: scenario, an fp32 reference against a bf16 replay, full mode
with and without local replay, stats mode; plus the audits (resnet with the simulated torch_tpu
BatchNorm bug and the view audit), emulated fp8, and a float64 truth run. `--diff` says which
reports differ byte for byte and which traces differ in any tensor or manifest field (the
manifest's volatile fields, run ids, timestamps and paths, are left out). Reports name their runs'
ids, so they are proven identical by `--recompare`: the new code compares the old traces.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BUILTINS = ["mlp", "resnet", "llama", "vit"]
HF = ["hf:convnext", "hf:deepseek_v3", "hf:dinov2", "hf:gemma", "hf:llama", "hf:mistral", "hf:qwen2",
      "hf:qwen3", "hf:resnet", "hf:unet", "hf:vit", "hf:wav2vec2", "hf:whisper"]
VOLATILE = {"run_id", "created", "replay_id", "replay_of", "local_of"}
COMPARES = [("full", "ref", "tgt", []), ("local", "ref", "tgt-local", []), ("stats", "ref-stats", "tgt-stats", [])]
EXTRA_COMPARES = [("bn", "rn-ref", "rn-bn", []), ("views", "rn-ref", "rn-views", []),
                  ("fp8", "ll-ref", "ll-fp8", []), ("fp16", "ll-ref", "ll-fp16", []),
                  ("truth", "ll-ref", "ll-bf16", ["--truth", "ll-truth"])]


def _dc(*args: str) -> int:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "driftcheck", "--quiet", *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).returncode


def _one(model: str, out: Path) -> None:
    d = out / model.replace(":", "_")
    d.mkdir(parents=True, exist_ok=True)
    rec = lambda name, *a: _dc("record", model, "--out", str(d / name), "--force", *a)  # noqa: E731
    rec("ref")
    rec("tgt", "--dtype", "bf16", "--replay", str(d / "ref"))
    rec("tgt-local", "--dtype", "bf16", "--replay", str(d / "ref"), "--local", str(d / "ref"))
    rec("ref-stats", "--mode", "stats")
    rec("tgt-stats", "--mode", "stats", "--dtype", "bf16", "--replay", str(d / "ref-stats"))
    _compares(d, d, COMPARES)


def _compares(src: Path, dst: Path, table: list, html: bool = False) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name, ref, tgt, extra in table:
        extra = [str(src / e) if i and extra[i - 1] == "--truth" else e for i, e in enumerate(extra)]
        rc = _dc("compare", str(src / ref), str(src / tgt), "--json", str(dst / f"{name}.json"),
                 "--summary-md", str(dst / f"{name}.md"), "--junit", str(dst / f"{name}.xml"), *extra)
        (dst / f"{name}.rc").write_text(str(rc))
        if html:
            _dc("report", str(dst / f"{name}.json"), "--html", str(dst / f"{name}.html"))


def _extras(out: Path) -> None:
    d = out / "extras"
    d.mkdir(parents=True, exist_ok=True)
    _dc("record", "resnet", "--out", str(d / "rn-ref"), "--force", "--view-audit")
    _dc("record", "resnet", "--out", str(d / "rn-bn"), "--force", "--view-audit", "--replay",
        str(d / "rn-ref"), "--simulate", "skip-bn-stats")
    _dc("record", "resnet", "--out", str(d / "rn-views"), "--force", "--view-audit", "--replay",
        str(d / "rn-ref"), "--simulate", "views-become-copies")
    _dc("record", "llama", "--out", str(d / "ll-ref"), "--force")
    _dc("record", "llama", "--out", str(d / "ll-fp8"), "--force", "--fp8", "hybrid", "--replay", str(d / "ll-ref"))
    _dc("record", "llama", "--out", str(d / "ll-truth"), "--force", "--dtype", "fp64", "--replay", str(d / "ll-ref"))
    _dc("record", "llama", "--out", str(d / "ll-bf16"), "--force", "--dtype", "bf16", "--replay", str(d / "ll-ref"))
    _dc("record", "llama", "--out", str(d / "ll-fp16"), "--force", "--dtype", "fp16", "--replay", str(d / "ll-ref"))
    _compares(d, d, EXTRA_COMPARES, html=True)


def recompare(src: Path, dst: Path) -> None:
    """Every model folder under ``src`` (``extras``, or one holding a ``ref`` trace: a MODEL spec
    with a path, ``bench/zoo.py:tv_resnet``, is a folder below ``bench/``) compared again."""
    folders = [p for p in src.rglob("*") if p.is_dir() and (p.name == "extras" or (p / "ref").is_dir())]
    for d in sorted(folders):
        rel = d.relative_to(src)
        _compares(d, dst / rel, EXTRA_COMPARES if d.name == "extras" else COMPARES, d.name == "extras")
        print(f"{str(rel):16s} compared", flush=True)


def _manifest(path: Path) -> dict:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(json.loads((path / "manifest.json").read_text()))


def _tensors(path: Path) -> dict:
    from safetensors import safe_open
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[(str(f.relative_to(path)), k)] = h.get_tensor(k)
    return out


def _bitwise(a, b) -> bool:
    """Same dtype, shape and bytes (NaN payloads included, which torch.equal calls unequal)."""
    import torch
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(flat(a), flat(b))


def _without(text: bytes, fields: list[str]) -> bytes:
    """A JSON report without the entry/finding fields a change added (``--new-fields``)."""
    doc = json.loads(text)
    for item in doc.get("entries", []) + doc.get("findings", []):
        for f in fields:
            item.pop(f, None)
    return json.dumps(doc, indent=1).encode()


def diff(a: Path, b: Path, what: str, new_fields: list[str] | None = None) -> int:
    """what: "reports" (byte for byte; JSON reports without ``new_fields`` of B when given) or
    "traces" (tensors bit for bit and non-volatile manifest fields)."""
    bad = n = 0
    for fa in sorted(a.rglob("*")):
        rel, fb = fa.relative_to(a), b / fa.relative_to(a)
        in_trace = (fa.parent / "manifest.json").is_file()
        if what == "reports" and fa.is_file() and not in_trace and fa.suffix in {".json", ".md", ".xml", ".rc", ".html"}:
            n += 1
            ta, tb = fa.read_bytes(), fb.read_bytes() if fb.is_file() else None
            if new_fields and tb is not None and fa.suffix == ".json":
                ta, tb = _without(ta, []), _without(tb, new_fields)
            if ta != tb:
                print(f"report differs: {rel}")
                bad += 1
        elif what == "traces" and fa.is_dir() and (fa / "manifest.json").is_file():
            n += 1
            if not (fb / "manifest.json").is_file() or _manifest(fa) != _manifest(fb):
                print(f"manifest differs: {rel}")
                bad += 1
                continue
            ta, tb = _tensors(fa), _tensors(fb)
            if ta.keys() != tb.keys() or any(not _bitwise(ta[k], tb[k]) for k in ta):
                print(f"tensors differ: {rel}")
                bad += 1
    print(f"parity: {n} {what} compared, " + ("all identical" if not bad else f"{bad} differ"))
    return 1 if bad or not n else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--diff", nargs=2, type=Path)
    ap.add_argument("--what", choices=["reports", "traces"], default="reports", help="what --diff compares")
    ap.add_argument("--new-fields", default=None,
                    help="comma list of entry/finding fields the new code adds to JSON reports")
    ap.add_argument("--recompare", type=Path, help="compare this --out folder's traces again into --out")
    ap.add_argument("--models", default=None, help="comma list (default: built-ins and hf:*)")
    args = ap.parse_args()
    if args.diff:
        return diff(*args.diff, args.what, args.new_fields.split(",") if args.new_fields else None)
    if args.recompare:
        recompare(args.recompare, args.out)
        return 0
    models = args.models.split(",") if args.models else BUILTINS + HF
    for m in models:
        t0 = time.perf_counter()
        _one(m, args.out)
        print(f"{m:16s} {time.perf_counter() - t0:6.1f} s", flush=True)
    _extras(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

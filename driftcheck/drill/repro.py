"""A standalone reproduction of one op's defect: what a user attaches to a backend bug report.

``repro/`` holds ``inputs.safetensors`` (the op's inputs as the reference computed them) and
``repro.py``, a script that needs torch alone (it reads safetensors' simple format itself). It
runs the op on the target device in the target's dtypes and in float64 on the CPU, prints the
error next to the floor driftcheck measured for that op (a trusted kernel's error in the same
dtypes), and exits 1 while the error exceeds the limit, 0 once it does not.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from driftcheck.drill.judge import OpJudgement
from driftcheck.drill.oplog import OpRecord

_SCRIPT = '''\
"""Repro of {op} ({phase}) from driftcheck {version}: {where}.

Reference: {ref_device} {ref_dtype}; target: {tgt_device}, inputs {in_dtypes}.
Measured by driftcheck: error {error:.3e}, floor {floor:.3e} (ratio {ratio:.3g}, limit {limit:g}).

    python repro.py                 # on the recorded target device
    python repro.py --device cpu    # elsewhere

Exit 0: within {limit:g} floors of the float64 truth; 1: the defect is there; 2: cannot run.
Needs torch only.
"""
import argparse, json, math, os, struct, sys

import torch

OP = {op!r}
SPEC = json.loads({spec!r})
IN_DTYPES = {in_dtypes!r}
OUTPUT = {output}
FLOOR = {floor!r}
LIMIT = {limit!r}
DEVICE = {tgt_device!r}
HERE = os.path.dirname(os.path.abspath(__file__))
_DT = {{"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
       "F8_E5M2": getattr(torch, "float8_e5m2", None)}}


def load(path):
    """safetensors without the package: an 8-byte header length, a JSON header, the bytes."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {{}}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        a, b = m["data_offsets"]
        dt = _DT[m["dtype"]]
        if b == a:
            out[name] = torch.empty(m["shape"], dtype=dt)
        else:
            out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=dt).reshape(m["shape"]).clone()
    return out


def decode(x, leaves, device, f64):
    if isinstance(x, dict):
        if "T" in x:
            return leaves[x["T"]]
        if "F" in x:
            return float(x["F"])
        if "L" in x:
            return [decode(v, leaves, device, f64) for v in x["L"]]
        if "dtype" in x:
            dt = getattr(torch, x["dtype"])
            return torch.float64 if f64 and dt.is_floating_point else dt
        if "device" in x:
            return torch.device(device)
        if "enum" in x:
            return getattr(torch, x["enum"])
    return x


def run(device, f64):
    ins = load(os.path.join(HERE, "inputs.safetensors"))
    leaves = []
    for i, dt in enumerate(IN_DTYPES):
        t = ins[str(i)]
        if t.is_floating_point():
            low = getattr(torch, dt)
            if not f64 and low.is_floating_point and torch.finfo(low).max < torch.finfo(t.dtype).max:
                big = torch.finfo(low).max  # saturate, as the target's own code would have it
                t = torch.where(torch.isfinite(t), t.clamp(-big, big), t)
            t = t.to(torch.float64 if f64 else low)
        leaves.append(t.to(device))
    ns, packet, overload = OP.split(".", 2)
    fn = getattr(getattr(getattr(torch.ops, ns), packet), overload)
    args = [decode(a, leaves, device, f64) for a in SPEC["args"]]
    kwargs = {{k: decode(v, leaves, device, f64) for k, v in SPEC["kwargs"].items()}}
    with torch.no_grad():
        out = fn(*args, **kwargs)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return out[OUTPUT].detach().to("cpu", torch.float64)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=DEVICE)
    device = p.parse_args().device
    try:
        got = run(device, False)
    except Exception as e:  # the op does not run there: say so, not a verdict
        print(f"cannot run {{OP}} on {{device}}: {{type(e).__name__}}: {{e}}")
        return 2
    truth = run("cpu", True)
    finite = torch.isfinite(truth)
    if bool((~torch.isfinite(got) & finite).any()):
        print(f"{{OP}} on {{device}}: NaN/Inf where the float64 truth is finite")
        return 1
    diff = torch.where(finite, got - truth, 0.0)
    err = math.sqrt(float((diff * diff).mean())) if diff.numel() else 0.0
    ratio = err / FLOOR
    print(f"{{OP}} output {{OUTPUT}} on {{device}}: rms error {{err:.3e}} against float64, "
          f"floor {{FLOOR:.3e}} ({{', '.join(sorted(set(IN_DTYPES)))}} kernels): {{ratio:.3g}} floors "
          f"(limit {{LIMIT:g}})")
    if ratio > LIMIT:
        print("DEFECT: the error is beyond what the precision explains")
        return 1
    print("OK: within the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def write_repro(path: Path, ref_op: OpRecord, tgt_op: OpRecord, j: OpJudgement, *,
                ref_run: dict[str, Any], tgt_run: dict[str, Any], limit: float) -> Path:
    """Write ``path/inputs.safetensors`` and ``path/repro.py``; returns the script's path."""
    from safetensors.torch import save_file

    from driftcheck.version import __version__

    path.mkdir(parents=True, exist_ok=True)
    save_file({str(i): t.detach().cpu().contiguous().clone() for i, t in enumerate(ref_op.inputs or [])},
              str(path / "inputs.safetensors"))
    src = j.source or {}
    where = f"{src.get('file')}:{src.get('line')} {src.get('code', '')}".strip() if src else "source unknown"
    script = _SCRIPT.format(
        op=tgt_op.op, phase=tgt_op.phase, version=__version__, where=where,
        ref_device=ref_run.get("device", "cpu"), ref_dtype=ref_run.get("dtype", "?"),
        tgt_device=tgt_run.get("device", "cpu"), in_dtypes=list(tgt_op.in_dtypes),
        error=j.error, floor=j.floor, ratio=j.ratio, limit=limit, spec=json.dumps(tgt_op.spec),
        output=j.output)
    (path / "repro.py").write_text(script, encoding="utf-8")
    (path / "README.md").write_text(
        f"# {tgt_op.op} ({tgt_op.phase})\n\nIssued by `{where}`.\n\n"
        f"Error {j.error:.3e} against float64 where a correct kernel in the same dtypes has "
        f"{j.floor:.3e}: {j.ratio:.3g}x its floor.\n\n`python repro.py` (torch only) exits 1 "
        "while the defect is there.\n", encoding="utf-8")
    return path / "repro.py"


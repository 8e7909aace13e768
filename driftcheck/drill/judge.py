"""Judging each op of a drilled call against a floor for that op.

For an aligned pair (reference op, target op), on the reference op's recorded inputs:
- the truth: the reference's op in float64 on the CPU (falls back to the reference's output
  where the op has no float64 CPU kernel);
- the target's local output: the target's op rerun on those inputs cast to its dtypes, on the
  target's device, inside the faulty module if there is one (driftcheck/drill/side.py);
- the op's floor: a correct kernel on the same cast operands (with the reference's scalars and
  flags, the target's dtype arguments: ``merge_spec``), measured against the truth: the
  CPU's op on the operands widened to float32 where they are bf16/fp16 (products exact, sums
  accumulated wide, as DESIGN.md's numerics expect of a correct kernel), each output rounded once
  to the dtype the target returns, under the target's recorded TPU matmul emulation if it had
  one. It carries everything precision explains for *this* op on *these* operands: its dtypes,
  its reduction length, the magnitudes it cancels; a kernel that accumulates in bf16 (PyTorch's
  own CPU LayerNorm backward does) is beyond it. A floor never falls below one unit of roundoff
  of the output's rms (MIN_FLOOR_U: a correct kernel's rounding, rms u/sqrt(3), and an extra
  rounding or two of a correct kernel stay well under the limit; the module's local floor,
  compare's C_LOCAL, is the same u for one op, so a defect the local replay sees in a parent's
  own code, 2% of a bf16 product, is named here too).

ratio = rms(target - truth) / floor, per floating output; an op's ratio is its worst output's.
Ops that draw random numbers are not judged (their inputs are the reference's everywhere else).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from driftcheck.drill.oplog import OpRecord, cast_to, decode_args, resolve_op
from driftcheck.numerics import dtypes


@dataclasses.dataclass
class OpJudgement:
    ref_index: int
    tgt_index: int
    op: str
    phase: str
    ratio: float
    floor: float  # rms error of the trusted run against the truth (worst output's)
    error: float  # rms error of the target's local output against the truth
    size: float  # rms(target - trusted) / floor: the deviation from a correct kernel, in floors
    output: int  # which output is worst
    ratios: list[float | None]  # per output
    source: dict[str, Any] | None
    inputs: list[dict[str, Any]]  # shape and dtype of each tensor argument, target side
    truth: str  # "float64" or "reference"
    alternatives: dict[str, float] = dataclasses.field(default_factory=dict)  # see _alternatives

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _call(op: str, spec: Any, leaves: list[torch.Tensor],
          float_dtype: torch.dtype | Callable[[torch.dtype], torch.dtype] | None = None
          ) -> list[torch.Tensor | None] | None:
    try:
        a, k = decode_args(spec, leaves, device="cpu", float_dtype=float_dtype)
        with torch.no_grad():
            out = resolve_op(op)(*a, **k)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError, IndexError):
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach() if isinstance(o, torch.Tensor) else None for o in outs]


def _rms(x: torch.Tensor) -> float:
    return math.sqrt(float((x * x).mean())) if x.numel() else 0.0


_LOW = (torch.bfloat16, torch.float16)
MIN_FLOOR_U = 1.0  # the smallest floor of an op: this many units of roundoff of its output's rms
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "addmv", "mv"})
SUMS = frozenset({"sum", "mean"})


def _widen(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in _LOW else dt


def merge_spec(ref: Any, tgt: Any) -> Any:
    """The reference's arguments (what the model asked for: its scalars, its flags) with the
    target's tensors and dtype arguments (what its precision made of them: autocast's casts);
    where the two structures differ, the target's."""
    if isinstance(tgt, dict) and ("dtype" in tgt or "T" in tgt):
        return tgt
    if isinstance(ref, dict) and isinstance(tgt, dict):
        if "L" in ref and "L" in tgt and len(ref["L"]) == len(tgt["L"]):
            return {"L": [merge_spec(a, b) for a, b in zip(ref["L"], tgt["L"])]}
        if "args" in ref and "args" in tgt and len(ref["args"]) == len(tgt["args"]) \
                and set(ref["kwargs"]) == set(tgt["kwargs"]):
            return {"args": [merge_spec(a, b) for a, b in zip(ref["args"], tgt["args"])],
                    "kwargs": {k: merge_spec(v, tgt["kwargs"][k]) for k, v in ref["kwargs"].items()}}
        return ref if ref.keys() == tgt.keys() and "L" not in ref and "args" not in ref else tgt
    return tgt if isinstance(ref, dict) != isinstance(tgt, dict) else ref


def _ideal(tgt: OpRecord, cast: list[torch.Tensor], emulate: str | None,
           spec: Any = None) -> list[torch.Tensor | None] | None:
    """A correct kernel on the target's operands: bf16/fp16 operands computed in float32 (the
    products exact, the sums wide), each output rounded once to the dtype the target returns."""
    wide = [x.to(_widen(x.dtype)) if x.is_floating_point() else x for x in cast]
    ctx: Any = contextlib.nullcontext()
    if emulate:
        from driftcheck.targets.emulate import emulate_tpu

        ctx = emulate_tpu(emulate)
    with ctx:
        outs = _call(tgt.op, spec if spec is not None else tgt.spec, wide, _widen)
    if outs is None:
        return None
    return [o.to(getattr(torch, d)) if o is not None and d is not None and o.is_floating_point() else o
            for o, d in zip(outs, list(tgt.out_dtypes) + [None] * len(outs))]


def _alternatives(tgt: OpRecord, ins: list[torch.Tensor], truth: torch.Tensor) -> dict[str, float]:
    """Errors of wrong-but-plausible kernels on the same operands, for the known signatures: a
    float32 matmul done as one bf16 pass; a sum accumulated one element at a time in bf16."""
    alt: dict[str, float] = {}
    name = tgt.packet
    t64 = truth.double()
    if name in MATMULS and any(x.dtype == torch.float32 for x in ins if x.is_floating_point()):
        low = [x.to(torch.bfloat16).float() if x.dtype == torch.float32 else x for x in ins]
        outs = _call(tgt.op, tgt.spec, low)
        if outs and outs[0] is not None and outs[0].shape == truth.shape:
            alt["bf16_pass"] = _rms(outs[0].double() - t64)
    if name == "_scaled_mm":
        a, k = decode_args(tgt.spec, [x.clone() for x in ins])
        wrong = _scaled_mm_exact(a, k, wrong_axis=True)
        if wrong is not None and wrong.shape == truth.shape:
            alt["scales_wrong_axis"] = _rms(wrong - t64)
    if name in SUMS and ins and ins[0].is_floating_point() and 0 < ins[0].numel() <= 1 << 22:
        from driftcheck.targets.faults import sequential_sum

        x = ins[0]
        a, k = decode_args(tgt.spec, [x.clone()] + [i.clone() for i in ins[1:]])
        dim = a[1] if len(a) > 1 else k.get("dim")
        dims = tuple(range(x.dim())) if dim in (None, []) else ((dim,) if isinstance(dim, int) else tuple(dim))
        n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
        if x.dim() and n <= 8192:
            acc = sequential_sum(x.float(), dims, torch.bfloat16).double()
            if name == "mean":
                acc = acc / n
            if acc.numel() == t64.numel():
                alt["bf16_accumulation"] = _rms(acc.reshape(t64.shape) - t64)
    return alt


def _scaled_mm_exact(a: tuple, k: dict, wrong_axis: bool = False) -> torch.Tensor | None:
    """``_scaled_mm`` in float64 from its fp8 operands (exactly representable); with
    ``wrong_axis`` the row/column scales applied along the other axis (square outputs only)."""
    names = ("self", "mat2", "scale_a", "scale_b", "bias")
    v = dict(zip(names, a), **{n: k[n] for n in names if n in k})
    x, w, sa, sb = (v.get(n) for n in names[:4])
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(sa, torch.Tensor)
            and isinstance(sb, torch.Tensor)):
        return None
    acc = x.double() @ w.double()
    sa, sb = sa.double(), sb.double()
    if wrong_axis:
        if acc.shape[0] != acc.shape[1] or (sa.numel() == 1 and sb.numel() == 1):
            return None
        sa, sb = sa.reshape(1, -1) if sa.numel() > 1 else sa, sb.reshape(-1, 1) if sb.numel() > 1 else sb
    out = acc * sa * sb
    if isinstance(v.get("bias"), torch.Tensor):
        out = out + v["bias"].double()
    return out


def judge_pair(ref: OpRecord, tgt: OpRecord, emulate: str | None = None) -> OpJudgement | None:
    """The judgement of one aligned pair, or None where nothing can be judged (a random op, no
    local output, no floating output, arguments that could not be recorded)."""
    if ref.random or tgt.random or tgt.local is None or ref.inputs is None or ref.spec is None \
            or tgt.spec is None or len(ref.inputs) != len(tgt.in_dtypes):
        return None
    ins = [x.cpu() for x in ref.inputs]
    as64 = [x.double() if x.is_floating_point() else x for x in ins]
    if ref.packet == "_scaled_mm":  # no float64 kernel: its fp8 operands are exact in float64
        a, k = decode_args(ref.spec, [x.clone() for x in ins])
        exact = _scaled_mm_exact(a, k)
        truth: list[torch.Tensor | None] | None = [exact] if exact is not None else None
    else:
        truth = _call(ref.op, ref.spec, [x.clone() for x in as64], torch.float64)
    truth_kind = "float64"
    if truth is None:
        truth, truth_kind = [o.double() if o is not None and o.is_floating_point() else o
                             for o in (ref.outputs or [])], "reference"
    cast = [cast_to(x, getattr(torch, d)) if x.is_floating_point() else x for x, d in zip(ins, tgt.in_dtypes)]
    ideal = _ideal(tgt, [x.clone() for x in cast], emulate, merge_spec(ref.spec, tgt.spec))
    ratios: list[float | None] = []
    best: tuple[float, float, float, float, int] | None = None  # ratio, floor, error, size, k
    for out_index, y in enumerate(tgt.local):
        t = truth[out_index] if out_index < len(truth) else None
        if y is None or t is None or not y.is_floating_point() or tuple(y.shape) != tuple(t.shape):
            ratios.append(None)
            continue
        y64, t64 = y.detach().cpu().double(), t.double()
        finite = torch.isfinite(t64)
        if bool((~torch.isfinite(y64) & finite).any()):
            r = (math.inf, 0.0, math.inf, math.inf)
        else:
            y64, t64 = torch.where(finite, y64, 0.0), torch.where(finite, t64, 0.0)
            scale = _rms(t64)
            u = dtypes.unit_roundoff(y.dtype)
            f = ideal[out_index] if ideal is not None and out_index < len(ideal) else None
            f64 = torch.where(finite, f.double(), 0.0) if f is not None and \
                tuple(f.shape) == tuple(y.shape) and f.is_floating_point() else None
            e_f = _rms(f64 - t64) if f64 is not None else 0.0
            floor = max(e_f, MIN_FLOOR_U * u * scale, 1e-300)
            err = _rms(y64 - t64)
            size = _rms(y64 - f64) / floor if f64 is not None else err / floor
            r = (err / floor, floor, err, size)
        ratios.append(r[0])
        if best is None or r[0] > best[0]:
            best = (*r, out_index)
    if best is None:
        return None
    alt = {}
    if best[0] > 1 and truth[0] is not None and tgt.local[0] is not None:
        alt = _alternatives(tgt, cast, truth[0])
    return OpJudgement(ref_index=ref.index, tgt_index=tgt.index, op=tgt.op, phase=tgt.phase,
                       ratio=best[0], floor=best[1], error=best[2], size=best[3], output=best[4],
                       ratios=ratios, source=tgt.source or ref.source,
                       inputs=[{"shape": s, "dtype": d} for s, d in zip(tgt.in_shapes, tgt.in_dtypes)],
                       truth=truth_kind, alternatives=alt)


def judge(ref_ops: list[OpRecord], tgt_ops: list[OpRecord], pairs: list[tuple[int, int]],
          emulate: str | None = None) -> list[OpJudgement]:
    """Every judgeable aligned pair, in the target's op order."""
    out = []
    for r, t in sorted(pairs, key=lambda p: p[1]):
        j = judge_pair(ref_ops[r], tgt_ops[t], emulate)
        if j is not None:
            out.append(j)
    return out

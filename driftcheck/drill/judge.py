"""Judging each op of a drilled call against a floor for that op.

For an aligned pair (reference op, target op), on the reference op's recorded inputs:
- the truth: the reference's op in float64 on the CPU (falls back to the reference's output
  where the op has no float64 CPU kernel);
- the target's local output: the target's op rerun on those inputs cast to its dtypes, on the
  target's device, inside the faulty module if there is one (driftcheck/drill/side.py);
- the op's floor: the same op computed by a trusted implementation (the CPU's kernels, with the
  target's recorded TPU matmul emulation if it had one) on the same cast inputs, measured against
  the truth. It carries everything precision explains for *this* op on *these* operands: its
  dtype, its reduction length, the magnitudes it cancels. A floor never falls below two units of
  roundoff of the output's rms (two correct kernels differ by an ulp or two).

ratio = rms(target - truth) / floor, per floating output; an op's ratio is its worst output's.
Ops that draw random numbers are not judged (their inputs are the reference's everywhere else).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch

from driftcheck import dtypes
from driftcheck.drill.oplog import OpRecord, decode_args, resolve_op


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _call(op: str, spec: Any, leaves: list[torch.Tensor], float_dtype: torch.dtype | None = None
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


def judge_pair(ref: OpRecord, tgt: OpRecord, emulate: str | None = None) -> OpJudgement | None:
    """The judgement of one aligned pair, or None where nothing can be judged (a random op, no
    local output, no floating output, arguments that could not be recorded)."""
    if ref.random or tgt.random or tgt.local is None or ref.inputs is None or ref.spec is None \
            or tgt.spec is None or len(ref.inputs) != len(tgt.in_dtypes):
        return None
    ins = [x.cpu() for x in ref.inputs]
    as64 = [x.double() if x.is_floating_point() else x for x in ins]
    truth = _call(ref.op, ref.spec, [x.clone() for x in as64], torch.float64)
    truth_kind = "float64"
    if truth is None:
        truth, truth_kind = [o.double() if o is not None and o.is_floating_point() else o
                             for o in (ref.outputs or [])], "reference"
    cast = [x.to(getattr(torch, d)) if x.is_floating_point() else x for x, d in zip(ins, tgt.in_dtypes)]
    ctx: Any = contextlib.nullcontext()
    if emulate:
        from driftcheck.emulate import emulate_tpu

        ctx = emulate_tpu(emulate)
    with ctx:
        trusted = _call(tgt.op, tgt.spec, [x.clone() for x in cast])
    ratios: list[float | None] = []
    best: tuple[float, float, float, float, int] | None = None  # ratio, floor, error, size, k
    for k, y in enumerate(tgt.local):
        t = truth[k] if k < len(truth) else None
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
            e_f = 0.0
            f = trusted[k] if trusted is not None and k < len(trusted) else None
            if f is not None and tuple(f.shape) == tuple(y.shape) and f.is_floating_point():
                f64 = torch.where(finite, f.double(), 0.0)
                e_f = _rms(f64 - t64)
            else:
                f64 = None
            floor = max(e_f, 2 * u * scale, 1e-300)
            err = _rms(y64 - t64)
            size = _rms(y64 - f64) / floor if f64 is not None else err / floor
            r = (err / floor, floor, err, size)
        ratios.append(r[0])
        if best is None or r[0] > best[0]:
            best = (*r, k)
    if best is None:
        return None
    return OpJudgement(ref_index=ref.index, tgt_index=tgt.index, op=tgt.op, phase=tgt.phase,
                       ratio=best[0], floor=best[1], error=best[2], size=best[3], output=best[4],
                       ratios=ratios, source=tgt.source or ref.source,
                       inputs=[{"shape": s, "dtype": d} for s, d in zip(tgt.in_shapes, tgt.in_dtypes)],
                       truth=truth_kind)


def judge(ref_ops: list[OpRecord], tgt_ops: list[OpRecord], pairs: list[tuple[int, int]],
          emulate: str | None = None) -> list[OpJudgement]:
    """Every judgeable aligned pair, in the target's op order."""
    out = []
    for r, t in sorted(pairs, key=lambda p: p[1]):
        j = judge_pair(ref_ops[r], tgt_ops[t], emulate)
        if j is not None:
            out.append(j)
    return out

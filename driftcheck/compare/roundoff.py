"""Unit roundoff: the precision each side computed an entry with (its dtype, its inputs' and
parameters', autocast, the run's matmul precision) and the one its sums accumulate in."""
from __future__ import annotations

from typing import Any

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.numerics import dtypes
from driftcheck.numerics.roundoff import effective_matmul_roundoff
from driftcheck.store.keys import TraceKey

MATMUL_KINDS = ("linear", "conv", "composite")


def matmul_roundoff(run: dict[str, Any], dtype: str, phase: str, kind: str | None) -> float:
    """The unit roundoff a run's matmul-like op (``kind``) of ``dtype`` computes with (TF32, a
    TPU's bf16 passes, fp8); a complex tensor (no matmul precision model) rounds as its
    components are stored."""
    if dtypes.measure_kind(dtype) == "complex":
        return dtypes.unit_roundoff(dtype)
    op = {"linear": "linear", "conv": "conv"}.get(kind or "", "matmul")
    return effective_matmul_roundoff(run.get("precision") or {}, dtype, phase=phase, op=op)


def autocast_roundoff(run: dict[str, Any]) -> float:
    """The unit roundoff of a run's autocast dtype (0 without autocast)."""
    cast = run.get("autocast") or (run.get("precision") or {}).get("autocast")
    return dtypes.unit_roundoff(cast) if isinstance(cast, str) and cast else 0.0


class Roundoff:
    """(u, u_acc) of an entry: the coarser side's unit roundoff and that of its accumulator."""

    def __init__(self, index: DependencyIndex, tgt_map: dict[TraceKey, TraceEntry],
                 ref_run: dict[str, Any], tgt_run: dict[str, Any]) -> None:
        self.index, self.tgt_map = index, tgt_map
        self.ref_run, self.tgt_run = ref_run, tgt_run

    def of(self, r: TraceEntry, t: TraceEntry) -> tuple[float, float]:
        """(u, u_acc) of entry ``r`` (``t`` the target's)."""
        u, u_acc = self.unit(r, t), self.accumulation(r, t)
        if r.phase == "grads" and self.index.owner_kind(r) in ("norm", "batchnorm"):
            # A norm kernel's backward sums its parameters' gradients in the storage dtype
            # (CPU bf16 LayerNorm: 7% on a bias over 512 positions), not in fp32: that of its
            # output gradient, under autocast too, where the parameters are fp32 (timm_coatnet:
            # 10% on a LayerNorm2d weight over 512 positions).
            u_acc = max(u_acc, u, self.grad_output_u(r))
        return u, u_acc

    def unit(self, r: TraceEntry, t: TraceEntry) -> float:
        """u: the coarser side, matmul precision where it applies."""
        u = max(dtypes.unit_roundoff(r.dtype), dtypes.unit_roundoff(t.dtype))
        if r.phase in ("forward", "backward") and not (r.phase == "forward" and r.slot_is("input")):
            u = self._operands(r, u)
        if r.phase in ("forward", "backward"):
            # Under autocast any op may run in the autocast dtype whatever dtype its tensors
            # are stored in (a LayerNorm whose fp32 tensors carry bf16 rounding), the code
            # between submodules included.
            u = max([u] + [autocast_roundoff(run) for run in (self.ref_run, self.tgt_run)])
        kind = r.meta.get("kind")
        if r.phase in ("forward", "backward", "loss") and (kind in MATMUL_KINDS or r.phase == "loss"):
            for run, e in ((self.ref_run, r), (self.tgt_run, t)):
                u = max(u, matmul_roundoff(run, e.dtype, r.phase, kind))
        if r.phase == "grads" and r.slot == "param.weight":
            # a weight gradient is a matmul too (of the output gradient and the input): the
            # run's matmul precision applies (TF32, a TPU's bf16 passes)
            owner = self.index.owner_kind(r)
            if owner in MATMUL_KINDS:
                for run, e in ((self.ref_run, r), (self.tgt_run, t)):
                    u = max(u, matmul_roundoff(run, e.dtype, "backward", owner))
        return u

    def _operands(self, r: TraceEntry, u: float) -> float:
        # A module computes in the lowest precision among its inputs (a gate in bf16 beside
        # an fp32 hidden state): its outputs and input gradients carry that rounding.
        # Its own parameters count too (a norm's bf16 weight times an fp32 hidden state).
        for e in list(self.index.fwd_in.get(Call(r.step, r.module, r.call), ())) + \
                list(self.index.params.get((r.step, r.module), ())):
            te = self.tgt_map.get(e.align)
            for d in (e.dtype, te.dtype if te is not None else e.dtype):
                if dtypes.is_float(d):
                    u = max(u, dtypes.unit_roundoff(d))
        return u

    @staticmethod
    def accumulation(r: TraceEntry, t: TraceEntry) -> float:
        return max(dtypes.accumulation_roundoff(r.dtype), dtypes.accumulation_roundoff(t.dtype))

    def grad_output_u(self, r: TraceEntry) -> float:
        """The coarsest unit roundoff among the target's output gradients of the calls of the
        module a parameter entry belongs to (the dtype its backward kernel computes in)."""
        u = 0.0
        for c in self.index.calls.get((r.step, r.module), ()):
            for e in self.index.gout.get(Call(r.step, r.module, c), [])[:1]:
                t = self.tgt_map.get(e.align)
                if t is not None and dtypes.is_float(t.dtype):
                    u = max(u, dtypes.unit_roundoff(t.dtype))
        return u

"""Second opinions on an entry: the target's local replay of its module (the error the module
adds itself), the float64 truth run (TorchDynamo's accuracy rule) and the control run (the
reference device at the target's precision: how far a correct run at that precision drifts)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.compare.kinks import Kinks
from driftcheck.compare.measure import Measurer
from driftcheck.compare.products import Products
from driftcheck.compare.roundoff import matmul_roundoff
from driftcheck.gate.report import DRIFT, NONFINITE, OK
from driftcheck.numerics import dtypes, floor as fl
from driftcheck.numerics.update import update_error
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

TRUTH_M, TRUTH_M_LOW = 2.0, 3.0  # TorchDynamo's multipliers: fp32 targets, bf16/fp16 targets
# The control run is a correct run at the target's own precision: the target may be this many
# times further from the reference than the control is (plus the op's own rounding).
CONTROL_M = 2.0


def local_floor(fi: fl.FloorInputs) -> fl.Floor:
    """The floor of the error a module adds itself: nothing inherited."""
    return fl.floor(dataclasses.replace(fi, inherited_rms=0.0, inherited_max=0.0))


def own_floor(fi: fl.FloorInputs, meta: dict[str, Any]) -> fl.Floor:
    """The local floor of a replay of a composite's own code (record/own.py): one rounding at
    the coarsest operand it was given (its inputs and its children's answers are rounded to
    their dtypes, whatever dtype its code computes in: a router's float32 logits of a bf16
    stream), or what its ops' rounding measurably moves beyond that (``local_noise``: the same
    replay with every op's result re-rounded stochastically; a sum of large terms that cancel
    moves by its terms' size, not its own)."""
    op_u = meta.get("operand_u") or 0.0
    f = local_floor(dataclasses.replace(fi, u=op_u)) if op_u > fi.u else local_floor(fi)
    noise = [x if isinstance(x, float) and math.isfinite(x) else 0.0
             for x in meta.get("local_noise") or ()]
    if len(noise) != 2:
        return f
    return fl.Floor(rms=max(f.rms, noise[0] - f.rms), max=max(f.max, noise[1] - f.max),
                    local_rms=max(f.local_rms, noise[0] - f.rms), inherited_rms=0.0)


class Opinions:
    """The local replay's and the truth run's judgement of the reference's entries."""

    def __init__(self, measurer: Measurer, kinks: Kinks, local_map: dict[TraceKey, TraceEntry],
                 truth_map: dict[TraceKey, TraceEntry], truth: TraceReader | None,
                 index: DependencyIndex | None = None,
                 tgt_map: dict[TraceKey, TraceEntry] | None = None,
                 control: TraceReader | None = None,
                 control_map: dict[TraceKey, TraceEntry] | None = None,
                 control_local_map: dict[TraceKey, TraceEntry] | None = None,
                 products: Products | None = None) -> None:
        self.measurer, self.kinks = measurer, kinks
        self.tgt_map = tgt_map or {}
        self.control = control
        self.control_map, self.control_local_map = control_map or {}, control_local_map or {}
        self.local_map, self.truth_map, self.truth = local_map, truth_map, truth
        self.index, self.products = index, products
        self._outputs: dict[tuple[int, str, int], int] | None = None  # forward outputs per call

    def _several_outputs(self, r: TraceEntry) -> bool:
        """Whether the call that ``r``'s output gradient belongs to returned several outputs
        (their forward entries in the reference), counted once for the whole trace."""
        if self._outputs is None:
            self._outputs = {}
            for e in self.measurer.ref.entries:
                if e["phase"] == "forward" and str(e["slot"]).startswith("output"):
                    k = (e["step"], e["module"], e["call"])
                    self._outputs[k] = self._outputs.get(k, 0) + 1
        return self._outputs.get((r.step, r.module, r.call), 0) > 1

    def local(self, r: TraceEntry, fi: fl.FloorInputs, limit: float) -> dict[str, Any] | None:
        """The error this module adds itself: the target's replay of it on the reference's
        inputs (``local.*``) against the reference's output, over the local-only floor."""
        le = self.local_map.get(r.align)
        if le is None or list(le.shape) != list(r.shape) or not dtypes.is_float(le.dtype):
            return None
        if r.phase == "optimizer" and r.slot_is("param"):
            return self.update(r, le, limit)
        if "operand_u" in le.meta and r.phase == "backward" and r.slot_is("grad_output") \
                and self.index is not None and any(
                    g.order < r.order for g in self.index.child_gins(Call(r.step, r.module, r.call))):
            # An output the child's own later children consumed too (IntermediateLayerGetter's
            # features feed its next stages): its recorded gradient holds their share, which
            # a replay of the parent's code, the child answered from the trace, does not make.
            return None
        if "operand_u" in le.meta and r.phase == "backward" and r.slot_is("grad_output") \
                and self._several_outputs(r):
            # A child with several outputs may compute one from another (a router's scores
            # from its logits): the recorded gradient of the first already holds that share,
            # which the parent's code, the child answered from the trace, does not make.
            return None
        measured = self.measurer.measure(self.measurer.ref, r, self.measurer.tgt, le)
        m = measured.metrics
        # the parent's own matmuls (attention's q @ k) compute at the target's matmul precision
        # (TF32, a TPU's bf16 passes under --emulate tpu), whatever its operands' dtypes
        mm_u = matmul_roundoff(self.measurer.tgt.run, le.dtype, r.phase, "composite")
        meta = dict(le.meta, operand_u=max(le.meta.get("operand_u") or 0.0, mm_u)) if "operand_u" in le.meta \
            else le.meta
        f = own_floor(fi, meta)
        ratio = f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0))
        flips = None
        if ratio > 1.0 and r.phase == "backward" and r.slot_is("grad_input", "grad_output") \
                and measured.how in ("full", "sample"):
            # The replay rounds the reference's input to the target's dtype: a kink's or a
            # selection's gradient flips where that carried an element across (or into a tie).
            judged = self.kinks.flips(r, le, m, f.max, "tensor" if measured.how == "full"
                                      else "sample", local=True)
            if judged is not m:
                flips = judged["kink_flips"]
                ratio = math.inf if flips["unexplained"] else \
                    f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        control = self._control(r, self.control_local_map.get(r.align), m, f, limit, f) \
            if ratio > limit else None
        if control is not None:
            control["analytic_ratio"] = ratio
            ratio = min(ratio, control["ratio"])  # both must object: the control drifts as far locally
        status = NONFINITE if m.get("nonfinite_new", 0) > 0 else (DRIFT if ratio > limit else OK)
        out = {"ratio": ratio, "status": status, "floor": f.rms, "floor_max": f.max,
               "rms": m.get("rms"), "max_abs": m.get("max_abs"),
               "nonfinite_new": m.get("nonfinite_new", 0), "key": le.key}
        if flips is not None:
            out["kink_flips"] = flips
        if control is not None:
            out["control"] = control
        return out

    def control_run(self, r: TraceEntry, m: dict[str, Any], fi: fl.FloorInputs, analytic: fl.Floor,
                    limit: float) -> dict[str, Any] | None:
        """The control's judgement of the target's entry (its metrics ``m`` against the
        reference): a correct run at the target's precision, the reference device's, drifted
        ``err_c`` from the reference here; the target is as good when err_t <= M * err_c + tol,
        tol the op's own rounding (the local analytic floor: a control that happens to be very
        exact cannot make the bound vanish). On the policy's scale, as the truth run's. Also
        the control's own ratio over the analytic floor: where it is over the limit, the
        model's code at that precision computes something else (the precision, not the target).
        None without a control entry."""
        return self._control(r, self.control_map.get(r.align), m, local_floor(fi), limit, analytic)

    def _control(self, r: TraceEntry, ce: TraceEntry | None, m: dict[str, Any], tol: fl.Floor,
                 limit: float, analytic: fl.Floor | None = None) -> dict[str, Any] | None:
        if self.control is None or ce is None or list(ce.shape) != list(r.shape) \
                or not dtypes.is_float(ce.dtype) or m.get("nonfinite_new", 0):
            return None
        err_c = self.measurer.measure(self.measurer.ref, r, self.control, ce).metrics
        if err_c.get("nonfinite_new", 0):
            return None  # the control itself overflowed here: no word on the target
        c_rms, c_max = err_c.get("rms", 0.0), err_c.get("max_abs", 0.0)
        bound = fl.Floor(CONTROL_M * c_rms + tol.rms, CONTROL_M * c_max + tol.max, local_rms=tol.rms,
                         inherited_rms=CONTROL_M * c_rms)
        out = {"ratio": limit * bound.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)), "m": CONTROL_M,
               "err_control": c_rms, "err_control_max": c_max, "err_target": m.get("rms"),
               "control_key": ce.key}
        if analytic is not None:
            out["control_ratio"] = analytic.ratio(c_rms, c_max)  # the control over the analytic floor
        # only where the control would pass what the analytic floor fails (the check costs the op)
        t_ratio = analytic.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) if analytic is not None else 0.0
        rescues = out["ratio"] <= limit < t_ratio
        kernel = self._control_kernel(r, tol, limit) if rescues else None
        if kernel is not None:
            out.update(kernel=kernel, ratio=math.inf)  # no word on the target: not a correct run here
        return out

    def _control_kernel(self, r: TraceEntry, tol: fl.Floor, limit: float) -> dict[str, Any] | None:
        """Where the control's own kernel is off: a Linear's or convolution's output that the
        control's local replay (on the reference's inputs) puts further from the reference than
        rounding the operands to its dtype explains (compare/products.py, the arithmetic after
        exact), by more than the limit: the control is no correct run at this module (this CPU's
        bf16 conv for few channels and a large kernel, bench/kernel_check.py), and cannot vouch
        for the target. None elsewhere."""
        cl = self.control_local_map.get(r.align)
        if self.products is None or cl is None or self.control is None or list(cl.shape) != list(r.shape):
            return None
        emu = self.products.rounding_error(r, cl.dtype)
        if emu is None:
            return None
        err = self.measurer.measure(self.measurer.ref, r, self.control, cl).metrics
        bound = fl.Floor(CONTROL_M * emu[0] + tol.rms, CONTROL_M * emu[1] + tol.max, local_rms=tol.rms,
                         inherited_rms=CONTROL_M * emu[0])
        ratio = limit * bound.ratio(err.get("rms", 0.0), err.get("max_abs", 0.0))
        if ratio <= limit or err.get("nonfinite_new", 0):
            return None
        return {"ratio": ratio, "emulated_rms": emu[0], "err_control_local": err.get("rms"),
                "control_local_key": cl.key}

    def update(self, r: TraceEntry, le: TraceEntry, limit: float) -> dict[str, Any] | None:
        """The optimizer step's own error (record/update.py): the target's parameter after its
        step against the step redone ideally from the target's own inputs, rounded to the
        parameter's dtype (numerics/update.py). None where the target's parameter before the
        step or after it is not held whole, or where torch's own host kernels at that dtype
        were already outside what the judgement allows (an optimizer it does not model)."""
        tgt = self.measurer.tgt
        t = self.tgt_map.get(r.align)
        before = self.tgt_map.get(TraceKey(r.step, "params", r.module, 0, r.slot))
        noise = self.local_map.get(r.align.with_slot(r.slot.replace("param.", "param_noise.", 1)))
        if t is None or before is None or not (t.has_tensor and before.has_tensor and le.has_tensor) \
                or list(before.shape) != list(r.shape) or not dtypes.is_float(t.dtype):
            return None
        after, ideal, prior = tgt.tensor(t.raw), tgt.tensor(le.raw), tgt.tensor(before.raw)
        if after is None or ideal is None or prior is None:
            return None
        if float(le.meta.get("ratio_at_dtype") or 0.0) > limit:
            return None  # torch's own kernels at the dtype are outside the model: no judgement
        moved = tgt.tensor(noise.raw) if noise is not None and noise.has_tensor else None
        got = update_error(after, ideal, prior, moved, limit,
                           float(le.meta.get("coherent_at_dtype") or 0.0))
        ratio = got["ratio"]
        status = DRIFT if ratio > limit else OK
        return {"ratio": ratio, "status": status, "key": le.key, "floor": None,
                "update": {k: v for k, v in got.items() if k != "ratio"}}

    def truth_run(self, r: TraceEntry, t: TraceEntry, fi: fl.FloorInputs, limit: float) -> dict[str, Any] | None:
        """TorchDynamo's accuracy rule against the float64 truth: the target is as good as the
        reference when err(target, truth) <= M * err(reference, truth) + tol, M = 3 for a
        bf16/fp16 target (2 otherwise), tol = this op's own rounding (the local analytic floor).
        Expressed on the policy's scale, ratio = limit * err_t / (M * err_r + tol), so it is over
        the limit exactly when the rule fails. It only matters for a reference of the target's
        precision (bf16 CPU vs bf16 accelerator): an fp32 reference is far closer to the truth
        than any correct bf16 run, and the analytic floor decides. None without a truth run."""
        te = self.truth_map.get(r.align)
        if self.truth is None or te is None or list(te.shape) != list(r.shape) or not dtypes.is_float(te.dtype):
            return None
        err_t = self.measurer.measure(self.truth, te, self.measurer.tgt, t).metrics
        err_r = self.measurer.measure(self.truth, te, self.measurer.ref, r).metrics
        if err_t.get("nonfinite_new", 0) or err_r.get("nonfinite_new", 0):
            return None
        mult = TRUTH_M_LOW if t.dtype in ("bfloat16", "float16") else TRUTH_M
        tol = local_floor(fi)
        f_rms = mult * err_r.get("rms", 0.0) + tol.rms
        f_max = mult * err_r.get("max_abs", 0.0) + tol.max
        # the truth's floor: as many of them as the target's error is
        floor = fl.Floor(f_rms, f_max, local_rms=tol.rms, inherited_rms=mult * err_r.get("rms", 0.0))
        raw = floor.ratio(err_t.get("rms", 0.0), err_t.get("max_abs", 0.0))
        return {"ratio": limit * raw, "floor": f_rms, "m": mult, "err_target": err_t.get("rms"),
                "err_reference": err_r.get("rms"), "truth_key": te.key}

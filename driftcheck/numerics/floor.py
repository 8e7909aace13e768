"""The noise floor: how far apart two correct runs may be, given their precisions.

For one entry (one tensor) the floor is an rms error and a max error that rounding explains:

    local     = (C_LOCAL * u + C_ACC * sqrt(K) * u_acc) * S
    inherited = KAPPA * eps_in * S
    floor     = local + inherited (+ extra, e.g. the optimizer update term)

- ``u``: unit roundoff of the coarser of the two sides for this tensor (storage dtype, or the
  effective matmul precision: TF32, one-pass bf16 on TPU, fp8 recipe).
- ``u_acc``, ``K``: the accumulation roundoff and reduction length of a dot-product op
  (Linear in_features, Conv in_channels/groups * kernel); the sqrt(K) growth is the
  probabilistic bound of Higham & Mary (SISC 2019) rather than the worst case K*u.
- ``S``: the operand magnitude. For Linear/Conv it is the rms over outputs of
  sqrt(sum_i x_i^2 w_i^2) (|A||B| in the probabilistic form), not |AB|: cancellation near zero
  makes relative error meaningless and is the main source of false alarms of fixed thresholds.
  Elsewhere the reference tensor's own rms (or absmax, for the max floor).
- ``eps_in``: the relative error this entry inherits: the largest relative error among the
  entries it depends on (its module's inputs, its children's outputs, its parameters; see
  compare/index.py). Drift that propagates raises the floor of everything downstream, so a
  later module is never blamed for an earlier one; what a module adds beyond KAPPA times what
  it received is its own.

The ratio of an entry is max(rms_err / floor_rms, max_err / floor_max); the gate fails where
it exceeds the limit. Constants are calibrated in docs/noise-floor.md.
"""
from __future__ import annotations

import dataclasses
import math

# Calibrated on the built-in models and the Hugging Face families, fp32 reference vs bf16 and
# fp16 targets, several seeds (docs/noise-floor.md, bench/calibrate.py).
C_LOCAL = 1.0      # rms of one rounding is u/sqrt(3); inputs, weights and output each rounded
C_LOCAL_MAX = 2.0  # the max error of rounding a value is u * |value|, twice for two roundings
C_ACC = 1.0        # accumulation: sqrt(K) * u_acc
KAPPA = 2.0        # how much relative error an op may amplify what it inherits
REL_CAP = 1.0      # a dependency 100% wrong says nothing more about what follows


@dataclasses.dataclass(frozen=True)
class FloorInputs:
    """What the floor of one entry depends on."""

    u: float
    scale_rms: float
    scale_max: float
    u_acc: float = 0.0
    k: int | None = None
    inherited_rms: float = 0.0
    inherited_max: float = 0.0
    extra_rms: float = 0.0
    extra_max: float = 0.0
    tiny: float = 0.0  # smallest normal of the coarser dtype: an absolute floor near zero


@dataclasses.dataclass(frozen=True)
class Floor:
    """An rms and a max floor, split into the local and the inherited part."""

    rms: float
    max: float
    local_rms: float
    inherited_rms: float

    def ratio(self, rms_err: float, max_err: float) -> float:
        """How many floors the observed error is: max of the rms and the max ratio."""
        return max(_div(rms_err, self.rms), _div(max_err, self.max))


def _div(err: float, floor: float) -> float:
    if err == 0.0 or math.isnan(err):
        return 0.0 if err == 0.0 else math.inf
    if floor <= 0.0:
        return math.inf
    return err / floor


def relative(err: float, scale: float) -> float:
    """err/scale, capped at REL_CAP; 0/0 = 0 (both sides exactly zero)."""
    if err == 0.0:
        return 0.0
    if not math.isfinite(err) or scale <= 0.0 or not math.isfinite(scale):
        return REL_CAP
    return min(err / scale, REL_CAP)


def floor(fi: FloorInputs) -> Floor:
    """The floor of one entry (pure arithmetic; see the module docstring)."""
    growth = C_ACC * math.sqrt(fi.k) * fi.u_acc if fi.k else 0.0
    local_rms = (C_LOCAL * fi.u + growth) * fi.scale_rms + fi.tiny
    local_max = (C_LOCAL_MAX * fi.u + growth) * fi.scale_max + fi.tiny
    inh_rms = KAPPA * fi.inherited_rms * fi.scale_rms
    inh_max = KAPPA * fi.inherited_max * fi.scale_max
    return Floor(rms=local_rms + inh_rms + fi.extra_rms,
                 max=local_max + inh_max + fi.extra_max,
                 local_rms=local_rms, inherited_rms=inh_rms)

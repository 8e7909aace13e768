"""How far a parameter after the optimizer step is from the ideal step of the same inputs
(record/update.py), in units of what rounding explains. Pure numerics on host tensors.

``after`` is the target's parameter after its step, in the parameter's dtype T; ``ideal`` the
same step computed at float32 or wider from the target's own parameter, gradient and state;
``before`` the parameter before the step. A correct step at T is ``ideal`` rounded to T, up to
the few roundings its own arithmetic at T makes (a bf16 AdamW's moments, square root, quotient).
Two questions:

- **Incoherent**: is any element further than that? Each element's error e = after -
  round_T(ideal) over one spacing of T there (before or after the step, the coarser) plus
  ``K_ARITH`` roundings of its update d = ideal - before and of the step's inputs (``moved``:
  where the terms of the update cancel, a momentum buffer against a gradient, their rounding
  is larger than the update's). A sign flipped, an update skipped or doubled: many of those.
- **Coherent**: is the update as a whole scaled? A kernel a few percent off moves every element
  by a share of its own update, mostly less than one spacing, so that most rounded results do
  not change; the ones that do (an element whose update spans many spacings: near-zero
  weights, a zero-initialised bias) all move in the direction of their update. The share is
  the weighted least-squares coefficient c = sum(w e d) / sum(w d^2), each element weighted by
  how finely it resolves a share of its update (w = 1 / (q^2 + a^2), q its spacing,
  a = K_ARITH (u |d| + moved) its arithmetic's error). Rounding explains |c| up to:
  ``K_HOST`` times what torch's own host kernels at T show on the same inputs (its CPU SGD at
  bf16 rounds the learning rate to bf16: 0.1 becomes 0.10010, a coherent 0.1%; a decoupled
  weight decay rounds the parameter between two roundings: norm weights all at 1.0 then flip
  together, on the side their update's binade decides); plus ``C_COHERENT`` rounding at T of
  a scalar that scales the whole update, which another correct kernel may round where torch's
  does not (a step size kept at bf16: up to 0.39%); plus ``Z`` standard errors of c.
  That is a bound, not a noise scale: ``coherent_ratio`` is on the policy's scale,
  limit * |c| / bound, over the limit exactly where |c| is beyond it (as the truth run's is).

``ratio`` is the larger of the two.
"""
from __future__ import annotations

import math
from typing import Any

import torch

K_ARITH = 2.0  # roundings at T in a correct step's own arithmetic, relative to its update
C_COHERENT = 1.0  # roundings at T of a scalar that scales a correct update, beyond the host's
K_HOST = 2.0  # times the coherent share torch's host kernels at T show on the same inputs
Z = 5.0  # standard errors of the coherent share that noise explains
PSEUDO_MOVES = 3.0  # moves against the update assumed beyond those seen (a Poisson count's margin)


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between adjacent values of ``dtype`` at each |x| (float64; the smallest
    normal's where |x| is below it)."""
    fi = torch.finfo(dtype)
    a = x.abs().clamp_min(fi.tiny)
    _, ex = torch.frexp(a)
    return torch.ldexp(torch.full_like(a, fi.eps / 2), ex)


def update_error(after: torch.Tensor, ideal: torch.Tensor, before: torch.Tensor,
                 moved: torch.Tensor | None = None, limit: float = 3.5,
                 coherent_at_dtype: float = 0.0) -> dict[str, Any]:
    """The step's own error of one parameter (see the module): ``ratio`` and its parts.
    ``moved``: how far the ideal moves when each input of the step is rounded once at T
    (record/update.py), the scale of a correct step's own arithmetic where its terms cancel.
    ``coherent_at_dtype``: the coherent share of torch's host kernels at T on the same inputs
    (record/update.py), ``K_HOST`` times of which a correct implementation may show too."""
    dtype = after.dtype
    u = torch.finfo(dtype).eps / 2
    a = after.detach().reshape(-1).to(torch.float64)
    i = ideal.detach().reshape(-1).to(torch.float64)
    b = before.detach().reshape(-1).to(torch.float64)
    rounded = ideal.detach().reshape(-1).to(dtype).to(torch.float64)
    e, d = a - rounded, i - b
    m = moved.detach().reshape(-1).to(torch.float64) if moved is not None else torch.zeros_like(d)
    finite = torch.isfinite(e) & torch.isfinite(d) & torch.isfinite(m)
    if not bool(finite.all()):
        e, d, m, rounded, b = e[finite], d[finite], m[finite], rounded[finite], b[finite]
    # the coarser of the spacings before and after: a correct step may round the parameter
    # between two roundings (a decoupled weight decay) in its own binade
    q = torch.maximum(spacing(rounded, dtype), spacing(b, dtype))
    arith = K_ARITH * (u * d.abs() + m)
    n = e.abs() / (q + arith)
    incoherent = float(n.max()) if n.numel() else 0.0
    # weighted by how finely an element resolves a share of its update (a coarse element's
    # rounding keeps a small share of it or none: not an average of it)
    w = 1.0 / (q * q + arith * arith)
    wdd = float((w * d * d).sum())
    out: dict[str, Any] = {"incoherent": incoherent, "elements": int(e.numel()),
                           "changed": int((e != 0).sum()), "nonfinite": int((~finite).sum())}
    if wdd > 0.0:
        c = float((w * e * d).sum()) / wdd
        # the noise of c: a correct step's element moves by a spacing where its arithmetic
        # (one rounding of its update, or of its terms where larger) carries it across a boundary,
        # probability ~ a1 / q, either way; and as the elements show it, from the moves against
        # their update only, twice (a defect's moves go with the update: they are the signal,
        # not the noise), with PSEUDO_MOVES more of the typical size where few are seen
        a1 = torch.maximum(u * d.abs(), m)
        flip = a1 * q + a1 * a1
        se_model = math.sqrt(float((w * w * flip * d * d).sum())) / wdd
        wed2 = w * w * e * e * d * d
        against, moving = (e * d) < 0, e != 0
        typical = float(wed2[moving].mean()) if bool(moving.any()) else 0.0
        se_seen = math.sqrt(2.0 * (float(wed2[against].sum()) + PSEUDO_MOVES * typical)) / wdd
        bound = C_COHERENT * u + K_HOST * abs(coherent_at_dtype) + Z * max(se_model, se_seen)
        # a bound, not a noise scale: on the policy's scale, over the limit exactly beyond it
        out.update(coherent=c, coherent_bound=bound, coherent_ratio=limit * abs(c) / bound)
    out["ratio"] = max(incoherent, out.get("coherent_ratio", 0.0))
    return out

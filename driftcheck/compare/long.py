"""Long compare: does the target diverge from the reference faster than correct runs diverge
from each other?

Two correct runs of one training drift apart too (training is chaotic), so a distance means
nothing alone. The control (a third run: the target's precision on the reference device, its
weights one ulp off, driftcheck/record/long.py ``perturb``) measures how fast correct runs
separate. At each sampled step s the distance of a run from the reference is the relative
distance of the parameter sample, ``|theta_run(s) - theta_ref(s)| / |theta_ref(s)|``. The band
at s is ``BAND x`` the largest control distance up to s (distances grow; a running maximum
keeps the band from dipping where the control's happens to). The target is out of the band at s
when its distance exceeds it. The same is done per module with the relative change of its
forward output rms (where a defect enters, its module's statistic moves at once; correct runs
move theirs slowly), and every band is at least the runs' unit roundoff. The first bad step is
the first sampled step from which the target stays out to the end. A target that leaves the
band and comes back passes, with a warning: chaotic runs cross. Without a control the band
cannot be drawn: the verdict says so.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.store.long import LongReader

BAND = 4.0  # the band: this many times the control's distance


@dataclasses.dataclass
class LongReport:
    """The verdict on a long target (its truth value: passed)."""

    verdict: str  # "pass" | "fail" | "no control"
    steps: int
    band: float
    first_bad_step: int | None
    first_bad_module: str | None  # the module whose output left the band first (None: the parameters)
    worst_ratio: float  # max over sampled steps of target distance / control envelope
    sample_steps: list[int]
    target_distance: list[float]
    control_distance: list[float] | None
    envelope: list[float] | None
    loss: dict[str, list[float]]  # "reference", "target", "control": the per-step loss
    left_and_came_back: list[int]  # sampled steps out of the band the target later left
    reference: dict[str, Any]
    target: dict[str, Any]
    control: dict[str, Any] | None
    sentence: str = ""

    def __bool__(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "driftcheck.long_report/1", **dataclasses.asdict(self)}


def compare_long(ref: str | LongReader, target: str | LongReader,
                 control: str | LongReader | None = None, *, band: float = BAND) -> LongReport:
    """Judge a long target (and its control) against a long reference."""
    r = ref if isinstance(ref, LongReader) else LongReader(ref)
    t = target if isinstance(target, LongReader) else LongReader(target)
    c = control if control is None or isinstance(control, LongReader) else LongReader(control)
    for other, what in ((t, "target"), (c, "control")):
        if other is None:
            continue
        if other.run.get("replay_id") != r.run.get("replay_id"):
            raise DriftcheckError(f"the {what} {other.dir} did not replay the reference {r.dir} "
                                  "(different replay_id): record it with --replay REF")
        if other.steps != r.steps or other.run.get("every") != r.run.get("every"):
            raise DriftcheckError(f"the {what} {other.dir} has {other.steps} steps sampled every "
                                  f"{other.run.get('every')}, the reference {r.steps} every "
                                  f"{r.run.get('every')}: record both with the same --steps and --every")
    steps_s = [int(s) for s in r.columns["sample_steps"].tolist()]
    d_t = distance(r.columns["param_sample"], t.columns["param_sample"])
    loss = {"reference": r.columns["loss"].tolist(), "target": t.columns["loss"].tolist()}
    base: dict[str, Any] = dict(steps=r.steps, band=band, sample_steps=steps_s, target_distance=d_t.tolist(),
                                loss=loss, reference=r.run, target=t.run, control=c.run if c else None)
    if c is None:
        return LongReport(verdict="no control", first_bad_step=None, first_bad_module=None,
                          worst_ratio=float("nan"),
                          control_distance=None, envelope=None, left_and_came_back=[],
                          sentence="no control run: the distance cannot be judged against how far "
                          "correct runs drift apart; record one (driftcheck run --long does)", **base)
    loss["control"] = c.columns["loss"].tolist()
    u = max(_unit(t.run), _unit(c.run))
    d_c = distance(r.columns["param_sample"], c.columns["param_sample"])
    env = torch.cummax(d_c, 0).values.clamp_min(u)
    first, worst, crossed = judge_band(d_t, env, band)
    found: list[tuple[int, str | None, str]] = [(first, None, "its parameters")] if first is not None else []
    if all("buffer_sample" in x.columns for x in (r, t, c)):
        # floating buffers (BatchNorm running statistics) apart: few, they drown among the weights
        b_env = torch.cummax(distance(r.columns["buffer_sample"], c.columns["buffer_sample"]), 0).values
        f, w, x = judge_band(distance(r.columns["buffer_sample"], t.columns["buffer_sample"]),
                             b_env.clamp_min(u), band)
        worst, crossed = max(worst, w), crossed + x
        if f is not None:
            found.append((f, None, "its buffers (BatchNorm running statistics)"))
    # Each module's forward output rms against the control's change of it: where a defect
    # enters, its module's statistic moves at once; correct runs move theirs slowly.
    m_t = module_distance(r.columns["module_rms"], t.columns["module_rms"])
    m_c = torch.cummax(module_distance(r.columns["module_rms"], c.columns["module_rms"]), 0).values.clamp_min(u)
    names = list(r.run.get("modules") or [])
    for j in range(m_t.shape[1]):
        f, w, x = judge_band(m_t[:, j], m_c[:, j], band)
        worst, crossed = max(worst, w), crossed + x
        if f is not None:
            name = names[j] if j < len(names) else str(j)
            found.append((f, name, f"{name or '(model)'}'s output"))
    # the earliest; among modules at the same step, the first in execution order (names order)
    first, module, where = min(found, key=lambda x: x[0]) if found else (None, None, "")
    verdict = "fail" if first is not None else "pass"
    at = steps_s[first] if first is not None else None
    if at is None:
        sentence = (f"the target stays within {band:g}x of how far correct runs drift apart over "
                    f"{r.steps} steps (worst {worst:.3g}x the control)")
    else:
        sentence = (f"the target leaves the band at step {at} and stays out ({where}): from there "
                    f"it diverges faster than correct runs do ({worst:.3g}x the control at worst), "
                    "a defect on the target")
    return LongReport(verdict=verdict, first_bad_step=at, first_bad_module=module, worst_ratio=worst,
                      control_distance=d_c.tolist(), envelope=env.tolist(),
                      left_and_came_back=sorted({steps_s[i] for i in crossed}), sentence=sentence, **base)


def module_distance(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per sampled step and module: |rms_other - rms_ref| / rms_ref (0 where a module did not
    run, or gave no floating output)."""
    d = (other - ref).abs() / ref.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(torch.isnan(ref) & torch.isnan(other), torch.zeros_like(d),
                       torch.nan_to_num(d, nan=float("inf"), posinf=float("inf")))


def _unit(run: dict[str, Any]) -> float:
    """The coarser unit roundoff of a run's dtype and autocast dtype."""
    from driftcheck.numerics import dtypes

    return max(dtypes.unit_roundoff(str(run.get("dtype") or "float32")),
               dtypes.unit_roundoff(str(run.get("autocast") or "float32")))


def distance(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per sampled step: |other - ref| / |ref| of the parameter samples ([n, S] each)."""
    if ref.shape != other.shape:
        raise DriftcheckError(f"the parameter samples differ in shape ({list(ref.shape)} vs "
                              f"{list(other.shape)}): the runs trained different models")
    d = torch.linalg.vector_norm(other - ref, dim=1)
    n = torch.linalg.vector_norm(ref, dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(torch.isfinite(d), d / n, torch.full_like(d, float("inf")))


def judge_band(d_t: torch.Tensor, env: torch.Tensor, band: float) -> tuple[int | None, float, list[int]]:
    """(index of the first sample from which d_t > band * env to the end, or None; the worst
    d_t / env; indices out of the band that the target left again)."""
    ratio = d_t / env.clamp_min(torch.finfo(torch.float64).tiny)
    ratio = torch.where(env > 0, ratio, torch.where(d_t > 0, torch.full_like(d_t, float("inf")),
                                                     torch.zeros_like(d_t)))
    out = (ratio > band).tolist()
    first = None
    for i in range(len(out) - 1, -1, -1):
        if not out[i]:
            break
        first = i
    crossed = [i for i, o in enumerate(out) if o and (first is None or i < first)]
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return first, worst, crossed

"""Kinks: gradients through ReLU-like ops switch on or off where the forward input crossed the
kink within its own rounding. In full mode the flips are counted
and judged by count; in stats mode their share of a gradient is estimated and passed on.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.compare.entries import TraceEntry, forward_slot
from driftcheck.compare.index import Call, DependencyIndex
from driftcheck.compare.propagation import Ledger
from driftcheck.numerics import dtypes, metrics as mx
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

KINK_ZEROS = 0.1  # a ReLU-like gradient: this many zeros, as many as non-positive inputs (+-)
KINK_NEAR = 16  # smallest sample magnitudes the density of a tensor near zero is taken from


def crossing(xr: torch.Tensor, xt: torch.Tensor, kinks: list[float] | tuple[float, ...] = (0.0,)
             ) -> torch.Tensor:
    """Where a kink's input may have crossed it between two runs: its side of the kink differs,
    or it is within twice its own error of the kink (a ReLU's at 0, a hard-swish's at +-3)."""
    xr64, xt64 = xr.double(), xt.double()
    near = 2 * (xt64 - xr64).abs()
    out = torch.zeros(xr64.shape, dtype=torch.bool, device=xr64.device)
    for c in kinks:
        dr, dt = xr64 - c, xt64 - c
        out |= (dr.abs() <= near) | (torch.sign(dr) != torch.sign(dt))
    return out


def density_near_zero(x: torch.Tensor, err: float) -> float:
    """The fraction of a sample within 2 ``err`` of zero, estimated from its KINK_NEAR smallest
    magnitudes (the density taken as flat below them, as for any smooth distribution)."""
    a = x.double().abs().reshape(-1)
    n = a.numel()
    near = float(a.kthvalue(KINK_NEAR).values)
    return KINK_NEAR / n * min(1.0, 2.0 * err / near) if near > 0 else KINK_NEAR / n


SELECTION_SHARE = 0.01  # a selecting op's gradient: at most this share of elements may move




class Kinks:
    """Kink flips of the reference's gradient entries against the target's: counted on the
    tensors or samples (:meth:`flips`), or estimated where a sample holds none (:meth:`estimate`)."""

    def __init__(self, index: DependencyIndex, ref: TraceReader, tgt: TraceReader,
                 tgt_map: dict[TraceKey, TraceEntry], ledger: Ledger) -> None:
        self.index, self.ref, self.tgt, self.tgt_map, self.ledger = index, ref, tgt, tgt_map, ledger

    def forward_of(self, r: TraceEntry) -> tuple[TraceEntry | None, TraceEntry | None]:
        """The forward tensor a gradient entry is the gradient of (grad_input.0 -> input.0,
        grad_output[.p] -> output[.p]), in the reference and in the target."""
        a = TraceKey(r.step, "forward", r.module, r.call, forward_slot(r.slot))
        return self.index.by_align.get(a), self.tgt_map.get(a)

    def decided_on_host(self, r: TraceEntry) -> bool:
        """Whether the code that consumed output ``r`` (its parent's, or its own: a model
        computing its loss) took float values to the host (record/watch.py: _TO_HOST)."""
        outs = self.index.consumer_outputs(r)
        if not r.module:  # the model's outputs: the loss code's too (the loss entry's meta)
            outs += list(self.index.loss.get(r.step, ()))
        return any(e.meta.get("host_decisions") for e in outs)

    def flips(self, r: TraceEntry, t: TraceEntry, m: dict[str, Any], floor_max: float,
              which: str = "tensor", local: bool = False) -> dict[str, Any]:
        """Gradients through ReLU-like kinks (relu, max-pool, clamp) switch on or off where the
        forward input crossed the kink within its own error: such positions are one side exactly
        zero, the other not; through a kink that changes the slope (LeakyReLU), they differ by
        more than the floor where the forward input crossed. Judge the other positions with the
        floor, and these by count: there may be no more of them than forward inputs that came
        that close to zero.

        ``which="sample"``: the same on the stats-mode samples (the same positions on both
        runs). The forward input's sample holds other positions (samples are drawn per key)
        unless both cover their whole tensor, so the count is otherwise judged without it.

        The kinks are the module's (its forward entry's ``kinks``; 0 by default). An op that
        selects (max pooling) moves a gradient to another element of a window where two tied
        within rounding: such elements may differ by any amount, up to SELECTION_SHARE of them.
        ``local``: ``t`` is the target's local replay, whose forward input is the reference's
        rounded to the target's dtype.

        Returns ``m`` itself where nothing flipped, else the metrics of the other positions with
        ``kink_flips`` (count, allowed, forward_crossings, unexplained)."""
        rt, tt = self.ref.tensor(r.raw, which), self.tgt.tensor(t.raw, which)
        if rt is None or tt is None or rt.shape != tt.shape:
            return m
        xr_e, xt_e = self.forward_of(r)
        fmeta = xr_e.meta if xr_e is not None else {}
        out_e = next(iter(self.index.fwd_out.get(Call(r.step, r.module, r.call), [])), None)
        ometa = out_e.meta if out_e is not None else {}
        # The module's own kinks shape its input gradient; its output gradient went through
        # whatever the code around it applied (F.relu: a kink at 0).
        own = r.slot_is("grad_input")
        kinks = (ometa.get("kinks") or fmeta.get("kinks") if own else None) or (0.0,)
        selection = own and bool(ometa.get("selection") or fmeta.get("selection"))
        cross = None
        whole = which == "tensor" or r.stats.get("numel") == rt.numel() == (
            xr_e.stats.get("numel") if xr_e is not None else None)  # a sample that is the whole tensor
        if xr_e is not None and (xt_e is not None or local) and whole and not selection:
            cross = self._crossing(xr_e, xt_e, t, rt, which, local, kinks)
        profiled = which == "sample" and own and bool(ometa.get("kinks") or fmeta.get("kinks"))
        flip = _flipped(rt, tt, floor_max, selection, cross, profiled)
        n = int(flip.sum())
        if n == 0:
            return m
        keep = ~flip
        out: dict[str, Any] = dict(mx.tensor_error(rt[keep], tt[keep], ref_dtype=r.dtype, tgt_dtype=t.dtype)
                                   if int(keep.sum()) else {"rms": 0.0, "max_abs": 0.0})
        crossings = int(cross.sum()) if cross is not None else None
        allowed = self._allowed(r, rt, which, own, selection, crossings, xr_e)
        out["kink_flips"] = {"count": n, "allowed": allowed, "forward_crossings": crossings,
                             "unexplained": n > allowed}
        return out

    def _crossing(self, xr_e: TraceEntry, xt_e: TraceEntry | None, t: TraceEntry, rt: torch.Tensor,
                  which: str, local: bool, kinks: list[float] | tuple[float, ...]) -> torch.Tensor | None:
        """Where the forward input crossed a kink (:func:`crossing`), None without both sides'."""
        xr = self.ref.tensor(xr_e.raw, which)
        xt: torch.Tensor | None
        if local and xr is not None:
            xt = xr.to(dtypes.torch_dtype(t.dtype)) if dtypes.is_float(t.dtype) else xr
        else:
            xt = self.tgt.tensor(xt_e.raw, which) if xt_e is not None else None
        if xr is not None and xt is not None and xr.shape == rt.shape == xt.shape:
            return crossing(xr, xt, kinks)
        return None

    def _allowed(self, r: TraceEntry, rt: torch.Tensor, which: str, own: bool, selection: bool,
                 crossings: int | None, xr_e: TraceEntry | None) -> int:
        """How many flips the forward input's crossings (or its kink profile) explain."""
        # Without the forward input, allow what rounding near zero typically produces, or (a
        # stats-mode sample) what the input's kink profile says came that close.
        share = max(4, int(SELECTION_SHARE * rt.numel()))
        if not own and self.decided_on_host(r):
            # The code that consumed the output took values to the host and selected there
            # (a DETR loss's Hungarian matching): on near ties another element may be picked,
            # which moves whole gradients (hf_yolos under autocast: a box matched to query 1,
            # not 2). Those positions are counted, not judged; the others are.
            share = rt.numel()
        if crossings is not None:
            allowed = 2 * crossings + 4
            if not own:
                # A kink applied to a sum the module's output is part of (a residual add, then
                # ReLU): the output's own crossings undercount it.
                allowed = max(allowed, share)
        elif selection and which == "tensor" and (near := self.near_kink(r)) is not None \
                and xr_e is not None:
            # A max pool in full mode: the windows whose top two came within twice the input's
            # error of each other (its tie profile) may each move their gradient to another
            # element, two elements per window. Under bf16 exact ties are common: many windows.
            prof = xr_e.meta["kink_profile"]
            allowed = max(share, 2 * (2 * math.ceil(near * prof[0]) + 4))
        else:
            allowed = share
            near = self.near_kink(r) if which == "sample" else None
            if near is None and which == "sample" and xr_e is not None:
                near = self.near_zero_in_sample(xr_e)
            if near is not None:
                allowed = max(allowed, 2 * math.ceil(near * rt.numel()) + 4)
        return allowed

    def near_zero_in_sample(self, x: TraceEntry) -> float | None:
        """The fraction of a forward tensor's stats-mode sample within four times its rms error
        of zero (a kink at 0 the code around a module applied, which has no profile)."""
        err = self.ledger.errors.get(x.align)
        xs = self.ref.tensor(x.raw, "sample")
        if err is None or not err.rms or xs is None or not xs.numel():
            return None
        return float((xs.double().abs() <= 4.0 * err.rms).double().mean())

    def near_kink(self, r: TraceEntry) -> float | None:
        """The fraction of the forward input (of gradient entry ``r``) within twice its error of
        a kink, from its ``kink_profile``; None without one."""
        x, _ = self.forward_of(r)
        err = self.ledger.errors.get(x.align) if x is not None else None
        prof = x.meta.get("kink_profile") if x is not None else None
        absmax = x.stats.get("absmax") if x is not None else None
        if err is None or not err.rms or not prof or not prof[0] or not absmax:
            return None
        k = math.floor(math.log2(absmax / (2.0 * err.rms))) if absmax > 2.0 * err.rms else 0
        share: float = prof[min(max(k, 0), len(prof) - 1)] / prof[0]
        return share

    def estimate(self, r: TraceEntry, seen: dict[str, Any] | None = None) -> float | None:
        """The relative rms error of a gradient from kink flips (stats mode). Flips are few and
        full-size (the gradient on one side, zero on the other): a 512-element sample of a large
        tensor rarely holds one, yet every gradient that sums over them (the previous layer's,
        the weights') carries them. Elements within twice their rms error e of zero may cross
        it; as a fraction p of the tensor, their share of the gradient's rms is ~sqrt(p).

        p comes from the forward tensor's ``kink_profile`` (an nn.ReLU's input: every element).
        Where a kink is applied by code around the module (F.relu, x.relu()), there is no
        profile; the gradient's sample shows the kink (flips, or as many exact zeros as the
        input has non-positive values), and p comes from the forward tensor's sample: the
        crossings seen, or the density of |x| near zero (from the KINK_NEAR smallest
        magnitudes, taken as flat below them, as for any smooth distribution) times 4e."""
        x, xt_e = self.forward_of(r)
        err = self.ledger.errors.get(x.align) if x is not None else None
        if x is None or err is None or not err.rms:
            return None
        p = self.near_kink(r)
        if p is not None:
            # A max pool's profile counts windows whose top two are that close: a flip moves
            # a window's gradient to another element (twice its energy in error).
            outs = self.index.fwd_out.get(Call(r.step, r.module, r.call), [])
            return math.sqrt(2 * p if outs and outs[0].meta.get("selection") else p)
        xr = self.ref.tensor(x.raw, "sample")
        xt = self.tgt.tensor(xt_e.raw, "sample") if xt_e is not None else None
        if xr is None or xt is None or xr.shape != xt.shape or xr.numel() < 2 * KINK_NEAR:
            return None
        xr64 = xr.double().reshape(-1)
        n = xr64.numel()
        if not (seen and seen.get("count")) and not self._zeros_follow_sign(r, xr64):
            return None
        close = crossing(xr, xt)
        dens = density_near_zero(xr64, err.rms)
        return math.sqrt(max(int(close.sum()) / n, dens, (seen or {}).get("count", 0) / n))

    def _zeros_follow_sign(self, r: TraceEntry, xr64: torch.Tensor) -> bool:
        # A ReLU's gradient is exactly zero where its input is <= 0: as many zeros in the
        # gradient's sample as non-positive inputs in the input's (the two samples hold other
        # positions, their fractions agree). Zeros for other reasons (ignored labels, masked
        # attention) do not follow the input's sign.
        g = self.ref.tensor(r.raw, "sample")
        zeros = float((g == 0).double().mean()) if g is not None and g.numel() else 0.0
        return not (zeros < KINK_ZEROS or abs(zeros - float((xr64 <= 0).double().mean())) > KINK_ZEROS)


def _flipped(rt: torch.Tensor, tt: torch.Tensor, floor_max: float, selection: bool,
             cross: torch.Tensor | None, profiled: bool) -> torch.Tensor:
    """Positions whose gradient flipped: one side exactly zero and the other over the floor,
    any position over it through a selection, or at an input that crossed the kink."""
    diff = (rt.double() - tt.double()).abs()
    big = torch.maximum(rt.double().abs(), tt.double().abs()) > floor_max
    flip = ((rt == 0) ^ (tt == 0)) & big
    if selection:
        flip |= diff > floor_max
    if cross is not None:
        # A kink that only changes the slope (LeakyReLU, a clamp's other side): the
        # gradient differs by more than the floor, at an input that crossed the kink.
        flip |= cross & (diff > floor_max)
    elif profiled:
        # ... which a sample cannot tell without its input's positions (hard-swish's +3:
        # slope 1.5 on one side, 1 on the other): counted, against the kink profile
        flip |= diff > floor_max
    return flip

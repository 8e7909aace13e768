"""compare(): align two traces, measure each tensor pair against its noise floor, give a verdict.

Entries align by their semantic key (step, phase, module, call, slot). Tensors are read one pair
at a time through memory-mapped shards, so memory is bounded by the largest pair. Each entry's
floor inherits the relative error of the entries it depends on (``dependencies``), so the first
entry over the limit, in execution order, is where drift *enters*.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import torch

from driftcheck import floor as fl
from driftcheck import format as fmt
from driftcheck import metrics as mx
from driftcheck.errors import DriftcheckError
from driftcheck.policy import Policy
from driftcheck.report import (DRIFT, IGNORED, INFO, MISALIGNED, NONFINITE, OK, Entry, Finding,
                               Report)
from driftcheck.store import TraceReader

MATMUL_KINDS = ("linear", "conv", "composite")
C_UPDATE = 0.5  # optimizer: share of the reference's own update that rounding may flip


def _order_key(e: dict[str, Any]) -> tuple[int, int, int]:
    return (e["step"], fmt.PHASE_RANK[e["phase"]], e["order"])


def _align(e: dict[str, Any]) -> tuple:
    return fmt.entry_key(e).align


class _Index:
    """Structural lookups on the reference's entries (who depends on whom)."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.fwd_in: dict[tuple, list] = defaultdict(list)
        self.fwd_out: dict[tuple, list] = defaultdict(list)
        self.gout: dict[tuple, list] = defaultdict(list)
        self.gin: dict[tuple, list] = defaultdict(list)
        self.children: dict[tuple, list] = defaultdict(list)
        self.params: dict[tuple, list] = defaultdict(list)
        self.calls: dict[tuple, set] = defaultdict(set)
        self.by_align: dict[tuple, dict] = {}
        self.loss: dict[int, list] = defaultdict(list)
        self.top_outputs: dict[int, list] = defaultdict(list)
        for e in entries:
            a = _align(e)
            self.by_align[a] = e
            s, ph, m, c, slot = a
            meta = e.get("meta") or {}
            if ph == "forward":
                (self.fwd_in if slot.startswith("input") else self.fwd_out)[(s, m, c)].append(e)
                self.calls[(s, m)].add(c)
                parent = meta.get("parent")
                if parent is not None and slot.startswith("output"):
                    p_mod, _, p_call = parent.rpartition("#")
                    key = (s, p_mod, int(p_call))
                    if (m, c) not in self.children[key]:
                        self.children[key].append((m, c))
                if parent is None and slot.startswith("output"):
                    self.top_outputs[s].append(e)
            elif ph == "backward":
                (self.gout if slot.startswith("grad_output") else self.gin)[(s, m, c)].append(e)
            elif ph == "params":
                self.params[(s, m)].append(e)
            elif ph == "loss":
                self.loss[s].append(e)

    def parent_of(self, e: dict[str, Any]) -> tuple | None:
        parent = (e.get("meta") or {}).get("parent")
        if parent is None:
            return None
        p_mod, _, p_call = parent.rpartition("#")
        return (e["step"], p_mod, int(p_call))

    def child_outputs(self, call: tuple) -> list:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.fwd_out.get((s, m, c), [])]

    def child_gins(self, call: tuple) -> list:
        s = call[0]
        return [o for m, c in self.children.get(call, []) for o in self.gin.get((s, m, c), [])]

    def dependencies(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        """The entries whose error ``e`` inherits (see floor.py)."""
        s, ph, m, c, slot = _align(e)
        call = (s, m, c)
        deps: list[dict[str, Any]] = []
        if ph == "params":
            if s > 0:
                prev = self.by_align.get((s - 1, "optimizer", m, 0, slot))
                deps += [prev] if prev else []
        elif ph == "forward" and slot.startswith("input"):
            parent = self.parent_of(e)
            if parent is not None:
                deps += self.fwd_in.get(parent, [])
                deps += [o for o in self.child_outputs(parent) if o["order"] < e["order"]]
        elif ph == "forward":
            deps += self.fwd_in.get(call, []) + self.child_outputs(call) + self.params.get((s, m), [])
        elif ph == "loss":
            deps += self.top_outputs.get(s, [])
        elif ph == "backward" and slot.startswith("grad_output"):
            # The gradient of C's output was made by code in some ancestor's scope: inherit from
            # every ancestor's incoming gradient and the gradients its children produced so far.
            anc = self.parent_of(e)
            if anc is None:
                deps += self.loss.get(s, [])
            while anc is not None:
                deps += [g for g in self.gout.get(anc, []) if g["order"] < e["order"]]
                deps += [g for g in self.child_gins(anc) if g["order"] < e["order"]]
                deps += self.fwd_in.get(anc, []) + self.child_outputs(anc)
                outs = self.fwd_out.get(anc, [])
                anc = self.parent_of(outs[0]) if outs else None
                if anc is None:
                    deps += self.loss.get(s, [])
            deps += self.fwd_out.get(call, [])
        elif ph == "backward":
            deps += self.gout.get(call, []) + self.child_gins(call)
            deps += self.fwd_in.get(call, []) + self.fwd_out.get(call, []) + self.child_outputs(call)
            deps += self.params.get((s, m), [])
        elif ph == "grads":
            for cc in self.calls.get((s, m), ()):
                k = (s, m, cc)
                deps += self.gout.get(k, []) + self.fwd_in.get(k, []) + self.fwd_out.get(k, [])
                deps += self.child_gins(k)
            deps += self.params.get((s, m), [])
        elif ph == "optimizer":
            leaf = slot.split(".", 2)[1] if slot.count(".") >= 1 else slot
            deps += [d for d in (self.by_align.get((s, "params", m, 0, f"param.{leaf}")),
                                 self.by_align.get((s, "params", m, 0, f"buffer.{leaf}")),
                                 self.by_align.get((s, "grads", m, 0, f"param.{leaf}")),
                                 self.by_align.get((s - 1, "optimizer", m, 0, slot))) if d]
            if slot.startswith("buffer."):
                for cc in self.calls.get((s, m), ()):
                    deps += self.fwd_in.get((s, m, cc), [])
        return [d for d in deps if d is not e]


def _rms_of(stats: dict[str, Any]) -> float:
    n = stats.get("numel") or 0
    l2 = stats.get("l2")
    if not n or l2 is None or not math.isfinite(l2):
        return 0.0
    return l2 / math.sqrt(n)


def _is_float(dtype: str) -> bool:
    return dtype in fmt.FLOAT_DTYPES or dtype.startswith("complex")


class Comparison:
    """One comparison of a target trace against a reference (optionally a float64 truth)."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, *, policy: Policy | None = None,
                 limit: float | None = None, truth: TraceReader | None = None,
                 chunk_elems: int = 1 << 20) -> None:
        self.ref, self.tgt, self.truth = ref, tgt, truth
        self.policy = policy or Policy.default()
        self.limit_override = limit
        self.chunk_elems = chunk_elems
        self.findings: list[Finding] = []
        self.warnings: list[str] = []
        self.rel: dict[tuple, tuple[float, float]] = {}  # align key -> (rel rms, rel max)

    # -- alignment -----------------------------------------------------------------------------
    def _check_runs(self) -> None:
        rs, ts = self.ref.run.get("steps"), self.tgt.run.get("steps")
        if rs != ts:
            raise DriftcheckError(
                f"the reference has {rs} step(s) and the target {ts}: record both with the same "
                "--steps (the target with --replay REF)")
        ref_keys = {_align(e) for e in self.ref.entries}
        tgt_keys = {_align(e) for e in self.tgt.entries}
        if ref_keys and len(ref_keys & tgt_keys) < 0.5 * len(ref_keys):
            ref_mods = {k[2] for k in ref_keys} - {k[2] for k in tgt_keys}
            tgt_mods = {k[2] for k in tgt_keys} - {k[2] for k in ref_keys}
            raise DriftcheckError(
                f"the traces do not describe the same model: only {len(ref_keys & tgt_keys)} of "
                f"{len(ref_keys)} reference keys exist in the target (reference model "
                f"{self.ref.run.get('model_id')!r}, target {self.tgt.run.get('model_id')!r}; "
                f"modules only in the reference: {sorted(ref_mods)[:4]}, only in the target: "
                f"{sorted(tgt_mods)[:4]}); record the target with --replay REF and the same MODEL")
        if self.ref.run.get("replay_id") and self.tgt.run.get("replay_id") \
                and self.ref.run["replay_id"] != self.tgt.run["replay_id"]:
            self.warnings.append("the target was not recorded from this reference's replay "
                                 "(different replay_id): weights and inputs may differ")

    def _alignment_findings(self, ref_map: dict, tgt_map: dict) -> None:
        missing: dict[str, list] = defaultdict(list)
        extra: dict[str, list] = defaultdict(list)
        for k, e in ref_map.items():
            if k not in tgt_map:
                missing[e["module"]].append(e)
        for k, e in tgt_map.items():
            if k not in ref_map:
                extra[e["module"]].append(e)
        for mod, es in missing.items():
            self.findings.append(Finding(
                "alignment.missing_in_target", mod, es[0]["step"],
                f"{len(es)} tensor(s) recorded on the reference are missing on the target "
                f"(e.g. {es[0]['key']}): the target skipped or renamed this module, or the two "
                "runs captured different phases/steps", phase=es[0]["phase"], key=es[0]["key"],
                details={"count": len(es), "keys": [x["key"] for x in es[:10]]}))
        for mod, es in extra.items():
            self.findings.append(Finding(
                "alignment.extra_in_target", mod, es[0]["step"],
                f"{len(es)} tensor(s) exist only on the target (e.g. {es[0]['key']}): the target "
                "ran a module or call the reference did not", phase=es[0]["phase"],
                key=es[0]["key"], details={"count": len(es), "keys": [x["key"] for x in es[:10]]}))

    # -- one pair --------------------------------------------------------------------------------
    def _pair_metrics(self, r: dict, t: dict) -> tuple[dict[str, Any], str]:
        rt = self.ref.tensor(r)
        tt = self.tgt.tensor(t)
        how = "full"
        if rt is None or tt is None:
            rt, tt, how = self.ref.tensor(r, "sample"), self.tgt.tensor(t, "sample"), "sample"
            if rt is None or tt is None or rt.shape != tt.shape:
                return _stats_metrics(r["stats"], t["stats"]), "stats"
        m = mx.tensor_error(rt, tt, ref_dtype=r["dtype"], tgt_dtype=t["dtype"],
                            chunk_elems=self.chunk_elems)
        if how == "full":
            m["ref_rms"] = m.get("ref_rms", _rms_of(r["stats"]))
        else:
            m["ref_rms"] = _rms_of(r["stats"])
            m["ref_absmax"] = r["stats"].get("absmax", m.get("ref_absmax"))
        return m, how

    def _kink_flips(self, r: dict, t: dict, m: dict[str, Any], floor_max: float) -> dict[str, Any]:
        """Gradients through ReLU-like kinks (relu, max-pool, clamp) switch on or off where the
        forward input crossed the kink within its own error: such positions are one side exactly
        zero, the other not. Judge the other positions with the floor, and these by count: there
        may be no more of them than forward inputs that came that close to zero."""
        rt, tt = self.ref.tensor(r), self.tgt.tensor(t)
        big = torch.maximum(rt.double().abs(), tt.double().abs()) > floor_max
        flip = ((rt == 0) ^ (tt == 0)) & big
        n = int(flip.sum())
        if n == 0:
            return m
        keep = ~flip
        out = mx.tensor_error(rt[keep], tt[keep], ref_dtype=r["dtype"], tgt_dtype=t["dtype"]) \
            if int(keep.sum()) else {"rms": 0.0, "max_abs": 0.0}
        s, _, mod, call, slot = _align(r)
        in_slot = "input" + slot[len("grad_input"):]
        xr_e = self.ref_index.by_align.get((s, "forward", mod, call, in_slot))
        xt_e = self.tgt_map.get((s, "forward", mod, call, in_slot))
        crossings = None
        if xr_e is not None and xt_e is not None:
            xr, xt = self.ref.tensor(xr_e), self.tgt.tensor(xt_e)
            if xr is not None and xt is not None and xr.shape == rt.shape == xt.shape:
                xr64, xt64 = xr.double(), xt.double()
                close = (xr64.abs() <= 2 * (xt64 - xr64).abs()) | (torch.sign(xr64) != torch.sign(xt64))
                crossings = int(close.sum())
        # Without the forward input, allow what rounding near zero typically produces.
        allowed = 2 * crossings + 4 if crossings is not None else max(4, int(0.01 * rt.numel()))
        out = dict(out)
        out["kink_flips"] = {"count": n, "allowed": allowed, "forward_crossings": crossings,
                             "unexplained": n > allowed}
        return out

    def _update_scale(self, r: dict) -> tuple[float, float]:
        """rms and max of the reference's own optimizer update of a parameter."""
        s, _, m, _, slot = _align(r)
        before = self.ref_index.by_align.get((s, "params", m, 0, slot))
        if before is None:
            return 0.0, 0.0
        a, b = self.ref.tensor(r), self.ref.tensor(before)
        if a is None or b is None or a.shape != b.shape:
            d_rms = abs(_rms_of(r["stats"]) - _rms_of(before["stats"]))
            return d_rms, d_rms
        d = a.double() - b.double()
        return float(d.pow(2).mean().sqrt()), float(d.abs().max()) if d.numel() else 0.0

    def _u(self, r: dict, t: dict) -> tuple[float, float]:
        """(u, u_acc) for this entry: the coarser side, matmul precision where it applies."""
        u = max(mx.unit_roundoff(r["dtype"]), mx.unit_roundoff(t["dtype"]))
        kind = (r.get("meta") or {}).get("kind")
        if r["phase"] in ("forward", "backward", "loss") and (kind in MATMUL_KINDS or r["phase"] == "loss"):
            for run, e in ((self.ref.run, r), (self.tgt.run, t)):
                u = max(u, _matmul_roundoff(run, e["dtype"], r["phase"]))
        u_acc = max(_acc_roundoff(r["dtype"]), _acc_roundoff(t["dtype"]))
        return u, u_acc

    def _judge(self, r: dict, t: dict) -> Entry:
        a = _align(r)
        limit, rule = self.policy.limit_for(r["module"], r["phase"])
        if self.limit_override is not None:
            limit, rule = self.limit_override, f"--limit {self.limit_override:g}"
        base = dict(key=r["key"], module=r["module"], phase=r["phase"], step=r["step"],
                    call=r["call"], slot=r["slot"], order=r["order"])
        if list(r["shape"]) != list(t["shape"]):
            self.findings.append(Finding(
                "alignment.shape_mismatch", r["module"], r["step"],
                f"{r['key']}: reference shape {r['shape']}, target shape {t['shape']}",
                phase=r["phase"], key=r["key"]))
            self.rel[a] = (fl.REL_CAP, fl.REL_CAP)
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        if _is_float(r["dtype"]) != _is_float(t["dtype"]):
            self.findings.append(Finding(
                "alignment.dtype_mismatch", r["module"], r["step"],
                f"{r['key']}: reference dtype {r['dtype']}, target dtype {t['dtype']} (one is not "
                "floating point)", phase=r["phase"], key=r["key"]))
            self.rel[a] = (fl.REL_CAP, fl.REL_CAP)
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        m, how = self._pair_metrics(r, t)
        judged = m
        details: dict[str, Any] = {"ref_stats": r["stats"], "tgt_stats": t["stats"],
                                   "ref_dtype": r["dtype"], "tgt_dtype": t["dtype"],
                                   "measured_on": how}
        meta = r.get("meta") or {}
        if meta.get("module_type"):
            details["module_type"] = meta["module_type"]
        ref_rms = m.get("ref_rms") or 0.0
        ref_max = m.get("ref_absmax") or r["stats"].get("absmax") or 0.0
        self.rel[a] = (fl.relative(m.get("rms", 0.0), ref_rms),
                       fl.relative(m.get("max_abs", 0.0), ref_max))
        ignore = self.policy.ignore_reason(r["module"], r["phase"], r["step"])
        if not _is_float(r["dtype"]):
            exact = m.get("max_abs", 0.0) == 0.0 and not m.get("nonfinite_mismatch")
            status = OK if exact else DRIFT
            if ignore:
                status = IGNORED
            return Entry(**base, metrics=m, floor=0.0, ratio=0.0 if exact else math.inf,
                         status=status, decided_by="exact", rule=ignore or "integer tensors must match exactly",
                         details=details)
        deps = self.ref_index.dependencies(r)
        inh = [self.rel.get(_align(d), (0.0, 0.0)) for d in deps]
        inh_rms = max((x[0] for x in inh), default=0.0)
        inh_max = max((x[1] for x in inh), default=0.0)
        u, u_acc = self._u(r, t)
        mag = meta.get("mag_rms")
        scale_rms = max(ref_rms, mag or 0.0)
        scale_max = ref_max * (scale_rms / ref_rms if ref_rms > 0 else 1.0)
        extra_rms = extra_max = 0.0
        if r["phase"] == "optimizer" and r["slot"].startswith("param."):
            upd_rms, upd_max = self._update_scale(r)
            extra_rms, extra_max = C_UPDATE * upd_rms, 2.0 * upd_max
        tiny = max(_tiny(r["dtype"]), _tiny(t["dtype"]))
        fi = fl.FloorInputs(u=u, u_acc=u_acc, k=meta.get("k"), scale_rms=scale_rms,
                            scale_max=scale_max, inherited_rms=inh_rms, inherited_max=inh_max,
                            extra_rms=extra_rms, extra_max=extra_max, tiny=tiny)
        f = fl.floor(fi)
        if how == "full" and r["phase"] == "backward" and r["slot"].startswith("grad_input") \
                and f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) > limit:
            judged = self._kink_flips(r, t, m, f.max)
        ratio = f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        if judged is not m:
            details["kink_flips"] = judged["kink_flips"]
            if judged["kink_flips"]["unexplained"]:
                ratio = math.inf
        details["floor"] = {"rms": f.rms, "max": f.max, "local_rms": f.local_rms,
                            "inherited_rms": f.inherited_rms, "u": u, "k": meta.get("k"),
                            "scale_rms": scale_rms, "inherited_rel": inh_rms}
        details["inherits_from"] = [d["key"] for d in deps][:8]
        if m.get("nonfinite_new", 0) > 0:
            status = NONFINITE
        elif ratio > limit:
            status = DRIFT
        else:
            status = OK
        if ignore and status != OK:
            status = IGNORED
        return Entry(**base, metrics=m, floor=f.rms, ratio=ratio, status=status,
                     decided_by="analytic", rule=ignore or rule, details=details)

    # -- the whole comparison ---------------------------------------------------------------------
    def run(self) -> Report:
        self._check_runs()
        ref_entries = sorted(self.ref.entries, key=_order_key)
        self.ref_index = _Index(ref_entries)
        ref_map = {_align(e): e for e in ref_entries}
        tgt_map = {_align(e): e for e in self.tgt.entries}
        self.tgt_map = tgt_map
        self._alignment_findings(ref_map, tgt_map)
        entries: list[Entry] = []
        for r in ref_entries:
            if not self.policy.judges_step(r["step"]):
                continue
            t = tgt_map.get(_align(r))
            if t is None:
                self.rel[_align(r)] = (0.0, 0.0)
                continue
            entries.append(self._judge(r, t))
        self._trace_findings()
        self._nonfinite_findings(entries)
        self._precision_findings()
        return self._verdict(entries)

    def _trace_findings(self) -> None:
        for side, reader in (("target", self.tgt), ("reference", self.ref)):
            for f in reader.manifest.get("findings", []) or []:
                if not isinstance(f, dict) or "kind" not in f:
                    continue
                finding = Finding(**{k: v for k, v in f.items() if k in Finding.__dataclass_fields__})
                if side == "reference":
                    finding.severity = "warning"
                    finding.message = "the reference run itself: " + finding.message
                finding.details = dict(finding.details or {}, side=side)
                self.findings.append(finding)
        ref_ev = self.ref.manifest.get("view_events")
        tgt_ev = self.tgt.manifest.get("view_events")
        if ref_ev and tgt_ev:
            from driftcheck.audit import views

            self.findings.extend(views.compare_events(ref_ev, tgt_ev, _view_tolerance(self)))

    def _nonfinite_findings(self, entries: list[Entry]) -> None:
        first = next((e for e in entries if e.status == NONFINITE), None)
        if first is not None:
            self.findings.append(Finding(
                "nonfinite.origin", first.module, first.step,
                f"NaN/Inf first appears on the target at {first.key} "
                f"({first.metrics.get('nonfinite_new')} element(s)) where the reference is finite: "
                "look for an overflow (bf16/fp16 range, fp8 saturation) or a bad kernel here",
                phase=first.phase, key=first.key))
        bad_ref = next((e for e in entries if (e.metrics.get("nan_ref") or 0) + (e.metrics.get("inf_ref") or 0) > 0), None)
        if bad_ref is not None:
            self.findings.append(Finding(
                "nonfinite.reference", bad_ref.module, bad_ref.step,
                f"the reference itself has NaN/Inf at {bad_ref.key}: drift after it cannot be "
                "judged; fix the reference run first", phase=bad_ref.phase, key=bad_ref.key,
                severity="warning"))

    def _precision_findings(self) -> None:
        try:
            from driftcheck.precision import diff_settings
        except ImportError:  # pragma: no cover
            return
        rp, tp = self.ref.run.get("precision") or {}, self.tgt.run.get("precision") or {}
        for key, a, b, explains in diff_settings(rp, tp):
            if explains:
                self.findings.append(Finding(
                    "precision.setting_differs", "", None,
                    f"{key} differs: reference {a!r}, target {b!r}; the noise floor accounts for "
                    "it where it can, but it explains drift", severity="warning",
                    details={"setting": key, "reference": a, "target": b}))

    def _verdict(self, entries: list[Entry]) -> Report:
        failing = [e for e in entries if e.status in (DRIFT, NONFINITE, MISALIGNED)]
        first = next((e for e in entries if e.status in (DRIFT, NONFINITE)), None)
        gate_findings = []
        for f in self.findings:
            reason = self.policy.ignore_reason(f.module, f.phase, f.step, f.kind)
            if reason:
                f.details = dict(f.details or {}, ignored=reason)
            elif self.policy.fails_gate(f):
                gate_findings.append(f)
        limit = self.limit_override if self.limit_override is not None else self.policy.limit
        if failing or gate_findings:
            verdict = "fail"
            parts = []
            if first is not None:
                parts.append(f"{first.key} has ratio {_fmt_ratio(first.ratio)} > limit "
                             f"({first.rule})" if first.status == DRIFT else
                             f"{first.key} has NaN/Inf the reference lacks")
            if gate_findings:
                kinds = sorted({f.kind for f in gate_findings})
                parts.append(f"{len(gate_findings)} finding(s) fail the gate: {', '.join(kinds)}")
            n_drift = sum(e.status == DRIFT for e in entries)
            if n_drift:
                parts.append(f"{n_drift} entr{'y' if n_drift == 1 else 'ies'} above the limit")
            decided_by = "; ".join(parts)
        else:
            verdict = "pass"
            worst = max((e.ratio for e in entries if e.ratio is not None and math.isfinite(e.ratio)),
                        default=0.0)
            decided_by = (f"all {len(entries)} entries within the limit (worst ratio "
                          f"{worst:.3g} <= {limit:g}) and no finding fails the gate")
        fd = None
        if first is not None:
            fd = {"key": first.key, "module": first.module, "phase": first.phase,
                  "step": first.step, "call": first.call, "slot": first.slot,
                  "ratio": first.ratio, "status": first.status,
                  "where": _where(first)}
        return Report(verdict=verdict, reference=self.ref.run, target=self.tgt.run,
                      first_divergence=fd, entries=entries, findings=self.findings, limit=limit,
                      decided_by=decided_by, warnings=self.warnings,
                      truth=self.truth.run if self.truth is not None else None,
                      policy=self.policy.to_dict())


def _where(e: Entry) -> str:
    """Say in words where drift entered."""
    mod = e.module or "the model"
    if e.phase == "forward" and e.slot.startswith("input"):
        return (f"in the code of the parent of {mod} that computes its input {e.slot} "
                "(between submodules)")
    if e.phase == "forward":
        return f"in the forward of {mod}"
    if e.phase == "backward" and e.slot.startswith("grad_input"):
        return f"in the backward of {mod}"
    if e.phase == "backward":
        return f"in the backward of the code that consumes the output of {mod}"
    if e.phase == "grads":
        return f"in the weight gradient of {mod}"
    if e.phase == "optimizer":
        return f"in the optimizer update of {mod}"
    if e.phase == "params":
        return f"in the initial state of {mod} (replayed weights differ beyond the cast)"
    return f"in the {e.phase} of {mod}"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else ("inf" if math.isinf(r) else f"{r:.3g}")


def _stats_metrics(rs: dict[str, Any], ts: dict[str, Any]) -> dict[str, Any]:
    """Error estimates from summary statistics alone (stats mode without a sample)."""
    rr, tr = _rms_of(rs), _rms_of(ts)
    mean_d = abs((ts.get("mean") or 0.0) - (rs.get("mean") or 0.0))
    # Lower bounds on the error: ||t-r|| >= | ||t|| - ||r|| |, and |mean(t-r)|.
    rms = max(abs(tr - rr), mean_d)
    amax = max(abs((ts.get("max") or 0) - (rs.get("max") or 0)), abs((ts.get("min") or 0) - (rs.get("min") or 0)))
    return {"rms": rms, "max_abs": amax, "ref_rms": rr, "ref_absmax": rs.get("absmax") or 0.0,
            "tgt_rms": tr, "nan_ref": rs.get("nan", 0), "nan_tgt": ts.get("nan", 0),
            "inf_ref": rs.get("inf", 0), "inf_tgt": ts.get("inf", 0),
            "nonfinite_new": max(0, (ts.get("nan", 0) + ts.get("inf", 0)) - (rs.get("nan", 0) + rs.get("inf", 0))),
            "estimated_from": "stats"}


def _acc_roundoff(dtype: str) -> float:
    return 2.0**-53 if dtype == "float64" else 2.0**-24


def _tiny(dtype: str) -> float:
    try:
        return float(torch.finfo(getattr(torch, dtype)).tiny) if _is_float(dtype) and not dtype.startswith("complex") else 0.0
    except (TypeError, AttributeError):
        return 0.0


def _matmul_roundoff(run: dict[str, Any], dtype: str, phase: str) -> float:
    settings = run.get("precision") or {}
    try:
        from driftcheck.precision import effective_matmul_roundoff

        return effective_matmul_roundoff(settings, dtype, phase=phase)
    except (ImportError, TypeError, KeyError, ValueError):
        return mx.unit_roundoff(dtype)


def _view_tolerance(c: Comparison) -> float:
    us = [mx.unit_roundoff(str(run.get("dtype") or "float32")) for run in (c.ref.run, c.tgt.run)]
    return 8 * max(us)


def compare(ref: str | TraceReader, target: str | TraceReader, *, policy: Policy | None = None,
            limit: float | None = None, truth: str | TraceReader | None = None) -> Report:
    """Compare a target trace against a reference trace.

    Args:
        ref, target: trace directories (or open readers).
        policy: the gate policy (default: Policy.default()).
        limit: overrides every ratio limit of the policy.
        truth: a float64 record of the same replay (three-way comparison).

    Returns:
        The Report; ``bool(report)`` is True when it passed.
    """
    r = ref if isinstance(ref, TraceReader) else TraceReader(ref)
    t = target if isinstance(target, TraceReader) else TraceReader(target)
    tr = truth if truth is None or isinstance(truth, TraceReader) else TraceReader(truth)
    return Comparison(r, t, policy=policy, limit=limit, truth=tr).run()


def entries_by_status(report: Report, statuses: Iterable[str]) -> list[Entry]:
    s = set(statuses)
    return [e for e in report.entries if e.status in s]

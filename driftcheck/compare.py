"""compare(): align two traces, measure each tensor pair against its noise floor, give a verdict.

Entries align by their semantic key (step, phase, module, call, slot). Tensors are read one pair
at a time through memory-mapped shards, so memory is bounded by the largest pair. Each entry's
floor inherits the relative error of the entries it depends on (``dependencies``), so the first
entry over the limit, in execution order, is where drift *enters*.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from typing import Any, NamedTuple

import torch

from driftcheck import floor as fl
from driftcheck import format as fmt
from driftcheck import metrics as mx
from driftcheck.errors import DriftcheckError
from driftcheck.local import base_slot, is_local_slot
from driftcheck.policy import Policy
from driftcheck.report import (DRIFT, IGNORED, MISALIGNED, NONFINITE, OK, Entry, Finding,
                               Report)
from driftcheck.store import TraceReader

MATMUL_KINDS = ("linear", "conv", "composite")
KINK_ZEROS = 0.1  # a ReLU-like gradient: this many zeros, as many as non-positive inputs (+-)
KINK_NEAR = 16  # smallest sample magnitudes the density of a tensor near zero is taken from
C_UPDATE = 0.5  # optimizer: share of the reference's own update that rounding may flip
TRUTH_M, TRUTH_M_LOW = 2.0, 3.0  # TorchDynamo's multipliers: fp32 targets, bf16/fp16 targets
HISTOGRAMS = 8  # worst entries that get an error histogram (the HTML report shows up to 6 + 1)
PART_ELEMS = 1 << 22  # elements above which one pair is measured in parts, on several workers
HISTOGRAM_BINS = 40  # at most, each a whole number of binades of |target - reference|
NOISE_GRAD = 0.3  # a gradient whose error is this share of its value is rounding noise


def _order_key(e: dict[str, Any]) -> tuple[int, int, int]:
    return (e["step"], fmt.PHASE_RANK[e["phase"]], e["order"])


def _align(e: dict[str, Any]) -> tuple:
    return fmt.entry_align(e)


class _Index:
    """Structural lookups on the reference's entries (who depends on whom)."""

    def __init__(self, entries: list[dict[str, Any]], tied: list[dict[str, str]] | None = None) -> None:
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
        # Tied parameters: a module computes with its owner's captured parameter (so inherits
        # its error), and the owner's gradient sums that module's contribution.
        self.users: dict[tuple[str, str], list[str]] = defaultdict(list)
        tied_in: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for t in tied or []:
            self.users[(t["owner"], t["owner_param"])].append(t["module"])
            tied_in[t["module"]].append((t["owner"], "param." + t["owner_param"]))
        if tied_in:
            for s, m in self.calls:
                for owner, slot in tied_in.get(m, ()):
                    e = self.by_align.get((s, "params", owner, 0, slot))
                    if e is not None and all(x is not e for x in self.params[(s, m)]):
                        self.params[(s, m)].append(e)

    def caller(self, s: int, module: str) -> str:
        """``module``, or where it never ran as a module at step ``s`` (an ancestor used its
        parameters itself: nn.MultiheadAttention calls F.linear with out_proj.weight), its
        nearest ancestor that did."""
        m = module
        while m and not self.calls.get((s, m)):
            m = m.rpartition(".")[0]
        return m if self.calls.get((s, m)) else module

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
            # parameters handed over as inputs (weight-norm parametrizations, tied weights):
            # those of the module and of its ancestors in the module tree
            path = m
            while path:
                deps += self.params.get((s, path), [])
                path = path.rpartition(".")[0]
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
            leaf = slot.partition(".")[2]
            for user in [m, *self.users.get((m, leaf), ())]:  # with the modules tied to it
                user = self.caller(s, user)
                for cc in self.calls.get((s, user), ()):
                    k = (s, user, cc)
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


class _Error(NamedTuple):
    """What a judged entry passes on to the entries that depend on it."""

    rel_rms: float  # rms error / magnitude
    rel_max: float  # max error / max magnitude
    rms: float  # absolute rms error
    max: float  # absolute max error
    mu: float = 1.0  # magnitude / rms of the reference (> 1 where terms cancel)
    sparse: float = 0.0  # relative error a sample cannot show (kink flips upstream)


class _Measured(NamedTuple):
    """One pair read and measured: its metrics, what they were measured on ("full", "sample" or
    "stats") and the error histogram of the elements read (None for "stats")."""

    metrics: dict[str, Any]
    how: str
    histogram: mx.ErrorHistogram | None


_WRONG = _Error(fl.REL_CAP, fl.REL_CAP, 0.0, 0.0)  # misaligned: fully wrong, no measured size
_NONE = _Error(0.0, 0.0, 0.0, 0.0)


def _rms_of(stats: dict[str, Any]) -> float:
    n = stats.get("numel") or 0
    l2 = stats.get("l2")
    if not n or l2 is None or not math.isfinite(l2):
        return 0.0
    return l2 / math.sqrt(n)


def _is_float(dtype: str) -> bool:
    return dtype in fmt.FLOAT_DTYPES or dtype.startswith("complex")


def _dtype_kind(dtype: str) -> str:
    """exact (integer/bool), real or complex: only tensors of one kind can be measured together."""
    return "complex" if dtype.startswith("complex") else ("real" if _is_float(dtype) else "exact")


class Comparison:
    """One comparison of a target trace against a reference (optionally a float64 truth)."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, *, policy: Policy | None = None,
                 limit: float | None = None, truth: TraceReader | None = None,
                 chunk_elems: int = 1 << 17, workers: int | None = None) -> None:
        self.ref, self.tgt, self.truth = ref, tgt, truth
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        self._measured: dict[tuple, _Measured] = {}
        self._histograms_by_key: dict[str, mx.ErrorHistogram] = {}
        self.policy = policy or Policy.default()
        self.limit_override = limit
        self.chunk_elems = chunk_elems
        self.findings: list[Finding] = []
        self.warnings: list[str] = []
        self.errors: dict[tuple, _Error] = {}  # align key -> what later entries inherit

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
        # The model's own state before the first step is the model configuration: if its shapes
        # differ, the traces are of different models, not a target that drifted.
        tgt_by_key = {_align(e): e for e in self.tgt.entries if e["phase"] == "params"}
        bad = [(e, tgt_by_key[_align(e)]) for e in self.ref.entries if e["phase"] == "params"
               and _align(e) in tgt_by_key and list(e["shape"]) != list(tgt_by_key[_align(e)]["shape"])]
        if bad:
            r, t = bad[0]
            raise DriftcheckError(
                f"the traces were recorded from different model configurations: {len(bad)} "
                f"parameter/buffer shape(s) differ (e.g. {r['module'] or '(model)'} {r['slot']}: "
                f"reference {r['shape']}, target {t['shape']}); re-record the reference (or the "
                "golden trace) and the target with the same MODEL and settings")
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
    def _pair_metrics(self, r: dict, t: dict) -> _Measured:
        measured = self._measured.pop(_align(r), None)
        return measured if measured is not None else self._measure(r, t)

    def _measure(self, r: dict, t: dict) -> _Measured:
        return self._measure_between(self.ref, r, self.tgt, t)

    def _measure_between(self, ref: TraceReader, r: dict, tgt: TraceReader, t: dict) -> _Measured:
        """Metrics of ``t`` (in ``tgt``) against ``r`` (in ``ref``): streamed from the full
        tensors, else the stats-mode samples (the same seeded indices on both runs), else
        estimated from the summary statistics; with the error histogram of the elements read
        (None when estimated from statistics), in the same pass."""
        acc, how = self._accumulate(ref, r, tgt, t)
        return self._finish(acc, how, r, t)

    def _accumulate(self, ref: TraceReader, r: dict, tgt: TraceReader, t: dict,
                    part: tuple[int, int] | None = None) -> tuple[mx.ErrorAccumulator | None, str]:
        """Stream the pair (or only its flat elements [lo, hi) when ``part`` is given: full
        tensors only) into an accumulator. (None, "stats") when neither side stored data."""
        rc = ref.chunks(r, self.chunk_elems, part=part)
        tc = tgt.chunks(t, self.chunk_elems, part=part)
        how = "full"
        if rc is None or tc is None:
            rs, ts = ref.tensor(r, "sample"), tgt.tensor(t, "sample")
            if rs is None or ts is None or rs.shape != ts.shape:
                return None, "stats"
            rc, tc, how = iter([rs.reshape(-1)]), iter([ts.reshape(-1)]), "sample"
        acc = mx.ErrorAccumulator(r["dtype"], t["dtype"])
        sat = _saturation(r, t)
        for a, b in zip(rc, tc):  # one chunk at a time: memory bounded by the chunk
            if sat is not None:
                # Sentinels like finfo(dtype).min in attention masks differ by dtype by design:
                # beyond the coarser dtype's range both sides mean "saturated", not error.
                a, b = a.double().clamp(-sat, sat), b.double().clamp(-sat, sat)
            acc.update(a, b)
        return acc, how

    def _finish(self, acc: mx.ErrorAccumulator | None, how: str, r: dict, t: dict) -> _Measured:
        if acc is None:
            return _Measured(_stats_metrics(r["stats"], t["stats"]), "stats", None)
        m = acc.result()
        if how == "full":
            m["ref_rms"] = m.get("ref_rms", _rms_of(r["stats"]))
        else:
            m["ref_rms"] = _rms_of(r["stats"])
            m["ref_absmax"] = r["stats"].get("absmax", m.get("ref_absmax"))
            m["estimated_from"] = "sample"
        return _Measured(m, how, acc.histogram(HISTOGRAM_BINS))

    def _parts(self, r: dict, t: dict) -> list[tuple[int, int]] | None:
        """Flat element ranges of a large pair of full tensors, measured on several workers;
        each a whole number of chunks, so the chunks are those of one stream."""
        n = math.prod(r["shape"])
        if ("tensor" not in r or "tensor" not in t or n <= PART_ELEMS or r["dtype"] != t["dtype"]
                or "complex" in str(r["dtype"])):
            return None
        step = max(1, PART_ELEMS // self.chunk_elems) * self.chunk_elems
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _measure_all(self, pairs: list[tuple[dict, dict]]) -> None:
        """Metrics of every pair on ``workers`` threads (the kernels release the GIL), a large
        pair split into parts measured side by side and merged in order; floors and ratios,
        which depend on earlier entries, are then judged in order."""
        self._measured = {}
        todo = [(r, t) for r, t in pairs if list(r["shape"]) == list(t["shape"])
                and _dtype_kind(r["dtype"]) == _dtype_kind(t["dtype"])]
        jobs: list[tuple[int, tuple[int, int] | None]] = []
        for i, (r, t) in enumerate(todo):
            jobs += [(i, p) for p in (self._parts(r, t) or [None])]
        if self.workers <= 1 or len(jobs) < 2:
            return  # measured lazily, one at a time, by _pair_metrics
        from concurrent.futures import ThreadPoolExecutor

        def run(job: tuple[int, tuple[int, int] | None]) -> tuple[mx.ErrorAccumulator | None, str]:
            r, t = todo[job[0]]
            return self._accumulate(self.ref, r, self.tgt, t, part=job[1])

        def finish(i: int, acc: mx.ErrorAccumulator | None, how: str) -> None:
            r, t = todo[i]
            self._measured[_align(r)] = self._finish(acc, how, r, t)

        current: tuple[int, mx.ErrorAccumulator | None, str] | None = None
        with ThreadPoolExecutor(self.workers, thread_name_prefix="driftcheck-compare") as pool:
            # Results come in job order: a pair's parts left to right, then the next pair, so
            # each pair is merged and finished (its accumulator dropped) as soon as it is whole.
            for (i, _), (acc, how) in zip(jobs, pool.map(run, jobs)):
                if current is not None and current[0] == i:
                    if current[1] is not None and acc is not None:
                        current[1].merge(acc)
                    continue
                if current is not None:
                    finish(*current)
                current = (i, acc, how)
        if current is not None:
            finish(*current)

    def _judge_integer(self, r: dict, m: dict[str, Any], base: dict[str, Any],
                       details: dict[str, Any], ignore: str | None) -> Entry:
        """Integer tensors: inputs, buffers and counters must match exactly. Integers a module
        computes (top-k expert indices, argmax) may flip where their float scores tie within
        rounding: a few percent of them may differ; more is a defect."""
        mismatched = m.get("frac_outside", 0.0) if m.get("max_abs", 0.0) > 0 else 0.0
        computed = r["phase"] == "forward" and (r["slot"].startswith("output")
                                                or (r.get("meta") or {}).get("parent") is not None)
        if m.get("nonfinite_mismatch"):
            mismatched = 1.0
        allowed = 0.05 if computed else 0.0
        ok = mismatched <= allowed
        details["integer_mismatch_fraction"] = mismatched
        status = OK if ok else DRIFT
        if ignore and not ok:
            status = IGNORED
        rule = ignore or ("computed integers may flip on near-ties (<= 5% of elements)" if computed
                          else "integer tensors must match exactly")
        return Entry(**base, metrics=m, floor=0.0, ratio=0.0 if mismatched == 0 else
                     (mismatched / allowed if allowed else math.inf), status=status,
                     decided_by="exact", rule=rule, details=details)

    def _magnitude(self, r: dict) -> float:
        """Operand magnitude of a parameter gradient (and the optimizer state built from it):
        dW = sum_n g_n x_n^T has rounding error ~ u * sqrt(sum_n g_n^2 x_n^2), whose rms over W
        is about ||G|| ||X|| / sqrt(numel(G) * fan_in); a bias's is ||G|| / sqrt(numel(b))."""
        s, ph, m, _, slot = _align(r)
        if ph == "optimizer" and slot.startswith("state."):
            leaf = slot.split(".")[1]
            g = self.ref_index.by_align.get((s, "grads", m, 0, f"param.{leaf}"))
            if g is None:
                return 0.0
            mu = self.errors.get(_align(g), _NONE).mu
            sq = slot.endswith(("exp_avg_sq", "square_avg", "sum", "max_exp_avg_sq"))
            return _rms_of(r["stats"]) * (mu * mu if sq else mu)
        if ph != "grads":
            return 0.0
        g2 = x2 = g_n = 0.0
        out_ch = fan_in = None
        for c in self.ref_index.calls.get((s, m), ()):
            for e in self.ref_index.gout.get((s, m, c), [])[:1]:
                g2 += (e["stats"].get("l2") or 0.0) ** 2
                g_n += e["stats"].get("numel") or 0
                if e["shape"]:
                    out_ch = e["shape"][-1] if (e.get("meta") or {}).get("kind") == "linear" else \
                        (e["shape"][1] if len(e["shape"]) > 1 else e["shape"][0])
            for e in self.ref_index.fwd_in.get((s, m, c), [])[:1]:
                x2 += (e["stats"].get("l2") or 0.0) ** 2
            for e in self.ref_index.fwd_out.get((s, m, c), [])[:1]:
                meta = e.get("meta") or {}
                if meta.get("k"):
                    fan_in = meta["k"] // max(meta.get("kernel", 1), 1)
        numel = r["stats"].get("numel") or 0
        if not g2 or not numel:
            return 0.0
        if slot == "param.weight" and x2 and fan_in and g_n:
            return math.sqrt(g2 * x2 / (g_n * fan_in))
        if len(r["shape"]) == 1 and out_ch == r["shape"][0]:
            return math.sqrt(g2 / numel)  # a bias (or a norm's per-channel parameter)
        return 0.0

    def _grad_terms(self, r: dict) -> int | None:
        """How many terms each element of a parameter gradient sums (K of its accumulation):
        per call, the output gradient's elements per output channel (batch x positions for a
        convolution, rows for a Linear), over every call. Two runs may sum them in different
        orders (threads, kernels): fp32 against fp32 differs by ~sqrt(K) u there."""
        s, _, m, _, slot = _align(r)
        if not r["shape"]:
            return None
        terms = 0
        for c in self.ref_index.calls.get((s, m), ()):
            for e in self.ref_index.gout.get((s, m, c), [])[:1]:
                # the output channel: dim 1 (convolutions, batch norm) or last (Linear, norms)
                if len(e["shape"]) > 1 and r["shape"][0] in (e["shape"][1], e["shape"][-1]):
                    terms += (e["stats"].get("numel") or 0) // r["shape"][0]
        return terms or None

    def _forward_of(self, r: dict) -> tuple[dict | None, dict | None]:
        """The forward tensor a gradient entry is the gradient of (grad_input.0 -> input.0,
        grad_output[.p] -> output[.p]), in the reference and in the target."""
        s, _, mod, call, slot = _align(r)
        a = (s, "forward", mod, call, slot[len("grad_"):])
        return self.ref_index.by_align.get(a), self.tgt_map.get(a)

    def _kink_flips(self, r: dict, t: dict, m: dict[str, Any], floor_max: float,
                    which: str = "tensor") -> dict[str, Any]:
        """Gradients through ReLU-like kinks (relu, max-pool, clamp) switch on or off where the
        forward input crossed the kink within its own error: such positions are one side exactly
        zero, the other not; through a kink that changes the slope (LeakyReLU), they differ by
        more than the floor where the forward input crossed. Judge the other positions with the
        floor, and these by count: there may be no more of them than forward inputs that came
        that close to zero.

        ``which="sample"``: the same on the stats-mode samples (the same positions on both
        runs). The forward input's sample holds other positions (samples are drawn per key)
        unless both cover their whole tensor, so the count is otherwise judged without it."""
        rt, tt = self.ref.tensor(r, which), self.tgt.tensor(t, which)
        if rt is None or tt is None or rt.shape != tt.shape:
            return m
        xr_e, xt_e = self._forward_of(r)
        cross = None
        whole = which == "tensor" or r["stats"].get("numel") == rt.numel() == (
            xr_e or {}).get("stats", {}).get("numel")  # a sample that is the whole tensor
        if xr_e is not None and xt_e is not None and whole:
            xr, xt = self.ref.tensor(xr_e, which), self.tgt.tensor(xt_e, which)
            if xr is not None and xt is not None and xr.shape == rt.shape == xt.shape:
                cross = _crossing(xr, xt)
        big = torch.maximum(rt.double().abs(), tt.double().abs()) > floor_max
        flip = ((rt == 0) ^ (tt == 0)) & big
        if cross is not None:
            # A kink that only changes the slope (LeakyReLU, a clamp's other side): the
            # gradient differs by more than the floor, at an input that crossed the kink.
            flip |= cross & ((rt.double() - tt.double()).abs() > floor_max)
        n = int(flip.sum())
        if n == 0:
            return m
        keep = ~flip
        out = mx.tensor_error(rt[keep], tt[keep], ref_dtype=r["dtype"], tgt_dtype=t["dtype"]) \
            if int(keep.sum()) else {"rms": 0.0, "max_abs": 0.0}
        crossings = int(cross.sum()) if cross is not None else None
        # Without the forward input, allow what rounding near zero typically produces.
        allowed = 2 * crossings + 4 if crossings is not None else max(4, int(0.01 * rt.numel()))
        out = dict(out)
        out["kink_flips"] = {"count": n, "allowed": allowed, "forward_crossings": crossings,
                             "unexplained": n > allowed}
        return out

    def _kink_estimate(self, r: dict, seen: dict[str, Any] | None = None) -> float | None:
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
        x, xt_e = self._forward_of(r)
        err = self.errors.get(_align(x)) if x is not None else None
        if err is None or not err.rms:
            return None
        prof = (x.get("meta") or {}).get("kink_profile")
        absmax = x["stats"].get("absmax")
        if prof and prof[0] and absmax:
            k = math.floor(math.log2(absmax / (2.0 * err.rms))) if absmax > 2.0 * err.rms else 0
            return math.sqrt(prof[min(max(k, 0), len(prof) - 1)] / prof[0])
        xr = self.ref.tensor(x, "sample")
        xt = self.tgt.tensor(xt_e, "sample") if xt_e is not None else None
        if xr is None or xt is None or xr.shape != xt.shape or xr.numel() < 2 * KINK_NEAR:
            return None
        xr64 = xr.double().reshape(-1)
        n = xr64.numel()
        if not (seen and seen.get("count")):
            # A ReLU's gradient is exactly zero where its input is <= 0: as many zeros in the
            # gradient's sample as non-positive inputs in the input's (the two samples hold other
            # positions, their fractions agree). Zeros for other reasons (ignored labels, masked
            # attention) do not follow the input's sign.
            g = self.ref.tensor(r, "sample")
            zeros = float((g == 0).double().mean()) if g is not None and g.numel() else 0.0
            if zeros < KINK_ZEROS or abs(zeros - float((xr64 <= 0).double().mean())) > KINK_ZEROS:
                return None
        close = _crossing(xr, xt)
        near = float(xr64.abs().kthvalue(KINK_NEAR).values)
        dens = KINK_NEAR / n * min(1.0, 2.0 * err.rms / near) if near > 0 else KINK_NEAR / n
        return math.sqrt(max(int(close.sum()) / n, dens, (seen or {}).get("count", 0) / n))

    def _update_scale(self, r: dict, reader: TraceReader | None = None,
                      index: dict | None = None) -> tuple[float, float]:
        """rms and max of a run's own optimizer update of a parameter (the reference's by
        default)."""
        reader = reader or self.ref
        index = index if index is not None else self.ref_index.by_align
        s, _, m, _, slot = _align(r)
        before = index.get((s, "params", m, 0, slot))
        if before is None:
            return 0.0, 0.0
        a, b = reader.tensor(r), reader.tensor(before)
        if (a is None or b is None) and r["stats"].get("numel") == before["stats"].get("numel"):
            # Stats mode: samples of a tensor no larger than a sample are the whole tensor, in
            # order, whatever their keys: the update itself.
            a, b = reader.tensor(r, "sample"), reader.tensor(before, "sample")
            if a is not None and a.numel() != r["stats"].get("numel"):
                a = None
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
                u = max(u, _matmul_roundoff(run, e["dtype"], r["phase"], kind))
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
            self.errors[a] = _WRONG
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        if _dtype_kind(r["dtype"]) != _dtype_kind(t["dtype"]):
            self.findings.append(Finding(
                "alignment.dtype_mismatch", r["module"], r["step"],
                f"{r['key']}: reference dtype {r['dtype']}, target dtype {t['dtype']} (not both "
                "integer, both real or both complex)", phase=r["phase"], key=r["key"]))
            self.errors[a] = _WRONG
            return Entry(**base, metrics={}, floor=None, ratio=None, status=MISALIGNED, rule=rule)
        m, how, hist = self._pair_metrics(r, t)
        if hist is not None:
            self._histograms_by_key[r["key"]] = hist
        judged = m
        details: dict[str, Any] = {"ref_stats": r["stats"], "tgt_stats": t["stats"],
                                   "ref_dtype": r["dtype"], "tgt_dtype": t["dtype"],
                                   "measured_on": how}
        meta = r.get("meta") or {}
        if meta.get("module_type"):
            details["module_type"] = meta["module_type"]
        ref_rms = m.get("ref_rms") or 0.0
        ref_max = m.get("ref_absmax") or r["stats"].get("absmax") or 0.0
        # The operand magnitude (|A||B| in its probabilistic form), never below the value itself:
        # where terms cancel (a key bias's gradient is exactly zero in exact arithmetic) the
        # rounding error scales with the terms, not with their tiny sum.
        mag = max(meta.get("mag_rms") or 0.0, self._magnitude(r))
        scale_rms = max(ref_rms, mag)
        scale_max = ref_max * (scale_rms / ref_rms if ref_rms > 0 else 1.0)
        self.errors[a] = _Error(fl.relative(m.get("rms", 0.0), scale_rms),
                                fl.relative(m.get("max_abs", 0.0), scale_max),
                                m.get("rms", 0.0), m.get("max_abs", 0.0),
                                scale_rms / ref_rms if ref_rms > 0 else 1.0)
        if m.get("nonfinite_new") or m.get("nonfinite_mismatch"):
            # NaN/Inf where the reference is finite: whatever depends on it can be anything
            # (its metrics only see the finite positions); nonfinite.origin names the source.
            self.errors[a] = self.errors[a]._replace(rel_rms=fl.REL_CAP, rel_max=fl.REL_CAP)
        ignore = self.policy.ignore_reason(r["module"], r["phase"], r["step"])
        if not _is_float(r["dtype"]):
            return self._judge_integer(r, m, base, details, ignore)
        deps = self.ref_index.dependencies(r)
        inh = [self.errors.get(_align(d), _NONE) for d in deps]
        inh_rms = max((x.rel_rms for x in inh), default=0.0)
        inh_max = max((x.rel_max for x in inh), default=0.0)
        u, u_acc = self._u(r, t)
        extra_rms = extra_max = 0.0
        if r["phase"] == "params" and r["step"] > 0:
            # The state before step s is the state after step s-1: the same tensor.
            prev = self.errors.get((r["step"] - 1, "optimizer", r["module"], 0, r["slot"]))
            if prev is not None:
                extra_rms, extra_max = prev.rms, prev.max
        if r["phase"] == "optimizer" and r["slot"].startswith("param."):
            upd_rms, upd_max = self._update_scale(r)
            extra_rms, extra_max = C_UPDATE * upd_rms, 2.0 * upd_max
            g = self.ref_index.by_align.get((r["step"], "grads", r["module"], 0, r["slot"]))
            if g is not None:
                err_g = self.errors.get(_align(g), _NONE)
                rel_g = err_g.rel_rms * err_g.mu  # error / the gradient's own rms
                if rel_g > NOISE_GRAD:
                    # The gradient is below its own rounding noise (terms that cancel): an
                    # adaptive optimizer turns that noise into full-size steps on both runs.
                    t_rms, t_max = self._update_scale(t, self.tgt, self.tgt_map)
                    extra_rms = max(extra_rms, 2.0 * max(upd_rms, t_rms))
                    extra_max = max(extra_max, 2.0 * max(upd_max, t_max))
                    details["gradient_below_noise"] = rel_g
        tiny = max(_tiny(r["dtype"]), _tiny(t["dtype"]))
        k = meta.get("k") or (self._grad_terms(r) if r["phase"] == "grads" else None)
        fi = fl.FloorInputs(u=u, u_acc=u_acc, k=k, scale_rms=scale_rms,
                            scale_max=scale_max, inherited_rms=inh_rms, inherited_max=inh_max,
                            extra_rms=extra_rms, extra_max=extra_max, tiny=tiny)
        f = fl.floor(fi)
        # A kink inside the module (nn.ReLU) shows in its input gradient; one applied to its
        # output by the code around it (F.relu, x.relu() between two Linears) in its output's.
        if how in ("full", "sample") and r["phase"] == "backward" \
                and r["slot"].startswith(("grad_input", "grad_output")) \
                and f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0)) > 1.0:
            judged = self._kink_flips(r, t, m, f.max, "tensor" if how == "full" else "sample")
        ratio = f.ratio(judged.get("rms", 0.0), judged.get("max_abs", 0.0))
        if how != "full":
            # Sparse errors (kink flips) that a sample rarely holds: estimated where they enter,
            # then passed on to everything measured on samples downstream, as measured errors
            # are in full mode (a layer's gradient sums over the flips of the one above).
            sparse = max((x.sparse for x in inh), default=0.0)
            if r["phase"] == "backward" and r["slot"].startswith(("grad_input", "grad_output")):
                flips = self._kink_estimate(r, judged.get("kink_flips"))
                if flips:
                    details["kink_estimate"] = flips
                    sparse = max(sparse, flips)
            if sparse:
                e = self.errors[a]
                self.errors[a] = e._replace(rel_rms=max(e.rel_rms, sparse),
                                            rel_max=max(e.rel_max, sparse), sparse=sparse)
        if judged is not m:
            details["kink_flips"] = judged["kink_flips"]
            if judged["kink_flips"]["unexplained"]:
                ratio = math.inf
        decided_by = "analytic"
        details["analytic_ratio"] = ratio
        truth = self._truth_judgement(r, t, fi, limit) if self.truth is not None else None
        if truth is not None:
            details["truth"] = truth
            # Both judges must object (see docs/diagnosis.md): the entry's ratio is the more
            # lenient of the two, and the judge that gave it decided.
            if truth["ratio"] < ratio:
                ratio, decided_by = truth["ratio"], "truth"
        local = self._local_judgement(r, fi, limit)
        if local is not None:
            details["local"] = local
        details["floor"] = {"rms": f.rms, "max": f.max, "local_rms": f.local_rms,
                            "inherited_rms": f.inherited_rms, "u": u, "k": k,
                            "scale_rms": scale_rms, "inherited_rel": inh_rms}
        details["inherits_from"] = [d["key"] for d in deps][:8]
        if m.get("nonfinite_new", 0) > 0:
            status = NONFINITE
        elif ratio > limit:
            status = DRIFT
        elif local is not None and local["status"] != OK:
            status = local["status"]  # the module's own error is over the limit
        else:
            status = OK
        if ignore and status != OK:
            status = IGNORED
        return Entry(**base, metrics=m, floor=f.rms, ratio=ratio, status=status,
                     decided_by=decided_by, local_ratio=local["ratio"] if local else None,
                     rule=ignore or rule, details=details)

    # -- local replay and truth --------------------------------------------------------------------
    def _blame_module(self, e: Entry) -> str:
        """The module whose code produced the diverging tensor: a forward input is computed by
        the parent's code between its submodules."""
        r = self.ref_index.by_align.get((e.step, e.phase, e.module, e.call, e.slot))
        parent = self.ref_index.parent_of(r) if r is not None else None
        if e.phase == "forward" and e.slot.startswith("input") and parent is not None:
            return parent[1]
        return e.module

    def _local_judgement(self, r: dict, fi: fl.FloorInputs, limit: float) -> dict[str, Any] | None:
        """The error this module adds itself: the target's replay of it on the reference's
        inputs (``local.*``) against the reference's output, over the local-only floor."""
        le = self.local_map.get(_align(r))
        if le is None or list(le["shape"]) != list(r["shape"]) or not _is_float(le["dtype"]):
            return None
        m = self._measure_between(self.ref, r, self.tgt, le).metrics
        f = fl.floor(dataclasses.replace(fi, inherited_rms=0.0, inherited_max=0.0))
        ratio = f.ratio(m.get("rms", 0.0), m.get("max_abs", 0.0))
        status = NONFINITE if m.get("nonfinite_new", 0) > 0 else (DRIFT if ratio > limit else OK)
        return {"ratio": ratio, "status": status, "floor": f.rms, "floor_max": f.max,
                "rms": m.get("rms"), "max_abs": m.get("max_abs"),
                "nonfinite_new": m.get("nonfinite_new", 0), "key": le["key"]}

    def _truth_judgement(self, r: dict, t: dict, fi: fl.FloorInputs,
                         limit: float) -> dict[str, Any] | None:
        """TorchDynamo's accuracy rule against the float64 truth: the target is as good as the
        reference when err(target, truth) <= M * err(reference, truth) + tol, M = 3 for a
        bf16/fp16 target (2 otherwise), tol = this op's own rounding (the local analytic floor).
        Expressed on the policy's scale, ratio = limit * err_t / (M * err_r + tol), so it is over
        the limit exactly when the rule fails. It only matters for a reference of the target's
        precision (bf16 CPU vs bf16 accelerator): an fp32 reference is far closer to the truth
        than any correct bf16 run, and the analytic floor decides."""
        te = self.truth_map.get(_align(r))
        if te is None or list(te["shape"]) != list(r["shape"]) or not _is_float(te["dtype"]):
            return None
        err_t = self._measure_between(self.truth, te, self.tgt, t).metrics
        err_r = self._measure_between(self.truth, te, self.ref, r).metrics
        if err_t.get("nonfinite_new", 0) or err_r.get("nonfinite_new", 0):
            return None
        mult = TRUTH_M_LOW if t["dtype"] in ("bfloat16", "float16") else TRUTH_M
        tol = fl.floor(dataclasses.replace(fi, inherited_rms=0.0, inherited_max=0.0))
        f_rms = mult * err_r.get("rms", 0.0) + tol.rms
        f_max = mult * err_r.get("max_abs", 0.0) + tol.max
        raw = max(fl._div(err_t.get("rms", 0.0), f_rms), fl._div(err_t.get("max_abs", 0.0), f_max))
        return {"ratio": limit * raw, "floor": f_rms, "m": mult, "err_target": err_t.get("rms"),
                "err_reference": err_r.get("rms"), "truth_key": te["key"]}

    # -- the whole comparison ---------------------------------------------------------------------
    def run(self) -> Report:
        self._check_runs()
        ref_entries = sorted(self.ref.entries, key=_order_key)
        self.ref_index = _Index(ref_entries, self.ref.manifest.get("tied_params"))
        ref_map = {_align(e): e for e in ref_entries}
        # Local-replay captures (slot local.*) stand beside the entry they replay; they are not
        # aligned with the reference on their own.
        self.local_map = {(e["step"], e["phase"], e["module"], e["call"], base_slot(e["slot"])): e
                          for e in self.tgt.entries if is_local_slot(e["slot"])}
        tgt_map = {_align(e): e for e in self.tgt.entries if not is_local_slot(e["slot"])}
        self.tgt_map = tgt_map
        self.truth_map = {_align(e): e for e in self.truth.entries} if self.truth is not None else {}
        self._alignment_findings(ref_map, tgt_map)
        self._measure_all([(r, tgt_map[_align(r)]) for r in ref_entries
                           if self.policy.judges_step(r["step"]) and _align(r) in tgt_map])
        entries: list[Entry] = []
        for r in ref_entries:
            if not self.policy.judges_step(r["step"]):
                continue
            t = tgt_map.get(_align(r))
            if t is None:
                continue  # reported as alignment.missing_in_target; inherits nothing
            entries.append(self._judge(r, t))
        self._histograms(entries)
        self._trace_findings()
        self._nonfinite_findings(entries)
        self._precision_findings()
        return self._verdict(entries)

    def _histograms(self, entries: list[Entry]) -> None:
        """Error histograms (log10 |target - reference|, measured in the metrics pass) for the
        entries a reader looks at first: the first over the limit and the worst by ratio."""
        first = next((e for e in entries if e.status in (DRIFT, NONFINITE)), None)
        judged = sorted((e for e in entries if e.ratio is not None),
                        key=lambda e: -(e.ratio if not math.isnan(e.ratio) else math.inf))
        for e in ([first] if first is not None else []) + judged[:HISTOGRAMS]:
            h = self._histograms_by_key.get(e.key)
            if h is not None and "histogram" not in e.details:
                e.details["histogram"] = {"edges": list(h.edges), "counts": list(h.counts),
                                          "exact": h.exact}

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
        self._fp8_findings()
        ref_ev = self.ref.manifest.get("view_events")
        tgt_ev = self.tgt.manifest.get("view_events")
        if ref_ev and tgt_ev:
            from driftcheck.audit import views

            self.findings.extend(views.compare_events(ref_ev, tgt_ev, _view_tolerance(self)))

    def _fp8_findings(self) -> None:
        """Summarise the target's fp8 casts (amax, scale, flushed and saturated fractions)."""
        casts = [c for c in (self.tgt.manifest.get("fp8") or []) if isinstance(c, dict)]
        if not casts:
            return
        def worst(key: str) -> dict[str, Any]:
            return max(casts, key=lambda c: c.get(key) or 0.0)
        flushed, saturated = worst("flushed_fraction"), worst("saturated_fraction")
        recipe = (self.tgt.run.get("precision") or {}).get("fp8") or self.tgt.run.get("fp8")
        self.findings.append(Finding(
            "precision.fp8_casts", "", None,
            f"{len(casts)} fp8 casts (recipe {recipe}): at most "
            f"{100 * (flushed.get('flushed_fraction') or 0):.2g}% of a tensor flushed to zero "
            f"({flushed.get('module')} {flushed.get('role')}), at most "
            f"{100 * (saturated.get('saturated_fraction') or 0):.2g}% saturated "
            f"({saturated.get('module')} {saturated.get('role')})", severity="warning",
            details={"casts": casts[:500]}))
        for c in casts:
            if (c.get("saturated_fraction") or 0) > 0:
                self.findings.append(Finding(
                    "precision.fp8_saturation", c.get("module", ""), c.get("step"),
                    f"{c.get('role')} of {c.get('module')} saturated in {c.get('format')}: "
                    f"{100 * c['saturated_fraction']:.3g}% of {c.get('numel')} values clipped at the "
                    f"format's max (scale {c.get('scale'):.3g}, amax {c.get('amax'):.3g}); delayed "
                    "scaling lags a growing amax: use current scaling or a longer margin",
                    severity="warning", details=dict(c)))

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
        diffs = [(k, a, b) for k, a, b, explains in diff_settings(rp, tp) if explains]
        if diffs:
            shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:6])
            more = f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""
            self.findings.append(Finding(
                "precision.settings_differ", "", None,
                f"{len(diffs)} precision setting(s) differ between the runs: {shown}{more}. "
                "They explain drift; the noise floor accounts for dtype, TF32, matmul precision "
                "and fp8", severity="warning",
                details={"settings": [{"setting": k, "reference": a, "target": b} for k, a, b in diffs]}))

    def _verdict(self, entries: list[Entry]) -> Report:
        failing = [e for e in entries if e.status in (DRIFT, NONFINITE, MISALIGNED)]
        # Where drift enters: the first entry whose own error is over the limit. A leaf module
        # replayed locally is blamed only if its local error is; otherwise it inherited the drift.
        first = next((e for e in entries if e.status in (DRIFT, NONFINITE) and _blamed(e)), None) \
            or next((e for e in entries if e.status in (DRIFT, NONFINITE)), None)
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
            if first.local_ratio is not None:
                fd["local_ratio"] = first.local_ratio
            fd["blame_module"] = self._blame_module(first)
        return Report(verdict=verdict, reference=self.ref.run, target=self.tgt.run,
                      first_divergence=fd, entries=entries, findings=self.findings, limit=limit,
                      decided_by=decided_by, warnings=self.warnings,
                      truth=self.truth.run if self.truth is not None else None,
                      policy=dict(self.policy.to_dict(), **({"limit_override": self.limit_override}
                                                            if self.limit_override is not None else {})))


def _blamed(e: Entry) -> bool:
    """Whether the entry's own module (not what it inherited) put it over the limit."""
    local = (e.details or {}).get("local")
    return local is None or local["status"] != OK


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
    if e.phase == "optimizer" and e.slot.startswith("buffer."):
        return f"in the buffers of {mod} after the step (they are updated by its forward)"
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


def _saturation(r: dict, t: dict) -> float | None:
    """The coarser side's largest finite value, when the reference goes beyond it."""
    limits = []
    for d in (r["dtype"], t["dtype"]):
        if _is_float(d) and not d.startswith("complex"):
            limits.append(float(torch.finfo(getattr(torch, d)).max))
    if not limits:
        return None
    lim = min(limits)
    absmax = max(abs(r["stats"].get("min") or 0.0), abs(r["stats"].get("max") or 0.0))
    return lim if absmax > 0.5 * lim else None


def _crossing(xr: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
    """Where a kink's input may have crossed zero between two runs: its sign differs, or it is
    within twice its own error of zero."""
    xr64, xt64 = xr.double(), xt.double()
    return (xr64.abs() <= 2 * (xt64 - xr64).abs()) | (torch.sign(xr64) != torch.sign(xt64))


def _acc_roundoff(dtype: str) -> float:
    return 2.0**-53 if dtype == "float64" else 2.0**-24


def _tiny(dtype: str) -> float:
    try:
        return float(torch.finfo(getattr(torch, dtype)).tiny) if _is_float(dtype) and not dtype.startswith("complex") else 0.0
    except (TypeError, AttributeError):
        return 0.0


def _matmul_roundoff(run: dict[str, Any], dtype: str, phase: str, kind: str | None) -> float:
    settings = run.get("precision") or {}
    op = {"linear": "linear", "conv": "conv"}.get(kind or "", "matmul")
    try:
        from driftcheck.precision import effective_matmul_roundoff

        return effective_matmul_roundoff(settings, dtype, phase=phase, op=op)
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

"""compare(): align two traces, measure each tensor pair against its noise floor, give a verdict.

Entries align by their semantic key (step, phase, module, call, slot). Tensors are read one pair
at a time through memory-mapped shards, so memory is bounded by the largest pair. Each entry's
floor inherits the relative error of the entries it depends on (``dependencies``), so the first
entry over the limit, in execution order, is where drift *enters*.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from driftcheck.compare.decisions import Decisions
from driftcheck.compare.entries import entries_of
from driftcheck.compare.findings import Findings
from driftcheck.compare.index import DependencyIndex
from driftcheck.compare.inheritance import Inheritance
from driftcheck.compare.judge import Judging
from driftcheck.compare.kinks import Kinks
from driftcheck.compare.magnitude import Magnitudes
from driftcheck.compare.measure import Measured, Measuring
from driftcheck.compare.norms import Norms
from driftcheck.compare.propagation import Propagated
from driftcheck.compare.scale import Scales
from driftcheck.compare.verdict import Verdict
from driftcheck.errors import DriftcheckError
from driftcheck.gate.policy import Policy
from driftcheck.gate.report import IGNORED, Entry, Finding, Report
from driftcheck.numerics import metrics as mx
from driftcheck.store import format as fmt
from driftcheck.store.format import base_slot, is_local_slot
from driftcheck.store.reader import TraceReader

__all__ = ["Comparison", "compare"]


class Comparison(Judging, Inheritance, Decisions, Kinks, Scales, Magnitudes, Norms, Measuring, Findings, Verdict):
    """One comparison of a target trace against a reference (optionally a float64 truth)."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, *, policy: Policy | None = None,
                 limit: float | None = None, truth: TraceReader | None = None,
                 chunk_elems: int = 1 << 17, workers: int | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 whole: dict[tuple, tuple[float, float]] | None = None) -> None:
        self.ref, self.tgt, self.truth = ref, tgt, truth
        # align key -> (rel rms, rel max) of the whole tensor this rank holds a shard of (FSDP):
        # what its dependents inherit (driftcheck/compare/ranks.py measures it over the ranks)
        self.whole = whole or {}
        self.on_progress = on_progress  # (done, total): pairs measured, then entries judged
        self._done, self._total = 0, 0
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        self._measured: dict[tuple, Measured] = {}
        self._histograms_by_key: dict[str, mx.ErrorHistogram] = {}
        self.policy = policy or Policy.default()
        self.limit_override = limit
        self.chunk_elems = chunk_elems
        self.findings: list[Finding] = []
        self.warnings: list[str] = []
        self.errors: dict[tuple, Propagated] = {}  # align key -> what later entries inherit
        self._floors: dict[tuple, tuple[float, float]] = {}  # optimizer entries: (rms, max) floor
        # step -> (key, module it routes within) of computed indices that flipped, legitimately
        self._flipped: dict[int, list[tuple[str, str]]] = {}
        self._flip_share: dict[tuple, float] = {}  # align key -> share of an index tensor that flipped
        self._rerouted_by: dict[str, Finding] = {}  # flipped decision -> its alignment.rerouted
        self.ref_entries, self.tgt_entries = entries_of(ref), entries_of(tgt)
        self.truth_entries = entries_of(truth) if truth is not None else []

    # -- alignment -----------------------------------------------------------------------------
    def _check_runs(self) -> None:
        rs, ts = self.ref.run.get("steps"), self.tgt.run.get("steps")
        if rs != ts:
            raise DriftcheckError(
                f"the reference has {rs} step(s) and the target {ts}: record both with the same "
                "--steps (the target with --replay REF)")
        ref_keys = {e.align for e in self.ref_entries}
        tgt_keys = {e.align for e in self.tgt_entries}
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
        tgt_by_key = {e.align: e for e in self.tgt_entries if e.phase == "params"}
        bad = [(e, tgt_by_key[e.align]) for e in self.ref_entries if e.phase == "params"
               and e.align in tgt_by_key and list(e.shape) != list(tgt_by_key[e.align].shape)]
        if bad:
            r, t = bad[0]
            raise DriftcheckError(
                f"the traces were recorded from different model configurations: {len(bad)} "
                f"parameter/buffer shape(s) differ (e.g. {r.module or '(model)'} {r.slot}: "
                f"reference {r.shape}, target {t.shape}); re-record the reference (or the "
                "golden trace) and the target with the same MODEL and settings")
        if self.ref.run.get("replay_id") and self.tgt.run.get("replay_id") \
                and self.ref.run["replay_id"] != self.tgt.run["replay_id"]:
            self.warnings.append("the target was not recorded from this reference's replay "
                                 "(different replay_id): weights and inputs may differ")

    def run(self) -> Report:
        self._check_runs()
        self.policy.check_traces({e.module for e in self.ref_entries}, {e.step for e in self.ref_entries})
        ref_entries = sorted(self.ref_entries, key=lambda e: (e.step, fmt.PHASE_RANK[e.phase], e.order))
        self.ref_index = DependencyIndex(ref_entries, self.ref.manifest.get("tied_params"))
        ref_map = {e.align: e for e in ref_entries}
        # Local-replay captures (slot local.*) stand beside the entry they replay; they are not
        # aligned with the reference on their own.
        self.local_map = {(e.step, e.phase, e.module, e.call, base_slot(e.slot)): e
                          for e in self.tgt_entries if is_local_slot(e.slot)}
        tgt_map = {e.align: e for e in self.tgt_entries if not is_local_slot(e.slot)}
        self.tgt_map = tgt_map
        self.truth_map = {e.align: e for e in self.truth_entries} if self.truth is not None else {}
        self._alignment_findings(ref_map, tgt_map)
        pairs = [(r, tgt_map[r.align]) for r in ref_entries
                 if self.policy.judges_step(r.step) and r.align in tgt_map]
        self._done, self._total = 0, 2 * len(pairs)
        self._measure_all(pairs)
        self._done = len(pairs)
        entries: list[Entry] = []
        for r in ref_entries:
            if not self.policy.judges_step(r.step):
                continue
            t = tgt_map.get(r.align)
            if t is None:
                continue  # reported as alignment.missing_in_target; inherits nothing
            entries.append(self._judge(r, t))
            self.tick()
        if not entries:
            raise DriftcheckError(self._why_nothing_judged())
        judged = sum(e.status != IGNORED for e in entries)
        if judged < self.policy.min_entries:
            raise DriftcheckError(f"the gate judged {judged} entr{'y' if judged == 1 else 'ies'} (ignore rules "
                                  f"took {len(entries) - judged}), fewer than the policy's min_entries "
                                  f"{self.policy.min_entries}: a verdict on so little is no gate; widen "
                                  "what is recorded or judged, or lower min_entries")
        self._histograms(entries)
        self._trace_findings()
        self._nonfinite_findings(entries)
        self._precision_findings()
        report = self._verdict(entries)
        from driftcheck.gate.signatures import attach

        attach(report)  # the known defects its findings show (the drill adds the op-level ones)
        return report

    def tick(self) -> None:
        """One more pair measured or entry judged: tell ``on_progress``."""
        self._done += 1
        if self.on_progress is not None:
            self.on_progress(min(self._done, self._total), self._total)

    def _why_nothing_judged(self) -> str:
        # (a policy's steps outside the traces were refused by check_traces already)
        if not self.ref_entries:
            return (f"nothing to judge: the reference {self.ref.dir} holds no entry; re-record it "
                    "with wider --phases/--include")
        return ("nothing to judge: no entry of the reference exists in the target; record the "
                "target with --replay REF and the same MODEL and options")


def compare(ref: str | TraceReader, target: str | TraceReader, *, policy: Policy | None = None,
            limit: float | None = None, truth: str | TraceReader | None = None,
            on_progress: Callable[[int, int], None] | None = None,
            whole: dict[tuple, tuple[float, float]] | None = None) -> Report:
    """Compare a target trace against a reference trace.

    Args:
        ref, target: trace directories (or open readers).
        policy: the gate policy (default: Policy.default()).
        limit: overrides every ratio limit of the policy.
        truth: a float64 record of the same replay (three-way comparison).
        on_progress: called with (done, total) as pairs are measured and entries judged.
        whole: for a rank of a sharded run, the relative error (rms, max) of each whole tensor
            this rank records a shard of, by align key (compare_ranks measures it).

    Returns:
        The Report; ``bool(report)`` is True when it passed.
    """
    r = ref if isinstance(ref, TraceReader) else TraceReader(ref)
    t = target if isinstance(target, TraceReader) else TraceReader(target)
    tr = truth if truth is None or isinstance(truth, TraceReader) else TraceReader(truth)
    return Comparison(r, t, policy=policy, limit=limit, truth=tr, on_progress=on_progress,
                      whole=whole).run()

"""compare(): align two traces, measure each tensor pair against its noise floor, give a verdict.

Entries align by their semantic key (step, phase, module, call, slot). Tensors are read one pair
at a time through memory-mapped shards, so memory is bounded by the largest pair. Each entry's
floor inherits the relative error of the entries it depends on (``dependencies``), so the first
entry over the limit, in execution order, is where drift *enters*.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from driftcheck.compare.alignment import Alignment, check_control, check_runs
from driftcheck.compare.allowances import Allowances
from driftcheck.compare.decisions import Decisions
from driftcheck.compare.entries import entries_of
from driftcheck.compare.findings import FindingLog, Findings
from driftcheck.compare.inheritance import Inheritance
from driftcheck.compare.judge import Judge
from driftcheck.compare.kinks import Kinks
from driftcheck.compare.magnitude import Magnitudes
from driftcheck.compare.measure import Measurer, Progress
from driftcheck.compare.norms import Norms
from driftcheck.compare.opinions import Opinions
from driftcheck.compare.products import Products
from driftcheck.compare.propagation import Ledger
from driftcheck.compare.roundoff import Roundoff
from driftcheck.compare.scale import Scales
from driftcheck.compare.slices import Slices
from driftcheck.compare.verdict import Verdict, attach_histograms
from driftcheck.errors import DriftcheckError
from driftcheck.gate.policy import Policy
from driftcheck.gate.report import IGNORED, Entry, Report
from driftcheck.gate.signatures import attach
from driftcheck.store.keys import TraceKey
from driftcheck.store.reader import TraceReader

__all__ = ["Comparison", "compare"]

Whole = Mapping[TraceKey, tuple[float, float]]  # align key -> (rel rms, rel max) of a whole tensor


class Comparison:
    """One comparison of a target trace against a reference (optionally a float64 truth): checks
    the runs, aligns them, measures every pair, judges the entries in order, gives the verdict."""

    def __init__(self, ref: TraceReader, tgt: TraceReader, *, policy: Policy | None = None,
                 limit: float | None = None, truth: TraceReader | None = None,
                 chunk_elems: int = 1 << 17, workers: int | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 whole: Whole | None = None, control: TraceReader | None = None) -> None:
        self.ref, self.tgt, self.truth, self.control = ref, tgt, truth, control
        # align key -> (rel rms, rel max) of the whole tensor this rank holds a shard of (FSDP):
        # what its dependents inherit (driftcheck/compare/ranks.py measures it over the ranks)
        self.whole = whole or {}
        self.policy = policy or Policy.default()
        self.limit_override = limit
        self.progress = Progress(on_progress)  # (done, total): pairs measured, then entries judged
        self.measurer = Measurer(ref, tgt, chunk_elems=chunk_elems, progress=self.progress,
                                 workers=workers if workers is not None else min(2, os.cpu_count() or 1))
        self.ledger = Ledger()
        self.findings = FindingLog()
        self.warnings: list[str] = []
        self.ref_entries, self.tgt_entries = entries_of(ref), entries_of(tgt)
        self.truth_entries = entries_of(truth) if truth is not None else []
        self.control_entries = entries_of(control) if control is not None else []

    def run(self) -> Report:
        self.warnings += check_runs(self.ref, self.tgt, self.ref_entries, self.tgt_entries)
        if self.control is not None:
            check_control(self.tgt.run, self.control.run)
            self.warnings += [f"control: {w}" for w in check_runs(
                self.ref, self.control, self.ref_entries, self.control_entries)]
        self.policy.check_traces({e.module for e in self.ref_entries}, {e.step for e in self.ref_entries})
        alignment = Alignment.of(self.ref_entries, self.tgt_entries, self.truth_entries,
                                 self.ref.manifest.get("tied_params"), self.control_entries)
        findings = Findings(self.ref, self.tgt, self.findings, self.control)
        findings.alignment(alignment.ref_map, alignment.tgt_map)
        tgt_map = alignment.tgt_map
        pairs = [(r, tgt_map[r.align]) for r in alignment.ref_entries
                 if self.policy.judges_step(r.step) and r.align in tgt_map]
        self.progress.start(2 * len(pairs))
        self.measurer.measure_all(pairs)
        self.progress.done = len(pairs)
        judge = self.build_judge(alignment)
        entries = self.judge_all(judge, alignment)
        attach_histograms(entries, judge.histograms)
        findings.of_traces(self.ledger.errors)
        findings.layout()
        findings.nonfinite(entries)
        findings.precision()
        verdict = Verdict(self.policy, self.limit_override, alignment.index)
        findings.model_sensitivity(entries, self.control, verdict.blame_module)
        report = verdict.report(entries, self.findings.items, self.warnings,
                                (self.ref.run, self.tgt.run, self.truth.run if self.truth is not None else None))
        report.control = self.control.run if self.control is not None else None
        attach(report)  # the known defects its findings show (the drill adds the op-level ones)
        return report

    def build_judge(self, alignment: Alignment) -> Judge:
        """The judge of this comparison, and the parts it judges with, wired."""
        index, tgt_map, ledger, findings = alignment.index, alignment.tgt_map, self.ledger, self.findings
        roundoff = Roundoff(index, tgt_map, self.ref.run, self.tgt.run)
        magnitudes = Magnitudes(index, self.ref_entries, ledger)
        norms = Norms(index, self.ref, self.tgt, tgt_map)
        kinks = Kinks(index, self.ref, self.tgt, tgt_map, ledger)
        decisions = Decisions(index, self.ref, ledger, findings)
        scales = Scales(self.ref, self.tgt, index, tgt_map, self.ref_entries, ledger, findings, magnitudes, roundoff)
        products = Products(index, self.ref, self.tgt, tgt_map)
        return Judge(policy=self.policy, limit_override=self.limit_override, alignment=alignment,
                     ledger=ledger, findings=findings, measurer=self.measurer, roundoff=roundoff,
                     magnitudes=magnitudes, norms=norms, kinks=kinks, decisions=decisions, scales=scales,
                     inheritance=Inheritance(index, norms, Slices(self.ref)),
                     allowances=Allowances(index, ledger, scales, magnitudes, decisions),
                     opinions=Opinions(self.measurer, kinks, alignment.local_map, alignment.truth_map, self.truth,
                                       index=alignment.index, tgt_map=tgt_map, control=self.control,
                                       control_map=alignment.control_map,
                                       control_local_map=alignment.control_local_map, products=products),
                     whole=self.whole, products=products)

    def judge_all(self, judge: Judge, alignment: Alignment) -> list[Entry]:
        """Every entry of a judged step that both runs hold, in execution order."""
        entries: list[Entry] = []
        for r in alignment.ref_entries:
            if not self.policy.judges_step(r.step):
                continue
            t = alignment.tgt_map.get(r.align)
            if t is None:
                continue  # reported as alignment.missing_in_target; inherits nothing
            entries.append(judge.judge(r, t))
            self.progress.tick()
        if not entries:
            raise DriftcheckError(self._why_nothing_judged())
        judged = sum(e.status != IGNORED for e in entries)
        if judged < self.policy.min_entries:
            raise DriftcheckError(f"the gate judged {judged} entr{'y' if judged == 1 else 'ies'} (ignore rules "
                                  f"took {len(entries) - judged}), fewer than the policy's min_entries "
                                  f"{self.policy.min_entries}: a verdict on so little is no gate; widen "
                                  "what is recorded or judged, or lower min_entries")
        return entries

    def _why_nothing_judged(self) -> str:
        # (a policy's steps outside the traces were refused by check_traces already)
        if not self.ref_entries:
            return (f"nothing to judge: the reference {self.ref.where} holds no entry; re-record it "
                    "with wider --phases/--include")
        return ("nothing to judge: no entry of the reference exists in the target; record the "
                "target with --replay REF and the same MODEL and options")


def compare(ref: str | TraceReader, target: str | TraceReader, *, policy: Policy | None = None,
            limit: float | None = None, truth: str | TraceReader | None = None,
            on_progress: Callable[[int, int], None] | None = None,
            whole: Whole | None = None, control: str | TraceReader | None = None) -> Report:
    """Compare a target trace against a reference trace.

    Args:
        ref, target: trace directories (or open readers).
        policy: the gate policy (default: Policy.default()).
        limit: overrides every ratio limit of the policy.
        truth: a float64 record of the same replay (three-way comparison).
        on_progress: called with (done, total) as pairs are measured and entries judged.
        whole: for a rank of a sharded run, the relative error (rms, max) of each whole tensor
            this rank records a shard of, by align key (compare_ranks measures it).
        control: a control run of the same replay, the reference device at the target's
            precision (``driftcheck run`` records it when the verdict would fail): an entry
            fails only when the analytic floor and the control both say so.

    Returns:
        The Report; ``bool(report)`` is True when it passed.
    """
    r = ref if isinstance(ref, TraceReader) else TraceReader(ref)
    t = target if isinstance(target, TraceReader) else TraceReader(target)
    tr = truth if truth is None or isinstance(truth, TraceReader) else TraceReader(truth)
    cr = control if control is None or isinstance(control, TraceReader) else TraceReader(control)
    return Comparison(r, t, policy=policy, limit=limit, truth=tr, on_progress=on_progress,
                      whole=whole, control=cr).run()

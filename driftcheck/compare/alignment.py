"""Alignment: the two runs' entries matched by their semantic key, after checking that the
traces describe the same model and the same steps."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from driftcheck.compare.entries import TraceEntry
from driftcheck.compare.index import DependencyIndex
from driftcheck.errors import DriftcheckError
from driftcheck.store import format as fmt
from driftcheck.store.keys import TraceKey, base_slot, is_local_slot
from driftcheck.store.reader import TraceReader


@dataclasses.dataclass
class Alignment:
    """The reference's entries in execution order, their dependency index, and the other runs'
    entries by the reference key they align with."""

    ref_entries: list[TraceEntry]  # (step, phase, execution order)
    index: DependencyIndex
    ref_map: dict[TraceKey, TraceEntry]
    tgt_map: dict[TraceKey, TraceEntry]  # the target's own entries (not its local replays)
    local_map: dict[TraceKey, TraceEntry]  # a local replay (slot local.*) by the entry it replays
    truth_map: dict[TraceKey, TraceEntry]
    # the control run (the reference device at the target's precision): its entries and its
    # local replays, as the target's
    control_map: dict[TraceKey, TraceEntry] = dataclasses.field(default_factory=dict)
    control_local_map: dict[TraceKey, TraceEntry] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, ref: list[TraceEntry], tgt: list[TraceEntry], truth: list[TraceEntry],
           tied: list[dict[str, str]] | None = None, control: Sequence[TraceEntry] = ()) -> Alignment:
        ref_entries = sorted(ref, key=lambda e: (e.step, fmt.PHASE_RANK[e.phase], e.order))
        # Local-replay captures (slot local.*) stand beside the entry they replay; they are not
        # aligned with the reference on their own.
        return cls(ref_entries, DependencyIndex(ref_entries, tied), {e.align: e for e in ref_entries},
                   {e.align: e for e in tgt if not is_local_slot(e.slot)},
                   {e.align.with_slot(base_slot(e.slot)): e for e in tgt if is_local_slot(e.slot)},
                   {e.align: e for e in truth},
                   {e.align: e for e in control if not is_local_slot(e.slot)},
                   {e.align.with_slot(base_slot(e.slot)): e for e in control if is_local_slot(e.slot)})


def check_runs(ref: TraceReader, tgt: TraceReader, ref_entries: list[TraceEntry],
               tgt_entries: list[TraceEntry]) -> list[str]:
    """Refuse traces that cannot be compared (other steps, another model, other shapes); the
    warnings about traces that can be, but should not have been."""
    rs, ts = ref.run.get("steps"), tgt.run.get("steps")
    if rs != ts:
        raise DriftcheckError(
            f"the reference has {rs} step(s) and the target {ts}: record both with the same "
            "--steps (the target with --replay REF)")
    ref_keys = {e.align for e in ref_entries}
    tgt_keys = {e.align for e in tgt_entries}
    if ref_keys and len(ref_keys & tgt_keys) < 0.5 * len(ref_keys):
        ref_mods = {k.module for k in ref_keys} - {k.module for k in tgt_keys}
        tgt_mods = {k.module for k in tgt_keys} - {k.module for k in ref_keys}
        raise DriftcheckError(
            f"the traces do not describe the same model: only {len(ref_keys & tgt_keys)} of "
            f"{len(ref_keys)} reference keys exist in the target (reference model "
            f"{ref.run.get('model_id')!r}, target {tgt.run.get('model_id')!r}; "
            f"modules only in the reference: {sorted(ref_mods)[:4]}, only in the target: "
            f"{sorted(tgt_mods)[:4]}); record the target with --replay REF and the same MODEL")
    _check_shapes(ref_entries, tgt_entries)
    return _replay_warnings(ref.run, tgt.run)


def _check_shapes(ref_entries: list[TraceEntry], tgt_entries: list[TraceEntry]) -> None:
    # The model's own state before the first step is the model configuration: if its shapes
    # differ, the traces are of different models, not a target that drifted.
    tgt_by_key = {e.align: e for e in tgt_entries if e.phase == "params"}
    bad = [(e, tgt_by_key[e.align]) for e in ref_entries if e.phase == "params"
           and e.align in tgt_by_key and list(e.shape) != list(tgt_by_key[e.align].shape)]
    if bad:
        r, t = bad[0]
        raise DriftcheckError(
            f"the traces were recorded from different model configurations: {len(bad)} "
            f"parameter/buffer shape(s) differ (e.g. {r.module or '(model)'} {r.slot}: "
            f"reference {r.shape}, target {t.shape}); re-record the reference (or the "
            "golden trace) and the target with the same MODEL and settings")


def _replay_warnings(ref_run: dict[str, Any], tgt_run: dict[str, Any]) -> list[str]:
    if ref_run.get("replay_id") and tgt_run.get("replay_id") and ref_run["replay_id"] != tgt_run["replay_id"]:
        return ["the target was not recorded from this reference's replay "
                "(different replay_id): weights and inputs may differ"]
    return []


def check_control(tgt_run: dict[str, Any], ctl_run: dict[str, Any]) -> None:
    """Refuse a control run of another precision than the target's (dtype, autocast, fp8): it
    would bound the target's drift by a drift of another size."""
    def precision(run: dict[str, Any]) -> tuple[Any, ...]:
        p = run.get("precision") or {}
        return tuple(run.get(k, p.get(k)) for k in ("dtype", "autocast", "fp8"))

    def words(p: tuple[Any, ...]) -> str:
        return ", ".join(f"{k} {v}" for k, v in zip(("dtype", "autocast", "fp8"), p) if v)

    t, c = precision(tgt_run), precision(ctl_run)
    if t != c:
        raise DriftcheckError(f"--control was recorded at {words(c)}, the target at {words(t)}: a control "
                              "runs at the target's precision (driftcheck run records one; or record the "
                              "reference device with the target's --dtype/--autocast/--fp8 and --replay REF)")

"""Rank-by-rank compare of two multi-rank run directories (``OUT/rank-<r>``, one trace per rank):
one Report for all ranks."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from driftcheck.errors import DriftcheckError
from driftcheck.gate.report import Report
from driftcheck.store import format as fmt
from driftcheck.store.keys import TraceKey
from driftcheck.store.layout import complete_ranks, rank_dir, rank_dirs


def compare_ranks(ref: str | os.PathLike, target: str | os.PathLike, **kwargs: Any) -> Any:
    """Compare two multi-rank run directories rank by rank; one Report for all of them.

    Entries and findings carry their rank (``details["rank"]``, keys prefixed ``rank<r>:``); the
    verdict fails when any rank fails; the first divergence is the earliest over all ranks
    (step, phase, execution order); ``decided_by`` gives each rank's verdict. A single trace
    against a multi-rank run directory, and runs of different ranks or of DDP and FSDP2, are
    compared as one logical trace each (compare/layouts.py).
    """
    from driftcheck.compare import compare

    refs, tgts = complete_ranks(ref), complete_ranks(target)
    if different_layouts(ref, target):  # judged as one logical tensor per entry
        from driftcheck.compare.layouts import compare_layouts

        return compare_layouts(ref, target, **kwargs)
    if not refs or not tgts:
        which = ref if not refs else target
        raise DriftcheckError(f"{which} is not a multi-rank run directory (rank-0, rank-1, ... "
                              "inside); compare single traces directly")
    if set(refs) != set(tgts):
        raise DriftcheckError(f"the reference has ranks {sorted(refs)} and the target {sorted(tgts)}: "
                              "record both with the same --nproc_per_node")
    truth = kwargs.pop("truth", None)
    whole = whole_errors(refs, tgts)
    reports = {}
    for r in refs:
        t = rank_dir(truth, r) if truth else None
        reports[r] = compare(str(refs[r]), str(tgts[r]), truth=str(t) if t else None,
                             whole=whole, **kwargs)
    entries, findings, warnings = [], [], []
    firsts = []
    for r, rep in reports.items():
        for e in rep.entries:
            e.key = f"rank{r}:{e.key}"
            e.details = dict(e.details or {}, rank=r)
            entries.append(e)
        for f in rep.findings:
            f.message = f"[rank {r}] {f.message}"
            f.key = f"rank{r}:{f.key}" if f.key else f.key
            f.details = dict(f.details or {}, rank=r)
            findings.append(f)
        warnings += [f"[rank {r}] {w}" for w in rep.warnings]
        if rep.first_divergence:
            fd = dict(rep.first_divergence, rank=r, key=f"rank{r}:{rep.first_divergence['key']}")
            firsts.append(((fd["step"], fmt.PHASE_RANK.get(fd["phase"], 99),
                            next((e.order for e in rep.entries if e.key == fd["key"]), math.inf), r), fd))
    first = min(firsts, key=lambda x: x[0])[1] if firsts else None
    verdict = "fail" if any(not rep for rep in reports.values()) else "pass"
    decided_by = "; ".join(f"rank {r}: {rep.verdict} ({rep.decided_by})" for r, rep in reports.items())
    base = reports[min(reports)]
    ref_run = dict(base.reference, world_size=len(reports))
    tgt_run = dict(base.target, world_size=len(reports))
    return Report(verdict=verdict, reference=ref_run, target=tgt_run, first_divergence=first,
                  entries=entries, findings=findings, limit=base.limit, decided_by=decided_by,
                  warnings=warnings, truth=base.truth, policy=base.policy)


def different_layouts(ref: str | os.PathLike, target: str | os.PathLike) -> bool:
    """A single trace and a multi-rank run directory, or two multi-rank runs of different ranks
    or different ``parallel`` (DDP, FSDP2)."""
    from driftcheck.store.reader import TraceReader

    refs, tgts = rank_dirs(ref), rank_dirs(target)
    if not refs and not tgts:
        return False
    if bool(refs) != bool(tgts):  # the other side must be a trace directory, or say why not
        return bool(refs or Path(ref).is_dir()) and bool(tgts or Path(target).is_dir())
    if set(refs) != set(tgts):
        return True
    runs = [TraceReader(d[min(d)]).run for d in (refs, tgts)]
    meshes = [(r.get("tensor_parallel") or {}).get("mesh") for r in runs]  # fsdp-tp's --tp-size
    return runs[0].get("parallel") != runs[1].get("parallel") or meshes[0] != meshes[1]


def whole_errors(refs: dict[int, Any], tgts: dict[int, Any]) -> dict[TraceKey, tuple[float, float]]:
    """(rel rms, rel max) of every whole tensor the ranks record shards of (FSDP parameters,
    gradients, optimizer state: meta ``shard``), by align key: the error of the tensor a module
    computes with. One rank's shard alone can miss it: the rows another rank updates may carry
    all of it. Full-mode entries only (stats mode stores no tensor to measure)."""
    import torch

    from driftcheck.compare.entries import entries_of
    from driftcheck.store.reader import TraceReader

    sums: dict[TraceKey, list[float]] = {}  # align -> [sum d^2, sum r^2, max |d|, max |r|]
    for rank in refs:
        ref, tgt = TraceReader(refs[rank]), TraceReader(tgts[rank])
        tgt_by = {e.align: e for e in entries_of(tgt)}
        for e in entries_of(ref):
            t = tgt_by.get(e.align)
            if not e.meta.get("shard") or t is None or not (e.has_tensor and t.has_tensor):
                continue
            a, b = ref.tensor(e.raw), tgt.tensor(t.raw)
            if a is None or b is None or a.shape != b.shape or not a.is_floating_point():
                continue
            a, b = a.double(), b.double()
            d = (b - a)[torch.isfinite(b - a)]
            acc = sums.setdefault(e.align, [0.0, 0.0, 0.0, 0.0])
            acc[0] += float(d.pow(2).sum())
            acc[1] += float(a.pow(2).sum())
            acc[2] = max(acc[2], float(d.abs().max()) if d.numel() else 0.0)
            acc[3] = max(acc[3], float(a.abs().max()) if a.numel() else 0.0)
    return {k: (math.sqrt(d2 / r2), dmax / rmax) for k, (d2, r2, dmax, rmax) in sums.items()
            if r2 > 0 and rmax > 0}

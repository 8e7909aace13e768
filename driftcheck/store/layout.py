"""Directories that hold traces: a multi-rank run (``rank-<r>`` per rank) and a ``driftcheck run``
directory (reference, target, truth and the reports)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from driftcheck.errors import DriftcheckError
from driftcheck.store import format as fmt
from driftcheck.store.remote import is_url

RANK_DIR = re.compile(r"^rank-(\d+)$")

# driftcheck run OUT: one trace per side, the reports beside them.
REFERENCE, TARGET, TRUTH = "reference", "target", "truth"
REPORT_JSON, REPORT_HTML = "report.json", "report.html"
# driftcheck run --long OUT: also the control, the long report and the first bad step in full
CONTROL, LONG_REPORT_JSON, LONG_REPORT_HTML, FIRST_BAD = ("control", "long-report.json",
                                                          "long-report.html", "first-bad")
# driftcheck run OUT/drill, driftcheck drill: the drill-down's ops and the repro
DRILL = "drill"
RUN_CONTENTS = frozenset({REFERENCE, TARGET, TRUTH, REPORT_JSON, REPORT_HTML, CONTROL,
                          LONG_REPORT_JSON, LONG_REPORT_HTML, FIRST_BAD, DRILL})


def rank_dir(out: str | os.PathLike, rank: int) -> Path:
    """The trace directory of ``rank`` inside a multi-rank run directory (a local one: the
    ranks' traces are never written to or read from a URL)."""
    if is_url(out):
        raise DriftcheckError(f"{out}: a multi-rank run (one trace per rank) is a local directory; "
                              "record it locally and copy it to the bucket")
    return Path(out) / f"rank-{rank}"


def rank_dirs(run_dir: str | os.PathLike) -> dict[int, Path]:
    """{rank: trace directory} of a multi-rank run directory; empty for a single trace."""
    p = Path(run_dir)
    if not p.is_dir() or (p / fmt.MANIFEST).exists():
        return {}
    found = {int(m.group(1)): c for c in p.iterdir()
             if c.is_dir() and not c.is_symlink() and (m := RANK_DIR.match(c.name))}
    return dict(sorted(found.items()))


def complete_ranks(run_dir: str | os.PathLike) -> dict[int, Path]:
    """``rank_dirs``, checked to be a whole run: ranks 0 to N-1, N the ``world_size`` their
    manifests say.

    Raises:
        DriftcheckError: one line naming the missing rank (or the rank whose record did not
            finish)."""
    dirs = rank_dirs(run_dir)
    if not dirs:
        return dirs
    worlds = set()
    for r, d in dirs.items():
        try:
            run = json.loads((d / fmt.MANIFEST).read_text()).get("run") or {}
        except (OSError, ValueError, AttributeError):
            raise DriftcheckError(f"{d} holds no readable manifest: rank {r}'s record did not finish "
                                  "(or its trace is corrupt); record the run again") from None
        if isinstance(run, dict) and isinstance(run.get("world_size"), int):
            worlds.add(run["world_size"])
    world = max([*worlds, max(dirs) + 1])
    missing = [r for r in range(world) if r not in dirs]
    if missing:
        raise DriftcheckError(f"{run_dir}: rank-{missing[0]} is missing (the run had {world} ranks, "
                              f"the directory holds {', '.join(f'rank-{r}' for r in dirs)}); "
                              "copy the whole run directory, or record it again")
    return dirs


def is_multirank(run_dir: str | os.PathLike) -> bool:
    return bool(rank_dirs(run_dir))

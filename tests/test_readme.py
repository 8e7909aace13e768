"""The README's promises: its first command runs (twice), its second is what CI runs, what the
first writes is ignored by git, and every file it links to exists."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _first_block() -> list[str]:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_second_command_is_what_ci_runs() -> None:
    lines = _first_block()
    assert len(lines) == 2
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == lines[1] == "python -m pytest -q"


def test_first_command_runs_twice_and_leaves_nothing_tracked(tmp_path) -> None:
    install, _, job = _first_block()[0].partition(" && ")
    assert install.startswith("pip install") and job.startswith("driftcheck run ")
    args = shlex.split(job)[1:]
    for attempt in (1, 2):  # the README's line can be run again
        proc = subprocess.run([sys.executable, "-m", "driftcheck", "--quiet", *args], cwd=tmp_path,
                              capture_output=True, text=True, env={**__import__("os").environ,
                                                                   "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
        assert proc.returncode == 0, (attempt, proc.stderr)
        assert proc.stdout.startswith("PASS The target matches the reference")
    out = args[args.index("--out") + 1]
    assert (tmp_path / out / "report.html").exists() and (tmp_path / out / "report.json").exists()
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/report.html"], cwd=ROOT)
    assert ignored.returncode == 0, f"{out}/ is not ignored by git"


def test_links_point_at_files_that_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target

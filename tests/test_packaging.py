"""The wheel holds the whole package: every subpackage is listed in pyproject.toml (an editable
install imports from the checkout and would not notice one missing; a wheel would: it lacked
driftcheck.drill, so `driftcheck run` failed where a verdict is drilled)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_and_data_directory_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    package = ROOT / "driftcheck"
    found = {"driftcheck"} | {
        "driftcheck." + ".".join(d.relative_to(package).parts) for d in package.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.iterdir())}
    assert found - listed == set(), f"not in pyproject.toml's packages: {sorted(found - listed)}"

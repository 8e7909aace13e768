"""The probe suite's results as a terminal table (rich)."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

_STYLE = {"pass": "green", "mismatch": "red", "error": "yellow"}


def render_probe(results: list[Any], console: Console, device: str, reference: str = "cpu") -> None:
    """One row per program (status coloured), then the count that passed."""
    table = Table(title=f"driftcheck probe: {device} vs {reference}")
    for column in ("program", "status", "detail"):
        table.add_column(column)
    for r in results:
        table.add_row(r.name, f"[{_STYLE[r.status]}]{r.status}[/]", r.detail)
    console.print(table)
    console.print(f"{sum(bool(r) for r in results)}/{len(results)} programs pass")

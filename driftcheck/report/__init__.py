"""Renderers of a report (gate/report.py): terminal, HTML, JUnit, Markdown. They render; the
policy has judged every entry and finding before they run."""

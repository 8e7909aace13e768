"""The driftcheck gate inside a user's own test suite (a pytest plugin, entry point ``pytest11``).

    def test_llama_on_the_target(driftcheck_gate):
        driftcheck_gate.check("my_pkg.models:build_llama", name="llama")

    pytest --driftcheck-record-golden                    # once, on the reference machine
    pytest --driftcheck-device tpu --driftcheck-dtype bf16   # every run on the target

``check(MODEL)`` takes what ``driftcheck record`` takes (a built-in name, ``hf:<family>``,
``file.py:build``, ``package.module:build``) or a :class:`driftcheck.Scenario`. It records the
target replaying the golden trace ``GOLDEN/<name>`` (weights, inputs and dropout masks), compares
it under the project's policy (``driftcheck.toml`` or ``[tool.driftcheck]`` in the rootdir) and
fails the test with the verdict line. The report (``report.html``, ``junit.xml``,
``summary.md``, ``report.json``) and the target trace go to ``OUT/<test>/<name>/``: OUT is
``--driftcheck-out``, else ``driftcheck/`` beside ``--junitxml``'s file, else
``<rootdir>/driftcheck-results``. The test's JUnit record carries the report's path as the
property ``driftcheck_report``.

Options (``driftcheck_golden`` / ``driftcheck_device`` / ``driftcheck_dtype`` also as ini keys):
``--driftcheck-golden DIR`` (default ``golden``), ``--driftcheck-device``, ``--driftcheck-dtype``,
``--driftcheck-autocast``, ``--driftcheck-record-golden`` (record the goldens on this machine
instead of checking, each test then ends as skipped with the golden's path;
``--driftcheck-device``/``--driftcheck-dtype`` then describe the reference),
``--driftcheck-out``. Nothing here imports torch until a test asks for the fixture.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

_OPTIONS = (
    ("golden", "DIR", "golden traces, one directory per checked model (default: golden)"),
    ("device", "DEVICE", "the device the target runs on (default: cpu)"),
    ("dtype", "DTYPE", "the target's dtype: fp32, bf16, fp16 (default: fp32)"),
    ("autocast", "DTYPE", "run the target's forward under autocast: bf16 or fp16"),
    ("out", "DIR", "where reports and target traces go"),
)


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("driftcheck", "numerical drift against golden traces")
    for key, metavar, text in _OPTIONS:
        group.addoption(f"--driftcheck-{key}", dest=f"driftcheck_{key}", metavar=metavar,
                        default=None, help=text)
    group.addoption("--driftcheck-record-golden", dest="driftcheck_record_golden",
                    action="store_true", help="record the golden traces instead of checking them")
    for key in ("golden", "device", "dtype"):
        parser.addini(f"driftcheck_{key}", f"default for --driftcheck-{key}", default=None)


def _setting(config: Any, key: str, default: str | None = None) -> str | None:
    value = config.getoption(f"driftcheck_{key}")
    if value is None and key in ("golden", "device", "dtype"):
        value = config.getini(f"driftcheck_{key}") or None
    return value if value is not None else default


class Gate:
    """What the ``driftcheck_gate`` fixture gives a test: :meth:`check`."""

    def __init__(self, request: Any) -> None:
        self.request = request
        config = request.config
        root = Path(str(config.rootpath))
        golden = Path(_setting(config, "golden", "golden") or "golden")
        self.golden = golden if golden.is_absolute() else root / golden
        self.device = _setting(config, "device", "cpu") or "cpu"
        self.dtype = _setting(config, "dtype", "fp32") or "fp32"
        self.autocast = _setting(config, "autocast")
        self.record_golden = bool(config.getoption("driftcheck_record_golden"))
        out = _setting(config, "out")
        junit = config.getoption("xmlpath", None)
        base = Path(out) if out else Path(junit).resolve().parent / "driftcheck" if junit else \
            root / "driftcheck-results"
        self.out = base / _safe(request.node.nodeid)
        self.root = root

    def check(self, model: Any, *, name: str | None = None, steps: int | None = None,
              seed: int = 0, mode: str = "full", limit: float | None = None,
              local: bool = False) -> Any:
        """Record MODEL on this run's device against its golden trace and compare.

        Args:
            model: a MODEL spec (as ``driftcheck record`` takes) or a Scenario.
            name: the golden trace's directory name (default: from the spec).
            steps, seed, mode: as for ``driftcheck record`` (a replaying target runs the
                golden's steps unless ``steps`` says otherwise).
            limit: override every ratio limit of the policy.
            local: also rerun each leaf module on the golden's inputs (``--local``).

        Returns:
            The :class:`driftcheck.report.Report` (the test has already failed if it fails;
            under ``--driftcheck-record-golden`` the test ends here, skipped).
        """
        from driftcheck.errors import DriftcheckError

        label = name or (model if isinstance(model, str) else getattr(model, "name", None))
        if not label:
            raise ValueError("check(scenario): pass name= for a Scenario without a name")
        golden = self.golden / _safe(str(label))
        try:
            return self._check(model, golden, steps=steps, seed=seed, mode=mode, limit=limit,
                               local=local)
        except DriftcheckError as e:
            pytest.fail(f"driftcheck: {e}", pytrace=False)

    def _check(self, model: Any, golden: Path, *, steps: int | None, seed: int, mode: str,
               limit: float | None, local: bool) -> Any:
        from driftcheck.compare import compare
        from driftcheck.gate.policy import Policy
        from driftcheck.loader import load_scenario
        from driftcheck.record.config import RecordConfig
        from driftcheck.record.runner import record
        from driftcheck.report.common import conclusion
        from driftcheck.report.html import render_html
        from driftcheck.report.junit import render_junit
        from driftcheck.report.markdown import render_markdown
        from driftcheck.targets import devices

        def scenario() -> Any:
            return load_scenario(model, seed) if isinstance(model, str) else model

        device = devices.open_device(self.device)
        model_id = model if isinstance(model, str) else None
        if self.record_golden:
            record(scenario(), RecordConfig(golden, device=device, dtype=self.dtype, steps=steps,
                                            seed=seed, mode="full", force=True,
                                            autocast=self.autocast, model_id=model_id))
            # The rest of the test is about the target: it does not run on the reference.
            pytest.skip(f"driftcheck: recorded the golden trace {golden}")
        if not (golden / "manifest.json").is_file():
            pytest.fail(f"driftcheck: no golden trace {golden}: record it on the reference machine "
                        "with pytest --driftcheck-record-golden (or driftcheck record MODEL --out "
                        f"{golden})", pytrace=False)
        out = self.out / golden.name
        target = out / "target"
        record(scenario(), RecordConfig(target, device=device, dtype=self.dtype, steps=steps,
                                        replay=golden, mode=mode, force=True,
                                        autocast=self.autocast, local=golden if local else None,
                                        model_id=model_id))
        report = compare(str(golden), str(target), policy=Policy.load(search_dir=str(self.root)), limit=limit)
        from driftcheck.gate.jsonform import dumps

        (out / "report.json").write_text(dumps(report.to_dict()), encoding="utf-8")
        (out / "report.html").write_text(render_html(report), encoding="utf-8")
        (out / "junit.xml").write_text(render_junit(report), encoding="utf-8")
        (out / "summary.md").write_text(render_markdown(report), encoding="utf-8")
        self.request.node.user_properties.append(("driftcheck_report", str(out / "report.html")))
        if not report:
            pytest.fail(f"driftcheck {report.verdict.upper()} {conclusion(report)} "
                        f"(report: {out / 'report.html'})", pytrace=False)
        return report


@pytest.fixture
def driftcheck_gate(request: Any) -> Gate:
    """Check a model on this run's device against its golden trace: ``driftcheck_gate.check(MODEL)``."""
    return Gate(request)


def _safe(text: str) -> str:
    """A file name from a test id or a model spec (``tests/test_x.py::test[a]`` -> ``tests_test_x.py_test_a``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "model"

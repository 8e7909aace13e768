"""The policy file: which drift ratio is too much, per module, and which findings fail the gate.

Read from ``driftcheck.toml`` or ``[tool.driftcheck]`` in ``pyproject.toml`` (first found in the
search directory), or from an explicit ``--policy FILE``. Format (docs/policy.md)::

    limit = 3.5                       # default ratio limit (drift / noise floor)
    steps = "0-3"                     # steps to judge (inclusive); or [0, 3]; default all
    fail_on = ["batchnorm", "view"]   # finding kinds (dotted prefixes or globs) that fail the gate

    [[module]]                        # overrides: the last matching rule wins
    glob = "lm_head*"                 # fnmatch on the module path
    phase = "forward"                 # optional
    limit = 8

    [[ignore]]                        # matching entries/findings are reported, never judged
    glob = "dropout*"
    kind = "nonfinite"                # optional: only findings of this kind
    phase = "backward"                # optional
    steps = "1-2"                     # optional
    reason = "dropout mask differs by design"   # required

Pure: parses text and answers questions; the only I/O is reading the policy file itself.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import os
import tomllib
from collections.abc import Iterable
from typing import Any

from driftcheck.errors import DriftcheckError
from driftcheck.gate.finding import Finding
from driftcheck.store.format import FINDING_KINDS, PHASES, kind_matches

# Measured (docs/noise-floor.md, docs/diagnosis.md): clean fp32-vs-bf16/fp16/fp8 runs and the
# no-fault controls stay below 2.3; faults of 4x the floor reach >= 4.0. 3.5 keeps both margins.
DEFAULT_LIMIT = 3.5
# Findings that fail the gate unless the policy says otherwise (severity "error" kinds);
# ``precision.*`` findings are warnings: a precision setting that differs explains drift,
# it is not a defect by itself.
DEFAULT_FAIL_ON = ("batchnorm", "view", "inplace", "nonfinite", "alignment", "compile", "alias")
FILE_NAME = "driftcheck.toml"

_TOP_KEYS = {"limit", "steps", "fail_on", "module", "overrides", "ignore", "min_entries"}
_OVERRIDE_KEYS = {"glob", "phase", "limit"}
_IGNORE_KEYS = {"glob", "kind", "phase", "steps", "reason"}


@dataclasses.dataclass(frozen=True)
class Override:
    """A per-module limit: ``glob`` (fnmatch on the module path), optional ``phase``."""

    glob: str
    limit: float
    phase: str | None = None

    def matches(self, module: str, phase: str) -> bool:
        return fnmatch.fnmatchcase(module, self.glob) and self.phase in (None, phase)


@dataclasses.dataclass(frozen=True)
class IgnoreRule:
    """Entries/findings that are shown but never judged; ``reason`` is mandatory."""

    reason: str
    glob: str = "*"
    kind: str | None = None
    phase: str | None = None
    steps: tuple[int, int | None] | None = None

    def matches(self, module: str, phase: str | None, step: int | None, kind: str | None) -> bool:
        if not fnmatch.fnmatchcase(module, self.glob):
            return False
        if self.phase is not None and phase != self.phase:
            return False
        if self.steps is not None and (step is None or not _in_range(step, self.steps)):
            return False
        # A rule naming a kind is about findings only; one without a kind covers both.
        if self.kind is not None and (kind is None or not kind_matches(kind, self.kind)):
            return False
        return True


@dataclasses.dataclass
class Policy:
    """Limits, overrides, ignore rules and the gate's finding kinds; ``Policy.load()`` reads one."""

    limit: float = DEFAULT_LIMIT
    overrides: list[Override] = dataclasses.field(default_factory=list)
    ignores: list[IgnoreRule] = dataclasses.field(default_factory=list)
    fail_on: tuple[str, ...] | None = None  # None: the default kinds, severity "error" only
    steps: tuple[int, int | None] | None = None
    min_entries: int = 1  # a gate that judged fewer entries judged nothing worth a verdict
    source: str | None = None  # the file it came from; None for the built-in default

    @classmethod
    def default(cls) -> Policy:
        """The built-in policy: limit ``DEFAULT_LIMIT``, default gate kinds, nothing ignored."""
        return cls()

    @classmethod
    def load(cls, path: str | None = None, search_dir: str = ".") -> Policy:
        """Read the policy from ``path``, else from ``driftcheck.toml`` or ``pyproject.toml``.

        Args:
            path: an explicit policy file (``--policy``); a ``pyproject.toml`` is read from its
                ``[tool.driftcheck]`` table, any other file as a whole.
            search_dir: where to look for ``driftcheck.toml`` then ``pyproject.toml`` when no
                path is given. Neither present (or no ``[tool.driftcheck]``): the default policy.

        Raises:
            DriftcheckError: one line naming the file, the bad rule and how to fix it.
        """
        if path is not None:
            if not os.path.isfile(path):
                raise DriftcheckError(f"policy file {path} not found; pass an existing TOML file to --policy")
            data = _read_toml(path)
            if os.path.basename(path) == "pyproject.toml":
                table = data.get("tool", {}).get("driftcheck")
                if table is None:
                    raise DriftcheckError(f"{path}: no [tool.driftcheck] table; add one or point --policy "
                                          "at a driftcheck.toml")
                return cls.from_mapping(table, source=path)
            return cls.from_mapping(data, source=path)
        own = os.path.normpath(os.path.join(search_dir, FILE_NAME))
        if os.path.isfile(own):
            return cls.from_mapping(_read_toml(own), source=own)
        pyproject = os.path.normpath(os.path.join(search_dir, "pyproject.toml"))
        if os.path.isfile(pyproject):
            table = _read_toml(pyproject).get("tool", {}).get("driftcheck")
            if table is not None:
                return cls.from_mapping(table, source=pyproject)
        return cls.default()

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "<policy>") -> Policy:
        """Validate a parsed TOML table (the file's top level or ``[tool.driftcheck]``)."""
        where = _where(source)
        if not isinstance(data, dict):
            raise DriftcheckError(f"{where}: the policy must be a table of keys, got {type(data).__name__}")
        _no_unknown(data, _TOP_KEYS, where, "the policy")
        if "module" in data and "overrides" in data:
            raise DriftcheckError(f"{where}: both [[module]] and overrides are set; keep one of them")
        limit = _limit(data.get("limit", DEFAULT_LIMIT), where, "limit")
        rules = data.get("module", data.get("overrides", []))
        name = "module" if "module" in data else "overrides"
        if not isinstance(rules, list):
            raise DriftcheckError(f"{where}: '{name}' must be an array of tables ([[{name}]]), "
                                  f"got {type(rules).__name__}")
        overrides = [_override(r, where, f"[[{name}]] #{i + 1}") for i, r in enumerate(rules)]
        ignores_raw = data.get("ignore", [])
        if not isinstance(ignores_raw, list):
            raise DriftcheckError(f"{where}: 'ignore' must be an array of tables ([[ignore]]), "
                                  f"got {type(ignores_raw).__name__}")
        ignores = [_ignore(r, where, f"[[ignore]] #{i + 1}") for i, r in enumerate(ignores_raw)]
        fail_on = None
        if "fail_on" in data:
            fail_on = data["fail_on"]
            if not isinstance(fail_on, list) or not all(isinstance(k, str) and k for k in fail_on):
                raise DriftcheckError(f"{where}: 'fail_on' must be a list of finding kinds, "
                                      "e.g. fail_on = [\"batchnorm\", \"view\"]")
            fail_on = tuple(_kind(k, where, "fail_on item") for k in fail_on)
        steps = _steps(data["steps"], where, "steps") if "steps" in data else None
        min_entries = data.get("min_entries", 1)
        if type(min_entries) is not int or min_entries < 1:
            raise DriftcheckError(f"{where}: 'min_entries' must be a whole number >= 1 (the fewest "
                                  f"entries a verdict may rest on), got {min_entries!r}")
        return cls(limit=limit, overrides=overrides, ignores=ignores, fail_on=fail_on, steps=steps,
                   min_entries=min_entries, source=source)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Policy:
        """Rebuild the policy embedded in a report (``to_dict()``); empty or None: the default."""
        if not d:
            return cls.default()
        table: dict[str, Any] = {"limit": d.get("limit", DEFAULT_LIMIT)}
        if d.get("overrides"):
            table["module"] = [{k: v for k, v in o.items() if v is not None} for o in d["overrides"]]
        if d.get("ignore"):
            table["ignore"] = [{k: v for k, v in r.items() if v is not None} for r in d["ignore"]]
        if d.get("fail_on_explicit"):
            table["fail_on"] = list(d.get("fail_on", []))
        if d.get("steps") is not None:
            table["steps"] = d["steps"]
        if d.get("min_entries") is not None:
            table["min_entries"] = d["min_entries"]
        policy = cls.from_mapping(table, source=d.get("source") or "<report policy>")
        policy.source = d.get("source")
        return policy

    # --- questions the compare engine and the renderers ask -------------------------------

    def limit_for(self, module: str, phase: str) -> tuple[float, str]:
        """The ratio limit for ``module`` in ``phase`` and the rule that set it, in words."""
        for rule in reversed(self.overrides):  # last matching rule wins, as in .gitignore
            if rule.matches(module, phase):
                on = f" [{rule.phase}]" if rule.phase else ""
                return rule.limit, f"override '{rule.glob}'{on} limit {rule.limit:g} ({self._file()})"
        if self.source is None:
            return self.limit, f"default limit {self.limit:g}"
        return self.limit, f"default limit {self.limit:g} ({self._file()})"

    def ignore_reason(self, module: str, phase: str | None, step: int | None, kind: str | None = None) -> str | None:
        """The ``reason`` of the first ignore rule matching, or None; ``kind`` is a finding's kind."""
        for rule in self.ignores:
            if rule.matches(module, phase, step, kind):
                return rule.reason
        return None

    def fails_gate(self, finding: Finding) -> bool:
        """Whether ``finding`` fails the gate: its kind is in ``fail_on`` and it is not ignored."""
        if finding.step is not None and not self.judges_step(finding.step):
            return False
        if self.ignore_reason(finding.module, finding.phase, finding.step, finding.kind) is not None:
            return False
        if self.fail_on is None:
            return finding.severity == "error" and any(kind_matches(finding.kind, k) for k in DEFAULT_FAIL_ON)
        # An explicit list is the user's decision: a listed kind fails whatever its severity.
        return any(kind_matches(finding.kind, k) for k in self.fail_on)

    def check_traces(self, modules: Iterable[str], steps: Iterable[int]) -> None:
        """Rules that cannot apply to the traces being judged are errors, not silent no-ops: a
        module glob that matches no module (with the nearest paths), a step range beyond the
        traces' steps."""
        if not (self.overrides or self.ignores or self.steps):
            return
        where, names, last = _where(self.source or "<policy>"), sorted(set(modules)), max(steps, default=-1)

        def glob_hits(glob: str, what: str) -> None:
            if glob != "*" and not any(fnmatch.fnmatchcase(n, glob) for n in names):
                near = difflib.get_close_matches(glob.strip("*?"), [n for n in names if n], n=3, cutoff=0.3)
                raise DriftcheckError(f"{where}: {what} {glob!r} matches no module of the traces"
                                      + (f" (nearest: {', '.join(near)})" if near else ""))

        def in_steps(rng: tuple[int, int | None] | None, what: str) -> None:
            if rng is not None and (rng[0] > last or (rng[1] is not None and rng[1] > last)):
                raise DriftcheckError(f"{where}: {what} {_steps_text(rng)!r} lies outside the traces' "
                                      f"steps (0-{last}); fix the range or record more steps")

        for i, o in enumerate(self.overrides):
            glob_hits(o.glob, f"[[module]] #{i + 1} glob")
        for i, r in enumerate(self.ignores):
            glob_hits(r.glob, f"[[ignore]] #{i + 1} glob")
            in_steps(r.steps, f"[[ignore]] #{i + 1} steps")
        in_steps(self.steps, "steps")

    def judges_step(self, step: int) -> bool:
        """Whether ``step`` is in the judged ``steps`` range (all steps when none is set)."""
        return self.steps is None or _in_range(step, self.steps)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form embedded in the report; ``Policy.from_dict`` reads it back."""
        return {
            "source": self.source,
            "limit": self.limit,
            "overrides": [dataclasses.asdict(o) for o in self.overrides],
            "ignore": [dict(dataclasses.asdict(r), steps=_steps_text(r.steps)) for r in self.ignores],
            "fail_on": list(self.fail_on if self.fail_on is not None else DEFAULT_FAIL_ON),
            "fail_on_explicit": self.fail_on is not None,
            "steps": _steps_text(self.steps),
            **({"min_entries": self.min_entries} if self.min_entries != 1 else {}),
        }

    def _file(self) -> str:
        return os.path.basename(self.source) if self.source else "built-in"


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise DriftcheckError(f"{path}: invalid TOML ({err}); fix the syntax at that line") from None
    except OSError as err:
        raise DriftcheckError(f"{path}: cannot read the policy file ({err.strerror})") from None


def _where(source: str) -> str:
    return f"{source} [tool.driftcheck]" if os.path.basename(source) == "pyproject.toml" else source


def _no_unknown(table: dict[str, Any], allowed: set[str], where: str, what: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise DriftcheckError(f"{where}: {what} has unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"allowed: {', '.join(sorted(allowed))}")


def _limit(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise DriftcheckError(f"{where}: {what} must be a number > 0 (a ratio to the noise floor), "
                              f"got {value!r}; e.g. limit = 4")
    return float(value)


def _str(table: dict[str, Any], key: str, where: str, what: str) -> str | None:
    value = table.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise DriftcheckError(f"{where}: {what} '{key}' must be a non-empty string, got {value!r}")
    return value


def _phase(table: dict[str, Any], where: str, what: str) -> str | None:
    phase = _str(table, "phase", where, what)
    if phase is not None and phase not in PHASES:
        raise DriftcheckError(f"{where}: {what} phase {phase!r} is not one of {', '.join(PHASES)}")
    return phase


def _kind(pattern: str, where: str, what: str) -> str:
    """A finding-kind pattern that matches at least one kind driftcheck reports: a misspelt one
    (``views``) would silently switch a gate rule off."""
    if any(kind_matches(k, pattern) for k in FINDING_KINDS):
        return pattern
    families = sorted({k.split(".")[0] for k in FINDING_KINDS})
    near = difflib.get_close_matches(pattern, families + sorted(FINDING_KINDS), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    raise DriftcheckError(f"{where}: {what} {pattern!r} matches no finding kind ({hint}kinds are "
                          f"{', '.join(families)} and their dotted kinds, docs/findings.md)")


def _override(rule: Any, where: str, what: str) -> Override:
    if not isinstance(rule, dict):
        raise DriftcheckError(f"{where}: {what} must be a table with glob and limit, got {rule!r}")
    _no_unknown(rule, _OVERRIDE_KEYS, where, what)
    glob = _str(rule, "glob", where, what)
    if glob is None:
        raise DriftcheckError(f"{where}: {what} has no 'glob'; add the module path pattern, e.g. glob = \"lm_head*\"")
    if "limit" not in rule:
        raise DriftcheckError(f"{where}: {what} (glob {glob!r}) has no 'limit'; add e.g. limit = 8")
    return Override(glob=glob, limit=_limit(rule["limit"], where, f"{what} (glob {glob!r}) limit"),
                    phase=_phase(rule, where, what))


def _ignore(rule: Any, where: str, what: str) -> IgnoreRule:
    if not isinstance(rule, dict):
        raise DriftcheckError(f"{where}: {what} must be a table with glob and reason, got {rule!r}")
    _no_unknown(rule, _IGNORE_KEYS, where, what)
    glob = _str(rule, "glob", where, what) or "*"
    reason = rule.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise DriftcheckError(f"{where}: {what} (glob {glob!r}) has no 'reason'; every ignore rule must say "
                              f"why, e.g. reason = \"dropout differs by design\"")
    steps = _steps(rule["steps"], where, f"{what} steps") if "steps" in rule else None
    kind = _str(rule, "kind", where, what)
    return IgnoreRule(reason=reason.strip(), glob=glob,
                      kind=None if kind is None else _kind(kind, where, f"{what} kind"),
                      phase=_phase(rule, where, what), steps=steps)


def _steps(value: Any, where: str, what: str) -> tuple[int, int | None]:
    """``"0-3"``, ``"2"``, ``"2-"`` (open end), ``[0, 3]`` or ``2`` -> inclusive (first, last)."""
    bad = DriftcheckError(f"{where}: {what} must be a step range like \"0-3\", \"2\", \"2-\" or [0, 3], got {value!r}")
    if isinstance(value, bool):
        raise bad
    first: int
    last: int | None
    if isinstance(value, int):
        first, last = value, value
    elif isinstance(value, list):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise bad
        first, last = value
    elif isinstance(value, str):
        text = value.strip()
        lo, sep, hi = text.partition("-")
        if not lo.strip().isdigit() or (hi.strip() and not hi.strip().isdigit()):
            raise bad
        first = int(lo)
        last = int(hi) if hi.strip() else (None if sep else first)
    else:
        raise bad
    if first < 0 or (last is not None and last < first):
        raise bad
    return first, last


def _steps_text(steps: tuple[int, int | None] | None) -> str | None:
    if steps is None:
        return None
    first, last = steps
    return str(first) if first == last else f"{first}-{'' if last is None else last}"


def _in_range(step: int, steps: tuple[int, int | None]) -> bool:
    first, last = steps
    return step >= first and (last is None or step <= last)


def gate_state(finding: Finding, policy: Policy) -> str:
    """"fails gate", "ignored" or "warning": how ``policy`` treats ``finding``."""
    if policy.ignore_reason(finding.module, finding.phase, finding.step, finding.kind) is not None:
        return "ignored"
    return "fails gate" if policy.fails_gate(finding) else "warning"

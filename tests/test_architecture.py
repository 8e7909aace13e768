"""The architecture's rules, checked on the source (docs/architecture.md draws them):

- layers: imports run one way, cli -> drill/integrations -> record/compare -> report/audit/probe
  -> gate -> store/targets (and the model sources) -> numerics and the root's errors, scenario,
  nested; a module imports from a lower layer or from its own folder, never upwards or sideways;
- no import circle anywhere in the repository (the package, bench/, tests/, models/), counting
  imports inside functions and under ``if TYPE_CHECKING:``;
- no private name (``_x``) imported from, or read on, another driftcheck module;
- one noun a module: none over 400 lines; no function over 80 lines in compare/ and record/;
- the package root holds only the public face;
- numerics load no CLI or rendering library, the policy and the renderers load no torch,
  renderers never judge.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "driftcheck"

# Low to high. A module may import from a lower rank, or from its own group at the same rank.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"errors": ("driftcheck.errors",), "version": ("driftcheck.version",)},
    {"numerics": ("driftcheck.numerics",), "scenario": ("driftcheck.scenario",), "nested": ("driftcheck.nested",)},
    {"store": ("driftcheck.store",), "targets": ("driftcheck.targets",),
     "sources": ("driftcheck.loader", "driftcheck.hf", "driftcheck.models")},
    {"gate": ("driftcheck.gate",)},
    {"report": ("driftcheck.report",), "audit": ("driftcheck.audit",), "probe": ("driftcheck.probe",)},
    {"record": ("driftcheck.record",), "compare": ("driftcheck.compare",)},
    {"drill": ("driftcheck.drill",), "integrations": ("driftcheck.integrations",)},
    {"cli": ("driftcheck.cli", "driftcheck.__main__"), "api": ("driftcheck",)},
]
ROOT_FACE = {"__init__", "__main__", "errors", "version", "scenario", "loader", "nested"}


def _name(path: Path, base: Path, prefix: str = "") -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts] if prefix else parts) if parts or prefix else prefix


def _modules() -> dict[str, Path]:
    """The package's modules by dotted name (driftcheck.models is the repository's models/)."""
    out = {_name(p, PKG.parent): p for p in sorted(PKG.rglob("*.py"))}
    out.update({_name(p, REPO / "models", "driftcheck.models"): p for p in sorted((REPO / "models").rglob("*.py"))})
    return out


def _all_files() -> dict[str, Path]:
    """Every Python file of the repository by the name it is imported as: the package's dotted
    names, bench/ and tests/ files by their stem (those folders are put on sys.path)."""
    out = _modules()
    for folder in ("bench", "tests"):
        for p in sorted((REPO / folder).rglob("*.py")):
            out.setdefault(p.stem, p)
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every known module ``path`` imports, anywhere in the file (inside functions and under
    ``if TYPE_CHECKING:`` too): ``from pkg import name`` whose name is a module imports that
    module; relative imports are resolved."""
    me = next((n for n, p in known.items() if p == path), "")
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known.keys()
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            subs = {f"{module}.{a.name}" for a in node.names} & known.keys()
            found |= subs or ({module} & known.keys())
    return found - {me}


def _layer(module: str) -> tuple[int, str]:
    best = (-1, "", -1)
    for rank, groups in enumerate(LAYERS):
        for group, prefixes in groups.items():
            for p in prefixes:
                if (module == p or module.startswith(p + ".")) and len(p) > best[2]:
                    best = (rank, group, len(p))
    assert best[0] >= 0, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return best[0], best[1]


def test_every_module_has_a_layer_and_imports_only_downwards():
    modules = _modules()
    wrong = []
    for m, p in modules.items():
        rank, group = _layer(m)
        for target in sorted(_imports(p, modules)):
            t_rank, t_group = _layer(target)
            if t_rank > rank or (t_rank == rank and t_group != group):
                wrong.append(f"{m} ({group}) imports {target} ({t_group})")
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycle_anywhere_in_the_repository():
    files = _all_files()
    graph = {m: _imports(p, files) for m, p in files.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_type_checking_and_function_level_imports(tmp_path):
    """The rule's own loopholes, closed: a circle through ``if TYPE_CHECKING:`` or through an
    import inside a function is a circle."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    files = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {m: _imports(p, files) for m, p in files.items()}
    assert _cycles(graph) == [["a", "b", "a"]]


def _private_uses(path: Path, modules: dict[str, Path]) -> list[str]:
    """``from driftcheck.x import _name`` and ``x._name`` on an imported driftcheck module."""
    me = next(n for n, p in modules.items() if p == path)
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__") and node.module != me:
                    bad.append(f"{me} imports {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and aliases[node.value.id] != me \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            bad.append(f"{me} reads {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_private_name_crosses_a_module_border():
    modules = _modules()
    found = [b for p in modules.values() for b in _private_uses(p, modules)]
    assert sorted(set(found)) == []


def test_no_module_over_400_lines():
    long = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_no_function_over_80_lines_in_compare_and_record():
    long = {}
    for folder in ("compare", "record"):
        for p in sorted((PKG / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 80:
                        long[f"{p.relative_to(PKG)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_the_package_root_holds_only_the_public_face():
    modules = {p.stem for p in PKG.glob("*.py")}
    assert modules <= ROOT_FACE, modules - ROOT_FACE
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    layered = {prefix.split(".")[1] for groups in LAYERS for prefixes in groups.values() for prefix in prefixes
               if prefix.count(".") == 1}
    assert folders <= layered, folders - layered


def test_renderers_import_no_policy():
    """compare applies the policy once and writes each entry's limit and each finding's gate
    state into the report: the renderers only render."""
    modules = _modules()
    renderers = [m for m in modules if m.startswith("driftcheck.report.")]
    assert len(renderers) >= 5
    judged = {m: sorted(i for i in _imports(modules[m], modules) if i == "driftcheck.gate.policy")
              for m in renderers}
    assert {m: v for m, v in judged.items() if v} == {}


def test_numerics_load_no_cli_or_rendering_library():
    code = ("import sys, pkgutil, importlib\nimport driftcheck.numerics as n\n"
            "for m in pkgutil.iter_modules(n.__path__):\n    importlib.import_module('driftcheck.numerics.' + m.name)\n"
            "import driftcheck.compare\n"
            "print(sorted(m for m in ('click', 'rich', 'jinja2', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_store_format_and_policy_load_without_torch():
    """The policy and the renderers read the trace format's phases: no torch behind them."""
    code = ("import sys\nimport driftcheck.store.format, driftcheck.gate.policy, driftcheck.gate.report\n"
            "import driftcheck.report\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_finding_kind_the_code_reports_is_in_the_vocabulary():
    """Policies are checked against store.format.FINDING_KINDS: a kind the code reports but the
    vocabulary lacks could never be named in a policy."""
    from driftcheck.store.format import FINDING_KINDS

    used = set()
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Finding", "finding") \
                    and node.args and isinstance(node.args[0], ast.Constant):
                used.add(node.args[0].value)
    assert len(used) >= 15 and used <= FINDING_KINDS, used - FINDING_KINDS

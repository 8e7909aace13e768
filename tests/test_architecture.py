"""The architecture's rules, checked on the source: one noun a module (none over 400 lines), no
import cycle, numerics that load no CLI or rendering library, renderers that judge nothing."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "driftcheck"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_nodes(child)])
            continue
        yield node
        yield from _nodes(node)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every driftcheck module ``path`` imports, at module level or inside functions: a
    ``from pkg import name`` whose name is a module imports that module."""
    found = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            if subs:
                found |= subs
            elif node.module in modules:
                found.add(node.module)
    return found


def test_no_module_over_400_lines():
    long = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


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
    code = ("import sys\n"
            "import driftcheck.numerics.dtypes, driftcheck.numerics.floor, driftcheck.numerics.metrics, driftcheck.numerics.kernels\n"
            "import driftcheck.numerics.stats, driftcheck.compare\n"
            "print(sorted(m for m in ('click', 'rich', 'jinja2', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_store_format_and_policy_load_without_torch():
    """The policy and the renderers read the trace format's phases: no torch behind them."""
    code = ("import sys\nimport driftcheck.store.format, driftcheck.gate.policy, driftcheck.report\n"
            "print('torch' in sys.modules)")
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

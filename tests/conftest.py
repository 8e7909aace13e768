"""Shared fixtures and helpers: traces of the built-in models (recorded once per session), the
CLI in a subprocess and in-process, user scenarios (tests/data/user_scenarios.py), and the
one-line-error and incomplete-trace assertions."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
torch.set_num_threads(1)  # CI has 2 cores; keep records deterministic and cheap

try:  # property tests judge values, not the host's speed: a loaded host made one "too slow"
    from hypothesis import HealthCheck, settings

    settings.register_profile("driftcheck", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("driftcheck")
except ImportError:  # (hypothesis is a dev dependency)
    pass

BUILTINS = ("mlp", "resnet", "llama", "vit")


def record_builtin(name: str, out: Path, *, dtype: str = "fp32", replay: Path | None = None,
                   **kwargs) -> Path:
    from driftcheck.loader import load_scenario
    from driftcheck.record.runner import record

    return record(load_scenario(name), out, dtype=dtype, replay=replay, force=True,
                  model_id=name, **kwargs)


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{model: {"fp32": ref, "fp32b": re-record, "bf16": target}} for every built-in."""
    root = tmp_path_factory.mktemp("traces")
    out: dict[str, dict[str, Path]] = {}
    for name in BUILTINS:
        ref = record_builtin(name, root / f"{name}-fp32")
        out[name] = {
            "fp32": ref,
            "fp32b": record_builtin(name, root / f"{name}-fp32b", replay=ref),
            "bf16": record_builtin(name, root / f"{name}-bf16", dtype="bf16", replay=ref),
        }
    return out


# -- the CLI ---------------------------------------------------------------------------------------
ENV = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", NO_COLOR="1")
DATA = Path(__file__).resolve().parent / "data"


def make_pytpu_site(site: Path) -> Path:
    """What ``pip install --no-deps --target SITE tests/data/pytpu`` lays out, made by hand: a
    Python PrivateUse1 ``tpu`` that ``import torch`` autoloads where SITE is on the path."""
    shutil.copytree(DATA / "pytpu" / "pytpu", site / "pytpu", ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "pytpu-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pytpu\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\npytpu = pytpu:autoload\n")
    return site


def dc(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``driftcheck ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "driftcheck", *args], capture_output=True,
                          text=True, env=ENV, cwd=cwd, timeout=600)


def run_cli(args: list, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """Run ``driftcheck ARGS`` in-process through ``main()`` (the console script's error mapping)."""
    from driftcheck.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return ei.value.code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit 2, exactly one line on stderr that starts with ``driftcheck:``, no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}: {err}"
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    line = lines[0]
    assert line.startswith("driftcheck: "), line
    assert "Traceback" not in err and "report it" not in line, line  # not an "unexpected" crash
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


def assert_not_complete(d: Path) -> None:
    """Nothing that passes as a complete trace: no manifest, no temp shard left behind."""
    assert not (d / "manifest.json").exists()
    assert not list(d.glob(".*.tmp")), list(d.iterdir())


# -- user scenarios and models ---------------------------------------------------------------------
def write_scenarios(d: Path) -> Path:
    """The user scenarios as ``d/scenarios.py``: the loader imports them like a user's file."""
    p = d / "scenarios.py"
    shutil.copyfile(DATA / "user_scenarios.py", p)
    return p


def record_trace(scen: Path, fn: str, out: Path, **kwargs) -> Path:
    """Record a user scenario through the library (fixtures; the tests go through the CLI)."""
    from driftcheck.loader import load_scenario
    from driftcheck.record.runner import record

    spec = f"{scen}:{fn}"
    return record(load_scenario(spec), out, force=True, model_id=spec, **kwargs)


def record_side(scenario, out: Path, *, threads: int | None = None, fault=None, **options) -> Path:
    """Record ``scenario`` with ``threads`` intra-op threads and the op fault ``fault()`` made
    for this record only (removed after it, the thread count put back)."""
    from driftcheck.record.runner import record

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    hook = fault() if fault else None
    try:
        return record(scenario, out, target_hooks=hook, **options)
    finally:
        torch.set_num_threads(old)
        if hook is not None:
            hook.remove()


def a_middle_linear(name: str) -> str:
    """The middle nn.Linear of a built-in model (where the fault benches inject)."""
    from torch import nn

    from driftcheck.loader import load_scenario

    lins = [n for n, m in load_scenario(name).model.named_modules() if isinstance(m, nn.Linear)]
    return lins[len(lins) // 2]


# the built-in llama, with a 5% defect in one tensor-parallel Linear's output under DC_FAULT=1
# (tests/record/test_tp.py, test_fsdp_tp.py: its up_proj is colwise, a local shard on each rank)
LLAMA_FAULT_SCENARIO = textwrap.dedent('''
    import os
    from torch import nn
    from driftcheck import Scenario
    from driftcheck.models import llama

    def build():
        sc = llama.build()
        if os.environ.get("DC_FAULT"):  # a 5% defect in the output of one sharded Linear
            sc.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, out: out * 1.05)
        return sc
''')


def record_cli(cwd, *args: str, ranks: int = 0, env: dict | None = None) -> None:
    """``driftcheck --quiet record ARGS`` in a subprocess run from ``cwd``: under torchrun with
    ``ranks`` processes (gloo on CPU, a free port), or a single process where ``ranks`` is 0;
    ``env`` added to this process's environment. Asserts it exits 0."""
    import socket

    full = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", **(env or {}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_addr", "127.0.0.1", "--master_port", str(port)] if ranks else [sys.executable]
    proc = subprocess.run([*run, "-m", "driftcheck", "--quiet", "record", *args], env=full,
                          capture_output=True, text=True, timeout=180, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]

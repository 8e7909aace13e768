"""The CLI end to end, in subprocesses: exit codes 0/1/2, one-line errors, run, report, models."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import click
import pytest
import torch
from conftest import ENV, dc

from driftcheck.errors import DriftcheckError


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def test_models_lists_builtins_and_families():
    p = dc("models")
    assert p.returncode == 0
    for name in ("mlp", "resnet", "llama", "vit", "hf:llama", "hf:resnet"):
        assert name in p.stdout


def test_record_compare_pass_fail_and_reports(tmp_path, traces):
    ref = tmp_path / "ref"
    p = dc("record", "mlp", "--out", str(ref))
    assert p.returncode == 0, p.stderr
    assert (ref / "manifest.json").exists() and (ref / "replay.safetensors").exists()
    tgt = tmp_path / "tgt"
    assert dc("record", "mlp", "--out", str(tgt), "--dtype", "bf16", "--replay", str(ref)).returncode == 0
    out = tmp_path / "r.json"
    p = dc("compare", str(ref), str(tgt), "--json", str(out), "--junit", str(tmp_path / "j.xml"),
           "--summary-md", str(tmp_path / "s.md"), "--html", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("PASS")
    report = json.loads(out.read_text())
    assert report["verdict"] == "pass" and report["schema"].startswith("driftcheck.report/")
    for f in ("j.xml", "s.md", "r.html"):
        assert (tmp_path / f).stat().st_size > 100
    # a failing comparison: tight limit -> exit 1 and a first divergence line
    p = dc("compare", str(ref), str(tgt), "--limit", "0.001")
    assert p.returncode == 1
    assert p.stdout.startswith("FAIL") and "first divergence:" in p.stdout
    # report re-renders a saved JSON with the verdict's exit code
    p = dc("report", str(out), "--html", str(tmp_path / "again.html"))
    assert p.returncode == 0 and (tmp_path / "again.html").exists()


@pytest.mark.parametrize("args,needle", [
    (["record", "no-such-model", "--out", "X"], "unknown model"),
    (["record", "mlp", "--out", "X", "--dtype", "fp7"], "--dtype"),
    (["record", "mlp", "--out", "X", "--device", "cuda"], "CUDA"),
    (["record", "mlp", "--out", "X", "--device", "tpu"], "pip install torch-tpu==0.2.0"),
    (["record", "mlp", "--out", "X", "--device", "gpu"], "cuda"),
    (["record", "nofile.py:build", "--out", "X"], "does not exist"),
    (["compare", "missing-a", "missing-b"], "does not exist"),
    (["report", "missing.json", "--html", "x.html"], "cannot read"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    line = one_line_error(dc(*args, cwd=tmp_path))
    assert needle in line


def test_existing_out_needs_force(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "something").write_text("x")
    assert "--force" in one_line_error(dc("record", "mlp", "--out", str(tmp_path / "t")))
    # --force replaces traces, never an arbitrary directory
    assert "not a driftcheck trace" in one_line_error(
        dc("record", "mlp", "--out", str(tmp_path / "t"), "--force"))
    assert (tmp_path / "t" / "something").exists()
    assert dc("record", "mlp", "--out", str(tmp_path / "u")).returncode == 0
    assert "--force" in one_line_error(dc("record", "mlp", "--out", str(tmp_path / "u")))
    assert dc("record", "mlp", "--out", str(tmp_path / "u"), "--force").returncode == 0


def test_incomplete_trace_is_refused(tmp_path, traces):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(traces["mlp"]["fp32"], broken)
    (broken / "manifest.json").unlink()
    line = one_line_error(dc("compare", str(traces["mlp"]["fp32"]), str(broken)))
    assert "incomplete" in line


def test_user_scenario_file(tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(
        "import torch\nimport driftcheck\n\n"
        "def build(seed=0):\n"
        "    torch.manual_seed(seed)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "    xs = [torch.randn(5, 4) for _ in range(3)]\n"
        "    return driftcheck.Scenario(model=model, inputs=xs, loss=lambda out, x: out.pow(2).mean(),\n"
        "                               optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), steps=3)\n"
        "def wrong():\n    return 42\n"
        "def boom():\n    raise RuntimeError('user code exploded')\n")
    p = dc("record", f"{f}:build", "--out", str(tmp_path / "t"))
    assert p.returncode == 0, p.stderr
    from driftcheck.store import TraceReader

    r = TraceReader(tmp_path / "t")
    assert r.run["steps"] == 3 and {e["step"] for e in r.entries} == {0, 1, 2}
    assert "driftcheck.Scenario" in one_line_error(dc("record", f"{f}:wrong", "--out", str(tmp_path / "w")))
    assert "user code exploded" in one_line_error(dc("record", f"{f}:boom", "--out", str(tmp_path / "b")))
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_run_one_shot_precision_what_if(tmp_path):
    p = dc("run", "llama", "--target", "cpu", "--target-dtype", "bf16", "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stdout + p.stderr
    for f in ("reference/manifest.json", "target/manifest.json", "report.json", "report.html"):
        assert (tmp_path / "run" / f).exists(), f
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["target"]["dtype"] == "bfloat16" and rep["reference"]["dtype"] == "float32"
    assert rep["reference"]["replay_id"] == rep["target"]["replay_id"]
    # where stderr is not a terminal: no bars, one line per side once it is recorded
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("recorded ")]
    assert len(said) == 2 and said[0].startswith("recorded reference: 2/2 steps, ") and "\r" not in p.stderr
    assert said[1].startswith("recorded target + local replay: 2/2 steps, ") and " tensors, " in said[1]


def test_replay_gives_bitwise_identical_start(traces):
    from driftcheck.store import TraceReader

    a, b = TraceReader(traces["vit"]["fp32"]), TraceReader(traces["vit"]["fp32b"])
    ka = {(e["module"], e["slot"]): e for e in a.entries if e["phase"] == "params" and e["step"] == 0}
    kb = {(e["module"], e["slot"]): e for e in b.entries if e["phase"] == "params" and e["step"] == 0}
    assert ka.keys() == kb.keys() and ka
    for k in ka:
        assert torch.equal(a.tensor(ka[k]), b.tensor(kb[k]))
    ia = [e for e in a.entries if e["phase"] == "forward" and e["module"] == "" and e["slot"].startswith("input")]
    assert ia
    for e in ia:
        eb = next(x for x in b.entries if x["key"] == e["key"])
        assert torch.equal(a.tensor(e), b.tensor(eb))
    # the bf16 target starts from the same weights, cast
    c = TraceReader(traces["vit"]["bf16"])
    kc = {(e["module"], e["slot"]): e for e in c.entries if e["phase"] == "params" and e["step"] == 0}
    for k in ka:
        ta = a.tensor(ka[k])
        if ta.is_floating_point():
            assert torch.equal(ta.to(torch.bfloat16), c.tensor(kc[k]))


def test_quiet_and_no_color(traces):
    ref, tgt = str(traces["mlp"]["fp32"]), str(traces["mlp"]["bf16"])
    p = dc("--quiet", "compare", ref, tgt)
    assert p.returncode == 0 and len(p.stdout.strip().splitlines()) == 1
    p = dc("compare", ref, tgt, "-q")  # after the command name too
    assert p.returncode == 0 and len(p.stdout.strip().splitlines()) == 1

    def colored(*args: str, **env: str) -> str:
        base = {k: v for k, v in ENV.items() if k != "NO_COLOR"}
        p = subprocess.run([sys.executable, "-m", "driftcheck", *args, "compare", ref, tgt,
                            "--limit", "0.01"], capture_output=True, text=True, timeout=300,
                           env=dict(base, FORCE_COLOR="1", **env))
        assert p.returncode == 1
        return p.stdout

    assert "\x1b[" in colored(), "control: a forced terminal gets colors"
    assert "\x1b[" not in colored("--no-color")
    assert "\x1b[" not in colored(NO_COLOR="1")


def test_cli_runs_no_full_garbage_collections(tmp_path):
    """A fresh process importing torch and numba for a record would walk its ~300k long-lived
    objects in several full collections (~25% of a 60-step record); the CLI skips them, and
    leaves the thresholds as it found them when called in-process."""
    code = (
        "import gc, sys\n"
        "from driftcheck.cli import main\n"
        "full = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'stop' and info['generation'] == 2 "
        "and full.append(1))\n"
        "before = gc.get_threshold()\n"
        "try:\n"
        f"    main(['--quiet', 'record', 'llama', '--out', {str(tmp_path / 't')!r}, '--steps', '2',"
        " '--mode', 'stats'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert gc.get_threshold() == before, (gc.get_threshold(), before)\n"
        "print('full collections', len(full))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "full collections 0"
    assert (tmp_path / "t" / "manifest.json").exists()


def test_cli_process_exit_skips_the_final_collections():
    """At the interpreter's exit the objects still alive are frozen (gc.freeze): the final
    collections would walk torch's long-lived objects several times (~0.5 s a process, three
    processes in a row in ``driftcheck run``). Only at exit: a process that calls ``main`` has
    nothing frozen until then."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count() > 0))\n"
        "from driftcheck.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('frozen before exit', gc.get_freeze_count())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ["frozen before exit 0", "frozen at exit True"]


def test_run_checks_a_missing_target_device_before_recording(tmp_path):
    """A target device torch itself knows (cuda, mps, xpu) that this host lacks is refused before
    the reference is recorded (it used to be recorded first, then the target failed)."""
    p = dc("run", "llama", "--reference", "cpu", "--target", "xpu:3", "--out", str(tmp_path / "r"))
    assert "XPU" in one_line_error(p)
    assert not (tmp_path / "r" / "reference").exists()


def test_report_output_dash_is_standard_output(traces, tmp_path, capsys, monkeypatch):
    """``report R.json --summary-md -`` prints the summary (it used to write a file named -);
    the verdict line goes to stderr, so stdout holds the summary alone."""
    from conftest import run_cli

    rj = tmp_path / "r.json"
    code, _, _ = run_cli(["compare", traces["mlp"]["fp32"], traces["mlp"]["bf16"], "--json", rj], capsys)
    assert code == 0
    monkeypatch.chdir(tmp_path)  # restored after the test: its folder is removed then
    code, out, err = run_cli(["report", rj, "--summary-md", "-"], capsys)
    assert code == 0 and not (tmp_path / "-").exists()
    assert out.startswith("#") and "PASS" in err
    code, _, err = run_cli(["report", rj, "--summary-md", "-", "--json", "-"], capsys)
    assert code == 2 and "only one of" in err


def test_report_of_a_non_report_says_so_once(tmp_path, capsys):
    from conftest import assert_one_line_error, run_cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/1"}')
    code, _, err = run_cli(["report", bad, "--html", tmp_path / "x.html"], capsys)
    line = assert_one_line_error(code, err, "is not a driftcheck report")
    assert line.count("not a driftcheck report") == 1


@pytest.mark.parametrize("extra, needle", [
    (["--target", "tpu"], "needs torch_tpu"),
    (["--target", "cpu", "--local", "--mode", "stats"], "--local needs full tensors"),
    (["--target", "cpu", "--steps", "0"], "--steps must be at least 1"),
    (["--target", "cpu", "--target-dtype", "bf61"], "unsupported --target-dtype 'bf61'"),
])
def test_run_refuses_before_recording_anything(tmp_path, capsys, extra, needle):
    """run checks its options and devices first: no reference recorded, no run directory made
    (it used to record the whole reference, then fail on the target)."""
    from conftest import assert_one_line_error, run_cli

    out = tmp_path / "run"
    code, _, err = run_cli(["run", "mlp", "--out", out, *extra], capsys)
    assert_one_line_error(code, err, needle)
    assert not out.exists()


def test_run_hands_each_side_the_users_backend_autoload(tmp_path, monkeypatch):
    """run checks its devices in its own process; that must not leave
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 for the sides it starts: a tpu target needs the autoload
    (it failed with 'torch_tpu is installed but not loaded')."""
    import driftcheck.record.run as run_mod

    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    envs = []

    class Fake:  # a side's process that records nothing and succeeds
        def __init__(self, cmd, env, **kw):
            envs.append(env)
            self.stdin = io.StringIO() if kw.get("stdin") == run_mod.subprocess.PIPE else None
            self.stderr, self.returncode = io.StringIO("driftcheck-progress: 1/2\n"), 0

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(run_mod.subprocess, "Popen", Fake)
    run_mod.record_sides(run_mod.Sides(model="mlp", out=tmp_path / "r", reference="cpu", target="cpu"))
    assert len(envs) == 2 and all("TORCH_DEVICE_BACKEND_AUTOLOAD" not in e for e in envs)


def test_options_that_change_nothing_say_so(tmp_path, capsys):
    """--simulate on a model it cannot affect, and --matmul-precision on a CPU whose float32
    matmuls it leaves bitwise the same, used to pass in silence."""
    from conftest import run_cli

    code, _, err = run_cli(["record", "mlp", "--out", tmp_path / "a", "--simulate", "skip-bn-stats"], capsys)
    assert code == 0 and "--simulate skip-bn-stats changed nothing" in err  # the MLP has no BatchNorm
    code, _, err = run_cli(["record", "resnet", "--out", tmp_path / "b", "--steps", "1",
                            "--simulate", "skip-bn-stats"], capsys)
    assert code == 0 and "changed nothing" not in err
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
    torch.set_float32_matmul_precision("medium")
    try:
        medium = a @ b
    finally:
        torch.set_float32_matmul_precision("highest")
    try:
        code, _, err = run_cli(["record", "mlp", "--out", tmp_path / "c", "--matmul-precision", "medium"],
                               capsys)
    finally:
        torch.set_float32_matmul_precision("highest")  # the in-process record set it for good
    assert code == 0 and ("changes nothing" in err) == torch.equal(medium, a @ b)


def test_run_knows_the_dtype_names_without_torch():
    """record/run.py checks --dtype names from the torch-free table (numerics/dtype_names.py)
    that numerics/dtypes.py builds its torch dtypes from: one table, and run stays torch-free."""
    import subprocess
    import sys

    from driftcheck.numerics import dtypes

    code = ("import sys\nimport driftcheck.record.run, driftcheck.store.format\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert {k: dtypes.name_of(v) for k, v in dtypes.CLI_DTYPES.items()} == dtypes.CLI_DTYPE_NAMES


def test_run_takes_the_record_options_that_make_sense_for_a_side(tmp_path, capsys):
    """run passes --view-audit, --include/--exclude, --capture-steps and --phases to both sides
    and --simulate to the target only: the README's audit example works through run."""
    from conftest import run_cli

    from driftcheck.store import TraceReader

    out = tmp_path / "run"
    code, stdout, _ = run_cli(["run", "resnet", "--target", "cpu", "--out", out, "--view-audit",
                               "--simulate", "skip-bn-stats", "--exclude", "fc", "--capture-steps", "0",
                               "--phases", "forward,optimizer", "--steps", "2"], capsys)
    assert code == 1
    first = stdout.splitlines()[1]
    assert first.startswith("FAIL BatchNorm running statistics in ") and "not precision" in first
    ref, tgt = TraceReader(out / "reference"), TraceReader(out / "target")
    assert ref.run["simulated_backend"] is None and tgt.run["simulated_backend"] == "skip-bn-stats"
    for r in (ref, tgt):
        entries = r.entries.values() if isinstance(r.entries, dict) else r.entries
        modules = {e["module"] for e in entries}
        assert modules and "fc" not in modules and "layer1.bn1" in modules
        assert {e["step"] for e in entries if e["phase"] != "params"} == {0}
        assert {e["phase"] for e in entries} <= {"forward", "optimizer", "params", "loss"}


def test_run_help_documents_every_option(capsys):
    """Every option of every command has help text; run's and compare's state their defaults."""
    from driftcheck.cli import cli

    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{name} {param.opts} has no help text"
    for name in ("run", "compare"):
        limit = next(p for p in cli.commands[name].params if p.name == "limit")
        assert "3.5" in limit.help


@pytest.mark.parametrize("flag", [["--compile"], ["--compile", "aot_eager"], ["--reference-compile"]])
def test_run_long_with_compile_is_refused_before_anything_runs(tmp_path, capsys, flag):
    """`run --long` records eager steps: a --compile there would be dropped silently (it was,
    when the check sat after --long's return); it is one line and exit 2, and no side runs."""
    from conftest import assert_one_line_error, run_cli

    out = tmp_path / "run"
    code, _, err = run_cli(["run", "mlp", "--target", "cpu", "--long", "--steps", "3", "--out", out, *flag],
                           capsys)
    assert_one_line_error(code, err, "--long runs eager steps", "--compile")
    assert not out.exists()


def test_a_failed_reference_stops_the_side_waiting_for_it(tmp_path):
    """The target's process starts with the reference's and waits for its turn: when the
    reference fails, the run says so in one line, and the target records nothing (and does
    not hang: this test would)."""
    f = tmp_path / "flaky.py"
    f.write_text(
        "import os, torch, driftcheck\n"
        "def build(seed=0):\n"
        "    if os.environ.get('FLAKY_SIDE') == 'reference':\n"
        "        raise RuntimeError('the reference side broke')\n"
        "    torch.manual_seed(seed)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "    return driftcheck.Scenario(model=model, inputs=[torch.randn(5, 4)], steps=1,\n"
        "                               loss=lambda out, x: out.pow(2).mean(),\n"
        "                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n")
    out = tmp_path / "run"
    p = dc("--quiet", "run", f"{f}:build", "--target", "cpu", "--out", str(out),
           "--reference-env", "FLAKY_SIDE=reference")
    assert p.returncode == 2 and "the reference record failed" in one_line_error(p)
    assert "the reference side broke" in p.stderr
    assert not (out / "target" / "manifest.json").exists()


def test_a_side_waits_for_its_turn(monkeypatch):
    """wait_for_turn: nothing without the variable; "go" on stdin lets the record go on; end of
    input (the reference failed, or run was stopped) ends the process before it records."""
    import driftcheck.record.run as run_mod

    monkeypatch.delenv(run_mod.GATE_VAR, raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    run_mod.wait_for_turn()  # not started by run: returns at once, reads nothing
    monkeypatch.setenv(run_mod.GATE_VAR, "1")
    monkeypatch.setattr("sys.stdin", io.StringIO("go\n"))
    run_mod.wait_for_turn()
    monkeypatch.setenv(run_mod.GATE_VAR, "1")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(SystemExit):
        run_mod.wait_for_turn()


def test_a_side_is_followed_to_its_complete_trace_then_to_its_end(monkeypatch):
    """The reference's trace is complete (its record says so) before its process has ended: the
    sides waiting for it get their "go" then, not after its interpreter's exit. Its end is still
    followed: a failure after the trace is complete fails the run in one line; a record that
    never says its trace is complete is followed to its end, as before."""
    import driftcheck.record.run as run_mod

    popen = subprocess.Popen

    def side(code: str) -> run_mod.SideProcess:  # a stand-in for the record process
        monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: popen([sys.executable, "-c", code], **kw))
        return run_mod.SideProcess([], "reference", False, None, gated=True)

    say = "import sys; w = sys.stderr.write; w('{p}1/1 3 40\\n'); w('{p}{c}\\n'); sys.stderr.flush(); "
    say = say.format(p=run_mod.PROGRESS_PREFIX, c=run_mod.COMPLETE)
    ended = side(say + "sys.stdin.readline(); w('the end broke\\n'); sys.exit(1)")
    ended.wait_complete()  # returns while the process still runs: it waits for a line
    assert ended.proc.poll() is None and ended.steps == "1/1"
    ended.go()
    with pytest.raises(DriftcheckError, match="the reference record failed: the end broke"):
        ended.finish()
    ended.stop()
    quiet = side("import sys; sys.stderr.write('it broke\\n'); sys.exit(1)")
    quiet.wait_complete()  # no such line: its end
    assert quiet.proc.wait() == 1
    with pytest.raises(DriftcheckError, match="it broke"):
        quiet.finish()
    quiet.stop()


def test_sides_share_one_string_hash_seed(tmp_path):
    """A model that calls its modules in the order of a set of strings (issue 47, class 1): each
    process drew its own hash seed, so the n-th call on one side was another module's on the
    other. run gives every side the user's PYTHONHASHSEED, or 0, and records it."""
    f = tmp_path / "setorder.py"
    f.write_text(
        "import torch, driftcheck\n"
        "NAMES = ['alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta']\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.shared = torch.nn.Linear(8, 8)\n"
        "        self.scale = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn(8)) for n in NAMES})\n"
        "    def forward(self, x):\n"
        "        for n in set(NAMES):\n"
        "            x = torch.tanh(self.shared(x) * self.scale[n])\n"
        "        return x\n"
        "def build(seed=0):\n"
        "    torch.manual_seed(seed)\n"
        "    return driftcheck.Scenario(model=M(), inputs=[torch.randn(4, 8)], steps=1,\n"
        "                               loss=lambda out, x: out.pow(2).mean(),\n"
        "                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n")
    env = {k: v for k, v in ENV.items() if k != "PYTHONHASHSEED"}
    p = subprocess.run([sys.executable, "-m", "driftcheck", "--quiet", "run", f"{f}:build", "--target", "cpu",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    for side in ("reference", "target"):
        run = json.loads((tmp_path / "run" / side / "manifest.json").read_text())["run"]
        assert run["python_hash_seed"] == "0"

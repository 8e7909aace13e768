"""torch.compile'd training (issue 20): module paths as the eager model's, capture traced into the
graph (no break, no recompilation of its own), traced == untraced bitwise, faults inside the
compiled region caught where they are, breaks the capture causes reported as findings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import record_builtin, run_cli
from torch import nn

import driftcheck
from driftcheck.compare import compare
from driftcheck.record import taps
from driftcheck.store import TraceReader


class Block(nn.Module):
    """Linear -> BatchNorm -> ReLU(inplace) with a residual: in-place ops on a module's output
    and input, buffers written in training, an input used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.bn(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.GELU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _run(out: Path | None, backend: str | None, steps: int = 2, mode: str = "full",
         breaks: bool = False, in_place: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two AdamW steps of Net, eager or compiled (whole, or ``in_place``: one block compiled by
    ``module.compile()``), traced into ``out`` or not; (losses, params)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = model if backend is None or in_place else torch.compile(model, backend=backend)
    if in_place:
        model.blocks[1].compile(backend=backend)
    if breaks:  # the model's own graph break (a print-like call in its forward)
        inner = model.forward
        model.forward = lambda x: (torch._dynamo.graph_break(), inner(x))[1]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 8, generator=gen) for _ in range(steps)]
    losses: list[torch.Tensor] = []
    tracer = driftcheck.trace(fwd, str(out), optimizer=opt, force=True, mode=mode) if out else None
    t = tracer.__enter__() if tracer else None
    try:
        for x in xs:
            loss = fwd(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            if t is not None:
                t.step(loss)
    finally:
        if tracer is not None:
            tracer.__exit__(None, None, None)
    torch._dynamo.reset()
    return losses, [p.detach().clone() for p in model.parameters()] + \
        [b.detach().clone() for b in model.buffers()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_is_traced_under_its_own_module_paths(tmp_path: Path, backend: str) -> None:
    _run(tmp_path / "eager", None)
    _run(tmp_path / "compiled", backend)
    eager, compiled = TraceReader(tmp_path / "eager"), TraceReader(tmp_path / "compiled")
    keys = {e["key"] for e in compiled.entries}
    assert keys == {e["key"] for e in eager.entries}  # every activation and gradient, as eager
    assert not any("_orig_mod" in k for k in keys)
    assert {e["phase"] for e in compiled.entries} >= {"forward", "backward", "grads", "optimizer"}
    # the input gradient of an in-place module and of a block whose input is used twice
    assert any(e["module"] == "blocks.0.act" and e["slot"] == "grad_input.0" for e in compiled.entries)
    assert any(e["module"] == "blocks.1" and e["slot"] == "grad_input.0" for e in compiled.entries)
    run = compiled.run["compile"]
    assert run["graph_breaks"] == 0 and run["recompiles"] == 0
    assert not [f for f in compiled.manifest["findings"] if f["kind"].startswith("compile.")]
    report = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    assert report.verdict == "pass", report.decided_by


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("how", ["whole", "breaks", "in_place"])
def test_traced_compiled_training_is_bitwise_the_untraced(tmp_path: Path, backend: str, how: str) -> None:
    """Compiled whole, whole with a graph break of the model's own (the modules after it run
    as frames of their own, each module's forward a forward_tap), or one block compiled in
    place: the traced steps' losses, parameters and buffers are the untraced ones, bitwise."""
    kw = {"breaks": how == "breaks", "in_place": how == "in_place"}
    plain = _run(None, backend, **kw)
    traced = _run(tmp_path / "t", backend, **kw)
    for a, b in zip(plain[0] + plain[1], traced[0] + traced[1]):
        assert torch.equal(a, b)
    stats = _run(tmp_path / "s", backend, mode="stats", **kw)
    for a, b in zip(plain[0] + plain[1], stats[0] + stats[1]):
        assert torch.equal(a, b)
    reader = TraceReader(tmp_path / "t")
    assert not [f for f in reader.manifest["findings"]
                if f["kind"].startswith("compile.") and f["severity"] == "error"]
    if how == "in_place":  # the compiled block's output gradient, hooked in its graph
        assert any(e["key"] == "0/backward/blocks.1/0/grad_output" for e in reader.entries)


def test_the_capture_breaking_the_graph_is_an_error_finding(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    clean = tmp_path / "clean"
    _run(clean, "aot_eager")
    assert not [f for f in TraceReader(clean).manifest["findings"] if f["kind"].startswith("compile.")]
    original = taps.pre

    def breaking(tid, name, module, args, kwargs):  # a capture that Dynamo cannot trace
        if name == "blocks.1.fc":
            torch._dynamo.graph_break()
        return original(tid, name, module, args, kwargs)

    monkeypatch.setattr(taps, "pre", breaking)
    _run(tmp_path / "broken", "aot_eager")
    found = [f for f in TraceReader(tmp_path / "broken").manifest["findings"]
             if f["kind"] == "compile.graph_break"]
    assert found and found[0]["severity"] == "error"
    assert "driftcheck/record/taps.py" in found[0]["message"]


def test_the_models_own_graph_breaks_are_information(tmp_path: Path) -> None:
    _run(tmp_path / "own", "aot_eager", breaks=True)
    reader = TraceReader(tmp_path / "own")
    assert reader.run["compile"]["graph_breaks"] >= 1
    found = [f for f in reader.manifest["findings"] if f["kind"].startswith("compile.")]
    assert found and all(f["severity"] == "warning" for f in found)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.rnn, self.out = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        v, _ = self.rnn(self.fc(x))
        return self.out(v.mean(1))


def test_a_break_at_a_module_dynamo_does_not_trace_is_the_models(tmp_path: Path) -> None:
    """timm's Sequencer under the corpus's compiled targets: Dynamo breaks at every nn.LSTM
    ("Attempted to wrap RNN, GRU, or LSTM"), untraced too. The break's place is the forward
    tap's call of the LSTM's forward (a repeat's stack left out, only that place named), which
    was reported as the capture's own break, an error failing the gate."""
    from driftcheck import Scenario
    from driftcheck.record.runner import record

    torch.manual_seed(0)
    sc = Scenario(model=_Recurrent(), inputs=[torch.randn(2, 5, 8) for _ in range(2)],
                  loss=lambda o, x: o.pow(2).mean(), optimizer=lambda p: torch.optim.AdamW(p, 1e-3), steps=2)
    out = record(sc, tmp_path / "rnn", force=True, compile={"backend": "aot_eager", "mode": None, "dynamic": None})
    reader = TraceReader(out)
    assert reader.run["compile"]["graph_breaks"] >= 2  # both steps' calls of the LSTM
    breaks = [f for f in reader.manifest["findings"] if f["kind"] == "compile.graph_break"]
    assert breaks and all(f["severity"] == "warning" for f in breaks), breaks
    assert any("LSTM" in f["message"] for f in breaks)
    assert any(e["key"] == "0/backward/rnn/0/grad_input.0" for e in reader.entries)


class _DropPath(nn.Module):
    """Stochastic depth as timm and Hugging Face's BEiT write it: torch.rand in the forward."""

    def forward(self, x):
        keep = (0.7 + torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device)).floor_()
        return x / 0.7 * keep


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 8), _DropPath(), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(x + self.drop(self.fc1(x)))


def test_random_numbers_drawn_inside_an_inductor_graph_are_the_eager_ones(tmp_path: Path) -> None:
    """hf_beit against an inductor target (bench/zoo.py --compile) failed at its drop path
    (1.5e6 floors): inductor drew torch.rand from its own Philox streams. A compiled record
    makes inductor draw from the run's generator (fallback_random), as eager code does."""
    from driftcheck import Scenario
    from driftcheck.record.runner import record

    def build():
        torch.manual_seed(0)
        return Scenario(model=_Residual(), inputs=[torch.randn(16, 8) for _ in range(2)],
                        loss=lambda o, x: o.pow(2).mean(),
                        optimizer=lambda p: torch.optim.AdamW(p, 1e-3), steps=2)

    ref = record(build(), tmp_path / "ref", force=True)
    tgt = record(build(), tmp_path / "tgt", replay=ref, force=True,
                 compile={"backend": "inductor", "mode": None, "dynamic": None})
    rep = compare(str(ref), str(tgt))
    assert rep.verdict == "pass", rep.decided_by
    import torch._inductor.config as inductor_config

    assert inductor_config.fallback_random is False  # the user's setting, back after the record


class _Pooled:
    """A model output object (as Hugging Face's ModelOutput) made in the forward."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden, self.pooled = hidden, hidden[:, 0]


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return _Pooled(self.fc(x))


class _Projected(nn.Module):
    """CLIP's get_text_features: the tower's output object, its pooled tensor replaced by its
    projection after the tower's hooks ran, and read back."""

    def __init__(self) -> None:
        super().__init__()
        self.tower, self.proj = _Tower(), nn.Linear(16, 4)

    def forward(self, x):
        out = self.tower(x)
        out.pooled = self.proj(out.pooled)
        return out.pooled


def test_an_attribute_set_after_a_tap_is_read_back_in_the_graph(tmp_path: Path) -> None:
    """hf_clip against a compiled target (bench/zoo.py --compile) failed every control: torch
    2.13's Dynamo traces a tap's register_hook as a subgraph and restores its side-effect table
    after, and an object made before the tap kept writing its attribute assignments into the
    old table: the traced graph returned the unprojected pooled tensor ([6, 16], not [6, 4]).
    A compiled record makes Dynamo read the live table (record/compilation.py)."""
    from torch._dynamo.variables import dicts

    def step(out: Path | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = _Projected()
        fwd = torch.compile(model, backend="aot_eager")
        x = torch.randn(6, 3, 8)
        if out is None:
            y = fwd(x)
        else:
            with driftcheck.trace(fwd, str(out), force=True) as t:
                y = fwd(x)
                y.square().mean().backward()
                t.step(y.square().mean())
        torch._dynamo.reset()
        return y.detach()

    plain, traced = step(None), step(tmp_path / "t")
    assert plain.shape == traced.shape == (6, 4)
    assert torch.equal(traced, plain)
    assert "side_effects" not in vars(dicts.SideEffectsProxyDict)  # Dynamo as it was, after


def test_a_fault_inside_the_compiled_graph_is_found_where_it_enters(tmp_path: Path) -> None:
    from driftcheck.targets import faults

    ref = record_builtin("llama", tmp_path / "ref", steps=1)
    comp = {"backend": "aot_eager", "mode": None, "dynamic": None}
    clean = record_builtin("llama", tmp_path / "clean", replay=ref, steps=1, compile=comp)
    assert compare(str(ref), str(clean)).verdict == "pass"
    bad = record_builtin("llama", tmp_path / "bad", replay=ref, steps=1, compile=comp,
                         target_hooks=faults.scale_output("layers.1.mlp.down_proj", 1.01))
    report = compare(str(ref), str(bad))
    assert report.verdict == "fail"
    assert report.first_divergence["module"] == "layers.1.mlp.down_proj"


def test_batchnorm_stats_never_written_inside_a_compiled_graph_are_found(tmp_path: Path,
                                                                         monkeypatch) -> None:
    """The audit of a tapped norm runs at the end of the step (the graph writes buffers back
    after it runs): a clean compiled BatchNorm passes, one whose statistics are never written
    is named."""
    _run(tmp_path / "clean", "aot_eager")
    assert not [f for f in TraceReader(tmp_path / "clean").manifest["findings"]
                if f["kind"].startswith("batchnorm.")]

    def stale(self, x):  # torch_tpu 0.2.0's bug: normalised with batch statistics, never written
        return nn.functional.batch_norm(x, None, None, self.weight, self.bias, True, 0.1, self.eps)

    monkeypatch.setattr(nn.BatchNorm1d, "forward", stale)
    _run(tmp_path / "stale", "aot_eager")
    found = [f for f in TraceReader(tmp_path / "stale").manifest["findings"]
             if f["kind"].startswith("batchnorm.")]
    assert {f["module"] for f in found} == {"blocks.0.bn", "blocks.1.bn"}


def test_record_compiles_a_scenario_and_replays_into_a_compiled_build(tmp_path: Path, capsys) -> None:
    """A build() that returns torch.compile(model) replays an eager reference's weights (its
    paths carry no _orig_mod.), and --compile compiles a plain one; both align with the eager
    reference entry by entry (with the built-in mlp's dropout masks reproduced in the graph)."""
    scen = tmp_path / "compiled_scen.py"
    scen.write_text(
        "import torch\nfrom driftcheck.loader import load_scenario\n\n"
        "def build():\n    s = load_scenario('mlp')\n    s.model = torch.compile(s.model, backend='aot_eager')\n"
        "    return s\n")
    ref = tmp_path / "ref"
    assert run_cli(["record", "mlp", "--out", ref], capsys)[0] == 0
    assert run_cli(["record", f"{scen}:build", "--out", tmp_path / "user", "--replay", ref], capsys)[0] == 0
    assert run_cli(["record", "mlp", "--out", tmp_path / "cli", "--replay", ref, "--compile"],
                   capsys)[0] == 0  # inductor, which may move the taps' ordered ops
    keys = {e["key"] for e in TraceReader(ref).entries}
    for side in ("user", "cli"):
        manifest = json.loads((tmp_path / side / "manifest.json").read_text())
        assert manifest["run"]["compile"]["graph_breaks"] == 0
        got = {e["key"] for e in TraceReader(tmp_path / side).entries}
        assert {k for k in got if "/local." not in k} == keys  # no gap
        # --compile replays locally by default, each leaf's code compiled on its own (issue 44);
        # a user's own torch.compile build gets no module replay (its settings are not known),
        # only the optimizer step redone on the host (record/update.py: no compiled code in it)
        assert any("/local." in k and "/optimizer/" not in k for k in got) == (side == "cli")
        assert any("/optimizer/" in k and "/local.param." in k for k in got)
        code, out, _ = run_cli(["compare", ref, tmp_path / side], capsys)
        assert code == 0, out


def test_the_tpu_backend_gets_capturable_optimizers_and_others_keep_theirs() -> None:
    from driftcheck.record.compilation import prepare_optimizer

    params = [nn.Parameter(torch.ones(2))]
    adam = torch.optim.AdamW(params)
    assert prepare_optimizer(adam, {"backend": "inductor"}) == []
    assert adam.param_groups[0]["capturable"] is False
    assert prepare_optimizer(adam, {"backend": "tpu"}) == ["AdamW"]
    assert adam.param_groups[0]["capturable"] is True
    sgd = torch.optim.SGD(params, lr=0.1)  # no such option: left as it is
    assert prepare_optimizer(sgd, {"backend": "tpu"}) == []


def test_the_tpu_backend_is_checked_against_torch_tpu_and_the_device(monkeypatch) -> None:
    from driftcheck.errors import DriftcheckError
    from driftcheck.record.compilation import settings
    from driftcheck.targets import devices

    with pytest.raises(DriftcheckError, match="torch_tpu's backend: pip install torch-tpu"):
        settings("tpu")  # no torch_tpu here: the real error path
    monkeypatch.setattr(devices, "torch_tpu_version", lambda: "0.2.0")  # as if installed
    with pytest.raises(DriftcheckError, match="compiles for a TPU, not --device cpu"):
        settings("tpu", device=torch.device("cpu"))
    assert settings("tpu") == {"backend": "tpu", "mode": None, "dynamic": False}
    assert settings("inductor", "max-autotune", True) == {"backend": "inductor",
                                                          "mode": "max-autotune", "dynamic": True}
    assert settings(None) is None


class WithLoss(nn.Module):
    """A model that computes its own loss from its logits (Hugging Face models given labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.body(x)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _run_with_loss(out: Path, compiled: bool, skip_root: bool = False) -> TraceReader:
    """One SGD step of WithLoss, eager or under ``torch.compile`` (aot_eager), traced into ``out``;
    ``skip_root``: the root's forward tap is skipped as a frame, as Dynamo skips a forward it
    cannot trace (Hugging Face ResNet's)."""
    torch.manual_seed(0)
    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    with driftcheck.trace(fwd, str(out), optimizer=opt, force=True) as t:
        if skip_root:
            torch._dynamo.eval_frame.skip_code(model.forward.__func__.__code__)
        loss = fwd(x, y)["loss"]
        loss.backward()
        opt.step()
        t.step(loss)
    torch._dynamo.reset()
    return TraceReader(out)


@pytest.mark.parametrize("hooks_in_graph", ["inline_hooks", "forward_tap", "neither"])
def test_an_output_the_graph_consumes_itself_keeps_its_gradient(tmp_path: Path, monkeypatch,
                                                                hooks_in_graph: str) -> None:
    """The gradient of logits that the model's own loss consumes is computed inside the compiled
    backward: the root's output hook must be in the graph to see it, either because the root's
    hooks are traced (``inline_hooks``) or because its forward is a ``forward_tap``, whose
    output hooks are graph code. Left around the graph, as Dynamo calls a user model's hooks by
    default, the hook misses it: a gap."""
    from driftcheck.record import compilation, taps

    if hooks_in_graph != "inline_hooks":
        monkeypatch.setattr(compilation, "inline_hooks", lambda m: m)
    if hooks_in_graph == "neither":
        monkeypatch.setattr(taps, "forward_tap", lambda *a: None)

    eager, compiled = _run_with_loss(tmp_path / "e", False), _run_with_loss(tmp_path / "c", True)
    key = "0/backward/./0/grad_output.logits"
    assert any(e["key"] == key for e in eager.entries)
    same = {e["key"] for e in compiled.entries} == {e["key"] for e in eager.entries}
    assert same is (hooks_in_graph != "neither")
    if same:
        ref, got = (r.tensor(next(e for e in r.entries if e["key"] == key)) for r in (eager, compiled))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    # A gradient the compiled capture did not get is a gap, said as a warning, not a failure
    # of the gate; every value both sides hold is still judged.
    report = compare(str(tmp_path / "e"), str(tmp_path / "c"))
    kinds = {f.kind for f in report.findings}
    assert "alignment.missing_in_target" not in kinds
    assert ("compile.capture_gap" in kinds) is (hooks_in_graph == "neither")
    assert report.verdict == "pass"


def test_a_break_is_the_captures_only_where_its_stack_passes_through_capture_code() -> None:
    """Every stack Dynamo reports starts in the training loop that called the model (loop.py):
    that frame does not make a model's own break (MoE routing's nonzero) the capture's."""
    import os

    from driftcheck.record.compilation import _model_line, _our_line

    pkg = os.path.dirname(driftcheck.__file__)
    loop = f'File "{pkg}/record/loop.py", line 47, in train\n'
    model = 'File "/home/u/moe.py", line 184, in forward\n    idx = mask.nonzero()\n'
    assert _our_line(loop + model) is None
    assert _model_line(loop + model) == "/home/u/moe.py:184"
    tap = f'File "{pkg}/record/taps.py", line 101, in pre\n'
    assert _our_line(loop + model + tap) == "driftcheck/record/taps.py:101"
    assert _our_line("guard  # driftcheck/record/hooks.py:30 in _enter") == "driftcheck/record/hooks.py:30"


class _Backbone(nn.Module):
    """A backbone whose forward consumes its own output (HF's pooler on last_hidden_state)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.pool = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return h, self.pool(h)


class _UsesBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = _Backbone()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, p = self.backbone(x)
        return self.head(p) + 0.5 * h.sum(-1, keepdim=True)  # h used outside the backbone too


@pytest.mark.parametrize("forward_tap", [True, False])
def test_a_submodule_compiled_in_place_is_no_false_failure(tmp_path, monkeypatch, forward_tap):
    """``backbone.compile()``: Dynamo runs its hooks around its compiled forward, where a hook on
    its output would see only the gradient from the parent's use, not the pooler's inside (a
    false failure against the eager reference: 0.27 apart). Its forward_tap hooks the outputs in
    the graph: every entry is there and judged, the output gradients equal the eager ones. Without
    it (a forward with no code of its own) they are capture gaps, never a hook's partial sum."""
    from driftcheck.record import taps

    if not forward_tap:
        monkeypatch.setattr(taps, "forward_tap", lambda *a: None)

    def run(out: Path, compiled: bool) -> Path:
        torch.manual_seed(0)
        model, x = _UsesBoth(), torch.randn(4, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if compiled:
            model.backbone.compile(backend="aot_eager")
        with driftcheck.trace(model, out, mode="full", optimizer=opt) as t:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            t.step(loss)
        assert "forward" not in model.backbone.__dict__  # the module's own forward again
        return out

    ref, tgt = run(tmp_path / "ref", False), run(tmp_path / "tgt", True)
    torch._dynamo.reset()
    rep = compare(str(ref), str(tgt))
    assert rep.verdict == "pass"
    outs = ["0/backward/backbone/0/grad_output.0", "0/backward/backbone/0/grad_output.1"]
    gaps = [f for f in rep.findings if f.kind == "compile.capture_gap"]
    assert [(f.module, sorted(f.details["keys"])) for f in gaps] == \
        ([] if forward_tap else [("backbone", outs)])
    assert not [f for f in rep.findings if f.severity == "error"]
    r, t = TraceReader(ref), TraceReader(tgt)
    theirs = {e["key"]: e for e in t.manifest["entries"]}
    judged = [e for e in r.manifest["entries"] if e["key"] in theirs]
    assert len(judged) == len(r.manifest["entries"]) - (0 if forward_tap else 2)
    inner = ["0/backward/backbone.body/0/grad_output", "0/backward/backbone.pool/0/grad_output"]
    for key in inner + (outs if forward_tap else []):  # the inner ones tapped in the graph too
        mine = next(e for e in judged if e["key"] == key)
        torch.testing.assert_close(t.tensor(theirs[key]), r.tensor(mine), rtol=1e-6, atol=1e-7)


class _ReturnsBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = _Backbone()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backbone(x)  # the compiled submodule's outputs, as they are


def test_an_eager_parent_returning_a_compiled_modules_outputs_gets_their_whole_gradient(tmp_path):
    """The root runs eagerly and returns what ``backbone.compile()``'s graph made (a Hugging Face
    model's logits where its forward is not traced): an eager hook on them would miss the use
    inside the graph; their gradient is the one the backbone's forward_tap hooked in the graph."""
    def run(out: Path, compiled: bool) -> TraceReader:
        torch.manual_seed(0)
        model, x = _ReturnsBackbone(), torch.randn(4, 8)
        if compiled:
            model.backbone.compile(backend="aot_eager")
        with driftcheck.trace(model, out, mode="full") as t:
            h, p = model(x)
            loss = h.pow(2).mean() + p.sum()
            loss.backward()
            t.step(loss)
        return TraceReader(out)

    ref, tgt = run(tmp_path / "ref", False), run(tmp_path / "tgt", True)
    torch._dynamo.reset()
    assert {e["key"] for e in tgt.entries} == {e["key"] for e in ref.entries}
    for slot in ("grad_output.0", "grad_output.1"):
        key = f"0/backward/./0/{slot}"
        mine, theirs = (r.tensor(next(e for e in r.entries if e["key"] == key)) for r in (ref, tgt))
        torch.testing.assert_close(theirs, mine, rtol=1e-6, atol=1e-7)
    assert compare(str(tmp_path / "ref"), str(tmp_path / "tgt")).verdict == "pass"


def test_a_deep_copy_of_a_traced_compiled_model_computes_with_its_own_weights(tmp_path):
    """An EMA model deep-copied inside the trace copies each module's forward_tap with it: bound
    to the copy, it calls the copy's forward, never the traced module's; the signature a
    Trainer reads off ``model.forward`` is the forward's own."""
    import copy
    import inspect

    model = WithLoss()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    fwd = torch.compile(model, backend="aot_eager")
    with driftcheck.trace(fwd, str(tmp_path / "t"), force=True) as t:
        assert "forward" in model.__dict__ and "forward" in model.head.__dict__
        assert list(inspect.signature(model.forward).parameters) == ["x", "labels"]
        ema = copy.deepcopy(model)
        with torch.no_grad():
            for p in ema.parameters():
                p.zero_()
        assert torch.equal(ema(x, y)["logits"], torch.zeros(4, 5))
        loss = fwd(x, y)["loss"]
        loss.backward()
        t.step(loss)
    torch._dynamo.reset()
    assert "forward" not in model.__dict__ and "forward" not in model.head.__dict__


def test_a_forward_dynamo_skips_runs_its_tap_eagerly(tmp_path, monkeypatch):
    """Dynamo gives up on a model's forward (as on Hugging Face ResNet's) and runs it eagerly,
    compiling what it calls as frames of their own: the skipped forward tap's graph code then runs
    eagerly too, never as a frame the capture compiles (that was a compile.graph_break error);
    every entry but the root's output gradients (made by compiled frames: gaps) is taken."""
    from driftcheck.record import compilation

    monkeypatch.setattr(compilation, "inline_hooks", lambda m: m)  # the root's hooks stay eager

    eager = _run_with_loss(tmp_path / "e", False)
    compiled = _run_with_loss(tmp_path / "c", True, skip_root=True)
    assert not [f for f in compiled.manifest["findings"] if f["kind"].startswith("compile.")
                and f["severity"] == "error"]
    missing = {e["key"] for e in eager.entries} - {e["key"] for e in compiled.entries}
    assert missing <= {"0/backward/./0/grad_output.loss", "0/backward/./0/grad_output.logits"}
    assert {e["key"] for e in compiled.entries} <= {e["key"] for e in eager.entries}
    assert compare(str(tmp_path / "e"), str(tmp_path / "c")).verdict == "pass"


class _MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y if mask is None else y * mask


class _BuildsAMaskWhenCompiled(nn.Module):
    """As Hugging Face models do: a mask tensor built while Dynamo traces, None in eager mode."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _MaskedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], 4) if torch.compiler.is_compiling() else None
        return self.head(x, mask=mask)


def test_an_input_only_compiled_code_passes_is_an_input_gap_not_an_alignment_error(tmp_path):
    def run(out: Path, compiled: bool) -> Path:
        torch.manual_seed(0)
        model = _BuildsAMaskWhenCompiled()
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        with driftcheck.trace(fwd, str(out), force=True) as t:
            loss = fwd(torch.randn(4, 8)).square().mean()
            loss.backward()
            t.step(loss)
        torch._dynamo.reset()
        return out

    ref, tgt = run(tmp_path / "e", False), run(tmp_path / "c", True)
    assert any(e["key"] == "0/forward/head/0/input.mask" for e in TraceReader(tgt).entries)
    report = compare(str(ref), str(tgt))
    gaps = [f for f in report.findings if f.kind == "compile.input_gap"]
    assert [(f.module, f.details["keys"]) for f in gaps] == [("head", ["0/forward/head/0/input.mask"])]
    assert not [f for f in report.findings if f.kind.startswith("alignment.")]
    assert report.verdict == "pass"


class _RMSNorm(nn.Module):
    """A Llama norm: ``x.float()`` of a float32 ``x`` is ``x`` itself, used twice inside."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class _PreNorm(nn.Module):
    """Pre-norm residual blocks: each norm's input is also the residual (used outside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(_RMSNorm(16) for _ in range(3))
        self.fcs = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs):
            x = x + torch.tanh(fc(norm(x)))
        return self.head(x)


def _prenorm_grads(out: Path | None, backend: str, dynamic: bool, dtype: torch.dtype = torch.float32
                   ) -> tuple[list[torch.Tensor], list[dict]]:
    return _compiled_grads(_PreNorm, out, backend, dynamic, dtype)


def _compiled_grads(build: type, out: Path | None, backend: str = "aot_eager", dynamic: bool = False,
                    dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[dict]]:
    """One compiled step of ``build()``: its parameter gradients, and where traced into ``out``
    (stats mode) the record's compile.* findings."""
    torch.manual_seed(0)
    model = build().to(dtype)
    fwd = torch.compile(model, backend=backend, dynamic=dynamic or None)
    x = (torch.randn(32, 16, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    found: list[dict] = []
    if out is None:
        fwd(x).square().mean().backward()
    else:
        with driftcheck.trace(fwd, str(out), force=True, mode="stats") as t:
            loss = fwd(x).square().mean()
            loss.backward()
            t.step(loss)
        found = [f for f in TraceReader(out).manifest["findings"] if f["kind"].startswith("compile.")]
    torch._dynamo.reset()
    return [p.grad.clone() for p in model.parameters()], found


@pytest.mark.parametrize("backend,dynamic", [("aot_eager", False), ("inductor", False),
                                             ("aot_eager", True)])
def test_a_regrouped_gradient_sum_is_reported_and_is_the_only_difference(
        tmp_path: Path, backend: str, dynamic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm that uses its input twice, the input also the residual: the view the norm is
    handed for its input gradient adds its two gradients first, where untraced autograd adds all
    three in arrival order. The record says so (compile.regrouped_gradients, naming each norm)
    and nothing else differs: with those views left out, the gradients are the untraced ones,
    bitwise. The test model of the bitwise test reports none. With dynamic shapes too (the
    hooks then carry the sizes they close over)."""
    plain, _ = _prenorm_grads(None, backend, dynamic)
    traced, found = _prenorm_grads(tmp_path / "t", backend, dynamic)
    assert not all(torch.equal(a, b) for a, b in zip(plain, traced))  # the effect is real here
    assert [f["kind"] for f in found] == ["compile.regrouped_gradients"]
    assert found[0]["severity"] == "warning"
    assert found[0]["details"]["modules"] == ["norms.1", "norms.2"]  # norms.0: x needs no grad
    original = taps.pre

    def unviewed(tid, name, module, args, kwargs):
        got = original(tid, name, module, args, kwargs)
        return None if name.startswith("norms.") else got

    monkeypatch.setattr(taps, "pre", unviewed)
    without, found = _prenorm_grads(tmp_path / "u", backend, dynamic)
    assert not found
    for a, b in zip(plain, without):
        assert torch.equal(a, b)
    _run(tmp_path / "net", backend, mode="stats")
    assert not [f for f in TraceReader(tmp_path / "net").manifest["findings"]
                if f["kind"] == "compile.regrouped_gradients"]


def test_a_norm_that_copies_its_input_regroups_nothing(tmp_path: Path) -> None:
    """In bfloat16 the norm's ``x.float()`` is a copy, its one use of ``x`` (``type_as(x)`` reads
    only x's dtype): no finding, and the traced gradients are the untraced ones, bitwise."""
    plain, _ = _prenorm_grads(None, "aot_eager", False, torch.bfloat16)
    traced, found = _prenorm_grads(tmp_path / "t", "aot_eager", False, torch.bfloat16)
    assert not found
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)


class _DtypeOnly(nn.Module):
    """A rotary embedding's way with its input: it reads the dtype, never the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((16,), 0.5, dtype=x.dtype, device=x.device)


class _ResidualLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rotary, self.layer = nn.Linear(16, 16), _DtypeOnly(), _ResidualLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.layer(h) * self.rotary(h)


def test_a_module_that_reads_only_the_dtype_is_no_outside_use(tmp_path: Path) -> None:
    """A layer uses its input twice (its norm, the residual); the input also goes to a module
    that reads only its dtype (its input view takes no gradient): all of the input's gradient
    comes through the layer's view, added as untraced. No finding, gradients bitwise (a first
    version counted the other view and named Hugging Face Llama's first decoder layer)."""
    plain, _ = _compiled_grads(_WithRotary, None)
    traced, found = _compiled_grads(_WithRotary, tmp_path / "t")
    assert not found
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _ResidualLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _NestedViews(nn.Module):
    """The residual layer's two uses of its input come through two views (its own and its
    wrapper's); the input is used outside the wrapper too (a diffusers down block's skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block = nn.Linear(16, 16), _Wrapped()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.block(h) + torch.tanh(h)


def test_a_sum_regrouped_through_nested_views_names_each_view(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients counted through the views of modules handed the input on: both views hold two of
    the input's three gradients, both are named, and with their views left out the gradients
    are the untraced ones, bitwise (a first version looked one view deep and named neither)."""
    plain, _ = _compiled_grads(_NestedViews, None)
    _, found = _compiled_grads(_NestedViews, tmp_path / "t")
    assert [f["details"]["modules"] for f in found] == [["block", "block.inner"]]
    original = taps.pre
    monkeypatch.setattr(taps, "pre", lambda tid, name, *a: None if name.startswith("block")
                        else original(tid, name, *a))
    without, found = _compiled_grads(_NestedViews, tmp_path / "u")
    assert not found
    for a, b in zip(plain, without):
        assert torch.equal(a, b)

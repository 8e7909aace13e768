"""The tracer: what it captures, copies at hook time, call indices, and no effect on the numbers."""
from __future__ import annotations

import pytest
import torch
from conftest import BUILTINS
from torch import nn

from driftcheck.loader import load_scenario
from driftcheck.nested import flatten
from driftcheck.record.rng import DropoutControl
from driftcheck.record.runner import record, train
from driftcheck.record.tracer import Tracer
from driftcheck.store import TraceReader


class BnReluNet(nn.Module):
    """Conv -> BatchNorm -> ReLU(inplace=True), the ResNet pattern that breaks full backward hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.head(x.mean((2, 3)))


class Twice(nn.Module):
    """One Linear applied twice in a step: weight sharing."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(x)))


def _scenario(model, x, loss=lambda out, b: out.pow(2).mean()):
    from driftcheck import Scenario

    return Scenario(model=model, inputs=x, loss=loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1)


def _by_key(reader):
    return {(e["step"], e["phase"], e["module"], e["call"], e["slot"]): e for e in reader.entries}


def test_round_trip_values_match_what_the_model_computed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(4, 3)
    expected_hidden = torch.tanh(model[0](x)).detach()
    record(_scenario(model, x), tmp_path / "t", model_id="seq")
    r = TraceReader(tmp_path / "t")
    e = _by_key(r)
    assert torch.equal(r.tensor(e[(0, "forward", "0", 0, "input.0")]), x)
    assert torch.equal(r.tensor(e[(0, "forward", "1", 0, "output")]), expected_hidden)
    stats = e[(0, "forward", "1", 0, "output")]["stats"]
    assert stats["numel"] == 20 and stats["max"] == pytest.approx(float(expected_hidden.max()))
    phases = {k[1] for k in e}
    assert phases == {"params", "forward", "loss", "backward", "grads", "optimizer"}
    # parameter before and after the step differ by exactly lr * grad
    w0 = r.tensor(e[(0, "params", "0", 0, "param.weight")])
    g = r.tensor(e[(0, "grads", "0", 0, "param.weight")])
    w1 = r.tensor(e[(0, "optimizer", "0", 0, "param.weight")])
    assert torch.equal(w1, w0 - 0.1 * g)


def test_bn_then_inplace_relu_output_is_copied_at_hook_time(tmp_path):
    torch.manual_seed(0)
    record(_scenario(BnReluNet(), torch.randn(2, 3, 6, 6)), tmp_path / "t", model_id="bnrelu")
    r = TraceReader(tmp_path / "t")
    e = _by_key(r)
    bn_out = r.tensor(e[(0, "forward", "bn", 0, "output")])
    relu_out = r.tensor(e[(0, "forward", "relu", 0, "output")])
    assert bn_out.min() < 0, "the BatchNorm output must keep its negative values"
    assert relu_out.min() == 0
    assert torch.equal(relu_out, bn_out.clamp(min=0))
    # backward through the in-place ReLU: both the grad w.r.t. its output and its input
    g_in = r.tensor(e[(0, "backward", "relu", 0, "grad_input.0")])
    g_out = r.tensor(e[(0, "backward", "relu", 0, "grad_output")])
    assert torch.equal(g_in, g_out * (bn_out > 0))
    assert (0, "backward", "bn", 0, "grad_input.0") in e


def test_module_called_twice_gets_call_indices(tmp_path):
    torch.manual_seed(0)
    record(_scenario(Twice(), torch.randn(3, 4)), tmp_path / "t", model_id="twice")
    e = _by_key(TraceReader(tmp_path / "t"))
    for call in (0, 1):
        assert (0, "forward", "shared", call, "output") in e
        assert (0, "backward", "shared", call, "grad_output") in e
    # the model input needs no gradient; the second call's input (tanh of the first) does
    assert (0, "backward", "shared", 0, "grad_input.0") not in e
    assert (0, "backward", "shared", 1, "grad_input.0") in e
    assert (0, "forward", "shared", 2, "output") not in e
    assert e[(0, "forward", "shared", 1, "input.0")]["order"] > e[(0, "forward", "shared", 0, "output")]["order"]


def _record_sum_loss(m: nn.Module, x: torch.Tensor, out, model_id: str) -> tuple[TraceReader, dict]:
    """Record ``m`` trained on ``x`` with loss = sum of the output; the reader and its entries."""
    record(_scenario(m, x, loss=lambda y, b: y.sum()), out, model_id=model_id)
    r = TraceReader(out)
    return r, _by_key(r)


def test_grad_input_is_the_modules_own_contribution(tmp_path):
    """x feeds two branches; each branch's grad_input is its part, not the sum."""

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.pre = nn.Linear(3, 3)

        def forward(self, x):
            h = self.pre(x)
            return self.a(h) + 2 * self.b(h)

    torch.manual_seed(0)
    m = Branches()
    x = torch.randn(2, 3)
    r, e = _record_sum_loss(m, x, tmp_path / "t", "br")
    ga = r.tensor(e[(0, "backward", "a", 0, "grad_input.0")])
    gb = r.tensor(e[(0, "backward", "b", 0, "grad_input.0")])
    w_a = r.tensor(e[(0, "params", "a", 0, "param.weight")])
    w_b = r.tensor(e[(0, "params", "b", 0, "param.weight")])
    assert torch.allclose(ga, torch.ones(2, 3) @ w_a)
    assert torch.allclose(gb, 2 * torch.ones(2, 3) @ w_b)
    g_pre_out = r.tensor(e[(0, "backward", "pre", 0, "grad_output")])
    assert torch.allclose(g_pre_out, ga + gb)


def test_nested_structures_and_none_are_flattened():
    out = {"logits": torch.ones(2), "aux": None, "pkv": ((torch.zeros(1), torch.ones(1)),), "n": 3}
    slots = [s for s, _ in flatten(out, "output")]
    assert slots == ["output.logits", "output.pkv.0.0", "output.pkv.0.1"]


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_traced_equals_untraced_bitwise(name, dtype, tmp_path):
    """Same scenario, same seed: loss, outputs and updated parameters are bitwise equal."""
    from driftcheck.numerics.dtypes import parse_cli as parse_dtype
    from driftcheck.store import TraceWriter

    results, states = [], []
    for traced in (False, True):
        sc = load_scenario(name, 0)
        torch.manual_seed(0)
        model = sc.model.to(parse_dtype(dtype))
        opt = sc.optimizer(model.parameters())
        batches = [sc.batch(i) for i in range(sc.steps)]
        tracer = None
        if traced:
            writer = TraceWriter(tmp_path / "t", force=True)
            tracer = Tracer(model, writer, optimizer=opt).attach()
        res = train(model, batches, sc, opt, device=torch.device("cpu"), dtype=parse_dtype(dtype),
                    dropout=DropoutControl(0), tracer=tracer)
        if tracer is not None:
            tracer.detach()
            assert len(writer.entries) > 50
        results.append(res)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for a, b in zip(*results):
        assert torch.equal(a["loss"], b["loss"])
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_records_all_phases(traces, name):
    for dtype in ("fp32", "bf16"):
        r = TraceReader(traces[name][dtype])
        phases = {e["phase"] for e in r.entries}
        assert phases == {"params", "forward", "loss", "backward", "grads", "optimizer"}, dtype
        assert r.run["steps"] == 2
        modules = {e["module"] for e in r.entries if e["phase"] == "backward"}
        assert len(modules) >= 5
        assert any(e["slot"].startswith("grad_input") for e in r.entries)
        dt = {e["dtype"] for e in r.entries if e["phase"] == "forward" and e["slot"] == "output"}
        assert dt == {"float32" if dtype == "fp32" else "bfloat16"}


def test_huggingface_model_output_is_captured(tmp_path):
    transformers = pytest.importorskip("transformers")
    from driftcheck import Scenario

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    sc = Scenario(model=model, inputs=batch, loss=lambda out, b: out.loss,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=1)
    record(sc, tmp_path / "t", model_id="hf-llama")
    e = _by_key(TraceReader(tmp_path / "t"))
    assert (0, "forward", "", 0, "output.logits") in e
    assert (0, "forward", "", 0, "output.loss") in e
    assert (0, "forward", "", 0, "input.input_ids") in e
    assert (0, "backward", "model.layers.0.self_attn.q_proj", 0, "grad_input.0") in e
    assert (0, "forward", "model.layers.0.self_attn", 0, "input.hidden_states") in e


def test_dropout_masks_are_reproducible_across_runs(traces):
    """mlp has dropout: two fp32 records from the same replay are bitwise identical."""
    a, b = TraceReader(traces["mlp"]["fp32"]), TraceReader(traces["mlp"]["fp32b"])
    eb = _by_key(b)
    for e in a.entries:
        t = b.tensor(eb[(e["step"], e["phase"], e["module"], e["call"], e["slot"])])
        assert torch.equal(a.tensor(e), t), e["key"]


def test_huggingface_cache_objects_are_captured(tmp_path):
    """A model returning a KV cache object (transformers' DynamicCache) and None fields."""
    transformers = pytest.importorskip("transformers")
    from driftcheck import Scenario

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding
    sc = Scenario(model=model, inputs={"input_ids": ids, "attention_mask": mask, "use_cache": True},
                  loss=lambda out, b: out.logits.float().pow(2).mean(),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1)
    record(sc, tmp_path / "t", model_id="hf-llama-cache")
    keys = _by_key(TraceReader(tmp_path / "t"))
    cache = [k for k in keys if k[1] == "forward" and k[2] == "" and "cache" in k[4]]
    assert cache, "the KV cache returned by the model must be recorded"
    assert (0, "forward", "", 0, "input.attention_mask") in keys


def test_library_api_trace_context_manager(tmp_path):
    """Users who drive their own loop: driftcheck.trace(...) and t.step(loss)."""
    import driftcheck

    def run(out, dtype):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1)).to(dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        with driftcheck.trace(model, out=out, optimizer=opt) as t:
            for _ in range(3):
                x = torch.randn(16, 4, generator=gen).to(dtype)
                loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                t.step(loss)
        return out

    a = run(tmp_path / "a", torch.float32)
    b = run(tmp_path / "b", torch.bfloat16)
    r = TraceReader(a)
    assert r.run["steps"] == 3
    assert {e["phase"] for e in r.entries} == {"params", "forward", "loss", "backward", "grads", "optimizer"}
    from driftcheck.compare import compare

    assert compare(a, a).verdict == "pass"
    rep = compare(a, b)
    assert rep.verdict == "pass", rep.decided_by
    assert max(e.metrics.get("rel_l2", 0) for e in rep.entries) > 1e-3


def test_the_magnitude_cache_follows_in_place_weight_updates():
    from driftcheck.record.meta import magnitude_sq as _magnitude_sq

    lin = torch.nn.Linear(6, 3)
    x = torch.randn(4, 6)
    cache: dict = {}
    first = _magnitude_sq(lin, x, cache)
    assert torch.allclose(first, _magnitude_sq(lin, x), rtol=1e-6)
    assert _magnitude_sq(lin, x, cache) is not first
    assert len([k for k in cache if not isinstance(k, tuple)]) == 1  # one weight's column sums
    assert len([k for k in cache if isinstance(k, tuple)]) == 1  # one input's, shared
    with torch.no_grad():
        lin.weight.mul_(3.0)  # an optimizer step: the version counter moves
    again = _magnitude_sq(lin, x, cache)
    assert torch.allclose(again, 9 * first, rtol=1e-5)
    want = ((x**2) @ (lin.weight.detach()**2).t()).mean()
    assert torch.allclose(again, want, rtol=1e-5)
    x.mul_(2.0)  # the input written in place: its column sums are taken again
    assert torch.allclose(_magnitude_sq(lin, x, cache), 4 * want, rtol=1e-5)
    other = torch.nn.Linear(6, 5)  # another projection of the same input (q, k, v)
    want_other = ((x**2) @ (other.weight.detach()**2).t()).mean()
    assert torch.allclose(_magnitude_sq(other, x, cache), want_other, rtol=1e-5)


class _Deep(nn.Module):
    """A residual block over many small ops and nested modules: a large autograd subgraph whose
    walk creates and drops many node wrappers, with the block input also used outside."""

    def __init__(self, width: int = 6, depth: int = 12):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(depth))
        self.skip = nn.Identity()  # its output node is its input's, made before the call

    def forward(self, x):
        h0 = h = self.norm(x)
        for i, layer in enumerate(self.layers):
            h = layer(h) * 0.5 + h.sin() * (0.1 * i) + h
        h += self.skip(h0)  # in place, as ResNet's residual add
        return h + x


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.deep = _Deep()

    def forward(self, x):
        y = self.pre(x)
        return (self.deep(y) * y).sum(-1) + y.mean()  # y also used outside "deep"


def test_grad_input_of_nested_composites_is_their_own_contribution(tmp_path):
    """Every module's grad_input, leaves and composites nested three deep, equals the
    contribution autograd computes through that call alone (its output's gradient pulled back
    through the call), on a graph of hundreds of nodes."""
    torch.manual_seed(0)
    m = _Outer()
    x = torch.randn(4, 6)
    r, e = _record_sum_loss(m, x, tmp_path / "t", "deep")
    with_grad_input = {k[2] for k in e if k[0] == 0 and k[1] == "backward" and k[4] == "grad_input.0"}
    # every call whose input needs a gradient and that computes with it ("pre"'s input is the
    # data; the ModuleList is never called; an Identity makes no autograd node of its own)
    assert with_grad_input == {n for n, _ in m.named_modules()} - {"", "pre", "deep.layers", "deep.skip"}
    checked = 0
    for (step, phase, mod, call, slot), entry in e.items():
        if phase != "backward" or slot != "grad_input.0" or step != 0 or mod == "":
            continue
        # autograd truth: rerun the call from its recorded input, pull back its grad_output
        module = m.get_submodule(mod)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(r.tensor(e[(0, "params", f"{mod}.{name}".rpartition(".")[0], 0,
                                    "param." + name.rpartition(".")[2])]))
        inp = r.tensor(e[(0, "forward", mod, call, "input.0")]).requires_grad_(True)
        out = module(inp)
        (g_in,) = torch.autograd.grad(out, inp, r.tensor(e[(0, "backward", mod, call, "grad_output")]))
        assert torch.allclose(r.tensor(entry), g_in, rtol=1e-5, atol=1e-6), (mod, call)
        checked += 1
    assert checked == len(with_grad_input)


@pytest.mark.parametrize("args", [
    dict(in_channels=16, out_channels=4, kernel_size=4, stride=2, padding=1),
    dict(in_channels=8, out_channels=6, kernel_size=3, stride=1, padding=1, groups=2),
    dict(in_channels=8, out_channels=8, kernel_size=(2, 3), stride=(2, 1), groups=4)])
def test_transposed_convolution_magnitude_matches_its_definition(args):
    """mean over outputs of sum x^2 w^2, which is conv_transpose(x^2, w^2): a transposed
    convolution's weight is (C_in, C_out/groups, *kernel), not a convolution's layout (taking
    it for one crashed every record of a model with ConvTranspose2d)."""
    import torch.nn.functional as F

    from driftcheck.record.meta import magnitude_sq as _magnitude_sq

    torch.manual_seed(0)
    m = nn.ConvTranspose2d(**args)
    x = torch.randn(2, args["in_channels"], 12, 12)
    with torch.no_grad():
        exact = F.conv_transpose2d(x * x, m.weight * m.weight, stride=m.stride, padding=m.padding,
                                   groups=m.groups).mean()
    assert float(_magnitude_sq(m, x)) == pytest.approx(float(exact), rel=0.25)


def test_a_model_with_a_transposed_convolution_records_and_passes_bf16(tmp_path):
    from driftcheck.compare import compare
    from driftcheck.record.runner import record
    from driftcheck.scenario import Scenario

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(4, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                              nn.ConvTranspose2d(16, 4, 4, stride=2, padding=1))
        g = torch.Generator().manual_seed(0)
        return Scenario(model=model, inputs=[torch.randn(4, 4, 16, 16, generator=g)],
                        loss=lambda out, x: (out - x).pow(2).mean(),
                        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), steps=2)

    ref = record(build(), tmp_path / "r")
    rep = compare(ref, record(build(), tmp_path / "t", dtype="bf16", replay=ref))
    assert rep.verdict == "pass", rep.first_divergence
    out = next(e for e in rep.entries if e.key == "0/forward/3/0/output")
    assert out.details["floor"]["scale_rms"] > 0


def test_a_sparse_gradient_is_recorded_dense(tmp_path):
    """nn.Embedding(sparse=True) gives its weight a sparse COO gradient: the record crashed on
    it (reshape is not implemented for sparse tensors). It is recorded as the dense tensor."""
    from driftcheck.scenario import Scenario

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(100, 16, sparse=True), nn.Flatten(), nn.Linear(96, 4))
        g = torch.Generator().manual_seed(0)
        return Scenario(model=model, inputs=[torch.randint(0, 100, (8, 6), generator=g)],
                        loss=lambda out, x: out.pow(2).mean(),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1)

    sc = build()
    model = sc.model
    sc.loss(model(sc.inputs[0]), None).backward()
    expected = model[0].weight.grad.to_dense()
    out = record(build(), tmp_path / "t")
    reader = TraceReader(out)
    e = next(e for e in reader.entries if e["key"] == "0/grads/0/0/param.weight")
    assert e["shape"] == [100, 16] and torch.equal(reader.tensor(e), expected)


def test_library_trace_records_the_models_dtype_precision_and_an_id(tmp_path):
    """driftcheck.trace on a bf16 model: the manifest says bfloat16 (it said None, and the
    precision float32, so no precision.settings_differ appeared), and names the model."""
    import driftcheck
    from driftcheck.store import TraceReader

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with driftcheck.trace(model, out=str(tmp_path / "t")) as t:
        model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
        t.step()
    run = TraceReader(tmp_path / "t").run
    assert run["dtype"] == "bfloat16" and run["precision"]["dtype"] == "bfloat16"
    assert run["model_id"] == "Linear (15 parameters)"


def test_library_trace_warns_without_a_step_and_speaks_python(tmp_path):
    import driftcheck

    model = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="without t.step"):
        with driftcheck.trace(model, out=str(tmp_path / "t")):
            model(torch.randn(2, 4))
    with pytest.raises(FileExistsError, match="force=True"):
        with driftcheck.trace(model, out=str(tmp_path / "t")):
            pass


def test_a_second_backward_through_the_graph_leaves_a_summed_gradient_as_captured(tmp_path):
    """An input that reaches two ops has its gradient summed over both edges by the tracer (its
    own copy); a second backward through the same graph (retain_graph) must not add into what
    the first one captured."""
    import driftcheck
    from driftcheck.store import TraceReader

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) * self.b(x)

    torch.manual_seed(0)
    model, x = Two(), torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), x)[0]
    with driftcheck.trace(model, out=str(tmp_path / "t"), mode="full") as t:
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        t.step(loss)
    r = TraceReader(tmp_path / "t")
    got = r.tensor(next(e for e in r.entries if e["key"] == "0/backward/./0/grad_input.0"))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("phases", [("forward", "backward"), None])
def test_gradients_the_record_does_not_capture_are_not_kept(tmp_path, phases):
    """The post-accumulate hook keeps a parameter's gradient for the step's end only where the
    ``grads`` phase and its module are captured (a copy of every gradient held for nothing
    before: 1.3 GB a step at 349M)."""
    from driftcheck.store import TraceReader, TraceWriter

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    kw = dict(phases=frozenset(phases)) if phases else dict(include=("1",))
    with TraceWriter(tmp_path / "t") as w:
        tr = Tracer(model, w, mode="full", **kw).attach()
        model(torch.randn(3, 4)).sum().backward()
        kept = {tr.state.owners[k][0] for k in tr.state.grads}
        tr.step()
        tr.detach()
        w.close({})
    assert kept == (set() if phases else {"1"}), kept  # no grads phase; only module 1 included
    grads = {e["module"] for e in TraceReader(tmp_path / "t").entries if e["phase"] == "grads"}
    assert grads == (set() if phases else {"1"})


def test_gradients_go_to_the_writer_when_the_update_begins_as_they_were_accumulated(tmp_path):
    """The optimizer's step pre-hook hands the step's gradients over (written while the update
    runs, their copies free before its state is captured), as accumulated over two backwards,
    before a clipping between backward and the update: what the trace holds is what backward
    left, as at the step's end before."""
    from driftcheck.store import TraceWriter

    torch.manual_seed(0)
    # a weight of stats.BIG elements (its gradient copied and summarised in the hook) and small ones
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: list[tuple[int, set[str]]] = []
    with TraceWriter(tmp_path / "t") as w:
        tr = Tracer(model, w, optimizer=opt, mode="full").attach()
        # registered after the tracer's: sees what it left when the update starts
        opt.register_step_pre_hook(lambda o, a, k: seen.append((len(tr.state.grads), {
            p.entry["phase"] for p in tr.capture.pending} | {e["phase"] for e in w.entries})))
        want = []
        for _ in range(2):
            for _ in range(2):  # two micro-batches
                model(torch.randn(8, 256)).square().mean().backward()
            want.append([p.grad.clone() for p in model.parameters()])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
            tr.step()
        tr.detach()
        w.close({})
    assert [n for n, _ in seen] == [0, 0] and all("grads" in phases for _, phases in seen)
    assert all("optimizer" not in phases for _, phases in seen[:1])
    r = TraceReader(tmp_path / "t")
    names = [n for n, _ in model.named_parameters()]
    for step in range(2):
        for name, g in zip(names, want[step]):
            mod, leaf = name.rsplit(".", 1)
            got = r.tensor(next(e for e in r.entries if e["key"] == f"{step}/grads/{mod}/0/param.{leaf}"))
            assert torch.equal(got, g), (step, name)

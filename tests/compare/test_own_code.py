"""A composite module's own code (the ops between its children: a SwiGLU's product, a residual
add, an attention's softmax) has a local error of its own: the module replayed on the
reference's inputs with each child call answered from the reference's trace (record/own.py).
A defect of a few percent there is caught, blamed on the parent and drilled to the op; a clean
bf16 target stays clean."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.drill import drill
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record
from driftcheck.store import TraceReader
from driftcheck.targets import opfaults


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    for name in ("llama", "vit"):
        record(load_scenario(name), root / name / "ref", dtype="fp32")
    return root


def _faulty(refs, model, make, dtype="bf16", tag="t"):
    d = refs / model
    fault = make() if make else None
    try:
        record(load_scenario(model), d / tag, dtype=dtype, replay=d / "ref", local=d / "ref",
               force=True, target_hooks=fault)
    finally:
        if fault is not None:
            fault.remove()
    return d / "ref", d / tag, compare(d / "ref", d / tag)


def test_clean_bf16_target_has_own_code_entries_and_stays_clean(refs):
    ref, tgt, rep = _faulty(refs, "llama", None, tag="clean")
    slots = {(e["module"], e["slot"]) for e in TraceReader(tgt).entries}
    # the parent's replay: its output, the input its code made for a child, the output
    # gradient its backward made for a child, its input gradient
    for want in [("layers.1.mlp", "local.output"), ("layers.1.mlp.down_proj", "local.input.0"),
                 ("layers.1.mlp.up_proj", "local.grad_output"), ("layers.1.mlp", "local.grad_input.0"),
                 ("", "local.output")]:
        assert want in slots, want
    assert rep.verdict == "pass", rep.decided_by
    own = [e for e in rep.entries if e.local_ratio is not None and e.slot.startswith(("input", "grad_output"))]
    assert own and max(e.local_ratio for e in own) < rep.limit / 2


@pytest.mark.parametrize("model,make,parent,phase,op", [
    # the SwiGLU product, 2% off, forward and backward
    ("llama", lambda: opfaults.scale_op("layers.1.mlp", "mul", 1.02), "layers.1.mlp", "forward", "mul"),
    ("llama", lambda: opfaults.wrong_backward("layers.1.mlp", op="mul", factor=1.02), "layers.1.mlp",
     "backward", "mul"),
    # a residual add of a block, an attention's softmax
    ("vit", lambda: opfaults.scale_op("blocks.0", "add", 1.02), "blocks.0", "forward", "add"),
    ("vit", lambda: opfaults.scale_op("blocks.1.attn", "_softmax", 1.02), "blocks.1.attn", None, "_softmax"),
])
def test_a_two_percent_defect_in_a_parents_own_code_is_blamed_on_it_and_drilled_to_the_op(
        refs, model, make, parent, phase, op):
    ref, tgt, rep = _faulty(refs, model, make)
    assert rep.verdict == "fail"
    fd = rep.first_divergence
    assert fd["blame_module"] == parent, fd
    assert fd["local_ratio"] > rep.limit and fd["ratio"] < rep.limit  # only the local replay sees it
    if phase is not None:
        assert fd["phase"] == phase
    fault = make()
    try:
        res = drill(ref, tgt, report=rep, target_hooks=fault, scenario=lambda: load_scenario(model))
    finally:
        fault.remove()
    assert res.point["module"] == parent
    rc = res.root_cause
    assert rc is not None and rc["op"].split(".")[1] == op, [(j.op, j.ratio) for j in res.judged]


def test_fp32_finds_a_tenth_of_a_percent_in_a_parents_own_code(refs):
    _, _, rep = _faulty(refs, "llama", lambda: opfaults.scale_op("layers.0.mlp", "mul", 1.001),
                        dtype="fp32", tag="fp32")
    assert rep.verdict == "fail" and rep.first_divergence["blame_module"] == "layers.0.mlp"


# -- compiled targets: each leaf's compiled code replayed on the reference's inputs ----------------
@pytest.fixture(scope="module")
def mlp_ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    record(load_scenario("mlp"), root / "ref", dtype="fp32")
    return root


def _compiled(root, fault, tag):
    try:
        record(load_scenario("mlp"), root / tag, dtype="bf16", replay=root / "ref", local=root / "ref",
               force=True, target_hooks=fault,
               compile={"backend": "aot_eager", "mode": None, "dynamic": None})
    finally:
        if fault is not None:
            fault.remove()
    return compare(root / "ref", root / tag), TraceReader(root / tag)


def test_a_defect_inside_a_compiled_graph_gets_a_local_ratio(mlp_ref):
    from driftcheck.targets import faults

    rep, tr = _compiled(mlp_ref, faults.scale_output("fc2", 1.02), "faulty")
    assert tr.run["compile"]["graph_breaks"] == 0  # the replay runs after the step, outside it
    fd = rep.first_divergence
    assert rep.verdict == "fail" and fd["blame_module"] == "fc2", fd
    assert fd["local_ratio"] > rep.limit and fd["ratio"] < rep.limit  # the propagated floor misses it
    clean, tr = _compiled(mlp_ref, None, "clean")
    assert clean.verdict == "pass", clean.decided_by
    judged = [e for e in clean.entries if e.local_ratio is not None]
    # the modules' calls, and each parameter's step redone ideally (record/update.py)
    assert {e.phase for e in judged} == {"forward", "backward", "optimizer"}
    # the Dropout leaves drew masks inside the graph: not replayed (no other masks judged)
    assert not any(e["module"].startswith("drop") and e["slot"].startswith("local.")
                   for e in tr.entries)


# -- the floor of a composite's own code: what its operands and its ops' rounding explain ---------
class _StraightThrough(nn.Module):
    """A VQ-style quantizer: its own code adds large terms that cancel, z + (q - z).detach()."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 16)
        self.code = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        z = self.enc(x) * 8.0  # large
        q = self.code(x)  # small
        return self.head(z + (q - z).detach())


class _Router(nn.Module):
    """A router computing in float32 from a bf16 stream, as Switch Transformers' does."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.classifier = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x).float()
        self.classifier.float()
        return self.classifier(h * 1.0)


def _scen(make):
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    inputs = [{"x": torch.randn(8, 16, generator=g)} for _ in range(2)]
    return Scenario(model=model, inputs=inputs, loss=lambda out, b: out.float().pow(2).mean(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


@pytest.mark.parametrize("make", [_StraightThrough, _Router])
def test_clean_bf16_own_code_of_cancelling_sums_and_float32_islands_stays_clean(tmp_path, make):
    record(_scen(make), tmp_path / "ref", dtype="fp32")
    record(_scen(make), tmp_path / "t", dtype="bf16", replay=tmp_path / "ref", local=tmp_path / "ref")
    rep = compare(tmp_path / "ref", tmp_path / "t")
    own = [e for e in rep.entries if e.local_ratio is not None and e.slot.startswith("input")]
    assert own, "the composite's own code was replayed"
    assert rep.verdict == "pass", rep.decided_by
    # and a 2% defect there is still caught and blamed on the composite
    fault = opfaults.scale_op("", "mul", 1.02)
    try:
        record(_scen(make), tmp_path / "f", dtype="bf16", replay=tmp_path / "ref",
               local=tmp_path / "ref", target_hooks=fault)
    finally:
        fault.remove()
    if make is _Router:  # h * 1.0 in float32: 2% of it
        rep = compare(tmp_path / "ref", tmp_path / "f")
        assert rep.verdict == "fail" and rep.first_divergence["blame_module"] == "", rep.first_divergence

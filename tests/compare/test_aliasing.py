"""alias.sharing_differs: the alias structure each record writes (manifest ``aliases``) and the
finding compare makes where the two runs' sharing differs. On the real lazy backend (it ships in
the CPU wheel): moving the built-in llama there unties its embedding and head."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

from driftcheck.compare import compare
from driftcheck.compare.aliasing import KIND, sharing_findings
from driftcheck.gate.policy import Policy
from driftcheck.loader import load_scenario
from driftcheck.record.aliases import alias_groups
from driftcheck.record.runner import record
from driftcheck.store.format import FormatError, validate_manifest


class Shared(nn.Module):
    """Every kind of sharing: a tied weight, a buffer registered twice, a buffer that is a view
    of another, two parameters carved out of one flat buffer; and one tensor shared by none."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("buf", torch.zeros(3))
        self.c = nn.Module()
        self.c.register_buffer("buf", self.buf)
        self.register_buffer("vb", torch.zeros(4, 4))
        self.register_buffer("vv", self.vb[0])
        flat = torch.zeros(8)
        self.p1 = nn.Parameter(flat[:4])
        self.p2 = nn.Parameter(flat[4:])
        self.alone = nn.Parameter(torch.zeros(2))


@functools.cache
def _lazy() -> None:
    """The TorchScript lazy backend, initialised once per process (a second init raises)."""
    import torch._lazy
    import torch._lazy.ts_backend

    try:
        torch._lazy.ts_backend.init()
    except RuntimeError as err:  # initialised already, by driftcheck or another test
        if "multiple backend fallbacks" not in str(err):
            raise


def test_alias_groups_cpu() -> None:
    groups = alias_groups(Shared())
    assert {tuple(g["tensors"]): g["how"] for g in groups} == {
        ("a.weight", "b.weight"): "tied", ("p1", "p2"): "storage",
        ("buf", "c.buf"): "tied", ("vb", "vv"): "storage"}
    assert alias_groups(nn.Linear(2, 2)) == []


def test_alias_groups_llama_on_lazy() -> None:
    """The real untying: the built-in llama's tie is gone once the model is on "lazy" (and so is
    every other sharing of the toy module); identity and _base are read there, not data_ptr()."""
    _lazy()
    model = load_scenario("llama").model
    assert alias_groups(model) == [{"tensors": ["tok_emb.weight", "lm_head.weight"], "how": "tied"}]
    model.to("lazy")
    assert alias_groups(model) == []
    model.lm_head.weight = model.tok_emb.weight  # tied again after the move
    assert alias_groups(model) == [{"tensors": ["tok_emb.weight", "lm_head.weight"], "how": "tied"}]
    assert alias_groups(Shared().to("lazy")) == []


def test_alias_groups_hf_tied_llama_on_lazy() -> None:
    """A Hugging Face LlamaForCausalLM with tied embeddings, built offline from its config:
    untied by the move to lazy, tied again by its own ``tie_weights()``."""
    transformers = pytest.importorskip("transformers")
    _lazy()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    tied = [{"tensors": ["model.embed_tokens.weight", "lm_head.weight"], "how": "tied"}]
    assert alias_groups(model) == tied
    model.to("lazy")
    assert alias_groups(model) == []
    model.tie_weights()
    assert alias_groups(model) == tied


def _m(*groups: tuple[str, ...], how: str = "tied") -> dict:
    return {"aliases": [{"tensors": list(g), "how": how} for g in groups]}


@pytest.mark.parametrize("ref, tgt, names, untied", [
    (_m(("emb.weight", "head.weight")), _m(), ["emb.weight", "head.weight"], True),
    (_m(), _m(("emb.weight", "head.weight")), ["emb.weight", "head.weight"], False),
    (_m(("x", "y", "z")), _m(("x", "y")), ["x", "y", "z"], True),
    (_m(("x", "y"), ("u", "v")), _m(("x", "y")), ["u", "v"], True),
])
def test_sharing_findings_table(ref, tgt, names, untied) -> None:
    got = sharing_findings(ref, tgt)
    assert len(got) == 1
    f = got[0]
    assert f.kind == KIND and f.step == 0 and f.phase == "params"
    assert f.details["tensors"] == names and f.details["untied_on_target"] is untied
    assert all(n in f.message for n in names)
    assert ("tie_weights()" in f.message) is untied
    if untied:
        assert f.module == names[0].rpartition(".")[0]


def test_storage_sharing_is_a_warning() -> None:
    """Views of one buffer moved tensor by tensor: a warning (it matters only where a write
    through one is meant to reach the other), apart from the tied weights' error."""
    ref = {"aliases": [{"tensors": ["e.weight", "h.weight"], "how": "tied"},
                       {"tensors": ["vb", "vv"], "how": "storage"}]}
    tgt = {"aliases": [{"tensors": ["e.weight", "h.weight"], "how": "tied"}]}
    (f,) = sharing_findings(ref, tgt)
    assert f.severity == "warning" and f.details["how"] == "storage" and f.details["tensors"] == ["vb", "vv"]
    assert "share storage" in f.message and f.module == ""
    assert not Policy.default().fails_gate(f)
    (f,) = sharing_findings(ref, {"aliases": []}, step=3)[:1]
    assert f.severity == "error" and f.step == 3 and Policy.default().fails_gate(f)


@pytest.mark.parametrize("ref, tgt", [
    (_m(("a", "b")), _m(("a", "b"))),
    (_m(("a", "b"), ("c", "d")), _m(("c", "d"), ("a", "b"))),
    (_m(), _m()),
    ({}, _m()), (_m(("a", "b")), {}), ({}, {}),  # a trace made before the field: not judged
])
def test_sharing_findings_none(ref, tgt) -> None:
    assert sharing_findings(ref, tgt) == []


def test_manifest_validation() -> None:
    base = {"format": "driftcheck.trace", "version": 1, "run": {}, "entries": [], "shards": {}}
    validate_manifest(base)  # an old trace: no field
    validate_manifest(dict(base, aliases=[]))
    validate_manifest(dict(base, aliases=[{"tensors": ["a", "b"], "how": "storage"}]))
    for bad in ({"tensors": ["a"], "how": "tied"}, {"tensors": ["a", "b"], "how": "view"},
                {"tensors": "ab", "how": "tied"}, ["a", "b"]):
        with pytest.raises(FormatError, match="'aliases'"):
            validate_manifest(dict(base, aliases=[bad]))


def _untie(model: nn.Module) -> None:
    """A fault made by hand on CPU: the head gets a copy of the embedding, not the embedding."""
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())


def _retie(model: nn.Module) -> None:
    model.lm_head.weight = model.tok_emb.weight


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("alias") / "ref"
    record(load_scenario("llama"), d, steps=1)
    return d


def _alias(report) -> list:
    return [f for f in report.findings if f.kind == KIND]


def _assert_named_cause(report) -> None:
    assert report.verdict == "fail"
    (f,) = _alias(report)
    assert f.gate == "fails gate" and f.module == "tok_emb"
    assert f.details["tensors"] == ["tok_emb.weight", "lm_head.weight"]
    assert "model.lm_head.weight = model.tok_emb.weight" in f.message
    assert report.first_divergence["finding"] == KIND, report.first_divergence
    assert report.decided_by.startswith(KIND)
    # the head's own entries on the target: explained by the untying, a warning
    (extra,) = [f for f in report.findings if f.kind == "alignment.extra_in_target"]
    assert extra.module == "lm_head" and extra.severity == "warning" and KIND in extra.message
    assert sorted({f.kind for f in report.findings if f.gate == "fails gate"}) == [KIND]
    # the gradient that drifts is the consequence: the tied weight's, at step 0
    assert report.first_divergence["drift"]["key"] == "0/grads/tok_emb/0/param.weight"


def test_hand_untied_cpu_target(ref) -> None:
    tgt = ref.parent / "untied"
    record(load_scenario("llama"), tgt, steps=1, replay=ref, target_hooks=_untie)
    report = compare(ref, tgt)
    _assert_named_cause(report)
    # the policy can take it out: then it is neither a gate failure nor the named cause
    ignoring = Policy.from_mapping({"ignore": [{"kind": "alias", "reason": "re-tied later"}]})
    report = compare(ref, tgt, policy=ignoring)
    (f,) = _alias(report)
    assert f.gate == "ignored" and report.first_divergence.get("finding") != KIND


@pytest.mark.parametrize("hooks, dtype", [(None, "bf16"), (_untie, "fp32")])
def test_clean_controls_and_old_traces(ref, hooks, dtype) -> None:
    """A clean bf16 target has no alias finding; a target recorded before the field existed
    (``aliases`` taken out of its manifest) compares as before: no alias finding either."""
    tgt = ref.parent / f"control-{dtype}"
    record(load_scenario("llama"), tgt, steps=1, replay=ref, dtype=dtype, target_hooks=hooks,
           force=True)
    manifest = tgt / "manifest.json"
    new = compare(ref, tgt)
    if hooks is None:
        assert new.verdict == "pass" and not _alias(new), new.decided_by
    m = json.loads(manifest.read_text())
    del m["aliases"]
    manifest.write_text(json.dumps(m))
    old = compare(ref, tgt)
    assert not _alias(old)
    assert [(f.kind, f.module) for f in new.findings if f.kind != KIND] == \
        [(f.kind, f.module) for f in old.findings]
    if hooks is not None:  # as before the field: drift and an unexplained extra head, no cause
        assert old.verdict == "fail" and old.first_divergence.get("finding") is None
    assert [(e.key, e.ratio) for e in new.entries] == [(e.key, e.ratio) for e in old.entries]


@pytest.fixture
def lazy_capture():
    """PyTorch's lazy-tensor backend, started (the record's deferred capture moves the step's
    captures to the host in one transfer after its mark_step)."""
    _lazy()


def test_lazy_untying_is_named(ref, lazy_capture) -> None:
    """The built-in llama moved to the real lazy backend: forward and loss agree, the tied
    weight's gradient does not, and the report names the untying as the cause."""
    tgt = ref.parent / "lazy"
    record(load_scenario("llama"), tgt, steps=1, replay=ref, device="lazy")
    report = compare(ref, tgt)
    _assert_named_cause(report)
    loss = next(e for e in report.entries if e.phase == "loss")
    assert loss.metrics["max_abs"] == 0.0  # forward unchanged: only the gradient tells
    retied = ref.parent / "lazy-retied"
    record(load_scenario("llama"), retied, steps=1, replay=ref, device="lazy", target_hooks=_retie)
    report = compare(ref, retied)
    assert report.verdict == "pass" and not _alias(report), report.decided_by

"""Semantic audits end to end: simulated faulty backends on the built-in models are named for
what they are, from the CLI; clean fp32-vs-fp32 and fp32-vs-bf16 runs give no semantic finding."""
from __future__ import annotations

import json

import pytest
from conftest import dc, record_builtin

from driftcheck.compare import compare

SEMANTIC = ("batchnorm.", "view.", "inplace.")


def _semantic(rep):
    return [f for f in rep.findings if f.kind.startswith(SEMANTIC)]


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    root = tmp_path_factory.mktemp("audited")
    return {m: record_builtin(m, root / m, view_audit=True) for m in ("resnet", "llama")}


@pytest.mark.parametrize("name", ["resnet", "llama"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_clean_runs_have_no_semantic_findings(audited, name, dtype, tmp_path):
    tgt = record_builtin(name, tmp_path / "t", dtype=dtype, replay=audited[name], view_audit=True)
    rep = compare(audited[name], tgt)
    assert not _semantic(rep), [f.message for f in _semantic(rep)][:3]
    assert rep.verdict == "pass"


def test_torch_tpu_batchnorm_bug_is_named(audited, tmp_path):
    tgt = record_builtin("resnet", tmp_path / "t", replay=audited["resnet"], view_audit=True,
                         simulate="skip-bn-stats")
    rep = compare(audited["resnet"], tgt)
    kinds = {(f.kind, f.module) for f in rep.findings}
    for bn in ("bn1", "layer1.bn1", "layer1.bn2", "layer2.bn1", "layer2.bn2", "layer2.downsample.1"):
        assert ("batchnorm.running_stats_not_updated", bn) in kinds
    assert not any(f.kind.startswith(("view.", "inplace.")) for f in rep.findings)
    assert rep.verdict == "fail"
    # forward activations are untouched: the bug hides from a plain numeric diff of outputs
    assert all(e.status == "ok" for e in rep.entries if e.phase == "forward" and e.step == 0)


def test_views_that_became_copies_are_named(audited, tmp_path):
    tgt = record_builtin("llama", tmp_path / "t", replay=audited["llama"], view_audit=True,
                         simulate="views-become-copies")
    rep = compare(audited["llama"], tgt)
    kinds = {f.kind for f in _semantic(rep)}
    # the copies lose aliasing; where the model then writes into a "view" (RoPE's rotate-half
    # buffer) the write misses its base too
    assert "view.alias_lost" in kinds and kinds <= {"view.alias_lost", "inplace.value_mismatch",
                                                    "inplace.base_not_updated",
                                                    "view.write_not_through_view"}, kinds
    missed = {(f.module, f.details["op"]) for f in rep.findings
              if f.kind == "view.write_not_through_view"}
    # RoPE's rotate-half writes into a slice of its buffer, which became a copy of another layout
    assert {("layers.0.attn", "aten.copy_.default"), ("layers.1.attn", "aten.copy_.default")} <= missed
    assert not any(f.kind.startswith("batchnorm") for f in rep.findings)
    assert rep.verdict == "fail"


def test_dropped_view_writes_are_named_in_the_attention(audited, tmp_path):
    tgt = record_builtin("llama", tmp_path / "t", replay=audited["llama"], view_audit=True,
                         simulate="drop-view-writes")
    rep = compare(audited["llama"], tgt)
    lost = [f for f in rep.findings if f.kind == "inplace.base_not_updated"]
    # forward writes are named by module; the backward of the same slice writes runs outside
    # any module call and is attributed to the model ("")
    assert lost and {f.module for f in lost} <= {"layers.0.attn", "layers.1.attn", ""}
    assert {"layers.0.attn", "layers.1.attn"} <= {f.module for f in lost}
    # the numeric first divergence points into the same module's own code
    assert rep.first_divergence["module"].startswith("layers.0.attn")


def test_cli_names_the_batchnorm_bug(tmp_path):
    ref, tgt = tmp_path / "ref", tmp_path / "tgt"
    assert dc("record", "resnet", "--out", str(ref)).returncode == 0
    assert dc("record", "resnet", "--out", str(tgt), "--replay", str(ref),
              "--simulate", "skip-bn-stats").returncode == 0
    p = dc("compare", str(ref), str(tgt), "--json", str(tmp_path / "r.json"))
    assert p.returncode == 1
    assert "batchnorm.running_stats_not_updated" in p.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert any(f["kind"] == "batchnorm.running_stats_not_updated" and f["module"] == "layer1.bn1"
               for f in rep["findings"])

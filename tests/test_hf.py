"""Hugging Face families and local model directories as Scenarios (driftcheck.hf)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from driftcheck import Scenario, hf, nested  # noqa: E402
from driftcheck.errors import DriftcheckError  # noqa: E402
from driftcheck.scenario import call_model  # noqa: E402

REQUIRED = ["llama", "qwen2", "qwen3", "gemma", "mistral", "deepseek_v3", "vit", "resnet",
            "convnext", "dinov2", "whisper", "wav2vec2"]
FAMILIES = list(hf.FAMILIES)


def _needs(family: str) -> None:
    if family == "unet":
        pytest.importorskip("diffusers")


def _leaves(x: Any) -> list[tuple[str, Any]]:
    """(path, leaf) of the tracer's walker, a Cache kept whole (as a leaf) to be seen."""
    def leaf(path: str, obj: Any, kind: str, children: nested.Children[Any]) -> list[tuple[str, Any]]:
        if kind in (nested.MAPPING, nested.SEQUENCE):
            return [pair for _, sub in children() for pair in sub]
        return [(path, obj)]
    return nested.fold(x, "", leaf)


def _cast(batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}


def _train(scenario: Scenario, dtype: torch.dtype) -> list[float]:
    model = scenario.model.to(dtype)
    optimizer = scenario.optimizer(model.parameters())
    losses = []
    for step in range(scenario.steps):
        batch = _cast(scenario.batch(step), dtype)
        loss = scenario.loss(call_model(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_families_cover_the_required_set() -> None:
    assert set(REQUIRED) <= set(hf.FAMILIES)
    assert all(isinstance(d, str) and d for d in hf.FAMILIES.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_builds_bitwise_identical_weights_and_inputs(family: str) -> None:
    _needs(family)
    a, b, other = hf.build(family, seed=0), hf.build(family, seed=0), hf.build(family, seed=1)
    sa, sb, so = a.model.state_dict(), b.model.state_dict(), other.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], so[k]) for k in sa if sa[k].is_floating_point())
    assert a.steps == 2 and len(a.inputs) == 2 and a.name == f"hf:{family}"
    for step in range(2):
        for k, v in a.batch(step).items():
            w = b.batch(step)[k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
    main = next(iter(a.batch(0)))  # the model's main input: ids, pixels, features, waveform
    assert not torch.equal(a.batch(0)[main], a.batch(1)[main])  # two different batches


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    hf.build("llama", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_training_steps_give_finite_loss_and_move_weights(family: str,
                                                               dtype: torch.dtype) -> None:
    _needs(family)
    scenario = hf.build(family)
    assert scenario.model.training
    assert all(p.dtype == torch.float32 for p in scenario.model.parameters())  # made in fp32
    before = {k: v.clone() for k, v in scenario.model.named_parameters()}
    losses = _train(scenario, dtype)
    assert all(math.isfinite(x) for x in losses), losses
    after = dict(scenario.model.named_parameters())
    assert all(after[k].dtype == dtype for k in after)
    assert any(not torch.equal(before[k].to(dtype), after[k]) for k in before)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_is_a_model_output_of_tensors(family: str) -> None:
    _needs(family)
    scenario = hf.build(family)
    output = call_model(scenario.model, scenario.batch(0))
    if family == "unet":
        from diffusers.utils import BaseOutput

        assert isinstance(output, BaseOutput)
    else:
        assert isinstance(output, transformers.utils.ModelOutput)
        assert output.loss is not None and output.loss.dim() == 0
    leaves = _leaves(output)
    # only tensors: no Cache objects, no None-valued fields left in the container
    assert leaves and all(isinstance(v, torch.Tensor) for _, v in leaves), leaves
    loss = scenario.loss(output, scenario.batch(0))
    if family == "unet":
        target = scenario.batch(0)["noise"]
        assert torch.allclose(loss, torch.nn.functional.mse_loss(output.sample, target))
    else:
        assert loss is output.loss


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_is_reproducible_from_the_torch_seed_alone(family: str) -> None:
    # Randomness outside torch (wav2vec2 SpecAugment draws from np.random) or structural
    # randomness would make a reference and a target run different graphs.
    _needs(family)
    scenario = hf.build(family)
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        output = call_model(scenario.model, scenario.batch(0))
        losses.append(scenario.loss(output, scenario.batch(0)))
    assert torch.equal(losses[0], losses[1])


def test_text_batches_have_padding_masks_and_ignored_labels() -> None:
    batch = hf.build("llama").batch(0)
    mask, labels = batch["attention_mask"], batch["labels"]
    assert mask.shape == batch["input_ids"].shape and (mask == 0).any() and (mask[0] == 1).all()
    assert torch.equal(labels == -100, mask == 0)
    assert batch["use_cache"] is False


def test_whisper_batch_is_log_mel_with_shifted_decoder_ids() -> None:
    scenario = hf.build("whisper")
    config, batch = scenario.model.config, scenario.batch(0)
    features = batch["input_features"]
    assert features.shape == (2, config.num_mel_bins, 2 * config.max_source_positions)
    # Whisper's dynamic range: log10 clamped to max - 8, then (x + 4) / 4 -> a span of 2 per sample
    span = features.amax(dim=(1, 2)) - features.amin(dim=(1, 2))
    assert (span <= 2.0 + 1e-6).all() and (span > 0.5).all()
    tone = torch.sin(torch.arange(2400.0)).expand(2, -1)
    half_silent = torch.cat([tone, torch.zeros(2, 2720)], dim=1)
    quiet = hf.batches._log_mel(half_silent, 16, 32)  # silence hits the clamp: span exactly 8 / 4
    assert torch.allclose(quiet.amax(dim=(1, 2)) - quiet.amin(dim=(1, 2)), torch.tensor(2.0))
    ids, labels = batch["decoder_input_ids"], batch["labels"]
    assert (ids[:, 0] == config.decoder_start_token_id).all()
    assert torch.equal(ids[0, 1:], labels[0, :-1])
    assert (labels[1] == -100).any()
    assert torch.equal(batch["decoder_attention_mask"] == 0, labels == -100)


def test_wav2vec2_has_no_structural_randomness_and_enough_frames() -> None:
    scenario = hf.build("wav2vec2")
    config, batch = scenario.model.config, scenario.batch(0)
    assert config.layerdrop == 0.0 and config.mask_time_prob == 0.0
    frames = scenario.model._get_feat_extract_output_lengths(batch["attention_mask"].sum(-1))
    assert (frames >= (batch["labels"] != -100).sum(-1)).all()  # CTC needs frames >= targets
    assert (batch["input_values"][batch["attention_mask"] == 0] == 0).all()


def test_resnet_has_batchnorm_whose_running_stats_train() -> None:
    scenario = hf.build("resnet")
    norms = [m for m in scenario.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms
    before = norms[0].running_mean.clone()
    _train(scenario, torch.float32)
    assert not torch.equal(norms[0].running_mean, before)
    assert int(norms[0].num_batches_tracked) == 2


def test_deepseek_v3_routes_through_moe_experts() -> None:
    model = hf.build("deepseek_v3").model
    names = [type(m).__name__ for m in model.modules()]
    assert "DeepseekV3MoE" in names and "DeepseekV3Experts" in names
    assert model.config._experts_implementation == "eager"


def test_local_deepseek_v3_directory_keeps_eager_experts(tmp_path: Path) -> None:
    hf.build("deepseek_v3").model.save_pretrained(tmp_path)
    assert hf.build_from_path(str(tmp_path)).model.config._experts_implementation == "eager"


def test_attention_is_eager() -> None:
    for family in ("llama", "vit", "whisper", "wav2vec2"):
        assert hf.build(family).model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "vit", "resnet", "whisper", "wav2vec2"])
def test_local_directory_round_trip(family: str, tmp_path: Path) -> None:
    original = hf.build(family, seed=3)
    original.model.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = hf.build_from_path(str(tmp_path), seed=3)
    assert type(loaded.model) is type(original.model)
    assert loaded.model.training and loaded.name == f"hf:{tmp_path}"
    so, sl = original.model.state_dict(), loaded.model.state_dict()
    assert so.keys() == sl.keys() and all(torch.equal(so[k], sl[k]) for k in so)
    for k, v in original.batch(0).items():  # inputs synthesized from the saved config
        assert v.shape == loaded.batch(0)[k].shape if isinstance(v, torch.Tensor) else True
    assert loaded.model.config._attn_implementation == "eager"
    assert all(math.isfinite(x) for x in _train(loaded, torch.float32))


def test_base_model_directory_gets_a_seeded_head(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2)
    transformers.LlamaModel(config).to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]
    a, b = hf.build_from_path(str(tmp_path), seed=5), hf.build_from_path(str(tmp_path), seed=5)
    assert isinstance(a.model, transformers.LlamaForCausalLM)
    assert a.model.dtype == torch.float32  # bf16 checkpoint, fp32 Scenario
    assert torch.equal(a.model.lm_head.weight, b.model.lm_head.weight)
    assert a.batch(0)["input_ids"].max() < 64
    assert all(math.isfinite(x) for x in _train(a, torch.float32))


def test_unknown_family_lists_the_known_ones() -> None:
    with pytest.raises(DriftcheckError, match=r"known: llama, qwen2.*wav2vec2"):
        hf.build("gpt5")
    with pytest.raises(DriftcheckError, match="unknown Hugging Face family"):
        hf.resolve("gpt5")


def test_directory_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(DriftcheckError, match="no such directory"):
        hf.build_from_path(str(tmp_path / "absent"))
    with pytest.raises(DriftcheckError, match=r"no config\.json"):
        hf.build_from_path(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DriftcheckError, match=r"no weights \(\*.safetensors"):
        hf.build_from_path(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DriftcheckError, match=r"unreadable config\.json"):
        hf.build_from_path(str(tmp_path))


def test_unsupported_head_is_refused(tmp_path: Path) -> None:
    config = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                   num_heads=2)
    transformers.T5Model(config).save_pretrained(tmp_path)
    with pytest.raises(DriftcheckError, match="no supported task head for model type 't5'"):
        hf.build_from_path(str(tmp_path))


def test_resolve_picks_family_or_directory(tmp_path: Path) -> None:
    assert isinstance(hf.resolve("qwen3").model, transformers.Qwen3ForCausalLM)
    hf.build("convnext").model.save_pretrained(tmp_path)
    assert isinstance(hf.resolve(str(tmp_path)).model, transformers.ConvNextForImageClassification)


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "is_available", lambda: False)
    # a line that works: driftcheck itself is not on the index
    expected = (r'hf:llama needs transformers: pip install transformers '
                r'\(from a driftcheck checkout: pip install -e "\.\[hf\]"\)')
    with pytest.raises(DriftcheckError, match=expected):
        hf.build("llama")


def test_import_is_torch_free() -> None:
    code = "import sys, driftcheck.hf as h; assert h.FAMILIES; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

"""The built-in reference models: seeded, deterministic, trainable in fp32 and bf16."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import driftcheck
from driftcheck.errors import DriftcheckError
from driftcheck.models import BUILTINS, load
from driftcheck.scenario import call_model

NAMES = sorted(BUILTINS)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _cast(batch: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors only: token ids and class targets stay integers."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast(v, dtype) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_cast(v, dtype) for v in batch)
    return batch


def _train(scenario: driftcheck.Scenario, dtype: torch.dtype) -> list[torch.Tensor]:
    """Run every step of ``scenario`` in ``dtype``; return the losses (detached)."""
    model = scenario.model.to(dtype).train()
    optimizer = scenario.optimizer(model.parameters())
    losses = []
    for step in range(scenario.steps):
        batch = _cast(scenario.batch(step), dtype)
        output = call_model(model, batch)
        assert output.dtype == dtype, f"step {step}: output is {output.dtype}, model runs in {dtype}"
        loss = scenario.loss(output, batch)
        assert loss.dim() == 0
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"step {step}: {name}"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def test_load_unknown_name_lists_builtins() -> None:
    with pytest.raises(DriftcheckError, match="unknown built-in model 'gpt5'") as err:
        load("gpt5")
    for name in BUILTINS:
        assert name in str(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_build_is_a_cpu_fp32_two_step_scenario(name: str) -> None:
    scenario = load(name)
    assert isinstance(scenario, driftcheck.Scenario)
    assert scenario.name == name
    assert scenario.steps == 2
    assert isinstance(scenario.inputs, list) and len(scenario.inputs) == 2
    assert scenario.loss is not None and scenario.optimizer is not None
    for t in list(scenario.model.state_dict().values()) + _tensors(scenario.inputs):
        assert t.device.type == "cpu"
        if t.is_floating_point():
            assert t.dtype == torch.float32
    # Tiny by design: a step must cost milliseconds, not seconds, on one CPU core.
    assert sum(p.numel() for p in scenario.model.parameters()) < 200_000


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_is_bitwise_identical_and_other_seed_differs(name: str) -> None:
    a, b, c = load(name, seed=0), load(name, seed=0), load(name, seed=1)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ta, tb, tc = _tensors(a.inputs), _tensors(b.inputs), _tensors(c.inputs)
    assert len(ta) == len(tb) == len(tc)
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))
    # Seed 1 changes the weights (every trainable matrix) and the inputs.
    weights = [k for k in sa if k.endswith("weight") and sa[k].dim() >= 2]
    assert weights and all(not torch.equal(sa[k], sc[k]) for k in weights)
    assert any(not torch.equal(x, y) for x, y in zip(ta, tc))


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    for name in NAMES:
        load(name, seed=7)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("name", NAMES)
def test_training_is_deterministic_on_cpu(name: str) -> None:
    # The golden-test shape: same seed, two runs, bitwise-equal losses and final weights.
    runs = []
    for _ in range(2):
        scenario = load(name)
        torch.manual_seed(0)  # dropout masks come from the global RNG
        losses = _train(scenario, torch.float32)
        runs.append((losses, scenario.model.state_dict()))
    (la, sa), (lb, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_trains_with_finite_loss(name: str, dtype: torch.dtype) -> None:
    scenario = load(name)
    before = {k: v.clone() for k, v in scenario.model.named_parameters()}
    losses = _train(scenario, dtype)
    assert len(losses) == scenario.steps
    assert all(torch.isfinite(loss) and loss.dtype == dtype for loss in losses)
    after = dict(scenario.model.named_parameters())
    for k, v in before.items():
        # Every parameter is updated in fp32. In bf16 an update below half an ULP is lost (norm
        # weights at 1.0 have ULP 2^-7, AdamW moves them ~1e-3): real bf16 stagnation, so
        # there only the matrices, whose entries are small, must move.
        if dtype == torch.float32 or v.dim() >= 2:
            assert not torch.equal(v.to(dtype), after[k].detach()), f"{k} did not change"


def test_mlp_has_active_dropout() -> None:
    scenario = load("mlp")
    drops = [m for m in scenario.model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(0.0 < m.p < 0.5 for m in drops)
    batch = scenario.batch(0)
    torch.manual_seed(0)
    first = call_model(scenario.model, batch)
    torch.manual_seed(1)
    assert not torch.equal(first, call_model(scenario.model, batch))  # masks differ by seed
    scenario.model.eval()
    assert torch.equal(call_model(scenario.model, batch), call_model(scenario.model, batch))


def test_resnet_batchnorm_feeds_an_inplace_relu() -> None:
    model = load("resnet").model
    bn_outputs: list[torch.Tensor] = []
    hits: list[str] = []

    def after_bn(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        bn_outputs.append(output)

    def before_relu(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            # The ReLU's input is the very tensor BatchNorm just returned, and it writes into it.
            if module.inplace and bn_outputs and args[0] is bn_outputs[-1]:
                hits.append(name)
        return hook

    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_hook(after_bn)
        elif isinstance(m, nn.ReLU):
            m.register_forward_pre_hook(before_relu(name))
    batch = load("resnet").batch(0)
    call_model(model, batch)
    assert {"relu", "layer1.relu", "layer2.relu"} <= set(hits)
    # The downsampling block really has a 1x1 conv + BatchNorm on its identity path.
    downsample = model.get_submodule("layer2.downsample")
    assert isinstance(downsample[0], nn.Conv2d) and downsample[0].stride == (2, 2)
    assert isinstance(downsample[1], nn.BatchNorm2d)
    # Training mode updates the running statistics (what a broken backend fails to do).
    assert not torch.equal(model.bn1.running_mean, torch.zeros_like(model.bn1.running_mean))


def test_llama_lm_head_is_the_embedding() -> None:
    scenario = load("llama")
    model = scenario.model
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert isinstance(model.lm_head, nn.Linear)
    _train(scenario, torch.bfloat16)  # casting and training keep the tie
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_llama_attention_is_causal_and_grouped() -> None:
    scenario = load("llama")
    model = scenario.model.eval()
    attn = model.layers[0].attn
    assert attn.k_proj.out_features * 2 == attn.q_proj.out_features  # 4 q heads, 2 kv heads
    idx = scenario.batch(0)["idx"]
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    # Changing the last token must not change any earlier position's logits.
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])

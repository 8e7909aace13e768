"""Emulated fp8 Linear: casts and their statistics, accuracy, gradients, scaling, restore."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.targets import fp8
from driftcheck.targets.fp8 import Fp8Recipe, compute_scale, enable_fp8, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U_E4M3, U_E5M2, U_BF16 = 2.0**-4, 2.0**-3, 2.0**-8


def _roundtrip(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent reference: current per-tensor scaling, saturating cast, back in float64."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.detach().abs().max().double()
    return (t.detach().double() * scale).clamp(-fmax, fmax).to(dtype).double() / scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("hybrid", Fp8Recipe("hybrid", "delayed", 16)),
        ("e4m3:current", Fp8Recipe("e4m3", "current", 16)),
        ("E5M2:delayed:4", Fp8Recipe("e5m2", "delayed", 4)),
    ],
)
def test_recipe_parse(spec: str, expected: Fp8Recipe) -> None:
    recipe = Fp8Recipe.parse(spec)
    assert recipe == expected
    assert Fp8Recipe.parse(str(recipe)) == recipe
    assert recipe.to_dict()["format"] == expected.format


@pytest.mark.parametrize("spec", ["e3m4", "hybrid:sometimes", "hybrid:delayed:0",
                                  "hybrid:delayed:x", "a:b:c:d", ""])
def test_recipe_rejects(spec: str) -> None:
    with pytest.raises(DriftcheckError, match="fp8"):
        Fp8Recipe.parse(spec)


def test_recipe_dtypes() -> None:
    hybrid = Fp8Recipe("hybrid")
    assert [hybrid.dtype(r) for r in fp8.ROLES] == [E4M3, E4M3, E5M2]
    assert {Fp8Recipe("e5m2").dtype(r) for r in fp8.ROLES} == {E5M2}


@pytest.mark.parametrize(
    "amax, dtype, expected",
    [(2.0, E4M3, 224.0), (448.0, E4M3, 1.0), (1.0, E5M2, 57344.0),
     (0.0, E4M3, 1.0), (math.inf, E4M3, 1.0), (math.nan, E5M2, 1.0)],
)
def test_compute_scale(amax: float, dtype: torch.dtype, expected: float) -> None:
    assert compute_scale(torch.tensor(amax), dtype).item() == expected


def test_quantize_counts_flushed_and_saturated_e4m3() -> None:
    # e4m3fn: smallest subnormal 2^-9, so |x| <= 2^-10 rounds to zero; max 448.
    x = torch.tensor([0.0, 1e-6, -1e-6, 1.0, 500.0, -1000.0, 2.0**-9, 0.0009, math.inf, math.nan])
    q = quantize(x, E4M3, torch.tensor(1.0))
    amax, scale, flushed, saturated = q.values.tolist()
    assert (flushed, saturated) == (3.0, 3.0)  # 1e-6, -1e-6, 0.0009 | 500, -1000, inf
    assert scale == 1.0 and q.inv_scale.item() == 1.0 and math.isnan(amax)  # nan propagates
    back = q.data.float()
    assert back[4].item() == 448.0 and back[5].item() == -448.0 and back[8].item() == 448.0
    assert back[6].item() == 2.0**-9 and math.isnan(back[9].item())


def test_quantize_counts_with_scale_e5m2() -> None:
    # e5m2: smallest subnormal 2^-16, max 57344. Scale 16: 1e-6 -> 1.6e-5 survives, 1e-7 flushes.
    x = torch.tensor([1e-7, 1e-6, 1.0, 3000.0, -5000.0, 0.0, 2.0, 3.0])
    q = quantize(x, E5M2, torch.tensor(16.0))
    _, scale, flushed, saturated = q.values.tolist()
    assert (scale, flushed, saturated) == (16.0, 1.0, 1.0)  # 1e-7 | -80000
    assert q.inv_scale.item() == 1 / 16
    assert q.data.float()[4].item() == -57344.0


def test_current_scaling_never_counts_its_own_amax_as_saturated() -> None:
    torch.manual_seed(0)
    for _ in range(20):
        x = torch.randn(257) * torch.rand(()) * 10
        amax = x.abs().max()
        q = quantize(x, E4M3, compute_scale(amax, E4M3))
        assert q.values[3].item() == 0.0


@pytest.mark.parametrize("kernel", ["scaled_mm", "dequant"])
def test_fp8_linear_matches_quantise_dequantise_reference(kernel: str) -> None:
    torch.manual_seed(0)
    lin, x = nn.Linear(64, 32), torch.randn(16, 64)
    expected = _roundtrip(x, E4M3) @ _roundtrip(lin.weight, E4M3).T + lin.bias.double()
    with enable_fp8(lin, Fp8Recipe("e4m3", "current", kernel=kernel)) as handle:
        y = lin(x)
    # Only the final bf16 rounding (and fp32 accumulation) separates the two.
    err = (y.double() - expected).abs()
    assert (err <= U_BF16 * expected.abs() + 1e-6).all()
    assert {row["kernel"] for row in handle.stats()} == {kernel}


def test_fp8_linear_is_within_what_e4m3_explains_and_far_from_exact() -> None:
    torch.manual_seed(1)
    lin, x = nn.Linear(128, 48), torch.randn(32, 128)
    exact = x.double() @ lin.weight.double().T + lin.bias.double()
    with enable_fp8(lin, "e4m3:current"):
        y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (32, 48)
    # Each operand is off by <= u relative (u = 2^-4); normalise by magnitudes, not by |y|.
    magnitude = x.double().abs() @ lin.weight.double().abs().T + lin.bias.double().abs()
    ratio = ((y.double() - exact).abs() / magnitude).max().item()
    assert ratio <= 2 * U_E4M3 + U_BF16
    assert _rel(y, exact) > 2 * U_BF16  # not merely bf16 output rounding: fp8 is really applied


def test_kernels_agree_and_odd_shapes_are_padded() -> None:
    torch.manual_seed(2)
    lin, x = nn.Linear(33, 17), torch.randn(5, 3, 33)  # nothing a multiple of 16; 3-D input
    outs = {}
    for kernel in ("scaled_mm", "dequant"):
        with enable_fp8(lin, Fp8Recipe("hybrid", "current", kernel=kernel)) as handle:
            outs[kernel] = lin(x)
            assert handle.stats()[0]["kernel"] == kernel
    assert outs["scaled_mm"].shape == (5, 3, 17)
    # Same exact products, different accumulation order: at most one bf16 ulp apart.
    diff = (outs["scaled_mm"] - outs["dequant"]).abs()
    assert (diff <= U_BF16 * outs["dequant"].abs() + 1e-6).all()


def test_gradients_flow_through_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    lin = nn.Linear(32, 24)
    x = torch.randn(8, 32, requires_grad=True)
    g = torch.randn(8, 24)
    with enable_fp8(lin, "hybrid:current") as handle:
        lin(x).backward(g)
    assert x.grad.shape == x.shape and lin.weight.grad.shape == lin.weight.shape
    assert lin.bias.grad.shape == lin.bias.shape
    xq, wq, gq = _roundtrip(x, E4M3), _roundtrip(lin.weight, E4M3), _roundtrip(g, E5M2)
    grad_x, grad_w = gq @ wq, gq.T @ xq
    assert ((x.grad.double() - grad_x).abs() <= U_BF16 * grad_x.abs() + 1e-6).all()
    assert _rel(lin.weight.grad, grad_w) < 1e-6  # fp32 accumulator, no bf16 rounding
    assert torch.allclose(lin.bias.grad, g.sum(0), rtol=1e-6, atol=1e-6)
    # e5m2 gradients are coarse: clearly off the fp32 gradient, within what e5m2 + e4m3 explain.
    exact = g.double() @ lin.weight.double()
    assert 2 * U_BF16 < _rel(x.grad, exact) < U_E5M2 + U_E4M3
    roles = [(row["role"], row["format"]) for row in handle.stats()]
    assert roles == [("input", "e4m3"), ("weight", "e4m3"), ("grad_output", "e5m2")]


def test_remove_restores_bitwise_and_keeps_modules_and_hooks() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 16)
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out))
    before = model(x)
    names_before = [(name, id(m)) for name, m in model.named_modules()]
    handle = enable_fp8(model, "e4m3:current")
    assert handle.modules == ["0", "2"] and "forward" in model[0].__dict__
    during = model(x)
    assert [(name, id(m)) for name, m in model.named_modules()] == names_before
    assert len(seen) == 2 and not torch.equal(seen[1], seen[0])  # the hook saw the fp8 output
    assert not torch.equal(during, before)
    handle.remove()
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    assert torch.equal(model(x), before)


def test_delayed_scaling_uses_the_amax_history() -> None:
    lin = nn.Linear(16, 4)
    base = torch.randn(4, 16)
    base = base / base.abs().max()  # amax exactly 1
    handle = enable_fp8(lin, Fp8Recipe("e4m3", "delayed", history=2))
    for factor in (8.0, 1.0, 1.0, 1.0):
        lin(base * factor)
    inputs = [row for row in handle.stats() if row["role"] == "input"]
    assert [row["call"] for row in inputs] == [0, 1, 2, 3]
    assert [row["amax"] for row in inputs] == [8.0, 1.0, 1.0, 1.0]
    # Call 0 uses its own amax; calls 1-2 still see 8 in the 2-long history; call 3 no longer.
    assert [row["scale_amax"] for row in inputs] == [8.0, 8.0, 8.0, 1.0]
    assert inputs[1]["scale"] == pytest.approx(448.0 / 8.0)
    handle.remove()


def test_delayed_scaling_saturates_when_values_grow() -> None:
    torch.manual_seed(5)
    x = torch.randn(64, 16)
    results = {}
    for scaling in ("current", "delayed"):
        lin = nn.Linear(16, 4)
        with enable_fp8(lin, Fp8Recipe("e4m3", scaling)) as handle:
            lin(x)
            lin(x * 10.0)  # delayed: scaled by the first call's amax, 10x too large
            last = [row for row in handle.stats() if row["role"] == "input"][-1]
        results[scaling] = last
    assert results["current"]["saturated"] == 0
    expected = int((x.abs() * 10.0 * (448.0 / x.abs().max()) > 448.0).sum())
    assert results["delayed"]["saturated"] == expected > 0
    assert results["delayed"]["saturated_fraction"] == expected / x.numel()


def test_reset_starts_a_new_step_and_counts_calls_per_module() -> None:
    lin = nn.Linear(8, 8)
    handle = enable_fp8(lin, "hybrid:delayed")
    x = torch.randn(2, 8)
    lin(lin(x))  # weight sharing: two calls of one module
    step0 = handle.stats()
    assert [(r["call"], r["role"]) for r in step0] == [
        (0, "input"), (0, "weight"), (1, "input"), (1, "weight")]
    handle.reset()
    assert handle.stats() == []
    lin(x * 0.01)
    step1 = handle.stats()
    assert {r["call"] for r in step1} == {0}
    # The amax history outlives the step: the scale still comes from step 0's inputs.
    assert step1[0]["scale_amax"] == max(r["amax"] for r in step0 if r["role"] == "input")
    handle.reset(history=True)
    lin(x * 0.01)
    assert handle.stats()[0]["scale_amax"] == handle.stats()[0]["amax"]
    handle.remove()


def test_enable_errors_and_skips() -> None:
    class Lora(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Lora(4, 4))
    handle = enable_fp8(model)
    assert handle.modules == ["0"] and handle.skipped == ["1"]
    with pytest.raises(DriftcheckError, match="already enabled on 0"):
        enable_fp8(model)
    handle.remove()
    with pytest.raises(DriftcheckError, match=r"no nn\.Linear"):
        enable_fp8(nn.Sequential(nn.ReLU()))


def test_scaled_mm_failure_falls_back_or_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(fp8, "_BROKEN", set())
    lin, x = nn.Linear(16, 16), torch.randn(2, 16)
    with enable_fp8(lin, Fp8Recipe("e5m2", "current", kernel="auto")) as handle:
        lin(x)
        assert handle.stats()[0]["kernel"] == "dequant"
    with enable_fp8(lin, Fp8Recipe("e5m2", "current", kernel="scaled_mm")):
        with pytest.raises(DriftcheckError, match=r"cannot multiply e5m2 x e5m2 on cpu \(Multi"):
            lin(x)


@pytest.mark.parametrize("kernel", ["scaled_mm", "dequant"])
def test_autocast_does_not_change_the_fp8_result(kernel: str) -> None:
    torch.manual_seed(6)
    lin, x = nn.Linear(32, 16), torch.randn(4, 32)
    with enable_fp8(lin, Fp8Recipe("hybrid", "current", kernel=kernel)):
        plain = lin(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = lin(x)
    assert torch.equal(plain, under.float())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_on_cuda_matches_cpu() -> None:
    torch.manual_seed(7)
    lin, x = nn.Linear(40, 24), torch.randn(6, 40, requires_grad=True)
    with enable_fp8(lin, "hybrid:current"):
        cpu_out = lin(x)
    gpu = nn.Linear(40, 24).cuda()
    gpu.load_state_dict(lin.state_dict())
    with enable_fp8(gpu, "hybrid:current") as handle:
        out = gpu(x.cuda())
        out.sum().backward()
        kernels = {row["kernel"] for row in handle.stats()}
    if torch.cuda.get_device_capability() >= (8, 9):
        assert "scaled_mm" in kernels
    diff = (out.cpu() - cpu_out).abs()
    assert (diff <= U_BF16 * cpu_out.abs() + 1e-5).all()


def test_full_backward_hooks_see_fp8_gradients() -> None:
    torch.manual_seed(8)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    grads: list[tuple] = []
    lin.register_full_backward_hook(lambda mod, gin, gout: grads.append((mod, gin, gout)))
    with enable_fp8(lin, "hybrid:current"):
        lin(x).pow(2).sum().backward()
    [(module, grad_input, grad_output)] = grads
    assert module is lin
    assert grad_input[0].shape == x.shape and grad_output[0].shape == (4, 8)
    assert torch.equal(grad_input[0], x.grad)

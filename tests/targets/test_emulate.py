"""TPU matmul precision emulation (driftcheck/emulate.py, ``--emulate tpu``): hand-computed
expectations for each level, the backward through the same passes, and whole runs that pass
against an fp32 reference while a defect is still caught at its module."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.targets.emulate import LEVELS, TpuMatmul, emulate_tpu, level_of, split

aten = torch.ops.aten


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def test_split_parts_are_bf16_and_sum_to_the_value():
    x = torch.randn(1000, dtype=torch.float32) * 1e3
    for n in (1, 2, 3):
        parts = split(x, n)
        assert all(torch.equal(p, _bf16(p)) for p in parts)
    # three bf16 parts hold all 24 bits of an fp32 value
    assert torch.equal(sum(split(x, 3)[::-1]), x)


def test_default_is_bitwise_the_bf16_rounded_inputs_multiplied_in_fp32():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(33, 70, generator=g), torch.randn(70, 17, generator=g)
    bias = torch.randn(17, generator=g)
    a3, b3 = torch.randn(4, 9, 70, generator=g), torch.randn(4, 70, 5, generator=g)
    x, w = torch.randn(2, 3, 12, 12, generator=g), torch.randn(6, 3, 3, 3, generator=g)
    with emulate_tpu("default") as mode:
        mm, addmm, bmm = a @ b, F.linear(a, b.t(), bias), torch.bmm(a3, b3)
        conv = F.conv2d(x, w, padding=1)
    assert torch.equal(mm, _bf16(a) @ _bf16(b))
    assert torch.equal(addmm, torch.addmm(bias, _bf16(a), _bf16(b)))
    assert torch.equal(bmm, torch.bmm(_bf16(a3), _bf16(b3)))
    assert torch.equal(conv, F.conv2d(_bf16(x), _bf16(w), padding=1))
    assert {"mm.default", "bmm.default", "convolution.default"} <= set(mode.calls)


def _cases():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
    yield "random", a, b
    # cancellation: each dot product sums terms of both signs whose sum is ~1e-4 of them
    c = torch.randn(64, 128, generator=g)
    yield "cancelling", torch.cat([c, c * (1 + 1e-4)], 1), torch.cat([b[:128], -b[:128]], 0)
    # a wide dynamic range: the low parts carry most of what matters
    yield "wide range", a * torch.logspace(-6, 6, 256)[None, :], b


# |C - AB| <= bound * (|A||B|) elementwise: the level's bf16 passes lose about u_level of each
# product, the fp32 accumulation of n terms about n 2^-24 (a loose worst case)
BANDS = {"default": 2.0**-8, "high": 2.0**-16, "highest": 2.0**-22}


@pytest.mark.parametrize("case,a,b", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_levels_fall_in_their_bands_against_float64(case, a, b):
    exact = a.double() @ b.double()
    mags = a.double().abs() @ b.double().abs()
    n = a.shape[1]
    errors = {}
    for level in LEVELS:
        with emulate_tpu(level):
            got = a @ b
        rel = float(((got.double() - exact).abs() / mags).max())
        errors[level] = rel
        assert rel <= 2 * BANDS[level] + n * 2.0**-24, (level, rel)
    # each level is really more accurate than the one below it (not all the same kernel)
    assert errors["default"] > 8 * errors["high"] and errors["high"] > 2 * errors["highest"], errors


def test_linear_and_conv_backward_use_the_same_passes():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(40, 24)
    x = torch.randn(8, 40, generator=g, requires_grad=True)
    with emulate_tpu("default") as mode:
        y = lin(x)
        gy = torch.randn(y.shape, generator=g)
        y.backward(gy)
    assert torch.equal(x.grad, _bf16(gy) @ _bf16(lin.weight.detach()))
    assert torch.equal(lin.weight.grad, _bf16(gy).t() @ _bf16(x.detach()))
    assert mode.calls.get("mm.default", 0) >= 2

    conv = nn.Conv2d(3, 5, 3, padding=1)
    xi = torch.randn(2, 3, 10, 10, generator=g, requires_grad=True)
    with emulate_tpu("default") as mode:
        out = conv(xi)
        go = torch.randn(out.shape, generator=g)
        out.backward(go)
    gi, gw, _ = aten.convolution_backward.default(
        _bf16(go), _bf16(xi.detach()), _bf16(conv.weight.detach()), [5], [1, 1], [1, 1], [1, 1], False,
        [0, 0], 1, [True, True, True])
    assert torch.equal(xi.grad, gi) and torch.equal(conv.weight.grad, gw)
    assert torch.allclose(conv.bias.grad, go.sum((0, 2, 3)))  # a sum, not a matmul: exact fp32
    assert mode.calls.get("convolution_backward.default") == 1


def test_attention_matmuls_are_emulated_too():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    with emulate_tpu("default") as mode:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    assert mode.calls.get("bmm.default", 0) >= 2
    exact = F.scaled_dot_product_attention(*(q.detach().double(),) * 3)
    fp32 = F.scaled_dot_product_attention(*(q.detach(),) * 3)
    with emulate_tpu("default"):
        out = F.scaled_dot_product_attention(*(q.detach(),) * 3)
    rel = lambda x: float((x.double() - exact).norm() / exact.norm())
    assert rel(out) > 1e-4 > 1e-6 > rel(fp32)  # the bf16 passes show; plain fp32 is far closer


def test_bf16_inputs_accumulate_in_fp32():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(16, 512, generator=g).bfloat16(), torch.randn(512, 8, generator=g).bfloat16()
    with TpuMatmul("high"):
        got = a @ b
    assert got.dtype == torch.bfloat16 and torch.equal(got, (a.float() @ b.float()).bfloat16())


def test_level_names_map_as_torch_tpu_maps_them():
    assert [level_of(n) for n in (None, "medium", "default", "high", "highest")] == \
        ["default", "default", "default", "high", "highest"]


# -- whole runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("model", ["llama", "mlp", "resnet", "vit"])
def test_emulated_runs_of_every_builtin_pass(traces, tmp_path, model, level):
    from conftest import record_builtin

    from driftcheck.compare import compare

    ref = traces[model]["fp32"]
    tgt = record_builtin(model, tmp_path / "tgt", replay=ref, emulate=level)
    from driftcheck.store import TraceReader

    run = TraceReader(tgt).run
    assert run["emulation"]["matmul_precision"] == level and sum(run["emulation"]["ops"].values()) > 0
    rep = compare(ref, tgt)
    assert rep.verdict == "pass", rep.decided_by
    if level == "default":  # the bf16 passes show: the numbers differ from fp32's
        assert max(e.metrics.get("rel_l2", 0) for e in rep.entries if e.phase == "forward") > 1e-4


def test_a_defect_under_emulation_is_caught_at_its_module(traces, tmp_path):
    from conftest import a_middle_linear, record_builtin

    from driftcheck.compare import compare
    from driftcheck.targets.faults import scale_output

    mod = a_middle_linear("llama")
    bad = record_builtin("llama", tmp_path / "bad", replay=traces["llama"]["fp32"], emulate="default",
                         target_hooks=scale_output(mod, 1.25))
    rep = compare(traces["llama"]["fp32"], bad)
    assert rep.verdict == "fail" and rep.first_divergence["module"] == mod


def test_cli_emulation_is_recorded_and_named(tmp_path, capsys):
    from conftest import run_cli

    code, out, _ = run_cli(["run", "mlp", "--target", "cpu", "--emulate", "tpu", "--matmul-precision", "high",
                            "--out", tmp_path / "run"], capsys)
    assert code == 0 and "with TPU matmuls at 'high'" in out
    code, _, err = run_cli(["run", "mlp", "--target", "meta", "--emulate", "tpu", "--out", tmp_path / "r2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r2").exists()

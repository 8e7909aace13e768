"""Fault injection: each fault is caught and named at the module it was injected into, and the
controls (legitimate noise) never raise an alarm. A representative subset of bench/faults.py."""
from __future__ import annotations

import math

import pytest
import torch

from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record
from driftcheck.targets import faults

MODELS = ("mlp", "resnet", "llama", "vit")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model: fp32 reference, fp64 truth, clean bf16 target with local replay, its report."""
    root = tmp_path_factory.mktemp("faults")
    out = {}
    for name in MODELS:
        d = root / name
        record(load_scenario(name), d / "ref", dtype="fp32")
        record(load_scenario(name), d / "truth", dtype="fp64", replay=d / "ref")
        record(load_scenario(name), d / "clean", dtype="bf16", replay=d / "ref", local=d / "ref")
        out[name] = (d, compare(d / "ref", d / "clean", truth=d / "truth"))
    return out


def _target(runs, name, hooks=None, dtype="bf16", mode=None, local=True):
    d, _ = runs[name]
    with mode if mode is not None else _Null():
        record(load_scenario(name), d / "target", dtype=dtype, replay=d / "ref", force=True,
               target_hooks=hooks, local=(d / "ref") if local else None)
    return compare(d / "ref", d / "target", truth=d / "truth")


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


def _floor(runs, name, module, phase="forward", slot="output"):
    """The clean bf16 floor of (step 0, module, call 0, slot) and the reference rms there."""
    _, clean = runs[name]
    e = next(e for e in clean.entries if (e.step, e.phase, e.module, e.call, e.slot) == (0, phase, module, 0, slot))
    return e.floor, e.metrics["ref_rms"]


def _assert_localized(rep, module):
    assert rep.verdict == "fail", rep.decided_by
    fd = rep.first_divergence
    assert fd is not None and fd["blame_module"] == module, fd


# -- controls: every one, every model --------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_control_fp32_vs_bf16_passes(runs, name):
    _, clean = runs[name]
    assert clean.verdict == "pass", clean.decided_by
    worst = max(v for e in clean.entries for v in (e.ratio, e.local_ratio) if v is not None)
    assert worst < clean.limit / 2  # a margin, not a near miss


@pytest.mark.parametrize("name", MODELS)
def test_control_thread_count_passes(runs, name):
    old = torch.get_num_threads()
    torch.set_num_threads(1 if old > 1 else 2)
    try:
        rep = _target(runs, name, dtype="fp32")
    finally:
        torch.set_num_threads(old)
    assert rep.verdict == "pass", rep.decided_by


@pytest.mark.parametrize("name", MODELS)
def test_control_stochastic_rounding_passes(runs, name):
    rep = _target(runs, name, mode=faults.stochastic_rounding(seed=3))
    assert rep.verdict == "pass", rep.decided_by


# -- faults ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,module,kind", [
    ("llama", "layers.1.mlp.down_proj", "scale"),
    ("resnet", "layer2.bn1", "offset"),
    ("vit", "blocks.1.norm1", "scale"),
    ("mlp", "act1", "offset"),
])
def test_output_fault_at_4x_floor_is_caught_where_injected(runs, name, module, kind):
    floor, rms = _floor(runs, name, module)
    fault = faults.scale_output(module, 1 + 4 * floor / rms) if kind == "scale" \
        else faults.offset_output(module, 4 * floor)
    rep = _target(runs, name, fault)
    _assert_localized(rep, module)
    assert rep.first_divergence["step"] == 0 and rep.first_divergence["phase"] == "forward"


def test_composite_module_fault_is_blamed_on_it_not_on_its_children(runs):
    floor, rms = _floor(runs, "vit", "blocks.0.attn")
    rep = _target(runs, "vit", faults.scale_output("blocks.0.attn", 1 + 8 * floor / rms))
    _assert_localized(rep, "blocks.0.attn")


def test_fp8_matmul_in_one_linear_is_caught(runs):
    rep = _target(runs, "mlp", faults.fp8_matmul("fc2"))
    _assert_localized(rep, "fc2")


def test_wrong_gradient_is_caught_in_the_backward(runs):
    floor, rms = _floor(runs, "resnet", "layer1.conv2", "backward", "grad_input.0")
    rep = _target(runs, "resnet", faults.scale_grad("layer1.conv2", 1 + 8 * floor / rms))
    _assert_localized(rep, "layer1.conv2")
    assert rep.first_divergence["phase"] == "backward"
    assert rep.first_divergence["slot"] == "grad_input.0"


def test_other_dropout_mask_is_caught(runs):
    rep = _target(runs, "mlp", faults.other_dropout_mask("drop1"))
    _assert_localized(rep, "drop1")


def test_batch_norm_statistics_summed_in_bf16_are_caught(runs):
    rep = _target(runs, "resnet", faults.low_precision_reduction("layer2.bn1", torch.bfloat16, ("batch_norm",)))
    _assert_localized(rep, "layer2.bn1")
    assert rep.first_divergence["local_ratio"] > rep.limit  # seen by the local replay


def test_overflow_is_caught_as_nonfinite(runs):
    rep = _target(runs, "llama", faults.overflow("layers.0.mlp.up_proj"))
    origin = [f for f in rep.findings if f.kind == "nonfinite.origin"]
    assert len(origin) == 1
    assert (origin[0].module, origin[0].step, origin[0].phase) == ("layers.0.mlp.up_proj", 0, "forward")
    _assert_localized(rep, "layers.0.mlp.up_proj")


# -- the library itself ----------------------------------------------------------------------------
def test_fault_remove_restores_the_module():
    model = load_scenario("mlp").model.eval()  # no dropout: the same input, the same output
    x = torch.randn(3, 32)
    before = model(x)
    fault = faults.scale_output("fc2", 2.0)(model)
    assert not torch.equal(model(x), before)
    fault.remove()
    assert torch.equal(model(x), before)
    assert "forward" not in model.fc2.__dict__


def test_unknown_module_is_a_user_error():
    with pytest.raises(DriftcheckError, match="no submodule 'nope'"):
        faults.scale_output("nope", 2.0)(load_scenario("mlp").model)


def test_sequential_bf16_sum_loses_what_an_fp32_accumulator_keeps():
    x = torch.full((1, 512), 1.0)
    # 256 + 1 is not representable in bf16: a bf16 running sum stalls at 256.
    assert faults.sequential_sum(x, (-1,), torch.bfloat16).item() == 256.0
    assert faults.sequential_sum(x, (-1,), torch.float32).item() == 512.0


def test_stochastic_rounding_moves_values_by_at_most_one_ulp_and_leaves_copies_alone():
    a = torch.randn(4096).to(torch.bfloat16)
    b = torch.randn(4096).to(torch.bfloat16)
    rn = a * b  # round to nearest
    with faults.stochastic_rounding(seed=0):
        y = a * b
        c = a.clone()
    assert torch.equal(c, a)  # copies are exact on every backend: left alone
    ulp = torch.ldexp(torch.ones(4096, dtype=torch.float64), torch.frexp(rn.double())[1] - 8)
    moved = (y.double() - rn.double()).abs() / ulp
    assert set(moved.unique().tolist()) <= {0.0, 1.0}  # one ULP or nothing
    assert math.isclose((moved > 0).float().mean().item(), 0.25, abs_tol=0.05)

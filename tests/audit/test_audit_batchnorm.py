"""The BatchNorm running-stat audit: silent on correct runs, names each injected fault."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from driftcheck.audit.batchnorm import audit_call, is_tracked_norm, snapshot
from driftcheck.targets.simulate import skip_batchnorm_stat_updates

MOMENTA = [0.1, 0.5, 1.0, None]
LAYERS = [  # (constructor, input shape)
    (lambda m: nn.BatchNorm1d(4, momentum=m), (8, 4)),
    (lambda m: nn.BatchNorm1d(4, momentum=m), (8, 4, 7)),
    (lambda m: nn.BatchNorm2d(4, momentum=m), (6, 4, 5, 5)),
    (lambda m: nn.BatchNorm3d(4, momentum=m), (2, 4, 3, 3, 3)),
    (lambda m: nn.SyncBatchNorm(4, momentum=m), (6, 4, 5)),  # single process: plain batch norm
    (lambda m: nn.InstanceNorm2d(4, momentum=m, track_running_stats=True), (6, 4, 5, 5)),
    (lambda m: nn.InstanceNorm1d(4, momentum=m, track_running_stats=True), (4, 9)),  # unbatched
]


def _inputs(shape, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # An offset mean makes E[x^2] >> var: the case where a sloppy tolerance raises false alarms.
    return [(torch.randn(shape, generator=g) * 3 + 5).to(dtype) for _ in range(steps)]


def _run(module, xs, fault=None, training=True):
    module.train(training)
    findings = []
    for step, x in enumerate(xs):
        before = snapshot(module)
        if fault is None:
            module(x)
        else:
            with fault():
                module(x)
        findings += audit_call("net.bn", module, x, before, snapshot(module), module.training,
                               step, 0)
    return findings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum", MOMENTA)
@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_correct_updates_give_no_findings(layer, momentum, dtype):
    make, shape = LAYERS[layer]
    module = make(momentum).to(dtype)
    assert is_tracked_norm(module)
    assert _run(module, _inputs(shape, 3, dtype)) == []
    assert _run(module, _inputs(shape, 2, dtype, seed=1), training=False) == []


def test_is_tracked_norm():
    assert is_tracked_norm(nn.BatchNorm2d(3))
    assert not is_tracked_norm(nn.BatchNorm2d(3, track_running_stats=False))
    assert not is_tracked_norm(nn.InstanceNorm2d(3))  # track_running_stats defaults to False
    assert not is_tracked_norm(nn.LayerNorm(3))

    class MyBN(nn.BatchNorm1d):
        pass

    assert is_tracked_norm(MyBN(3))


def test_snapshot_is_a_copy():
    bn = nn.BatchNorm1d(3)
    snap = snapshot(bn)
    bn(torch.randn(4, 3) + 1)
    assert torch.equal(snap["running_mean"], torch.zeros(3))
    assert int(snap["num_batches_tracked"]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_torch_tpu_signature_is_named(dtype, momentum):
    bn = nn.BatchNorm2d(4, momentum=momentum).to(dtype)
    findings = _run(bn, _inputs((6, 4, 5, 5), 2, dtype), fault=skip_batchnorm_stat_updates)
    assert [f.kind for f in findings] == ["batchnorm.running_stats_not_updated"] * 2
    assert "torch_tpu 0.2.0" in findings[0].message and "evaluation" in findings[0].message
    assert findings[0].module == "net.bn" and findings[1].step == 1
    assert findings[0].details["counter_advanced"] is True


def _corrupt(module, x, edit):
    """One training call whose buffers are then edited, as a faulty kernel would leave them."""
    module.train()
    before = snapshot(module)
    module(x)
    with torch.no_grad():
        edit(module)
    return audit_call("bn", module, x, before, snapshot(module), True, 0, 0)


def test_biased_variance_is_wrong():
    x = _inputs((8, 4), 1, torch.float32)[0]
    bn = nn.BatchNorm1d(4)
    # The kernel used the biased variance (divide by n, not n - 1).
    var_b, var_u = x.var(0, unbiased=False), x.var(0, unbiased=True)
    found = _corrupt(bn, x, lambda m: m.running_var.add_(0.1 * (var_b - var_u)))
    assert [f.kind for f in found] == ["batchnorm.running_stats_wrong"]
    assert found[0].details["buffer"] == "running_var"
    injected = float((0.1 * (var_u - var_b)).abs().max())
    assert found[0].details["max_abs_error"] == pytest.approx(injected, rel=1e-3)


def test_momentum_applied_the_other_way_is_wrong():
    x = _inputs((8, 4, 3), 1, torch.float32)[0]
    bn = nn.BatchNorm1d(4, momentum=0.1)
    batch_mean = x.mean((0, 2))
    # PyTorch's momentum weights the new batch; Keras's weights the old value.
    found = _corrupt(bn, x, lambda m: m.running_mean.copy_(0.9 * batch_mean))
    assert [f.kind for f in found] == ["batchnorm.running_stats_wrong"]
    assert found[0].details["buffer"] == "running_mean"


def _next_bf16_up(t):
    return t.copy_(torch.nextafter(t, torch.full_like(t, 1e3)))


def test_one_bf16_ulp_is_tolerated_but_five_percent_is_not():
    x = _inputs((8, 4), 1, torch.bfloat16)[0]
    ulp = _corrupt(nn.BatchNorm1d(4).bfloat16(), x, lambda m: _next_bf16_up(m.running_mean))
    assert ulp == []
    big = _corrupt(nn.BatchNorm1d(4).bfloat16(), x, lambda m: m.running_mean.mul_(1.05))
    assert [f.kind for f in big] == ["batchnorm.running_stats_wrong"]


def test_counter_not_advanced():
    x = _inputs((8, 4), 1, torch.float32)[0]
    found = _corrupt(nn.BatchNorm1d(4), x, lambda m: m.num_batches_tracked.sub_(1))
    assert [f.kind for f in found] == ["batchnorm.counter_not_advanced"]


def test_counter_advanced_twice():
    x = _inputs((8, 4), 1, torch.float32)[0]
    found = _corrupt(nn.BatchNorm1d(4), x, lambda m: m.num_batches_tracked.add_(1))
    assert [f.kind for f in found] == ["batchnorm.counter_wrong"]
    assert found[0].details["advanced_by"] == 2


def test_update_in_eval_mode():
    bn = nn.BatchNorm1d(4)
    x = _inputs((8, 4), 1, torch.float32)[0]
    bn.eval()
    before = snapshot(bn)
    bn(x)
    with torch.no_grad():
        bn.running_var.mul_(0.5)  # as if the kernel ignored training=False
    found = audit_call("bn", bn, x, before, snapshot(bn), False, 3, 1)
    assert [f.kind for f in found] == ["batchnorm.updated_in_eval"]
    assert found[0].details == {"call": 1, "buffers": ["running_var"]}
    assert found[0].step == 3


def test_no_update_expected_no_finding():
    # momentum 0: the running stats must stay put; unchanged buffers are then correct.
    bn = nn.BatchNorm1d(4, momentum=0.0)
    assert _run(bn, _inputs((8, 4), 2, torch.float32)) == []
    assert _run(bn, _inputs((8, 4), 2, torch.float32), fault=skip_batchnorm_stat_updates) == []

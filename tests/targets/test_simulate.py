"""The simulated backends produce exactly their defect on real module code, and nothing else."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from driftcheck.targets.simulate import drop_view_writes, skip_batchnorm_stat_updates, views_become_copies


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def _step(model, x, fault=None):
    """Loss and gradients of one training step, optionally under a simulated backend."""
    model.zero_grad()
    if fault is None:
        loss = model(x).pow(2).mean()
        loss.backward()
    else:
        with fault():
            loss = model(x).pow(2).mean()
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


X = torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(3))


def test_views_become_copies_changes_aliasing_not_math():
    ref_loss, ref_grads = _step(_cnn(), X)
    loss, grads = _step(_cnn(), X, views_become_copies)
    # Flatten, the Linear's weight transpose, BN's reshapes all go through view ops: values
    # must come out identical, only the storage sharing differs.
    assert torch.equal(loss, ref_loss) and all(map(torch.equal, grads, ref_grads))
    base = torch.zeros(3, 4)
    with views_become_copies():
        row = base[1]
        flat = base.view(-1)
        row.fill_(1.0)
        flat[0] = 5.0
        parts = base.chunk(2, 1)
    assert row.sum() == 4 and torch.count_nonzero(base) == 0
    assert row.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() for p in parts)


def test_views_become_copies_loses_a_weight_edit_in_module_code():
    lin = nn.Linear(4, 2)
    with torch.no_grad(), views_become_copies():
        lin.weight[0] = 0.0  # e.g. pruning a row in place
    assert torch.count_nonzero(lin.weight[0]) == 4


def test_drop_view_writes_keeps_the_view_and_loses_the_base():
    ref_loss, ref_grads = _step(_cnn(), X)
    loss, grads = _step(_cnn(), X, drop_view_writes)
    assert torch.equal(loss, ref_loss) and all(map(torch.equal, grads, ref_grads))
    base = torch.zeros(3, 4)
    with drop_view_writes():
        v = base[:, 1:3]
        v.add_(2.0)              # write through a view: lost for the base
        base.add_(1.0)           # write to the base itself: kept
    assert torch.equal(v, torch.full((3, 2), 2.0))  # the view holds its own write
    assert torch.equal(base, torch.ones(3, 4))
    lin = nn.Linear(4, 2)
    with torch.no_grad(), drop_view_writes():
        lin.weight[:, 0].zero_()
        lin.bias.zero_()
    assert torch.count_nonzero(lin.weight[:, 0]) == 2 and torch.count_nonzero(lin.bias) == 0


def test_skip_batchnorm_stat_updates_is_the_torch_tpu_bug():
    correct, faulty = _cnn(), _cnn()
    for _ in range(3):
        ref_loss, ref_grads = _step(correct, X)
        loss, grads = _step(faulty, X, skip_batchnorm_stat_updates)
        # Training is untouched: same output, same loss, same gradients, bit for bit.
        assert torch.equal(loss, ref_loss) and all(map(torch.equal, grads, ref_grads))
    bn_ok, bn_bad = correct[1], faulty[1]
    assert torch.equal(bn_bad.running_mean, torch.zeros(4))
    assert torch.equal(bn_bad.running_var, torch.ones(4))
    assert int(bn_bad.num_batches_tracked) == int(bn_ok.num_batches_tracked) == 3
    assert not torch.equal(bn_ok.running_mean, bn_bad.running_mean)
    # ... and evaluation is wrong.
    correct.eval(), faulty.eval()
    assert not torch.allclose(correct(X), faulty(X), rtol=1e-3, atol=1e-3)


def test_skip_batchnorm_stat_updates_functional_and_eval():
    x = torch.randn(8, 3) + 2
    rm, rv = torch.zeros(3), torch.ones(3)
    with skip_batchnorm_stat_updates():
        out = F.batch_norm(x, rm, rv, training=True, momentum=0.5)
        evaluated = F.batch_norm(x, rm, rv, training=False)
    assert torch.equal(out, F.batch_norm(x, None, None, training=True))
    assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))
    assert torch.equal(evaluated, F.batch_norm(x, torch.zeros(3), torch.ones(3), training=False))

"""Probe programs: in-place ops on bases and views, metadata ops, autograd-facing aliasing, and
what optimizers and norm layers do in place."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from driftcheck.probe.programs import (
    Program,
    out as _out,
    raises as _raises,
    registrar,
    shares as _shares,
    write_through as _write_through,
    x_ as _x,
)

PROGRAMS: dict[str, Program] = {}
_program = registrar(PROGRAMS)

# ---------------------------------------------------------------------------------------------
# In-place ops with index or mask arguments, on bases and on views.

@_program
def index_put_accumulate(dev):
    x = _x(dev, 5)
    x.index_put_((torch.tensor([0, 2, 2, 4]).to(dev),), torch.ones(4).to(dev), accumulate=True)
    return _out(x=x)


@_program
def index_add_on_view(dev):
    return _write_through(dev, lambda x: x[:, 1:],
                          lambda v: v.index_add_(0, torch.tensor([0, 0]).to(v.device),
                                                 torch.ones(2, 3).to(v.device)), 3, 4)


@_program
def masked_fill_base(dev):
    x = _x(dev, 3, 4)
    x.masked_fill_(x > 4, 0.0)
    return _out(x=x)


@_program
def masked_fill_view(dev):
    return _write_through(dev, lambda x: x[:, :2], lambda v: v.masked_fill_(v > 3, -1.0), 3, 4)


@_program
def scatter_inplace(dev):
    x = _x(dev, 2, 4)
    x.scatter_(1, torch.tensor([[3], [0]]).to(dev), torch.tensor([[-1.0], [-2.0]]).to(dev))
    return _out(x=x)


@_program
def scatter_add_on_view(dev):
    return _write_through(dev, lambda x: x[1:],
                          lambda v: v.scatter_add_(1, torch.tensor([[0, 0], [1, 1]]).to(v.device),
                                                   torch.ones(2, 2).to(v.device)), 3, 4)


@_program
def copy_into_row_view(dev):
    new_row = torch.tensor([5.0, 6.0, 7.0, 8.0])
    return _write_through(dev, lambda x: x[0], lambda v: v.copy_(new_row.to(v.device)), 3, 4)


@_program
def copy_row_to_row(dev):
    x = _x(dev, 3, 4)
    x[0].copy_(x[2])
    return _out(x=x)


@_program
def copy_into_transposed(dev):
    x = _x(dev, 3, 4)
    x.t().copy_(_x(dev, 4, 3) * 10)
    return _out(x=x)


@_program
def relu_inplace_on_view(dev):
    x = _x(dev, 3, 4) - 6.0
    torch.relu_(x[1:])
    return _out(x=x)


@_program
def clamp_inplace_on_transposed(dev):
    x = _x(dev, 3, 4)
    x.t().clamp_(min=2.0, max=8.0)
    return _out(x=x)


@_program
def tril_inplace_on_view(dev):
    return _write_through(dev, lambda x: x[:, :3], lambda v: v.tril_(), 3, 4)


@_program
def fill_diagonal_inplace(dev):
    x = _x(dev, 3, 4)
    x.fill_diagonal_(-1.0)
    return _out(x=x)


# ---------------------------------------------------------------------------------------------
# In-place metadata ops.

@_program
def squeeze_inplace(dev):
    x = _x(dev, 1, 3, 1, 4)
    version = x._version
    x.squeeze_()
    return _out(x=x, shape=tuple(x.shape), strides=tuple(x.stride()),
                version_bumped=x._version > version)


@_program
def unsqueeze_inplace(dev):
    x = _x(dev, 3, 4)
    x.unsqueeze_(1)
    x.add_(1.0)
    return _out(x=x, shape=tuple(x.shape), strides=tuple(x.stride()))


@_program
def transpose_inplace(dev):
    x = _x(dev, 3, 4)
    x.t_()
    x[0].fill_(0.0)  # a write after the metadata change lands in the transposed position
    return _out(x=x, strides=tuple(x.stride()), contiguous=x.is_contiguous())


# ---------------------------------------------------------------------------------------------
# out= variants: the result must land in the given tensor, views included.

@_program
def out_add_into_view(dev):
    x = _x(dev, 3, 4)
    torch.add(_x(dev, 4), 100.0, out=x[1])
    return _out(x=x)


@_program
def out_mm_resizes(dev):
    o = torch.empty(0).to(dev)
    torch.mm(_x(dev, 2, 3), _x(dev, 3, 2), out=o)
    return _out(o=o, shape=tuple(o.shape))


@_program
def out_mm_into_view(dev):
    x = torch.zeros(4, 4).to(dev)
    torch.mm(_x(dev, 2, 3), _x(dev, 3, 2), out=x[1:3, 1:3])
    return _out(x=x)


# ---------------------------------------------------------------------------------------------
# Autograd-facing aliasing: .data, detach, no_grad leaf updates, version counters.

@_program
def data_assignment(dev):
    p = nn.Parameter(_x(dev, 2, 3))
    new = _x(dev, 2, 3) * -1
    p.data = new
    return _out(p=p, aliases_new=_shares(p, new), requires_grad=p.requires_grad)


@_program
def data_inplace(dev):
    p = nn.Parameter(_x(dev, 2, 3))
    version = p._version
    p.data.mul_(2.0)  # .data has its own version counter: autograd does not see this write
    return _out(p=p, version_bumped=p._version > version)


@_program
def leaf_inplace_under_no_grad(dev):
    w = _x(dev, 2, 3).requires_grad_()
    version = w._version
    with torch.no_grad():
        w.sub_(0.5 * torch.ones(2, 3).to(dev))
    return _out(w=w, is_leaf=w.is_leaf, requires_grad=w.requires_grad,
                version_bumped=w._version > version)


@_program
def detach_aliases(dev):
    x = _x(dev, 3, 4)
    y = x.detach()
    y.add_(1.0)
    return _out(x=x, shares=_shares(x, y))


@_program
def contiguous_of_transposed_copies(dev):
    x = _x(dev, 3, 4)
    y = x.t().contiguous()
    y.add_(1.0)
    return _out(x=x, y=y, shares=_shares(x, y))


@_program
def contiguous_of_contiguous_aliases(dev):
    x = _x(dev, 3, 4)
    y = x.contiguous()
    y.add_(1.0)
    return _out(x=x, same_object=y is x, shares=_shares(x, y))


@_program
def clone_does_not_alias(dev):
    x = _x(dev, 3, 4)
    y = x.clone()
    y.add_(1.0)
    return _out(x=x, shares=_shares(x, y))


@_program
def version_counter_shared_with_view(dev):
    x = _x(dev, 3, 4)
    v = x[0]
    before = x._version
    v.add_(1.0)
    return _out(x=x, base_bumped=x._version > before, same_counter=x._version == v._version)


@_program
def inplace_on_saved_tensor_raises(dev):
    a = _x(dev, 3).requires_grad_()
    b = a.sigmoid()  # sigmoid saves its output for backward
    b.mul_(2.0)
    return _out(raised=_raises(lambda: b.sum().backward()))


# ---------------------------------------------------------------------------------------------
# What optimizers and norm layers do in place.

def _params(dev: torch.device) -> list[torch.Tensor]:
    return [_x(dev, 3), _x(dev, 2, 2), _x(dev, 4) * 0.5]


@_program
def foreach_add_(dev):
    ps = _params(dev)
    torch._foreach_add_(ps, [torch.ones_like(p) for p in ps], alpha=-0.5)
    return _out(**{f"p{i}": p for i, p in enumerate(ps)})


@_program
def foreach_mul_(dev):
    ps = _params(dev)
    torch._foreach_mul_(ps, 0.5)
    return _out(**{f"p{i}": p for i, p in enumerate(ps)})


@_program
def foreach_lerp_(dev):
    ps = _params(dev)
    torch._foreach_lerp_(ps, [torch.full_like(p, 4.0) for p in ps], 0.25)
    return _out(**{f"p{i}": p for i, p in enumerate(ps)})


@_program
def foreach_add_on_flat_buffer_views(dev):
    flat = _x(dev, 10)  # parameters as views of one flat buffer (FSDP, apex-style flattening)
    ps = [flat[:3], flat[3:7].view(2, 2), flat[7:]]
    torch._foreach_add_(ps, [torch.ones_like(p) for p in ps])
    return _out(flat=flat, views=all(_shares(p, flat) for p in ps))


@_program
def sgd_step_updates_params(dev):
    w = nn.Parameter(_x(dev, 2, 3))
    opt = torch.optim.SGD([w], lr=0.5, momentum=0.5, foreach=True)
    for _ in range(2):
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step()
    return _out(w=w, buf=opt.state[w]["momentum_buffer"])


def _batch_norm_run(dev: torch.device, momentum: float | None) -> dict[str, Any]:
    bn = nn.BatchNorm1d(3, momentum=momentum).to(dev).train()
    for k in range(2):
        bn((_x(dev, 4, 3) + k) * 0.5)
    return _out(running_mean=bn.running_mean, running_var=bn.running_var,
                num_batches_tracked=bn.num_batches_tracked)


@_program
def batchnorm_buffers_update(dev):
    return _batch_norm_run(dev, 0.1)


@_program
def batchnorm_buffers_cumulative(dev):
    return _batch_norm_run(dev, None)


@_program
def batchnorm_eval_leaves_buffers(dev):
    bn = nn.BatchNorm1d(3).to(dev)
    with torch.no_grad():
        bn.running_mean.fill_(1.0)
    out = bn.eval()(_x(dev, 4, 3))
    return _out(out=out, running_mean=bn.running_mean, num_batches_tracked=bn.num_batches_tracked)

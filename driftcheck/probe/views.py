"""Probe programs: index assignment, and views written through."""
from __future__ import annotations

import torch

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
# Index assignment (__setitem__): select/slice + copy_/fill_, or index_put_.

@_program
def index_assign_int(dev):
    x = _x(dev, 3, 4)
    x[1] = 7.0
    return _out(x=x)


@_program
def index_assign_slice(dev):
    x = _x(dev, 3, 4)
    x[:, 1:3] = -1.0
    return _out(x=x)


@_program
def index_assign_strided_slice(dev):
    x = _x(dev, 4, 6)
    x[::2, 1::2] = torch.ones(2, 3).to(dev) * 5
    return _out(x=x)


@_program
def index_assign_ellipsis_none(dev):
    x = _x(dev, 2, 3, 4)
    x[..., None, 2] = torch.full((2, 3, 1), 9.0).to(dev)
    return _out(x=x)


@_program
def index_assign_bool_mask(dev):
    x = _x(dev, 3, 4)
    x[x > 5] = 0.0
    return _out(x=x)


@_program
def index_assign_tensor_index(dev):
    x = _x(dev, 4, 3)
    x[torch.tensor([0, 2]).to(dev)] = torch.tensor([[1.0, 2.0, 3.0]]).to(dev)
    return _out(x=x)


@_program
def index_assign_swap_rows(dev):
    x = _x(dev, 3, 4)
    x[[0, 1]] = x[[1, 0]]  # the right side is gathered (a copy) before the write
    return _out(x=x)


# ---------------------------------------------------------------------------------------------
# Views, then an in-place op through them.

@_program
def slice_view_write(dev):
    return _write_through(dev, lambda x: x[1:], lambda v: v.mul_(2.0), 3, 4)


@_program
def select_view_write(dev):
    return _write_through(dev, lambda x: x.select(1, 2), lambda v: v.add_(10.0), 3, 4)


@_program
def narrow_view_write(dev):
    return _write_through(dev, lambda x: x.narrow(0, 1, 2), lambda v: v.zero_(), 4, 3)


@_program
def transpose_view_write(dev):
    return _write_through(dev, lambda x: x.t(), lambda v: v.add_(_x(v.device, 4, 3)), 3, 4)


@_program
def permute_view_write(dev):
    return _write_through(dev, lambda x: x.permute(2, 0, 1), lambda v: v[1].mul_(-1.0), 2, 3, 4)


@_program
def view_write(dev):
    return _write_through(dev, lambda x: x.view(4, 3), lambda v: v[0, 0].fill_(100.0), 3, 4)


@_program
def view_of_view_write(dev):
    return _write_through(dev, lambda x: x.view(2, 6)[1][2:4], lambda v: v.fill_(-3.0), 3, 4)


@_program
def reshape_contiguous_aliases(dev):
    return _write_through(dev, lambda x: x.reshape(-1), lambda v: v[5:].neg_(), 3, 4)


@_program
def reshape_noncontiguous_copies(dev):
    # reshape of a transposed tensor cannot be a view: it must copy, and the base stays as is.
    return _write_through(dev, lambda x: x.t().reshape(-1), lambda v: v.fill_(0.0), 3, 4)


@_program
def flatten_write(dev):
    return _write_through(dev, lambda x: x.flatten(), lambda v: v[::2].zero_(), 2, 3, 2)


@_program
def unflatten_write(dev):
    return _write_through(dev, lambda x: x.unflatten(1, (2, 3)), lambda v: v[:, 1].add_(1.0), 2, 6)


@_program
def diagonal_write(dev):
    return _write_through(dev, lambda x: x.diagonal(), lambda v: v.fill_(-5.0), 4, 4)


@_program
def diagonal_offset_write(dev):
    return _write_through(dev, lambda x: x.diagonal(offset=1), lambda v: v.add_(1.0), 4, 4)


@_program
def as_strided_write(dev):
    return _write_through(dev, lambda x: x.as_strided((2, 2), (4, 1), 1), lambda v: v.mul_(-1.0),
                          3, 4)


@_program
def as_strided_overlapping_read(dev):
    x = _x(dev, 3, 4)
    v = x.as_strided((3, 3), (1, 1))  # overlapping windows: read-only use
    return _out(v=v, v_is_view=_shares(v, x), strides=tuple(v.stride()))


@_program
def unfold_read(dev):
    x = _x(dev, 8)
    v = x.unfold(0, 3, 2)
    return _out(v=v, v_is_view=_shares(v, x), strides=tuple(v.stride()))


@_program
def expand_read(dev):
    x = _x(dev, 1, 4)
    v = x.expand(3, 4)
    return _out(v=v, v_is_view=_shares(v, x), strides=tuple(v.stride()))


@_program
def expand_inplace_raises(dev):
    x = _x(dev, 1, 4)
    v = x.expand(3, 4)
    # Several elements of v share one memory location: PyTorch refuses the write.
    return _out(raised=_raises(lambda: v.add_(1.0)), x=x)


@_program
def chunk_write(dev):
    return _write_through(dev, lambda x: x.chunk(2, 0)[1], lambda v: v.mul_(3.0), 4, 3)


@_program
def split_sizes_write(dev):
    return _write_through(dev, lambda x: x.split([1, 2], 0)[1], lambda v: v.neg_(), 3, 4)


@_program
def unbind_write(dev):
    return _write_through(dev, lambda x: x.unbind(0)[2], lambda v: v.fill_(9.0), 3, 4)


@_program
def base_write_seen_by_view(dev):
    x = _x(dev, 3, 4)
    v = x[1]
    x.add_(1.0)  # written through the base: the view must read the new values
    return _out(v=v, v_is_view=_shares(v, x))

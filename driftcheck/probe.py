"""The view/in-place conformance suite behind ``driftcheck probe --device DEV``.

Each program is a few lines of ordinary PyTorch that depend on view and in-place semantics
(index assignment, slices, transposes, ``out=``, ``_foreach_*_`` as optimizers use them, the
BatchNorm buffer update, version counters). It runs on the reference (CPU) and on the device from
identical CPU-made inputs, and returns its results (moved to CPU) plus alias facts: "y is a view
of x", "the base changed", "the version counter bumped", "it raised". A conforming backend matches
the reference in both. Values are exact for the same device type, within a bf16-class tolerance
otherwise (TPU fp32 matmuls run as bf16 passes by default).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any, Callable

import torch
from torch import nn

from driftcheck.errors import DriftcheckError

__all__ = ["PROGRAMS", "ProbeResult", "probe_main", "run_probe"]

Program = Callable[[torch.device], dict[str, Any]]
PROGRAMS: dict[str, Program] = {}

# Cross-device tolerance (assert_close's bf16 pair): values here are small integers, so only the
# matmul, batch-norm and lerp programs can differ at all on a correct backend.
_RTOL, _ATOL = 1.6e-2, 1e-5


@dataclasses.dataclass
class ProbeResult:
    """One program's verdict; its truth value means "passed"."""

    name: str
    status: str  # "pass" | "mismatch" | "error"
    detail: str = ""

    def __bool__(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def run_probe(device: str, reference: str = "cpu",
              fault: Callable[[], Any] | None = None) -> list[ProbeResult]:
    """Run every program on ``reference`` and on ``device`` and compare values and alias facts.

    Args:
        device: the device under test (``"tpu"``, ``"cuda:0"``, ``"cpu"`` ...).
        reference: the trusted device.
        fault: a context-manager factory (``driftcheck.simulate.*``) applied around the device
            runs only, to prove the suite catches a given defect.
    """
    ref_dev, dev = _device(reference), _device(device)
    exact = ref_dev.type == dev.type
    results = []
    for name, program in PROGRAMS.items():
        try:
            expected = program(ref_dev)
        except Exception as err:  # noqa: BLE001 - a broken reference is reported, not raised
            results.append(ProbeResult(name, "error", f"reference {reference} raised: {err!r}"))
            continue
        try:
            with fault() if fault is not None else contextlib.nullcontext():
                actual = program(dev)
        except Exception as err:  # noqa: BLE001 - an op the device cannot run is a result
            results.append(ProbeResult(name, "error", f"{device} raised: {_short(err)}"))
            continue
        problems = _differences(expected, actual, exact)
        results.append(ProbeResult(name, "mismatch" if problems else "pass", "; ".join(problems)))
    return results


def probe_main(device: str, json_path: str | None = None, reference: str = "cpu",
               console: Any = None, fault: Callable[[], Any] | None = None) -> int:
    """Run the suite, print a table, optionally write JSON; returns the exit code (0 pass, 1 not).

    ``console`` is a ``rich.console.Console`` (default: stdout); ``fault`` as in ``run_probe``.

    Raises:
        DriftcheckError: the device string is not usable here (exit code 2 in the CLI).
    """
    from rich.console import Console
    from rich.table import Table

    results = run_probe(device, reference, fault)
    table = Table(title=f"driftcheck probe: {device} vs {reference}")
    for column in ("program", "status", "detail"):
        table.add_column(column)
    style = {"pass": "green", "mismatch": "red", "error": "yellow"}
    for r in results:
        table.add_row(r.name, f"[{style[r.status]}]{r.status}[/]", r.detail)
    console = console or Console()
    console.print(table)
    failed = [r for r in results if not r]
    console.print(f"{len(results) - len(failed)}/{len(results)} programs pass")
    if json_path:
        doc = {"schema": "driftcheck.probe/1", "device": device, "reference": reference,
               "passed": len(results) - len(failed), "total": len(results),
               "results": [r.to_dict() for r in results]}
        try:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
        except OSError as err:
            raise DriftcheckError(f"cannot write probe JSON to {json_path}: {err.strerror}; "
                                  "choose a writable path for --json") from err
    return 1 if failed else 0


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as err:
        raise DriftcheckError(f"device {name!r} is not usable here ({_short(err)}); check its "
                              "backend is installed and visible, or probe --device cpu") from err
    return dev


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _differences(expected: dict[str, Any], actual: dict[str, Any], exact: bool) -> list[str]:
    problems = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual or key not in expected:
            problems.append(f"{key}: present on one side only")
            continue
        e, a = expected[key], actual[key]
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            if e.shape != a.shape or e.dtype != a.dtype:
                problems.append(f"{key}: {tuple(a.shape)} {a.dtype}, expected "
                                f"{tuple(e.shape)} {e.dtype}")
            elif not _close(e, a, exact):
                diff = (e.double() - a.double()).abs().max().item() if e.numel() else 0.0
                problems.append(f"{key}: values differ (max abs {diff:.3g})")
        elif type(e) is not type(a) or e != a:
            problems.append(f"{key}: {a!r}, expected {e!r}")
    return problems


def _close(e: torch.Tensor, a: torch.Tensor, exact: bool) -> bool:
    if not e.is_floating_point():
        return torch.equal(e, a)
    if exact:  # bitwise, except that NaN matches NaN
        return bool(((e == a) | (e.isnan() & a.isnan())).all())
    return torch.allclose(a, e, rtol=_RTOL, atol=_ATOL, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Helpers the programs share. Inputs are made on CPU (the TPU RNG does not reproduce CPU streams)
# and are small integers, so every correct backend computes them exactly.


def _program(fn: Program) -> Program:
    PROGRAMS[fn.__name__] = fn
    return fn


def _x(dev: torch.device, *shape: int) -> torch.Tensor:
    """arange(numel) reshaped, as its own (non-view) tensor on ``dev``."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).clone().to(dev)


def _out(**values: Any) -> dict[str, Any]:
    return {k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
            for k, v in values.items()}


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _raises(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except RuntimeError:
        return True
    return False


def _write_through(dev: torch.device, make_view: Callable[[torch.Tensor], torch.Tensor],
                   write: Callable[[torch.Tensor], Any], *shape: int) -> dict[str, Any]:
    """Make a view of a fresh base, write through it; the base must see the write."""
    x = _x(dev, *shape)
    before = x.clone()
    v = make_view(x)
    write(v)
    return _out(x=x, v=v, v_is_view=_shares(v, x), base_changed=not torch.equal(x, before),
                strides=tuple(v.stride()), offset=v.storage_offset())


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
        bn(((_x(dev, 4, 3) + k) * 0.5))
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

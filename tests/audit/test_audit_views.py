"""The view/in-place audit: silent on legitimate in-place code, names each injected fault."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck.audit.views import ViewAudit, compare_events
from driftcheck.targets.simulate import drop_view_writes, views_become_copies


class Mix(nn.Module):
    """The in-place idioms real models use: index assignment, masked_fill_, slice *=."""

    def forward(self, y):
        z = y.clone()
        z[:, 0] = 0.0                      # select + fill_ through a view
        z.masked_fill_(z < -1.0, -1.0)     # in place on the base
        z[:, 1:3] *= 0.5                   # slice view, mul_
        z[torch.tensor([0, 2])] = 1.0      # index_put_
        return z


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 8)
        self.mix = Mix()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.bn(self.fc1(x)))
        y = self.fc2(h)
        y += h                             # x += y on a non-leaf
        return self.head(self.mix(y))


class ModuleStack:
    """What the tracer provides: the path of the module currently running."""

    def __init__(self, model):
        self.stack = [""]
        names = {m: n for n, m in model.named_modules()}
        for m in model.modules():
            m.register_forward_pre_hook(lambda mod, _: self.stack.append(names[mod]))
            m.register_forward_hook(self._leave)

    def _leave(self, module, args, output):
        self.stack.pop()

    def current(self):
        return self.stack[-1]


def _record(dtype, fault=None, steps=2, model_fn=Net):
    torch.manual_seed(0)
    model = model_fn().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 6, generator=g).to(dtype) for _ in range(steps)]
    where = ModuleStack(model)
    step = [0]
    audit = ViewAudit(where.current, lambda: step[0])
    with fault() if fault else contextlib.nullcontext():
        with audit:  # inside the fault, so the audit sees what the faulty backend returns
            for step[0], x in enumerate(xs):
                opt.zero_grad()
                model(x).float().pow(2).mean().backward()
                opt.step()
    return audit.events()


@pytest.fixture(scope="module")
def ref_events():
    return _record(torch.float32)


def test_events_describe_views_and_writes(ref_events):
    mix = [e for e in ref_events if e["module"] == "mix" and e["step"] == 0]
    ops = [e["op"] for e in mix]
    assert "aten.masked_fill_.Scalar" in ops and "aten.index_put_.default" in ops
    select = next(e for e in mix if e["op"] == "aten.select.int")
    assert select["kind"] == "view" and select["aliased"] is True
    assert select["sizes"] == [5] and select["strides"] == [8] and select["storage_offset"] == 0
    fill = next(e for e in mix if e["op"].startswith("aten.fill_"))
    assert fill["aliased"] is True and fill["base_changed"] is True
    assert set(fill["value"]) == {"sum", "abs_sum", "checksum", "checksum_scale"}
    masked = next(e for e in mix if e["op"] == "aten.masked_fill_.Scalar")
    assert masked["aliased"] is False and masked["base_changed"] is None and masked["value"] is None
    foreach = [e for e in ref_events if e["op"].startswith("aten._foreach_add_")]
    assert {e["arg"] for e in foreach} >= {"self.0", "self.5"}  # one event per parameter
    assert [e["index"] for e in mix] == list(range(len(mix)))


def test_same_program_same_backend_no_findings(ref_events):
    assert compare_events(ref_events, _record(torch.float32), value_tolerance=0.0) == []


def test_fp32_vs_bf16_no_findings(ref_events):
    # bf16 drift accumulated through the layers: a few percent of magnitude.
    bf16 = _record(torch.bfloat16)
    assert compare_events(ref_events, bf16, value_tolerance=0.1) == []
    # The default (16 bf16 roundoffs per op) is also enough for this small net.
    assert compare_events(ref_events, bf16) == []


def test_copies_instead_of_views_are_named(ref_events):
    found = compare_events(ref_events, _record(torch.float32, fault=views_become_copies), 0.0)
    kinds = {f.kind for f in found}
    assert kinds == {"view.alias_lost", "view.write_not_through_view"}
    where = {(f.module, f.details["op"]) for f in found if f.kind == "view.alias_lost"}
    assert ("mix", "aten.select.int") in where and ("mix", "aten.slice.Tensor") in where
    # The writes through those views landed in the copies: judged across layouts (writes.py).
    writes = {(f.module, f.details["op"]) for f in found if f.kind == "view.write_not_through_view"}
    assert {("mix", "aten.fill_.Tensor"), ("mix", "aten.mul_.Tensor")} <= writes
    assert all(f.step in (0, 1) for f in found)


def test_dropped_view_writes_are_named(ref_events):
    found = compare_events(ref_events, _record(torch.float32, fault=drop_view_writes), 0.0)
    lost = [f for f in found if f.kind == "inplace.base_not_updated"]
    assert {(f.module, f.details["op"]) for f in lost} >= {
        ("mix", "aten.fill_.Tensor"), ("mix", "aten.mul_.Tensor")}
    assert {f.kind for f in found} <= {"inplace.base_not_updated", "view.alias_lost",
                                       "inplace.value_mismatch"}


class _CorruptViewWrites(TorchDispatchMode):
    """A backend whose writes through views reach the base, but slightly wrong."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mul_.Tensor and args[0]._is_view():
            args[0].add_(0.25)
        return out


class _OffByOneSlice(TorchDispatchMode):
    """A backend whose slice views start one element late (still inside the storage)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.slice.Tensor and out.dim() == 2 and out.shape[1] == 2:
            return out.as_strided(out.shape, out.stride(), out.storage_offset() + 1)
        return out


def test_wrong_values_after_a_view_write_are_named(ref_events):
    found = compare_events(ref_events, _record(torch.float32, fault=_CorruptViewWrites), 1e-4)
    assert {f.kind for f in found} == {"inplace.value_mismatch"}
    first = found[0]  # forward of step 0 comes first; the backward's own view writes follow
    assert first.kind == "inplace.value_mismatch" and first.module == "mix" and first.step == 0
    assert first.details["op"] == "aten.mul_.Tensor" and first.details["error"] > 1e-4


def test_shifted_view_layout_is_named(ref_events):
    found = compare_events(ref_events, _record(torch.float32, fault=_OffByOneSlice), 0.0)
    layout = [f for f in found if f.kind == "view.layout_mismatch"]
    assert layout and layout[0].module == "mix"
    assert layout[0].details["target"]["storage_offset"] == layout[0].details["reference"][
        "storage_offset"] + 1


def test_an_extra_op_on_one_side_shifts_nothing(ref_events):
    tgt = [dict(e) for e in ref_events]
    extra = dict(tgt[3], op="aten.alias.default", arg="return.0")
    assert compare_events(ref_events, tgt[:3] + [extra] + tgt[3:], 0.0) == []


def test_paused_records_nothing():
    audit = ViewAudit(lambda: "m")
    x = torch.zeros(4)
    with audit:
        x[1:].add_(1.0)
        with audit.paused():
            x[2:].add_(1.0)
    ops = [e["op"] for e in audit.events()]
    assert ops == ["aten.slice.Tensor", "aten.add_.Tensor"]


class _Garbage(TorchDispatchMode):
    """An allocator whose uninitialised memory holds ``value`` everywhere."""

    def __init__(self, value: int) -> None:
        super().__init__()
        self.value = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("empty", "new_empty"):
            out.fill_(self.value)
        return out


def _fill_a_buffer_a_view_at_a_time(x: torch.Tensor) -> torch.Tensor:
    buf = x.new_empty(8, dtype=torch.int64)  # (RT-DETR's int64 buffers)
    buf[:4].copy_(torch.zeros(4, dtype=torch.int64))
    buf[4:].copy_(torch.arange(4))
    return buf


def test_a_write_into_uninitialised_memory_that_held_its_values_is_no_dropped_write():
    """A base from an uninitialised allocation holds, before each write, whatever the memory
    held: where the target's already held the values written (zeros on a fresh page) its base
    "did not change". Found as a false alarm on RT-DETR (1 vs 2 threads, an AVX2 host). Such
    writes are marked ``fresh`` and not judged as dropped when the bases differed before;
    without the mark the same events are a finding (the check is needed), and a dropped write
    into initialised memory is still named (test_dropped_view_writes_are_named)."""
    def run(garbage: int) -> list:
        with _Garbage(garbage), ViewAudit(lambda: "m") as audit:
            _fill_a_buffer_a_view_at_a_time(torch.ones(3))
        return audit.events()

    ref, tgt = run(7), run(0)  # the target's garbage: the zeros the first write writes
    writes = [e for e in tgt if e["op"] == "aten.copy_.default"]
    assert len(writes) == 2 and all(e.get("fresh") for e in writes), writes
    assert [e["base_changed"] for e in writes] == [False, True]
    assert not [f for f in compare_events(ref, tgt, 0.0) if f.kind == "inplace.base_not_updated"]
    unmarked = [[{k: v for k, v in e.items() if k != "fresh"} for e in side] for side in (ref, tgt)]
    lost = [f for f in compare_events(*unmarked, 0.0) if f.kind == "inplace.base_not_updated"]
    assert [f.details["op"] for f in lost] == ["aten.copy_.default"]

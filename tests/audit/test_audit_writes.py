"""Writes the reference made through a view and the target into a copy (audit/writes.py), and
the view audit on a backend without inspectable storage (lazy)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from driftcheck.audit.views import ViewAudit, compare_events, not_observed
from driftcheck.targets.simulate import drop_view_writes, views_become_copies


class Halve(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.view(-1, y.shape[-1])[..., :4].mul_(2.0)   # the write lands in y through two views
        return y


class Shift(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.narrow(-1, 2, 3).add_(1.0)
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.halve, self.shift = Halve(), Shift()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.shift(self.halve(torch.relu(self.fc(x)))))


def _record(fault=None):
    torch.manual_seed(0)
    model = Net()
    names = {m: n for n, m in model.named_modules()}
    stack = [""]
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, _: stack.append(names[mod]))
        m.register_forward_hook(lambda *_: None if stack.pop() is None else None)
    audit = ViewAudit(lambda: stack[-1])
    with fault() if fault else contextlib.nullcontext():
        with audit:
            model(torch.randn(3, 2, 8)).square().mean().backward()
    return audit.events()


def test_clean_runs_give_no_finding():
    assert compare_events(_record(), _record(), 0.0) == []


def test_a_write_into_a_copy_of_another_layout_is_named():
    found = compare_events(_record(), _record(views_become_copies), 0.0)
    writes = {(f.module, f.details["op"]) for f in found if f.kind == "view.write_not_through_view"}
    # Halve's slice of a view became a contiguous copy: another layout, so only this check sees it
    assert ("halve", "aten.mul_.Tensor") in writes
    f = next(f for f in found if (f.module, f.details["op"]) == ("halve", "aten.mul_.Tensor"))
    assert f.details["reference"]["strides"] != f.details["target"]["strides"]
    assert "the reference wrote through a view" in f.message and f.step == 0
    # Shift's narrow copy keeps the view's layout (offset aside): named too, by one check or other
    shift = {f.kind for f in found if f.module == "shift" and f.details["op"] == "aten.add_.Tensor"}
    assert shift and shift <= {"view.alias_lost", "view.write_not_through_view"}


def test_a_lost_write_into_a_true_view_stays_base_not_updated():
    found = compare_events(_record(), _record(drop_view_writes), 0.0)
    kinds = {f.kind for f in found}
    assert "inplace.base_not_updated" in kinds and "view.write_not_through_view" not in kinds


def test_not_observed_names_the_device_as_a_warning():
    assert not_observed([]) is None
    f = not_observed(["lazy"])
    assert f.kind == "view.audit_unobservable" and f.severity == "warning"
    assert "driftcheck probe --device lazy" in f.message


def test_the_record_on_lazy_skips_the_audit_with_one_warning(tmp_path):
    from driftcheck.record.tracer import Tracer, view_audit
    from driftcheck.store.writer import TraceWriter

    with TraceWriter(str(tmp_path / "t")) as writer:
        tracer = Tracer(nn.Linear(2, 2), writer, view_audit=True)
        assert view_audit(tracer, torch.device("lazy")) is None
        assert [f["kind"] for f in tracer.findings] == ["view.audit_unobservable"]
        assert view_audit(tracer, torch.device("cpu")) is not None


@pytest.mark.filterwarnings("ignore")
def test_ops_on_lazy_tensors_are_not_recorded():
    from driftcheck.targets.devices import init_backend

    init_backend("lazy")
    audit = ViewAudit(lambda: "m")
    x = torch.arange(12.0).reshape(3, 4).to("lazy")  # made outside: functionalized
    with audit:
        x[1:].mul_(2.0)
        x.t()
    assert audit.events() == []
    assert audit.unobservable().details["devices"] == ["lazy"]
    assert x.cpu()[1, 0].item() == 8.0  # the write itself went through


def test_trace_with_view_audit_records_the_events(tmp_path):
    import json

    import driftcheck

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with driftcheck.trace(model, out=str(tmp_path / "t"), optimizer=opt, view_audit=True) as t:
        model(torch.randn(3, 2, 8)).square().mean().backward()
        opt.step()
        t.step()
    events = json.loads((tmp_path / "t" / "manifest.json").read_text())["view_events"]
    assert any(e["module"] == "halve" and e["op"] == "aten.mul_.Tensor" and e["aliased"]
               for e in events)

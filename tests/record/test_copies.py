"""record/copies.py: full mode copies the same data once and names that copy from every entry
that captured it, and never where the data changed in between (an in-place op, a write through
``.data`` between steps); what each entry reads back is what it captured."""
from __future__ import annotations

import torch
from torch import nn

from driftcheck.compare import compare
from driftcheck.record.tracer import Tracer
from driftcheck.store import TraceReader, TraceWriter


class _Net(nn.Module):
    """Linear -> ReLU(inplace) -> Linear, with weights and activations of >= stats.BIG
    elements (the kept-copy path): the ReLU writes its input, the first Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(512, 512)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _record(out, steps=2, between=None, seed=0, **options):
    """A full-mode record; ``between(model)`` runs after each update; the values every hook
    saw (key -> a copy taken by a hook of this test, not the tracer's)."""
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(300, 256)
    with TraceWriter(out, force=True) as w:
        tracer = Tracer(model, w, optimizer=opt, **options).attach()
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(model)
            tracer.step(None)
        tracer.detach()
        w.close({"steps": steps})
    return TraceReader(out), model


def _shared(r):
    return {e["key"]: e["tensor"]["name"] for e in r.entries
            if e.get("tensor") and e["tensor"]["name"] != e["key"]}


def test_the_same_data_is_stored_once_and_read_back_by_every_entry(tmp_path):
    r, _ = _record(tmp_path / "t")
    shared = _shared(r)
    # the ReLU's input is the first Linear's output (before the ReLU writes it), the second
    # Linear's input the ReLU's output; a gradient reaches the hooks of two modules; the
    # weights at step 1's start are those after step 0's update
    assert shared["0/forward/act/0/input.0"] == "0/forward/a/0/output"
    assert shared["0/forward/b/0/input.0"] == "0/forward/act/0/output"
    assert shared["1/params/a/0/param.weight"] == "0/optimizer/a/0/param.weight"
    assert any(k.startswith("0/backward/") for k in shared), shared
    by_key = {e["key"]: e for e in r.entries}
    for key, name in shared.items():
        assert torch.equal(r.tensor(by_key[key]), r.tensor(by_key[name])), key
        assert by_key[key]["stats"] == by_key[name]["stats"], key
    # the in-place ReLU: its output (the same memory, written) has its own copy, and the
    # Linear's output keeps the values from before the ReLU
    a_out, relu_out = r.tensor(by_key["0/forward/a/0/output"]), r.tensor(by_key["0/forward/act/0/output"])
    assert "0/forward/act/0/output" not in shared and (a_out < 0).any() and torch.equal(relu_out, a_out.clamp(min=0))


def test_a_write_through_data_between_steps_is_recorded(tmp_path):
    """A parameter changed through ``.data`` after the update (no version counter moves): the
    next step's parameter entry is its own copy, with the values changed."""
    def halve(model):
        model.a.weight.data.mul_(0.5)

    r, _ = _record(tmp_path / "t", between=halve)
    shared = _shared(r)
    assert "1/params/a/0/param.weight" not in shared
    assert shared["1/params/b/0/param.weight"] == "0/optimizer/b/0/param.weight"  # untouched
    by_key = {e["key"]: e for e in r.entries}
    after_update = r.tensor(by_key["0/optimizer/a/0/param.weight"])
    assert torch.equal(r.tensor(by_key["1/params/a/0/param.weight"]), after_update * 0.5)


def test_a_shared_record_compares_as_one_that_copies_everything(tmp_path, monkeypatch):
    """The same run recorded with and without the sharing: every entry reads the same tensor,
    and compare finds nothing between them."""
    from driftcheck.record import copies

    r1, _ = _record(tmp_path / "shared")
    monkeypatch.setattr(copies.Copies, "same", lambda self, data: None)
    r2, _ = _record(tmp_path / "copied")
    assert _shared(r1) and not _shared(r2)
    assert [e["key"] for e in r1.entries] == [e["key"] for e in r2.entries]
    for e1, e2 in zip(r1.entries, r2.entries):
        if e1.get("tensor"):
            assert torch.equal(r1.tensor(e1), r2.tensor(e2)), e1["key"]
    result = compare(str(tmp_path / "copied"), str(tmp_path / "shared"))
    assert result.verdict == "pass", result.first_divergence
    assert sum(p.stat().st_size for p in (tmp_path / "shared").iterdir()) < \
        0.9 * sum(p.stat().st_size for p in (tmp_path / "copied").iterdir())


def test_a_module_summarised_in_auto_mode_keeps_its_sample(tmp_path):
    """``--mode auto`` keeps the first Linear whole and summarises the ReLU: the ReLU's input,
    the Linear's output, is a sample there, not the Linear's stored tensor."""
    r, _ = _record(tmp_path / "t", mode="auto", full_modules=["a"])
    by_key = {e["key"]: e for e in r.entries}
    assert by_key["0/forward/a/0/output"].get("tensor") is not None
    relu_in = by_key["0/forward/act/0/input.0"]
    assert relu_in.get("tensor") is None and relu_in.get("sample") is not None


def _one_step(out, model, x, update, optimizer=None):
    """A one-step full-mode record where ``update(model)`` changes the parameters; the live
    weight of the first Linear after it."""
    with TraceWriter(out, force=True) as w:
        tracer = Tracer(model, w, optimizer=optimizer).attach()
        model(x).square().mean().backward()
        update(model)
        live = model[0].weight.detach().clone()
        tracer.step(None)
        tracer.detach()
        w.close({"steps": 1})
    r = TraceReader(out)
    return r, {e["key"]: e for e in r.entries}, live


def test_writes_that_move_no_version_counter_are_recorded(tmp_path):
    """A fused optimizer and a hand-written update through ``.data`` change a weight within the
    step without moving its version counter: the entry after the update is the updated weight,
    not the copy taken at the step's start (the bytes' checksum decides, not the counter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def fused(m):
        v = m[0].weight._version
        opt.step()
        opt.zero_grad()
        assert m[0].weight._version == v  # (what makes the case: the counter did not move)

    r, by, live = _one_step(tmp_path / "fused", model, torch.randn(8, 256), fused, opt)
    assert torch.equal(r.tensor(by["0/optimizer/0/0/param.weight"]), live)
    assert by["0/optimizer/0/0/param.weight"]["tensor"]["name"] == "0/optimizer/0/0/param.weight"

    def by_data(m):
        for p in m.parameters():
            p.data.add_(p.grad, alpha=-10.0)
            p.grad = None

    r, by, live = _one_step(tmp_path / "data", nn.Sequential(nn.Linear(256, 256)), torch.randn(8, 256), by_data)
    assert torch.equal(r.tensor(by["0/optimizer/0/0/param.weight"]), live)
    assert not torch.equal(live, r.tensor(by["0/params/0/0/param.weight"]))


class _Neg(nn.Module):
    def forward(self, x):
        return torch._neg_view(x)


def test_a_negative_view_is_not_its_base(tmp_path):
    """A negative-bit view has its base's memory, shape, strides, dtype and version counter,
    and the opposite values: its entry is its own copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), _Neg())
    with TraceWriter(tmp_path / "t") as w:
        tracer = Tracer(model, w).attach()
        y = model(torch.randn(300, 256))
        assert y.is_neg()
        live = y.detach().clone()
        tracer.step(None)
        tracer.detach()
        w.close({"steps": 1})
    r = TraceReader(tmp_path / "t")
    e = next(e for e in r.entries if e["key"] == "0/forward/1/0/output")
    assert torch.equal(r.tensor(e), live)


def test_a_shared_entry_never_goes_through_the_host_transfer(tmp_path, monkeypatch):
    """The flush's host transfer gets tensors only (a device run mixes host copies with device
    tensors, and the transfer reads each one's dtype and device)."""
    from driftcheck.record import copies, transfer

    seen = []
    real = transfer.to_host

    def to_host(tensors):
        seen.extend(type(t) for t in tensors)
        return real(tensors)

    monkeypatch.setattr(transfer, "to_host", to_host)
    r, _ = _record(tmp_path / "t")
    assert _shared(r) and copies.Same not in seen and seen


def test_a_shared_tensor_is_checksummed_once_on_read(tmp_path, monkeypatch):
    """The reader verifies each stored tensor's checksum once, however many entries name it."""
    from driftcheck.store import shard as store_shard

    r, _ = _record(tmp_path / "t")
    shared = _shared(r)
    assert shared
    counted: list[int] = []
    real = store_shard.MappedShard.checksum
    monkeypatch.setattr(store_shard.MappedShard, "checksum",
                        lambda self, begin, end: counted.append(begin) or real(self, begin, end))
    r = TraceReader(tmp_path / "t")
    for e in r.entries:
        r.tensor(e)
    stored = {(e["tensor"]["shard"], e["tensor"]["name"]) for e in r.entries if e.get("tensor")}
    assert len(counted) == len(stored) < sum(1 for e in r.entries if e.get("tensor"))

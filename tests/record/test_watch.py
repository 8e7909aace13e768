"""The watch (record/watch.py): what it measures of the ops a module's code runs, and that the
tracer's own work stays out of it and of any torch function mode a user runs the step under."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import driftcheck
from driftcheck.record.watch import LOGIT_SPAN, LogitWatch, _weighted_absmax


def _by_definition(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| over the finite elements within LOGIT_SPAN of their row's max."""
    x = x.detach().double()
    top = torch.where(torch.isfinite(x), x, torch.full_like(x, -math.inf)).amax(dim, keepdim=True)
    keep = torch.isfinite(x) & (x >= top - LOGIT_SPAN)
    return torch.where(keep, x.abs(), torch.zeros(())).amax()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_weighted_absmax_is_its_definition(dtype, dim):
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = (torch.randn(3, 5, 17, generator=g) * (100 * torch.rand((), generator=g))
             - 50 * torch.rand((), generator=g)).to(dtype)
        if trial % 3 == 0:
            x[0, 1, :] = -math.inf  # a fully masked row
        if trial % 5 == 0:
            x[1, 2, 3] = -math.inf  # a masked position
        if trial % 7 == 0:
            x = -x.abs()  # every logit negative
        assert float(_weighted_absmax(x, dim)) == float(_by_definition(x, dim))



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_absmax_on_the_host_kernel_equals_the_torch_ops(dtype):
    """A contiguous host softmax input over its last dim takes one compiled call; the same
    values laid out transposed take the torch ops: the same float32 value, rows holding NaN
    (either sign), +inf, all -inf, causal masks and all-negative logits included."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 40, 40, generator=g, dtype=dtype) * 30
    causal = base.masked_fill(torch.triu(torch.ones(40, 40, dtype=torch.bool), 1), -math.inf)
    nan_row, neg_nan, inf_row = causal.clone(), causal.clone(), causal.clone()
    nan_row[0, 0, 5, 3] = math.nan
    neg_nan[1, 1, 30, 2] = -math.nan
    inf_row[1, 2, 7, 0] = math.inf
    all_nan = torch.full((2, 4), math.nan, dtype=dtype)
    all_nan[1] = torch.tensor([1.0, -50.0, -30.0, 2.0])
    for x in (base, causal, nan_row, neg_nan, inf_row, all_nan, -causal.abs() - 3,
              torch.full((3, 5), -math.inf, dtype=dtype), torch.tensor([[-100.0, -70.0, -50.0]], dtype=dtype),
              torch.tensor([[1.0, 2.0], [100.0, math.nan]], dtype=dtype),  # the NaN row has the max
              torch.tensor([[1.0, 2.0], [100.0, -math.nan]], dtype=dtype),
              torch.tensor([[10.0, -30.0]], dtype=dtype)):  # exactly LOGIT_SPAN below: kept
        other = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # not contiguous: torch ops
        fast, slow = _weighted_absmax(x, -1), _weighted_absmax(other, -1)
        assert fast.dtype == slow.dtype == torch.float32
        assert fast.item() == slow.item(), (fast, slow)
    assert _weighted_absmax(torch.tensor([[1.0, 2.0], [100.0, -math.nan]], dtype=dtype), -1).item() == 2.0
    assert _weighted_absmax(torch.tensor([[10.0, -30.0]], dtype=dtype), -1).item() == 30.0

class _Counter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Softmax(-1))


def _step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_users_torch_function_mode_sees_the_same_ops_traced(tmp_path, mode):
    """The tracer's copies, statistics and samples run with torch functions undispatched: a
    mode the user runs the step under sees the model's ops and the optimizer's, nothing more."""
    x = torch.randn(4, 8)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _Counter() as plain:
        _step(model, opt, x)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with driftcheck.trace(model, str(tmp_path / "t"), mode=mode, optimizer=opt) as t:
        with _Counter() as traced:
            loss = _step(model, opt, x)
            t.step(loss)
    assert traced.names == plain.names


def test_the_watch_still_sees_the_models_softmax_under_the_tracer(tmp_path):
    model = _net()
    with torch.no_grad():
        model[2].weight.mul_(300.0)  # large logits
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with driftcheck.trace(model, str(tmp_path / "t"), optimizer=opt) as t:
        t.step(_step(model, opt, torch.randn(4, 8)))
    entries = driftcheck.store.TraceReader(tmp_path / "t").manifest["entries"]
    out = [e for e in entries if e["module"] == "3" and e["slot"] == "output"]
    assert out and out[0]["meta"]["logit_absmax"] > 10.0


def test_the_watch_sees_each_softmax_once():
    seen = []
    with LogitWatch(seen.append):
        torch.softmax(torch.randn(2, 3), -1)
        torch.randn(2, 3).log_softmax(-1)
    assert len(seen) == 2


def test_the_recomputed_logits_block_is_one_block_kept_across_calls(monkeypatch):
    """The host's block of recomputed attention logits is allocated once and kept (in mapped
    memory: store/buffers.py mapped_empty), a shorter last row block a view of its start: a
    block freed through malloc at each call moved glibc's mmap threshold for the whole process."""
    from driftcheck.record import watch

    made = []
    real = watch.mapped_empty
    monkeypatch.setattr(watch, "_SDPA_BLOCK", 1 << 16)  # blocks of 65 x 1000 logits: a tail of 25
    monkeypatch.setattr(watch, "mapped_empty", lambda *a: made.append(a) or real(*a))
    g = torch.Generator().manual_seed(0)
    blocks: dict = {}
    for layer in range(4):
        q, k = torch.randn(1, 1, 1000, 8, generator=g) * 4, torch.randn(1, 1, 1000, 8, generator=g) * 4
        got = watch._sdpa_logits_absmax(q, k, None, True, None, blocks)
        assert torch.equal(got, watch._sdpa_logits_absmax(q, k, None, True, None, None)), layer
    assert len(made) == 1, made


class _Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64)

    def forward(self, x):  # (batch, heads, tokens, dim): the watch recomputes the logits
        q = self.q(x)
        return torch.nn.functional.scaled_dot_product_attention(q, x, x)


def test_the_view_audit_does_not_see_the_watch_recomputing_logits(tmp_path):
    """The logit watch recomputes attention logits into its own block (``matmul(out=...)``,
    in-place scaling): the tracer's writes, not the model's. Seen by the view audit, they were
    in-place writes whose values differ between thread counts (timm's XCiT failed a clean
    fp32 1-vs-2-thread compare at ``inplace.value_mismatch`` on ``aten.bmm.out``)."""
    from driftcheck.record.runner import record
    from driftcheck.scenario import Scenario
    from driftcheck.store import TraceReader

    torch.manual_seed(0)
    model = _Attend()
    x = torch.randn(2, 4, 300, 64)  # logits of 2 x 4 x 300 x 300: above the watch's host size
    sc = Scenario(model=model, inputs=x, loss=lambda out, _: out.square().mean(),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1, name="attend")
    record(sc, tmp_path / "t", mode="full", view_audit=True, force=True)
    events = TraceReader(tmp_path / "t").manifest.get("view_events") or []
    assert not [e for e in events if ".out" in str(e.get("op", ""))], events

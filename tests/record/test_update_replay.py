"""The optimizer step redone on the host (record/update.py): invisible to the run (no state,
parameter, hook or counter of it changes), the step of the same inputs, and a refusal that
leaves a warning rather than a failed record."""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from driftcheck.record.update import IdealUpdate, ideal_step


class _Capture:
    step = 0

    def __init__(self):
        self.got = {}

    def wants(self, phase):
        return True

    def quiet(self):
        import contextlib
        return contextlib.nullcontext()

    def __call__(self, module, phase, call, slot, t, **kw):
        self.got[(module, slot)] = t


def _model_and_opt(opt_cls=torch.optim.AdamW, dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)
    opt = opt_cls(m.parameters(), **(kw or {"lr": 1e-3}))
    return m, opt


def _owner(m):
    owners = {id(p): tuple(n.rsplit(".", 1)) for n, p in m.named_parameters()}
    return lambda p: owners.get(id(p))


def _train_step(m, opt, x):
    opt.zero_grad()
    m(x).float().pow(2).mean().backward()
    opt.step()


def test_the_replay_changes_nothing_of_the_run():
    x = torch.randn(5, 8).to(torch.bfloat16)
    plain, plain_opt = _model_and_opt()
    traced, opt = _model_and_opt()
    calls = []
    h = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(type(o).__name__))
    cap = _Capture()
    upd = IdealUpdate(opt, cap, _owner(traced), lambda name: True)
    handles = upd.attach()
    try:
        for _ in range(3):
            _train_step(plain, plain_opt, x)
            _train_step(traced, opt, x)
            upd.flush()  # the tracer's step end
    finally:
        h.remove()
        [h.remove() for h in handles]
    assert calls == ["AdamW"] * 6  # the user's global hook saw the real steps only
    for (a, b) in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(plain_opt.state.values(), opt.state.values()):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    # one ideal and one noise scale per parameter, at float32 and bf16
    assert {s for _, s in cap.got} == {"local.param.weight", "local.param.bias",
                                       "local.param_noise.weight", "local.param_noise.bias"}
    assert cap.got[("0", "local.param.weight")].dtype == torch.float32


def test_the_ideal_is_the_step_itself_in_float64():
    m, opt = _model_and_opt(torch.optim.SGD, torch.float64, lr=0.1, momentum=0.9)
    x = torch.randn(5, 8, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        p = m[0].weight
        ideal, moved, at_dtype = ideal_step(opt, opt.param_groups[0], p)
        opt.step()
        assert torch.equal(ideal, p.detach()) and torch.equal(at_dtype, p.detach())
        assert bool((moved >= 0).all())
    # at float32, the inputs' rounding moves the float64 result measurably
    m, opt = _model_and_opt(torch.optim.SGD, torch.float32, lr=0.1, momentum=0.9)
    opt.zero_grad()
    m(x.float()).pow(2).mean().backward()
    _, moved, _ = ideal_step(opt, opt.param_groups[0], m[0].weight)
    assert float(moved.max()) > 0


class _NeedsTheModel(torch.optim.SGD):
    """An optimizer built with more than its parameters (K-FAC keeps the model): a replay of
    its class from the group's hyperparameters cannot build it."""

    def __init__(self, params, model, lr=0.1):
        super().__init__(params, lr=lr)
        self.model = model


def test_an_optimizer_that_refuses_leaves_a_warning():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    opt = _NeedsTheModel(m.parameters(), m)
    cap = _Capture()
    upd = IdealUpdate(opt, cap, _owner(torch.nn.Sequential(m)), lambda name: True)
    handles = upd.attach()
    before = m.weight.detach().clone()
    _train_step(m, opt, torch.randn(5, 8))
    [h.remove() for h in handles]
    assert not torch.equal(before, m.weight)  # the real step ran
    assert not cap.got
    (w,) = upd.findings()
    assert w["kind"] == "update.replay_failed" and w["severity"] == "warning" and "_NeedsTheModel" in w["message"]


def test_ours_runs_after_a_pre_hook_registered_later():
    """A user's gradient clipping as a step pre-hook registered after the tracer's: from the
    next step on, the replay sees the clipped gradient the step consumes."""
    m, opt = _model_and_opt(torch.optim.SGD, torch.float32, lr=0.1)
    cap = _Capture()
    upd = IdealUpdate(opt, cap, _owner(m), lambda name: True)
    handles = upd.attach()
    opt.register_step_pre_hook(lambda o, a, k: [p.grad.mul_(0.5) for p in m.parameters()] and None)
    x = torch.randn(5, 8)
    _train_step(m, opt, x)  # ours moved last after the step
    before = m[0].weight.detach().clone()
    _train_step(m, opt, x)
    upd.flush()
    ideal, real = cap.got[("0", "local.param.weight")], m[0].weight.detach()
    # the ideal is the float64 step rounded once; the real step rounds lr * g, then the sum: at
    # most one float32 ulp apart, where an unclipped gradient would be half the update away
    ulp = torch.finfo(torch.float32).eps * real.abs()
    assert ((ideal - real).abs() <= ulp).all()
    assert (real - before).abs().max() > 1e4 * ulp.max()

"""The optimizer step's own error (numerics/update.py) on real torch.optim steps: a correct
step at bf16 or fp32 is within what rounding explains; a step scaled by 2% at bf16 (0.1% at
fp32), skipped, or with its sign flipped is far outside it. The ideal comes from
record/update.py's host replay, as a record makes it."""
from __future__ import annotations

import pytest
import torch

from driftcheck.numerics.update import spacing, update_error
from driftcheck.record.update import ideal_step

LIMIT = 3.5


def _steps(opt_name: str, dtype: torch.dtype, init: float, fault, steps: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    # init 1.0: all ones (a norm's weight), else normal with that deviation
    w = torch.ones(48, 96) if init == 1.0 else torch.randn(48, 96, generator=g) * init
    p = torch.nn.Parameter(w.to(dtype))
    kw = {"lr": 0.1, "momentum": 0.9} if opt_name == "SGD" else {"lr": 1e-3, "weight_decay": 0.01}
    opt = getattr(torch.optim, opt_name)([p], **kw)
    out = []
    for _ in range(steps):
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(dtype)
        before = p.detach().clone()
        ideal, moved, at_dtype = ideal_step(opt, opt.param_groups[0], p)
        wide = torch.promote_types(dtype, torch.float32)
        host = update_error(at_dtype, ideal.to(wide), before, moved)  # as record/update.py
        opt.step()
        with torch.no_grad():
            p.copy_(fault(before, p.detach()))
        out.append(update_error(p.detach(), ideal.to(wide), before, moved.bfloat16(),
                                coherent_at_dtype=host.get("coherent", 0.0)))
    return out


CASES = [(o, d, i) for o in ("AdamW", "SGD") for d in (torch.bfloat16, torch.float32) for i in (0.02, 0.0, 1.0)]


@pytest.mark.parametrize("opt_name,dtype,init", CASES)
def test_a_correct_step_is_within_rounding(opt_name, dtype, init):
    for got in _steps(opt_name, dtype, init, lambda b, a: a):
        assert got["ratio"] < LIMIT / 1.5, got


@pytest.mark.parametrize("opt_name,dtype,init", [c for c in CASES if c[1:] != (torch.bfloat16, 1.0)])
def test_a_scaled_update_is_found(opt_name, dtype, init):
    """(Not a bf16 weight at 1.0: an update of 0.001 is below half its spacing, 0.004; the
    stored parameter keeps none of it, right or wrong.)"""
    size = 0.02 if dtype == torch.bfloat16 else 0.001
    for got in _steps(opt_name, dtype, init, lambda b, a: b + (a - b) * (1 + size)):
        assert got["ratio"] > LIMIT, got
        assert got["coherent"] == pytest.approx(size, rel=0.35)


@pytest.mark.parametrize("fault", [lambda b, a: b, lambda b, a: b - (a - b)], ids=["skipped", "sign"])
def test_a_skipped_or_reversed_update_is_far_outside(fault):
    for got in _steps("AdamW", torch.bfloat16, 0.02, fault):
        assert got["incoherent"] > 10 * LIMIT, got


def test_the_inputs_rounding_covers_a_cancelling_momentum():
    """SGD with momentum from zero weights: where the buffer and the gradient cancel, the
    update's own rounding is far below the terms'; ``moved`` carries the terms' scale."""
    got = _steps("SGD", torch.bfloat16, 0.0, lambda b, a: a, steps=4)
    assert max(x["ratio"] for x in got) < LIMIT / 1.5


def test_spacing_is_one_step_of_the_dtype():
    x = torch.tensor([1.0, 1.5, -3.0, 1e-3], dtype=torch.float64)
    for dtype, bits in ((torch.bfloat16, 7), (torch.float32, 23)):
        want = torch.tensor([2.0 ** -bits, 2.0 ** -bits, 2.0 ** (1 - bits), 2.0 ** (-10 - bits)], dtype=torch.float64)
        assert torch.equal(spacing(x, dtype), want)
        # the next value of the dtype is one spacing away
        assert torch.equal((x + want).to(dtype).double() - x.to(dtype).double(), want)

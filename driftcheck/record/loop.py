"""The training loop of a record, traced or not (the same code: tracing must not change the
numbers): each step's batch cast and placed, the forward and loss under autocast and the
dropout control, the backward, the optimizer step; the user's exceptions as one line.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.nested import substitute
from driftcheck.numerics import dtypes
from driftcheck.record.rng import DropoutControl
from driftcheck.record.tracer import Tracer
from driftcheck.scenario import Scenario, call_model
from driftcheck.targets import deferred


def cast_batch(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move tensors to ``device``; floating tensors are cast to ``dtype`` (ints/bools kept)."""
    return substitute(obj, "", lambda _, t: t.to(device=device, dtype=dtype)
                      if t.is_floating_point() else t.to(device=device))



def train(model: nn.Module, batches: list[Any], scenario: Scenario,
          optimizer: torch.optim.Optimizer | None, *, device: torch.device, dtype: torch.dtype,
          dropout: DropoutControl, autocast: str | None = None, tracer: Tracer | None = None,
          fp8_handle: Any = None, on_step: Callable[[int, int], None] | None = None,
          model_id: str | None = None, first_step: int = 0,
          step_hook: Callable[[int], Any] | None = None) -> list[dict[str, Any]]:
    """The training loop of a record, traced or not (the same code: tracing must not change
    the numbers). Returns per step the loss and output (detached) for tests. ``first_step``:
    the number of the first step (a record started from a long run's replay point)."""
    results = []
    name = model_id or scenario.name
    for step, raw in enumerate(batches, start=first_step):
        dropout.set_step(step)
        if step_hook is not None:
            step_hook(step)  # a fault scheduled to begin at some step (tests, bench/long_runs.py)
        batch = cast_batch(raw, device, dtype)
        with dropout, autocast_context(device, autocast):
            with user_code(name, "the forward", step, device), \
                    tracer.logit_watch() if tracer is not None else contextlib.nullcontext():
                output = call_model(model, batch)
            with user_code(name, "loss(output, batch)", step, device), \
                    tracer.logit_watch("loss") if tracer is not None else contextlib.nullcontext():
                loss = scenario.loss(output, batch) if scenario.loss else None
        if loss is not None:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise DriftcheckError(f"{name}: loss(output, batch) must return "
                                      f"a scalar tensor, got {type(loss).__name__}")
            if not loss.requires_grad:
                raise DriftcheckError(f"{name}: the loss of step {step} does not depend on any "
                                      "trainable parameter (no grad_fn); check the loss function, "
                                      "or drop the loss for an inference-only record")
            if tracer is not None:
                tracer.record_loss(loss)
            with user_code(name, "the backward", step, device):
                loss.backward()
            if optimizer is not None:
                with user_code(name, "the optimizer step", step, device):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        if tracer is not None:
            tracer.step()  # on a deferred device (lazy, xla) it marks the step, after its captures
        elif deferred.is_deferred(device):
            deferred.mark_step(device)  # the step boundary, as a traced run has it
        if fp8_handle is not None and tracer is not None:
            tracer.fp8_stats += [dict(s, step=step) for s in fp8_handle.stats()]
            fp8_handle.reset()
        results.append({"loss": None if loss is None else loss.detach().clone(),
                        "output": output})
        if on_step is not None:
            on_step(step + 1 - first_step, len(batches))
    return results


# Errors a backend raises for its own defect, not the model's: (device type, what the error
# says) -> what it is (docs/devices.md reduces each to a few lines of torch).
BACKEND_DEFECTS = {
    ("lazy", "is not a lazy tensor"): "a defect of the lazy backend, not of the model: an op's "
    "outputs left the lazy device (torch.unbind's do; x.unbind(0)[0] fails where x[0] works, "
    "docs/devices.md)",
}


@contextlib.contextmanager
def user_code(name: str, what: str, step: int, device: torch.device | None = None) -> Any:
    """Turn an exception raised by the user's model code into one clear line (exit 2); the
    original stays chained for --debug. Our own errors and Ctrl-C pass through untouched. On
    ``device``, an error that is a known defect of its backend says so."""
    try:
        yield
    except DriftcheckError:
        raise
    except Exception as e:
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        msg = lines[0][:300] if lines else ""
        if msg.endswith("raised:") and len(lines) > 1:  # torch.compile's: the reason is below
            msg = f"{msg} {lines[1][:300]}"
        for (kind, text), defect in BACKEND_DEFECTS.items():
            if device is not None and device.type == kind and text in msg:
                raise DriftcheckError(f"{name}: {what} raised {type(e).__name__} at step {step} on "
                                      f"{kind}: {msg}: {defect}") from e
        raise DriftcheckError(f"{name}: {what} raised {type(e).__name__} at step {step}: {msg} "
                              "(fix the model code; --debug shows the traceback)") from e


def autocast_context(device: torch.device, autocast: str | None):
    if not autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtypes.parse_cli(autocast))

"""Long records: thousands of training steps at a cost close to the untraced step.

Per step, on the device and without a host sync: the loss, the global gradient norm, the norm
of the optimizer's update and of the parameters. Every ``every`` steps (after the update):
the parameters and floating buffers at a fixed, seeded sample of positions (the same positions on every run of the
model: a distance between runs) and each module's forward output rms. The reference also saves
a replay point (model and optimizer state) every ``points_every`` steps, so that the first bad
step can be recorded in full later (``record(..., start=POINT)``, driftcheck/record/runner.py).
Storage: driftcheck/store/long.py. Judged by driftcheck/compare/long.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes
from driftcheck.record.loop import autocast_context, cast_batch, user_code
from driftcheck.record.metadata import run_metadata
from driftcheck.record.points import load_state
from driftcheck.record.rng import DropoutControl
from driftcheck.scenario import Scenario, call_model
from driftcheck.store import format as fmt
from driftcheck.store.long import write_long, write_point
from driftcheck.store.replay import (
    decode_batch,
    encode_batch,
    input_prefix,
    read_replay,
    replay_meta,
    state_key,
    write_replay,
)

SAMPLE_SIZE = 4096  # parameter elements kept per sampled step
SAMPLE_SEED = 0x5EED


def record_long(scenario: Scenario, out: str | os.PathLike, *, steps: int,
                device: torch.device | str = "cpu", dtype: str = "fp32", every: int = 10,
                points_every: int | None = None, replay: str | os.PathLike | None = None, seed: int = 0,
                autocast: str | None = None, perturb: bool = False, force: bool = False,
                model_id: str | None = None, target_hooks: Callable[[nn.Module], Any] | None = None,
                on_step: Callable[[int, int], None] | None = None, simulate: str | None = None) -> Path:
    """Train ``scenario`` for ``steps`` steps and write a long trace into ``out``.

    Args:
        steps: training steps. every: the sampling interval of the parameter sample and the
            module statistics. points_every: replay points (a reference only, i.e. no replay);
            default max(50, steps / 20): at most ~20 points (each is a model + optimizer state).
        replay: a long reference whose initial weights, inputs and seed this run starts from.
        perturb: a control run: every floating parameter moved by one unit in the last place
            of its dtype, in a seeded random direction, before the first step (a correct run
            that differs from the reference by rounding only).
        target_hooks: called with the model before training (fault injection); if what it
            returns has ``set_step``, that is called with each step index (a scheduled fault).
        simulate: train on a simulated faulty backend (targets/simulate.py: ``skip-bn-stats``
            is torch_tpu 0.2.0's BatchNorm that never writes its running statistics).
    """
    out = Path(out)
    if points_every is None:
        points_every = max(50, math.ceil(steps / 20))
    if steps < 1 or every < 1 or points_every < 1:
        raise DriftcheckError(f"--steps, --every and --points-every must be at least 1 "
                              f"(got {steps}, {every}, {points_every})")
    _prepare_out(out, force)
    device, tdtype = torch.device(device), dtypes.parse_cli(dtype)
    model = scenario.model
    if scenario.loss is None or scenario.optimizer is None:
        raise DriftcheckError(f"a long record trains: model {model_id or scenario.name} needs a loss "
                              "and an optimizer")
    torch.manual_seed(seed)
    inputs = _long_inputs(scenario, model, replay, seed, steps, model_id)
    seed = inputs.seed
    model.to(device=device)
    if tdtype != torch.float32:
        model._apply(lambda t: t.to(tdtype) if t.is_floating_point() else t)
    if perturb:
        _one_ulp(model, seed)
    hook = target_hooks(model) if target_hooks is not None else None
    optimizer = scenario.optimizer(model.parameters())
    cols = _Columns(model, steps, every, device)
    loop = _Loop(scenario, model, optimizer, device, tdtype, autocast, model_id or scenario.name,
                 DropoutControl(seed))
    points: list[int] = []
    backend: Any = contextlib.nullcontext()
    if simulate:
        from driftcheck.targets.simulate import backend as simulated

        backend = simulated(simulate)
    with backend:
        for step in range(steps):
            if replay is None and step % points_every == 0:
                write_point(out, step, model, optimizer)
                points.append(step)
            if hook is not None and hasattr(hook, "set_step"):
                hook.set_step(step)
            loop.step(step, inputs.distinct[step % inputs.cycle], cols)
            if on_step is not None:
                on_step(step + 1, steps)
    columns = cols.columns(tdtype)
    if replay is None:
        rtensors: dict[str, torch.Tensor] = dict(inputs.initial)
        descs = [encode_batch(b, input_prefix(i), rtensors) for i, b in enumerate(inputs.distinct)]
        write_replay(out, rtensors, replay_meta(replay_id=inputs.replay_id, seed=seed, steps=steps,
                                                inputs=descs, model=model_id, cycle=inputs.cycle))
    run = run_metadata(model=model, device=device, mode="long", steps=steps,
                       dtype=dtypes.name_of(tdtype), dtype_obj=tdtype, seed=seed, autocast=autocast,
                       model_id=loop.name, scenario=scenario.name, replay_id=inputs.replay_id,
                       replay_of=str(replay) if replay else None, every=every,
                       points_every=points_every if replay is None else None, perturbed=perturb,
                       modules=cols.names, sample_size=int(columns["param_sample"].shape[1]))
    write_long(out, run, columns, points)
    (out / fmt.INCOMPLETE).unlink(missing_ok=True)
    return out


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it or "
                                  "choose another directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / fmt.INCOMPLETE).write_text("long record in progress or interrupted\n")


class _LongInputs(NamedTuple):
    distinct: list[Any]  # the distinct batches, cycled through
    cycle: int
    replay_id: str
    seed: int
    initial: dict[str, torch.Tensor]  # a reference's initial state (replay keys); {} replayed


def _long_inputs(scenario: Scenario, model: nn.Module, replay: str | os.PathLike | None,
                 seed: int, steps: int, model_id: str | None) -> _LongInputs:
    """The batches a long record cycles through: the scenario's, or a long reference's (its
    initial state then loaded into ``model``)."""
    if replay is not None:
        tensors, meta = read_replay(replay)
        if not meta.get("cycle"):
            raise DriftcheckError(f"--replay {replay} is not a long reference (record it with "
                                  "driftcheck record --long)")
        load_state(model, tensors, replay)
        distinct = [decode_batch(d, tensors) for d in meta.get("inputs", [])]
        seed = int(meta.get("seed", seed))
        if int(meta.get("steps", 0)) < steps:
            raise DriftcheckError(f"--replay {replay} holds {meta.get('steps')} step(s); --steps "
                                  f"{steps} asks for more")
        torch.manual_seed(seed)
        return _LongInputs(distinct, int(meta["cycle"]), str(meta.get("replay_id")), seed, {})
    distinct = list(scenario.inputs) if isinstance(scenario.inputs, list) else [scenario.inputs]
    if not distinct:
        raise DriftcheckError(f"model {model_id or scenario.name} has no inputs")
    initial = {state_key("param" if isinstance(t, nn.Parameter) else "buffer", k): t.detach().clone()
               for k, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    return _LongInputs(distinct, len(distinct), uuid.uuid4().hex, seed, initial)


class _Columns:
    """A long record's per-step columns, kept on the device (no host sync): the loss, the
    gradient, update and parameter norms; at sampled steps the parameter and buffer samples
    and each module's output rms."""

    def __init__(self, model: nn.Module, steps: int, every: int, device: torch.device) -> None:
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.positions = _sample_positions(self.params, SAMPLE_SIZE)
        # floating buffers apart (BatchNorm running statistics a backend may never write): among
        # the parameters their few positions would drown
        self.buffers = [b for b in model.buffers() if b.is_floating_point() and b.numel()]
        self.buffer_positions = _sample_positions(self.buffers, SAMPLE_SIZE) if self.buffers else []
        self.names = [n for n, _ in model.named_modules()]
        self.acc = _acc_dtype(device)
        self.cols = torch.zeros(steps, len(("loss", "grad_norm", "update_norm", "param_norm")),
                                dtype=self.acc, device=device)
        self.sample_steps = [s for s in range(steps) if s % every == 0 or s == steps - 1]
        self.samples: list[torch.Tensor] = []
        self.module_rms: list[torch.Tensor] = []
        self.buffer_samples: list[torch.Tensor] = []

    def after(self, step: int, loss: torch.Tensor, grads: list[torch.Tensor],
              before: list[torch.Tensor], rms: dict[str, torch.Tensor] | None) -> None:
        """Step ``step`` done (``before``: the parameters before its update; ``rms``: the
        module outputs' rms at a sampled step, else None)."""
        acc, params = self.acc, self.params
        with torch.no_grad():
            self.cols[step, 0] = loss.detach().to(acc)
            self.cols[step, 1] = _norm(grads, acc)
            self.cols[step, 2] = _norm(torch._foreach_sub([p.detach() for p in params], before), acc)
            self.cols[step, 3] = _norm([p.detach() for p in params], acc)
            if rms is not None:
                self.samples.append(torch.cat([p.detach().reshape(-1)[i].to(acc)
                                               for p, i in zip(params, self.positions)]))
                if self.buffers:
                    self.buffer_samples.append(torch.cat([b.reshape(-1)[i].to(acc) for b, i
                                                          in zip(self.buffers, self.buffer_positions)]))
                self.module_rms.append(torch.stack([
                    rms.get(n, torch.tensor(float("nan"), device=self.device)).to(acc)
                    for n in self.names]))

    def columns(self, tdtype: torch.dtype) -> dict[str, torch.Tensor]:
        cols = self.cols
        columns = {"loss": cols[:, 0], "grad_norm": cols[:, 1], "update_norm": cols[:, 2],
                   "param_norm": cols[:, 3],
                   "sample_steps": torch.tensor(self.sample_steps, dtype=torch.float64),
                   "param_sample": torch.stack(self.samples).to(
                       torch.float64 if tdtype == torch.float64 else torch.float32),
                   "module_rms": torch.stack(self.module_rms)}
        if self.buffer_samples:
            columns["buffer_sample"] = torch.stack(self.buffer_samples)
        return columns


class _Loop(NamedTuple):
    """One training step of a long record (the record's loop code: record/loop.py's pieces)."""

    scenario: Scenario
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    tdtype: torch.dtype
    autocast: str | None
    name: str
    dropout: DropoutControl

    def step(self, step: int, raw: Any, cols: _Columns) -> None:
        sampled = step in cols.sample_steps
        rms: dict[str, torch.Tensor] = {}
        handles = [m.register_forward_hook(_rms_hook(n, rms, cols.acc))
                   for n, m in self.model.named_modules()] if sampled else []
        self.dropout.set_step(step)
        batch = cast_batch(raw, self.device, self.tdtype)
        assert self.scenario.loss is not None
        try:
            with self.dropout, autocast_context(self.device, self.autocast):
                with user_code(self.name, "the forward", step):
                    output = call_model(self.model, batch)
                with user_code(self.name, "loss(output, batch)", step):
                    loss = self.scenario.loss(output, batch)
        finally:
            for h in handles:
                h.remove()
        with user_code(self.name, "the backward", step):
            loss.backward()
        grads = [p.grad for p in cols.params if p.grad is not None]
        before = [p.detach().clone() for p in cols.params]
        with user_code(self.name, "the optimizer step", step):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        cols.after(step, loss, grads, before, rms if sampled else None)


def _acc_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (CPU, CUDA); float32 elsewhere (MPS has no float64, a
    TPU emulates it)."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _norm(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], acc: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=acc)
    return torch.linalg.vector_norm(torch.stack([n.to(acc) for n in torch._foreach_norm(tensors)]))


def _rms_hook(name: str, into: dict[str, torch.Tensor], acc: torch.dtype) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        from driftcheck.nested import flatten

        for _, t in flatten(output, "output"):
            if t.is_floating_point() and t.numel():
                into.setdefault(name, t.detach().to(acc).pow(2).mean().sqrt())
                return
    return hook


def _sample_positions(params: Sequence[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Fixed positions in each parameter (by shape and a constant seed: the same on every run
    of the model), in proportion to its size, at least one each."""
    total = sum(p.numel() for p in params) or 1
    g = torch.Generator().manual_seed(SAMPLE_SEED)
    out = []
    for p in params:
        k = min(p.numel(), max(1, math.ceil(size * p.numel() / total)))
        out.append(torch.randint(0, p.numel(), (k,), generator=g).to(p.device))
    return out


def _one_ulp(model: nn.Module, seed: int) -> None:
    """Every floating parameter one ulp up or down (seeded direction): a control run."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                up = torch.rand(p.shape, generator=g) < 0.5
                target = torch.where(up, torch.full(p.shape, math.inf), torch.full(p.shape, -math.inf))
                p.copy_(torch.nextafter(p, target.to(device=p.device, dtype=p.dtype)))


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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from driftcheck.store.replay import decode_batch, encode_batch, input_prefix, read_replay, replay_meta, write_replay

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
        simulate: train on a simulated faulty backend (driftcheck/simulate.py: ``skip-bn-stats``
            is torch_tpu 0.2.0's BatchNorm that never writes its running statistics).
    """
    out = Path(out)
    if points_every is None:
        points_every = max(50, math.ceil(steps / 20))
    if steps < 1 or every < 1 or points_every < 1:
        raise DriftcheckError(f"--steps, --every and --points-every must be at least 1 "
                              f"(got {steps}, {every}, {points_every})")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise DriftcheckError(f"--out {out} already exists; pass --force to overwrite it or "
                                  "choose another directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / fmt.INCOMPLETE).write_text("long record in progress or interrupted\n")
    device, tdtype = torch.device(device), dtypes.parse_cli(dtype)
    model = scenario.model
    if scenario.loss is None or scenario.optimizer is None:
        raise DriftcheckError(f"a long record trains: model {model_id or scenario.name} needs a loss "
                              "and an optimizer")
    torch.manual_seed(seed)
    if replay is not None:
        tensors, meta = read_replay(replay)
        if not meta.get("cycle"):
            raise DriftcheckError(f"--replay {replay} is not a long reference (record it with "
                                  "driftcheck record --long)")
        load_state(model, tensors, replay)
        distinct = [decode_batch(d, tensors) for d in meta.get("inputs", [])]
        cycle, replay_id = int(meta["cycle"]), str(meta.get("replay_id"))
        seed = int(meta.get("seed", seed))
        if int(meta.get("steps", 0)) < steps:
            raise DriftcheckError(f"--replay {replay} holds {meta.get('steps')} step(s); --steps "
                                  f"{steps} asks for more")
        torch.manual_seed(seed)
    else:
        distinct = list(scenario.inputs) if isinstance(scenario.inputs, list) else [scenario.inputs]
        if not distinct:
            raise DriftcheckError(f"model {model_id or scenario.name} has no inputs")
        cycle, replay_id = len(distinct), uuid.uuid4().hex
        initial = {f"{'param' if isinstance(t, nn.Parameter) else 'buffer'}/{k}": t.detach().clone()
                   for k, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    model.to(device=device)
    if tdtype != torch.float32:
        model._apply(lambda t: t.to(tdtype) if t.is_floating_point() else t)
    if perturb:
        _one_ulp(model, seed)
    hook = target_hooks(model) if target_hooks is not None else None
    optimizer = scenario.optimizer(model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    positions = _sample_positions(params, SAMPLE_SIZE)
    # floating buffers apart (BatchNorm running statistics a backend may never write): among the
    # parameters their few positions would drown
    buffers = [b for b in model.buffers() if b.is_floating_point() and b.numel()]
    buffer_positions = _sample_positions(buffers, SAMPLE_SIZE) if buffers else []
    names = [n for n, _ in model.named_modules()]
    dropout = DropoutControl(seed)
    acc = _acc_dtype(device)
    cols = torch.zeros(steps, len(("loss", "grad_norm", "update_norm", "param_norm")),
                       dtype=acc, device=device)
    sample_steps = [s for s in range(steps) if s % every == 0 or s == steps - 1]
    samples, module_rms, buffer_samples = [], [], []
    points: list[int] = []
    name = model_id or scenario.name
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
            sampled = step in sample_steps
            rms: dict[str, torch.Tensor] = {}
            handles = [m.register_forward_hook(_rms_hook(n, rms, acc)) for n, m in model.named_modules()] \
                if sampled else []
            dropout.set_step(step)
            batch = cast_batch(distinct[step % cycle], device, tdtype)
            try:
                with dropout, autocast_context(device, autocast):
                    with user_code(name, "the forward", step):
                        output = call_model(model, batch)
                    with user_code(name, "loss(output, batch)", step):
                        loss = scenario.loss(output, batch)
            finally:
                for h in handles:
                    h.remove()
            with user_code(name, "the backward", step):
                loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            before = [p.detach().clone() for p in params]
            with user_code(name, "the optimizer step", step):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                cols[step, 0] = loss.detach().to(acc)
                cols[step, 1] = _norm(grads, acc)
                cols[step, 2] = _norm(torch._foreach_sub([p.detach() for p in params], before), acc)
                cols[step, 3] = _norm([p.detach() for p in params], acc)
                if sampled:
                    samples.append(torch.cat([p.detach().reshape(-1)[i].to(acc) for p, i in zip(params, positions)]))
                    if buffers:
                        buffer_samples.append(torch.cat([b.reshape(-1)[i].to(acc)
                                                         for b, i in zip(buffers, buffer_positions)]))
                    module_rms.append(torch.stack([rms.get(n, torch.tensor(float("nan"), device=device))
                                                   .to(acc) for n in names]))
            if on_step is not None:
                on_step(step + 1, steps)
    columns = {"loss": cols[:, 0], "grad_norm": cols[:, 1], "update_norm": cols[:, 2],
               "param_norm": cols[:, 3], "sample_steps": torch.tensor(sample_steps, dtype=torch.float64),
               "param_sample": torch.stack(samples).to(torch.float64 if tdtype == torch.float64 else torch.float32),
               "module_rms": torch.stack(module_rms)}
    if buffer_samples:
        columns["buffer_sample"] = torch.stack(buffer_samples)
    if replay is None:
        rtensors: dict[str, torch.Tensor] = dict(initial)
        descs = [encode_batch(b, input_prefix(i), rtensors) for i, b in enumerate(distinct)]
        write_replay(out, rtensors, replay_meta(replay_id=replay_id, seed=seed, steps=steps, inputs=descs,
                                                model=model_id, cycle=cycle))
    run = run_metadata(model=model, device=device, mode="long", steps=steps,
                       dtype=dtypes.name_of(tdtype), dtype_obj=tdtype, seed=seed, autocast=autocast,
                       model_id=name, scenario=scenario.name, replay_id=replay_id,
                       replay_of=str(replay) if replay else None, every=every,
                       points_every=points_every if replay is None else None, perturbed=perturb,
                       modules=names, sample_size=int(columns["param_sample"].shape[1]))
    write_long(out, run, columns, points)
    (out / fmt.INCOMPLETE).unlink(missing_ok=True)
    return out


def _acc_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (CPU, CUDA); float32 elsewhere (MPS has no float64, a
    TPU emulates it)."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _norm(tensors: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
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


def _sample_positions(params: list[torch.Tensor], size: int) -> list[torch.Tensor]:
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


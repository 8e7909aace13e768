"""record(): run a Scenario for N training steps under the tracer, on one device and dtype.

The reference writes ``replay.safetensors`` (initial parameters and buffers, every step's inputs,
the seed of the CPU-generated dropout masks); a target started with ``replay=REF_DIR`` loads
exactly those, casts them to its dtype and moves them to its device.

With ``parallel="ddp"|"fsdp"|"tp"`` (under torchrun) the same function records this rank into
``OUT/rank-<r>`` (driftcheck/record/ranks.py says what each rank sees).
"""
from __future__ import annotations

import contextlib
import difflib
import fnmatch
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes
from driftcheck.record import compilation, ranks, taps, tensor_parallel
from driftcheck.record.config import RecordConfig
from driftcheck.record.inputs import Inputs, batch_parts_of, new_inputs, replayed_inputs
from driftcheck.record.loop import train
from driftcheck.record.metadata import run_metadata
from driftcheck.record.parts import Parts
from driftcheck.record.points import load_point_optimizer
from driftcheck.record.rng import DropoutControl
from driftcheck.record.tracer import Tracer, view_audit
from driftcheck.scenario import Scenario
from driftcheck.store.layout import rank_dir, rank_dirs
from driftcheck.store.writer import TraceWriter
from driftcheck.targets import precision


class Ranks(NamedTuple):
    """This process's place in a torchrun group (all None in a single process)."""

    rank: int | None = None
    world: int | None = None
    backend: str | None = None


# -- record ---------------------------------------------------------------------------------------
def record(scenario: Scenario, config: RecordConfig | str | os.PathLike[str], /,
           **options: Any) -> Path:
    """Record ``scenario`` as ``config`` says (record/config.py ``RecordConfig``); returns the
    trace directory's path.

    ``record(scenario, RecordConfig(out, dtype="bf16", replay=ref))``, or the same as keyword
    arguments: ``record(scenario, out, dtype="bf16", replay=ref)``. The scenario runs on CPU in
    float32 as built; the config moves it (device, dtype), replays a reference's initial weights
    and inputs (replay), varies the target (autocast, fp8, emulate, simulate, compile) and
    chooses what is captured. With ``parallel`` (under torchrun) this rank goes into
    ``out/rank-<rank>``, and that directory is returned.
    """
    if not isinstance(config, RecordConfig):
        config = RecordConfig(config, **options)
    elif options:
        raise TypeError("record() takes a RecordConfig or its fields as keywords, not both")
    device = torch.device(config.device)
    tdtype = dtypes.parse_cli(config.dtype)
    _refuse_combinations(config)
    ranks_ = Ranks()
    tp_plan = None
    if config.parallel in ("tp", "fsdp-tp"):  # before the group: a model without a plan is bad input
        tp_plan = tensor_parallel.plan_of(taps.unwrap(scenario.model), scenario.tp_plan, config.model_id)
    if config.parallel == "fsdp-tp" and os.environ.get("WORLD_SIZE", "").isdigit():
        ranks.mesh_shape(int(os.environ["WORLD_SIZE"]), config.tp_size)  # bad input before the group
    if config.parallel:
        config, device, ranks_ = _join_ranks(config, device)
    n_steps = int(config.steps if config.steps is not None else scenario.steps)
    if n_steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {n_steps}")
    user_compiled = scenario.model if taps.compiled(scenario.model) else None
    model = taps.unwrap(scenario.model)  # its paths without torch.compile's "_orig_mod."
    _check_model(model, scenario, config.model_id)
    torch.manual_seed(config.seed)
    if config.replay is not None:
        inputs = replayed_inputs(model, config, n_steps, ranks_.world, ranks_.rank)
    else:
        inputs = new_inputs(model, scenario, config, n_steps, ranks_.rank, ranks_.world)
    first_step = config.start or 0
    _check_selection(model, config.include, config.exclude, config.full_modules, config.mode,
                     config.capture_steps, len(inputs.batches), first_step)
    # the CPU kernels are a process setting: set for this record (its manifest captures them
    # while they hold), as they were afterwards
    previous = precision.apply_settings(mkldnn=config.mkldnn)
    try:
        return _run(scenario, config.replace(seed=inputs.seed), model, user_compiled, inputs,
                    device, tdtype, ranks_, tp_plan)
    finally:
        precision.apply_settings(**previous)


def _refuse_combinations(config: RecordConfig) -> None:
    c = config
    if c.compile and (c.parallel or c.fp8 or c.simulate or c.view_audit or c.emulate):
        raise DriftcheckError("--compile records a plain compiled run: drop --parallel, "
                              "--fp8, --simulate, --emulate and --view-audit (they run the model "
                              "eagerly or under a dispatch mode Dynamo does not trace)")
    if c.dist_backend and not c.parallel:
        raise DriftcheckError("--dist-backend chooses the process group of --parallel; "
                              "add --parallel or drop --dist-backend")
    if c.tp_size is not None and c.parallel != "fsdp-tp":
        raise DriftcheckError("--tp-size sets the tensor-parallel groups of --parallel fsdp-tp; "
                              "add --parallel fsdp-tp or drop --tp-size")
    if c.parallel and (c.fp8 or c.local is not None or c.simulate or c.view_audit or c.emulate):
        raise DriftcheckError("--parallel records plain DDP/FSDP/TP runs: drop --fp8, --local, "
                              "--simulate, --emulate and --view-audit, or record a single process")


def _join_ranks(config: RecordConfig, device: torch.device
                ) -> tuple[RecordConfig, torch.device, Ranks]:
    """Under torchrun: this rank's device, its trace directory and the reference's."""
    rank, world, backend = ranks.init_from_env(device, config.dist_backend)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    replay = config.replay
    # A reference of as many ranks that split the batch alike: this rank's trace. Else (a
    # single trace, another number of ranks, DDP/FSDP against TP) the reference's global batch,
    # of which this rank takes its part, or all of it under TP (inputs.py).
    ours = [p[0] for p in (ranks.batch_part(config.parallel, r, world, config.tp_size)
                           for r in range(world)) if p is not None]
    if replay is not None and len(rank_dirs(replay)) == world and batch_parts_of(replay) == ours:
        src = rank_dir(replay, rank)
        if not src.is_dir():
            raise DriftcheckError(f"--replay {replay} has no {src.name}: its ranks are not "
                                  f"numbered 0 to {world - 1}; re-record the reference")
        replay = src
    return config.replace(out=rank_dir(config.out, rank), replay=replay), device, \
        Ranks(rank, world, backend)


def _check_model(model: nn.Module, scenario: Scenario, model_id: str | None) -> None:
    if not any(True for _ in model.parameters()) and not any(True for _ in model.buffers()):
        if scenario.loss is not None:
            raise DriftcheckError(f"model {model_id or scenario.name} has no parameters: nothing to "
                                  "train; drop the loss for an inference-only record")
    if scenario.loss is not None and not any(p.requires_grad for p in model.parameters()):
        raise DriftcheckError(f"model {model_id or scenario.name} has no trainable parameters (none "
                              "requires grad): unfreeze some, or drop the loss for an "
                              "inference-only record")


class _Model(NamedTuple):
    """The model as the loop trains it: placed, cast, wrapped; its optimizer and extras."""

    trained: nn.Module  # what the loop calls (DDP/FSDP, torch.compile)
    compiled: bool
    optimizer: torch.optim.Optimizer | None
    fp8: Any  # the fp8 handle, or None
    hook: Any  # what target_hooks returned
    capturable: Any  # compilation.prepare_optimizer's


def _prepare(model: nn.Module, scenario: Scenario, config: RecordConfig, user_compiled: Any,
             device: torch.device, tdtype: torch.dtype, tp_plan: dict[str, Any] | None) -> _Model:
    model.to(device=device)
    if tdtype != torch.float32:
        # Floating tensors only: Module.to(dtype) would also cast complex tensors to real,
        # silently dropping their imaginary part; integer/bool/complex state keeps its dtype.
        model._apply(lambda t: t.to(tdtype) if t.is_floating_point() else t)
    fp8_handle = None
    if config.fp8:
        from driftcheck.targets import fp8 as fp8_mod

        fp8_handle = fp8_mod.enable_fp8(model, fp8_mod.Fp8Recipe(config.fp8))
    hook = config.target_hooks(model) if config.target_hooks is not None else None
    trained = ranks.wrap(model, config.parallel, device, tp_plan, config.tp_size) if config.parallel else model
    compile_ = dict(config.compile) if config.compile else None
    if compile_:
        trained = compilation.wrap(trained, compile_)
    elif user_compiled is not None and not config.parallel:
        trained = compilation.inline_hooks(user_compiled)
    compiled = taps.compiled(trained) or taps.compiled(model)
    optimizer = scenario.optimizer(model.parameters()) if scenario.optimizer and scenario.loss else None
    if config.start and optimizer is not None:
        assert config.replay is not None
        load_point_optimizer(optimizer, config.replay, config.start)
    capturable = compilation.prepare_optimizer(optimizer, compile_)
    return _Model(trained, compiled, optimizer, fp8_handle, hook, capturable)


def _tp_coordinate(config: RecordConfig, ranks_: Ranks) -> tuple[int, int] | None:
    """(this rank's coordinate, size) of its tensor-parallel mesh; None without one."""
    rank, world = ranks_.rank or 0, ranks_.world or 1
    if config.parallel == "tp":
        return rank, world
    if config.parallel == "fsdp-tp":
        size = ranks.mesh_shape(world, config.tp_size)[1]
        return rank % size, size
    return None


def _phases(config: RecordConfig, scenario: Scenario, optimizer: Any) -> set[str]:
    """The phases captured: those asked for, less those the scenario has not."""
    phases = set(config.phases or ("forward", "backward", "grads", "optimizer"))
    if scenario.loss is None:
        phases &= {"forward"}
    elif optimizer is None:
        phases -= {"optimizer"}
    return phases


def _run(scenario: Scenario, config: RecordConfig, model: nn.Module, user_compiled: Any,
         inputs: Inputs, device: torch.device, tdtype: torch.dtype, ranks_: Ranks,
         tp_plan: dict[str, Any] | None = None) -> Path:
    """Train the record's steps under the tracer and write the trace."""
    m = _prepare(model, scenario, config, user_compiled, device, tdtype, tp_plan)
    phases = _phases(config, scenario, m.optimizer)
    # a rank's masks: its part of the global batch's (DDP, FSDP2, fsdp-tp), the whole batch's (TP)
    part = ranks.batch_part(config.parallel, ranks_.rank or 0, ranks_.world or 1, config.tp_size)
    dropout = DropoutControl(config.seed, *part) if part is not None else DropoutControl(config.seed)
    local_replay = _open_local(config.local, config.replay, inputs.replay_id, config.fp8, dropout) \
        if config.local is not None else None
    if local_replay is not None and config.compile:
        # a compiled target's modules are replayed through their own compiled code (regional
        # compilation with the target's settings), after each step, outside its graphs
        local_replay.regional = compilation.regional(dict(config.compile))
    with TraceWriter(config.out, force=config.force) as writer:
        if inputs.meta is not None:
            writer.write_replay(inputs.tensors, inputs.meta)
        tracer = Tracer(model, writer, config.capture(phases=phases), optimizer=m.optimizer,
                        local=local_replay, compiled=m.compiled)
        if tp_plan:  # the activations the plan's styles hand over as local shards
            tracer.capture.shards = tensor_parallel.activation_layouts(model)
        if config.parallel == "fsdp-tp":  # its DTensor activations: blocks of its group's batch part
            tracer.capture.batch = part
        if (ranks_.world or 1) > 1 and config.mode != "full":  # each part's share of the logical sample
            tracer.capture.parts = Parts(part, _tp_coordinate(config, ranks_), tracer.capture.seed)
        tracer.step_index = config.start or 0
        tracer.attach()
        account = compilation.Account().start() if m.compiled else None
        contexts = _Contexts(config, tracer, device)
        try:
            # the fault outside the audit, so the audit sees what the faulty backend does
            with contexts.fault, contexts.emulate as emulation, contexts.audit:
                train(m.trained, inputs.batches, scenario, m.optimizer, device=device,
                      dtype=tdtype, dropout=dropout, autocast=config.autocast, tracer=tracer,
                      fp8_handle=m.fp8, on_step=_on_step(config, writer), model_id=config.model_id,
                      first_step=config.start or 0, step_hook=getattr(m.hook, "set_step", None))
            if tracer.audit is not None:
                tracer.events = tracer.audit.events()
                tracer.findings.extend(f.to_dict() for f in [tracer.audit.unobservable()] if f)
        finally:
            tracer.detach()
            if account is not None:
                account.stop()
            if m.fp8 is not None:
                m.fp8.remove()
            if local_replay is not None:
                local_replay.close()
        run = _run_metadata(scenario, config, model, inputs, device, tdtype, ranks_, phases,
                            contexts, emulation)
        if not writer.entries:
            raise DriftcheckError(
                f"the record captured no tensor ({len(inputs.batches)} step(s) ran): --phases, "
                "--include, --exclude and --capture-steps together select nothing; widen them")
        if account is not None:
            counts, found = account.result()
            run["compile"] = dict(config.compile or {"backend": "user", "mode": None, "dynamic": None},
                                  **counts, **({"capturable": m.capturable[0]} if m.capturable else {}))
            tracer.findings.extend(found)
        if tracer.counts is not None:
            run["lazy"] = tracer.counts.metadata()
        extra = tracer.manifest_extra()
        if tracer.fp8_stats:
            extra["fp8"] = tracer.fp8_stats
        if tracer.events:
            extra["view_events"] = tracer.events
        writer.close(run, extra=extra)
    return Path(config.out)


class _Contexts:
    """What the loop runs under besides the tracer: a simulated faulty backend, the TPU
    emulation, the view audit (each a no-op where not asked for)."""

    def __init__(self, config: RecordConfig, tracer: Tracer, device: torch.device) -> None:
        self.audit: Any = contextlib.nullcontext()
        if config.view_audit:
            self.audit = view_audit(tracer, device) or self.audit
        self.fault: Any = contextlib.nullcontext()
        if config.simulate:
            from driftcheck.targets.simulate import backend

            self.fault = backend(config.simulate)
        self.emulate: Any = contextlib.nullcontext()
        if config.emulate:
            from driftcheck.targets.emulate import emulate_tpu

            self.emulate = emulate_tpu(config.emulate)


def _run_metadata(scenario: Scenario, config: RecordConfig, model: nn.Module, inputs: Inputs,
                  device: torch.device, tdtype: torch.dtype, ranks_: Ranks, phases: set[str],
                  contexts: _Contexts, emulation: Any) -> dict[str, Any]:
    c = config
    run = run_metadata(model=model, device=device, mode=c.mode, steps=len(inputs.batches),
                       dtype=str(tdtype).replace("torch.", ""), dtype_obj=tdtype,
                       seed=c.seed, model_id=c.model_id or scenario.name, scenario=scenario.name,
                       replay_id=inputs.replay_id, replay_of=str(c.replay) if c.replay else None,
                       simulated_backend=c.simulate, start_step=c.start or None,
                       env=dict(c.env or {}),
                       autocast=c.autocast, fp8=c.fp8,
                       local_of=str(c.local) if c.local is not None else None,
                       capture={"include": list(c.include), "exclude": list(c.exclude),
                                "phases": sorted(phases), "transfer": c.transfer},
                       **({"rank": ranks_.rank, "world_size": ranks_.world, "parallel": c.parallel,
                           "backend": ranks_.backend} if c.parallel else {}),
                       **({"simulated_changes": contexts.fault.changes} if c.simulate else {}))
    if c.parallel in ("tp", "fsdp-tp"):
        run["tensor_parallel"] = tensor_parallel.described(model)
    if c.emulate:
        run["emulation"] = {"backend": "tpu", "matmul_precision": c.emulate,
                            "ops": dict(sorted(emulation.calls.items()))}
        run.setdefault("precision", {})["emulation"] = {"backend": "tpu", "matmul_precision": c.emulate}
    return run


def _on_step(config: RecordConfig, writer: TraceWriter) -> Callable[[int, int], None] | None:
    """The loop's step callback: what the trace holds so far (``on_written``), then the step."""
    if config.on_written is None:
        return config.on_step
    written, step = config.on_written, config.on_step

    def on_step(done: int, total: int) -> None:
        written(len(writer.entries), writer.tensor_bytes)
        if step is not None:
            step(done, total)
    return on_step


def default_local(replay: str | os.PathLike | None, *, mode: str, parallel: str | None,
                  fp8: str | None, start: int | None) -> str | None:
    """The local replay a record does by default: of the ``--replay`` trace, where it can (a
    full-mode single-process trace of a plain record, and a run the replay supports)."""
    if replay is None or mode != "full" or parallel or fp8 or start:
        return None
    try:
        from driftcheck.store.reader import TraceReader

        run = TraceReader(replay).run
    except (DriftcheckError, OSError):
        return None  # record() says what is wrong with the replay itself
    if run.get("mode") != "full" or run.get("start_step") or run.get("driver"):
        return None
    return str(replay)


def _check_selection(model: nn.Module, include: Iterable[str] | None, exclude: Iterable[str] | None,
                     full_modules: Iterable[str] | None, mode: str,
                     capture_steps: Iterable[int] | None, n_steps: int, first: int = 0) -> None:
    """Options that would select nothing are refused before anything runs: a module glob that
    matches no module (with the nearest module paths), --full-modules without --mode auto, a
    --capture-steps step the run does not have."""
    names = [n for n, _ in model.named_modules()]
    for flag, globs in (("--include", include), ("--exclude", exclude), ("--full-modules", full_modules)):
        for g in globs or ():
            if not any(fnmatch.fnmatchcase(n, g) for n in names):
                near = difflib.get_close_matches(g.strip("*?"), [n for n in names if n], n=3, cutoff=0.3)
                raise DriftcheckError(f"{flag} {g!r} matches no module of this model"
                                      + (f" (nearest: {', '.join(near)})" if near else "")
                                      + "; module paths are named_modules() names, e.g. "
                                      f"{', '.join(repr(n) for n in names[1:4])}")
    if full_modules and mode != "auto":
        raise DriftcheckError(f"--full-modules only takes effect with --mode auto (this record is "
                              f"--mode {mode}); add --mode auto or drop --full-modules")
    outside = sorted(s for s in set(capture_steps or ()) if not first <= s < first + n_steps)
    if outside:
        raise DriftcheckError(f"--capture-steps {','.join(map(str, outside))}: this run has "
                              f"{n_steps} step(s) ({first}-{first + n_steps - 1}); choose steps in "
                              "that range or record more with --steps")


def _open_local(local: str | os.PathLike, replay: str | os.PathLike | None, replay_id: str | None,
                fp8: str | None, dropout: DropoutControl) -> Any:
    from driftcheck.record.local import LocalReplay

    if replay is None:
        raise DriftcheckError(f"--local {local} needs --replay: the local replay feeds each module "
                              "the reference's inputs, so the run must start from the same "
                              "weights and inputs (pass --replay with the same reference)")
    if fp8:
        raise DriftcheckError("--local cannot be combined with --fp8 yet: the replay would advance "
                              "the fp8 scaling history; record the fp8 target without --local")
    lr = LocalReplay(local, dropout)
    if lr.replay_id != replay_id:
        lr.close()
        raise DriftcheckError(f"--local {local} is not the trace replayed by --replay {replay} "
                              "(different replay_id); pass the same reference to both")
    return lr

"""record(): run a Scenario for N training steps under the tracer, on one device and dtype.

The reference writes ``replay.safetensors`` (initial parameters and buffers, every step's inputs,
the seed of the CPU-generated dropout masks); a target started with ``replay=REF_DIR`` loads
exactly those, casts them to its dtype and moves them to its device.

With ``parallel="ddp"|"fsdp"`` (under torchrun) the same function records this rank into
``OUT/rank-<r>`` (driftcheck/record/ranks.py says what each rank sees).
"""
from __future__ import annotations

import contextlib
import difflib
import fnmatch
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.numerics import dtypes
from driftcheck.record import compilation, ranks, taps
from driftcheck.record.loop import train
from driftcheck.record.metadata import run_metadata
from driftcheck.record.points import load_point_optimizer, load_state as _load_replay_state, segment
from driftcheck.record.rng import DropoutControl
from driftcheck.record.tracer import Tracer
from driftcheck.scenario import Scenario
from driftcheck.store.layout import rank_dir
from driftcheck.store.replay import (
    decode_batch,
    encode_batch,
    input_prefix,
    read_replay,
    replay_meta as make_replay_meta,
    state_key,
)
from driftcheck.store.writer import TraceWriter

parse_dtype = dtypes.parse_cli

# -- record ---------------------------------------------------------------------------------------
def record(scenario: Scenario, out: str | os.PathLike, *, device: torch.device | str = "cpu",
           dtype: str = "fp32", steps: int | None = None, seed: int = 0,
           replay: str | os.PathLike | None = None, mode: str = "full", force: bool = False,
           model_id: str | None = None, include: Iterable[str] | None = None,
           exclude: Iterable[str] | None = None, full_modules: Iterable[str] | None = None,
           phases: Iterable[str] | None = None, capture_steps: Iterable[int] | None = None,
           transfer: str = "batched", autocast: str | None = None, fp8: str | None = None,
           emulate: str | None = None,
           local: str | os.PathLike | None = None, view_audit: bool = False,
           simulate: str | None = None, on_step: Callable[[int, int], None] | None = None,
           target_hooks: Callable[[nn.Module], Any] | None = None,
           parallel: str | None = None, start: int | None = None,
           env: dict[str, str] | None = None, compile: dict[str, Any] | None = None) -> Path:
    """Record ``scenario`` into the trace directory ``out``; returns its path.

    Args:
        scenario: what to run (CPU, float32, as built).
        out: the trace directory to create (``force`` to overwrite).
        device: where to run. dtype: "fp32", "bf16", "fp16" or "fp64".
        steps: training steps (default: the scenario's). seed: CPU RNG seed (dropout masks).
        replay: a reference trace whose initial weights and inputs this run starts from.
        mode, include, exclude, full_modules, phases, capture_steps, transfer: see Tracer.
        autocast: "bf16"/"fp16" to run the forward under torch.autocast.
        emulate: a TPU matmul precision level ("default", "high", "highest"): every matmul and
            convolution, forward and backward, computed as torch_tpu does (driftcheck/emulate.py).
        fp8: "e4m3", "e5m2" or "hybrid": Linear matmuls through emulated fp8.
        local: a full-mode reference trace (the one replayed): every leaf module is also rerun
            on that reference's inputs of the same call, and its output (and input gradients,
            from the reference's output gradients) recorded as ``local.*`` entries, so compare
            can tell the error a module adds from the error it inherits (driftcheck/local.py).
        target_hooks: called with the model after it is placed, before recording (fault
            injection in tests and benchmarks); if what it returns has ``set_step``, that is
            called with each step's number (a fault scheduled to begin at some step).
        parallel: "ddp" or "fsdp" under torchrun: this rank into ``out/rank-<rank>``, replaying
            the reference's ``rank-<rank>``; returns that directory.
        start: with ``replay`` a long reference (driftcheck/record/long.py): start at this step
            from its replay point (weights and optimizer state) and run ``steps`` steps from
            there, numbered from ``start`` (``capture_steps`` are those numbers): the first bad
            step of a long run, recorded in full.
        env: the environment variables this side was given (``--env``): recorded as ``run.env``,
            so every later rerun of this side (the drill-down) runs under them.
        compile: ``torch.compile`` settings (record/compilation.py ``settings``): the loop calls
            the compiled model, captured by graph taps (record/taps.py); a scenario whose model
            is compiled already is traced the same way.
    """
    device = torch.device(device)
    tdtype = parse_dtype(dtype)
    if compile and (parallel or local is not None or fp8 or simulate or view_audit or emulate):
        raise DriftcheckError("--compile records a plain compiled run: drop --parallel, --local, "
                              "--fp8, --simulate, --emulate and --view-audit (they run the model "
                              "eagerly or under a dispatch mode Dynamo does not trace)")
    rank = world = backend = None
    if parallel:
        if fp8 or local is not None or simulate or view_audit or emulate:
            raise DriftcheckError("--parallel records plain DDP/FSDP runs: drop --fp8, --local, "
                                  "--simulate, --emulate and --view-audit, or record a single process")
        rank, world, backend = ranks.init_from_env(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        out = rank_dir(out, rank)
        if replay is not None:
            src = rank_dir(replay, rank)
            if not src.is_dir():
                raise DriftcheckError(f"--replay {replay} has no {src.name}: the reference ran with "
                                      f"fewer ranks than this run's {world}; use the same --nproc_per_node")
            replay = src
    n_steps = int(steps if steps is not None else scenario.steps)
    if n_steps < 1:
        raise DriftcheckError(f"--steps must be at least 1, got {n_steps}")
    user_compiled = scenario.model if taps.compiled(scenario.model) else None
    model = taps.unwrap(scenario.model)  # its paths without torch.compile's "_orig_mod."
    if not any(True for _ in model.parameters()) and not any(True for _ in model.buffers()):
        if scenario.loss is not None:
            raise DriftcheckError(f"model {model_id or scenario.name} has no parameters: nothing to "
                                  "train; drop the loss for an inference-only record")
    if scenario.loss is not None and not any(p.requires_grad for p in model.parameters()):
        raise DriftcheckError(f"model {model_id or scenario.name} has no trainable parameters (none "
                              "requires grad): unfreeze some, or drop the loss for an "
                              "inference-only record")
    torch.manual_seed(seed)

    replay_tensors: dict[str, torch.Tensor] = {}
    if replay is not None:
        tensors, meta = read_replay(replay)
        if meta.get("inputs_are") == "calls":
            raise DriftcheckError(f"--replay {replay} was recorded by a training-loop callback "
                                  f"({meta.get('driver') or 'driftcheck.integrations'}): replay it "
                                  "with the same callback's replay=, not driftcheck record")
        if parallel and meta.get("world_size", world) != world:
            raise DriftcheckError(f"--replay {Path(replay).parent} was recorded with "
                                  f"{meta.get('world_size')} ranks, this run has {world}; use the "
                                  "same --nproc_per_node")
        _load_replay_state(model, tensors, replay)
        inputs = meta.get("inputs", [])
        if not isinstance(inputs, list):
            raise DriftcheckError(f"--replay {replay}: the replay file's input list is malformed; "
                                  "re-record the reference")
        all_batches = [decode_batch(d, tensors) for d in inputs]
        if meta.get("cycle") or start:  # a long reference: from its replay point at `start`
            all_batches = segment(model, replay, meta, all_batches, start or 0, steps, n_steps)
        if steps is None:
            n_steps = len(all_batches)  # a replayed target runs the reference's steps
        batches = all_batches[:n_steps]
        if len(batches) < n_steps:
            raise DriftcheckError(f"--replay {replay} holds {len(batches)} step(s) of inputs but "
                                  f"{n_steps} were asked for; use --steps {len(batches)} or "
                                  "re-record the reference with more steps")
        replay_id = meta.get("replay_id")
        if not isinstance(meta.get("seed", seed), int) or isinstance(meta.get("seed"), bool):
            raise DriftcheckError(f"--replay {replay}: the replay file's seed is not an integer; "
                                  "re-record the reference")
        seed = int(meta.get("seed", seed))
        torch.manual_seed(seed)
    else:
        if start:
            raise DriftcheckError("--start needs --replay of a long reference (driftcheck record --long)")
        batches = [scenario.batch(i) for i in range(n_steps)]
        replay_id = uuid.uuid4().hex
        if parallel:
            batches = [ranks.shard_batch(b, rank, world) for b in batches]
            replay_id = ranks.broadcast_str(replay_id if rank == 0 else None)  # before any hook
        descs = [encode_batch(b, input_prefix(i), replay_tensors) for i, b in enumerate(batches)]
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                kind = "param" if isinstance(t, nn.Parameter) else "buffer"
                replay_tensors[state_key(kind, name)] = t.detach()
        replay_meta = make_replay_meta(replay_id=replay_id, seed=seed, steps=n_steps, inputs=descs,
                                       model=model_id)
        if parallel:
            replay_meta.update(rank=rank, world_size=world)

    first_step = start or 0
    _check_selection(model, include, exclude, full_modules, mode, capture_steps, n_steps, first_step)
    model.to(device=device)
    if tdtype != torch.float32:
        # Floating tensors only: Module.to(dtype) would also cast complex tensors to real,
        # silently dropping their imaginary part; integer/bool/complex state keeps its dtype.
        model._apply(lambda t: t.to(tdtype) if t.is_floating_point() else t)
    fp8_handle = None
    if fp8:
        from driftcheck.targets import fp8 as fp8_mod

        fp8_handle = fp8_mod.enable_fp8(model, fp8_mod.Fp8Recipe(fp8))
    hook = target_hooks(model) if target_hooks is not None else None
    trained = ranks.wrap(model, parallel, device) if parallel else model  # what the loop calls
    if compile:
        trained = compilation.wrap(trained, compile)
    elif user_compiled is not None and not parallel:
        trained = compilation.inline_hooks(user_compiled)
    compiled = taps.compiled(trained) or taps.compiled(model)
    optimizer = scenario.optimizer(model.parameters()) if scenario.optimizer and scenario.loss else None
    if start and optimizer is not None:
        load_point_optimizer(optimizer, replay, start)
    capturable = compilation.prepare_optimizer(optimizer, compile)
    sel_phases = set(phases or ("forward", "backward", "grads", "optimizer"))
    if scenario.loss is None:
        sel_phases &= {"forward"}
    elif optimizer is None:
        sel_phases -= {"optimizer"}

    dropout = DropoutControl(seed)
    local_replay = _open_local(local, replay, replay_id, fp8, dropout) if local is not None else None
    with TraceWriter(out, force=force) as writer:
        if replay is None:
            writer.write_replay(replay_tensors, replay_meta)
        tracer = Tracer(model, writer, mode=mode, optimizer=optimizer, include=include,
                        exclude=exclude, full_modules=full_modules, phases=sel_phases,
                        steps=capture_steps, transfer=transfer, seed=seed,
                        view_audit=view_audit, local=local_replay, compiled=compiled)
        tracer.step_index = first_step
        tracer.attach()
        account = compilation.Account().start() if compiled else None
        audit_ctx: Any = contextlib.nullcontext()
        if view_audit:
            from driftcheck.audit.views import ViewAudit

            tracer.audit = audit_ctx = ViewAudit(lambda: tracer.current_module,
                                                 lambda: tracer.step_index)
        fault_ctx: Any = contextlib.nullcontext()
        if simulate:
            from driftcheck.targets.simulate import backend

            fault_ctx = backend(simulate)
        emulate_ctx: Any = contextlib.nullcontext()
        if emulate:
            from driftcheck.targets.emulate import emulate_tpu

            emulate_ctx = emulate_tpu(emulate)
        try:
            # the fault outside the audit, so the audit sees what the faulty backend does
            with fault_ctx, emulate_ctx as emulation, audit_ctx:
                train(trained, batches, scenario, optimizer, device=device, dtype=tdtype,
                      dropout=dropout, autocast=autocast, tracer=tracer, fp8_handle=fp8_handle,
                      on_step=on_step, model_id=model_id, first_step=first_step,
                      step_hook=getattr(hook, "set_step", None))
            if tracer.audit is not None:
                tracer.events = tracer.audit.events()
        finally:
            tracer._active = False
            tracer.detach()
            if account is not None:
                account.stop()
            if fp8_handle is not None:
                fp8_handle.remove()
            if local_replay is not None:
                local_replay.close()
        run = run_metadata(model=model, device=device, mode=mode, steps=n_steps,
                           dtype=str(tdtype).replace("torch.", ""), dtype_obj=tdtype,
                           seed=seed, model_id=model_id or scenario.name, scenario=scenario.name,
                           replay_id=replay_id, replay_of=str(replay) if replay else None,
                           simulated_backend=simulate, start_step=start or None,
                           env=dict(env or {}),
                           autocast=autocast, fp8=fp8,
                           local_of=str(local) if local is not None else None,
                           capture={"include": list(include or []), "exclude": list(exclude or []),
                                    "phases": sorted(sel_phases), "transfer": transfer},
                           **({"rank": rank, "world_size": world, "parallel": parallel,
                               "backend": backend} if parallel else {}),
                           **({"simulated_changes": fault_ctx.changes} if simulate else {}))
        if emulate:
            run["emulation"] = {"backend": "tpu", "matmul_precision": emulate,
                                "ops": dict(sorted(emulation.calls.items()))}
            run.setdefault("precision", {})["emulation"] = {"backend": "tpu", "matmul_precision": emulate}
        if not writer.entries:
            raise DriftcheckError(
                f"the record captured no tensor ({n_steps} step(s) ran): --phases, --include, "
                "--exclude and --capture-steps together select nothing; widen them")
        if account is not None:
            counts, found = account.result()
            run["compile"] = dict(compile or {"backend": "user", "mode": None, "dynamic": None},
                                  **counts, **({"capturable": capturable[0]} if capturable else {}))
            tracer.findings.extend(found)
        extra = tracer.manifest_extra()
        if tracer.fp8_stats:
            extra["fp8"] = tracer.fp8_stats
        if tracer.events:
            extra["view_events"] = tracer.events
        writer.close(run, extra=extra)
    return Path(out)


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

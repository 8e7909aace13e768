"""A traced run driven by somebody else's training loop (a Hugging Face ``Trainer``, a Lightning
``Trainer``): what a callback keeps between the loop's hooks.

The callback calls, in this order:
- ``start(model, optimizer)`` once, before the first step: the reference keeps its initial
  weights, a replaying target loads the reference's;
- per step: ``step_begin()`` before the first micro-batch, ``model_call(args, kwargs)`` for each
  call of the model (the reference keeps the call's inputs, a replaying target gets the
  reference's back, moved to its device), ``add_loss(loss)``, ``step_end()`` after the
  optimizer step;
- ``finish()`` when training ends before the chosen steps did (a no-op otherwise: the trace is
  finished right after the last chosen step, and the loop goes on untraced).

The replay file is ``driftcheck record``'s (driftcheck/store/replay.py) with one difference, said
by ``inputs_are: "calls"`` in its metadata: ``inputs[step]`` is the list of that step's model
calls, each ``{"args": [...], "kwargs": {...}}`` (a step of gradient accumulation has one call
per micro-batch). Dropout masks come from the CPU (driftcheck/record/rng.py), so both sides draw
the same ones. Under torchrun each rank records ``OUT/rank-<r>`` and replays the same rank.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.nested import flatten, substitute
from driftcheck.numerics import dtypes
from driftcheck.record import compilation, ranks
from driftcheck.record.metadata import run_metadata
from driftcheck.record.parts import Parts
from driftcheck.record.rng import DropoutControl
from driftcheck.record.tracer import Tracer
from driftcheck.store import format as fmt
from driftcheck.store.layout import rank_dir
from driftcheck.store.remote import is_url
from driftcheck.store.replay import (
    decode_batch,
    encode_batch,
    input_prefix,
    model_state,
    read_replay,
    replay_meta,
    state_key,
)
from driftcheck.store.writer import TraceWriter

INPUTS_ARE = "calls"  # the replay metadata's word for "inputs[step] lists the step's model calls"


class TraceSession:
    """One traced run: reference (``replay=None``) or a target replaying ``replay``.

    Args:
        out: the trace directory (``OUT/rank-<r>`` per rank under torchrun).
        steps: the optimizer steps to capture: ``N`` (the first N) or the step indices; the run
            is traced from its first step through the last chosen one. Default: 2, or the
            reference's when replaying.
        replay: the reference trace this run starts from (its weights, model inputs, dropout).
        mode, seed, force: as for ``driftcheck record``. autocast: the autocast dtype the loop
            runs the forward under ("bf16", "fp16"), for the noise floor. grad_clip: how the loop
            clips gradients before the optimizer step ({"norm": max_norm}: the optimizer state
            then inherits the global norm's error), for the noise floor.
        driver: who runs the loop ("transformers.Trainer"), for the run metadata.
        **tracer: passed to :class:`driftcheck.record.tracer.Tracer` (include, exclude, phases).
    """

    def __init__(self, out: str | os.PathLike, *, steps: int | Iterable[int] | None = None,
                 replay: str | os.PathLike | None = None, mode: str = "full", seed: int = 0,
                 force: bool = False, autocast: str | None = None, driver: str = "",
                 model_id: str | None = None, grad_clip: dict[str, float] | None = None,
                 **tracer: Any) -> None:
        if is_url(out) or is_url(replay):
            raise DriftcheckError(f"{out if is_url(out) else replay}: the training-loop integrations "
                                  "record to and replay from local directories; copy the trace to "
                                  "or from the bucket (driftcheck record and compare take URLs)")
        self.out = Path(out)
        self.grad_clip = grad_clip  # {"norm": max_norm} or {"value": v}: the loop clips gradients
        self.replay = None if replay is None else Path(replay)
        self.mode, self.seed, self.force, self.autocast = mode, seed, force, autocast
        self.driver, self.model_id, self.tracer_kwargs = driver, model_id, tracer
        self.capture = _chosen_steps(steps)
        if mode not in fmt.MODES:
            raise DriftcheckError(f"mode must be one of {', '.join(fmt.MODES)}, not {mode!r}")
        if self.replay is not None and not self.replay.is_dir():
            raise DriftcheckError(f"replay {self.replay} is not a trace directory; pass the "
                                  "reference trace this callback recorded")
        self.tracer: Tracer | None = None
        self.writer: TraceWriter | None = None
        self.done = False
        self.step = 0
        self._in_step = False
        self._calls: list[Any] = []  # reference: this step's call descriptions
        self._inputs: list[Any] = []  # reference: per step, its calls; target: the reference's
        self._tensors: dict[str, torch.Tensor] = {}  # the replay file's tensors
        self._losses: list[torch.Tensor] = []
        self._ctx: contextlib.ExitStack | None = None
        self._account: compilation.Account | None = None  # Dynamo's account of a compiled run

    # -- the loop's hooks -----------------------------------------------------------------------
    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Before the first step: rank directories, the initial weights, the tracer attached."""
        if self.tracer is not None:
            raise DriftcheckError("this driftcheck callback already traced a run; create a new "
                                  "callback (with a new out directory) for each training run")
        self.model = ranks.unwrap(model)
        self.rank = ranks.rank_info(self.model)
        if self.rank:
            self.out = rank_dir(self.out, self.rank["rank"])
            if self.replay is not None:
                self.replay = rank_dir(self.replay, self.rank["rank"])
        if self.replay is not None:
            self._load_replay()
        else:
            self.replay_id = uuid.uuid4().hex
            if self.rank:
                self.replay_id = ranks.broadcast_str(self.replay_id if self.rank["rank"] == 0 else None)
            for name, t in self.model.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor):
                    kind = "param" if isinstance(t, nn.Parameter) else "buffer"
                    self._tensors[state_key(kind, name)] = ranks.local_shard(t).detach().to("cpu", copy=True)
        if self.capture is None:
            self.capture = set(range(2))
        self.last = max(self.capture)
        self.dropout = DropoutControl(self.seed)
        try:
            self.writer = TraceWriter(self.out, force=self.force)
        except DriftcheckError as e:  # the CLI's words name --force; a Python caller passes force=True
            if "--force" not in str(e):
                raise
            raise FileExistsError(str(e).replace("pass --force", "pass force=True")) from None
        self.tracer = Tracer(self.model, self.writer, mode=self.mode, optimizer=optimizer,
                             steps=self.capture, seed=self.seed, **self.tracer_kwargs)
        if self.rank and self.tracer.mode != "full":  # each part's share of the logical sample
            self.tracer.capture.parts = Parts(ranks.batch_part(self.rank["parallel"], self.rank["rank"],
                                                               self.rank["world_size"]),
                                              None, self.tracer.capture.seed)
        self.tracer.attach()
        self.tracer.pause()
        # A compiled model (torch.compile by the loop, Trainer's torch_compile): Dynamo's account
        # of the run for the manifest's run.compile, and the capture's own breaks as findings.
        self._account = compilation.Account().start() if self.tracer.compiled else None

    def step_begin(self) -> None:
        if self.done or self.tracer is None or self._in_step:
            return
        self._in_step = True
        self._calls, self._losses = [], []
        self.dropout.set_step(self.step)
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(self.dropout)
        self._ctx.enter_context(self.tracer.logit_watch("loop"))
        self.tracer.resume()

    def model_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """One call of the model in a step: (args, kwargs) the model is to compute with."""
        if not self._in_step:
            return args, kwargs
        index = len(self._calls)
        self._calls.append(None)
        if self.replay is None:
            desc = encode_batch({"args": list(args), "kwargs": dict(kwargs)},
                                input_prefix(f"{self.step}.{index}"), self._tensors)
            self._calls[-1] = desc
            for key in [k for k in self._tensors if k.startswith(input_prefix(f"{self.step}.{index}") + ".")]:
                self._tensors[key] = self._tensors[key].detach().to("cpu", copy=True)
            return args, kwargs
        recorded = self._inputs[self.step]["items"] if self.step < len(self._inputs) else []
        if index >= len(recorded):
            self._refuse(
                f"step {self.step}: the model is called {index + 1} time(s), the reference's "
                f"{self.replay} called it {len(recorded)} time(s) in this step; run the target "
                "with the same gradient accumulation and loop as the reference")
        call = decode_batch(recorded[index], self._tensors)
        live = dict(flatten((args, kwargs), "in"))
        device = self.tracer.device if self.tracer is not None else torch.device("cpu")

        def place(slot: str, t: torch.Tensor) -> torch.Tensor:
            twin = live.get(slot)
            dev = twin.device if twin is not None else device
            if t.is_floating_point() and twin is not None and twin.is_floating_point():
                return t.to(device=dev, dtype=twin.dtype)
            return t.to(device=dev)

        new_args = substitute(tuple(call["args"]), "in.0", place)
        new_kwargs = substitute(call["kwargs"], "in.1", place)
        return tuple(new_args), dict(new_kwargs)

    def add_loss(self, loss: Any) -> None:
        if self._in_step and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().float().reshape(()))

    def step_end(self) -> None:
        """After the step's optimizer step: the step captured; after the last chosen step, the
        trace finished."""
        if not self._in_step or self.tracer is None:
            return
        self._in_step = False
        if self.replay is None:
            self._inputs.append({"t": "list", "items": self._calls})
        elif self.step < len(self._inputs) and len(self._calls) < len(self._inputs[self.step]["items"]):
            self._refuse(
                f"step {self.step}: the model was called {len(self._calls)} time(s), the "
                f"reference's {self.replay} called it {len(self._inputs[self.step]['items'])} "
                "time(s); run the target with the same gradient accumulation as the reference")
        loss = torch.stack(self._losses).sum() if self._losses else None
        self.tracer.step(loss)
        self.tracer.pause()
        self._close_ctx()
        self.step += 1
        if self.step > self.last:
            self._finish()

    def finish(self) -> None:
        """Training ended: finish the trace with the steps that ran (a no-op once finished)."""
        if self.tracer is None or self.done:
            return
        self._in_step = False
        self._close_ctx()
        if self.step == 0:
            self.abort("training ended before the first traced step finished")
            raise DriftcheckError(f"driftcheck: training ended before step 0 finished; {self.out} "
                                  "holds no trace (is max_steps at least 1?)")
        self._finish()

    def abort(self, reason: str) -> None:
        """Training failed: leave a directory that never passes as a complete trace."""
        self._close_ctx()
        if self.tracer is not None:
            self.tracer.detach()
        if self._account is not None:
            self._account.stop()
        if self.writer is not None and not self.writer.closed:
            self.writer.abort(reason)
        self.done = True

    # -- internals ------------------------------------------------------------------------------
    def _refuse(self, message: str) -> None:
        """The target does not replay the reference: no trace, the patches undone, one line."""
        self.abort(message)
        raise DriftcheckError(message)

    def _close_ctx(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.close()

    def _finish(self) -> None:
        assert self.tracer is not None and self.writer is not None
        tracer, writer = self.tracer, self.writer
        tracer.detach()
        tracer.flush()
        self.done = True
        if self.replay is None:
            meta = replay_meta(replay_id=self.replay_id, seed=self.seed, steps=self.step, inputs=self._inputs,
                               model=self.model_id, inputs_are=INPUTS_ARE,
                               capture_steps=sorted(self.capture or ()), driver=self.driver)
            if self.rank:
                meta.update(rank=self.rank["rank"], world_size=self.rank["world_size"])
            writer.write_replay(self._tensors, meta)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        params = sum(p.numel() for p in self.model.parameters())
        run = run_metadata(
            model=self.model, device=tracer.device, mode=self.mode, steps=self.step,
            dtype=dtypes.name_of(dtype), dtype_obj=dtype, seed=self.seed, autocast=self.autocast,
            model_id=self.model_id or f"{type(self.model).__name__} ({params} parameters)",
            replay_id=self.replay_id, replay_of=str(self.replay) if self.replay else None,
            driver=self.driver, capture_steps=sorted(self.capture or ()), **self.rank,
            **({"grad_clip": self.grad_clip} if self.grad_clip else {}))
        if self._account is not None:
            counts, found = self._account.result()
            run["compile"] = dict(backend="user", mode=None, dynamic=None, **counts)
            tracer.findings.extend(found)
        if not writer.entries:
            writer.abort("nothing captured")
            raise DriftcheckError("the driftcheck callback captured no tensor: its include/exclude/"
                                  "phases select nothing; widen them")
        writer.close(run, extra=tracer.manifest_extra())

    def _load_replay(self) -> None:
        assert self.replay is not None
        if not self.replay.is_dir() and self.rank:
            raise DriftcheckError(f"replay {self.replay.parent} has no {self.replay.name}: the "
                                  "reference ran with fewer ranks; use the same number of processes")
        tensors, meta = read_replay(self.replay)
        if meta.get("inputs_are") != INPUTS_ARE:
            raise DriftcheckError(f"replay {self.replay} was recorded by `driftcheck record`, not by a "
                                  "training-loop callback; record the reference with the same "
                                  "callback (or replay it with driftcheck record --replay)")
        inputs = meta.get("inputs")
        if not isinstance(inputs, list) or not all(isinstance(s, dict) and isinstance(s.get("items"), list)
                                                   for s in inputs):
            raise DriftcheckError(f"replay {self.replay}: its input list is malformed; re-record "
                                  "the reference")
        if self.rank and meta.get("world_size", self.rank["world_size"]) != self.rank["world_size"]:
            raise DriftcheckError(f"replay {self.replay.parent} was recorded with {meta.get('world_size')} "
                                  f"ranks, this run has {self.rank['world_size']}; use the same number")
        self._inputs, self._tensors = inputs, tensors
        self.replay_id = str(meta.get("replay_id"))
        seed = meta.get("seed", 0)
        self.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
        if self.capture is None:
            chosen = meta.get("capture_steps")
            self.capture = set(chosen) if isinstance(chosen, list) and chosen and all(
                isinstance(s, int) for s in chosen) else set(range(len(inputs)))
        if max(self.capture) >= len(inputs):
            raise DriftcheckError(f"replay {self.replay} holds {len(inputs)} step(s); steps up to "
                                  f"{max(self.capture)} were asked for: choose steps below {len(inputs)}")
        _load_state(self.model, tensors, self.replay)


def _chosen_steps(steps: int | Iterable[int] | None) -> set[int] | None:
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, (int, Iterable)):
        raise DriftcheckError(f"steps must be a number of steps or a list of step indices, not {steps!r}")
    chosen = set(range(steps)) if isinstance(steps, int) else set(steps)
    if not chosen or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in chosen):
        raise DriftcheckError(f"steps must be at least 1, or step indices >= 0; got {steps!r}")
    return chosen


def _load_state(model: nn.Module, tensors: dict[str, torch.Tensor], replay: Path) -> None:
    state = model_state(tensors)
    own = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise DriftcheckError(
            f"replay {replay} was recorded from a different model: {len(missing)} tensor(s) missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}); train the "
            "same model as the reference")
    bad = [k for k, v in own.items() if tuple(ranks.local_shard(v).shape) != tuple(state[k].shape)]
    if bad:
        raise DriftcheckError(f"replay {replay}: shapes differ for {bad[:3]}; the reference trained "
                              "another model configuration")
    with torch.no_grad():
        for k, v in own.items():
            ranks.local_shard(v).copy_(state[k])


class SessionCallback:
    """What both framework callbacks share: their arguments, turned into a TraceSession at
    construction, so that bad arguments are refused before any training runs.

    Args:
        out: the trace directory to create (``force=True`` to overwrite).
        steps: optimizer steps to trace: ``N`` (the first N, default 2) or step indices.
            A replaying target traces the reference's steps unless told otherwise.
        replay: a reference trace written by the same callback.
        mode: "full", "stats" or "auto". stop: end training after the last traced step.
        **tracer: include, exclude, phases, full_modules, transfer (see driftcheck.trace).
    """

    DRIVER = ""
    SESSION_OPTIONS: ClassVar[dict[str, Any]] = {}  # what a framework's session always needs

    def __init__(self, out: str | os.PathLike, *, steps: int | Iterable[int] | None = None,
                 replay: str | os.PathLike | None = None, mode: str = "full", seed: int = 0,
                 force: bool = False, stop: bool = False, **tracer: Any) -> None:
        self.stop = stop
        self.session = TraceSession(out, steps=steps, replay=replay, mode=mode, seed=seed,
                                    force=force, driver=self.DRIVER, **self.SESSION_OPTIONS, **tracer)


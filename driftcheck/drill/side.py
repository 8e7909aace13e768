"""One side of a drill: replay a recorded run up to one module call and rerun that call under the
op recorder, on the reference's recorded inputs and parameters.

The side's run is rebuilt from its trace's manifest (model, seed, device, dtype, autocast,
simulated backend, TPU emulation) and driven by the record's own training loop
(``runner.train``, untraced) from the reference's replay file, so everything before the drilled
call is what the recorded run did. At the chosen (step, call) of the module, a forward hook runs
the call again, from the *reference's* recorded inputs and the reference's parameters of that
step (cast to this side's dtypes), under an :class:`~driftcheck.drill.oplog.OpRecorder`; for a
backward drill, ``autograd.grad`` from the reference's recorded output gradients follows, under
the same recorder. The run stops there.

The reference side keeps every op's tensors. The target side runs the call twice: once to learn
its op sequence, which is aligned with the reference's, and once more calling each aligned op a
second time on the reference op's inputs (its local output), inside the same module call, so a
fault scoped to the module is active as it was.

Run as ``python -m driftcheck.drill.side ARGS.json`` by ``driftcheck drill``, so each side runs
in its own process under its own recorded environment (a CPU reference never loads torch_tpu).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from driftcheck.drill import oplog
from driftcheck.drill.align import align
from driftcheck.errors import DriftcheckError
from driftcheck.nested import flatten, substitute
from driftcheck.record.isolation import fork_rng, rng_state, set_rng_state
from driftcheck.targets import precision


@dataclass
class Point:
    """The module call a drill reruns."""

    module: str
    step: int
    call: int = 0
    phase: str = "forward"  # "forward" or "backward" (the backward also records the forward)


class _Done(BaseException):
    """Raised from the hook once the call is drilled: stops the training loop (not an error, so
    the loop's user-code guard lets it through)."""


class DrillHook:
    """A ``target_hooks``-style callable: installs the hooks on the drilled module (after the
    side's own ``inner`` hooks, such as an injected fault), counts its calls per step, and at
    the chosen one runs the drill."""

    def __init__(self, point: Point, ref_dir: str | os.PathLike, *, keep: bool,
                 ref_ops: list[oplog.OpRecord] | None = None, dropout: Any = None,
                 inner: Callable[[nn.Module], Any] | None = None) -> None:
        self.point, self.ref_dir, self.keep, self.ref_ops = point, ref_dir, keep, ref_ops
        self.dropout, self.inner = dropout, inner
        self.step, self.calls = -1, 0
        self.inner_hook: Any = None  # what the target hooks return: maybe set_step, remove
        self.ops: list[oplog.OpRecord] | None = None
        self.info: dict[str, Any] = {}
        self._mark: Any = None

    def __call__(self, model: nn.Module) -> DrillHook:
        if self.inner is not None:
            self.inner_hook = self.inner(model)
        try:
            mod = model.get_submodule(self.point.module) if self.point.module else model
        except AttributeError:
            raise DriftcheckError(f"drill: the model has no module {self.point.module!r}") from None
        mod.register_forward_pre_hook(self._pre)
        mod.register_forward_hook(self._post, with_kwargs=True)
        return self

    def set_step(self, step: int) -> None:
        self.step, self.calls = step, 0
        if hasattr(self.inner_hook, "set_step"):
            self.inner_hook.set_step(step)

    def _here(self) -> bool:
        return self.step == self.point.step and self.calls == self.point.call

    def _pre(self, module: nn.Module, args: tuple) -> None:
        if self._here() and self._mark is None:
            dev = next((t.device for t in module.parameters()), torch.device("cpu"))
            self._mark = (rng_state(dev), self.dropout.index if self.dropout is not None else None)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._here():
            self.calls += 1
            return
        self.calls += 1
        from driftcheck.record.local import LocalReplay

        ref = LocalReplay(self.ref_dir)
        try:
            prepared = _prepare(ref, self.point, module, args, kwargs, output)
            self.info = prepared.pop("info")
            self.info["call_site"] = oplog.call_site()
            if self.ref_ops is None:
                self.ops = self._pass(module, prepared, oplog.OpRecorder(keep=self.keep))
            else:
                first = self._pass(module, prepared, oplog.OpRecorder(keep=False))
                pairs = align([o.token() for o in self.ref_ops], [o.token() for o in first])
                rerun = {t: self.ref_ops[r] for r, t in pairs}
                rec = oplog.OpRecorder(keep=False, rerun=rerun, tokens=[o.token() for o in first])
                self.ops = self._pass(module, prepared, rec)
                self.info["pairs"] = pairs
                self.info["second_pass_diverged_at"] = rec.diverged
        finally:
            ref.close()
        raise _Done()

    def _pass(self, module: nn.Module, prep: dict[str, Any], rec: oplog.OpRecorder
              ) -> list[oplog.OpRecord]:
        rng, mask_index = self._mark
        dev = next((t.device for t in module.parameters()), torch.device("cpu"))
        with fork_rng(dev):
            set_rng_state(rng)
            if mask_index is not None:
                saved = (self.dropout.index, len(self.dropout.masks))
                self.dropout.index = mask_index
            try:
                leaves: list[torch.Tensor] = []
                inputs = substitute(prep["args"], "input", _fresh_leaf(prep["leaves"], leaves))
                kw = substitute(prep["kwargs"], "input", _fresh_leaf(prep["leaves"], leaves))
                params = {k: v.detach().requires_grad_(v.requires_grad) for k, v in prep["params"].items()}
                buffers = {k: v.clone() for k, v in prep["buffers"].items()}
                with torch.autograd.set_detect_anomaly(True, check_nan=False):
                    out = _drilled_call(module, params, buffers, inputs, kw, rec)
                if self.point.phase == "backward":
                    pairs = [(t, prep["grads"][s]) for s, t in flatten(out, "output")
                             if isinstance(t, torch.Tensor) and t.requires_grad and s in prep["grads"]]
                    wrt = leaves + [p for p in params.values() if p.requires_grad]
                    if pairs and wrt:
                        rec.phase = "backward"
                        with rec:
                            torch.autograd.grad([t for t, _ in pairs], wrt,
                                                grad_outputs=[g for _, g in pairs], allow_unused=True)
            finally:
                if mask_index is not None:
                    self.dropout.index = saved[0]
                    del self.dropout.masks[saved[1]:]
        return rec.ops


def _drilled_call(module: nn.Module, params: dict, buffers: dict, args: Any, kwargs: Any,
                  rec: oplog.OpRecorder) -> Any:
    # The name of this function is oplog.BOUNDARY: source lines are looked for inside it.
    from torch.func import functional_call

    with rec:
        return functional_call(module, {**params, **buffers}, tuple(args), dict(kwargs), strict=False)


assert _drilled_call.__name__ == oplog.BOUNDARY


def _fresh_leaf(leaves: set[str], made: list[torch.Tensor]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A fresh copy of each input; those whose gradient the real call produced become leaves
    (in ``made``), and the module gets a non-leaf copy of them, so that an in-place module
    (``ReLU(inplace=True)``) may write into its input."""
    def fn(slot: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if slot not in leaves:
            return t
        t.requires_grad_(True)
        made.append(t)
        return t.clone()
    return fn


def _prepare(ref: Any, point: Point, module: nn.Module, args: tuple, kwargs: dict,
             output: Any) -> dict[str, Any]:
    """The reference's inputs, parameters and output gradients of the drilled call, cast to this
    side's dtypes and device (the live call's tensors say which)."""
    missing: list[str] = []
    leaves: set[str] = set()

    def ref_input(slot: str, t: torch.Tensor) -> torch.Tensor:
        r = ref.tensor(point.step, "forward", point.module, point.call, slot)
        if r is None or tuple(r.shape) != tuple(t.shape):
            missing.append(slot)
            return t.detach()
        if t.requires_grad and t.is_floating_point():
            leaves.add(slot)
        return oplog.cast_to(r, t.dtype, t.device) if t.is_floating_point() else r.to(t.device)

    r_args = substitute(args, "input", ref_input)
    r_kwargs = substitute(kwargs, "input", ref_input)
    if missing:
        raise DriftcheckError(f"drill: the reference holds no forward input {missing[0]} of "
                              f"{point.module or '<root>'} call {point.call} at step {point.step} "
                              "(recorded in stats mode, or outside --include/--capture-steps); "
                              "record the reference with --mode full")
    params: dict[str, torch.Tensor] = {}
    own = 0
    for name, p in module.named_parameters():
        owner, _, local = f"{point.module}.{name}".lstrip(".").rpartition(".")
        rp = ref.tensor(point.step, "params", owner, 0, f"param.{local}")
        if rp is None or tuple(rp.shape) != tuple(p.shape):
            rp, own = p.detach(), own + 1
        # requires_grad as in the real call, for a forward drill too: kernels are chosen by it
        # (SDPA takes its math path for a mask that requires grad, a fused kernel otherwise)
        params[name] = rp.detach().to(device=p.device, dtype=p.dtype).requires_grad_(p.requires_grad)
    buffers = {n: b.detach() for n, b in module.named_buffers()}
    grads: dict[str, torch.Tensor] = {}
    if point.phase == "backward":
        for slot, t in flatten(output, "output"):
            g = ref.tensor(point.step, "backward", point.module, point.call, "grad_" + slot)
            if g is not None and tuple(g.shape) == tuple(t.shape):
                grads[slot] = g.to(device=t.device, dtype=t.dtype if t.is_floating_point() else g.dtype)
        if not grads:
            raise DriftcheckError(f"drill: the reference holds no output gradient of "
                                  f"{point.module or '<root>'} at step {point.step}; drill the "
                                  "forward (--phase forward) or record the reference in full")
    info = {"params_from_reference": len(params) - own, "params_own": own,
            "inputs": [{"slot": s, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for s, t in list(flatten(r_args, "input")) + list(flatten(r_kwargs, "input"))]}
    return {"args": r_args, "kwargs": r_kwargs, "leaves": leaves, "params": params,
            "buffers": buffers, "grads": grads, "info": info}


def run_side(trace: str | os.PathLike, ref: str | os.PathLike, point: Point, *, keep: bool,
             ref_ops: list[oplog.OpRecord] | None = None, scenario: Any = None,
             target_hooks: Callable[[nn.Module], Any] | None = None,
             ) -> tuple[list[oplog.OpRecord], dict[str, Any]]:
    """Rebuild the run recorded in ``trace`` (which replayed ``ref``, or is ``ref``), train it up
    to ``point`` and drill that call: (the ops, what the drill saw)."""
    from driftcheck.loader import load_scenario
    from driftcheck.numerics.dtypes import parse_cli as parse_dtype
    from driftcheck.record.loop import train
    from driftcheck.record.points import load_state, segment
    from driftcheck.record.rng import DropoutControl
    from driftcheck.store import TraceReader
    from driftcheck.store.replay import decode_batch, read_replay
    from driftcheck.targets import devices

    run = TraceReader(trace).run
    device = devices.open_device(str(run.get("device", "cpu")))
    dtype = parse_dtype(run.get("dtype", "float32"))
    if scenario is None:
        scenario = load_scenario(run.get("model_id") or run.get("scenario"), int(run.get("seed") or 0))
    tensors, meta = read_replay(ref)
    model = scenario.model
    load_state(model, tensors, ref)
    batches = [decode_batch(d, tensors) for d in meta.get("inputs", [])]
    start = int(run.get("start_step") or 0)
    if start or meta.get("cycle"):
        batches = segment(model, ref, meta, batches, start, int(run["steps"]), int(run["steps"]))
    if not start <= point.step < start + len(batches):
        raise DriftcheckError(f"drill: step {point.step} is not in the recorded run (steps "
                              f"{start}-{start + len(batches) - 1})")
    batches = batches[:point.step + 1 - start]
    seed = int(meta.get("seed", 0))
    torch.manual_seed(seed)
    model.to(device=device)
    if dtype != torch.float32:
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    fp8_handle = None
    if run.get("fp8"):
        from driftcheck.targets import fp8 as fp8_mod

        fp8_handle = fp8_mod.enable_fp8(model, fp8_mod.Fp8Recipe(run["fp8"]))
    dropout = DropoutControl(seed)
    hook = DrillHook(point, ref, keep=keep, ref_ops=ref_ops, dropout=dropout, inner=target_hooks)
    hook(model)
    optimizer = scenario.optimizer(model.parameters()) if scenario.optimizer and scenario.loss else None
    contexts = contextlib.ExitStack()
    if run.get("simulated_backend"):
        from driftcheck.targets.simulate import backend

        contexts.enter_context(backend(run["simulated_backend"]))
    mkldnn = ((run.get("precision") or {}).get("cpu_kernels") or {}).get("mkldnn")
    if mkldnn is False:  # the side ran with oneDNN off (--mkldnn off); this process is its rerun
        precision.apply_settings(mkldnn=False)
    level = (run.get("emulation") or {}).get("matmul_precision")
    if level:
        from driftcheck.targets.emulate import emulate_tpu

        contexts.enter_context(emulate_tpu(level))
    try:
        with contexts:
            train(model, batches, scenario, optimizer, device=device, dtype=dtype, dropout=dropout,
                  autocast=run.get("autocast"), first_step=start, step_hook=hook.set_step,
                  model_id=run.get("model_id"))
    except _Done:
        return hook.ops or [], hook.info
    finally:
        if hasattr(hook.inner_hook, "remove"):
            hook.inner_hook.remove()
        if fp8_handle is not None:
            fp8_handle.remove()
    raise DriftcheckError(f"drill: {point.module or 'the model'} ran {hook.calls} time(s) at step "
                          f"{point.step}, so it has no call {point.call}")


def main(argv: list[str] | None = None) -> int:
    """``python -m driftcheck.drill.side ARGS.json``: one side, its op log into ARGS["out"]."""
    args = json.loads(Path((argv or sys.argv[1:])[0]).read_text(encoding="utf-8"))
    point = Point(**args["point"])
    try:
        ref_ops = oplog.load(args["ref_ops"])[0] if args.get("ref_ops") else None
        ops, info = run_side(args["trace"], args["ref"], point, keep=ref_ops is None, ref_ops=ref_ops)
        oplog.save(ops, args["out"], extra={"info": info, "point": asdict(point)})
    except DriftcheckError as e:
        print(f"driftcheck: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compilation: a record's ``torch.compile`` settings (``--compile [BACKEND]``, ``--compile-mode``,
``--dynamic``), checked before anything runs, and Dynamo's own account of the run (graphs,
graph breaks, recompilations) for the manifest, with the breaks and recompilations that the
tracer's code caused as findings.

What is captured inside the graph is record/taps.py's.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from driftcheck.errors import DriftcheckError
from driftcheck.record.taps import AROUND_GRAPH, FORWARD_CALL_LINES, FORWARD_FRAME

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the driftcheck package
_TAPS = os.path.join(_OURS, "record", "taps.py")
_TAPS_NAME = os.path.join("record", "taps.py")  # as a stack names it, absolute or not


def settings(backend: str | None, mode: str | None = None, dynamic: bool | None = None,
             device: torch.device | None = None) -> dict[str, Any] | None:
    """The compile settings of a record, checked: None where it does not compile.

    Raises:
        DriftcheckError: one line: an unknown backend (with the known ones), ``tpu`` without
            torch_tpu, or a mode without a backend.
    """
    if backend is None:
        if mode is not None or dynamic is not None:
            raise DriftcheckError("--compile-mode and --dynamic set how --compile compiles: add "
                                  "--compile [BACKEND]")
        return None
    if mode is not None and mode not in MODES:
        raise DriftcheckError(f"--compile-mode {mode!r} is not one of {', '.join(MODES)}")
    if backend == "tpu":
        from driftcheck.targets import devices

        if devices.torch_tpu_version() is None:
            raise DriftcheckError(f"--compile tpu is torch_tpu's backend: {devices.TPU_FIX}")
        if device is not None and device.type != "tpu":
            raise DriftcheckError(f"--compile tpu compiles for a TPU, not --device {device.type}; "
                                  "record on --device tpu, or compile with inductor or aot_eager")
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend != "tpu" and backend not in known:
        shown = sorted(set(torch._dynamo.list_backends()) | {"aot_eager", "eager"})
        raise DriftcheckError(f"--compile {backend!r} is not a registered torch.compile backend; "
                              f"known here: {', '.join(shown)}")
    if mode is not None and backend != "inductor":
        raise DriftcheckError(f"--compile-mode is inductor's; the {backend} backend takes none")
    if backend == "tpu" and dynamic is None:
        dynamic = False  # torch_tpu compiles static shapes unless asked (bounded dynamism pads)
    return {"backend": backend, "mode": mode, "dynamic": dynamic}


def wrap(model: nn.Module, compile: dict[str, Any]) -> nn.Module:
    """``torch.compile(model)`` as ``compile`` says (``settings``), its own hooks in its graph
    (``inline_hooks``)."""
    kwargs: dict[str, Any] = {"backend": compile["backend"], "dynamic": compile.get("dynamic")}
    if compile.get("mode"):
        kwargs["mode"] = compile["mode"]
    return inline_hooks(cast(nn.Module, torch.compile(model, **kwargs)))  # an OptimizedModule


def regional(compile: dict[str, Any]) -> Any:
    """``fn -> torch.compile(fn)`` as ``compile`` says: one module's code compiled on its own
    (the local replay of a compiled target, record/local.py)."""
    kwargs: dict[str, Any] = {"backend": compile["backend"], "dynamic": compile.get("dynamic")}
    if compile.get("mode"):
        kwargs["mode"] = compile["mode"]
    return lambda fn: torch.compile(fn, **kwargs)


def inline_hooks(model: nn.Module) -> nn.Module:
    """A model compiled whole with its own hooks traced into its graph, as a torch.nn class's
    are: by default Dynamo calls a user model's hooks outside the frame it compiles, where the
    gradient of an output the graph itself consumes (logits of a model that computes its loss)
    never reaches a hook. Re-initialised under ``wrap_top_frame``; others unchanged."""
    init = getattr(model, "_initialize", None)
    if type(model).__name__ == "OptimizedModule" and init is not None \
            and hasattr(torch._dynamo.config, "wrap_top_frame"):
        with torch._dynamo.config.patch(wrap_top_frame=True):
            init()
    return model


def prepare_optimizer(optimizer: Any, compile: dict[str, Any] | None) -> list[str]:
    """torch_tpu's compiled training needs its stateful optimizers built ``capturable=True``
    (their step count a device tensor, not a Python number): set it for the ``tpu`` backend on
    every parameter group that has the option; returns the groups' optimizer names changed."""
    if not compile or compile.get("backend") != "tpu" or optimizer is None:
        return []
    changed = []
    for group in optimizer.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            changed.append(type(optimizer).__name__)
    return changed


def _live_instance_dicts() -> Any:
    """Make Dynamo's view of an object's ``__dict__`` read the side-effect table in use, not the
    one it was made with; returns the undo. A tap's ``register_hook`` on a tensor made in the
    graph is traced as a subgraph, after which Dynamo restores its side-effect table from a
    copy (torch 2.13: ``speculate_subgraph(restore_side_effects=True)``); an object made
    before the tap (a Hugging Face ModelOutput, any Python object) still wrote its attribute
    assignments into the old table, and reads came from the new one: CLIP's
    ``text_outputs.pooler_output = self.text_projection(...)`` was lost, the traced compiled
    model computed its embeddings from the unprojected outputs (an observer effect). Nothing
    to do where Dynamo has no such class or already reads the live table."""
    try:
        from torch._dynamo.variables.dicts import SideEffectsProxyDict as cls
    except ImportError:
        return lambda: None
    if "side_effects" in vars(cls) or "__init__" not in vars(cls):
        return lambda: None
    init = cls.__init__

    def __init__(self: Any, item: Any, tx: Any) -> None:
        self._driftcheck_output = tx.output
        init(self, item, tx)

    def live(self: Any) -> Any:
        return self._driftcheck_output.side_effects

    prop = property(live, lambda self, value: None)  # its own __init__ sets it: ignored
    # Dynamo's own class patched for the run (undone by ``undo``): mypy cannot follow it
    cls.__init__, cls.side_effects = __init__, prop  # type: ignore[method-assign,assignment]

    def undo() -> None:  # once, however often stop() is called
        if vars(cls).get("side_effects") is prop:
            cls.__init__ = init  # type: ignore[method-assign]  # Dynamo's own, back
            del cls.side_effects  # type: ignore[misc]  # the property set above

    return undo


_REPLAY_FRAMES: set[int] = set()  # Dynamo's metrics of frames the local replay compiled


@contextlib.contextmanager
def unaccounted() -> Iterator[None]:
    """Dynamo's work inside the block is not the run's (the local replay compiling a module on
    its own, after the step): its counters are restored, its break log not collected, its
    frames left out of ``Account.result``."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    saved = {k: dict(counters[k]) for k in ("graph_break", "stats")}
    n = len(get_compilation_metrics())
    log = logging.getLogger(_BREAK_LOG)
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled
        for k, v in saved.items():
            counters[k].clear()
            counters[k].update(v)
        _REPLAY_FRAMES.update(id(m) for m in get_compilation_metrics()[n:])


class Account:
    """Dynamo's counters over one record: ``start()`` before the first step, ``result()``
    after the last (the counters are process-wide; the difference is this run's)."""

    def start(self) -> Account:
        from torch._dynamo.utils import counters, get_compilation_metrics

        self._breaks = dict(counters["graph_break"])
        self._graphs = int(counters["stats"].get("unique_graphs", 0))
        self._metrics = len(get_compilation_metrics())
        # Random numbers drawn inside a graph (torch.rand in a drop path, timm's and BEiT's
        # stochastic depth) from the run's generator as eager code draws them, not from
        # inductor's own Philox streams: a compiled target then draws the eager reference's
        # (as DropoutControl's masks), or every such call differs for no numeric reason.
        import torch._inductor.config as inductor_module

        inductor_config: Any = inductor_module  # a config module: its attributes are made at import
        self._random = (inductor_config, inductor_config.fallback_random)
        inductor_config.fallback_random = True
        self._unpatch = _live_instance_dicts()
        # Each break's user stack (Dynamo's graph_breaks log, read without printing it):
        # a break whose stack passes through the tracer's code is the capture's.
        self._stacks: list[str] = []
        self._log = logging.getLogger(_BREAK_LOG)
        self._saved = (self._log.level, self._log.propagate)
        self._handler = _Collect(self._stacks)
        self._log.addHandler(self._handler)
        self._log.setLevel(logging.DEBUG)
        if self._saved[0] != logging.DEBUG:  # collected, not printed (unless the user asked)
            self._log.propagate = False
        return self

    def stop(self) -> None:
        config, before = self._random
        config.fallback_random = before
        self._unpatch()
        self._log.removeHandler(self._handler)
        self._log.setLevel(self._saved[0])
        self._log.propagate = self._saved[1]

    def result(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the manifest's ``compile`` counts, the findings they make)."""
        from torch._dynamo.utils import counters, get_compilation_metrics

        self.stop()

        breaks = {k: v - self._breaks.get(k, 0) for k, v in counters["graph_break"].items()
                  if v - self._breaks.get(k, 0) > 0}
        frames = [m for m in get_compilation_metrics()[self._metrics:] if id(m) not in _REPLAY_FRAMES]
        recompiles = [m for m in frames if getattr(m, "recompile_reason", None)]
        counts = {"graphs": int(counters["stats"].get("unique_graphs", 0)) - self._graphs,
                  "frames": len(frames), "graph_breaks": sum(breaks.values()),
                  "break_reasons": {k[:300]: v for k, v in sorted(breaks.items())},
                  "recompiles": len(recompiles)}
        findings = []
        for m in frames:  # a frame Dynamo compiled from the tracer's own code: it broke the graph
            where = str(getattr(m, "co_filename", "") or "")
            if where == _TAPS and (getattr(m, "co_name", None) in AROUND_GRAPH or _forward_frame(m)):
                continue  # a compiled model's own hooks, around its graph, or a module's
                # forward compiled as a frame of its own, as untraced (record/taps.py)
            if where.startswith(_OURS):
                findings.append(finding(
                    "compile.graph_break", "error",
                    f"the tracer's own code ({os.path.relpath(where, _OURS)}:"
                    f"{getattr(m, 'co_firstlineno', '?')}, {getattr(m, 'co_name', '?')}) was "
                    "compiled as a frame of its own: a graph break that the capture caused, so the "
                    "traced graphs are not the ones the model compiles to untraced",
                    {"frame": getattr(m, "co_name", None), "file": where}))
        for stack in self._stacks:
            ours = _our_line(stack)
            if ours:
                model = _model_line(stack)
                findings.append(finding(
                    "compile.graph_break", "error",
                    f"the capture broke the compiled graph at {ours}"
                    + (f", in the module called from {model}" if model else "")
                    + ": the traced graphs are not the ones the model compiles to untraced; "
                    + _reason(stack), {"stack": stack[-2000:]}))
        for m in recompiles:
            reason = str(m.recompile_reason)
            caused = bool(_our_line(reason)) or (str(getattr(m, "co_filename", "")).startswith(_OURS)
                                                 and not _forward_frame(m))
            findings.append(finding(
                "compile.recompile", "error" if caused else "warning",
                (f"Dynamo recompiled {getattr(m, 'co_name', '?')} because of the tracer's state: "
                 if caused else f"Dynamo recompiled {getattr(m, 'co_name', '?')} (the model's own "
                 "guards, not the capture's): ") + reason.strip().splitlines()[0][:300],
                {"reason": reason[:2000]}))
        if breaks and not any(f["kind"] == "compile.graph_break" for f in findings):
            findings.append(finding(
                "compile.graph_break", "warning",
                f"the model's code broke the compiled graph {sum(breaks.values())} time(s) (its own "
                f"breaks, not the capture's), e.g. {next(iter(breaks))[:200]}",
                {"reasons": counts["break_reasons"]}))
        return counts, findings


_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"
# The capture's code (not the training loop's frames, loop.py and runner.py, which call the model
# and so sit at the outer end of every stack Dynamo reports)
_CAPTURE = (r"(?:record/(?:taps|hooks|autograd|capture|tracer|watch|meta|norms|rng|calls|state|audits"
            r"|selection)|audit/\w+)")
_OUR_FILE = re.compile(r'(?:File ")?([^"\s]*driftcheck/' + _CAPTURE + r'\.py)(?:", line |:)(\d+)')
_ANY_FILE = re.compile(r'File "([^"]+)", line (\d+)')


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.into.append(record.getMessage())
        except Exception:  # a record that does not format: not a break we can place
            pass


def _forward_frame(metrics: Any) -> bool:
    """A frame of a module's forward_tap, or a resume function of one (record/taps.py)."""
    return FORWARD_FRAME in str(getattr(metrics, "co_name", "") or "")


def _our_line(text: str) -> str | None:
    """The innermost place in driftcheck's capture code that ``text`` (a stack) names; a
    forward_tap calling the module's forward is the model's place, not the capture's (named as
    a frame of the stack, or as the place of a break whose stack Dynamo left out as a repeat)."""
    hits = [m for m in _OUR_FILE.finditer(text) if (m.group(1).startswith(_OURS) or
            not os.path.isabs(m.group(1))) and not text.startswith(f", in {FORWARD_FRAME}", m.end())
            and not (m.group(1).endswith(_TAPS_NAME) and int(m.group(2)) in FORWARD_CALL_LINES)]
    if not hits:
        return None
    path, line = hits[-1].group(1), hits[-1].group(2)
    return f"{os.path.relpath(path, os.path.dirname(_OURS)) if os.path.isabs(path) else path}:{line}"


def _model_line(text: str) -> str | None:
    """The innermost frame of the stack outside driftcheck and torch: the model's code."""
    found = None
    for m in _ANY_FILE.finditer(text):
        path = m.group(1)
        if not path.startswith(_OURS) and f"{os.sep}torch{os.sep}" not in path:
            found = f"{path}:{m.group(2)}"
    return found


def _reason(stack: str) -> str:
    for line in stack.splitlines():
        if "Reason:" in line:
            return line.split("Reason:", 1)[1].strip()[:300]
    return ""


def finding(kind: str, severity: str, message: str, details: dict[str, Any],
            module: str = "") -> dict[str, Any]:
    """A record-time compile.* finding, as the manifest holds it (step 0: of the whole run)."""
    return {"kind": kind, "severity": severity, "module": module, "step": 0, "message": message,
            "details": details}

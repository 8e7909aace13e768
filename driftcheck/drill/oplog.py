"""The op log: every ATen op one module call issues, forward and backward, as a dispatch mode sees it.

An :class:`OpRecorder` is a ``TorchDispatchMode`` entered around a module call (and around the
``autograd.grad`` of its backward). Per op it keeps the op's name, the structure of its
arguments with every tensor replaced by a numbered leaf (``encode_args``: JSON, so the op can be
called again in another process, or by a standalone repro), the Python source line of the
model code that issued it (for a backward op, the line whose forward op created the autograd
node running it, from anomaly mode's traceback), and optionally copies of its input and output
tensors. Given ops of another run to replay (``rerun``), it also calls each op again on that
run's input tensors, cast to this run's dtypes: the op's local output.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import linecache
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftcheck import nested
from driftcheck.errors import DriftcheckError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep
# Ops whose outputs are not a function of their inputs: never judged.
RANDOM_OPS = frozenset({"bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "randn",
                        "randn_like", "randint", "randint_like", "randperm", "normal", "normal_",
                        "uniform_", "exponential_", "multinomial", "random_", "geometric_",
                        "cauchy_", "log_normal_",
                        # uninitialised memory: whatever the allocator hands out
                        "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                        "empty_permuted"})
BOUNDARY = "_drilled_call"  # the function of driftcheck/drill/side.py that calls the module


@dataclasses.dataclass
class OpRecord:
    """One op call. ``inputs``/``outputs``/``local`` hold tensors only while in memory."""

    index: int
    op: str  # "aten.gelu.default"
    phase: str  # "forward" | "backward"
    spec: Any  # encode_args of (args, kwargs); None where an argument cannot be encoded
    in_shapes: list[list[int]]
    in_dtypes: list[str]
    out_shapes: list[list[int] | None]
    out_dtypes: list[str | None]
    source: dict[str, Any] | None = None  # {file, line, function, code}
    node: str | None = None  # the autograd node running a backward op
    random: bool = False
    inputs: list[torch.Tensor] | None = None
    outputs: list[torch.Tensor | None] | None = None
    local: list[torch.Tensor | None] | None = None

    @property
    def packet(self) -> str:
        return self.op.split(".")[1] if self.op.count(".") >= 2 else self.op

    def token(self) -> str:
        """What alignment matches: the op (without its overload), phase and output shapes."""
        return f"{self.phase}|{self.packet}|{self.out_shapes}"

    def meta(self) -> dict[str, Any]:
        # never through asdict: it deep-copies the tensors too (a device copy per op, and a
        # crash on a backend whose storages cannot be copied, as a PrivateUse1 backend made in Python)
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("inputs", "outputs", "local")}


# -- argument encoding ---------------------------------------------------------------------------
def encode_args(args: tuple, kwargs: dict, leaves: list[torch.Tensor]) -> Any:
    """JSON for (args, kwargs); tensors appended to ``leaves`` and written ``{"T": i}``.
    Raises ValueError for an argument that does not survive the trip (a generator, a SymInt)."""
    def enc(_: str, x: Any, k: str, children: nested.Children[Any]) -> Any:
        if k == nested.TENSOR:
            leaves.append(x)
            return {"T": len(leaves) - 1}
        if k == nested.SEQUENCE:
            return {"L": [v for _, v in children()]}
        if k == nested.LEAF:
            return _encode_leaf(x)
        raise ValueError(f"cannot encode {type(x).__name__}")
    return {"args": [nested.fold(a, "", enc) for a in args],
            "kwargs": {key: nested.fold(v, "", enc) for key, v in kwargs.items()}}


def _encode_leaf(x: Any) -> Any:
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return {"F": repr(x)}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, (torch.memory_format, torch.layout)):
        return {"enum": str(x).removeprefix("torch.")}
    raise ValueError(f"cannot encode {type(x).__name__}")


def decode_args(spec: Any, leaves: list[torch.Tensor], device: torch.device | str | None = None,
                float_dtype: Any = None) -> tuple[tuple, dict]:
    """(args, kwargs) back from ``encode_args``: ``device`` replaces every device argument;
    ``float_dtype`` (a dtype, or a function of one) every floating dtype argument (float64 for a
    truth run, float32 for bf16 in an ideal-kernel run)."""
    def dec(x: Any) -> Any:
        if isinstance(x, dict):
            if "T" in x:
                return leaves[x["T"]]
            if "F" in x:
                return float(x["F"])
            if "L" in x:
                return [dec(v) for v in x["L"]]
            if "dtype" in x:
                dt = getattr(torch, x["dtype"])
                if float_dtype is None or not dt.is_floating_point:
                    return dt
                return float_dtype(dt) if callable(float_dtype) else float_dtype
            if "device" in x:
                return torch.device(device) if device is not None else torch.device(x["device"])
            if "enum" in x:
                return getattr(torch, x["enum"])
        return x
    return tuple(dec(a) for a in spec["args"]), {k: dec(v) for k, v in spec["kwargs"].items()}


def cast_to(x: torch.Tensor, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """``x`` in ``dtype`` (on ``device``), finite values saturated at the dtype's range: a float32
    mask of ``finfo(float32).min`` is ``finfo(bfloat16).min`` in a bf16 run's own code, not the
    ``-inf`` a plain cast makes of it."""
    if not x.is_floating_point():
        return x.to(device) if device is not None else x
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        big = torch.finfo(dtype).max
        x = torch.where(torch.isfinite(x), x.clamp(-big, big), x)
    return x.to(device=device, dtype=dtype) if device is not None else x.to(dtype)


def resolve_op(name: str) -> Any:
    """``torch.ops.aten.gelu.default`` from ``"aten.gelu.default"``."""
    ns, packet, overload = name.split(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


# -- source lines --------------------------------------------------------------------------------
_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _pick(frames: list[tuple[str, int, str]]) -> dict[str, Any] | None:
    """The model-code line among ``frames`` (innermost first, inside the drilled call): the
    innermost frame outside torch, driftcheck and the standard library; else the innermost
    ``torch/nn/modules`` forward (the drilled module is torch's own)."""
    def own(f: str) -> bool:
        return f.startswith((_TORCH_DIR, _OWN_DIR, _STDLIB, "<"))
    chosen = next((fr for fr in frames if not own(fr[0])), None)
    if chosen is None:
        chosen = next((fr for fr in frames if "/nn/modules/" in fr[0]
                       and not fr[0].endswith("module.py")), None)
    if chosen is None:
        return None
    f, line, fn = chosen
    return {"file": f, "line": line, "function": fn, "code": linecache.getline(f, line).strip()}


def call_site() -> dict[str, Any] | None:
    """The model-code line that called the module whose hook is running (for a drilled
    module that is torch's own, such as an ``nn.Linear``, this is where the model uses it)."""
    frames: list[tuple[str, int, str]] = []
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    def own(name: str) -> bool:
        return name.startswith((_TORCH_DIR, _OWN_DIR, _STDLIB, "<"))
    chosen = next((fr for fr in frames if not own(fr[0])), None)
    if chosen is None:
        return None
    return {"file": chosen[0], "line": chosen[1], "function": chosen[2],
            "code": linecache.getline(chosen[0], chosen[1]).strip()}


def forward_source() -> dict[str, Any] | None:
    frames: list[tuple[str, int, str]] = []
    f: types.FrameType | None = sys._getframe(2)
    while f is not None and f.f_code.co_name != BOUNDARY:
        frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return _pick(frames) if f is not None else None


def backward_source(node: Any) -> dict[str, Any] | None:
    tb = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not tb:
        return None
    frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in map(_TB_LINE.search, tb) if m]
    inner: list[tuple[str, int, str]] = []
    for fr in reversed(frames):  # innermost first, up to the drilled call
        if fr[2] == BOUNDARY:
            return _pick(inner)
        inner.append(fr)
    return None


# -- the recorder --------------------------------------------------------------------------------
class OpRecorder(TorchDispatchMode):
    """Records the ops under it. ``keep``: copy inputs and outputs. ``rerun``: index -> the other
    run's OpRecord (with its inputs) to call this op on as well (the result in ``local``)."""

    def __init__(self, keep: bool = True, rerun: dict[int, OpRecord] | None = None,
                 tokens: list[str] | None = None) -> None:
        super().__init__()
        self.keep, self.rerun, self.tokens = keep, rerun or {}, tokens
        self.ops: list[OpRecord] = []
        self.phase = "forward"
        self.diverged: int | None = None  # a second pass that issued other ops from here on

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves: list[torch.Tensor] = []
        try:
            spec = encode_args(args, kwargs, leaves)
        except ValueError:
            spec, leaves = None, [a for a in args if isinstance(a, torch.Tensor)]
        inputs = [t.detach().clone() for t in leaves] if self.keep else None
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        rec = OpRecord(
            index=len(self.ops), op=str(func), phase=self.phase, spec=spec,
            in_shapes=[list(t.shape) for t in leaves], in_dtypes=[_dt(t.dtype) for t in leaves],
            out_shapes=[list(o.shape) if isinstance(o, torch.Tensor) else None for o in outs],
            out_dtypes=[_dt(o.dtype) if isinstance(o, torch.Tensor) else None for o in outs],
            source=backward_source(node) if self.phase == "backward" else forward_source(),
            node=type(node).__name__ if node is not None else None,
            random=func.overloadpacket.__name__ in RANDOM_OPS, inputs=inputs,
            outputs=[o.detach().clone() if isinstance(o, torch.Tensor) else None for o in outs]
            if self.keep else None)
        i = rec.index
        if self.tokens is not None and self.diverged is None and \
                (i >= len(self.tokens) or self.tokens[i] != rec.token()):
            self.diverged = i
        if i in self.rerun and self.diverged is None and spec is not None:
            rec.local = self._rerun(func, spec, leaves, self.rerun[i])
        self.ops.append(rec)
        return out

    @staticmethod
    def _rerun(func: Any, spec: Any, leaves: list[torch.Tensor], other: OpRecord
               ) -> list[torch.Tensor | None] | None:
        if other.inputs is None or len(other.inputs) != len(leaves) or \
                any(tuple(a.shape) != tuple(b.shape) for a, b in zip(other.inputs, leaves)):
            return None
        mine = [cast_to(o, t.dtype, t.device) if t.is_floating_point() else o.to(t.device)
                for o, t in zip(other.inputs, leaves)]
        a, k = decode_args(spec, [m.clone() for m in mine], device=leaves[0].device if leaves else None)
        try:
            out = func(*a, **k)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().clone() if isinstance(o, torch.Tensor) else None for o in outs]


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# -- on disk -------------------------------------------------------------------------------------
def save(ops: list[OpRecord], path: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    metas = []
    for rec in ops:
        m = rec.meta()
        for kind in ("inputs", "outputs", "local"):
            ts = getattr(rec, kind)
            if ts is None:
                continue
            names: list[str | None] = []
            for j, t in enumerate(ts):
                if t is None:
                    names.append(None)
                    continue
                n = f"{rec.index}.{kind}.{j}"
                tensors[n] = t.detach().to("cpu").contiguous().clone()
                names.append(n)
            m[kind] = names
        metas.append(m)
    save_file(tensors, str(path / "tensors.safetensors"))
    (path / "ops.json").write_text(json.dumps({"ops": metas, **(extra or {})}), encoding="utf-8")


def load(path: str | os.PathLike) -> tuple[list[OpRecord], dict[str, Any]]:
    from safetensors.torch import load_file

    path = Path(path)
    try:
        doc = json.loads((path / "ops.json").read_text(encoding="utf-8"))
        tensors = load_file(str(path / "tensors.safetensors"))
    except (OSError, ValueError) as e:
        raise DriftcheckError(f"{path}: not a drill op log ({e})") from None
    ops = []
    for m in doc.pop("ops"):
        kinds = {k: m.pop(k, None) for k in ("inputs", "outputs", "local")}
        rec = OpRecord(**m)
        for k, names in kinds.items():
            if names is not None:
                setattr(rec, k, [tensors[n] if n is not None else None for n in names])
        ops.append(rec)
    return ops, doc

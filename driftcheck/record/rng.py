"""Randomness a target must reproduce: dropout masks generated on CPU, keyed by step and call.

Accelerator generators (TPU, CUDA) do not reproduce CPU streams, so a target would draw other
dropout masks than its reference and "drift" for no numeric reason. Under ``DropoutControl`` every
dropout draws its mask from a CPU generator seeded by (seed, step, index of the dropout call in
the step), then moves it to the device: both runs use the same masks whatever the device.
Recorded runs use it on both sides; it changes the dropout stream, not the numerics of the op.
"""
from __future__ import annotations

import itertools
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F


class DropoutControl:
    """Replace dropout's device RNG with CPU-generated masks. ``set_step(i)`` before each step.

    A context manager that swaps the dropout entry points of ``torch.nn.functional`` (which
    ``nn.Dropout`` and Hugging Face models call) and ``torch.dropout`` for the duration of the
    block. Patching these few functions, rather than a TorchFunctionMode that sees every torch
    call, keeps the cost of a step unchanged when no dropout runs.
    """

    _PATCHED = (("dropout", F), ("dropout1d", F), ("dropout2d", F), ("dropout3d", F),
                ("scaled_dot_product_attention", F), ("dropout", torch))

    def __init__(self, seed: int = 0, rank: int | None = None, world: int | None = None) -> None:
        self.seed = seed
        # A rank of a torchrun record (rank, world): its batch is part ``rank`` of ``world``
        # contiguous parts along dim 0, so it takes that part of the mask one process would
        # draw for the global batch: the same masks whatever the number of ranks.
        self.part = (rank, world) if rank is not None and world and world > 1 else None
        self.step = 0
        self.index = 0
        self.masks: list[dict[str, Any]] = []  # (step, index, p, shape) of every mask drawn
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0
        self._id = next(_IDS)  # its number in compiled graphs (dropout_mask)
        _CONTROLS[self._id] = weakref.ref(self)
        # the patched functions, made once: a compiled graph guards on their identity
        self._wrappers = [self._wrap(name, getattr(owner, name)) for name, owner in self._PATCHED]

    def set_step(self, step: int) -> None:
        self.step = step
        self.index = 0

    def _mask(self, shape: torch.Size, p: float, like: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Inside a graph Dynamo traces: the same mask, drawn when the graph runs by an op
            # the graph keeps in order (the generator and the call index are Python state).
            return torch.ops.driftcheck.dropout_mask(like.detach(), list(shape), p, self._id)
        return self._mask_eager(shape, p, like)

    def _mask_eager(self, shape: torch.Size, p: float, like: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.step * 10_007 + self.index) % 2**63)
        self.index += 1
        if self.part is not None and len(shape) >= 1:
            rank, world = self.part
            whole = torch.rand([shape[0] * world, *shape[1:]], generator=g)
            keep = whole[rank * shape[0]:(rank + 1) * shape[0]] >= p
        else:
            keep = torch.rand(shape, generator=g) >= p
        self.masks.append({"step": self.step, "index": self.index - 1, "p": p, "shape": list(shape)})
        # noise = mask / (1 - p), as PyTorch's native dropout scales it, in the input's dtype.
        return (keep.to(like.dtype) / (1.0 - p) if p < 1 else keep.to(like.dtype)).to(like.device)

    def __enter__(self) -> DropoutControl:
        self._depth += 1
        if self._depth == 1:
            for (name, owner), patched in zip(self._PATCHED, self._wrappers):
                self._saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, patched)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            while self._saved:
                owner, name, original = self._saved.pop()
                setattr(owner, name, original)

    def _wrap(self, name: str, func: Any) -> Any:
        feature = {"dropout1d": 1, "dropout2d": 2, "dropout3d": 3}.get(name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            if name == "scaled_dot_product_attention":
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if p and p > 0.0:
                    return self._sdpa_with_mask(*args, **kwargs)
                return func(*args, **kwargs)
            x, p, training, inplace = _dropout_args(func, args, kwargs)
            if not training or p == 0.0 or not isinstance(x, torch.Tensor):
                return func(*args, **kwargs)
            shape = torch.Size(list(x.shape[:-feature]) + [1] * feature) if feature else x.shape
            noise = self._mask(shape, p, x)
            return x.mul_(noise) if inplace else x * noise

        patched.__wrapped__ = func  # type: ignore[attr-defined]
        return patched

    def _sdpa_with_mask(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                        scale=None, enable_gqa=False):
        # The math path of SDPA, with our mask on the attention probabilities.
        L, S = query.size(-2), key.size(-2)
        scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
        if enable_gqa:
            rep = query.size(-3) // key.size(-3)
            key = key.repeat_interleave(rep, -3)
            value = value.repeat_interleave(rep, -3)
        scores = query @ key.transpose(-2, -1) * scale
        if is_causal:
            causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        probs = torch.softmax(scores, dim=-1)
        probs = probs * self._mask(probs.shape, dropout_p, probs)
        return probs @ value


_TORCH_DROPOUT = torch.dropout
_CONTROLS: dict[int, Any] = {}  # DropoutControl number -> the control (weakly)
_IDS = itertools.count(1)


@torch.library.custom_op("driftcheck::dropout_mask", mutates_args=())
def dropout_mask(like: torch.Tensor, shape: list[int], p: float, control: int) -> torch.Tensor:
    """A compiled graph's dropout noise: ``DropoutControl._mask`` when the graph runs (an
    ordered effect: never merged with another call's, never reordered)."""
    ref = _CONTROLS.get(control)
    owner = ref() if ref is not None else None
    if owner is None:
        raise RuntimeError("driftcheck::dropout_mask ran after its DropoutControl was dropped")
    return owner._mask_eager(torch.Size(shape), p, like)


@dropout_mask.register_fake
def _dropout_mask_fake(like: torch.Tensor, shape: list[int], p: float, control: int) -> torch.Tensor:
    return like.new_empty(shape)


torch.library._register_effectful_op(torch.ops.driftcheck.dropout_mask.default,
                                     torch.library.EffectType.ORDERED)


def _dropout_args(func, args, kwargs):
    names = ("input", "p", "training", "inplace")
    vals = dict(zip(names, args))
    vals.update({k: v for k, v in kwargs.items() if k in names})
    if func is _TORCH_DROPOUT:  # torch.dropout(input, p, train)
        vals.setdefault("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return vals.get("input"), float(vals.get("p", 0.5)), bool(vals.get("training", True)), \
        bool(vals.get("inplace", False))

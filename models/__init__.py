"""Built-in reference models: tiny, seeded, CPU float32 training scenarios, one file each.

Each module ``driftcheck.models.<name>`` exposes ``build(seed: int = 0) -> driftcheck.Scenario``.
Two builds with the same seed are bitwise identical (weights and inputs); inputs are synthetic,
nothing is downloaded. Every batch is a dict ``{"x" or "idx": inputs, "targets": labels}``: the
model is called as ``model(**batch)`` and the loss reads ``batch["targets"]``.

This file imports nothing heavy: torch is imported only when a model is built, so listing the
built-ins (``driftcheck models``) never loads torch or a device plugin.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from driftcheck.errors import DriftcheckError

if TYPE_CHECKING:
    from driftcheck.scenario import Scenario

BUILTINS: dict[str, str] = {
    "mlp": "3-layer MLP classifier with GELU/ReLU and Dropout; cross-entropy, SGD momentum",
    "resnet": "ResNet-style conv net, 2 BasicBlocks with BatchNorm + in-place ReLU; SGD momentum",
    "llama": "2-layer Llama decoder: RMSNorm, RoPE, GQA (4q/2kv heads), SwiGLU, tied head; AdamW",
    "vit": "2-layer ViT: conv patch embedding, class token, pre-norm attention + GELU MLP; AdamW",
}


def load(name: str, seed: int = 0) -> Scenario:
    """Build the built-in scenario ``name`` with ``seed``.

    Args:
        name: a key of ``BUILTINS`` (``"mlp"``, ``"resnet"``, ``"llama"``, ``"vit"``).
        seed: seeds weights, inputs and targets; equal seeds give bitwise-identical scenarios.

    Returns:
        The ``Scenario``, on CPU in float32, with its ``name`` set.

    Raises:
        DriftcheckError: ``name`` is not a built-in.

    Example:
        >>> scenario = load("llama", seed=0)
        >>> scenario.steps
        2
    """
    if name not in BUILTINS:
        known = ", ".join(sorted(BUILTINS))
        raise DriftcheckError(
            f"unknown built-in model {name!r}: choose one of {known} "
            "(or pass path/to/file.py:build, package.module:build or hf:<family>)"
        )
    module = importlib.import_module(f"{__name__}.{name}")
    scenario = module.build(seed)
    scenario.name = scenario.name or name
    return scenario


__all__ = ["BUILTINS", "load"]

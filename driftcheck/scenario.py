"""A Scenario: the model, inputs, loss and optimizer of one recordable training run.

``build()`` functions (built-in models, user files, Hugging Face families) return one, made on
CPU in float32; the runner moves and casts everything to the device and dtype being recorded.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported only once the device is known (torch_tpu autoload)
    import torch
    from torch import nn


@dataclasses.dataclass
class Scenario:
    """One training run driftcheck can record.

    Args:
        model: the ``nn.Module``, on CPU, float32.
        inputs: a tensor (``model(x)``), a tuple of positional args (``model(*args)``), a dict of
            keyword args (``model(**kwargs)``), or a list of such per-step batches (step ``i``
            uses ``inputs[i % len(inputs)]``). Non-tensor leaves (ints, None, strings) are kept.
        loss: ``loss(output, batch) -> scalar tensor``; optional (inference-only records).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; optional.
        steps: number of training steps to record.
        name: a display name (set by the loader when empty).
        tp_plan: the tensor-parallel plan of ``driftcheck record --parallel tp``: {module path
            (``*`` matches one component): "colwise" | "rowwise" | "colwise_rep" or a
            ``ParallelStyle``} (record/tensor_parallel.py); None: the model's ``tp_plan``, if any.

    Example:
        >>> def build():
        ...     model = torch.nn.Linear(4, 2)
        ...     return Scenario(model=model, inputs=torch.randn(8, 4),
        ...                     loss=lambda out, x: out.pow(2).mean(),
        ...                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    """

    model: nn.Module
    inputs: Any
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    steps: int = 1
    name: str = ""
    tp_plan: dict[str, Any] | None = None

    def batch(self, step: int) -> Any:
        """The inputs of ``step`` (a tensor, tuple or dict)."""
        if isinstance(self.inputs, list):
            if not self.inputs:
                raise ValueError("Scenario.inputs is an empty list")
            return self.inputs[step % len(self.inputs)]
        return self.inputs


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on one batch following the Scenario input convention."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)

"""A Hugging Face ``Trainer`` traced by a callback, and replayed on another device.

    from driftcheck.integrations.transformers import DriftcheckCallback

    # the reference (CPU or CUDA): traces the first 2 optimizer steps into ref/
    Trainer(model, args, train_dataset=ds, callbacks=[DriftcheckCallback("ref", steps=2)]).train()
    # the target (any device, bf16=True or not): starts from ref's weights, feeds the model
    # ref's batches in ref's order, and traces the same steps into tgt/
    Trainer(model, args, train_dataset=ds, callbacks=[DriftcheckCallback("tgt", replay="ref")]).train()
    # then: driftcheck compare ref tgt

A step is one optimizer update: under gradient accumulation its model calls are the micro-batches
(calls 0..k-1 of every module), its gradients the accumulated ones. The replayed inputs are what
the model is called with (``model(**inputs)`` in ``compute_loss``, ``num_items_in_batch``
included), so the target's own data loader, shuffling and collation do not matter, but labels a
custom ``compute_loss`` keeps outside the model call are the target's own. The step's loss is the
model's ``loss`` output as the Trainer backpropagates it (divided by the number of micro-batches
unless the model normalises by ``num_items_in_batch``), summed over the micro-batches; a
``compute_loss`` that computes the loss itself passes it to :meth:`DriftcheckCallback.record_loss`.
``bf16=True`` / ``fp16=True`` are recorded as the run's autocast, ``max_grad_norm`` as
``grad_clip`` (the optimizer state inherits the clip factor's error). The gradients of the model's
returned outputs are not captured (on either side): under mixed precision accelerate returns
fp32 copies of them that a loss computed inside the model never uses, so only one side would
have them; the last layer's output gradient (``lm_head``'s) is captured as usual. Under torchrun every rank
writes ``OUT/rank-<r>``. Training goes on untraced after the last traced step (``stop=True``
ends it there). A ``train()`` that raises mid-step leaves a trace that never passes as complete;
``callback.session.abort(reason)`` in an ``except`` also undoes the step's patches (dropout,
the logit watch) when the process goes on.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from driftcheck.errors import DriftcheckError
from driftcheck.integrations.session import SessionCallback

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - needs an environment without it
    raise ImportError("driftcheck.integrations.transformers needs transformers and accelerate: "
                      "pip install transformers accelerate") from e

DRIVER = "transformers.Trainer"


class DriftcheckCallback(SessionCallback, TrainerCallback):
    """Trace a ``Trainer`` run; with ``replay=REF``, replay the reference's weights and batches.

    Arguments: :class:`driftcheck.integrations.session.SessionCallback`.
    """

    DRIVER = DRIVER
    # the model's returned outputs get no gradient capture (module docstring)
    SESSION_OPTIONS: ClassVar[dict[str, Any]] = {"root_output_grads": False}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handles: list[Any] = []
        self._losses: list[torch.Tensor] = []  # as backpropagated (record_loss)
        self._model_losses: list[tuple[torch.Tensor, bool]] = []  # (model's loss, normalised)

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss of one micro-batch as backpropagated, for a ``compute_loss`` that computes it
        outside the model (the model's own ``loss`` output is recorded without this)."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().float().reshape(()))

    # -- TrainerCallback ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise DriftcheckError("DriftcheckCallback: the Trainer passed no model to on_train_begin")
        self.session.autocast = "bf16" if getattr(args, "bf16", False) else \
            "fp16" if getattr(args, "fp16", False) else None
        self.session.model_id = _model_id(model)
        clip = float(getattr(args, "max_grad_norm", 0) or 0)
        self.session.grad_clip = {"norm": clip} if clip > 0 else None
        if getattr(args, "torch_compile", False):  # accelerate compiles the model it prepares
            self.session.tracer_kwargs["compiled"] = True
        self.session.start(model, _torch_optimizer(optimizer))
        root = self.session.model
        # Eager code around a compiled model's graph (accelerate's torch.compile): never a frame
        # Dynamo compiles (the session's state would be guards, each step a recompilation).
        self._handles = [
            root.register_forward_pre_hook(torch._dynamo.disable(self._on_call), with_kwargs=True,
                                           prepend=True),
            root.register_forward_hook(torch._dynamo.disable(self._on_output), with_kwargs=True),
        ]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._losses, self._model_losses = [], []
        self.session.step_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session.done:
            return
        calls = len(self._model_losses)
        for loss, normalised in self._model_losses:
            # What the Trainer backpropagates: the model's loss normalised by num_items_in_batch,
            # or divided by the number of micro-batches of the step.
            session.add_loss(loss if normalised else loss / calls)
        for loss in self._losses:
            session.add_loss(loss)
        session.step_end()
        if session.done:
            self._remove_hooks()
            if self.stop:
                control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hooks()
        self.session.finish()

    # -- hooks on the model -----------------------------------------------------------------------
    def _on_call(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not module.training:
            return None
        return self.session.model_call(args, kwargs)

    def _on_output(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not module.training:
            return
        loss = output.get("loss") if hasattr(output, "get") else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._model_losses.append((loss.detach().float().reshape(()),
                                       kwargs.get("num_items_in_batch") is not None))

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's AcceleratedOptimizer (an Optimizer subclass that
    holds neither the state nor the step hooks itself)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _model_id(model: Any) -> str:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None) or type(model).__name__
    params = sum(p.numel() for p in model.parameters())
    return f"{kind} ({params} parameters, {DRIVER})"

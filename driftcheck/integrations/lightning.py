"""A Lightning ``Trainer`` traced by a callback, and replayed on another device.

    from driftcheck.integrations.lightning import DriftcheckCallback

    L.Trainer(max_steps=4, callbacks=[DriftcheckCallback("ref", steps=2)]).fit(module, loader)
    L.Trainer(max_steps=4, precision="bf16-mixed",
              callbacks=[DriftcheckCallback("tgt", replay="ref")]).fit(module, loader)
    # then: driftcheck compare ref tgt

The LightningModule is traced (module paths are its ``named_modules()``). A step is one optimizer
update: with ``accumulate_grad_batches=k`` its k batches are calls 0..k-1 of every module. The
replayed input is the batch ``training_step`` receives (after the transfer to the device), so
the target's own data loader does not matter; a replaying target also starts from the reference's
weights. The step's loss is what Lightning backpropagates (``on_before_backward``), summed over
the step's batches. ``precision="bf16-mixed"`` / ``"16-mixed"`` are recorded as the run's
autocast; ``"bf16-true"`` as its dtype; ``gradient_clip_val`` as ``grad_clip``. One optimizer is
traced (``configure_optimizers`` may return one). Under ``strategy="ddp"`` / FSDP every rank writes ``OUT/rank-<r>``.
"""
from __future__ import annotations

from typing import Any

from driftcheck.errors import DriftcheckError
from driftcheck.integrations.session import SessionCallback

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package ships the same Callback
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]  # the same class
    except ImportError as e:  # pragma: no cover - needs an environment without it
        raise ImportError("driftcheck.integrations.lightning needs Lightning: pip install lightning") from e

DRIVER = "lightning.Trainer"
_AUTOCAST = {"bf16-mixed": "bf16", "16-mixed": "fp16", "bf16": "bf16", "16": "fp16"}


class DriftcheckCallback(SessionCallback, Callback):
    """Trace a Lightning ``fit``; with ``replay=REF``, replay the reference's weights and batches.

    Arguments: :class:`driftcheck.integrations.session.SessionCallback`.
    """

    DRIVER = DRIVER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module: Any = None
        self._step_from: int | None = None  # trainer.global_step when the open step began

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if len(optimizers) > 1:
            raise DriftcheckError(f"DriftcheckCallback traces one optimizer; this LightningModule "
                                  f"configures {len(optimizers)}")
        precision = str(getattr(trainer, "precision", "32-true"))
        params = sum(p.numel() for p in pl_module.parameters())
        self.session.autocast = _AUTOCAST.get(precision)
        self.session.model_id = f"{type(pl_module).__name__} ({params} parameters, {DRIVER})"
        clip = getattr(trainer, "gradient_clip_val", None)
        if clip:
            how = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").split(".")[-1].lower()
            self.session.grad_clip = {"value" if how == "value" else "norm": float(clip)}
        self.session.start(pl_module, optimizers[0] if optimizers else None)
        self._module = pl_module
        original = pl_module.training_step
        session = self.session

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            (batch,), _ = session.model_call((batch,), {})
            return original(batch, *args, **kwargs)

        training_step.__wrapped__ = original  # type: ignore[attr-defined]
        pl_module.training_step = training_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.session.done and self._step_from is None:
            self._step_from = trainer.global_step
            self.session.step_begin()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.session.add_loss(loss)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.session
        if session.done or self._step_from is None:
            return
        if trainer.global_step == self._step_from:
            return  # an accumulation step: the optimizer has not stepped yet
        self._step_from = None
        session.step_end()
        if session.done:
            self._restore()
            if self.stop:
                trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore()
        self.session.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore()
        if not self.session.done:
            self.session.abort(f"{type(exception).__name__}: {exception}")

    def _restore(self) -> None:
        if self._module is not None and "training_step" in self._module.__dict__:
            del self._module.training_step
        self._module = None

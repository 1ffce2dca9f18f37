"""Host syncs the training loop makes through ``LightningModule.log``, and how to drop them.

On a GPU every read of a device value on the host (``.item()``) and every blocking copy to the
device (``torch.tensor(x, device="cuda")``) waits until the device has run everything queued
before it; the device then idles while the host does the Python work up to its next kernel.
Two such waits come with every NeMo training step on Lightning 2.4:

- a Python number logged (NeMo's ``lr``, at the start of each step) becomes a tensor on the
  module's device: a blocking copy;
- every metric logged with ``prog_bar=True`` is converted to a Python number at the end of
  every training step, whether or not a progress bar shows it; NeMo logs five that way
  (``reduced_train_loss``, ``global_step``, ``consumed_samples``, ``global_batch_size``,
  ``lr``), and the first read waits for the whole step, optimizer included.

:class:`SyncFreeLogging` keeps logged Python numbers on the host and, when the trainer has no
progress bar, logs without ``prog_bar``: the loggers, ``trainer.callback_metrics`` and every
callback still get each value, and the host can queue the next step while the device runs this
one's optimizer. It also gives a NeMo GPT model :class:`SyncFreeTokenLossReduction`: NeMo's
reduction of the step's loss for logging reads each microbatch's token count on the host, right
after the backward is queued, so the host waits for the whole backward before it can queue the
optimizer's work. :class:`SyncFreeGradClip` makes megatron's optimizer clip its gradients on
the device (``nemo_gtp.integrations.megatron.grad_clip``): megatron reads the grad norm on the
host to decide whether to clip, a wait for the whole backward. GTP adds no host read of its own
to a step (``tests/test_strategy.py``).

Example::

    callbacks = [SyncFreeLogging(), SyncFreeGradClip()]
    trainer = nl.Trainer(..., enable_progress_bar=False, callbacks=callbacks)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

from nemo_gtp.integrations.megatron.grad_clip import clip_grads_on_device


class SyncFreeTokenLossReduction(MaskedTokenLossReduction):
    """NeMo's ``MaskedTokenLossReduction`` whose ``reduce`` (the step's loss for logging) reads
    nothing on the host: NeMo drops the microbatches without a valid token with a host read per
    microbatch; here their rows are zeroed on the device. Losses and gradients are NeMo's (its
    ``forward``); the reduced loss is NeMo's bit for bit when every microbatch has a token, and
    the same sum in another order otherwise.

    Example: ``model._training_loss_reduction = SyncFreeTokenLossReduction()`` (NeMo's way of
    giving a model its reduction; :class:`SyncFreeLogging` does it).
    """

    def reduce(self, losses_reduced_per_micro_batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        if not losses_reduced_per_micro_batch or "avg" in losses_reduced_per_micro_batch[0]:
            return super().reduce(losses_reduced_per_micro_batch)
        from megatron.core import parallel_state

        rows = torch.vstack([x["loss_sum_and_ub_size"] for x in losses_reduced_per_micro_batch])
        loss = torch.where(rows[:, 1:] > 0, rows, torch.zeros_like(rows)).sum(dim=0)
        torch.distributed.all_reduce(
            loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        return loss[0] / loss[1]  # over the global batch's tokens, as NeMo's


class _UndoneAfterTheFit(pl.Callback):
    """A callback whose changes last for one fit: the undo functions it collects run at the
    fit's end, or when it fails."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def _restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._restore()


class SyncFreeLogging(_UndoneAfterTheFit):
    """For the fit, the module's ``log`` keeps Python numbers on the host (a CPU tensor, no
    copy to the device; not those reduced across ranks, ``sync_dist``) and, without a progress
    bar, drops ``prog_bar``; a NeMo GPT model with NeMo's own training loss reduction gets
    :class:`SyncFreeTokenLossReduction` (see the module docstring). The YAML recipes add it.

    Example: ``nl.Trainer(..., enable_progress_bar=False, callbacks=[SyncFreeLogging()])``.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # NeMo's own reduction only: a model's other reduction (a user's, NeMo's VLMs') stays
        reduction = getattr(pl_module, "_training_loss_reduction", False)
        if reduction is None or type(reduction) is MaskedTokenLossReduction:
            pl_module._training_loss_reduction = SyncFreeTokenLossReduction()
        if "log" in vars(pl_module):  # wrapped already (a second callback, or a user's own)
            return
        log, off_the_bar = pl_module.log, trainer.progress_bar_callback is None

        def sync_free_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            # a value reduced across ranks (sync_dist) must live where the collective runs
            sync_dist = kwargs.get("sync_dist") or (len(args) > 6 and args[6])
            if isinstance(value, (int, float)) and not sync_dist:
                value = torch.tensor(value, dtype=torch.get_default_dtype())
            if off_the_bar and args:  # prog_bar is log's first parameter after the value
                args = (False, *args[1:])
            elif off_the_bar:
                kwargs["prog_bar"] = False
            log(name, value, *args, **kwargs)

        def restore() -> None:
            del pl_module.log  # the class's method again

        pl_module.log = sync_free_log  # type: ignore[method-assign]
        self._undo.append(restore)


class SyncFreeGradClip(_UndoneAfterTheFit):
    """For the fit, megatron's optimizers (behind NeMo's ``McoreDistributedOptimizer``) clip
    their gradients on the device: the same gradients bit for bit, the grad norm a device
    tensor, no host read in the step (``clip_grads_on_device``). The YAML recipes add it.

    Example: ``nl.Trainer(..., callbacks=[SyncFreeGradClip()])``.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            megatron_optimizer = getattr(optimizer, "mcore_optimizer", None)
            if megatron_optimizer is not None:
                self._undo.append(clip_grads_on_device(megatron_optimizer))

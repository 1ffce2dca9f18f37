"""NeMo's PEFT checkpoints (``llm.finetune(..., peft=...)``) under ``GTPMegatronStrategy``.

NeMo's ``PEFT.setup`` callback replaces the strategy's checkpoint IO with its
``WrappedAdapterIO`` over a plain ``MegatronCheckpointIO``: saves keep only the adapter weights
(and their optimizer state), and ``weights/adapter_metadata.json`` names the base checkpoint a
resume loads first. Under GTP that IO would drop GTP's atomic commit (design §3.3 "Atomic
commit"), and with NeMo's default asynchronous save its metadata file would land in a
``weights/`` that the commit then replaces: the resume would take the adapter checkpoint for a
whole model. :func:`install_gtp_adapter_io` puts GTP's IO back beneath PEFT's:
:class:`GTPAdapterIO` filters as NeMo's does and hands the metadata to
:class:`~nemo_gtp.strategy.checkpoint_io.GTPCheckpointIO`, which writes it into the staged
directory, so the adapter weights and their metadata are committed together or not at all.
Loading (base weights, then adapters) is NeMo's own, unchanged. :func:`set_peft` sets the
method up on a model as ``llm.finetune`` does, its IO record included, so a checkpoint's
``context/`` names the adapters that NeMo's ``llm.peft.merge_lora`` / ``export_lora`` rebuild.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nemo.lightning.ckpt_utils import ADAPTER_META_FILENAME
from nemo.lightning.pytorch.callbacks.peft import WrappedAdapterIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO


class GTPAdapterIO(WrappedAdapterIO):
    """NeMo's ``WrappedAdapterIO`` whose adapter metadata is committed with the weights.

    The wrapped IO must be a :class:`~nemo_gtp.strategy.checkpoint_io.GTPCheckpointIO` (it takes
    ``extra_files``). Example::

        io = GTPAdapterIO(GTPCheckpointIO(lambda: groups), peft=lora)
        io.save_checkpoint(checkpoint, "ckpts/step=9")   # weights/ with adapter_metadata.json
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> Any:
        """Keep the adapter entries of the model state (as NeMo does), then save and commit
        them with ``adapter_metadata.json`` (the base checkpoint's path) beside them."""
        key = "sharded_state_dict" if "sharded_state_dict" in checkpoint else "state_dict"
        state = checkpoint.pop(key)
        checkpoint[key] = {k: v for k, v in state.items() if self.peft.adapter_key_filter(k)}
        metadata = json.dumps({"model_ckpt_path": str(self.model_ckpt_path)})
        return self.checkpoint_io.save_checkpoint(
            checkpoint,
            path,
            storage_options=storage_options,
            extra_files={ADAPTER_META_FILENAME: metadata},
        )


def install_gtp_adapter_io(strategy: Any, make_io: Callable[[], Any]) -> bool:
    """Replace the ``WrappedAdapterIO`` NeMo's ``PEFT.setup`` installed on ``strategy`` by a
    :class:`GTPAdapterIO` over ``make_io()`` (a new ``GTPCheckpointIO``), asynchronous when
    NeMo's was; the PEFT callback is pointed at it. Returns whether anything was replaced
    (False without PEFT, or when already done). Call before the strategy's setup loads a
    checkpoint. Example::

        install_gtp_adapter_io(strategy, strategy.gtp_checkpoint_io)
    """
    current = strategy._checkpoint_io
    asynchronous = isinstance(current, AsyncFinalizableCheckpointIO)
    adapter_io = current.checkpoint_io if asynchronous else current
    if type(adapter_io) is not WrappedAdapterIO:
        return False
    peft = adapter_io.peft
    replacement = GTPAdapterIO(make_io(), peft=peft)
    replacement.model_ckpt_path = adapter_io.model_ckpt_path
    replacement.adapter_ckpt_path = adapter_io.adapter_ckpt_path
    strategy._checkpoint_io = (
        AsyncFinalizableCheckpointIO(replacement) if asynchronous else replacement
    )
    peft.wrapped_io = replacement  # PEFT.apply_transform loads the adapters through it
    return True


def set_peft(model: Any, peft: Any) -> Any:
    """Make NeMo PEFT method ``peft`` (e.g. ``llm.peft.LoRA()``) ``model``'s transform as
    ``llm.finetune`` does: the attribute, and the model's IO record when both have one, which a
    checkpoint's ``context/`` serializes (NeMo's ``llm.peft.merge_lora`` and ``export_lora``
    read the adapters' settings from it and refuse a checkpoint without them). Returns ``peft``,
    the callback the trainer needs too. Example::

        trainer = nl.Trainer(..., callbacks=[set_peft(model, llm.peft.LoRA(dim=8))])
    """
    from nemo.collections.llm.api import _set_with_io  # what llm.finetune calls

    _set_with_io(model, "model_transform", peft)
    return peft

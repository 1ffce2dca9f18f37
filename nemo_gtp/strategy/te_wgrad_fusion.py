"""A Lightning callback: TE's fused wgrad accumulation on a NeMo run without apex.

The GPU recipes add it (``callbacks.te_wgrad_fusion``) to GTP runs and to their baselines alike,
so a GTP weight (whose TE wgrad GEMM always writes GTP's scratch) is not compared with a
baseline that pays an unfused add per weight. See
:mod:`nemo_gtp.integrations.megatron.te_wgrad_fusion` for why megatron leaves it off.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch

from nemo_gtp.integrations.megatron.te_wgrad_fusion import fuse_te_wgrad_accumulation

_log = logging.getLogger(__name__)


class TEWgradFusion(pl.Callback):
    """At the start of training, switch on TE's ``fuse_wgrad_accumulation`` for every TE
    linear whose weights megatron's DDP gives a ``main_grad`` (:func:`fuse_te_wgrad_accumulation`):
    what ``gradient_accumulation_fusion=True`` does for TE modules, without the apex extension
    megatron's own output layer needs for it. Works with NeMo's ``MegatronStrategy`` and with
    ``GTPMegatronStrategy`` at any GTP size; a no-op under Megatron-FSDP (NeMo turns the fusion
    off there). :attr:`fused` names the modules switched (none under GTP when every TE linear is
    a GTP shard: GTP fuses those itself).

    Example::

        trainer = nl.Trainer(..., strategy=GTPMegatronStrategy(num_weight_shards=2),
                             callbacks=[TEWgradFusion()])

    or in a recipe: ``callbacks: {te_wgrad_fusion: {target: nemo_gtp.strategy.TEWgradFusion}}``.
    """

    def __init__(self) -> None:
        self.fused: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After DDP has given the weights their main_grad, before the first backward and before
        # any CUDA graph is captured (TE reads the flag at each forward).
        ddp_config = getattr(trainer.strategy, "ddp_config", None)
        if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(
            ddp_config, "use_custom_fsdp", False
        ):
            _log.warning("TEWgradFusion: Megatron-FSDP owns the gradients; nothing fused")
            return
        model = trainer.strategy.model
        model = model if isinstance(model, torch.nn.Module) else pl_module
        self.fused = fuse_te_wgrad_accumulation(model)
        if self.fused:
            _log.info("TEWgradFusion: TE's fused wgrad accumulation on %d modules", len(self.fused))
        elif not any(getattr(m, "fuse_wgrad_accumulation", False) for m in model.modules()):
            _log.warning(
                "TEWgradFusion: no TE module whose weights have megatron DDP's main_grad (the "
                "local layer spec, or no megatron DDP): nothing fused"
            )

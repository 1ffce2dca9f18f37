"""Muon through NeMo: a ``MegatronOptimizerModule`` whose optimizer is Muon + Adam (design §1.6).

``MuonOptimizerModule`` is NeMo's ``MegatronOptimizerModule`` (same ``OptimizerConfig``, lr
scheduler, weight-decay and lr multipliers, checkpoints) with the optimizer built by
:func:`~nemo_gtp.integrations.megatron.muon.get_muon_optimizer`: Muon for the hidden matrices,
megatron's Adam for embeddings, output layer, norms and biases. It runs under
``GTPMegatronStrategy`` (each sharded matrix orthogonalized whole by one GTP peer, state 1/GTP
per rank) and under NeMo's
plain ``MegatronStrategy`` (the baseline: the same optimizer without GTP).

NeMo builds the optimizer through ``megatron.core.optimizer.get_megatron_optimizer``, looked up
at call time; for the duration of :meth:`MuonOptimizerModule.optimizers` that name builds the
Muon optimizer instead, with the GTP process groups the strategy's builder carries
(:func:`~nemo_gtp.strategy.optimizer.megatron_optimizer_pg_collection`).

Example::

    optim = MuonOptimizerModule(
        OptimizerConfig(lr=2e-2, bf16=True, use_distributed_optimizer=False, clip_grad=1.0),
        muon=MuonConfig(adjust_lr_fn="match_rms_adamw"),
    )
    model = llm.GPTModel(config, tokenizer=tokenizer, optim=optim)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import megatron.core.optimizer as mcore_optimizer
from megatron.core.optimizer import OptimizerConfig
from nemo.lightning.pytorch.optim import MegatronOptimizerModule
from nemo.lightning.pytorch.optim.base import LRSchedulerModule

from nemo_gtp.integrations.megatron.muon import MuonConfig, check_muon_config, get_muon_optimizer


class MuonOptimizerModule(MegatronOptimizerModule):
    """NeMo's megatron optimizer module with Muon for the hidden matrices (module docstring).

    ``config.use_distributed_optimizer`` must be False (checked here, before any process group
    exists); ``config.optimizer`` names what the non-Muon params use (``"adam"``; ``"muon"``
    is read as ``"adam"``, upstream megatron's spelling of the same split).

    Example::

        optim = MuonOptimizerModule(OptimizerConfig(lr=2e-2, use_distributed_optimizer=False))
    """

    def __init__(
        self,
        config: OptimizerConfig,
        lr_scheduler: LRSchedulerModule | None = None,
        muon: MuonConfig | None = None,
        no_weight_decay_cond: Callable | None = None,
        scale_lr_cond: Callable | None = None,
        lr_mult: float = 1.0,
    ) -> None:
        if config.optimizer not in ("adam", "muon"):
            raise ValueError(
                f"MuonOptimizerModule: OptimizerConfig.optimizer={config.optimizer!r}; the "
                "params Muon does not take use Adam: set it to 'adam' (or 'muon')"
            )
        check_muon_config(config)
        super().__init__(config, lr_scheduler, no_weight_decay_cond, scale_lr_cond, lr_mult)
        self.muon = muon or MuonConfig()

    def optimizers(self, model: Any) -> list[Any]:
        """NeMo's optimizer setup, building Muon + Adam (see the module docstring)."""
        current = mcore_optimizer.get_megatron_optimizer
        pg_collection = getattr(current, "gtp_pg_collection", None)  # set under GTP
        muon = self.muon

        def build(config: OptimizerConfig, model_chunks: list[Any], **kwargs: Any) -> Any:
            kwargs.pop("pg_collection", None)
            return get_muon_optimizer(
                config, model_chunks, muon, pg_collection=pg_collection, **kwargs
            )

        mcore_optimizer.get_megatron_optimizer = build
        try:
            return super().optimizers(model)
        finally:
            mcore_optimizer.get_megatron_optimizer = current

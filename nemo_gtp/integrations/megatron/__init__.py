"""megatron-core integration: process groups, model transform, DDP routing, finalize grads.

The touch points of design §3.1 and §3.2, on megatron-core 0.15 which has no GTP:

- :func:`initialize_gtp_parallel` / :func:`gtp_process_groups`: megatron's ``parallel_state``
  plus our GTP groups, and the ``ProcessGroupCollection`` DDP and the optimizer must use
  (data-parallel = the GTP-excluded replicate group; model-parallel includes GTP).
- :func:`shard_model`: shards eligible linears in place and returns the model's runtime;
  :func:`gtp_layer_spec` makes a layer spec build its parallel linears (TE or local, and the
  routed experts of ``SequentialMLP`` and ``TEGroupedMLP``) as shards
  (both in :mod:`~nemo_gtp.integrations.megatron.sharding`);
  :func:`mirror_per_token_loss` pairs a ``GTPConfig`` with a model config.
- :class:`GTPDistributedDataParallel`: grad-ready hooks of GTP params fired by the runtime.
- :func:`make_finalize_model_grads`: drains GTP reduce-scatters, runs megatron's finalize, then
  completes the GTP axis for replicated params.
- :func:`full_state_dict`: the model's state dict as a run without GTP has it (GTP shards
  all-gathered and unpadded).
"""

from nemo_gtp.integrations.megatron.checkpoint import (
    gtp_sharded_state_dict,
    load_gtp_checkpoint,
    make_gtp_sharded_state_dict,
    save_gtp_checkpoint,
)
from nemo_gtp.integrations.megatron.ddp import GTPDDPMixin, GTPDistributedDataParallel
from nemo_gtp.integrations.megatron.export import full_state_dict, unwrapped_module
from nemo_gtp.integrations.megatron.finalize import (
    allreduce_replicated_grads,
    make_finalize_model_grads,
)
from nemo_gtp.integrations.megatron.model_config import (
    mirror_per_token_loss,
    validate_model_config_for_gtp,
)
from nemo_gtp.integrations.megatron.optimizer_copies import plan_optimizer_copies
from nemo_gtp.integrations.megatron.parallel import (
    gtp_process_groups,
    initialize_gtp_parallel,
)
from nemo_gtp.integrations.megatron.sharding import (
    GTPShardPlan,
    default_should_shard,
    gtp_layer_spec,
    preshard_config_layer_spec,
    presharded_class,
    presharded_classes,
    presharded_expert_classes,
    presharded_grouped_class,
    presharded_grouped_classes,
    replace_modules_in_spec,
    shard_model,
)

__all__ = [
    "GTPDDPMixin",
    "GTPDistributedDataParallel",
    "GTPShardPlan",
    "allreduce_replicated_grads",
    "default_should_shard",
    "full_state_dict",
    "gtp_layer_spec",
    "gtp_process_groups",
    "gtp_sharded_state_dict",
    "initialize_gtp_parallel",
    "load_gtp_checkpoint",
    "make_finalize_model_grads",
    "make_gtp_sharded_state_dict",
    "mirror_per_token_loss",
    "plan_optimizer_copies",
    "preshard_config_layer_spec",
    "presharded_class",
    "presharded_classes",
    "presharded_expert_classes",
    "presharded_grouped_class",
    "presharded_grouped_classes",
    "replace_modules_in_spec",
    "save_gtp_checkpoint",
    "shard_model",
    "unwrapped_module",
    "validate_model_config_for_gtp",
]

"""Make a megatron-core model's linears GTP shards (design §1.5, §3.1): one package, two paths.

=====================  =========================================================================
module                 what
=====================  =========================================================================
``sliced``             :func:`shard_model`, the entry point for a built model: slices linears
                       built full, registers linears built as shards, one runtime per model
``built``              linears built as their shard: the pre-sharding mixin
                       (:func:`presharded_class`), :class:`GTPShardPlan`, per-GTP-peer init
``spec``               the layer-spec rewrite that selects the ``built`` classes
                       (:func:`gtp_layer_spec`, :func:`preshard_config_layer_spec`)
``te``                 TransformerEngine specifics (which wrappers opt in, grad-mode hook,
                       ``LayerNormMLP`` warning); TE is imported lazily
=====================  =========================================================================

Example (megatron-core directly; ``gtp_config`` the same in both calls)::

    spec = gtp_layer_spec(get_gpt_layer_with_transformer_engine_spec(), groups, gtp_config)
    model = GPTModel(config, spec, vocab_size, max_seq)
    runtime = shard_model(model, groups, gtp_config)
"""

from nemo_gtp.integrations.megatron.sharding.built import (
    GTPShardPlan,
    PreShardedLinearMixin,
    is_presharded,
    presharded_class,
)
from nemo_gtp.integrations.megatron.sharding.sliced import default_should_shard, shard_model
from nemo_gtp.integrations.megatron.sharding.spec import (
    gtp_layer_spec,
    preshard_config_layer_spec,
    presharded_classes,
    replace_modules_in_spec,
)
from nemo_gtp.integrations.megatron.sharding.te import (
    te_parallel_linear_kinds,
    warn_unsharded_te_modules,
)

__all__ = [
    "GTPShardPlan",
    "PreShardedLinearMixin",
    "default_should_shard",
    "gtp_layer_spec",
    "is_presharded",
    "preshard_config_layer_spec",
    "presharded_class",
    "presharded_classes",
    "replace_modules_in_spec",
    "shard_model",
    "te_parallel_linear_kinds",
    "warn_unsharded_te_modules",
]

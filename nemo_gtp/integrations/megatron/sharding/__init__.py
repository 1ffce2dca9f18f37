"""Make a megatron-core model's linears GTP shards (design §1.5, §3.1): one package, two paths.

=====================  =========================================================================
module                 what
=====================  =========================================================================
``sliced``             :func:`shard_model`, the entry point for a built model: slices linears
                       built full, registers linears built as shards, one runtime per model
``built``              linears built as their shard: the pre-sharding mixins
                       (:func:`presharded_class`, :func:`presharded_grouped_class` for
                       ``TEGroupedMLP``'s experts), :class:`GTPShardPlan`, the exact init
                       of every shard (:func:`rows_of_full_init`)
``spec``               the layer-spec rewrite that selects the ``built`` classes
                       (:func:`gtp_layer_spec`, :func:`preshard_config_layer_spec`)
``te``                 TransformerEngine specifics (which wrappers opt in, grouped ones too,
                       grad-mode hook,
                       ``LayerNormMLP`` warning); TE is imported lazily
=====================  =========================================================================

Example (megatron-core directly; ``gtp_config`` the same in both calls)::

    spec = gtp_layer_spec(get_gpt_layer_with_transformer_engine_spec(), groups, gtp_config)
    model = GPTModel(config, spec, vocab_size, max_seq)
    runtime = shard_model(model, groups, gtp_config)
"""

from nemo_gtp.integrations.megatron.sharding.built import (
    GTPShardPlan,
    PreShardedGroupedLinearMixin,
    PreShardedLinearMixin,
    is_presharded,
    presharded_class,
    presharded_grouped_class,
    rows_of_full_init,
)
from nemo_gtp.integrations.megatron.sharding.sliced import default_should_shard, shard_model
from nemo_gtp.integrations.megatron.sharding.spec import (
    grouped_expert_linear_kinds,
    gtp_layer_spec,
    preshard_config_layer_spec,
    presharded_classes,
    presharded_expert_classes,
    presharded_grouped_classes,
    replace_modules_in_spec,
)
from nemo_gtp.integrations.megatron.sharding.te import (
    te_grouped_linear_kinds,
    te_parallel_linear_kinds,
    warn_unsharded_te_modules,
)

__all__ = [
    "GTPShardPlan",
    "PreShardedGroupedLinearMixin",
    "PreShardedLinearMixin",
    "default_should_shard",
    "grouped_expert_linear_kinds",
    "gtp_layer_spec",
    "is_presharded",
    "preshard_config_layer_spec",
    "presharded_class",
    "presharded_classes",
    "presharded_expert_classes",
    "presharded_grouped_class",
    "presharded_grouped_classes",
    "replace_modules_in_spec",
    "rows_of_full_init",
    "shard_model",
    "te_grouped_linear_kinds",
    "te_parallel_linear_kinds",
    "warn_unsharded_te_modules",
]

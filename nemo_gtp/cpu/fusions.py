"""The kernel fusions a megatron config may ask for, torch-free: none exists on CPU (TE, Apex or
CUDA-only), so the CPU patches (``megatron_patches``) and :func:`nemo_gtp.recipes.cpu.on_cpu`
turn them off, and the NeMo-recipe CLI's parent check (where the GPU workers' TE or Apex may be
missing) too.

Example::

    for name in FUSIONS:
        setattr(config, name, False)
"""

FUSIONS = (
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "gradient_accumulation_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)

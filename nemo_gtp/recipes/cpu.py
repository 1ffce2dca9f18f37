"""A NeMo recipe (``llm.*.pretrain_recipe``) adapted to run on CPU processes with gloo.

Tooling for the tests and ``python -m nemo_gtp.run --recipe ... --cpu``, not for GPU runs. What
changes (each a setting NeMo's GPU recipes choose for CUDA):

- ``trainer.accelerator="cpu"``, the strategy's ``process_group_backend="gloo"``, synchronous
  checkpoint saves, ``context_parallel_size=1`` (megatron runs CP in TransformerEngine's
  attention only; the CP ranks become data-parallel ranks, the same loss);
- fp32: the mixed-precision plugin dropped, ``bf16`` / ``fp16`` off in the model and optimizer;
- the model config: megatron's local layer spec (no TransformerEngine), CPU initialization, the
  fused CUDA kernels off, ``data_step_fn`` =
  :func:`nemo_gtp.cpu.nemo_patches.cpu_gpt_data_step` (the CPU batch staging);
- ``ddp.average_in_collective=False`` (gloo has no AVG reduction);
- the data module: an attention mask (the local spec needs one), no workers, no pinned memory.

The processes must also call ``nemo_gtp.cpu.compat.enable_cpu_compat(nemo=True)`` before the fit:
``nemo_gtp.recipes.sequence.run_recipes(..., cpu_compat=True)`` does.

Example::

    recipe = on_cpu(llm.llama3_8b.pretrain_recipe(name="cpu", dir="/tmp/cpu", num_nodes=1,
                                                  num_gpus_per_node=4))
"""

from __future__ import annotations

from typing import Any

# Kernel fusions a model config may ask for: off on CPU (no fused kernels), and off in the
# parent's check of a NeMo recipe (nemo_cli.check_recipe), which runs where the GPU workers'
# TransformerEngine or Apex may be missing.
FUSIONS = (
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "gradient_accumulation_fusion",
)


def _set_if_known(cfg: Any, name: str, value: Any) -> None:
    """``cfg.name = value`` when the config's target takes ``name`` (recipes differ)."""
    try:
        getattr(cfg, name)
    except AttributeError:
        if name not in getattr(cfg, "__arguments__", {}):
            return
    setattr(cfg, name, value)


def on_cpu(recipe: Any) -> Any:
    """``recipe`` (changed in place and returned) for CPU processes (see the module list).

    Example: the module docstring.
    """
    import fiddle as fdl
    import torch
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.cpu.compat import cpu_gpt_data_step

    trainer = recipe.trainer
    trainer.accelerator = "cpu"
    trainer.plugins = None
    strategy = trainer.strategy
    strategy.process_group_backend = "gloo"
    strategy.ckpt_async_save = False
    strategy.pipeline_dtype = None
    strategy.context_parallel_size = 1
    ddp = getattr(strategy, "ddp", "megatron")
    if isinstance(ddp, fdl.Buildable):
        ddp.average_in_collective = False
    config = recipe.model.config
    for name in FUSIONS:
        _set_if_known(config, name, False)
    config.transformer_layer_spec = local_layer_spec
    config.use_cpu_initialization = True
    config.params_dtype = torch.float32
    config.bf16 = False
    config.fp16 = False
    config.data_step_fn = cpu_gpt_data_step
    optim = getattr(getattr(recipe, "optim", None), "config", None)
    if optim is not None:
        optim.bf16 = False
        optim.fp16 = False
    data = recipe.data
    _set_if_known(data, "create_attention_mask", True)
    _set_if_known(data, "num_workers", 0)
    _set_if_known(data, "pin_memory", False)
    return recipe

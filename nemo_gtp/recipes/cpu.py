"""A NeMo recipe (``llm.*.pretrain_recipe``) adapted to run on CPU processes with gloo.

Tooling for the tests and ``python -m nemo_gtp.run --recipe ... --cpu``, not for GPU runs. What
changes (each a setting NeMo's GPU recipes choose for CUDA):

- ``trainer.accelerator="cpu"``, the strategy's ``process_group_backend="gloo"``, synchronous
  checkpoint saves, ``context_parallel_size=1`` (megatron runs CP in TransformerEngine's
  attention only; the CP ranks become data-parallel ranks, the same loss); NeMo's
  ``DeepEPCallback`` dropped (it picks a GPU dispatcher by compute capability);
- fp32: the mixed-precision plugin dropped, ``bf16`` / ``fp16`` off in the model and optimizer;
- the model config: megatron's local modules in place of NeMo's layer spec
  (:func:`nemo_gtp.cpu.layer_spec.cpu_layer_spec`: the family's QK layernorm, experts, shared
  experts, multi-latent attention, dense/MoE layer pattern and zero-centered norms kept; a
  family whose spec builds TransformerEngine-only layers of its own is refused, naming it), CPU
  initialization, the fused CUDA kernels off, megatron's default ``attention_backend`` (TE's
  choice, nothing on CPU), ``data_step_fn`` =
  :func:`nemo_gtp.cpu.nemo_patches.cpu_gpt_data_step` (the CPU batch staging);
- ``ddp.average_in_collective=False`` (gloo has no AVG reduction);
- the data module: an attention mask (the local spec needs one), no workers, no pinned memory
  (NeMo's ``MockDataModule`` emits the mask under :mod:`nemo_gtp.cpu.compat`'s
  ``nemo_mock_data_mask`` patch).

The processes must also call ``nemo_gtp.cpu.compat.enable_cpu_compat(nemo=True)`` before the fit:
``nemo_gtp.recipes.sequence.run_recipes(..., cpu_compat=True)`` does.

Example::

    recipe = on_cpu(llm.llama3_8b.pretrain_recipe(name="cpu", dir="/tmp/cpu", num_nodes=1,
                                                  num_gpus_per_node=4))
"""

from __future__ import annotations

from typing import Any

from nemo_gtp.cpu.fusions import FUSIONS

# NeMo's layer specs whose architecture cpu_layer_spec rebuilds from megatron's local modules
# (every other spec, e.g. Gemma 2's softcapped attention or Llama 4's chunked attention, builds
# TransformerEngine layers of its own that have no CPU counterpart).
CPU_REPLACEABLE_SPECS = (
    "default_layer_spec",
    "transformer_engine_layer_spec",
    "local_layer_spec",
    "get_gpt_decoder_block_spec",
    "cpu_layer_spec",
)


def _set_if_known(cfg: Any, name: str, value: Any) -> None:
    """``cfg.name = value`` when the config's target takes ``name`` (recipes differ)."""
    try:
        getattr(cfg, name)
    except AttributeError:
        if name not in getattr(cfg, "__arguments__", {}):
            return
    setattr(cfg, name, value)


def _cls_name(cfg: Any) -> str:
    """The class (or function) name a ``run.Config`` builds, or the object's type name."""
    fn = getattr(cfg, "__fn_or_cls__", None)
    return str(getattr(fn, "__name__", "")) if fn is not None else type(cfg).__name__


def _spec_name(spec: Any) -> str:
    """The function name behind a layer spec (a function, a ``functools.partial`` of one)."""
    fn = getattr(spec, "func", spec)
    return str(getattr(fn, "__name__", type(spec).__name__))


def on_cpu(recipe: Any) -> Any:
    """``recipe`` (changed in place and returned) for CPU processes (see the module list).

    :class:`~nemo_gtp.recipes.config.RecipeError` for a family whose layer spec has no CPU
    counterpart. Example: the module docstring.
    """
    import fiddle as fdl
    import torch
    from megatron.core.transformer.enums import AttnBackend

    from nemo_gtp.cpu.compat import cpu_gpt_data_step
    from nemo_gtp.cpu.layer_spec import cpu_layer_spec
    from nemo_gtp.recipes.config import RecipeError

    trainer = recipe.trainer
    trainer.accelerator = "cpu"
    trainer.plugins = None
    # NeMo's DeepEPCallback (DeepSeek, Qwen 3 MoE recipes) reads the GPU's compute capability
    # to switch to the DeepEP dispatcher: nothing to switch on CPU
    callbacks = getattr(trainer, "callbacks", None)
    if isinstance(callbacks, list):
        trainer.callbacks = [c for c in callbacks if _cls_name(c) != "DeepEPCallback"]
    strategy = trainer.strategy
    strategy.process_group_backend = "gloo"
    strategy.ckpt_async_save = False
    strategy.pipeline_dtype = None
    strategy.context_parallel_size = 1
    ddp = getattr(strategy, "ddp", "megatron")
    if isinstance(ddp, fdl.Buildable):
        ddp.average_in_collective = False
    config = recipe.model.config
    spec = getattr(config, "transformer_layer_spec", None)
    if spec is not None and _spec_name(spec) not in CPU_REPLACEABLE_SPECS:
        raise RecipeError(
            f"model.config.transformer_layer_spec={_spec_name(spec)} builds TransformerEngine "
            "layers of its own (no CPU counterpart in megatron's local modules): this family "
            f"does not run with --cpu; on CPU the specs {', '.join(CPU_REPLACEABLE_SPECS)} do"
        )
    for name in FUSIONS:
        _set_if_known(config, name, False)
    config.transformer_layer_spec = cpu_layer_spec
    # TE's attention choice (NVTE_* variables, which megatron refuses to see change within a
    # process that trains several recipes): on CPU the local spec's attention runs whatever it
    # says, so every recipe gets megatron's default
    _set_if_known(config, "attention_backend", AttnBackend.auto)
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

"""NeMo's model families (``llm.<recipe>.pretrain_recipe``) shrunk to a few tiny layers, for CPU.

:data:`FAMILIES` maps a NeMo recipe name to the NeMo-Run overrides (``key=value``, what
``python -m nemo_gtp.run --recipe NAME --cpu --tokenizer byte`` takes) that shrink it to 2
layers of width 64 while keeping what makes the family itself: QK layernorm, tied embeddings,
squared ReLU without gating, zero-centered norms, RoPE scaling, GQA / MQA ratios, routed experts
with top-k routing, shared experts, multi-latent attention, a dense first layer. :data:`COMMON`
are the settings every family gets (10 steps, fp32 on CPU, no validation or checkpoints).

:func:`recipe_fit` (used by :mod:`tests.harness.strategy` for a ``Fit(recipe=...)``) builds the
recipe exactly as the CLI does (``load_nemo_recipe`` -> ``on_cpu`` -> the mock data's tokenizer
-> ``apply_overrides`` -> ``with_gtp``), trains it through NeMo's own ``llm.pretrain`` and
reports the losses and what the built model holds (:func:`model_features`).

Example::

    Fit("qwen3_600m_gtp2", gtp=2, recipe="qwen3_600m")
"""

from __future__ import annotations

from typing import Any

import torch

# Every family: 10 steps of 2 microbatches x 2 data ranks, fp32 on CPU, no validation, no
# checkpoint, no TensorBoard; 1 pipeline stage, TP1 (the recipes' own TP / PP / EP sizes are
# for their GPU counts).
COMMON = (
    "trainer.max_steps=10",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=False",
    "trainer.enable_checkpointing=False",
    "trainer.strategy.tensor_model_parallel_size=1",
    "trainer.strategy.pipeline_model_parallel_size=1",
    "trainer.strategy.virtual_pipeline_model_parallel_size=None",
    "trainer.strategy.sequence_parallel=False",
    "log.ckpt=None",
    "log.tensorboard=None",
    "model.config.num_layers=2",
    "model.config.hidden_size=64",
    "model.config.ffn_hidden_size=128",
    "model.config.num_attention_heads=4",
    "model.config.kv_channels=16",
    "model.config.vocab_size=512",  # the byte tokenizer's (Qwen presets 151936)
    "model.config.seq_length=32",
    "data.seq_length=32",
    "data.micro_batch_size=2",
    "data.global_batch_size=8",
    "optim.lr_scheduler.warmup_steps=2",
)
GQA = ("model.config.num_query_groups=2",)
# Routed experts on CPU: 4 SequentialMLP experts (expert GTP's kind), one expert-parallel rank,
# megatron's allgather dispatcher (the alltoall one syncs through CUDA events).
MOE = (
    "trainer.strategy.expert_model_parallel_size=1",
    "model.config.num_moe_experts=4",
    "model.config.moe_router_topk=2",
    "model.config.moe_ffn_hidden_size=48",
    "model.config.moe_grouped_gemm=False",
    "model.config.moe_token_dispatcher_type=allgather",
)

FAMILIES: dict[str, tuple[str, ...]] = {
    # Llama 3 / 3.1 (RoPE scaling) / 3.2 (RoPE scaling, tied embeddings): SwiGLU, GQA 4:2
    "llama3_8b": (*COMMON, *GQA),
    "llama31_8b": (*COMMON, *GQA),
    "llama32_1b": (*COMMON, *GQA),
    # Mixtral: top-2 routed experts in every layer
    "mixtral_8x7b": (*COMMON, *GQA, *MOE, "model.config.ffn_hidden_size=48"),
    # Qwen 2.5: bias on q, k, v; Qwen 3: QK layernorm, tied embeddings
    "qwen25_500m": (*COMMON, *GQA),
    "qwen3_600m": (*COMMON, *GQA),
    # Nemotron: squared ReLU without gating, LayerNorm1p (zero-centered gamma), half-rotary
    "nemotron3_4b": (*COMMON, *GQA),
    # Gemma: tied embeddings, GeGLU, multi-query attention (1 group), zero-centered RMSNorm,
    # embeddings scaled by sqrt(hidden)
    "gemma_2b": (*COMMON, "model.config.num_query_groups=1"),
    # Qwen 3 MoE: QK layernorm and top-k routed experts in every layer
    "qwen3_30b_a3b": (*COMMON, *GQA, *MOE),
    # DeepSeek V2 Lite: multi-latent attention (YaRN RoPE), a dense first layer, then routed
    # experts beside a shared expert
    "deepseek_v2_lite": (
        *COMMON,
        *MOE,
        "model.config.num_query_groups=4",
        "model.config.moe_layer_freq=[0,1]",
        "model.config.moe_shared_expert_intermediate_size=64",
        "model.config.moe_shared_expert_overlap=False",  # an alltoall-dispatcher overlap
        "model.config.kv_lora_rank=32",
        "model.config.qk_head_dim=16",
        "model.config.qk_pos_emb_head_dim=8",
        "model.config.v_head_dim=16",
    ),
}
MOE_FAMILIES = ("mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite")
TOKENIZER = "byte"  # the mock data's tokenizer (NeMo's default one downloads GPT-2's files)


def family_recipe(
    name: str,
    *,
    devices: int,
    directory: str,
    num_weight_shards: int = 1,
    expert_num_weight_shards: int | None = None,
    overrides: tuple[str, ...] | None = None,
) -> Any:
    """``name``'s NeMo recipe for ``devices`` CPU processes with the family's shrinking
    overrides, converted by ``with_gtp`` when ``num_weight_shards > 1``; the CLI's steps."""
    from nemo_gtp.data.tokenizers import tokenizer_config
    from nemo_gtp.recipes.convert import with_gtp
    from nemo_gtp.recipes.cpu import on_cpu
    from nemo_gtp.recipes.nemo_cli import apply_overrides, load_nemo_recipe

    recipe = load_nemo_recipe(name, run_name=name, directory=directory, nodes=1, devices=devices)
    on_cpu(recipe)
    recipe.data.tokenizer = tokenizer_config(TOKENIZER)
    apply_overrides(recipe, list(FAMILIES[name] if overrides is None else overrides))
    if num_weight_shards > 1 or expert_num_weight_shards:
        recipe = with_gtp(
            recipe, num_weight_shards, expert_num_weight_shards=expert_num_weight_shards
        )
    return recipe


def model_features(module: torch.nn.Module, config: Any) -> dict[str, Any]:
    """What the built model holds that makes its family (the tests check each one)."""
    names = [name for name, _ in module.named_modules()]
    kinds = {type(m).__name__ for m in module.modules()}
    activation = getattr(config, "activation_func", None)
    return {
        "q_layernorm": any(
            n.endswith(("q_layernorm", "k_layernorm")) and type(m).__name__ != "IdentityOp"
            for n, m in module.named_modules()
        ),
        "tied_embeddings": bool(config.share_embeddings_and_output_weights),
        "output_layer_weight": any(
            n.endswith("output_layer.weight") for n, _ in module.named_parameters()
        ),
        "qkv_bias": any(n.endswith("linear_qkv.bias") for n, _ in module.named_parameters()),
        "gated": bool(config.gated_linear_unit),
        "activation": getattr(activation, "__name__", str(activation)),
        "zero_centered_norms": sum(
            type(m).__name__ == "CPUNorm" and m.zero_centered_gamma for m in module.modules()
        ),
        "rope_scale_factor": getattr(config, "scale_factor", None),
        "rotary_percent": config.rotary_percent,
        "query_groups": config.num_query_groups,
        "experts": sum(n.endswith("experts.local_experts.0") for n in names),
        "shared_experts": sum(n.endswith("mlp.shared_experts") for n in names),
        "dense_mlps": sum(
            type(m).__name__ == "MLP" and n.endswith(".mlp") for n, m in module.named_modules()
        ),  # fmt: skip
        "mla": "MLASelfAttention" in kinds,
        "rope_type": getattr(config, "rope_type", None),
        "embedding_scaled": "EmbeddingScalingMixin"
        in {c.__name__ for m in module.modules() for c in type(m).__mro__},
    }


def _forget_nemo_logger() -> None:
    """Drop what ``llm.pretrain``'s NeMoLogger left in NeMo's process-wide ``AppState``: its
    list of old log files to move, which the next fit's ``ModelCheckpoint`` would otherwise
    move out of this fit's log directory (on rank 0, while rank 1 still writes there)."""
    from nemo.utils.app_state import AppState

    state = AppState()
    state.files_to_move = []
    state.files_to_copy = []


def recipe_fit(fit: Any, world: int, store_path: str | None, out_dir: str) -> dict[str, Any]:
    """Train ``fit.recipe`` (GTP per ``fit.gtp`` / ``fit.expert_gtp``) through NeMo's
    ``llm.pretrain`` in this rank; the losses, grad norms and :func:`model_features`."""
    from pathlib import Path

    import fiddle as fdl
    import torch.distributed as dist

    from nemo_gtp.integrations.megatron import unwrapped_module
    from tests.harness.objects import Recorder

    recipe = family_recipe(
        fit.recipe,
        devices=world,
        directory=str(Path(out_dir, fit.name)),
        num_weight_shards=fit.tp * fit.gtp,
        expert_num_weight_shards=fit.tp * fit.expert_gtp if fit.expert_gtp > 1 else None,
        overrides=fit.recipe_overrides,
    )
    task = fdl.build(recipe)
    trainer = task.keywords["trainer"]
    if store_path is not None:
        trainer.strategy.store = dist.FileStore(store_path, world)
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    try:
        task()
    finally:
        _forget_nemo_logger()
    strategy = trainer.strategy
    runtimes = getattr(strategy, "gtp_runtimes", [])
    module = unwrapped_module(strategy)
    return {
        "name": fit.name,
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        **recorder.end,
        "strategy": type(strategy).__name__,
        "gtp_params": sum(len(r.params) for r in runtimes if r.size > 1),
        "gtp_runtimes": len(runtimes),
        "runtime_sizes": sorted(r.size for r in runtimes),
        "features": model_features(module, module.config),
    }

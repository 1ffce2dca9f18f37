"""The layout part of a YAML recipe's check (design §1.4, §3.1): the parallel sizes against
the world, the batch arithmetic, the checkpoint format, context and pipeline parallelism, routed
experts and FP8. The rules themselves are :mod:`nemo_gtp.engine.grid`'s (the strategy and
``with_gtp`` call the same ones); this module reads them off a recipe and names its keys.

Example::

    check_layout(load_recipe("configs/tiny_cpu.yaml", ["trainer.devices=3"]))
    # RecipeError: strategy.num_weight_shards=4 on trainer.devices x trainer.num_nodes = 3 x 1 ...
"""

from __future__ import annotations

import math
from typing import Any

from nemo_gtp.engine.fp8_recipe import FP8_FORMATS, FP8_PRIMARY_RECIPES, FP8_RECIPES
from nemo_gtp.engine.graph_rules import graph_settings, reject_cuda_graph_capture
from nemo_gtp.engine.grid import (
    check_checkpoint_format,
    check_expert_shards,
    check_global_batch,
    check_pipeline_split,
    layout_dims,
    on_world,
    refuse_legacy_grouped_experts,
)
from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.schema import (
    FP8_KEYS,
    check_keys,
    default_layer_spec_name,
    is_cpu_recipe,
    one_of,
)


def check_layout(raw: dict[str, Any]) -> None:
    """A plain recipe's layout (design §1.4, §3.1): the sizes statically and against the world
    (``trainer.devices x trainer.num_nodes``), the checkpoint format under GTP, routed experts,
    FP8, context and pipeline parallelism, then the global batch against micro x (DP x GTP).
    :class:`RecipeError` naming the key and the fix.

    Example::

        check_layout({"trainer": {"devices": 3}, "strategy": {"num_weight_shards": 4}})
        # RecipeError: strategy.num_weight_shards=4 on trainer.devices x trainer.num_nodes ...
    """
    trainer, strategy = raw.get("trainer") or {}, raw.get("strategy") or {}
    try:
        dims = layout_dims(strategy, "strategy")
        dims = on_world(
            dims,
            trainer.get("devices", 1),
            trainer.get("num_nodes", 1),
            key="strategy.num_weight_shards",
        )
        if dims.gtp_enabled:
            check_checkpoint_format(
                strategy.get("save_ckpt_format", "torch_dist"), key="strategy.save_ckpt_format"
            )
    except ValueError as err:
        raise RecipeError(str(err)) from None
    _check_moe(raw, dims)
    _check_fp8(raw, dims)
    _check_context_parallel(raw, dims)
    _check_pipeline(raw, dims)
    _check_cuda_graphs(raw, dims)
    data = raw.get("data") or {}
    micro, batch = data.get("micro_batch_size"), data.get("global_batch_size")
    if micro is None or batch is None:
        return
    try:
        check_global_batch(dims, micro, batch)
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _check_cuda_graphs(raw: dict[str, Any], dims: Any) -> None:
    """The CUDA graphs a GTP model asks for (``model.cuda_graph_impl`` / ``cuda_graph_scope``)
    against what GTP can capture (design §3.5; the strategy's rule, here before launch):
    per-layer graphs without routed experts, PP, recompute, with ``strategy.use_te_rng_tracker``.
    """
    if not dims.gtp_enabled:
        return
    model, strategy = raw.get("model") or {}, raw.get("strategy") or {}
    try:
        reject_cuda_graph_capture(
            graph_settings(lambda name, default: model.get(name, default)),
            use_te_rng_tracker=bool(strategy.get("use_te_rng_tracker", False)),
            pipeline_parallel=dims.pipeline_model_parallel_size,
            model_key="model.",
            strategy_key="strategy.",
        )
    except ValueError as err:
        raise RecipeError(f"{err} (design §3.5)") from None


def _check_context_parallel(raw: dict[str, Any], dims: Any) -> None:
    """Context parallelism runs in TransformerEngine's attention only (megatron's local core
    attention refuses it); under GTP the CP peers join the replicate group (design §1.4 "CP")."""
    cp = dims.context_parallel_size
    if cp == 1:
        return
    spec = (raw.get("model") or {}).get("layer_spec") or default_layer_spec_name()
    if spec != "te":
        raise RecipeError(
            f"strategy.context_parallel_size={cp} with model.layer_spec={spec}: megatron runs "
            "context parallelism in TransformerEngine's attention only; set "
            "model.layer_spec=te (GPUs) or strategy.context_parallel_size=1"
        )


def _check_pipeline(raw: dict[str, Any], dims: Any) -> None:
    """Pipeline stages (design §1.4 "PP"): the layers split evenly over PP x VP model chunks; a
    virtual pipeline gets at least PP microbatches per step; on CPU an untied output layer
    (megatron copies a tied embedding to the last stage through CUDA)."""
    strategy, model = raw.get("strategy") or {}, raw.get("model") or {}
    pp, vp = dims.pipeline_model_parallel_size, strategy.get("virtual_pipeline_model_parallel_size")
    if vp is not None and pp == 1:
        raise RecipeError(
            f"strategy.virtual_pipeline_model_parallel_size={vp} needs pipeline stages: set "
            "strategy.pipeline_model_parallel_size > 1 or drop the virtual size"
        )
    if pp == 1:
        return
    layers = model.get("num_layers")
    uneven = any(
        key in model
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
    )
    if layers is not None and not uneven:
        try:
            check_pipeline_split(layers, pp, vp)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    data = raw.get("data") or {}
    micro, batch, ranks = (
        data.get("micro_batch_size"),
        data.get("global_batch_size"),
        dims.data_parallel_size,
    )
    if vp is not None and micro and batch and batch // (micro * ranks) < pp:
        # megatron's interleaved schedule runs the microbatches in groups of PP per model chunk
        raise RecipeError(
            f"strategy.virtual_pipeline_model_parallel_size={vp} needs at least "
            f"pipeline_model_parallel_size={pp} microbatches per step, data.global_batch_size="
            f"{batch} gives {batch // (micro * ranks)} (micro {micro} x DP x GTP {ranks}): set "
            f"data.global_batch_size={pp * micro * ranks}"
        )
    if is_cpu_recipe(raw) and model.get("share_embeddings_and_output_weights", True):
        raise RecipeError(
            f"strategy.pipeline_model_parallel_size={pp} on CPU needs an untied output layer "
            "(megatron copies the tied embedding to the last stage through CUDA): set "
            "+model.share_embeddings_and_output_weights=false"
        )


def _check_moe(raw: dict[str, Any], dims: Any) -> None:
    """Expert GTP needs routed experts (``SequentialMLP``, or ``TEGroupedMLP``: grouped GEMM
    with the TE layer spec, not the legacy ``GroupedMLP``); experts divide over EP; the legacy
    ``GroupedMLP`` cannot checkpoint under GTP (design §1.4, §3.3 "Routed experts")."""
    model = raw.get("model") or {}
    experts = model.get("num_moe_experts")
    try:
        check_expert_shards(
            dims.egtp, experts, "model.num_moe_experts", "strategy.expert_num_weight_shards"
        )
    except ValueError as err:
        raise RecipeError(str(err)) from None
    if dims.egtp > 1 and model.get("moe_grouped_gemm"):
        spec = model.get("layer_spec") or default_layer_spec_name()
        why = ""
        if model.get("moe_use_legacy_grouped_gemm"):
            why = "model.moe_use_legacy_grouped_gemm=true"
        elif spec != "te" and model.get("layer_spec"):
            why = f"model.layer_spec={spec}"
        elif spec != "te":
            why = "model.layer_spec unset (local: TransformerEngine is not installed)"
        try:
            refuse_legacy_grouped_experts(
                dims.egtp,
                why and f"model.moe_grouped_gemm=true with {why}",
                "set model.moe_grouped_gemm=false, or model.layer_spec=te (TEGroupedMLP, "
                "TransformerEngine)",
            )
        except ValueError as err:
            raise RecipeError(str(err)) from None
    if experts and experts % dims.expert_model_parallel_size != 0:
        raise RecipeError(
            f"model.num_moe_experts={experts} must be a multiple of "
            f"strategy.expert_model_parallel_size={dims.expert_model_parallel_size}"
        )
    legacy = (
        model.get("moe_use_legacy_grouped_gemm")
        or (model.get("layer_spec") or default_layer_spec_name()) != "te"
    )
    grouped = experts and model.get("moe_grouped_gemm") and legacy
    if grouped and dims.gtp_enabled and (raw.get("checkpoint") or raw.get("resume")):
        raise RecipeError(
            "checkpoint / resume of megatron's legacy grouped-GEMM MoE experts under GTP "
            "(GroupedMLP) is not supported yet: set model.moe_grouped_gemm=false, or "
            "model.layer_spec=te (TEGroupedMLP checkpoints), or drop the checkpoint section "
            "(and resume)"
        )


def _check_fp8(raw: dict[str, Any], dims: Any) -> None:
    """The ``fp8`` section (TE's FP8 GEMMs through NeMo's precision plugin, design §1.3): names,
    what it needs (bf16-mixed, the TE layer spec, GPUs), and what FP8 primary weights
    (``fp8.param_gather``) need under GTP. The GPU's own limits (MXFP8 needs Blackwell) are
    checked on the device."""
    section = raw.get("fp8")
    if section is None:
        return
    check_keys("fp8", section, FP8_KEYS, "an fp8 setting")
    if section.get("format") is None:
        raise RecipeError("fp8.format is missing: add fp8.format=hybrid (or drop the fp8 section)")
    one_of("fp8.format", section["format"], FP8_FORMATS)
    one_of("fp8.recipe", section.get("recipe"), FP8_RECIPES)
    if str(raw.get("precision")) != "bf16-mixed":
        raise RecipeError(
            f"fp8 needs precision: bf16-mixed (TE's FP8 GEMMs run under NeMo's mixed-precision "
            f"plugin), got precision={raw.get('precision')!r}: set precision=bf16-mixed"
        )
    if raw.get("cpu_compat"):
        raise RecipeError(
            "fp8 needs GPUs with TransformerEngine: set cpu_compat=false (or drop the fp8 section)"
        )
    if (raw.get("model") or {}).get("layer_spec") == "local":
        raise RecipeError(
            "fp8 runs TransformerEngine's FP8 GEMMs: set model.layer_spec=te (megatron's local "
            "linears have none)"
        )
    if dims.gtp_enabled and section.get("param_gather"):
        _check_fp8_primary(raw, dims, section)


def _check_fp8_primary(raw: dict[str, Any], dims: Any, section: dict[str, Any]) -> None:
    """``fp8.param_gather=true`` under GTP: FP8 primary GTP shards (design §1.3 "FP8 primary
    weights"): per-tensor current scaling or blockwise scaling, megatron's distributed
    optimizer with fp32 gradient reduction, no routed experts over expert GTP. ``resume`` is
    fine: the strategy re-quantizes the shards from the loaded weights and fp32 mains (design
    §3.3 "FP8 primary weights")."""
    off = "or fp8.param_gather=false (the shards then stay bf16)"
    recipe = section.get("recipe") or "delayed"
    if recipe not in FP8_PRIMARY_RECIPES:
        raise RecipeError(
            f"fp8.param_gather=true (FP8 primary weights) with fp8.recipe={recipe} is not "
            f"supported with GTP (its FP8 primary shards use per-tensor current scaling or "
            f"128x128 blockwise scaling): set fp8.recipe=tensorwise or blockwise, {off}"
        )
    if not (raw.get("optim") or {}).get("use_distributed_optimizer"):
        raise RecipeError(
            "fp8.param_gather=true under GTP needs megatron's distributed optimizer (it keeps "
            f"the fp32 masters the FP8 shards are written back from): set "
            f"optim.use_distributed_optimizer=true, {off}"
        )
    if (raw.get("ddp") or {}).get("grad_reduce_in_fp32") is False:
        raise RecipeError(
            "fp8.param_gather=true under GTP needs ddp.grad_reduce_in_fp32=true (megatron DDP "
            f"would allocate the gradient buffer in the shards' float8 dtype), {off}"
        )
    if dims.egtp > 1 and (raw.get("model") or {}).get("num_moe_experts"):
        raise RecipeError(
            "fp8.param_gather=true is not supported for routed experts sharded over expert GTP: "
            f"drop strategy.expert_num_weight_shards (experts whole), {off}"
        )
    if recipe == "blockwise":
        _check_primary_tiles(raw, dims)


TE_TILE = 128  # TE's Float8BlockScaling weight tiles (sharding/te_fp8.TE_TILE; no torch here)


def _check_primary_tiles(raw: dict[str, Any], dims: Any) -> None:
    """Blockwise FP8 primary shards own their tiles (design §1.3 "FP8 primary weights"): every
    transformer linear's GTP shard must be whole 128-row tiles, else the recipe names the
    ``gtp.pad_for_alignment`` that makes it so (the shard rows are the TP-local rows padded to
    ``pad_for_alignment x GTP``, design §1.3 "Padding")."""
    model = raw.get("model") or {}
    hidden, heads = model.get("hidden_size"), model.get("num_attention_heads")
    if not hidden or not heads:
        return
    tp = dims.tensor_model_parallel_size
    kv = model.get("kv_channels") or hidden // heads
    groups = model.get("num_query_groups") or heads
    fc1 = (model.get("ffn_hidden_size") or 4 * hidden) * (
        2 if model.get("gated_linear_unit") else 1
    )
    rows = {
        "linear_qkv": (heads + 2 * groups) * kv // tp,
        "linear_fc1": fc1 // tp,
        "linear_proj and linear_fc2": hidden,
    }
    pad = int((raw.get("gtp") or {}).get("pad_for_alignment", 16))
    unit = pad * dims.gtp
    for name, count in rows.items():
        shard = -(-count // unit) * unit // dims.gtp
        if shard % TE_TILE:
            raise RecipeError(
                f"fp8.recipe=blockwise with fp8.param_gather=true: {name} ({count} rows per "
                f"tensor-parallel rank) gives GTP shards of {shard} rows at GTP {dims.gtp} "
                f"(gtp.pad_for_alignment={pad}), which split TE's {TE_TILE}x{TE_TILE} tiles: "
                f"set gtp.pad_for_alignment={math.lcm(TE_TILE, pad)}"
            )

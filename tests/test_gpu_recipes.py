"""The GPU recipes run as fast as the stack allows: per-layer CUDA graphs where GTP can capture
them, the fusions megatron-core has without apex, and what they cannot have refused by name.

In-process, no launch: each recipe's ``model`` section is built into megatron's own
``TransformerConfig`` (its ``__post_init__`` checks every fusion setting) and checked by GTP's
CUDA-graph refusal (``reject_cuda_graph_capture``, what the strategy runs before any process
group exists). ``gpu_stages.sh fusions`` measures each setting's step time and memory.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from omegaconf import OmegaConf

from bench.common import ROOT
from nemo_gtp.recipes.config import load_recipe
from nemo_gtp.recipes.validate import validate_recipe

GRAPHED = ("gpt_1b_te", "gpt_1b_fp8")
FUSED = ("bias_dropout_fusion", "cross_entropy_loss_fusion")
NEED_APEX = ("masked_softmax_fusion", "persist_layer_norm")
WGRAD_FUSED = {"gpt_1b_te": True, "gpt_1b_fp8": False, "moe_1b": False}
"""``gradient_accumulation_fusion``: without apex the strategy hands megatron torch's GEMM
(``wgrad_fusion``); on where its effect was measured."""


def _recipe(name: str, overrides: list[str] | None = None) -> Any:
    return load_recipe(str(ROOT / "configs" / f"{name}.yaml"), overrides or [])


def _transformer_config(cfg: Any) -> Any:
    """Megatron's ``TransformerConfig`` of a recipe's model section (the keys it has)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = OmegaConf.to_container(cfg.model, resolve=True)
    kwargs = {k: v for k, v in model.items() if k in fields}
    kwargs["params_dtype"] = getattr(torch, kwargs.get("params_dtype", "float32"))
    return TransformerConfig(**kwargs)


@pytest.mark.parametrize("name", [*GRAPHED, "moe_1b"])
def test_gpu_recipe_is_valid_and_megatron_accepts_its_fusions(name: str) -> None:
    cfg = _recipe(name)
    validate_recipe(cfg)
    config = _transformer_config(cfg)
    for fusion in FUSED:  # megatron's own jit fusions: no apex, no TE
        assert getattr(config, fusion) is True, (name, fusion)
    for fusion in NEED_APEX:
        assert getattr(config, fusion) is False, (name, fusion)
    assert config.gradient_accumulation_fusion is WGRAD_FUSED[name]


@pytest.mark.parametrize("name", GRAPHED)
def test_dense_gpu_recipes_are_graphed_per_layer_and_gtp_accepts_it(name: str) -> None:
    from nemo_gtp.strategy.cuda_graphs import full_iteration_graphs, reject_cuda_graph_capture

    cfg = _recipe(name)
    config = _transformer_config(cfg)
    assert (config.cuda_graph_impl, config.cuda_graph_scope) == ("local", "full")
    assert not full_iteration_graphs(config)
    assert cfg.strategy.use_te_rng_tracker is True
    reject_cuda_graph_capture(config, use_te_rng_tracker=True)  # accepted: no error


def test_moe_recipe_stays_eager_and_graphs_there_are_refused_by_name() -> None:
    from nemo_gtp.strategy.cuda_graphs import cuda_graphs_enabled, reject_cuda_graph_capture

    assert not cuda_graphs_enabled(_transformer_config(_recipe("moe_1b")))
    graphed = _transformer_config(
        _recipe("moe_1b", ["model.cuda_graph_impl=local", "+model.cuda_graph_scope=full"])
    )
    with pytest.raises(ValueError, match=r"num_moe_experts=8.*cuda_graph_impl='none'"):
        reject_cuda_graph_capture(graphed, use_te_rng_tracker=True)


@pytest.mark.parametrize(
    ("overrides", "kwargs", "named"),
    [
        ([], {"pipeline_parallel": 2}, "pipeline_model_parallel_size=2"),
        ([], {"use_te_rng_tracker": False}, "use_te_rng_tracker=True"),
        (["model.cuda_graph_impl=transformer_engine"], {}, "cuda_graph_impl='transformer_engine'"),
    ],
)
def test_what_per_layer_graphs_cannot_take_is_refused_by_name(
    overrides: list[str], kwargs: dict, named: str
) -> None:
    from nemo_gtp.strategy.cuda_graphs import reject_cuda_graph_capture

    config = _transformer_config(_recipe("gpt_1b_te", overrides))
    with pytest.raises(ValueError, match=re.escape(named)):
        reject_cuda_graph_capture(config, **{"use_te_rng_tracker": True, **kwargs})


def test_graphs_with_recompute_are_refused_by_megatron_itself() -> None:
    recompute = ("recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1")
    with pytest.raises(ValueError, match="CUDA graphs not supported with activation recomput"):
        _transformer_config(_recipe("gpt_1b_te", [f"+model.{k}" for k in recompute]))


def test_bias_activation_fusion_stays_off_without_linear_biases() -> None:
    """The recipes' MLP is GeLU without biases: megatron refuses the bias+GeLU fusion there
    (the recipes' comment says so); with biases it is accepted."""
    with pytest.raises(ValueError, match="add_bias_linear must also be True"):
        _transformer_config(_recipe("gpt_1b_te", ["model.bias_activation_fusion=true"]))
    _transformer_config(
        _recipe("gpt_1b_te", ["model.bias_activation_fusion=true", "model.add_bias_linear=true"])
    )


@pytest.mark.parametrize(
    ("recipe", "overrides", "named"),
    [
        (
            "moe_1b",
            ["model.cuda_graph_impl=local", "+model.cuda_graph_scope=full"],
            "model.num_moe_experts=8",
        ),
        ("gpt_1b_te", ["strategy.use_te_rng_tracker=false"], "strategy.use_te_rng_tracker=true"),
        (
            "gpt_1b_te",
            ["trainer.devices=4", "+strategy.pipeline_model_parallel_size=2"],
            "strategy.pipeline_model_parallel_size=2",
        ),
        (
            "gpt_1b_te",
            ["+model.recompute_granularity=selective"],
            "model.recompute_granularity='selective'",
        ),
    ],
)
def test_the_yaml_check_refuses_uncapturable_graphs_before_launch(
    recipe: str, overrides: list[str], named: str
) -> None:
    """The strategy's rule, run by the command line's pre-launch check with the recipe's keys;
    the same recipe without GTP (the baseline of ``--compare-baseline``) is not GTP's to
    refuse."""
    from nemo_gtp.recipes.config import RecipeError

    with pytest.raises(RecipeError, match=re.escape(named) + r".*model\.cuda_graph_impl='none'"):
        validate_recipe(_recipe(recipe, overrides))
    if recipe == "gpt_1b_te":
        validate_recipe(_recipe(recipe, [*overrides, "strategy.num_weight_shards=1"]))

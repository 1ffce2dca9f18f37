"""NeMo's model families under GTP, trained through their own recipes (CPU/gloo, fp32).

Each family's ``llm.<recipe>.pretrain_recipe``, shrunk by NeMo-Run overrides to 2 layers of
width 64 (:data:`tests.harness.families.FAMILIES`, which keep what makes the family), is built
exactly as ``python -m nemo_gtp.run --recipe NAME --cpu`` builds it and trained 10 steps through
NeMo's ``llm.pretrain`` twice on 2 ranks: through ``with_gtp`` at TP1·GTP2 (and EGTP2 for the
routed experts), and as NeMo gives it (DP2). Losses and grad norms agree to 1e-5 relative, and
the built model holds the family's layers:

============================  ================================================================
recipe                        what the shard must get right
============================  ================================================================
``llama31_8b``                Llama 3.1 RoPE scaling (factor 8), GQA 4:2, SwiGLU
``llama32_1b``                Llama 3.2 RoPE scaling (factor 32), tied embeddings
``mixtral_8x7b``              top-2 routed experts in every layer (expert GTP)
``qwen25_500m``               bias on the fused q/k/v rows
``qwen3_600m``                QK layernorm, tied embeddings
``qwen3_30b_a3b``             QK layernorm with routed experts (expert GTP)
``nemotron3_4b``              squared ReLU without gating, LayerNorm1p, half-rotary
``gemma_2b``                  GeGLU, multi-query attention, zero-centered RMSNorm, scaled
                              embeddings, tied embeddings
``deepseek_v2_lite``          multi-latent attention (YaRN), a dense first layer, routed
                              experts beside a shared expert (expert GTP)
============================  ================================================================

Llama 3 itself trains through the CLI in ``tests/test_nemo_recipes.py``. All fits share the
2-rank launch of :func:`tests.harness.shared_launch.shared_launch` (one spawn for the suite).

Also, in this process: the CLI's pre-launch path for every family (``--dryrun``: the recipe
built, shrunk, converted and checked, the launch written, nothing started), the memory planner
on every family's shrunk recipe (per-GPU bytes at GTP2; MoE refused by the planner, naming
the experts), and the CPU layers the families need (:mod:`nemo_gtp.cpu.layer_spec`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.families import FAMILIES, MOE_FAMILIES, TOKENIZER
from tests.harness.shared_launch import shared_launch
from tests.harness.strategy import Fit

TRAINED = [name for name in FAMILIES if name != "llama3_8b"]  # llama3_8b: test_nemo_recipes


def _fits(name: str) -> list[Fit]:
    moe = name in MOE_FAMILIES
    return [
        Fit(f"family_{name}_base", recipe=name),
        Fit(f"family_{name}_gtp2", recipe=name, gtp=2, expert_gtp=2 if moe else 1),
    ]


shared_launch(2).add([fit for name in TRAINED for fit in _fits(name)])

# What each family's built model must hold (tests.harness.families.model_features)
COMMON = {"query_groups": 2, "gated": True, "activation": "silu", "tied_embeddings": False,
          "q_layernorm": False, "qkv_bias": False, "experts": 0, "shared_experts": 0,
          "dense_mlps": 2, "mla": False, "zero_centered_norms": 0, "rotary_percent": 1.0,
          "rope_scale_factor": None, "embedding_scaled": False}  # fmt: skip
EXPECTED: dict[str, dict[str, Any]] = {
    "llama31_8b": {"rope_scale_factor": 8.0},
    "llama32_1b": {"rope_scale_factor": 32.0, "tied_embeddings": True},
    "mixtral_8x7b": {"experts": 2, "dense_mlps": 0},
    "qwen25_500m": {"qkv_bias": True},
    "qwen3_600m": {"q_layernorm": True, "tied_embeddings": True},
    "qwen3_30b_a3b": {"q_layernorm": True, "experts": 2, "dense_mlps": 0},
    # 2 norms per layer and the final one, each LayerNorm1p
    "nemotron3_4b": {
        "activation": "squared_relu",
        "gated": False,
        "zero_centered_norms": 5,
        "rotary_percent": 0.5,
    },  # fmt: skip
    "gemma_2b": {
        "activation": "openai_gelu",
        "query_groups": 1,
        "zero_centered_norms": 5,
        "tied_embeddings": True,
        "embedding_scaled": True,
    },  # fmt: skip
    # MLA (V2 Lite: no query LoRA); layer 1 dense, layer 2 routed experts + a shared expert
    "deepseek_v2_lite": {
        "mla": True,
        "rope_type": "yarn",
        "query_groups": 4,
        "experts": 1,
        "shared_experts": 1,
        "dense_mlps": 1,
    },  # fmt: skip
}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return shared_launch(2).results(tmp_path_factory)


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", TRAINED)
def test_family_trains_under_gtp_as_without(name: str, families: dict) -> None:
    base, gtp = families[f"family_{name}_base"], families[f"family_{name}_gtp2"]
    for rank in range(2):
        assert base[rank]["strategy"] == "MegatronStrategy"
        assert gtp[rank]["strategy"] == "GTPMegatronStrategy"
        # the dense runtime, and the expert one (EGTP2) for routed experts; weights sharded
        assert gtp[rank]["runtime_sizes"] == ([2, 2] if name in MOE_FAMILIES else [2])
        assert gtp[rank]["gtp_params"] > 0 and base[rank]["gtp_params"] == 0
        assert gtp[rank]["global_step"] == base[rank]["global_step"] == 10
        for key in ("losses", "grad_norms"):
            assert len(gtp[rank][key]) == 10, (key, gtp[rank][key])
            assert _max_rel(gtp[rank][key], base[rank][key]) <= 1e-5, (key, name)
        assert all(math.isfinite(loss) for loss in gtp[rank]["losses"])
    features = gtp[0]["features"]
    assert features == base[0]["features"]  # the same model, with and without GTP
    expected = {**COMMON, **EXPECTED[name]}
    assert {k: features[k] for k in expected} == expected
    assert features["output_layer_weight"] is not features["tied_embeddings"]


# ------------------------------------------------------------------------------- the CLI
def cli_argv(name: str) -> list[str]:
    """``python -m nemo_gtp.run``'s arguments for ``name`` on 2 CPU processes at GTP2 (EGTP2 for
    routed experts; the README's line per family): the mock data with the byte tokenizer, the
    shrinking overrides."""
    argv = ["--recipe", name, "--num-weight-shards", "2", "--devices", "2", "--cpu"]
    if name in MOE_FAMILIES:
        argv += ["--expert-num-weight-shards", "2"]
    return [*argv, "--tokenizer", TOKENIZER, *FAMILIES[name]]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cli_builds_and_checks_each_family(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Everything before the launch: the recipe loaded, put on CPU, shrunk, converted
    (``with_gtp``), checked (strategy, model config, optimizer; the baseline's too with
    ``--compare-baseline``) and written as NeMo-Run's task (``--dryrun``: nothing started)."""
    import nemo_run as run

    from nemo_gtp.recipes.sequence import run_recipes
    from nemo_gtp.run import main

    home = tmp_path / "nemo_run"
    old = run.config.get_nemorun_home()
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    argv = [*cli_argv(name), "--dir", str(tmp_path / "exp"), "--compare-baseline", "--dryrun"]
    try:
        status = main(argv)
    finally:
        run.config.set_nemorun_home(old)
    out = capsys.readouterr()
    assert status == 0, out.err[-3000:]
    assert "dryrun: nothing launched" in out.out
    (task,) = list(home.glob("experiments/*/*/*/configs/*_fn_or_script"))  # the serialized task
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    partial = ZlibJSONSerializer().deserialize(task.read_text())
    assert partial.__fn_or_cls__ is run_recipes and partial.cpu_compat is True
    gtp, base = [ZlibJSONSerializer().deserialize(text) for text in partial.recipes]
    assert gtp.trainer.strategy.__fn_or_cls__.__name__ == "GTPMegatronStrategy"
    assert gtp.trainer.strategy.num_weight_shards == 2
    if name in MOE_FAMILIES:  # expert GTP: the routed experts' weights in 2 shards too
        assert gtp.trainer.strategy.expert_num_weight_shards == 2
    assert base.trainer.strategy.__fn_or_cls__.__name__ == "MegatronStrategy"
    assert gtp.model.config.num_layers == 2 and gtp.model.config.hidden_size == 64


def test_cpu_refuses_a_family_without_cpu_layers() -> None:
    """Gemma 2's layer spec builds TE-only layers of its own (softcapped attention, TE's
    post-norm linears): refused on CPU naming the spec, before anything is built."""
    from nemo.collections import llm

    from nemo_gtp.recipes.config import RecipeError
    from nemo_gtp.recipes.cpu import on_cpu

    recipe = llm.gemma2_2b.pretrain_recipe(name="g", dir="/tmp/g", num_nodes=1, num_gpus_per_node=2)
    with pytest.raises(RecipeError, match=re.escape("transformer_layer_spec=gemma2_layer_spec")):
        on_cpu(recipe)


# ------------------------------------------------------------------------------- planner
@pytest.mark.parametrize("name", list(FAMILIES))
def test_planner_reads_each_family(name: str) -> None:
    """``python -m nemo_gtp.plan --recipe NAME`` with the family's overrides: the shape the
    trained model has, and per-GPU bytes at GTP2 (the sharded linears' weights halved against
    GTP off, the gather buffers added); routed experts read with their top-k, width, shared
    expert and MoE layers, and halved again at EGTP2."""
    from nemo_gtp.plan import Layout, estimate, model_from_nemo_recipe

    shape, seq = model_from_nemo_recipe(name, list(FAMILIES[name]))
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab, seq) == (2, 64, 4, 512, 32)
    moe = shape.moe_layer_count
    if name in MOE_FAMILIES:
        assert (shape.experts, shape.topk, shape.expert_ffn) == (4, 2, 48)
        deepseek = name == "deepseek_v2_lite"  # a dense first layer, a shared expert
        assert (moe, shape.shared_ffn) == ((1, 64) if deepseek else (2, 0))
    else:
        expected = {**COMMON, **EXPECTED.get(name, {})}
        assert shape.ffn == 128 and shape.query_groups == expected["query_groups"]
        assert shape.gated == expected["gated"]
        assert shape.tied_embeddings == expected["tied_embeddings"]
        assert moe == 0
    plain = estimate(shape, Layout(tp=1, gtp=1, dp=2), tokens_per_gpu=64)
    gtp2 = estimate(shape, Layout(tp=1, gtp=2, dp=1), tokens_per_gpu=64)
    assert set(gtp2) == set(plain) and all(value >= 0 for value in gtp2.values())
    sharded = (shape.layers - moe) * shape.linear_params_per_layer + moe * (
        shape.attention_params_per_layer + shape.mlp_params(shape.shared_ffn)
    )
    assert plain["weights"] - gtp2["weights"] == pytest.approx(sharded * 2 / 2)  # bf16 halves
    assert gtp2["gather"] > 0 == plain["gather"]
    if moe:
        egtp2 = estimate(shape, Layout(tp=1, gtp=2, dp=1, egtp=2), tokens_per_gpu=64)
        routed = moe * shape.expert_params_per_layer
        assert gtp2["weights"] - egtp2["weights"] == pytest.approx(routed * 2 / 2)


# ------------------------------------------------------------------------------- CPU layers
def test_cpu_norm_is_megatrons_zero_centered_norm() -> None:
    """:class:`CPUNorm` computes TE's ``zero_centered_gamma``: ``norm(x) * (1 + gamma)``."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from nemo_gtp.cpu.layer_spec import CPUNorm

    torch.manual_seed(0)
    x = torch.randn(3, 2, 8)
    for kind in ("LayerNorm", "RMSNorm"):
        config = SimpleNamespace(normalization=kind, layernorm_zero_centered_gamma=True,
                                 params_dtype=torch.float32, sequence_parallel=False)  # fmt: skip
        norm = CPUNorm(config, hidden_size=8, eps=1e-5)
        assert torch.equal(norm.weight, torch.zeros(8))  # gamma starts at 0: the identity scale
        with torch.no_grad():
            norm.weight.normal_()
        gamma = norm.weight.detach() + 1
        expected = (
            F.layer_norm(x, (8,), gamma, norm.bias.detach(), 1e-5)
            if kind == "LayerNorm"
            else F.rms_norm(x, (8,), gamma, 1e-5)
        )
        torch.testing.assert_close(norm(x), expected, rtol=0, atol=0)

"""The memory planner (``python -m nemo_gtp.plan``): byte model, ranking, errors, CLI.

Pure arithmetic, no processes. The last test holds the byte model to the peaks measured on
2×H200 (``bench/results/2026-11-30_nemo_path_2xH200/final/bench_nemo.json``).
"""

from __future__ import annotations

import dataclasses

import pytest

from nemo_gtp.plan import (
    GIB,
    Layout,
    ModelShape,
    estimate,
    main,
    model_from_nemo_recipe,
    plan_layouts,
    recommend,
    why,
)

MODEL_1B = ModelShape(layers=24, hidden=2048, ffn=8192, heads=16, vocab=32000, seq=2048)


def test_linear_params_and_totals() -> None:
    m = ModelShape(layers=2, hidden=64, ffn=256, heads=4, vocab=100, seq=16, query_groups=2)
    # qkv: 64 x (64 + 2 * 32), proj 64 x 64, fc1 64 x 256, fc2 256 x 64
    assert m.linear_params_per_layer == 64 * 128 + 64 * 64 + 2 * 64 * 256
    gated = ModelShape(layers=2, hidden=64, ffn=256, heads=4, vocab=100, seq=16, gated=True)
    assert gated.largest_linear == 64 * 512
    assert m.parameters == 2 * m.linear_params_per_layer + 2 * 100 * 64 + 5 * 64


def test_gtp_divides_sharded_bytes_and_options_do_what_they_say() -> None:
    dp2 = estimate(MODEL_1B, Layout(1, 1, 2), tokens_per_gpu=4096)
    gtp2 = estimate(MODEL_1B, Layout(1, 2, 1), tokens_per_gpu=4096)
    linear = MODEL_1B.layers * MODEL_1B.linear_params_per_layer
    assert dp2["weights"] - gtp2["weights"] == pytest.approx(linear / 2 * 2)  # bf16 halves
    assert dp2["grads"] - gtp2["grads"] == pytest.approx(linear / 2 * 4)  # fp32 main_grad
    assert dp2["gather"] == 0 and gtp2["gather"] > 0
    assert dp2["activations"] == gtp2["activations"]  # GTP does not shard activations
    sr = estimate(MODEL_1B, Layout(1, 2, 1, shard_replicated=True), tokens_per_gpu=4096)
    replicated = MODEL_1B.embedding_params + (2 * MODEL_1B.layers + 1) * MODEL_1B.hidden
    assert gtp2["optimizer"] - sr["optimizer"] == pytest.approx(replicated * 12 / 2)
    rc = estimate(MODEL_1B, Layout(1, 2, 1, recompute=True), tokens_per_gpu=4096)
    assert rc["activations"] < gtp2["activations"] / 5
    tp2 = estimate(MODEL_1B, Layout(2, 1, 1), tokens_per_gpu=4096)
    assert tp2["activations"] == pytest.approx(dp2["activations"] / 2)


def test_context_parallel_layouts_split_optimizer_state_over_cp() -> None:
    """With CP the candidates are TP x CP x GTP x DP (CP fixed); the CP peers hold the same
    weights and split the distributed optimizer's state with the DP ranks."""
    plans = plan_layouts(MODEL_1B, gpus=8, gpu_memory_gib=141, tokens_per_gpu=4096, cp=2)
    names = {p.layout.name for p in plans}
    assert "TP1·CP2·GTP2·DP2" in names and "TP2·CP2·GTP2·DP1 +recompute" in names
    assert "TP1·CP2·GTP2·DP2 +shard_replicated" in names
    cp2 = estimate(MODEL_1B, Layout(1, 2, 2, cp=2), tokens_per_gpu=4096)
    dp4 = estimate(MODEL_1B, Layout(1, 2, 4), tokens_per_gpu=4096)
    assert cp2 == dp4  # same bytes: CP x DP = 4 replicas of the GTP2 shards either way
    gtp2 = estimate(MODEL_1B, Layout(1, 2, 2), tokens_per_gpu=4096)
    assert cp2["optimizer"] == pytest.approx(gtp2["optimizer"] / 2)
    assert cp2["weights"] == gtp2["weights"] and cp2["activations"] == gtp2["activations"]
    with pytest.raises(ValueError, match="--context-parallel 3 must be >= 1 and divide"):
        plan_layouts(MODEL_1B, gpus=8, gpu_memory_gib=141, tokens_per_gpu=4096, cp=3)


def test_pipeline_stages_hold_their_layers_and_the_first_keeps_pp_microbatches() -> None:
    """With PP the candidates are TP x PP x GTP x DP (PP fixed); a GPU holds its stage's layers
    (half the sharded weights at PP2) and the estimate is the fuller stage: under 1F1B the first
    keeps PP microbatches of its layers' activations, as many as the whole model keeps without
    PP, without the logits (the last stage's)."""
    plans = plan_layouts(MODEL_1B, gpus=8, gpu_memory_gib=141, tokens_per_gpu=4096, pp=2)
    names = {p.layout.name for p in plans}
    assert "TP1·PP2·GTP2·DP2" in names and "TP2·PP2·GTP2·DP1 +recompute" in names
    pp2 = estimate(MODEL_1B, Layout(1, 2, 2, pp=2), tokens_per_gpu=4096)
    pp1 = estimate(MODEL_1B, Layout(1, 2, 2), tokens_per_gpu=4096)
    stage = estimate(MODEL_1B.__class__(**{**vars(MODEL_1B), "layers": 12}), Layout(1, 2, 2),
                     tokens_per_gpu=4096)  # fmt: skip
    logits = 2 * 4096 * MODEL_1B.vocab * 4
    assert pp2["activations"] == pytest.approx(pp1["activations"] - logits)
    assert pp2["weights"] < pp1["weights"] and pp2["weights"] == pytest.approx(
        stage["weights"] - MODEL_1B.vocab * MODEL_1B.hidden * 2 - MODEL_1B.hidden * 2, rel=1e-9
    )  # the first stage: half the layers, the input embedding, no final norm
    assert "TP1·PP2·GTP2·DP1" in {p.layout.name for p in plan_layouts(
        MODEL_1B, gpus=4, gpu_memory_gib=80, tokens_per_gpu=4096, pp=2)}  # fmt: skip
    with pytest.raises(ValueError, match="--pipeline-parallel 3 must be >= 1 and divide"):
        plan_layouts(MODEL_1B, gpus=8, gpu_memory_gib=141, tokens_per_gpu=4096, pp=3)
    with pytest.raises(ValueError, match="does not split evenly over 5 pipeline stages"):
        estimate(MODEL_1B, Layout(1, 1, 1, pp=5), tokens_per_gpu=4096)


def test_muon_keeps_whole_state_per_rank() -> None:
    """Muon (design §1.6): non-distributed, so DP does not divide its state; GTP does (the
    shards' masters and momenta, 8 bytes per element); no shard_replicated layouts."""
    linear = MODEL_1B.layers * MODEL_1B.linear_params_per_layer
    replicated = MODEL_1B.embedding_params + (2 * MODEL_1B.layers + 1) * MODEL_1B.hidden
    ns = 3 * MODEL_1B.largest_linear * 2  # Newton-Schulz's bf16 copies of the largest matrix
    dp2 = estimate(MODEL_1B, Layout(1, 1, 2), tokens_per_gpu=4096, optimizer="muon")
    assert dp2["optimizer"] == pytest.approx(linear * 8 + replicated * 12 + ns)
    dp4 = estimate(MODEL_1B, Layout(1, 1, 4), tokens_per_gpu=4096, optimizer="muon")
    assert dp4["optimizer"] == dp2["optimizer"]
    gtp2 = estimate(MODEL_1B, Layout(1, 2, 1), tokens_per_gpu=4096, optimizer="muon")
    buckets = 2 * 256 * 2**20  # two buckets of gathered fp32 inputs in flight
    assert gtp2["optimizer"] == pytest.approx(linear / 2 * 8 + replicated * 12 + ns + buckets)
    plans = plan_layouts(
        MODEL_1B, gpus=4, gpu_memory_gib=141, tokens_per_gpu=4096, optimizer="muon"
    )
    assert plans and not any(p.layout.shard_replicated for p in plans)
    with pytest.raises(ValueError, match="--optimizer must be adam or muon"):
        estimate(MODEL_1B, Layout(1, 1, 2), tokens_per_gpu=4096, optimizer="sgd")


def test_recommendation_prefers_no_recompute_then_fewest_shards_then_tp() -> None:
    roomy = plan_layouts(MODEL_1B, gpus=4, gpu_memory_gib=141, tokens_per_gpu=4096)
    assert recommend(roomy).layout == Layout(1, 1, 4)
    # 24 GiB: replicated training does not fit; the fewest-shard layout that does is TP2
    tight = plan_layouts(MODEL_1B, gpus=4, gpu_memory_gib=24, tokens_per_gpu=4096)
    best = recommend(tight)
    assert best.fits and best.layout.tp * best.layout.gtp == 2 and best.layout.tp == 2
    assert not next(p for p in tight if p.layout == Layout(1, 1, 4)).fits
    with pytest.raises(ValueError, match=r"no layout fits: the smallest, .* GiB more than"):
        recommend(plan_layouts(MODEL_1B, gpus=2, gpu_memory_gib=8, tokens_per_gpu=8192))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gpus=0, gpu_memory_gib=80, tokens_per_gpu=1), "--gpus must be >= 1"),
        (dict(gpus=2, gpu_memory_gib=80, tokens_per_gpu=0), "--tokens-per-gpu must be >= 1"),
        (dict(gpus=2, gpu_memory_gib=-1, tokens_per_gpu=1), "--gpu-memory-gib must be > 0"),
        (
            dict(gpus=2, gpu_memory_gib=80, tokens_per_gpu=1, gpus_per_node=0),
            "--gpus-per-node must be >= 1",
        ),
    ],
)
def test_bad_planner_inputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_layouts(MODEL_1B, **kwargs)
    with pytest.raises(ValueError, match="model.hidden must be >= 1"):
        ModelShape(layers=1, hidden=0, ffn=1, heads=1, vocab=1, seq=1)
    with pytest.raises(ValueError, match="moe_router_topk=9 must be between 1 and num_moe_expe"):
        ModelShape(layers=1, hidden=8, ffn=8, heads=1, vocab=8, seq=8, experts=8, topk=9)


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["configs/gpt_1b.yaml", "--gpus", "2", "--gpu-memory-gib", "141"]
    assert main([*argv, "--tokens-per-gpu", "4096"]) == 0
    out = capsys.readouterr().out
    assert "recommended: TP1·GTP1·DP2" in out and "TP1·GTP2·DP1 +shard_replicated" in out
    assert (
        main(["--layers", "2", "--gpus", "2", "--gpu-memory-gib", "1", "--tokens-per-gpu", "1"])
        == 2
    )
    assert "--hidden --heads --vocab --seq" in capsys.readouterr().err
    assert (
        main(["configs/nope.yaml", "--gpus", "2", "--gpu-memory-gib", "8", "--tokens-per-gpu", "1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "python -m nemo_gtp.plan: error: recipe file 'configs/nope.yaml' not found" in err
    too_big = [
        "--layers",
        "200",
        "--hidden",
        "16384",
        "--heads",
        "128",
        "--vocab",
        "256000",
        "--seq",
        "8192",
        "--gpus",
        "2",
        "--gpu-memory-gib",
        "80",
        "--tokens-per-gpu",
        "8192",
    ]
    assert main(too_big) == 1
    assert "no layout fits" in capsys.readouterr().err


# Peak allocated memory measured on 2×H200 (1.2 B recipe, bf16, distributed optimizer, fp32
# grads), GiB: (layout, tokens per GPU, flash attention, coalesce_mb) -> measured.
MEASURED = {
    (Layout(1, 1, 2), 2048, False, 0): 20.90,
    (Layout(1, 2, 1), 2048, False, 0): 18.39,
    (Layout(1, 1, 2), 4096, False, 0): 27.38,
    (Layout(1, 2, 1), 4096, False, 0): 24.86,
    (Layout(1, 1, 2), 8192, False, 0): 40.41,
    (Layout(1, 2, 1), 8192, False, 0): 37.89,
    (Layout(1, 1, 2), 2048, True, 0): 17.77,
    (Layout(1, 2, 1), 2048, True, 0): 15.22,
    (Layout(1, 1, 2), 4096, True, 0): 21.13,
    (Layout(1, 2, 1), 4096, True, 0): 18.62,
    (Layout(1, 1, 2), 8192, True, 0): 27.92,
    (Layout(1, 2, 1), 8192, True, 0): 25.40,
    # PP2 (stage 0's rank, 2 microbatches per step = PP, default coalesce_mb): each rank's
    # allocator peak on one H200 shared by four ranks, bench/results/2026-12-03_pipeline_1xH200.md
    (Layout(1, 1, 2, pp=2), 4096, False, 192): 20.49,
    (Layout(1, 2, 1, pp=2), 4096, False, 192): 21.06,
    # coalescing units (GTPConfig.coalesce_mb), local spec
    (Layout(1, 2, 1), 2048, False, 96): 18.86,
    (Layout(1, 2, 1), 2048, False, 192): 19.79,
    (Layout(1, 2, 1), 4096, False, 96): 25.33,
    (Layout(1, 2, 1), 4096, False, 192): 26.27,
}
# The largest-model benchmark (bench/bench_max_model.py, 2×H200): hidden 4096, ffn 16384, 32
# heads, sequence 4096, 4096 tokens per GPU, megatron's fp32 softmax; (layout, layers) -> GiB.
MEASURED_4K = {
    (Layout(1, 2, 1), 20): 116.11,
    (Layout(1, 2, 1), 23): 131.67,
    (Layout(1, 1, 2), 21): 129.67,
    (Layout(1, 2, 1, recompute=True), 37): 79.48,
    (Layout(1, 2, 1, recompute=True), 69): 134.49,
}


# Muon (MuonOptimizerModule, non-distributed; local spec, 4096 tokens per GPU, default
# coalesce_mb): each rank's allocator peak on one H200 shared by two ranks,
# bench/results/2026-12-03_muon_1xH200.md section 5.
MEASURED_MUON = {Layout(1, 1, 2): 30.02, Layout(1, 2, 1): 24.02}


@pytest.mark.parametrize(("layout", "measured"), MEASURED_MUON.items(), ids=str)
def test_muon_prediction_within_5_percent_of_measured_peak(layout: Layout, measured: float) -> None:
    bytes_ = estimate(
        MODEL_1B, layout, tokens_per_gpu=4096, overhead_gib=0.0, optimizer="muon", coalesce_mb=192
    )
    predicted = sum(bytes_.values()) / GIB
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


@pytest.mark.parametrize(("key", "measured"), MEASURED.items(), ids=str)
def test_prediction_within_10_percent_of_measured_peak(key: tuple, measured: float) -> None:
    layout, tokens, flash, coalesce_mb = key
    bytes_ = estimate(
        MODEL_1B,
        layout,
        tokens_per_gpu=tokens,
        overhead_gib=0.0,
        flash_attention=flash,
        coalesce_mb=coalesce_mb,
    )
    predicted = sum(bytes_.values()) / GIB
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


@pytest.mark.parametrize(("key", "measured"), MEASURED_4K.items(), ids=str)
def test_prediction_within_10_percent_of_largest_model_peaks(key: tuple, measured: float) -> None:
    layout, layers = key
    model = ModelShape(
        layers=layers, hidden=4096, ffn=16384, heads=32, vocab=32000, seq=4096, softmax_fp32=True
    )
    predicted = sum(estimate(model, layout, tokens_per_gpu=4096, overhead_gib=0.0).values()) / GIB
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_model_from_nemo_recipe_reads_the_config_and_the_cli_takes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape, seq = model_from_nemo_recipe("llama3_8b", ["model.config.num_layers=2"])
    assert (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.query_groups) == (
        2, 4096, 14336, 32, 8
    )  # fmt: skip
    assert (shape.vocab, seq, shape.gated, shape.tied_embeddings) == (128256, 8192, True, False)
    with pytest.raises(ValueError, match="did you mean 'model.config.num_layers'"):
        model_from_nemo_recipe("llama3_8b", ["model.config.num_layrs=2"])
    with pytest.raises(ValueError, match="did you mean 'llama3_8b'"):
        model_from_nemo_recipe("llama3_8x")
    argv = ["--recipe", "llama3_8b", "model.config.num_layers=2", "--gpus", "2"]
    assert main([*argv, "--gpu-memory-gib", "80"]) == 0
    assert "8192 tokens per GPU" in capsys.readouterr().out


def test_the_recommended_line_says_why_and_the_table_has_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--layers", "126", "--hidden", "16384", "--ffn", "53248", "--heads", "128"]
    argv = [*shape, "--vocab", "128256", "--seq", "8192", "--flash-attention"]
    assert main([*argv, "--gpus", "128", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "GiB per GPU" in out.splitlines()[1]  # the unit over the byte columns
    recommended = out.splitlines()[-1]
    assert recommended.startswith("recommended: TP8·GTP")
    assert "of 80 GiB per GPU): without GTP nothing fits: the smallest, TP8·GTP1·DP16" in (
        recommended
    )
    plans = plan_layouts(MODEL_1B, gpus=2, gpu_memory_gib=141, tokens_per_gpu=4096)
    assert why(plans, recommend(plans)) == "fits without GTP: plain TP + DP, no gathers"
    kwargs = dict(gpus=2, gpu_memory_gib=30, tokens_per_gpu=4096, gpus_per_node=1)
    plans = plan_layouts(MODEL_1B, **kwargs)  # 30.9 GiB for TP1·DP2, 29.6 for TP1·GTP2
    best = recommend(plans)  # TP1·DP2 fits only with recompute; GTP2 without it
    assert best.layout.gtp == 2 and not best.layout.recompute
    assert why(plans, best).startswith("without GTP only TP1·GTP1·DP2 +recompute fits")
    # megatron splits heads and key/value groups over TP: no TP that does not divide them
    odd = ModelShape(layers=2, hidden=96, ffn=384, heads=6, vocab=100, seq=16, query_groups=3)
    tps = {p.layout.tp for p in plan_layouts(odd, gpus=8, gpu_memory_gib=80, tokens_per_gpu=16)}
    assert tps == {1}  # 8 GPUs: TP 1, 2, 4, 8; only 1 divides 6 heads in 3 groups


MOE = ModelShape(
    layers=4, hidden=64, ffn=128, heads=4, vocab=100, seq=16, gated=True,
    experts=8, expert_ffn=96, topk=2, shared_ffn=32, moe_layers=3,
)  # fmt: skip


def test_moe_experts_counted_and_split_over_ep_tp_egtp() -> None:
    """Routed experts (Mixtral, DeepSeek): their weights and gradients split over EP × TP × EGTP,
    their Adam state also over the expert data ranks; the router stays whole; the shared
    expert and attention shard like dense linears; EGTP adds the experts' gather buffers."""
    routed = 8 * 64 * 96 * 3  # one MoE layer's experts (gated fc1: 2 x 96)
    assert MOE.expert_params_per_layer == routed and MOE.moe_layer_count == 3
    dense = dataclasses.replace(MOE, experts=0)
    swap = routed + 8 * 64 + 64 * 32 * 3 - 64 * 128 * 3  # experts + router + shared - dense MLP
    assert MOE.parameters == dense.parameters + 3 * swap
    base = dict(tokens_per_gpu=16, overhead_gib=0, param_bytes=2, grad_bytes=4)
    one = estimate(MOE, Layout(tp=1, gtp=2, dp=2), **base)
    split = estimate(MOE, Layout(tp=1, gtp=2, dp=2, ep=2, egtp=2), **base)
    assert one["weights"] - split["weights"] == pytest.approx(3 * routed * 2 * (1 - 1 / 4))
    assert one["grads"] - split["grads"] == pytest.approx(3 * routed * 4 * (1 - 1 / 4))
    # Adam state over the expert data ranks: (GTP·DP)/(EP·EGTP) = 4 and 1: the same bytes
    assert one["optimizer"] == pytest.approx(split["optimizer"])
    assert split["gather"] > one["gather"] > 0  # EGTP gathers the experts too
    assert Layout(tp=1, gtp=2, dp=2, ep=2, egtp=2).name == "TP1·GTP2·DP2 EP2·EGTP2"
    plans = plan_layouts(MOE, gpus=4, gpu_memory_gib=80, tokens_per_gpu=16)
    splits = {(p.layout.ep, p.layout.egtp) for p in plans if p.layout.gtp == 4}
    assert splits == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    assert recommend(plans).layout.name == "TP1·GTP1·DP4"  # a tiny model: no shards at all


def test_moe_layer_frequency_as_megatron_writes_it() -> None:
    from nemo_gtp.recipes.model_size import moe_layer_count

    assert moe_layer_count(1, 4) == 4 and moe_layer_count(2, 5) == 3
    assert moe_layer_count([0, 1, 1], 3) == 2
    assert moe_layer_count("([0]*1+[1]*26)", 27) == 26
    with pytest.raises(ValueError, match="moe_layer_freq"):
        moe_layer_count("__import__('os')", 3)

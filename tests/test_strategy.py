"""``GTPMegatronStrategy`` end to end with a real ``nl.Trainer`` on CPU/gloo, plus its checks.

Parity oracle: GTP at (TP=t, GTP=g, DP=d) reproduces plain ``MegatronStrategy`` at (TP=t,
DP=g*d) at the same global batch: per-step loss and grad norm within 1e-5 relative (fp32), for
10 steps of NeMo's llm.GPTModel (local spec), megatron DDP + distributed Adam, clip_grad=1.0, a
cosine LR schedule with warmup. The 2-rank fits share one spawn; the 4-rank ones share theirs
with ``test_strategy_checkpoint.py``'s first launch (``tests.harness.shared_launch.shared_launch``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

from nemo_gtp.engine import GTPConfig
from tests.harness.cp_attention import cp_local_layer_spec
from tests.harness.shared_launch import shared_launch
from tests.harness.strategy import (
    BANNER_PREFIX,
    GBS,
    MBS,
    STEPS,
    VAL_BATCHES,
    Fit,
    pipelined,
)

TOL = 1e-5


FP8_PARAM_FIT = dict(  # NeMo's precision plugin puts fp8_recipe into the OptimizerConfig too
    model_kwargs=dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True),
    optim_kwargs=dict(fp8_recipe="tensorwise"),
)
# blockwise FP8 primary shards own TE's 128x128 tiles: every linear's GTP2 shard whole tiles
FP8_BLOCK_PARAM_FIT = dict(
    model_kwargs=dict(
        fp8="hybrid", fp8_recipe="blockwise", fp8_param=True, hidden_size=256, ffn_hidden_size=512
    ),
    optim_kwargs=dict(fp8_recipe="blockwise"),
)
PRESHARD_ALL = {"gtp_config": GTPConfig(preshard_linears="all")}  # megatron-local linears too
UNLOGGED_STEP = 3  # a step log_every_n_steps=3 does not log ((3 + 1) % 3 != 0)
TWO_RANK_FITS = [
    Fit("base_tp1_dp2", host_reads_at=UNLOGGED_STEP),
    Fit("tp1_gtp2", gtp=2, metrics=True),
    Fit("tp1_gtp2_log3", gtp=2, metrics=True, log_every=3, host_reads_at=UNLOGGED_STEP),
    Fit("gtp_off", gtp_strategy=True),
    Fit("base_bf16", steps=4, bf16=True),
    Fit("tp1_gtp2_bf16", gtp=2, steps=4, bf16=True),
    Fit("base_plain_adam", steps=5, distopt=False),
    Fit("tp1_gtp2_plain_adam", gtp=2, steps=5, distopt=False),
    Fit("base_muon", steps=5, distopt=False, muon=True),  # MuonOptimizerModule (design §1.6)
    Fit("tp1_gtp2_muon", gtp=2, steps=5, distopt=False, muon=True, metrics=True),
    Fit(
        "tp1_gtp2_shard_replicated",
        gtp=2,
        strategy_kwargs={"gtp_config": GTPConfig(shard_replicated_params_over_gtp=True)},
    ),
    Fit(
        "tp1_gtp2_presharded",
        gtp=2,
        strategy_kwargs=PRESHARD_ALL,
    ),
    # megatron's fp8_param (design §1.3 "FP8 primary weights"): GTP2 with FP8 primary shards vs
    # DP2 whose linear weights are megatron's FP8 params emulated on full weights
    Fit("base_fp8_param", steps=3, emulate_fp8_params=True, **FP8_PARAM_FIT),
    Fit("tp1_gtp2_fp8_param", gtp=2, steps=3, **FP8_PARAM_FIT),
    Fit("base_fp8_block_param", steps=3, emulate_fp8_params=True, **FP8_BLOCK_PARAM_FIT),
    Fit("tp1_gtp2_fp8_block_param", gtp=2, steps=3, **FP8_BLOCK_PARAM_FIT),
]
shared_launch(2).add(TWO_RANK_FITS)  # one 2-rank spawn with test_hf_export's fit


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    results = shared_launch(2).results(tmp_path_factory)
    return {fit.name: results[fit.name] for fit in TWO_RANK_FITS}


# The TP1 pair also validates in the fit (a sanity check, then every VAL_EVERY steps), then
# validates and tests after it on the same trainer; the GTP run saves its final state, which
# fresh trainers that never ran fit validate and test (GTP and plain); two more validate a
# freshly built model without any checkpoint.
VAL_EVERY = 4
EVAL = dict(val_every=VAL_EVERY, sanity_val_steps=1, evaluate_after=True)
# context parallelism through NeMo (design §1.4 "CP"): megatron's CP attention is TE's, so on
# CPU its stand-in (tests.harness.cp_attention); NeMo's data step cuts each sample for its CP rank
CP2 = dict(
    strategy_kwargs={"context_parallel_size": 2},
    model_kwargs={"transformer_layer_spec": cp_local_layer_spec},
)
FOUR_RANK_FITS = [
    Fit("base_tp1_dp4", **EVAL),
    Fit("tp1_gtp2_dp2", gtp=2, save_to="tp1_gtp2_dp2_saved", **EVAL),
    Fit("base_tp2_dp2", tp=2),
    Fit("tp2_gtp2", tp=2, gtp=2),
    # megatron-local linears built as their shards at TP2 (CPU initialization: a TP-global
    # master per layer, design §3.1 "Exact init")
    Fit("tp2_gtp2_presharded", tp=2, gtp=2, strategy_kwargs=PRESHARD_ALL),
    Fit("base_cp2_dp2", **CP2),
    Fit("tp1_cp2_gtp2", gtp=2, **CP2),
    # pipeline parallelism (design §1.4 "PP"): NeMo's 1F1B and interleaved schedules
    Fit("base_pp2_dp2", **pipelined(2)),
    Fit("pp2_gtp2", gtp=2, **pipelined(2)),
    Fit("base_vpp2_dp2", **pipelined(2, vp=2)),
    Fit("vpp2_gtp2", gtp=2, **pipelined(2, vp=2)),
    Fit("gtp_validate_fresh", gtp=2, entry="validate", resume_from="tp1_gtp2_dp2_saved"),
    Fit("gtp_test_fresh", gtp=2, entry="test", resume_from="tp1_gtp2_dp2_saved"),
    Fit("base_validate_fresh", entry="validate", resume_from="tp1_gtp2_dp2_saved"),
    Fit("gtp_validate_init", gtp=2, entry="validate"),
    Fit("base_validate_init", entry="validate"),
    # PEFT (design §1.1 "Frozen weights"), set up as llm.finetune sets it up: NeMo's LoRA (the
    # model frozen, adapters beside every linear); the attention frozen, the rest trained
    Fit("base_lora_dp4", peft="lora", weights_to="base_lora.pt"),
    Fit("lora_gtp2", gtp=2, peft="lora", weights_to="lora_gtp2.pt"),
    Fit("base_frozen_attention_dp4", peft="freeze_attention"),
    Fit("frozen_attention_gtp2", gtp=2, peft="freeze_attention"),
    # NeMo's canonical LoRA (adapters per q / k / v projection); DoRA, refused under GTP
    Fit("base_canonical_lora_dp4", peft="canonical_lora"),
    Fit("canonical_lora_gtp2", gtp=2, peft="canonical_lora"),
    Fit("dora_gtp2", gtp=2, peft="dora", expect_error=True),
]
shared_launch(4).add(FOUR_RANK_FITS)  # one 4-rank spawn with test_strategy_checkpoint's first


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    results = shared_launch(4).results(tmp_path_factory)
    return {fit.name: results[fit.name] for fit in FOUR_RANK_FITS}


def _assert_parity(
    gtp: list[dict[str, Any]],
    base: list[dict[str, Any]],
    tol: float = TOL,
    steps: int = STEPS,
    clips: bool = True,
) -> float:
    worst = 0.0
    for g, b in zip(gtp, base, strict=True):
        assert len(g["losses"]) == len(b["losses"]) == steps
        for what in ("losses", "grad_norms"):
            for step, (x, y) in enumerate(zip(g[what], b[what], strict=True)):
                err = abs(x - y) / abs(y) if y else abs(x)  # PP: no loss on some ranks
                worst = max(worst, err)
                assert err <= tol, f"{g['name']} {what} step {step}: {x} vs {y} ({err:.2e})"
    assert not clips or base[0]["grad_norms"][0] > 1.0  # clip_grad=1.0 really clips
    print(f"[strategy parity] {gtp[0]['name']}: max rel err {worst:.2e}")
    return worst


# ------------------------------------------------------------------------------ end to end
def test_parity_tp1_gtp2_dp1(two_ranks: dict) -> None:
    _assert_parity(two_ranks["tp1_gtp2"], two_ranks["base_tp1_dp2"])


def test_parity_default_ddp_non_distributed_optimizer(two_ranks: dict) -> None:
    """ddp='megatron' (no overlap) + megatron's FP32Optimizer: grad norm via ``shared`` marks."""
    _assert_parity(two_ranks["tp1_gtp2_plain_adam"], two_ranks["base_plain_adam"], steps=5)


def test_parity_muon(two_ranks: dict) -> None:
    """Muon for the hidden matrices, Adam for the rest (``MuonOptimizerModule``), NeMo's lr
    schedule over both: GTP2 (Muon inputs gathered over GTP) reproduces DP2 on plain
    ``MegatronStrategy`` with the same optimizer."""
    for fit in ("tp1_gtp2_muon", "base_muon"):
        for rank in two_ranks[fit]:
            assert rank["inner_optimizers"] == ["AdamW", "GTPMuon"], rank["inner_optimizers"]
    _assert_parity(two_ranks["tp1_gtp2_muon"], two_ranks["base_muon"], steps=5)
    adam = two_ranks["base_plain_adam"][0]["losses"]
    assert two_ranks["base_muon"][0]["losses"][1:] != adam[1:]  # Muon did update the matrices
    # the metrics callback counts the state of both chained optimizers (a chain of two used to
    # fail its accounting: megatron's ChainedOptimizer.optimizer asserts a chain of one)
    for rank in two_ranks["tp1_gtp2_muon"]:
        assert rank["metrics"]["gtp/optimizer_bytes"] > 0


def test_presharded_linears_register_through_the_strategy(two_ranks: dict) -> None:
    """Linears built as their shard by the rewritten layer spec (the path NeMo's default TE spec
    takes on GPUs; here megatron's local linears via ``preshard_linears="all"``) own no runtime
    until the model transform registers them, after NeMo's ``configure_model``: the strategy's
    setup must not ask them for one (it used to raise "not registered with a live GTPRuntime").
    Built from the same seed with nothing copied in, they start with the unsharded model's rows
    (design §3.1 "Exact init"): the fit matches DP2."""
    for rank in two_ranks["tp1_gtp2_presharded"]:
        assert rank["presharded_modules"] == 8  # qkv, proj, fc1, fc2 of 2 layers
        assert rank["gtp_params"] == 8 and rank["fallback_allocations"] == 0
    presharded, base = two_ranks["tp1_gtp2_presharded"], two_ranks["base_tp1_dp2"]
    assert [r["losses"][0] for r in presharded] == [r["losses"][0] for r in base]
    _assert_parity(presharded, base)


def test_fp8_param_makes_fp8_primary_shards(two_ranks: dict) -> None:
    """megatron's ``fp8_param`` through the strategy (design §1.3 "FP8 primary weights"): the
    model transform makes every GTP shard FP8 (fp32 training dtype here), routes megatron's
    FP8-param functions to them, the distributed optimizer keeps fp32 masters and writes each
    shard back exactly (bytes and the whole master's scale); every gather moves the shards' own
    FP8 bytes with no refresh cast; losses and grad norms equal DP2 with megatron's FP8 params
    emulated on full weights (measured 3e-8; without the emulation the grad norms differ by
    5e-4, so the tolerance sees it)."""
    _assert_parity(two_ranks["tp1_gtp2_fp8_param"], two_ranks["base_fp8_param"], 1e-6, steps=3)
    for rank in two_ranks["tp1_gtp2_fp8_param"]:
        state = rank["fp8_primary"]
        assert rank["shard_dtypes"] == ["torch.float8_e4m3fn"]
        assert state["shards"] == 8 and state["training_dtypes"] == ["torch.float32"]
        assert state["master_dtypes"] == ["torch.float32"] and state["hooks_installed"]
        assert state["fp8_quantizes"] == 0 and state["fp8_gathers"] == state["gathers"] > 0
        assert state["write_back_errors"] == []


def test_fp8_param_blockwise_makes_fp8_primary_shards(two_ranks: dict) -> None:
    """The same with ``fp8_recipe="blockwise"`` (design §1.3 "FP8 primary weights"): every
    shard FP8 and owning its 128x128 tiles, written back exactly (bytes and tile scales), every
    gather FP8 with no refresh cast; losses and grad norms equal DP2 with megatron's blockwise
    FP8 params emulated on full weights."""
    fits = two_ranks["tp1_gtp2_fp8_block_param"], two_ranks["base_fp8_block_param"]
    _assert_parity(*fits, 1e-6, steps=3)
    for rank in two_ranks["tp1_gtp2_fp8_block_param"]:
        state = rank["fp8_primary"]
        assert rank["shard_dtypes"] == ["torch.float8_e4m3fn"] and state["shards"] == 8
        assert state["fp8_quantizes"] == 0 and state["fp8_gathers"] == state["gathers"] > 0
        assert state["write_back_errors"] == []


def test_parity_shard_replicated_params_over_gtp(two_ranks: dict) -> None:
    """GTPConfig(shard_replicated_params_over_gtp=True) through NeMo: replicated params' DDP
    buffer and distributed optimizer span DP x GTP, the GTP shards get their own optimizer."""
    for rank in two_ranks["tp1_gtp2_shard_replicated"]:
        assert rank["ddp_dp_size"] == rank["optimizer_dp_size"] == 2
        assert rank["chained_optimizers"] == 2 and rank["gtp_params"] == 8
    _assert_parity(two_ranks["tp1_gtp2_shard_replicated"], two_ranks["base_tp1_dp2"])


def test_teardown_keeps_no_finished_fit_alive(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A process that runs fit after fit does not accumulate them: every fit of both shared
    launches (every test module's, on every rank) leaves no megatron model and no GTP weight
    alive once torn down. Three holders kept one each: megatron DDP's grad hooks (a cycle
    through autograd's C++ nodes that the collector never frees), NeMo's one-per-process
    OneLogger callback (the fit's ``log`` methods) and megatron's class-level RoPE cache;
    ``teardown_fit`` releases all three, then collects until nothing more is freed. A fit that
    failed (``dora_gtp2``) keeps its model through its exception's frames."""
    kept = {
        name: [(rank["models_kept_by_fit"], rank["gtp_weights_kept_by_fit"]) for rank in ranks]
        for world in (2, 4)
        for name, ranks in shared_launch(world).results(tmp_path_factory).items()
        if name != "dora_gtp2"
    }
    assert {name: counts for name, counts in kept.items() if any(map(any, counts))} == {}


def test_parity_tp1_gtp2_dp2(four_ranks: dict) -> None:
    _assert_parity(four_ranks["tp1_gtp2_dp2"], four_ranks["base_tp1_dp4"])


def test_parity_tp2_gtp2(four_ranks: dict) -> None:
    _assert_parity(four_ranks["tp2_gtp2"], four_ranks["base_tp2_dp2"])


def test_parity_tp2_gtp2_linears_built_as_shards(four_ranks: dict) -> None:
    """At TP2 the pre-sharded linears' exact init runs on megatron's TP-global CPU master:
    the fit starts from the non-GTP run's weights (first loss identical) and matches it."""
    presharded, base = four_ranks["tp2_gtp2_presharded"], four_ranks["base_tp2_dp2"]
    assert all(rank["presharded_modules"] == 8 for rank in presharded)
    assert [r["losses"][0] for r in presharded] == [r["losses"][0] for r in base]
    _assert_parity(presharded, base)


def test_parity_cp2_gtp2(four_ranks: dict) -> None:
    """TP1·CP2·GTP2 vs TP1·CP2·DP2 through NeMo's Trainer: the CP peers of a GTP rank hold its
    shards, DDP reduces over CP x replicate."""
    _assert_parity(four_ranks["tp1_cp2_gtp2"], four_ranks["base_cp2_dp2"])


PIPELINE_PAIRS = [("pp2_gtp2", "base_pp2_dp2"), ("vpp2_gtp2", "base_vpp2_dp2")]


@pytest.mark.parametrize("gtp, base", PIPELINE_PAIRS)
def test_parity_pipeline(four_ranks: dict, gtp: str, base: str) -> None:
    """PP2·GTP2 vs PP2·DP2 through NeMo's Trainer, with 1F1B and with two model chunks per
    rank (interleaved): each chunk is sharded and runs its own chains (design §1.4 "PP")."""
    _assert_parity(four_ranks[gtp], four_ranks[base])
    chunks = 2 if gtp.startswith("vpp") else 1
    for rank in four_ranks[gtp]:  # 2 of the 4 layers per stage: qkv, proj, fc1, fc2 each
        assert rank["gtp_params"] == 8 and rank["gtp_runtimes"] == chunks
        assert all(left == NOTHING_OUTSTANDING[0] for left in rank["leftovers"])


def test_parity_lora(four_ranks: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """NeMo's LoRA under GTP (``llm.finetune``'s setup): the frozen base linears are the GTP
    shards (8: qkv, proj, fc1, fc2 of 2 layers), the rank-4 adapters stay replicated, and no
    shard reduces a wgrad or holds a grad. TP1·GTP2·DP2 reproduces DP4: losses, grad norms, and
    every weight at the end (adapters trained, base untouched)."""
    _assert_parity(four_ranks["lora_gtp2"], four_ranks["base_lora_dp4"], clips=False)
    for rank in four_ranks["lora_gtp2"]:
        assert rank["gtp_params"] == rank["frozen_gtp_params"] == 8
        assert rank["reduce_scatters"] == 0 and rank["gtp_params_with_grad"] == 0
    root = shared_launch(4).out_dir
    got = torch.load(root / "lora_gtp2.pt", weights_only=True)
    want = torch.load(root / "base_lora.pt", weights_only=True)
    assert got.keys() == want.keys()
    # NeMo's adapter wrapper names its base weight as the unwrapped linear's
    assert any(".adapter." in name for name in want)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=TOL, atol=1e-7, msg=name)


def test_parity_partly_frozen_model(four_ranks: dict) -> None:
    """The attention's linears frozen, the MLP's trained: a chain (and a coalescing unit) of
    frozen and trained GTP weights. The frozen ones reduce no wgrad; the unit's reduce-scatter
    covers its trained members alone (it used to wait for wgrads that never come). GTP2·DP2
    reproduces DP4."""
    _assert_parity(four_ranks["frozen_attention_gtp2"], four_ranks["base_frozen_attention_dp4"])
    steps_and_microbatches = STEPS * GBS // (MBS * 4)  # per rank: 4 data ranks (DP2 x GTP2)
    for rank in four_ranks["frozen_attention_gtp2"]:
        assert rank["gtp_params"] == 8 and rank["frozen_gtp_params"] == 4
        assert rank["reduce_scatters"] == 4 * steps_and_microbatches  # fc1, fc2 of 2 layers
        assert rank["gtp_params_with_grad"] == 0


def test_parity_canonical_lora_and_dora_refused(four_ranks: dict) -> None:
    """NeMo's canonical LoRA (one adapter per q, k and v inside the fused qkv linear, which
    stays one frozen GTP shard) at TP1·GTP2·DP2 reproduces DP4. NeMo's DoRA reads each wrapped
    linear's whole weight in every forward, a shard under GTP (it failed on a shape mismatch in
    the forward): refused at the model transform on every rank, naming what to use instead."""
    gtp, base = four_ranks["canonical_lora_gtp2"], four_ranks["base_canonical_lora_dp4"]
    _assert_parity(gtp, base, clips=False)
    for rank in gtp:
        assert rank["gtp_params"] == rank["frozen_gtp_params"] == 8
    for rank in four_ranks["dora_gtp2"]:
        assert rank["error"].startswith("ValueError: NeMo's DoRA"), rank["error"]
        assert "llm.peft.LoRA()" in rank["error"]


# ------------------------------------------------------------------------------ evaluation
def _close(x: float, y: float, what: str, tol: float = TOL) -> float:
    err = abs(x - y) / abs(y)
    assert err <= tol, f"{what}: {x} vs {y} ({err:.2e})"
    return err


NOTHING_OUTSTANDING = [{"gathers": 0, "reduce_scatters": 0}]


def test_validation_in_fit_matches_baseline(four_ranks: dict) -> None:
    """A sanity check and a validation every VAL_EVERY steps during the fit: every validation
    step's loss, each logged ``val_loss`` and the training curve match the DP4 run; no gather or
    reduce-scatter is outstanding when a validation ends or the next training step starts."""
    worst = 0.0
    for gtp, base in zip(four_ranks["tp1_gtp2_dp2"], four_ranks["base_tp1_dp4"], strict=True):
        for kind in ("sanity", "val"):
            assert len(gtp["eval_steps"][kind]) == len(base["eval_steps"][kind])
        assert len(gtp["eval_steps"]["sanity"]) == 1
        # every VAL_EVERY steps of the fit (none at max_steps), then trainer.validate after it
        assert [s for s, _ in gtp["val_loss"]] == [VAL_EVERY, 2 * VAL_EVERY, STEPS]
        # (one microbatch per step here: NeMo multiplies limit_val_batches by the microbatches
        # at every setup, so a second run on the same trainer validates more steps otherwise)
        assert len(gtp["eval_steps"]["val"]) == VAL_BATCHES * len(gtp["val_loss"])
        for kind in ("sanity", "val"):
            pairs = zip(gtp["eval_steps"][kind], base["eval_steps"][kind], strict=True)
            for (step, x), (bstep, y) in pairs:
                assert step == bstep
                worst = max(worst, _close(x, y, f"{kind} step at {step}"))
        for (step, x), (_, y) in zip(gtp["val_loss"], base["val_loss"], strict=True):
            worst = max(worst, _close(x, y, f"val_loss at step {step}"))
        # NeMo's val_loss reached the trainer's logger (at Lightning's logging step)
        assert [v for _, v in gtp["logged_val_loss"]] == [v for _, v in gtp["val_loss"]]
        assert [s for s, _ in gtp["logged_val_loss"]] == [s for s, _ in base["logged_val_loss"]]
        # the sanity check, 2 validations in the fit, then validate and test after it; a
        # training step follows the first three
        assert gtp["outstanding_at_eval_end"] == [NOTHING_OUTSTANDING] * 5
        assert gtp["outstanding_at_next_step"] == [NOTHING_OUTSTANDING] * 3
    _assert_parity(four_ranks["tp1_gtp2_dp2"], four_ranks["base_tp1_dp4"])
    print(f"[validation parity] in fit: max rel err {worst:.2e}")


def test_validate_and_test_after_fit(four_ranks: dict) -> None:
    """``trainer.validate`` and ``trainer.test`` on the trainer that just ran fit match DP4."""
    for gtp, base in zip(four_ranks["tp1_gtp2_dp2"], four_ranks["base_tp1_dp4"], strict=True):
        _close(gtp["validate_after"], base["validate_after"], "validate after fit")
        assert len(gtp["eval_steps"]["test"]) == VAL_BATCHES
        pairs = zip(gtp["eval_steps"]["test"], base["eval_steps"]["test"], strict=True)
        for (_, x), (_, y) in pairs:
            _close(x, y, "test step after fit")
        assert gtp["leftovers_after"] == NOTHING_OUTSTANDING


def test_validate_and_test_on_a_fresh_trainer(four_ranks: dict) -> None:
    """A trainer and model that never ran fit: ``trainer.validate(ckpt_path=...)`` of the GTP
    run's saved state gives the loss that run's own ``trainer.validate`` gave, under GTP and
    under plain MegatronStrategy; ``trainer.test`` likewise; and a freshly initialized model
    validates to the same loss with and without GTP."""
    reference = four_ranks["tp1_gtp2_dp2"]
    for name in ("gtp_validate_fresh", "base_validate_fresh"):
        for rank, ref in zip(four_ranks[name], reference, strict=True):
            _close(rank["returned"][0]["val_loss"], ref["validate_after"], name)
            assert len(rank["eval_steps"]["val"]) == VAL_BATCHES
    for rank, ref in zip(four_ranks["gtp_test_fresh"], reference, strict=True):
        pairs = zip(rank["eval_steps"]["test"], ref["eval_steps"]["test"], strict=True)
        for (_, x), (_, y) in pairs:
            _close(x, y, "test step, fresh trainer")
    for gtp, base in zip(
        four_ranks["gtp_validate_init"], four_ranks["base_validate_init"], strict=True
    ):
        _close(gtp["returned"][0]["val_loss"], base["returned"][0]["val_loss"], "fresh model")
    for name in ("gtp_validate_fresh", "gtp_test_fresh", "gtp_validate_init"):
        for rank in four_ranks[name]:
            assert rank["gtp_params"] == 8 and rank["leftovers_after"] == NOTHING_OUTSTANDING
    walls = {name: f"{runs[0]['wall_s']:.1f} s" for name, runs in four_ranks.items()}
    print(f"[evaluation] wall time per fit (rank 0): {walls}")


def test_parity_bf16_shards_have_training_dtype(two_ranks: dict) -> None:
    """bf16-mixed: NeMo's Float16Module conversion runs before sharding (bf16 shards)."""
    assert all(r["shard_dtypes"] == ["torch.bfloat16"] for r in two_ranks["tp1_gtp2_bf16"])
    _assert_parity(two_ranks["tp1_gtp2_bf16"], two_ranks["base_bf16"], tol=1e-4, steps=4)


def test_gtp_off_is_plain_megatron_strategy(two_ranks: dict) -> None:
    for off, base in zip(two_ranks["gtp_off"], two_ranks["base_tp1_dp2"], strict=True):
        assert off["losses"] == base["losses"] and off["grad_norms"] == base["grad_norms"]
        assert off["ddp_class"] == "DDP" and off["gtp_params"] == 0 and off["banners"] == []
        assert not off["gtp_finalize"] and not off["drain_callback"]


@pytest.mark.parametrize(
    "fixture, name, dp",
    [
        ("two_ranks", "tp1_gtp2", 1),
        ("four_ranks", "tp1_gtp2_dp2", 2),
        ("four_ranks", "tp2_gtp2", 1),
    ],
)
def test_wiring(request: pytest.FixtureRequest, fixture: str, name: str, dp: int) -> None:
    """DDP and the distributed optimizer reduce over the replicate group (DP, not DP x GTP)."""
    for rank in request.getfixturevalue(fixture)[name]:
        assert rank["ddp_class"] == "BoundGTPNeMoDDP"
        assert rank["ddp_dp_size"] == rank["optimizer_dp_size"] == dp
        # NeMo's distributed_sampler_kwargs see the data group: DP x GTP ranks
        assert rank["sampler_kwargs"] == {"num_replicas": 2 * dp, "rank": rank["data_rank"]}
        assert rank["gtp_finalize"] and rank["drain_callback"]
        assert rank["gtp_params"] == 8  # qkv, proj, fc1, fc2 x 2 layers
        assert rank["fallback_allocations"] == 0


@pytest.mark.parametrize(
    "fixture, gtp_name, base_name, tp, gtp, dp",
    [
        ("two_ranks", "tp1_gtp2", "base_tp1_dp2", 1, 2, 1),
        ("four_ranks", "tp1_gtp2_dp2", "base_tp1_dp4", 1, 2, 2),
        ("four_ranks", "tp2_gtp2", "base_tp2_dp2", 2, 2, 1),
    ],
)
def test_batch_and_lr_arithmetic(
    request: pytest.FixtureRequest,
    fixture: str,
    gtp_name: str,
    base_name: str,
    tp: int,
    gtp: int,
    dp: int,
) -> None:
    """global batch = micro x DP x GTP x microbatches (design §3.1); NeMo's bookkeeping agrees."""
    runs = request.getfixturevalue(fixture)
    microbatches = GBS // (MBS * dp * gtp)
    for rank, base in zip(runs[gtp_name], runs[base_name], strict=True):
        assert rank["data_size"] == dp * gtp
        assert rank["num_microbatches"] == microbatches == base["num_microbatches"]
        assert MBS * dp * gtp * rank["num_microbatches"] == GBS == rank["global_batch_size"]
        assert rank["consumed_samples"] == rank["logged_consumed_samples"] == STEPS * GBS
        assert rank["logged_global_batch_size"] == GBS and rank["global_step"] == STEPS
        assert rank["lrs"] == base["lrs"] and len(set(rank["lrs"])) > 2  # scheduler advanced
        assert len(rank["indices"]) == STEPS * MBS * microbatches
    by_data_rank: dict[int, list[int]] = {}
    for rank in runs[gtp_name]:  # TP peers load the same samples, data ranks distinct ones
        by_data_rank.setdefault(rank["data_rank"], rank["indices"])
        assert by_data_rank[rank["data_rank"]] == rank["indices"]
    assert len(by_data_rank) == dp * gtp
    seen = [i for indices in by_data_rank.values() for i in indices]
    assert sorted(seen) == list(range(STEPS * GBS))


def test_iteration0_log_line(two_ranks: dict, four_ranks: dict) -> None:
    expected = {
        "tp1_gtp2": "tp=1 gtp=2 dp=1",
        "tp1_gtp2_dp2": "tp=1 gtp=2 dp=2",
        "tp2_gtp2": "tp=2 gtp=2 dp=1",
    }
    for name, sizes in expected.items():
        ranks = (two_ranks if name in two_ranks else four_ranks)[name]
        assert len(ranks[0]["banners"]) == 1
        line = ranks[0]["banners"][0]
        assert line.startswith(f"{BANNER_PREFIX} GTPConfig(pad_for_alignment=16,") and sizes in line
        assert "\n" not in line
        assert all(rank["banners"] == [] for rank in ranks[1:])
    for runs in (two_ranks, four_ranks):
        for name, ranks in runs.items():
            if name.startswith("base"):
                assert all(rank["banners"] == [] for rank in ranks)


def test_metrics_callback(two_ranks: dict) -> None:
    for rank in two_ranks["tp1_gtp2"]:
        m = rank["metrics"]
        per_pass, microbatches = rank["expected_gather_bytes_per_pass"], rank["num_microbatches"]
        # every weight: one forward and one backward gather, one wgrad reduce-scatter, per
        # microbatch (counters reset each step)
        assert m["gtp/gather_bytes"] == 2 * microbatches * per_pass
        assert m["gtp/reduce_scatter_bytes"] == microbatches * per_pass
        assert m["gtp/gathers"] == 2 * microbatches * rank["gtp_params"]
        assert m["gtp/prefetches"] > 0 and m["gtp/prefetch_skipped"] == 0
        assert m["gtp/exposed_comm_s"] == pytest.approx(
            m["gtp/exposed_gather_s"] + m["gtp/exposed_reduce_scatter_s"]
        )
        assert m["gtp/exposed_gather_s"] > 0.0  # the chain head's gather is synchronous
        assert 0.0 < m["gtp/exposed_comm_fraction"] <= 1.0
        for kind in ("weight", "grad", "optimizer"):
            assert 0 < m[f"gtp/{kind}_bytes"] < m[f"gtp/unsharded_{kind}_bytes"]
        # through Lightning's logging: every step, at the steps NeMo's loss is logged at
        assert rank["logged_metric_steps"] == rank["logged_loss_steps"]
        assert len(rank["logged_metric_steps"]) == STEPS


def test_metrics_measure_only_the_logged_steps(two_ranks: dict) -> None:
    # log_every_n_steps=3 over 10 steps: Lightning logs steps 3, 6, 9; only their waits are
    # timed (untimed steps keep the runtime's one-frame path), and their values are complete
    every, every3 = two_ranks["tp1_gtp2"], two_ranks["tp1_gtp2_log3"]
    for rank, rank3 in zip(every, every3, strict=True):
        assert rank3["logged_metric_steps"] == rank3["logged_loss_steps"]
        assert len(rank3["logged_metric_steps"]) == STEPS // 3
        assert rank["timed_waits"] % STEPS == 0  # the same waits every step
        assert rank3["timed_waits"] == rank["timed_waits"] // STEPS * (STEPS // 3)
        assert rank3["metrics"]["gtp/exposed_gather_s"] > 0.0
        assert rank3["metrics"]["gtp/gathers"] == rank["metrics"]["gtp/gathers"]
        assert rank3["losses"] == rank["losses"]


# ------------------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def nemo_env() -> types.SimpleNamespace:
    from megatron.core.distributed import DistributedDataParallelConfig
    from nemo import lightning as nl

    from nemo_gtp import GTPMegatronStrategy

    return types.SimpleNamespace(
        DDPConfig=DistributedDataParallelConfig, nl=nl, Strategy=GTPMegatronStrategy
    )


INVALID = [
    (dict(tensor_model_parallel_size=2, num_weight_shards=3), "num_weight_shards=3"),
    (dict(num_weight_shards=0), "num_weight_shards=0"),
    (dict(num_weight_shards=2, ddp="pytorch"), "ddp='pytorch'"),
    (dict(num_weight_shards=2, fsdp="megatron"), "fsdp="),
    (dict(num_weight_shards=2, use_tp_pp_dp_mapping=True), "use_tp_pp_dp_mapping"),
    (
        dict(num_weight_shards=2, num_distributed_optimizer_instances=2),
        "num_distributed_optimizer_instances",
    ),
    (dict(expert_num_weight_shards=2, ddp="pytorch"), "ddp='pytorch'"),  # expert GTP alone
    (dict(expert_tensor_parallel_size=2, expert_num_weight_shards=3), "expert_num_weight_shards=3"),
    (dict(num_weight_shards=2, gtp_config="pad16"), "gtp_config"),
    (
        dict(num_weight_shards=2, gtp_config=GTPConfig(shard_replicated_params_over_gtp=True)),
        "use_distributed_optimizer=True",
    ),
]
INVALID_DDP = [
    (dict(average_in_collective=True), "average_in_collective=False"),
    (dict(use_distributed_optimizer=True, overlap_param_gather=True), "overlap_param_gather"),
    (dict(use_megatron_fsdp=True), "use_megatron_fsdp"),
]


@pytest.mark.parametrize("kwargs, match", INVALID)
def test_invalid_arguments(nemo_env: Any, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        nemo_env.Strategy(**kwargs)


@pytest.mark.parametrize("ddp_kwargs, match", INVALID_DDP)
def test_invalid_ddp_config(nemo_env: Any, ddp_kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        nemo_env.Strategy(num_weight_shards=2, ddp=nemo_env.DDPConfig(**ddp_kwargs))
    assert "ddp" in str(err.value)


def test_average_in_collective_message(nemo_env: Any) -> None:
    with pytest.raises(ValueError) as err:
        nemo_env.Strategy(
            num_weight_shards=4,
            tensor_model_parallel_size=2,
            ddp=nemo_env.DDPConfig(average_in_collective=True),
        )
    assert "DistributedDataParallelConfig(average_in_collective=False)" in str(err.value)
    assert "NeMo's stock recipes set it True" in str(err.value)


def test_gtp_off_accepts_megatron_settings(nemo_env: Any) -> None:
    strategy = nemo_env.Strategy(
        ddp=nemo_env.DDPConfig(average_in_collective=True),
        use_tp_pp_dp_mapping=True,
        tensor_model_parallel_size=2,
    )
    assert not strategy.gtp_enabled and strategy.num_weight_shards == 2


def test_ddp_config_rechecked_before_wrap(nemo_env: Any) -> None:
    strategy = nemo_env.Strategy(num_weight_shards=2, ddp=nemo_env.DDPConfig())
    strategy.ddp_config.average_in_collective = True  # e.g. a callback edited it after __init__
    with pytest.raises(ValueError, match="average_in_collective"):
        strategy.init_model_parallel()


def _fp8_param_settings(**changes: Any) -> tuple[Any, Any, Any]:
    """A model config asking for FP8 primary weights, and DDP / optimizer configs that take
    them; ``changes`` (``ddp.x`` / ``optim.x`` / model keys) edit them."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    model = types.SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    optim = OptimizerConfig(use_distributed_optimizer=True)
    for key, value in changes.items():
        where, _, name = key.rpartition(".")
        setattr({"ddp": ddp, "optim": optim, "": model}[where], name, value)
    return model, ddp, optim


FP8_PARAM_INVALID = [
    ({"fp8_recipe": "delayed"}, 1, r"fp8_param=True.*fp8_recipe='delayed'.*'tensorwise'"),
    ({"first_last_layers_bf16": True}, 1, "first_last_layers_bf16=False"),
    ({"num_moe_experts": 4}, 2, "routed experts.*expert_num_weight_shards"),
    ({"ddp.grad_reduce_in_fp32": False}, 1, r"DistributedDataParallelConfig\(grad_reduce_in_fp32"),
    ({"ddp.use_distributed_optimizer": False}, 1, r"\(use_distributed_optimizer=True\)"),
    ({"optim.use_distributed_optimizer": False}, 1, r"OptimizerConfig\(use_distributed_optim"),
]


@pytest.mark.parametrize("changes, egtp, match", FP8_PARAM_INVALID)
def test_fp8_param_settings_named(changes: dict, egtp: int, match: str) -> None:
    """megatron's ``fp8_param`` under GTP (FP8 primary shards, design §1.3): what it needs,
    each refusal naming the setting, before any collective."""
    from nemo_gtp.strategy.validation import validate_fp8_primary

    with pytest.raises(ValueError, match=match):
        validate_fp8_primary(*_fp8_param_settings(**changes), egtp=egtp)


def test_fp8_param_settings_accepted_and_rechecked(nemo_env: Any) -> None:
    from nemo_gtp.engine.fp8 import FP8Scaling
    from nemo_gtp.strategy.validation import validate_fp8_primary

    assert validate_fp8_primary(*_fp8_param_settings()) == FP8Scaling("tensorwise")
    assert validate_fp8_primary(*_fp8_param_settings(fp8_param=False)) is None
    assert validate_fp8_primary(*_fp8_param_settings(num_moe_experts=4), egtp=1) is not None
    model, ddp, optim = _fp8_param_settings()
    strategy = nemo_env.Strategy(num_weight_shards=2, ddp=ddp)
    ddp.grad_reduce_in_fp32 = False  # e.g. a callback edited it after connect
    strategy.model = types.SimpleNamespace(config=model, optim=types.SimpleNamespace(config=optim))
    with pytest.raises(ValueError, match="grad_reduce_in_fp32"):
        strategy.init_model_parallel()


def test_world_size_checked_before_collectives(nemo_env: Any) -> None:
    import torch

    strategy = nemo_env.Strategy(num_weight_shards=2)
    strategy.parallel_devices = [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match="world_size=3 is not divisible"):
        strategy.setup_distributed()


@pytest.mark.parametrize("shards", [2, 1])
def test_wgrad_fusion_without_the_gemm_refused_before_collectives(
    nemo_env: Any, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """``gradient_accumulation_fusion`` on a stack with neither apex nor torch's
    fp32-accumulating GEMM (this CPU machine): refused by name in ``setup_distributed``,
    before any process group, with GTP on or off."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers

    if torch.cuda.is_available():
        pytest.skip("the GEMM exists here")
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    strategy = nemo_env.Strategy(num_weight_shards=shards)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.model = types.SimpleNamespace(
        config=types.SimpleNamespace(gradient_accumulation_fusion=True)
    )
    with pytest.raises(ValueError, match="set model.gradient_accumulation_fusion=false"):
        strategy.setup_distributed()
    assert not dist.is_initialized()


def test_io_records_gtp_arguments(nemo_env: Any) -> None:
    """NeMo's IOMixin record (checkpoint ``context/``) rebuilds the same strategy."""
    import fiddle as fdl

    from nemo_gtp.engine import GTPConfig

    nemo_env.nl.MegatronStrategy()  # the parent's IOMixin wrapper exists before ours
    strategy = nemo_env.Strategy(
        2,
        num_weight_shards=4,
        gtp_config=GTPConfig(pad_for_alignment=8),
        process_group_backend="gloo",
    )
    rebuilt = fdl.build(strategy.__io__)
    assert type(rebuilt) is type(strategy)
    assert (rebuilt.num_weight_shards, rebuilt.tensor_model_parallel_size) == (4, 2)
    assert rebuilt.gtp_config == GTPConfig(pad_for_alignment=8) and rebuilt.gtp_size == 2


def test_cuda_graph_warmup_bump(nemo_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.strategy import cuda_graphs_enabled, enforce_cuda_graph_warmup

    def config(**kw: Any) -> types.SimpleNamespace:
        base = dict(
            enable_cuda_graph=False,
            external_cuda_graph=False,
            cuda_graph_impl="none",
            cuda_graph_scope="full",
            cuda_graph_warmup_steps=0,
        )
        return types.SimpleNamespace(**{**base, **kw})

    assert not cuda_graphs_enabled(config())
    off = config()
    assert enforce_cuda_graph_warmup(off) is None and off.cuda_graph_warmup_steps == 0
    for kw in (
        dict(cuda_graph_impl="local"),
        dict(enable_cuda_graph=True),
        dict(external_cuda_graph=True),
        dict(cuda_graph_scope="full_iteration"),
    ):
        cfg = config(**kw)
        note = enforce_cuda_graph_warmup(cfg)
        assert cfg.cuda_graph_warmup_steps == 2 and "raised from 0 to 2" in note
    kept = config(cuda_graph_impl="local", cuda_graph_warmup_steps=3)
    assert enforce_cuda_graph_warmup(kept) is None and kept.cuda_graph_warmup_steps == 3

    # Graphs on: every live graph is reset at exit, before NeMo's destroy of the process group
    # (exit handlers run last-registered first): moved to the end of the handlers at each ask.
    from nemo_gtp.integrations.megatron.layer_graphs import release_live_cuda_graphs
    from nemo_gtp.strategy import cuda_graphs

    handlers: list = []
    monkeypatch.setattr(cuda_graphs.atexit, "register", handlers.append)
    monkeypatch.setattr(
        cuda_graphs.atexit, "unregister", lambda f: handlers.remove(f) if f in handlers else None
    )
    assert not cuda_graphs.release_graphs_at_exit(config())
    assert handlers == []
    assert cuda_graphs.release_graphs_at_exit(config(cuda_graph_impl="local"))
    handlers.append("nemo's destroy")
    assert cuda_graphs.release_graphs_at_exit(config(cuda_graph_scope="full_iteration"))
    assert handlers == ["nemo's destroy", release_live_cuda_graphs]
    assert release_live_cuda_graphs() == 0  # no CUDA here: nothing to reset
    # Its search by type survives objects that raise on any attribute (NeMo's TE placeholders
    # on a GPU machine without TE: the teardown after a fit died there, 2026-12-03).
    import torch

    from nemo_gtp.integrations.megatron.layer_graphs import cuda_graphs_among

    class RaisingProxy:
        def __getattribute__(self, name: str) -> Any:
            raise ImportError("transformer_engine not installed")

    assert cuda_graphs_among([RaisingProxy(), object(), torch.zeros(1)]) == []

    # Through the strategy, on a real NeMo model config (connect runs before the model exists).
    for shards, expected in ((2, 2), (None, 1)):
        gpt = llm.GPTModel(
            llm.GPTConfig(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                transformer_layer_spec=local_layer_spec,
                cuda_graph_impl="local",
                cuda_graph_warmup_steps=1,
            )
        )
        nemo_env.Strategy(num_weight_shards=shards).connect(gpt)
        assert gpt.config.cuda_graph_warmup_steps == expected

    # Per-layer capture: megatron's local graphs with scope "full" / "attn" and the TE RNG
    # tracker are accepted; everything else is refused, naming the setting, before any process
    # group exists. The full-iteration graph is accepted; a graph's gather backend is made
    # capturable.
    from nemo_gtp.engine import GTPConfig
    from nemo_gtp.integrations.megatron.layer_graphs import check_layer_graph_settings
    from nemo_gtp.strategy.cuda_graphs import graph_safe_gtp_config, reject_cuda_graph_capture

    reject_cuda_graph_capture(off)
    for kw in (
        dict(cuda_graph_impl="local"),
        dict(enable_cuda_graph=True, cuda_graph_scope="attn"),
    ):
        reject_cuda_graph_capture(config(**kw), use_te_rng_tracker=True)
        with pytest.raises(ValueError, match="use_te_rng_tracker=True"):
            reject_cuda_graph_capture(config(**kw), use_te_rng_tracker=False)
    local = dict(cuda_graph_impl="local")
    for kw, options, message in (
        (dict(cuda_graph_impl="transformer_engine"), {}, "cuda_graph_impl='transformer_engine'"),
        (dict(external_cuda_graph=True), {}, "TransformerEngine's graph helper"),
        (dict(local, cuda_graph_scope="mlp"), {}, "cuda_graph_scope='mlp'"),
        (dict(local, num_moe_experts=4), {}, "num_moe_experts=4"),
        (dict(local, recompute_granularity="full"), {}, "recompute_granularity='full'"),
        (local, dict(pipeline_parallel=2), "pipeline_model_parallel_size=2"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            reject_cuda_graph_capture(config(**kw), use_te_rng_tracker=True, **options)
    with monkeypatch.context() as env:
        env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF"):
            reject_cuda_graph_capture(config(**local), use_te_rng_tracker=True)
    full_iteration = config(enable_cuda_graph=True, cuda_graph_scope="full_iteration")
    reject_cuda_graph_capture(full_iteration, use_te_rng_tracker=False)
    assert graph_safe_gtp_config(off, None) == (None, "")
    for graphed in (full_iteration, config(**local)):
        safe, note = graph_safe_gtp_config(graphed, None)
        assert safe.gather_backend == "process_group" and "'auto' -> 'process_group'" in note
        kept = GTPConfig(gather_backend="process_group", coalesce_mb=8)
        assert graph_safe_gtp_config(graphed, kept) == (kept, "")
        with pytest.raises(ValueError, match="gather_backend='process_group'"):
            graph_safe_gtp_config(graphed, GTPConfig(gather_backend="copy_engine"))
    # shard_model's own checks (megatron-core users, no strategy in between)
    warm = config(**local, cuda_graph_warmup_steps=2)
    assert check_layer_graph_settings(warm, GTPConfig(), moe=False).gather_backend == (
        "process_group"
    )
    for cfg, gtp_config, moe, message in (
        (warm, GTPConfig(), True, "num_moe_experts"),
        (config(**local, cuda_graph_warmup_steps=1), GTPConfig(), False, "warmup_steps=1"),
        (warm, GTPConfig(gather_backend="copy_engine"), False, "gather_backend='copy_engine'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_layer_graph_settings(cfg, gtp_config, moe=moe)
    strategy = nemo_env.Strategy(num_weight_shards=2)
    strategy.connect(gpt)
    with pytest.raises(ValueError, match="use_te_rng_tracker=True"):
        strategy.setup_distributed()


def test_drain_callback_drains_every_runtime() -> None:
    from nemo_gtp.strategy import GTPDrainCallback

    class Runtime:
        drains = 0

        def drain(self) -> None:
            self.drains += 1

    runtimes = [Runtime(), Runtime()]
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(gtp_runtimes=runtimes))
    callback = GTPDrainCallback()
    callback.on_save_checkpoint(trainer, None, {})
    callback.on_validation_start(trainer, None)
    callback.on_fit_end(trainer, None)
    callback.on_exception(trainer, None, RuntimeError("boom"))
    assert [r.drains for r in runtimes] == [4, 4]

    class Broken:
        def drain(self) -> None:
            raise RuntimeError("peer gone")

    trainer.strategy.gtp_runtimes = [Broken()]
    callback.on_exception(trainer, None, ValueError("original"))  # best effort: no raise


def test_synthetic_datamodule_emits_attention_mask(nemo_env: Any) -> None:
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

    from nemo_gtp import SyntheticGPTDataModule

    data = SyntheticGPTDataModule(
        seq_length=8,
        tokenizer=NullTokenizer(31),
        micro_batch_size=1,
        global_batch_size=2,
        num_workers=0,
        pin_memory=False,
        num_train_samples=16,
    )
    data.setup()
    sample = data._train_ds[3]
    assert sample["attention_mask"].shape == (1, 8, 8) and data._train_ds.seed == 42
    assert not bool(sample["attention_mask"][0, 7, 0])  # causal: position 7 sees 0


def test_engine_import_stays_free_of_nemo() -> None:
    code = (
        "import sys, nemo_gtp, nemo_gtp.engine; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('nemo', 'lightning')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def _repo_root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_full_iteration_graph_callback_routes_training_steps_only() -> None:
    """NeMo builds a fresh step object per step; the callback hands every training step the
    one graph wrapper (built with GTP's warmup), and leaves validation steps eager."""
    import dataclasses
    import functools

    from nemo_gtp.strategy.cuda_graphs import FullIterationGraph, install_full_iteration_graph

    @dataclasses.dataclass
    class Step:  # the shape of NeMo's MegatronStep: forward_backward_func is a cached_property
        forward_only: bool

        @functools.cached_property
        def forward_backward_func(self) -> str:
            return "eager"

    graph = object.__new__(FullIterationGraph)  # its wrapper needs CUDA streams
    graph.warmup, graph.wrapper = 2, "graph wrapper"
    assert graph.on_megatron_step_start(Step(False)).forward_backward_func == "graph wrapper"
    assert graph.on_megatron_step_start(Step(True)).forward_backward_func == "eager"
    off = types.SimpleNamespace(cuda_graph_scope="full", cuda_graph_impl="none")
    assert install_full_iteration_graph(None, off) is None  # graphs off: nothing installed


def test_gtp_adds_no_host_read_to_an_unlogged_step(two_ranks: dict) -> None:
    """Design for CUDA-graph capture (§3.5): a host read of a device value (``.item()``,
    ``float()``, ...) is a sync on a GPU, the device idle while the host catches up. On a step
    Lightning does not log, the GTP2 fit (metrics callback on) reads at the same places as
    NeMo's MegatronStrategy at DP2 (megatron's grad norm, NeMo's loss reduction, the test's
    recorder), except that megatron's NaN check, one read per gradient bucket in the backward,
    is replaced by GTP's: one read per step, gradients and loss together (faults.py)."""

    def sites(name: str) -> list[dict[str, float]]:  # per rank: innermost site -> reads
        return [
            {site.split(" < ")[0]: n for n, site in rank["host_reads"]} for rank in two_ranks[name]
        ]

    for gtp, base in zip(sites("tp1_gtp2_log3"), sites("base_tp1_dp2"), strict=True):
        ours = {site: n for site, n in gtp.items() if site.startswith("nemo_gtp/")}
        assert [site.split(":")[0] for site in ours] == ["nemo_gtp/strategy/faults.py"], gtp
        assert list(ours.values()) == [1.0], ours
        megatrons = {site for site in base if site.startswith("megatron/core/rerun_state")}
        assert megatrons and not megatrons & gtp.keys(), base
        assert gtp.keys() - ours.keys() == base.keys() - megatrons, (gtp, base)

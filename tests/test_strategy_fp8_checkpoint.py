"""NeMo checkpoints of FP8 primary GTP shards through ``GTPMegatronStrategy`` (design §3.3 "FP8
primary weights"): megatron's ``fp8_param`` (NeMo's ``fp8_param_gather``) on CPU/gloo, FP8
params emulated the way ``test_strategy.py``'s FP8 fits do (megatron-local linears, fp32 training
dtype; the shards are float8 with an fp32 master in the distributed optimizer).

The fits share ``test_strategy.py``'s 2-rank spawn (``tests.harness.shared_launch.shared_launch``):

``fp8_full``          TP1·GTP2, 3 steps uninterrupted; NeMo's ``ModelCheckpoint`` after every
                      step (the full state recorded after step 1: FP8 bytes, scales, dequantized
                      weights, fp32 mains, Adam moments)
``fp8_resume``        ``trainer.fit(ckpt_path=<step 1>)`` at TP1·GTP2: the state right after the
                      load equals the saved one bit for bit, steps 2 and 3 equal ``fp8_full``'s
``fp8_weights_only``  the same with ``ckpt_load_optimizer=False``: FP8 bytes as saved, the fp32
                      mains seeded from the shards' dequantized values
``fp8_dp2_from_gtp2`` plain ``MegatronStrategy`` at DP2 with megatron's FP8 params emulated on
                      full weights loads the weights: equal to the GTP run's dequantized ones

Saved after step 1 because there one of the 8 weights' scales, recomputed from its dequantized
values, differs from the saved one in its last bit (after step 2 none does): the resume is
bitwise only through the re-quantization from the loaded fp32 mains.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.shared_launch import shared_launch
from tests.harness.strategy import Fit

FP8_PARAM_FIT = dict(  # NeMo's precision plugin puts fp8_recipe into the OptimizerConfig too
    model_kwargs=dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True),
    optim_kwargs=dict(fp8_recipe="tensorwise"),
)
STEPS, SAVED_AT = 3, 1
CKPT = "fp8_ckpts/step=0"  # NeMo's ModelCheckpoint names it by the step index, 0-based
WEIGHTS_ONLY = {"ckpt_load_optimizer": False}
FITS = [
    Fit(
        "fp8_full",
        gtp=2,
        steps=STEPS,
        checkpoint_every=1,
        checkpoint_dir="fp8_ckpts",
        state_at=SAVED_AT,
        state_to="fp8_saved.pt",
        **FP8_PARAM_FIT,
    ),
    Fit(
        "fp8_resume",
        gtp=2,
        steps=STEPS,
        resume_from=CKPT,
        state_at=SAVED_AT,
        state_to="fp8_resumed.pt",
        **FP8_PARAM_FIT,
    ),
    Fit(
        "fp8_weights_only",
        gtp=2,
        steps=STEPS,
        resume_from=CKPT,
        state_at=SAVED_AT,
        state_to="fp8_weights_only.pt",
        strategy_kwargs=WEIGHTS_ONLY,
        **FP8_PARAM_FIT,
    ),
    Fit(
        "fp8_dp2_from_gtp2",
        steps=STEPS,
        resume_from=CKPT,
        state_at=SAVED_AT,
        state_to="fp8_dp2.pt",
        emulate_fp8_params=True,
        strategy_kwargs=WEIGHTS_ONLY,
        **FP8_PARAM_FIT,
    ),
]
shared_launch(2).add(FITS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    launch = shared_launch(2)
    results = launch.results(tmp_path_factory)
    root: Path = launch.out_dir
    walls = {fit.name: f"{results[fit.name][0]['wall_s']:.1f} s" for fit in FITS}
    print(f"[fp8 checkpoints] wall time per fit (rank 0): {walls}")
    # each fit's full state at step 1 (after that step, or right after the load)
    states = {fit.name: torch.load(Path(root, fit.state_to), weights_only=True) for fit in FITS}
    return {
        "root": root,
        "state": states,
        **{fit.name: results[fit.name] for fit in FITS},
    }


def _kinds(state: dict[str, torch.Tensor]) -> set[str]:
    return {key.split("/")[0] for key in state}


def _of(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    prefix = kind + "/"
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def test_checkpoint_is_nemos(runs: dict[str, Any]) -> None:
    saved = Path(runs["root"], CKPT)
    assert (saved / "weights" / "metadata.json").is_file()
    assert not list(saved.glob(".weights.*"))  # committed


def test_resume_is_bitwise(runs: dict[str, Any]) -> None:
    """Right after NeMo's load the FP8 bytes, scales, dequantized weights, fp32 mains and Adam
    moments equal the saving run's bit for bit (the shards re-quantized from the loaded mains,
    not cast), and the resumed steps' losses and grad norms equal the uninterrupted run's."""
    from tests.harness.checkpoint import assert_same_state

    saved, resumed = runs["state"]["fp8_full"], runs["state"]["fp8_resume"]
    assert _kinds(saved) == {
        "weight",
        "fp8",
        "fp8_scale",
        "fp8_scale_inv",
        "fp32_param",
        "exp_avg",
        "exp_avg_sq",
    }
    assert len(_of(saved, "fp8")) == 8  # qkv, proj, fc1, fc2 of 2 layers
    assert assert_same_state(resumed, saved) == len(saved)
    for full, again in zip(runs["fp8_full"], runs["fp8_resume"], strict=True):
        assert len(full["losses"]) == STEPS and len(again["losses"]) == STEPS - SAVED_AT
        assert again["losses"] == full["losses"][SAVED_AT:], (again["losses"], full["losses"])
        assert again["grad_norms"] == full["grad_norms"][SAVED_AT:]
        assert again["shard_dtypes"] == ["torch.float8_e4m3fn"]
        assert again["fp8_primary"]["write_back_errors"] == []


def test_weights_only_load(runs: dict[str, Any]) -> None:
    """``ckpt_load_optimizer=False``: the dequantized weights re-quantized with the GTP-agreed
    scale give the saved FP8 bytes (a scale recomputed from dequantized values may differ in its
    last bit: here one does), and the fp32 mains are the shards' dequantized values (megatron's
    ``reload_model_params``, through the ``dequantize_fp8_tensor`` hook)."""
    saved, got = runs["state"]["fp8_full"], runs["state"]["fp8_weights_only"]
    assert _kinds(got) == {"weight", "fp8", "fp8_scale", "fp8_scale_inv", "fp32_param"}
    fp8 = _of(got, "fp8")
    want_fp8 = _of(saved, "fp8")
    assert fp8.keys() == want_fp8.keys() and len(fp8) == 8
    for name, value in fp8.items():
        assert torch.equal(value, want_fp8[name]), f"FP8 bytes of {name}"
    weights, mains = _of(got, "weight"), _of(got, "fp32_param")
    scales, want_scales = _of(got, "fp8_scale_inv"), _of(saved, "fp8_scale_inv")
    want_weights = _of(saved, "weight")
    assert weights.keys() == mains.keys() == want_weights.keys()
    recomputed = 0
    for name, main in mains.items():
        assert torch.equal(main, weights[name]), f"fp32 main of {name}"
        if name not in fp8 or torch.equal(scales[name], want_scales[name]):
            assert torch.equal(weights[name], want_weights[name]), name
        else:  # the last bit of the recomputed scale: a relative 2^-23 on every element
            recomputed += 1
            torch.testing.assert_close(weights[name], want_weights[name], rtol=2e-7, atol=0)
    assert recomputed == 1  # what makes the full resume's re-quantization from the mains count
    for full, again in zip(runs["fp8_full"], runs["fp8_weights_only"], strict=True):
        assert len(again["losses"]) == STEPS - SAVED_AT
        for what in ("losses", "grad_norms"):  # the first resumed step: the loaded weights only
            x, y = again[what][0], full[what][SAVED_AT]
            assert abs(x - y) <= 1e-6 * abs(y), f"{what}: {x} vs {y}"


def test_gtp2_checkpoint_into_dp2_with_fp8_params(runs: dict[str, Any]) -> None:
    """The GTP2 FP8 checkpoint loaded by plain ``MegatronStrategy`` at DP2 (megatron's FP8
    params emulated on full weights): every weight equals the GTP run's dequantized weight bit
    for bit, and the next step's loss and grad norm match the uninterrupted GTP run's."""
    saved, got = runs["state"]["fp8_full"], runs["state"]["fp8_dp2_from_gtp2"]
    assert _kinds(got) == {"weight", "fp32_param"}
    want = _of(saved, "weight")
    weights = _of(got, "weight")
    assert weights.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(weights[name], value), f"{name} differs from the GTP run's"
    for full, dp2 in zip(runs["fp8_full"], runs["fp8_dp2_from_gtp2"], strict=True):
        assert dp2["gtp_params"] == 0 and dp2["data_size"] == 2
        assert len(dp2["losses"]) == STEPS - SAVED_AT
        for what in ("losses", "grad_norms"):  # the first resumed step: the loaded weights only
            x, y = dp2[what][0], full[what][SAVED_AT]
            assert abs(x - y) <= 1e-6 * abs(y), f"{what}: {x} vs {y}"


def test_other_optimizer_formats_refused_naming_the_setting() -> None:
    """Only the distributed optimizer's ``fully_sharded_model_space`` format holds FP8 primary
    shards' optimizer state (design §3.3): saving with ``ckpt_optim_fully_reshardable=True`` and
    loading the optimizer state of a checkpoint saved in another format are refused, naming the
    setting, before any collective; models without FP8 primary shards are not affected."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from nemo_gtp import GTPMegatronStrategy
    from nemo_gtp.engine.fp8 import FP8Scaling

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    strategy = GTPMegatronStrategy(num_weight_shards=2, ddp=ddp, ckpt_optim_fully_reshardable=True)
    strategy.gtp_runtimes = [types.SimpleNamespace(fp8_primary=FP8Scaling("tensorwise"))]
    with pytest.raises(NotImplementedError, match="ckpt_optim_fully_reshardable=False"):
        strategy.optimizer_sharded_state_dict()
    other = {"distrib_optim_sharding_type": "dp_reshardable"}
    with pytest.raises(NotImplementedError, match="'dp_reshardable'.*ckpt_load_optimizer=False"):
        strategy.optimizer_sharded_state_dict(is_loading=True, metadata=other)
    strategy.gtp_runtimes = [types.SimpleNamespace(fp8_primary=None)]
    strategy._check_fp8_primary_format(other, loading=True)  # no FP8 primary shards: no refusal

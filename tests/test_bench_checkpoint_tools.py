"""The GPU checkpoint check's tools: ``bench.common.compare`` (``python -m bench.tools
compare-weights``: two weight dumps, key by key, bit for bit) and what ``bench.bench_nemo`` adds
for it: ``@resume=`` as a mode modifier (a top-level recipe key), and the gathered-bytes ratio of
an FP8 mode against its bf16 twin."""

from __future__ import annotations

import torch

from bench.bench_nemo import bytes_summary, resolve_mode
from bench.common import compare


def test_compare_weights_bit_for_bit_and_differences() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.zeros(2, dtype=torch.bfloat16)}
    assert compare(a, {k: v.clone() for k, v in a.items()}, 0.0) == [
        "WEIGHTS: equal (2 keys: 2 bit for bit)"
    ]
    nudged = {"w": torch.tensor([1.0, 2.0 + 2e-6]), "b": a["b"].clone()}
    lines = compare(a, nudged, 0.0)
    assert lines[-1] == "WEIGHTS: DIFFER (1 of 2 keys)" and lines[0].startswith("w: max |diff|")
    assert (
        compare(a, nudged, 1e-5)[-1]
        == "WEIGHTS: equal (2 keys: 1 bit for bit, 1 within rtol 1e-05)"
    )
    other = {"w": a["w"].double(), "c": a["b"]}
    assert compare(a, other, 1.0) == [
        "b: only in the first",
        "c: only in the second",
        "w: (2,) torch.float32 vs (2,) torch.float64",
        "WEIGHTS: DIFFER (3 of 3 keys)",
    ]


def test_resume_modifier_is_a_recipe_key() -> None:
    _, overrides, baseline = resolve_mode(
        "dp2_fp8param@resume=/ck/step=2@strategy.ckpt_load_optimizer=false@coalesce_mb=64"
    )
    assert overrides[-3:] == [
        "+resume=/ck/step=2",
        "+strategy.ckpt_load_optimizer=false",
        "+gtp.coalesce_mb=64",
    ]
    assert baseline is None  # dp2_fp8param is a baseline itself


def test_gather_bytes_line_against_the_bf16_twin() -> None:
    def record(mode: str, gathered: int | None) -> dict:
        stats = {} if gathered is None else {"gather_bytes": gathered}
        return {"mode": mode, "tokens_per_gpu": 2048, "gtp_stats_per_step": stats}

    text = bytes_summary([record("gtp2_te", 1000), record("gtp2_fp8", 500), record("dp2_te", None)])
    assert text.strip() == (
        "GATHER BYTES gtp2_fp8 / gtp2_te at 2048: 500 / 1000 = 0.5000 per step (within 0.50 +- 3 %)"
    )
    assert "OUTSIDE" in bytes_summary([record("gtp2_te", 1000), record("gtp2_fp8", 600)])
    assert bytes_summary([record("gtp2_fp8", 500)]) == ""  # no twin: no line


def test_a_layout_modifier_goes_to_the_baseline_too() -> None:
    """GTP2·CP2 is compared with CP2·DP2 (GTP knobs stay the GTP mode's)."""
    _, overrides, baseline = resolve_mode(
        "gtp2_te@strategy.context_parallel_size=2@preshard_linears=none"
    )
    assert overrides == ["+strategy.context_parallel_size=2", "+gtp.preshard_linears=none"]
    assert baseline == "dp2_te@strategy.context_parallel_size=2"
    # the optimizer too: a Muon GTP2 run is compared with a Muon DP2 run (design §1.6)
    muon = "@optim.optimizer=muon@optim.use_distributed_optimizer=false@muon.ns_dtype=float32"
    _, _, baseline = resolve_mode(f"gtp2_te{muon}@coalesce_mb=64")
    assert baseline == f"dp2_te{muon}"
    # and PEFT: a LoRA GTP2 run is compared with a LoRA DP2 run (design §1.1 "Frozen weights")
    _, overrides, baseline = resolve_mode("gtp2_te@peft.method=lora@peft.dim=8")
    assert overrides[-2:] == ["+peft.method=lora", "+peft.dim=8"]
    assert baseline == "dp2_te@peft.method=lora@peft.dim=8"


def test_compare_against_the_fp8_quantization_of_a_bf16_dump() -> None:
    """``compare-weights --quantize-second tensorwise``: an FP8 primary start (each GTP shard cast
    with the full weight's agreed scale) equals the bf16 dump quantized as one tensor; other keys
    stay as they are."""
    from bench.tools import quantized_linears
    from nemo_gtp.engine.fp8 import FP8Scaling, cast_to_fp8, quantize_shard

    torch.manual_seed(0)
    weight = (torch.randn(64, 32) * 0.02).bfloat16()
    bf16 = {"layers.0.mlp.linear_fc1.weight": weight, "layers.0.norm.weight": torch.ones(32)}
    q = quantized_linears(bf16, "tensorwise")
    assert q["layers.0.norm.weight"] is bf16["layers.0.norm.weight"]
    assert not torch.equal(q["layers.0.mlp.linear_fc1.weight"], weight)  # it was cast
    scaling = FP8Scaling("tensorwise")
    full = quantize_shard(weight, scaling)  # the agreed scale: the full weight's amax
    halves = [cast_to_fp8(h.float(), full.scale, scaling).float() for h in weight.chunk(2)]
    gtp_start = (torch.cat(halves) * full.scale_inv).bfloat16()
    dump = {"layers.0.mlp.linear_fc1.weight": gtp_start, "layers.0.norm.weight": torch.ones(32)}
    assert compare(dump, q, 0.0) == ["WEIGHTS: equal (2 keys: 2 bit for bit)"]

"""``bench.bench_moe`` on CPU: every mode's recipe passes the CLI's checks (what the script's
``--dry-run`` does before a GPU sees it), its one-GPU launch plan (``--shared-device``: 4 ranks
on ``cuda:0``), and the report reads finished and failed fits and judges parity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_moe import MODES, SHARED_DEVICE_SHAPE, baselines, check_modes, main, report


def test_every_mode_passes_the_recipe_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """Every mode on its own ranks, plain and ``--shared-device``; then the 4-rank one-GPU
    plan: each rank local rank 0 of its own node, the cut shape, the staged backend, the global
    batch micro x 4; a mode of another size is refused before any launch, naming ``--devices``."""
    assert check_modes([*MODES, "grouped_egtp2@prefetch_depth=2"]) == []
    assert baselines("grouped_egtp2@prefetch_depth=2") == ("grouped_dp2", "grouped_ep2")
    assert baselines("grouped_ep2_egtp2") == ("grouped_ep2_dp2", "grouped_ep4")
    assert baselines("seq_ep2") == (None, None)
    args = ["--shared-device", "--modes", "grouped_ep2_dp2,grouped_ep2_egtp2", "--dry-run"]
    assert main([*args, "--out", "unused"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world"] == 4 and [r["mode"] for r in plan["runs"]] == args[2].split(",")
    for run in plan["runs"]:
        assert run["overrides"][: len(SHARED_DEVICE_SHAPE)] == list(SHARED_DEVICE_SHAPE)
        assert run["overrides"][-4:] == [
            "data.global_batch_size=8",
            "trainer.devices=1",
            "+trainer.num_nodes=4",
            "+strategy.process_group_backend=cpu:gloo,cuda:staged_gloo",
        ]
        assert (run["tokens_per_gpu"], run["precision"]) == (1024, "bf16-mixed")
    assert "strategy.expert_num_weight_shards=2" in plan["runs"][1]["overrides"]
    ranks = [(r["RANK"], r["LOCAL_RANK"], r["NODE_RANK"], r["WORLD_SIZE"]) for r in plan["ranks"]]
    assert ranks == [(str(r), "0", str(r), "4") for r in range(4)]
    assert main(["--modes", "seq_dp2,seq_ep2_egtp2", "--dry-run", "--out", "unused"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"] == [
        "seq_ep2_egtp2: runs on 4 ranks, the launch has 2: give --devices 4 or launch it separately"
    ]
    with pytest.raises(SystemExit):
        main(["--full-size", "--out", "unused"])  # only with --shared-device


def test_report(tmp_path: Path) -> None:
    fit = {"tokens_per_s_per_gpu": 1, "peak_gib": 1.0, "exposed_ms": {}}
    records = [
        {**fit, "mode": "seq_dp2", "step_ms": 100.0, "losses": [10.0, 8.0]},
        {**fit, "mode": "seq_ep2", "step_ms": 50.0, "losses": [10.5, 8.5]},
        {
            **fit,
            "mode": "seq_egtp2",
            "step_ms": 52.5,
            "losses": [10.0, 8.08],
            "expert_gathers": 64,
            "expert_gather_collectives": 8,
            "expert_reduce_scatters": 32,
            "expert_reduce_scatter_collectives": 4,
        },
        {"mode": "grouped_egtp2", "error": "RuntimeError: x"},
    ]
    table = report(records, tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| seq_egtp2 | 52.5"))
    # step time over EP2, weights per collective, loss vs DP2 (same initial weights)
    assert "| 1.050× |" in row and "| 8.0 / 8.0 |" in row and "| 1.0e-02 |" in row
    assert "failed: RuntimeError: x" in table
    # bf16 (the recipe's precision when a record names none): within 2e-2, a match
    assert "| seq_egtp2 | seq_dp2 | 4096 | 2 | identical | 8.00e-02 | 1.00e-02 |" in table
    assert "PARITY seq_egtp2 vs seq_dp2 at 4096 tokens/GPU: match" in table
    md = (tmp_path / "bench_moe.md").read_text().splitlines()
    assert sum(line.startswith("| seq_") for line in md) == 4  # 3 fits + 1 pair
    for r in records:  # a --shared-device run of 4 ranks, fp32: 1e-2 is out of 1e-5
        r.update(shared_device=4, precision="32", tokens_per_gpu=1024)
    table = report(records, tmp_path)
    assert table.startswith("**--shared-device: 4 ranks on one GPU**")
    assert "PARITY seq_egtp2 vs seq_dp2 at 1024 tokens/GPU: DIFFERS" in table


def test_gpu_grouped_experts_arguments() -> None:
    """``bench.gpu_grouped_experts`` (TEGroupedMLP pre-sharded on GPUs) imports and parses;
    its ``--cpu-smoke`` run is the same code on gloo with TE's stand-in."""
    from bench.gpu_grouped_experts import CHECKS, parse_args

    args = parse_args(["--out", "x", "--cpu-smoke"])
    assert (args.local_experts, args.hidden, args.moe_ffn) == (3, 32, 64)
    assert args.checks.split(",") == list(CHECKS)
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--checks", "nope"])


def test_a_layout_modifier_goes_to_the_baselines() -> None:
    """EP2·EGTP2·CP2 is compared with EP2·(expert DP2)·CP2; other modifiers stay the mode's."""
    cp = "@strategy.context_parallel_size=2"
    assert baselines(f"grouped_ep2_egtp2{cp}@prefetch_depth=2") == (
        f"grouped_ep2_dp2{cp}",
        f"grouped_ep4{cp}",
    )
    assert baselines("grouped_ep2_egtp2@prefetch_depth=2") == ("grouped_ep2_dp2", "grouped_ep4")
    assert baselines(f"grouped_ep2_dp2{cp}")[0] is None  # a baseline itself

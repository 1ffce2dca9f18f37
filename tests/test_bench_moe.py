"""``bench/bench_moe.py`` on CPU: every mode's recipe passes the CLI's checks (what the script's
``--dry-run`` does before a GPU sees it), and the report reads finished and failed fits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from bench_moe import MODES, baselines, check_modes, report  # noqa: E402


def test_every_mode_passes_the_recipe_checks() -> None:
    assert check_modes([*MODES, "grouped_egtp2@prefetch_depth=2"]) == []
    assert baselines("grouped_egtp2@prefetch_depth=2") == ("grouped_dp2", "grouped_ep2")
    assert baselines("seq_ep2") == (None, None)


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
    row = next(line for line in table.splitlines() if line.startswith("| seq_egtp2 "))
    # step time over EP2, weights per collective, loss vs DP2 (same initial weights)
    assert "| 1.050× |" in row and "| 8.0 / 8.0 |" in row and "| 1.0e-02 |" in row
    assert "failed: RuntimeError: x" in table
    assert (tmp_path / "bench_moe.md").read_text().count("| seq_") == 3


def test_gpu_grouped_experts_arguments() -> None:
    """``bench/gpu_grouped_experts.py`` (TEGroupedMLP pre-sharded on GPUs) imports and parses;
    its ``--cpu-smoke`` run is the same code on gloo with TE's stand-in."""
    import pytest
    from gpu_grouped_experts import CHECKS, parse_args

    args = parse_args(["--out", "x", "--cpu-smoke"])
    assert (args.local_experts, args.hidden, args.moe_ffn) == (3, 32, 64)
    assert args.checks.split(",") == list(CHECKS)
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--checks", "nope"])

"""The recipe loader and the README main job (``nemo_gtp.run ... --compare-baseline``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gtp.recipes.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_overrides_apply_and_typos_are_errors() -> None:
    cfg = load_recipe(
        TINY, ["trainer.max_steps=7", "strategy.num_weight_shards=4", "+trainer.seed=3"]
    )
    assert cfg.trainer.max_steps == 7 and cfg.strategy.num_weight_shards == 4
    assert cfg.trainer.seed == 3
    with pytest.raises(ValueError, match=r"trainer.max_step.*use \+trainer.max_step"):
        load_recipe(TINY, ["trainer.max_step=7"])
    with pytest.raises(ValueError, match="is not key=value"):
        load_recipe(TINY, ["trainer.max_steps"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_keeps_gtp_constraints(path: Path) -> None:
    cfg = load_recipe(str(path))
    assert cfg.ddp.average_in_collective is False  # GTP forbids it (design §3.2)
    tp = cfg.strategy.get("tensor_model_parallel_size", 1)
    assert cfg.strategy.num_weight_shards % tp == 0


def test_main_job_gtp_matches_baseline_in_one_launch() -> None:
    """The README's main command, shortened to 5 steps: both fits run and agree to 1e-5."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gtp.run", TINY, "trainer.max_steps=5", "--compare-baseline"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = re.findall(
        r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \| ([\d.e+-]+)$", result.stdout, flags=re.M
    )
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5], result.stdout
    assert max(float(r[3]) for r in rows) <= 1e-5, result.stdout
    assert float(rows[-1][1]) < float(rows[0][1])  # the loss goes down
    assert "GTP (TP1·GTP2)" in result.stdout and "baseline (TP1, no GTP)" in result.stdout

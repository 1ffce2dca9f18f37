"""The README's plain-Python script, ``examples/pretrain_gpt.py``, runs as a user runs it: its own
process, Lightning launching the ranks (2 CPU/gloo ranks, TP1·GTP2). Its numbers are the
strategy tests' business (``test_strategy``); this keeps the example from rotting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pretrain_gpt_example_trains_on_cpu() -> None:
    command = [sys.executable, "examples/pretrain_gpt.py", "--cpu", "--devices", "2"]
    command += ["--num-weight-shards", "2", "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    losses = [float(x) for x in re.findall(r"reduced_train_loss: ([0-9.]+)", out)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), out[-3000:]
    assert "tp=1 gtp=2 dp=1" in out, out[-3000:]  # the strategy's GTP line: GTP on

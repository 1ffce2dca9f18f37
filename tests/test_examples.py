"""The README's plain-Python script, ``examples/pretrain_gpt.py``, runs whole: its argument
parsing, model, data, ``GTPMegatronStrategy`` and ``trainer.fit`` on 2 CPU/gloo ranks
(TP1·GTP2), each rank running the script as ``torchrun`` would start it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` set: Lightning takes the launch as external), forked from the
suite's preloaded server so that no rank pays NeMo's import again. Its numbers are the strategy
tests' business (``test_strategy``); this keeps the example from rotting."""

from __future__ import annotations

import os
import re
import runpy
import socket
import sys
from pathlib import Path

from tests.harness.spawn import start_ranks

ROOT = Path(__file__).resolve().parent.parent
ARGV = ["examples/pretrain_gpt.py", "--cpu", "--devices", "2", "--num-weight-shards", "2"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_example(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: its output to ``out_dir/rank<N>.txt``, then the script as ``__main__``."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    log = os.open(os.path.join(out_dir, f"rank{rank}.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [*ARGV, "--steps", "2"]
    runpy.run_path(str(ROOT / ARGV[0]), run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


def test_pretrain_gpt_example_trains_on_cpu(tmp_path: Path) -> None:
    context = start_ranks(_run_example, (2, _free_port(), str(tmp_path)), nprocs=2, join=False)
    while not context.join(timeout=1.0):
        pass
    out = (tmp_path / "rank0.txt").read_text()
    losses = [float(x) for x in re.findall(r"reduced_train_loss: ([0-9.]+)", out)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), out[-3000:]
    assert "tp=1 gtp=2 dp=1" in out, out[-3000:]  # the strategy's GTP line: GTP on

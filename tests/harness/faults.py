"""A Lightning callback that injects one fault into a recipe run, through the recipe's
``callbacks`` section (``+callbacks.fault.target=tests.harness.faults.InjectFault ...``).

Every rank writes its pid to ``pid_dir`` at ``setup`` (the test checks none is left). At the
start of step ``step`` (``trainer.global_step``), rank ``rank`` first copies ``snapshot_from``
(the checkpoint directory: everything committed so far) to ``snapshot_to``, writes the time
to ``fault_at`` beside ``pid_dir``, then does ``kind``:

- ``kill``: SIGKILL itself;
- ``kill_writer``: SIGKILL the first process it starts from now on (megatron's checkpoint
  writer, forked for the next save);
- ``raise``: raise ``RuntimeError("injected fault")``;
- ``hang``: sleep (stops entering collectives);
- ``sigterm_all``: SIGTERM every rank (as Slurm does on preemption);
- ``nan``: write a NaN into its shard of the first GTP-sharded weight.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


class InjectFault(pl.Callback):
    """See the module docstring."""

    def __init__(
        self,
        kind: str,
        rank: int,
        step: int,
        pid_dir: str,
        snapshot_from: str | None = None,
        snapshot_to: str | None = None,
    ) -> None:
        self.kind, self.rank, self.step = kind, rank, step
        self.pid_dir = Path(pid_dir)
        self.snapshot = (snapshot_from, snapshot_to)

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        (self.pid_dir / str(trainer.global_rank)).write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        source, target = self.snapshot
        if source is not None and target is not None:
            shutil.copytree(source, target)
        self.pid_dir.with_name("fault_at").write_text(repr(time.time()))  # beside pid_dir
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "kill_writer":
            threading.Thread(target=_kill_next_child, daemon=True).start()
        elif self.kind == "raise":
            raise RuntimeError("injected fault")
        elif self.kind == "hang":
            time.sleep(3600)
        elif self.kind == "sigterm_all":
            for path in self.pid_dir.iterdir():
                os.kill(int(path.read_text()), signal.SIGTERM)
        elif self.kind == "nan":
            from nemo_gtp.engine.param import GTPShardedParam

            for param in pl_module.parameters():
                if isinstance(param, GTPShardedParam):
                    with torch.no_grad():
                        param.view(-1)[0] = float("nan")
                    return
            raise AssertionError("no GTP-sharded weight to poison")
        else:
            raise ValueError(f"unknown fault {self.kind!r}")


def _children() -> set[int]:
    pid = os.getpid()
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def _kill_next_child(deadline_s: float = 120.0) -> None:
    before = _children()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        new = _children() - before
        if new:
            child = min(new)
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            os.kill(child, signal.SIGKILL)
            print(f"InjectFault: killed {child} ({cmd.decode(errors='replace')})", file=sys.stderr)
            return
        time.sleep(0.002)

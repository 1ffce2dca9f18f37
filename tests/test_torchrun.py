"""The README's NeMo pattern under torchrun (an external launcher sets ``RANK`` before NeMo is
imported, which turns NeMo's telemetry on for rank 0): a fit without checkpoints, then one
with a ``ModelCheckpoint`` in the same process (the telemetry keeps the first fit's config),
then resume from it (``tests.harness.torchrun_fit``, 2 CPU/gloo ranks: TP1·GTP2; the DP layouts
of checkpoints and resumes are ``test_strategy_checkpoint``'s)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_model_checkpoint_and_resume_under_torchrun(tmp_path: Path) -> None:
    command = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nproc-per-node", "2", "--master-port", str(_free_port())),
        *("-m", "tests.harness.torchrun_fit", str(tmp_path)),
    ]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun did not finish in 240 s:\n{(err.stderr or b'')[-4000:]!r}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["checkpoints"] == ["step=1", "step=3"]  # ModelCheckpoint every 2 steps
    assert result["plain"]["global_step"] == 2  # no checkpoints: the telemetry config's fit
    assert result["first"]["global_step"] == 4 and len(result["first"]["losses"]) == 4
    assert result["resume"]["global_step"] == 6 and len(result["resume"]["losses"]) == 2

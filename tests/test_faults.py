"""Faults a long run meets, each injected through the real CLI and launcher
(``nemo_gtp.run.main`` in this process; the ranks fork from the session's preloaded fork
server) into the tiny CPU recipe: a rank killed, a rank raising, a rank that stops entering
collectives, a NaN, a preemption. Each ends clearly: the last lines printed name the rank and
why, the last committed checkpoint and the command that resumes; no process of the job is
left; and every checkpoint committed before the fault is unchanged, bit for bit, against a copy
taken just before it (:class:`tests.harness.faults.InjectFault`).
"""

from __future__ import annotations

import filecmp
import json
import os
import time
from pathlib import Path

import pytest

TINY = "configs/tiny_cpu.yaml"


def _job(tmp: Path, kind: str, rank: int, step: int, *extra: str) -> list[str]:
    fault = "+callbacks.fault"
    return [
        TINY,
        "trainer.max_steps=6",
        f"+checkpoint.dir={tmp / 'ckpts'}",
        "+checkpoint.every_n_train_steps=2",
        "+checkpoint.context=false",
        f"{fault}.target=tests.harness.faults.InjectFault",
        f"{fault}.kind={kind}",
        f"{fault}.rank={rank}",
        f"{fault}.step={step}",
        f"{fault}.pid_dir={tmp / 'pids'}",
        f"{fault}.snapshot_from={tmp / 'ckpts'}",
        f"{fault}.snapshot_to={tmp / 'snapshot'}",
        "--log-dir",
        str(tmp / "logs"),
        *extra,
    ]


@pytest.fixture(autouse=True)
def _cli_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # what main sets for CPU runs, undone after


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str, float]:
    from nemo_gtp.run import main

    start = time.monotonic()
    status = main(args)
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    return status, captured.out, captured.err, seconds


def _same_tree(snapshot: Path, live: Path) -> None:
    """Every checkpoint committed in ``snapshot`` is in ``live`` with the same bytes (one still
    being written when the copy was taken, an asynchronous save's, is not compared)."""
    from nemo_gtp.recipes.resume import is_committed

    committed = [path for path in snapshot.glob("step=*") if is_committed(path)]
    assert committed, f"nothing was committed before the fault: {snapshot}"
    for checkpoint in committed:
        for path in (p for p in checkpoint.rglob("*") if p.is_file()):
            other = live / path.relative_to(snapshot)
            assert other.is_file(), f"{other} was lost"
            assert filecmp.cmp(path, other, shallow=False), f"{other} was altered"


def _left_behind(pid_dir: Path) -> list[int]:
    """Processes of the job's process groups (each rank leads one) still alive."""
    from nemo_gtp.recipes.supervise import group_members

    groups = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert len(groups) == 4, groups
    return group_members(groups)


def _tail(err: str, n: int) -> list[str]:
    return [line for line in err.strip().splitlines() if line.strip()][-n:]


@pytest.mark.parametrize(
    "kind, rank, expect, extra",
    [
        ("kill", 2, "job failed: rank 2 was killed by SIGKILL", []),
        ("raise", 1, "job failed: rank 1 raised RuntimeError at step 5: injected fault", []),
        # megatron's asynchronous save forks a writer per save: the step=5 one is killed
        (
            "kill_writer",
            3,
            "raised CheckpointSaveError at step 5: saving checkpoint",
            ["strategy.ckpt_async_save=true"],
        ),
    ],
)
def test_a_dead_rank_ends_the_job_naming_it_and_the_checkpoint_to_resume(
    kind: str,
    rank: int,
    expect: str,
    extra: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A rank SIGKILLed (or raising) at step 5 of 6: the job ends non-zero soon after, its last
    lines name the rank and its signal (exception), the last committed checkpoint (step=3) and
    the command with ``+resume=latest``; nothing committed changed, no process is left."""
    status, _, err, seconds = _run(_job(tmp_path, kind, rank, 5, *extra), capsys)
    assert status == 1, err[-3000:]
    *head, last, resume = _tail(err, 4)
    failed = next((line for line in head if line.startswith("job failed: ")), err[-3000:])
    assert expect in failed, failed
    assert f"rank {rank}" in failed, failed
    assert last == f"last committed checkpoint: {tmp_path / 'ckpts' / 'step=3'}"
    assert resume.startswith("resume: python -m nemo_gtp.run configs/tiny_cpu.yaml")
    assert "+resume=latest" in resume and f"--log-dir {tmp_path / 'logs'}" in resume
    _same_tree(tmp_path / "snapshot", tmp_path / "ckpts")
    assert not _left_behind(tmp_path / "pids")
    ended = time.time() - float((tmp_path / "fault_at").read_text())
    assert ended < 60, f"the job ended {ended:.0f} s after the fault (the launch: {seconds:.0f} s)"


def test_a_hung_rank_ends_the_job_within_the_collective_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 stops entering collectives at step 3 (``faults.collective_timeout_s=5``): the
    ranks waiting on it time out in their collective (GTP's gather or megatron's reduction) and
    the job ends, naming the collective, the ranks that waited and the one that hung."""
    args = _job(tmp_path, "hang", 1, 3, "+faults.collective_timeout_s=5")
    status, _, err, _ = _run(args, capsys)
    assert status == 1, err[-3000:]
    lines = _tail(err, 6)
    text = "\n".join(lines)
    assert "timed out waiting in" in text and "rank 1 never joined it" in text, text
    ended = time.time() - float((tmp_path / "fault_at").read_text())
    assert ended < 60, f"the job ended {ended:.0f} s after rank 1 stopped (timeout 5 s)"
    assert lines[-2] == f"last committed checkpoint: {tmp_path / 'ckpts' / 'step=1'}"
    _same_tree(tmp_path / "snapshot", tmp_path / "ckpts")
    assert not _left_behind(tmp_path / "pids")


def test_a_nan_stops_the_run_at_its_step_naming_the_parameter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """megatron's ``ddp.check_for_nan_in_grad`` under GTP: a NaN written into rank 0's shard of
    a weight at step 3 is found in the reduced gradients of that step; the job stops naming the
    step and the first parameter; the step is not saved."""
    args = _job(tmp_path, "nan", 0, 3, "+ddp.check_for_nan_in_grad=true")
    status, _, err, _ = _run(args, capsys)
    assert status == 1, err[-3000:]
    failed = next(line for line in _tail(err, 6) if line.startswith("job failed:"))
    assert "FloatingPointError at step 3: non-finite gradient at step 3" in failed, failed
    assert "first parameter module." in failed or "on rank(s)" in failed, failed
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step=1"]
    _same_tree(tmp_path / "snapshot", tmp_path / "ckpts")
    assert not _left_behind(tmp_path / "pids")


def test_sigterm_saves_at_the_step_boundary_and_resume_continues_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm's preemption: every rank gets SIGTERM during step 2 (of 6); the job saves at the
    end of that step and exits 0; the same command with ``+resume=latest`` continues, and the
    losses of both parts are those of the uninterrupted run, bit for bit."""
    losses = tmp_path / "losses.jsonl"
    job = _job(tmp_path, "sigterm_all", 0, 2, "--loss-log", str(losses))
    status, out, err, _ = _run(job, capsys)
    assert status == 0, err[-3000:]
    assert "preempted: stopping after step 3" in out, out[-2000:]
    assert (tmp_path / "ckpts" / "step=2" / "weights" / "metadata.json").is_file()
    _same_tree(tmp_path / "snapshot", tmp_path / "ckpts")
    assert not _left_behind(tmp_path / "pids")
    first = [json.loads(line) for line in losses.read_text().splitlines()]
    status, _, err, _ = _run([*job, "+resume=latest"], capsys)
    assert status == 0, err[-3000:]
    both = [json.loads(line) for line in losses.read_text().splitlines()]
    full_dir = tmp_path / "full"
    full_log = tmp_path / "full.jsonl"
    whole = [
        TINY,
        "trainer.max_steps=6",
        "--log-dir",
        str(full_dir),
        "--loss-log",
        str(full_log),
    ]
    status, _, err, _ = _run(whole, capsys)
    assert status == 0, err[-3000:]
    full = [json.loads(line) for line in full_log.read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [(r["step"], r["loss"]) for r in both] == [(r["step"], r["loss"]) for r in full]


def test_the_supervisor_stops_a_hung_rank_and_names_who_waited(tmp_path: Path) -> None:
    """The launcher's watch on its own (plain processes, no torch): three ranks fail with a
    collective's timeout, one sleeps; after the grace period the sleeper's process group
    (with a helper it started) is killed, and the summary names the ranks that waited, the
    collective and the rank that hung, then the checkpoint and the resume command."""
    import subprocess
    import sys

    from nemo_gtp.recipes.supervise import (
        RankProcess,
        failure_summary,
        rank_error_path,
        supervise,
    )

    ranks = []
    for rank in range(4):
        if rank == 1:  # hangs, with a helper process in its group
            code = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
        else:
            record = {
                "rank": rank,
                "type": "RuntimeError",
                "message": "[pair.cc:78] Timed out waiting 5000ms for recv operation to complete",
                "collective": "GTP materialize (gather)",
                "step": 3,
            }
            path = rank_error_path(tmp_path, rank)
            code = (
                f"import json, time; time.sleep(0.3); open({str(path)!r}, 'w').write("
                f"json.dumps({record!r})); raise SystemExit(1)"
            )
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        ranks.append(RankProcess(rank, proc.pid, proc.poll))
    start = time.monotonic()
    outcomes = supervise(ranks, tmp_path, grace_s=3.0)  # ample for 3 interpreters to start
    assert time.monotonic() - start < 20
    assert [o.kind for o in outcomes] == ["timeout", "stopped", "timeout", "timeout"]
    lines = failure_summary(
        outcomes, "ckpts/step=1", "python -m nemo_gtp.run x.yaml +resume=latest"
    )
    assert lines == [
        "job failed: ranks 0, 2, 3 timed out waiting in a collective at step 3: ranks 0, 2, 3 in "
        "GTP materialize (gather) (Timed out waiting 5000ms for recv operation to complete)",
        "  rank 1 never joined it (still running when stopped): the rank that hung",
        "last committed checkpoint: ckpts/step=1",
        "resume: python -m nemo_gtp.run x.yaml +resume=latest",
    ]
    assert not _left_behind_groups([r.pid for r in ranks])


def _left_behind_groups(groups: list[int]) -> list[int]:
    from nemo_gtp.recipes.supervise import group_members

    return group_members(groups)


@pytest.mark.parametrize(
    "override, message",
    [
        ("+faults.collective_timeout_s=0", "faults.collective_timeout_s=0 must be > 0 seconds"),
        (
            "+faults.collective_timeout_s=soon",
            "faults.collective_timeout_s='soon' must be a number",
        ),
        ("+faults.preemption=maybe", "faults.preemption='maybe' must be true or false"),
        ("+faults.timeout_s=5", "faults.timeout_s is not a faults setting"),
        ("+callbacks.x.target=Nope", "callbacks.x needs target=package.module.Class"),
        ("+callbacks.x.target=nope_pkg.mod.C", "module nope_pkg.mod not found"),
        (
            "+callbacks.ft.target=nvidia_resiliency_ext.ptl_resiliency.FaultToleranceCallback",
            "callbacks.ft: nvidia-resiliency-ext's FaultToleranceCallback sends its heartbeats",
        ),
    ],
)
def test_fault_settings_are_checked_before_launch(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The faults and callbacks sections are refused with one line naming the key, before any
    rank starts (nvidia-resiliency-ext's FaultToleranceCallback outside its ft_launcher too)."""
    from nemo_gtp.run import main

    assert main([TINY, override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_strategy_adds_the_named_nan_check_for_megatrons_flag() -> None:
    """Under GTP, ``GTPMegatronStrategy.setup`` gives a NeMo user's trainer the check when
    ``ddp.check_for_nan_in_grad`` is on (once; megatron's per-bucket check, which names no
    parameter, is then left to it); without the flag, nothing is added."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig

    from nemo_gtp.strategy.faults import NonFiniteGradCheck, ensure_nonfinite_check

    ddp = DistributedDataParallelConfig(check_for_nan_in_grad=True)
    trainer = SimpleNamespace(strategy=SimpleNamespace(ddp_config=ddp), callbacks=[])
    trainer.lightning_module = None
    check = ensure_nonfinite_check(trainer)
    assert isinstance(check, NonFiniteGradCheck) and trainer.callbacks == [check]
    assert not ddp.check_for_nan_in_grad  # megatron's own check: replaced by the named one
    assert ensure_nonfinite_check(trainer) is None and len(trainer.callbacks) == 1
    off = SimpleNamespace(strategy=SimpleNamespace(ddp_config=DistributedDataParallelConfig()))
    off.callbacks = []
    assert ensure_nonfinite_check(off) is None and off.callbacks == []


def test_a_sigterm_to_the_launcher_reaches_every_rank(tmp_path: Path) -> None:
    """Slurm may signal the launcher alone: the supervisor passes the SIGTERM on to each rank
    (which saves and exits 0 in a real run; here it exits 0 at once) and reports the job as
    preempted, not failed."""
    import signal
    import subprocess
    import sys
    import threading

    from nemo_gtp.recipes.supervise import RankProcess, supervise

    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "print('ready', flush=True); time.sleep(60); sys.exit(3)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"  # its handler is installed
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    outcomes = supervise([RankProcess(r, p.pid, p.poll) for r, p in enumerate(procs)], tmp_path)
    assert [(o.status, o.failed, o.preempted) for o in outcomes] == [(0, False, True)] * 2

"""Watch the ranks of one launch; when one fails, stop the others and say why, last.

The launcher (:mod:`nemo_gtp.recipes.launch`) is the one process that sees every rank. Each rank
runs in a process group of its own (its helpers, e.g. megatron's checkpoint writer, with it),
and writes a one-record summary of the exception that ends it (:func:`write_rank_error`).
:func:`supervise` polls the ranks: once one exits non-zero, by a signal or with an error record,
the others get ``grace_s`` to fail on their own (a peer's gloo error, a collective's timeout,
which says which ranks waited), then every rank's group is killed (nothing of the job is left).
:func:`failure_summary` turns what happened into the lines printed after everything the ranks
printed: the rank, its signal or exception, the last committed checkpoint, the resume command.

A ``SIGTERM`` to the launcher (a Slurm preemption) is passed on to each rank, which saves at the
next step boundary and exits 0 (:class:`nemo_gtp.strategy.faults.GTPPreemption`).

No torch here: the launcher imports this before any rank starts.

Example::

    outcomes = supervise(ranks, error_dir)
    if any(o.failed for o in outcomes):
        print("\\n".join(failure_summary(outcomes, "ckpts", "python -m nemo_gtp.run ...")))
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

# Messages of a rank whose peer is gone: a consequence, never the cause.
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "econnreset",
    "socket closed",
    "read error",
)
TIMED_OUT = ("timed out", "timeout")


@dataclass
class RankProcess:
    """One rank as the supervisor sees it: its pid (also its process group's id) and a
    non-blocking ``poll`` (None while running, else the exit status, ``-N`` for signal N)."""

    rank: int
    pid: int
    poll: Callable[[], int | None]


@dataclass
class RankOutcome:
    """How one rank ended: ``status`` (``-N``: signal N; None: still running when the
    supervisor stopped it), ``error`` (the rank's :func:`write_rank_error` record, if any),
    ``stopped`` (killed by the supervisor after another rank failed), ``ended`` (seconds after
    the launch)."""

    rank: int
    pid: int
    status: int | None = None
    error: dict[str, Any] | None = None
    stopped: bool = False
    ended: float = float("inf")
    preempted: bool = False  # a SIGTERM to the launcher was passed on to it

    @property
    def failed(self) -> bool:
        """True unless the rank exited 0 by itself."""
        return self.status != 0 or self.error is not None

    @property
    def kind(self) -> str:
        """``signal``, ``timeout``, ``peer_lost``, ``error``, ``stopped`` or ``ok``."""
        if self.error is not None:
            text = f"{self.error.get('type', '')}: {self.error.get('message', '')}".lower()
            if any(word in text for word in TIMED_OUT):
                return "timeout"
            if any(word in text for word in PEER_LOST):
                return "peer_lost"
            return "error"
        if self.stopped:
            return "stopped"
        if self.status is not None and self.status < 0:
            return "signal"
        return "ok" if self.status == 0 else "error"


def rank_error_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a launch writes its exception record."""
    return Path(directory, f"rank{rank}.error.json")


def write_rank_error(directory: str | Path, rank: int, exc: BaseException) -> None:
    """Record, for the supervisor, the exception that ends this rank: its type, first lines,
    the collective it was waiting in (the innermost ``torch.distributed`` call or GTP wait of
    the traceback), where the rank's own code raised it, and the training step, if any.

    Called by the rank's main in its ``except`` (best effort: a failure here must not hide
    the exception). Example: ``write_rank_error(tmp, 2, err)``.
    """
    try:
        frames = traceback.extract_tb(exc.__traceback__)
        record = {
            "rank": rank,
            "type": type(exc).__name__,
            "message": "\n".join(str(exc).strip().splitlines()[:3])[:600],
            "collective": _collective(frames),
            "where": _where(frames),
            "step": _current_step(),
        }
        path = rank_error_path(directory, rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except Exception:  # noqa: BLE001  (the rank's own traceback still goes to its stderr)
        pass


_WAIT_HELPERS = ("wait", "complete", "timed_wait", "wrapper", "_wrapper")
_WAITS = ("torch/distributed/", "nemo_gtp/engine/slots.py", "nemo_gtp/engine/collectives.py")


def _collective(frames: traceback.StackSummary) -> str | None:
    """``all_reduce in finish_grad_sync (param_and_grad_buffer)``, ``GTP materialize
    (gather)``: the collective a failing wait was for and who issued it; None when the
    exception did not come out of a collective."""
    paths = [frame.filename.replace(os.sep, "/") for frame in frames]
    if not any(marker in path for path in paths for marker in _WAITS):
        return None
    name = None
    for frame, path in zip(reversed(frames), reversed(paths), strict=True):
        if "torch/distributed/" in path:
            if name is None and frame.name not in _WAIT_HELPERS:
                name = frame.name
            continue
        if frame.name in _WAIT_HELPERS:
            continue
        owner = "GTP " if "nemo_gtp/engine/" in path else ""
        issuer = f"{owner}{frame.name} ({Path(path).stem})"
        return f"{name} in {issuer}" if name else issuer
    return name


def _where(frames: traceback.StackSummary) -> str | None:
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and "/lightning/" not in path:
            return f"{'/'.join(path.split('/')[-2:])}:{frame.lineno} in {frame.name}"
    return None


def _current_step() -> int | None:
    try:  # the step the rank's fault callbacks last saw start (none before training)
        from nemo_gtp.strategy.faults import current_step

        return current_step()
    except Exception:  # noqa: BLE001
        return None


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group of rank ``pid`` (the rank and its helpers); to the
    rank alone if it has not made its group yet. Gone already: nothing to do."""
    if pid <= 1:  # never this process's own group, nor every process (kill(-1))
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def group_members(pgids: Sequence[int]) -> list[int]:
    """Live processes (not zombies) of the process groups ``pgids`` (Linux ``/proc``; elsewhere
    none are seen)."""
    wanted, found = set(pgids), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in wanted and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def wait_groups_gone(pgids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """Kill what is left of the groups ``pgids`` until none is alive (SIGKILL is delivered
    asynchronously); returns the pids still alive after ``timeout_s`` (none, normally)."""
    end = time.monotonic() + timeout_s
    left = group_members(pgids)
    while left and time.monotonic() < end:
        for pgid in pgids:
            kill_group(pgid)
        time.sleep(0.05)
        left = group_members(pgids)
    return left


@dataclass
class _Watch:
    ranks: Sequence[RankProcess]
    error_dir: Path
    grace_s: float
    start: float = field(default_factory=time.monotonic)
    terms: int = 0

    def forward_term(self, signum: int, frame: Any) -> None:
        # Slurm's preemption: every rank saves at its next step boundary and exits 0. Only the
        # ranks themselves, not their groups: a checkpoint writer's helper must finish.
        self.terms += 1
        for proc in self.ranks:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def supervise(
    ranks: Sequence[RankProcess],
    error_dir: str | Path,
    *,
    grace_s: float = 5.0,
    poll_s: float = 0.1,
    on_poll: Callable[[], None] | None = None,
) -> list[RankOutcome]:
    """Wait for every rank; after the first failure give the others ``grace_s`` seconds to end
    by themselves, then kill every rank's process group. Returns one outcome per rank.

    ``on_poll`` runs at each poll (e.g. copying the ranks' output). A ``SIGTERM`` to this
    process is passed on to the ranks (main thread only; the old handler comes back after).
    Example::

        outcomes = supervise([RankProcess(0, proc.pid, proc.poll)], tmp)
    """
    watch = _Watch(ranks, Path(error_dir), grace_s)
    outcomes = {p.rank: RankOutcome(p.rank, p.pid) for p in ranks}
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, watch.forward_term)
    deadline = None
    try:
        while True:
            now = time.monotonic() - watch.start
            running = 0
            for proc in ranks:
                out = outcomes[proc.rank]
                if out.status is None:
                    out.status = proc.poll()
                    if out.status is not None:
                        out.ended = now
                if out.error is None:
                    out.error = _read_error(watch.error_dir, proc.rank)
                    if out.error is not None:
                        out.ended = min(out.ended, now)
                running += out.status is None
            if on_poll is not None:
                on_poll()
            if not running:
                break
            if deadline is None and any(o.failed and o.ended <= now for o in outcomes.values()):
                deadline = now + grace_s
            if deadline is not None and now >= deadline:
                for proc in ranks:
                    if outcomes[proc.rank].status is None:
                        outcomes[proc.rank].stopped = True
                        kill_group(proc.pid)
                deadline = float("inf")  # killed: wait for them to be gone
            time.sleep(poll_s)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        for proc in ranks:  # helpers a rank left behind (its group outlives it)
            kill_group(proc.pid)
        wait_groups_gone([proc.pid for proc in ranks])
    for out in outcomes.values():
        out.preempted = watch.terms > 0
        if out.error is None:
            out.error = _read_error(watch.error_dir, out.rank)
        if out.stopped:
            out.status = None
    return [outcomes[p.rank] for p in ranks]


def _read_error(directory: Path, rank: int) -> dict[str, Any] | None:
    path = rank_error_path(directory, rank)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ranks(outcomes: Sequence[RankOutcome]) -> str:
    numbers = [str(o.rank) for o in sorted(outcomes, key=lambda o: o.rank)]
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(numbers)}"


def _signal_name(status: int) -> str:
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def _at_step(error: dict[str, Any] | None) -> str:
    step = (error or {}).get("step")
    return f" at step {step}" if step is not None else ""


def _same(a: RankOutcome, b: RankOutcome) -> bool:
    keys = ("type", "message", "step")
    return [(a.error or {}).get(k) for k in keys] == [(b.error or {}).get(k) for k in keys]


def _short(outcome: RankOutcome) -> str:
    """The first sentence of a rank's error, without gloo's ``[file:line]`` prefix."""
    message = (outcome.error or {}).get("message", "").splitlines()[0] if outcome.error else ""
    if message.startswith("[") and "] " in message:
        message = message.split("] ", 1)[1]
    return message.split(". ")[0]


def describe(outcome: RankOutcome) -> str:
    """One rank's end in words, e.g. ``rank 2 was killed by SIGKILL`` or ``rank 1 raised
    FloatingPointError at step 3: ... (in strategy/faults.py:80 in check)``."""
    error = outcome.error
    if error is None:
        if outcome.status is not None and outcome.status < 0:
            return f"rank {outcome.rank} was killed by {_signal_name(outcome.status)}"
        return f"rank {outcome.rank} exited with status {outcome.status}"
    text = f"rank {outcome.rank} raised {error['type']}{_at_step(error)}: {error['message']}"
    if error.get("collective"):
        text += f" (in collective {error['collective']})"
    if error.get("where"):
        text += f" (at {error['where']})"
    return text


def failure_summary(
    outcomes: Sequence[RankOutcome],
    last_checkpoint: str | None,
    resume_command: str,
    *,
    checkpoints: bool = True,
) -> list[str]:
    """The lines that end a failed launch: what ended it (the cause first: a rank killed by a
    signal or raising an error of its own; else the ranks whose collective timed out and the
    ones they waited for), what the other ranks did, then the last committed checkpoint and
    the command that continues from it."""
    failed = [o for o in outcomes if o.kind != "ok"]
    by_time = sorted(failed, key=lambda o: o.ended)
    causes = [o for o in by_time if o.kind in ("signal", "error")]
    timeouts = [o for o in by_time if o.kind == "timeout"]
    peers = [o for o in by_time if o.kind == "peer_lost"]
    stopped = [o for o in outcomes if o.kind == "stopped"]
    lines = []
    steps = [o.error["step"] for o in by_time if o.error and o.error.get("step") is not None]
    if causes:
        at = ""
        if causes[0].error is None and steps:
            at = f" (the other ranks were at step {steps[0]})"
        # the ranks that raised the same error (one agreed on by all) are named together
        same = [o for o in causes if o.error and causes[0].error and _same(o, causes[0])]
        if len(same) > 1:
            text = describe(causes[0]).split(" raised ", 1)[1]
            lines.append(f"job failed: {_ranks(same)} raised {text}")
        else:
            lines.append(f"job failed: {describe(causes[0])}{at}")
        lines += [f"  also: {describe(o)}" for o in causes[1:] if o not in same]
    if timeouts:
        first = timeouts[0].error or {}
        where: dict[str, list[RankOutcome]] = {}
        for out in timeouts:
            where.setdefault((out.error or {}).get("collective") or "a collective", []).append(out)
        places = "; ".join(f"{_ranks(outs)} in {name}" for name, outs in where.items())
        head = "job failed: " if not causes else "  "
        lines.append(
            f"{head}{_ranks(timeouts)} timed out waiting in a collective{_at_step(first)}: "
            f"{places} ({_short(timeouts[0])})"
        )
        if stopped:
            lines.append(
                f"  {_ranks(stopped)} never joined it (still running when stopped): the rank"
                f"{'s' if len(stopped) > 1 else ''} that hung"
            )
    if peers:
        head = "job failed: " if not (causes or timeouts) else "  then "
        lines.append(f"{head}{_ranks(peers)} failed as a peer was gone ({_short(peers[0])})")
    if not (causes or timeouts or peers):
        lines.append(f"job failed: {', '.join(describe(o) for o in failed) or 'no rank said why'}")
    elif stopped and not timeouts:
        lines.append(f"  {_ranks(stopped)} stopped by the launcher")
    if not checkpoints:
        lines.append(
            "last committed checkpoint: none (this recipe saves none: add +checkpoint.dir=DIR "
            "+checkpoint.every_n_train_steps=N)"
        )
        lines.append(f"rerun: {resume_command}")
    else:
        lines.append(f"last committed checkpoint: {last_checkpoint or 'none yet'}")
        lines.append(f"resume: {resume_command}")
    return lines


class OutputPump:
    """Copy what the ranks write to their files onto this process's streams, as it comes.

    ``sources``: (file, stream) pairs; :meth:`pump` copies what is new (call it often, and
    once more after the ranks are gone). Example::

        pump = OutputPump([(tmp / "stdout0.txt", sys.stdout)]); pump.pump()
    """

    def __init__(self, sources: Sequence[tuple[Path, TextIO]]) -> None:
        self.sources = list(sources)
        self.offsets = [0] * len(self.sources)

    def pump(self) -> None:
        """Copy the complete lines written since the last call."""
        for i, (path, stream) in enumerate(self.sources):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            cut = data.rfind(b"\n") + 1
            if cut:
                self.offsets[i] += cut
                stream.write(data[:cut].decode(errors="replace"))
                stream.flush()

    def flush(self) -> None:
        """Copy everything left, a last line without its newline too."""
        self.pump()
        for i, (path, stream) in enumerate(self.sources):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    rest = f.read()
            except FileNotFoundError:
                continue
            if rest:
                self.offsets[i] += len(rest)
                stream.write(rest.decode(errors="replace") + "\n")
                stream.flush()

"""Spawn real multi-process torch.distributed (gloo) jobs from a test.

Process start and the imports of torch / megatron / NeMo cost far more than the tiny models the
tests train (~10-20 s per 4-rank spawn on two cores), so a test module runs its cases in as few
spawns as it can: :func:`run_cases` runs many named cases in one spawn and reports each one's
outcome per rank; :func:`start_distributed` starts a job that the caller joins later (to run a
second job while the first waits).

Every spawn here forks its ranks from one *preloaded fork server* (:func:`start_ranks`): a
process started once per test session that imports torch, megatron-core and NeMo (~28 s of CPU
per process on two cores) and then forks each rank already imported. The ranks get the
parent's environment and working directory as they are at the call, as with ``spawn``, and
build their gloo groups on one TCP device each (:mod:`nemo_gtp.cpu.gloo_device`), with
the preloaded objects frozen out of the garbage collector's scans (``gc.freeze``).
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_gtp.cpu.gloo_device import share_gloo_device

COLLECTIVE_TIMEOUT_S = 300
"""Default bound on every collective: a rank stuck in one fails the spawn instead of hanging the
suite (gloo's own default is 30 minutes). Generous for the tests' tiny models, whose ranks can
still be minutes apart in their imports on a loaded two-core machine."""


PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "nemo.collections.llm",
    "nemo.lightning",
    "nemo_gtp.cpu.compat",
    "tests.harness.strategy",
)
"""What the fork server imports once, before it forks any rank (an import error there only
means that module is imported by each rank instead)."""

_preloaded = False


def _in_parent_env(rank: int, env: dict[str, str], cwd: str, fn: Callable, *args: Any) -> None:
    # A forked rank starts from the fork server's environment (the test session's at its
    # first spawn): give it the caller's, as a spawned process would have.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    share_gloo_device()  # every gloo group of the rank on one TCP device (gloo_device)
    # The preloaded imports stay out of every collection (recipes.launch.freeze_imports).
    gc.freeze()
    fn(rank, *args)


def start_ranks(fn: Callable, args: tuple, nprocs: int, *, join: bool) -> Any:
    """``torch.multiprocessing.start_processes`` of ``fn(rank, *args)`` on ``nprocs`` ranks,
    forked from the session's preloaded fork server (see the module docstring).

    Example::

        context = start_ranks(worker, (world, out_dir), nprocs=world, join=False)
        while not context.join(timeout=1.0): ...
    """
    global _preloaded
    if not _preloaded:  # before the fork server starts (it starts at the first forkserver call)
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        _preloaded = True
    return mp.start_processes(
        _in_parent_env,
        args=(dict(os.environ), os.getcwd(), fn, *args),
        nprocs=nprocs,
        join=join,
        start_method="forkserver",
    )


def _entry(
    rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, timeout_s: float | None
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    # Rendezvous through a file, not a TCP port chosen in advance: with jobs spawned back to
    # back (or side by side) a free port can be taken by gloo's own connections before it binds.
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **timeout)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


class DistributedJob:
    """A spawned gloo job; :meth:`join` waits for it and re-raises a rank's failure."""

    def __init__(self, context: mp.ProcessContext, store_dir: str) -> None:
        self._context = context
        self._store_dir = store_dir

    def poll(self) -> bool:
        """Whether every rank has exited (raises if one failed)."""
        try:
            done = self._context.join(timeout=0)
        except BaseException:
            self._cleanup()
            raise
        if done:
            self._cleanup()
        return done

    def join(self) -> None:
        """Wait for every rank; re-raise the first failure."""
        while not self.poll():
            time.sleep(0.2)

    def _cleanup(self) -> None:
        shutil.rmtree(self._store_dir, ignore_errors=True)


def start_distributed(
    fn: Callable, world_size: int, *args: Any, timeout_s: float | None = COLLECTIVE_TIMEOUT_S
) -> DistributedJob:
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; join it later."""
    store_dir = tempfile.mkdtemp(prefix="nemo_gtp_store_")
    context = start_ranks(
        _entry,
        (world_size, os.path.join(store_dir, "store"), fn, args, timeout_s),
        world_size,
        join=False,
    )
    return DistributedJob(context, store_dir)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout_s: float | None = COLLECTIVE_TIMEOUT_S
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise failures.

    ``timeout_s`` bounds every collective (a stuck rank fails the spawn instead of hanging).
    """
    start_distributed(fn, world_size, *args, timeout_s=timeout_s).join()


def spawn_bounded(worker: Callable, args: tuple, nprocs: int, timeout_s: float) -> str | None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes (the worker sets up its own
    process group, NCCL or gloo), for at most ``timeout_s`` seconds of wall clock.

    Returns None when every process ended cleanly, else why not (``"timed out after N s"``, or
    the failure of a rank); the processes still alive then are killed, so the caller never
    hangs (the GPU checks under ``bench/`` report what their ranks wrote before).

    Example::

        failed = spawn_bounded(worker, (2, args, store_path), nprocs=2, timeout_s=110)
    """
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout_s:.0f} s"
                break
    except Exception as err:  # noqa: BLE001 - a rank died: the caller reports what was written
        failed = repr(err)
    if failed is not None:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return failed


@dataclass(frozen=True)
class Outcome:
    """One rank's outcome of one case of :func:`run_cases`."""

    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0
    """Wall time of the case on this rank (where a module's spawn spends its time)."""


Case = tuple[str, Callable, tuple]
"""``(name, fn, args)``: ``fn(rank, world_size, *args)``, its return value recorded."""


def _cases_entry(rank: int, world_size: int, cases: Sequence[Case], out_dir: str) -> None:
    outcomes: dict[str, Outcome] = {}
    failed = None
    for name, fn, args in cases:
        if failed is not None:
            # This rank's collectives are out of step with its peers' after a failure: stop
            # here (the peers then fail fast on the closed connections instead of timing out
            # once per remaining case).
            outcomes[name] = Outcome(False, error=f"not run: case {failed!r} failed on this rank")
            continue
        start = time.perf_counter()
        try:
            value = fn(rank, world_size, *args)
            outcomes[name] = Outcome(True, value, seconds=time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - reported by the test that owns the case
            error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            outcomes[name] = Outcome(False, error=error, seconds=time.perf_counter() - start)
            failed = name
    Path(out_dir, f"outcomes.{rank}.pkl").write_bytes(pickle.dumps(outcomes))


def run_cases(
    cases: Sequence[Case],
    world_size: int,
    out_dir: str | Path,
    timeout_s: float | None = COLLECTIVE_TIMEOUT_S,
) -> dict[str, list[Outcome]]:
    """Run every case, in order, in one spawn of ``world_size`` ranks.

    Returns ``{name: [outcome of rank 0, rank 1, ...]}``; a case that raised on a rank is
    recorded there (the spawn itself succeeds), so each test checks its own case with
    :func:`case_values`.
    """
    names = [name for name, _, _ in cases]
    assert len(set(names)) == len(names), f"duplicate case names: {names}"
    run_distributed(_cases_entry, world_size, list(cases), str(out_dir), timeout_s=timeout_s)
    per_rank = [
        pickle.loads(Path(out_dir, f"outcomes.{r}.pkl").read_bytes()) for r in range(world_size)
    ]
    return {name: [ranks[name] for ranks in per_rank] for name in names}


def case_values(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value of a case; ``AssertionError`` with each failing rank's error."""
    errors = [f"--- rank {rank}: {o.error}" for rank, o in enumerate(outcomes) if not o.ok]
    if errors:
        raise AssertionError("\n".join(errors))
    return [o.value for o in outcomes]

"""Several recipe fits in one multi-process launch (``run.py --compare-baseline``).

Starting a rank and importing NeMo costs far more than a tiny fit, so the GTP run and its
baseline share one launch: the parent starts one process per rank (``RANK``/``LOCAL_RANK``/
``WORLD_SIZE`` in the environment, which Lightning's ``LightningEnvironment`` takes as an
external launch: :func:`rank_env`, which the bench scripts' launches use too), and each rank
runs the fits in order, tearing down megatron/NeMo process-global state between them
(:func:`teardown_fit`). A CPU recipe's ranks are forked from one process that imported NeMo
once (:mod:`nemo_gtp.recipes.rank_preload`; four ranks importing it side by side cost ~25 s of
CPU each, which two cores pay twice over); a GPU recipe's ranks are fresh interpreters (an
import that touched CUDA would poison a fork, and a GPU node has a core per rank). The
rendezvous of each fit goes through its own ``FileStore`` (handed to the strategy's ``store``,
which NeMo passes to ``init_process_group``), so no TCP port has to be picked in advance.

:func:`run_recipe` is the same launch for one plain run of ``python -m nemo_gtp.run``. Both
watch their ranks (:mod:`nemo_gtp.recipes.supervise`): each rank leads a process group of its
own, records the exception that ends it, and when one fails the others are stopped and the
launch says which rank failed and why (``run_recipe``: as its last lines, with the last
committed checkpoint and the resume command).

Example::

    logs = launch_fits("configs/tiny_cpu.yaml",
                       {"gtp": [], "baseline": ["strategy.num_weight_shards=1"]})
    logs["gtp"]  # [{"step": 0, "loss": ..., "ms": ...}, ...] from rank 0
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_gtp.recipes.schema import is_cpu_recipe
from nemo_gtp.recipes.supervise import (
    OutputPump,
    RankProcess,
    describe,
    failure_summary,
    supervise,
    write_rank_error,
)

PROG = "python -m nemo_gtp.run"  # the command a resume line names

# NVLink SHARP (NVLS) and symmetric-memory multicast stay off on the GPU machines the benches
# run on; defaults only: a value already in the environment wins.
NCCL_SINGLE_NODE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def rank_env(
    rank: int,
    world: int,
    *,
    nccl: bool = False,
    master_port: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank`` of a ``world``-process launch on this one node.

    ``base`` (default: ``os.environ``) plus what an external launcher sets for Lightning's
    ``LightningEnvironment`` and torch.distributed: ``RANK`` = ``LOCAL_RANK`` = ``rank``,
    ``NODE_RANK=0``, ``WORLD_SIZE=world``, ``MASTER_ADDR=127.0.0.1``, and ``MASTER_PORT`` only
    when ``master_port`` is given (the launches here meet through a ``FileStore``, so they need
    no port). Defaults that ``base`` may override: ``OMP_NUM_THREADS=1`` (as torchrun sets it
    for several ranks on one node: ``world`` processes with a thread per core each would
    oversubscribe the cores) and, with ``nccl=True``, :data:`NCCL_SINGLE_NODE_ENV`.

    Example::

        env = rank_env(1, 2, nccl=True)
        env["RANK"], env["WORLD_SIZE"], env["NCCL_NVLS_ENABLE"]  # ("1", "2", "0") unless set
        subprocess.Popen([sys.executable, "worker.py"], env=env)
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank_env: rank must be in [0, world={world}), got {rank}")
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    if nccl:
        for key, value in NCCL_SINGLE_NODE_ENV.items():
            env.setdefault(key, value)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    return env


def freeze_imports() -> None:
    """Keep what the imports made out of the garbage collector's scans (``gc.freeze``).

    Call once per process after NeMo is imported and before the first fit. NeMo, megatron,
    transformers and their kin leave millions of objects that live as long as the process:
    every full collection walks them all (about 2 s per ``gc.collect()`` on a 2-core machine,
    twice per :func:`teardown_fit`, and in Python's own collections during training). Frozen,
    they are never scanned; what fits create is collected as before.

    Example::

        freeze_imports()
        for fit in fits: ...; teardown_fit()
    """
    import gc

    import nemo.collections.llm  # noqa: F401  (what every fit imports anyway)

    gc.freeze()


MAX_COLLECTIONS = 8
""":func:`collect_garbage`: full collections at most (each one can take seconds once megatron's
graph capture has unfrozen the imports)."""


def collect_garbage() -> int:
    """Full collections until one finds no garbage (at most :data:`MAX_COLLECTIONS`); returns
    how many objects they freed.

    One collection is not enough after a fit: what autograd's C++ nodes hold (megatron DDP's
    ``AccumulateGrad`` nodes, the autograd graphs of a captured layer) counts as a live
    reference while the Python cycle owning those nodes is analysed, and is dropped only when
    that cycle is freed. The GTP weights form a cycle of their own (weight -> state -> chain ->
    weight) that such a node pins, so it becomes garbage one collection later: after a fit with
    per-layer CUDA graphs, a single collection left the 1B recipe's GTP weights with their
    gradient buffer and optimizer copies (5.3 GiB on an H100) to the next fit.

    Example::

        teardown_fit()  # ends with collect_garbage()
    """
    import gc

    freed = 0
    for _ in range(MAX_COLLECTIONS):
        found = gc.collect()
        freed += found
        if not found:
            break
    return freed


def teardown_fit() -> None:
    """Reset what one ``trainer.fit`` leaves in process-global state before the next one.

    Megatron's parallel state and microbatch calculator are module globals that NeMo sets once
    per fit; the default process group is destroyed so the next fit's strategy creates its own.
    So are megatron's CUDA graphs (class attributes of ``FullCudaGraphWrapper`` for the
    full-iteration graph, of the per-layer graph manager and its capture record): left in
    place, the next fit would replay the previous model's graphs. And megatron's RNG tracker:
    it is made once per process (later requests are ignored), so a fit asking for TE's
    capturable tracker after one without it would get the first fit's tracker and fail graph
    capture ("RNG tracker does not support cudagraphs!"). And NeMo's attribute proxy, which its
    teardown leaves on a model class under virtual pipeline parallelism
    (:func:`drop_leftover_getattr_proxies`). And three holders that would each keep the fit's
    model, grads and optimizer state alive for the life of the process: megatron DDP's grad
    hooks (:func:`~nemo_gtp.integrations.megatron.ddp.release_finished_ddp_hooks`), the model
    methods Lightning attached to NeMo's one-per-process callback
    (:func:`detach_singleton_callbacks`) and megatron's class-level RoPE caches
    (:func:`clear_rotary_caches`). Then it collects until nothing more is freed
    (:func:`collect_garbage`).
    """
    import gc

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator
    from megatron.core.tensor_parallel import random as megatron_random

    parallel_state.destroy_model_parallel()
    unset_num_microbatches_calculator()
    from nemo_gtp.cpu.compat import CpuRNGStatesTracker

    # The next fit's strategy makes the tracker its settings ask for (module globals); the CPU
    # stand-in tracker of cpu_compat (no graphs on CPU) stays for the life of the process.
    if not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        megatron_random._CUDA_RNG_STATE_TRACKER = None
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
    except ImportError:  # megatron-core without full-iteration graphs
        pass
    else:
        for stage in ("training", "validation"):
            FullCudaGraphWrapper.curr_iteration[stage] = 0
            FullCudaGraphWrapper.cuda_graph[stage] = None
            FullCudaGraphWrapper.result[stage] = None
            StaticBufferLoader.static_buffers[stage] = []
    from nemo_gtp.integrations.megatron.ddp import release_finished_ddp_hooks
    from nemo_gtp.integrations.megatron.layer_graphs import (
        release_live_cuda_graphs,
        reset_layer_graphs,
    )

    reset_layer_graphs()
    drop_leftover_getattr_proxies()
    # Free the fit's CUDA graphs and finish its work before the communicators go: a per-layer
    # graph holding GTP's captured NCCL collectives kept destroy_process_group waiting on
    # 2xH200, also after the references we know of were dropped; so every graph still alive
    # is reset, whoever holds it.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        release_live_cuda_graphs()
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()
    release_finished_ddp_hooks()  # else the fit's model, grads and optimizer outlive it
    detach_singleton_callbacks()  # the same, held by NeMo's one-per-process callback
    clear_rotary_caches()  # the same, held by megatron's class-level RoPE caches
    collect_garbage()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def detach_singleton_callbacks() -> int:
    """Drop what Lightning attached to NeMo's process-wide callback during the fit.

    Lightning sets ``callback.log`` / ``callback.log_dict`` to the fit's ``LightningModule``
    methods on every callback of the trainer. ``OneLoggerNeMoCallback`` is one object per
    process (every NeMo trainer gets the same instance), so it would keep the last fit's model,
    gradients and optimizer state alive after the fit. Returns how many attributes it dropped.

    Example::

        trainer.fit(model, datamodule=data)
        detach_singleton_callbacks()  # 2: log and log_dict
    """
    module = sys.modules.get("nemo.lightning.one_logger_callback")  # never imported: nothing held
    instance = getattr(getattr(module, "OneLoggerNeMoCallback", None), "_instance", None)
    dropped = 0
    for name in ("log", "log_dict"):
        if instance is not None and name in vars(instance):
            delattr(instance, name)
            dropped += 1
    return dropped


def clear_rotary_caches() -> int:
    """Empty megatron's class-level ``lru_cache``s of its rotary embeddings.

    ``RotaryEmbedding.forward`` (and its YaRN kin) is cached per class, keyed by the module
    itself, so the cache keeps the last fits' rotary modules alive, and through the forward
    hooks megatron DDP registers on them, their whole models. Returns how many caches it
    emptied.

    Example::

        trainer.fit(model, datamodule=data)   # a RoPE model
        clear_rotary_caches()
    """
    prefix = "megatron.core.models.common.embeddings."
    cleared = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            for attr in vars(cls).values():
                if hasattr(attr, "cache_clear"):
                    attr.cache_clear()
                    cleared += 1
    return cleared


def drop_leftover_getattr_proxies() -> int:
    """Remove NeMo's DDP attribute proxy from every module class its teardown left it on.

    ``MegatronParallel.init_ddp`` (NeMo 2.7.3) saves each chunk's ``__getattr__`` and then sets
    the chunk's *class* ``__getattr__`` to its proxy; ``teardown_ddp`` puts the saved ones back
    in chunk order. Under virtual pipeline parallelism the chunks share a class, so the second
    chunk saved the proxy the first had set, and the class keeps the proxy after the fit. A
    later fit of a subclass then recurses in it (``super(type(self), self).__getattr__`` finds
    the parent's proxy again). The classes never define ``__getattr__`` themselves (NeMo's
    saved one is ``nn.Module``'s), so deleting the class attribute restores them. Returns how
    many classes were fixed.

    Example::

        trainer.fit(model, datamodule=data)   # virtual_pipeline_model_parallel_size=2
        drop_leftover_getattr_proxies()       # 1: the model class
    """
    import torch
    from nemo.lightning.megatron_parallel import getattr_proxy

    fixed, seen, stack = 0, set(), [torch.nn.Module]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if getattr(vars(cls).get("__getattr__"), "__code__", None) is getattr_proxy.__code__:
            delattr(cls, "__getattr__")
            fixed += 1
    return fixed


def _world_size(cfg: Any) -> int:
    trainer = cfg.trainer
    return int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))


def launch_fits(
    config: str,
    runs: dict[str, list[str]],
    *,
    log_dirs: dict[str, str] | None = None,
    stderr_tail: int = 4000,
) -> dict[str, list[dict]]:
    """Run ``config`` once per entry of ``runs`` (name -> overrides) in one launch.

    Every run must need the same number of processes. Returns rank 0's per-step loss log of
    each run (see :class:`nemo_gtp.recipes.loader.LossLog`). ``log_dirs`` (name -> directory):
    each run logs there as ``build_fit(..., log_dir=...)`` does (TensorBoard). When a rank
    fails, the others are stopped (:func:`nemo_gtp.recipes.supervise.supervise`) and a
    ``RuntimeError`` says which rank failed and why, with its stderr tail.
    """
    from nemo_gtp.recipes.config import load_recipe

    cfgs = {name: load_recipe(config, args) for name, args in runs.items()}
    worlds = {name: _world_size(cfg) for name, cfg in cfgs.items()}
    if len(set(worlds.values())) != 1:
        raise ValueError(
            f"runs sharing one launch need the same trainer.devices x num_nodes, got {worlds}"
        )
    world = next(iter(worlds.values()))
    start = _fork_rank if is_cpu_recipe(next(iter(cfgs.values()))) else _exec_rank
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        dirs = [(log_dirs or {}).get(name) for name in runs]
        spec.write_text(json.dumps({"config": config, "runs": runs, "dir": tmp, "logs": dirs}))
        ranks = [
            _as_rank(r, start(str(spec), rank_env(r, world), str(Path(tmp, f"stderr{r}.txt"))))
            for r in range(world)
        ]
        outcomes = supervise(ranks, tmp)
        failed = [o for o in outcomes if o.failed]
        if failed:
            first = min(failed, key=lambda o: (o.kind not in ("signal", "error"), o.ended))
            if first.error is None:  # ranks that ended alike without a word: the lowest
                alike = [o for o in failed if o.error is None and o.status == first.status]
                first = min(alike, key=lambda o: o.rank)
            rank, code = first.rank, first.status
            stderr = Path(tmp, f"stderr{rank}.txt")
            if not stderr.exists():  # died before its first line of its own
                raise RuntimeError(
                    f"rank {rank} exited with {code} before it wrote a line (e.g. a "
                    "script that calls launch_fits at its top level: guard the call with `if "
                    '__name__ == "__main__":`, CPU recipes fork their ranks from a fork '
                    "server, which imports the script's main module again)"
                )
            tail = stderr.read_text()[-stderr_tail:]
            summary = "\n".join(describe(o) for o in failed)
            raise RuntimeError(f"rank {rank} exited with {code}:\n{tail}\n{summary}")
        return {name: _read_log(Path(tmp, f"{i}.jsonl")) for i, name in enumerate(runs)}


def run_recipe(
    config: str,
    overrides: list[str],
    *,
    loss_log: str | None = None,
    log_dir: str | None = None,
    grace_s: float = 5.0,
) -> int:
    """Train one recipe on ``trainer.devices`` processes of this node and watch them.

    What the ranks print comes out here as it is written; when a rank dies (a signal, an
    exception, a collective's timeout) the others are stopped and the last lines printed say
    which rank, why, the last committed checkpoint and the command that resumes from it
    (:func:`nemo_gtp.recipes.supervise.failure_summary`). A ``SIGTERM`` (Slurm's preemption)
    makes the ranks save at the next step boundary and exit 0. Returns the exit status: 0, or
    1 when a rank failed. ``loss_log``: rank 0's per-step losses (``LossLog``).

    Example::

        run_recipe("configs/tiny_cpu.yaml", ["trainer.max_steps=10"])   # 0
    """
    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.resume import latest_checkpoint

    cfg = load_recipe(config, overrides)
    world = _world_size(cfg)
    start = _fork_rank if is_cpu_recipe(cfg) else _exec_rank
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        plain = {"loss_log": loss_log}
        body = {"config": config, "runs": {"run": overrides}, "dir": tmp, "logs": [log_dir]}
        spec.write_text(json.dumps({**body, "plain": plain}))
        ranks = []
        for r in range(world):
            out, err = Path(tmp, f"stdout{r}.txt"), Path(tmp, f"stderr{r}.txt")
            ranks.append(_as_rank(r, start(str(spec), rank_env(r, world), str(err), str(out))))
        sources = [(Path(tmp, f"stdout{r}.txt"), sys.stdout) for r in range(world)]
        sources += [(Path(tmp, f"stderr{r}.txt"), sys.stderr) for r in range(world)]
        pump = OutputPump(sources)
        try:
            outcomes = supervise(ranks, tmp, grace_s=grace_s, on_poll=pump.pump)
        except KeyboardInterrupt:  # Ctrl-C: supervise has stopped every rank
            outcomes = None
        pump.flush()
    checkpoint = cfg.get("checkpoint")
    last = latest_checkpoint(checkpoint.dir) if checkpoint else None
    kept = [a for a in overrides if not a.lstrip("+").startswith("resume=")]
    options = [f"--loss-log {loss_log}"] if loss_log else []
    if log_dir is not None and Path(log_dir) != Path("runs", Path(config).stem):
        options.append(f"--log-dir {log_dir}")
    resume = ["+resume=latest"] if checkpoint else []
    again = " ".join([PROG, config, *kept, *resume, *options])
    if outcomes is None:
        where = f"last committed checkpoint: {last or 'none yet'}" if checkpoint else "no saves"
        print(f"interrupted: every rank stopped; {where}; resume: {again}", file=sys.stderr)
        return 130
    if not any(o.failed for o in outcomes):
        if any(o.preempted for o in outcomes) and checkpoint:
            print(f"preempted; continue with: {again}", file=sys.stderr, flush=True)
        return 0
    lines = failure_summary(outcomes, last and str(last), again, checkpoints=bool(checkpoint))
    sys.stdout.flush()
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


def _as_rank(rank: int, handle: Any) -> RankProcess:
    """A started rank as the supervisor watches it; a bare ``wait`` callable (a process's
    ``wait`` method) is polled through its process."""
    if isinstance(handle, RankProcess):
        return handle
    proc = getattr(handle, "__self__", None)
    if proc is not None and hasattr(proc, "poll") and hasattr(proc, "pid"):
        return RankProcess(rank, proc.pid, proc.poll)
    raise TypeError(f"rank {rank}: cannot watch {handle!r}")


def _exec_rank(
    spec: str, env: dict[str, str], stderr_path: str, stdout_path: str | None = None
) -> RankProcess:
    """One rank as a fresh interpreter, in a process group of its own."""
    with (
        open(stderr_path, "w") as err,  # the child holds its own descriptors
        open(stdout_path or os.devnull, "w") as out,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_gtp.recipes.launch", spec],
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its group: the supervisor stops it with its helpers
        )
    return RankProcess(int(env["RANK"]), proc.pid, proc.poll)


def _fork_rank(
    spec: str, env: dict[str, str], stderr_path: str, stdout_path: str | None = None
) -> RankProcess:
    """One rank forked from the preloaded fork server (CPU recipes), in a group of its own."""
    fork = multiprocessing.get_context("forkserver")
    # Takes effect when this process's fork server starts (its first fork); a server already
    # running (a test session's) keeps its own preload, which imports NeMo as well.
    fork.set_forkserver_preload(["nemo_gtp.recipes.rank_preload"])
    args = (spec, env, os.getcwd(), stderr_path, stdout_path)
    proc = fork.Process(target=_forked_rank_main, args=args)
    proc.start()
    return RankProcess(int(env["RANK"]), int(proc.pid or 0), lambda: proc.exitcode)


def _forked_rank_main(
    spec: str, env: dict[str, str], cwd: str, stderr_path: str, stdout_path: str | None = None
) -> None:
    # As a fresh interpreter would start: the launch's environment and directory (the fork
    # server has the parent's of its start), stdout to its file or discarded, stderr to its
    # file; a process group of its own, which the supervisor stops with its helpers.
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    with open(stdout_path or os.devnull, "w") as out, open(stderr_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        _rank_main(spec)
    except SystemExit as stop:
        sys.stdout.flush()
        sys.stderr.flush()
        if stop.code not in (0, None):
            _record_error(spec, stop)
        os._exit(0 if stop.code in (0, None) else 1)
    except BaseException as exc:
        import traceback

        _record_error(spec, exc)
        traceback.print_exc()  # what a fresh interpreter prints before exiting with 1
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def _record_error(spec: str, exc: BaseException) -> None:
    rank = int(os.environ.get("RANK", "0"))
    write_rank_error(json.loads(Path(spec).read_text())["dir"], rank, exc)


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rank_main(spec_path: str) -> None:
    """One rank: every run of the spec in order, torn down in between."""
    from nemo_gtp.recipes.quiet import quiet_known_warnings

    quiet_known_warnings()  # before NeMo / megatron import: most of the noise is import time
    import torch.distributed as dist

    from nemo_gtp.recipes.loader import LossLog, build_fit, load_recipe, progress_callbacks

    spec = json.loads(Path(spec_path).read_text())
    world = int(os.environ["WORLD_SIZE"])
    freeze_imports()
    from nemo_gtp.strategy.faults import add_error_sink, install_preemption_handler

    rank = int(os.environ["RANK"])
    add_error_sink(lambda error: write_rank_error(spec["dir"], rank, error))
    plain = spec.get("plain")
    for i, args in enumerate(spec["runs"].values()):
        cfg = load_recipe(spec["config"], args)
        if cfg.get("checkpoint") and (cfg.get("faults") or {}).get("preemption", True):
            install_preemption_handler()  # a SIGTERM from now on: saved at a step boundary
        if plain is None:  # launch_fits: rank 0's losses for the parent
            callbacks = [LossLog(str(Path(spec["dir"], f"{i}.jsonl")))]
        else:  # run_recipe: the progress lines, and the loss log asked for
            callbacks = progress_callbacks(cfg, plain["loss_log"])
        fit = build_fit(cfg, callbacks=callbacks, log_dir=spec["logs"][i])
        fit.trainer.strategy.store = dist.FileStore(str(Path(spec["dir"], f"store{i}")), world)
        try:
            fit.run()
        finally:
            del fit
            teardown_fit()


if __name__ == "__main__":
    try:
        _rank_main(sys.argv[1])
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            _record_error(sys.argv[1], error)
        raise

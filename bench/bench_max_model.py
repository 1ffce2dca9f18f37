"""Largest GPT that trains on 2 GPUs per mode: DDP, FSDP2, Megatron-FSDP, GTP2 (± options).

Question: What is the largest GPT each mode trains at 4k tokens per GPU on 2 GPUs?

Ranks: NCCL, one rank per GPU (each probe a fresh set of rank processes); CPU/gloo probes for the
tests.

Question: at 4k tokens per GPU (micro-batch 1 x seq 4096) on 2xH200, how many layers of a
fixed-width GPT (hidden 4096, ffn 16384, 32 heads, vocab 32000, bf16, megatron-core's local
layer spec: no TransformerEngine) complete 5 training steps under each mode, and at what speed
and peak memory? Modes (``MODES``): ``gtp2``, ``dp2`` (megatron DDP +
distributed optimizer), ``fsdp2`` (torch FSDP2), ``gtp2_srp`` (+
``shard_replicated_params_over_gtp``), ``gtp2_recompute`` (+ megatron full recompute, uniform,
1 layer), ``mfsdp`` (Megatron-FSDP from ``megatron.core.distributed.fsdp``; the report says why
when it cannot run). The models are ``bench_gpt.build``'s (same config, optimizer kernels).

How (a scarce GPU budget): the driver (this script, no torch) predicts each mode's largest layer
count with the planner (``nemo_gtp.plan``) and probes only around it (the search below:
bracket the boundary, extrapolate from measured peaks, usually 2-3 probes per mode). Every probe
is a fresh set of ``world`` processes (this script with ``--probe MODE,LAYERS``; it also runs
under ``torchrun``) that builds the model, trains ``--steps`` steps and times the last
``--timed-steps``. Each rank writes ``<scratch>/<mode>_L<layers>.rank<r>.json`` itself. An OOM on
one rank (which leaves its peer blocked in a collective) is written by that rank before it
exits; the driver then kills the probe's process group, as it does at the wall-clock timeout,
so no probe stalls the sweep. ``--budget-s`` bounds the whole sweep (a probe still running at
its end is killed and recorded as ``cut``). The JSON and the markdown table are rewritten after
every probe.

GPU (2xH200, the megatron-core / NeMo wheels installed and on ``PYTHONPATH`` as for
``bench_gpt.py``; expected 5-8 minutes: 14-19 probes of 15-40 s; hard cap ``--budget-s 540``,
so one command with a 600 s limit holds it; ``--modes`` splits it over several)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.bench_max_model --out $OUT/max_model

Only ``max_model.json`` and ``max_model.md`` are written under ``--out`` (per-rank files and logs
go to ``--scratch``, a temporary folder; the JSON keeps every rank's result and, for a failed
probe, the tails of its logs).

CPU smoke (gloo, hidden 64, a fake memory limit on weights + grads + optimizer state + the
activations autograd saves: exercises prediction, search, OOM handling and the report; about
3-5 minutes on 2 busy cores; ``tests/test_bench_max_model.py`` covers the same in ~30 s)::

    PYTHONPATH=$PWD python -m bench.bench_max_model --device cpu --out /tmp/max_model_cpu

Output: ``<out>/max_model.json`` (every probe, per rank) and ``<out>/max_model.md`` (per mode:
largest layer count, parameters, tokens/s, step ms, peak allocated / reserved / device memory,
the planner's prediction; gtp2_recompute vs gtp2 step time at gtp2's largest size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from bench.common import free_port, module_argv, with_root
from nemo_gtp.plan import GIB, Layout, ModelShape, estimate
from nemo_gtp.recipes.launch import NCCL_SINGLE_NODE_ENV, rank_env

# ------------------------------------------------------------------------------ the search
# Which layer counts this script probes: planner predictions and the search (no torch).
#
# Every mode's per-GPU peak is a straight line in the layer count, ``a + b * layers`` (weights,
# grads, optimizer state, gathered weights and activations all scale with the layers; embeddings,
# logits and the CUDA context do not). The planner (``nemo_gtp.plan.estimate``) gives a prior line
# per mode; successful probes give measured points. The search keeps the largest layer count that
# trained (``lo``) and the smallest that failed (``hi``) and stops when ``hi == lo + 1``. Its next
# guess is where the best line it has crosses the memory budget:
#
# - two measured points of this mode: the line through them (exact up to allocator slack);
# - one point: the planner's intercept and the slope through that point (the per-layer terms are
#   what the planner gets wrong: activations, allocator rounding);
# - none: the planner's line, shifted by the intercept and slope errors measured on an earlier
#   mode of the same activation class (with or without recompute) when there is one, else
#   ``first_fraction`` of the planner's prediction (a calibration probe that is expected to fit:
#   the planner counts 2 bytes per attention score, the local spec's unfused attention keeps 6,
#   its fp32 softmax output and bf16 probabilities).
#
# A guess the data contradict (at or above a failed count) falls back to bisection; with only
# failures so far the next probe is at least a quarter smaller.
#
# Example::
#
#     prior = planner_line(MODES["gtp2"], shape, world=2, tokens_per_gpu=4096)
#     layers = next_layers([], prior, budget=139 * GIB, first_fraction=0.5)

# Probe outcomes. "oom" and "timeout" bound the search from above; "error" ends the mode.
OK, OOM, TIMEOUT, ERROR = "ok", "oom", "timeout", "error"
FAILED = (OOM, TIMEOUT)


@dataclass(frozen=True)
class Mode:
    """One way to train the model on ``world`` GPUs, as the probe builds it."""

    name: str
    builder: str  # a bench_gpt.build mode, or "mfsdp" (Megatron-FSDP, built here)
    doc: str
    recompute: bool = False
    gtp: bool = False
    shard_replicated: bool = False
    zero3_bytes_per_param: int = 0  # fully sharded modes: state bytes per param over the world
    cuda_only: bool = False

    def layout(self, world: int) -> Layout | None:
        """The planner's layout, or None for the fully sharded modes (no planner layout)."""
        if self.zero3_bytes_per_param:
            return None
        if self.gtp:
            return Layout(1, world, 1, self.recompute, self.shard_replicated)
        return Layout(1, 1, world, self.recompute)


MODES = {
    m.name: m
    for m in (
        Mode(
            "gtp2",
            "gtp_auto",
            "GTP over every GPU (default GTPConfig), megatron DDP + distopt",
            gtp=True,
        ),
        Mode("dp2", "ddp", "megatron DDP, distributed optimizer, fp32 grad reduce"),
        Mode(
            "fsdp2",
            "fsdp2",
            "torch FSDP2 per layer + root, fp32 master params, bf16 compute",
            zero3_bytes_per_param=16,  # fp32 param + fp32 grad + Adam m, v
        ),
        Mode(
            "gtp2_srp",
            "gtp_sr",
            "gtp2 + shard_replicated_params_over_gtp",
            gtp=True,
            shard_replicated=True,
        ),
        Mode(
            "gtp2_recompute",
            "gtp_auto",
            "gtp2 + full activation recompute (uniform, 1 layer)",
            recompute=True,
            gtp=True,
        ),
        Mode(
            "mfsdp",
            "mfsdp",
            "Megatron-FSDP (megatron.core.distributed.fsdp), optim_grads_params",
            zero3_bytes_per_param=18,  # fp32 main + bf16 model shard + fp32 grad + Adam m, v
            cuda_only=True,
        ),
    )
}


def predicted_bytes(
    mode: Mode, shape: ModelShape, *, world: int, tokens_per_gpu: int, overhead_gib: float = 3.0
) -> dict[str, float]:
    """Per-GPU bytes of ``mode`` by the planner (its ``estimate``), split as the planner splits.

    The fully sharded modes have no planner layout: their state is ``zero3_bytes_per_param`` per
    parameter over the world, plus the unsharded bf16 weights of two layers (current and
    prefetched), one layer's bf16 grads and fp32 reduce-scatter input, and the root's unsharded
    embeddings and output layer; activations as the planner's DP layout.
    """
    layout = mode.layout(world)
    if layout is not None:
        return estimate(shape, layout, tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib)
    base = estimate(
        shape, Layout(1, 1, world), tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib
    )
    layer = shape.linear_params_per_layer
    return {
        "state": shape.parameters * mode.zero3_bytes_per_param / world,
        "gather": 2 * 2 * layer + 6 * layer + 2 * shape.embedding_params,
        "activations": base["activations"],
        "overhead": base["overhead"],
    }


@dataclass(frozen=True)
class Line:
    """Peak bytes per GPU = ``a + b * layers``."""

    a: float
    b: float

    def at(self, layers: int) -> float:
        """Bytes at ``layers``."""
        return self.a + self.b * layers

    def max_layers(self, budget: float) -> int:
        """Largest layer count whose bytes stay within ``budget`` (0 when none does)."""
        if self.b <= 0:
            return 10**6
        return max(0, math.floor((budget - self.a) / self.b))


def planner_line(
    mode: Mode, shape: ModelShape, *, world: int, tokens_per_gpu: int, overhead_gib: float = 3.0
) -> Line:
    """The planner's peak as a line in the layer count (it is linear: two points fix it)."""

    def total(layers: int) -> float:
        s = ModelShape(**{**shape.__dict__, "layers": layers})
        return sum(
            predicted_bytes(
                mode, s, world=world, tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib
            ).values()
        )

    one, two = total(1), total(2)
    return Line(one - (two - one), two - one)


@dataclass(frozen=True)
class Point:
    """One probe as the search sees it: layers, outcome, measured peak bytes (None unless ok)."""

    layers: int
    outcome: str
    peak: float | None = None


def fit_line(points: list[Point], prior: Line) -> Line:
    """The best line for a mode from its successful probes (see the module docstring)."""
    ok = {p.layers: p.peak for p in points if p.outcome == OK and p.peak is not None}
    if len(ok) >= 2:
        (l1, p1), (l2, p2) = sorted(ok.items())[-2:]
        slope = (p2 - p1) / (l2 - l1)
        if slope > 0:
            return Line(p2 - slope * l2, slope)
    if ok:
        l0, p0 = max(ok.items())
        slope = (p0 - prior.a) / l0
        if slope > 0:
            return Line(prior.a, slope)
    return prior


def bracket(points: list[Point]) -> tuple[int, int | None]:
    """(largest layer count that trained or 0, smallest failed count above it or None)."""
    lo = max((p.layers for p in points if p.outcome == OK), default=0)
    hi = min((p.layers for p in points if p.outcome in FAILED and p.layers > lo), default=None)
    return lo, hi


def next_layers(
    points: list[Point],
    prior: Line,
    budget: float,
    *,
    first_fraction: float | None = None,
    margin: float = GIB,
    max_layers: int = 256,
) -> int | None:
    """The next layer count to probe, or None when the search is done.

    ``points``: this mode's probes so far; ``prior``: its planner line (already corrected by
    other modes' measurements where there are some); ``budget``: bytes per GPU;
    ``first_fraction``: scale of the very first guess when the prior is uncorrected.
    """
    lo, hi = bracket(points)
    if hi is not None and hi <= lo + 1:
        return None  # the boundary is found
    if hi == 1 or lo >= max_layers:
        return None  # nothing fits, or the cap is reached
    guess = fit_line(points, prior).max_layers(budget - margin)
    if not points and first_fraction is not None:
        guess = max(1, math.floor(first_fraction * guess))
    upper = max_layers if hi is None else hi - 1
    if lo == 0 and hi is not None:  # only failures: shrink by at least a quarter
        return max(1, min(guess, hi - max(1, hi // 4)))
    if guess <= lo:
        return lo + 1  # the line says lo is the largest: confirm that lo + 1 fails
    if guess > upper:
        return (lo + hi) // 2 if hi is not None else upper  # the data contradict the line
    return guess


DEFAULT_MODES = "gtp2,dp2,fsdp2,gtp2_srp,gtp2_recompute,mfsdp"
# (hidden, ffn, heads, vocab, seq, micro-batch) per device; CPU: the smoke's tiny width.
SHAPES = {"cuda": (4096, 16384, 32, 32000, 4096, 1), "cpu": (64, 256, 4, 256, 128, 1)}
CPU_MEMORY_LIMIT_GIB = 0.008  # the smoke's fake per-rank limit: a few layers fit
NCCL_ENV = NCCL_SINGLE_NODE_ENV  # what every probe's ranks run with (unless exported)
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "FakeOutOfMemory")
CUT = "cut"  # a probe the sweep's time budget ended (neither a fit nor a failure)
FAIL_GRACE_S = 5.0  # after one rank reported a failure, the others get this long to exit


# ---------------------------------------------------------------------------------------------
# Probe: one (mode, layers) in this process, one rank of ``world``
# ---------------------------------------------------------------------------------------------


class FakeOutOfMemory(RuntimeError):
    """CPU smoke: the probe's measured bytes passed ``--memory-limit-gib``."""


def probe_main(args: argparse.Namespace) -> None:
    """Build, train ``args.steps`` steps, write this rank's result JSON, exit (never returns)."""
    start = time.monotonic()
    mode_name, layers = args.probe.split(",")
    mode, layers = MODES[mode_name], int(layers)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    result: dict = dict(mode=mode.name, layers=layers, rank=rank, world=world, phase="init")
    path = os.path.join(scratch_dir(args), f"{mode.name}_L{layers}.rank{rank}.json")

    def finish(outcome: str, **extra: object) -> None:
        result.update(outcome=outcome, wall_s=time.monotonic() - start, **extra)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)  # the driver never reads half a file
        sys.stdout.flush()
        sys.stderr.flush()
        # No teardown: a peer may be blocked in a collective, and the exit frees the memory.
        os._exit(0 if outcome == OK else 1)

    try:
        import torch
        import torch.distributed as dist

        device = args.device
        if device == "cuda":
            torch.cuda.set_device(local_rank)
            result["waited_for_memory_s"] = wait_for_free_device()
            if args.memory_limit_gib:
                total = torch.cuda.mem_get_info()[1]
                torch.cuda.set_per_process_memory_fraction(args.memory_limit_gib * GIB / total)
        if mode.cuda_only and device != "cuda":
            finish(ERROR, error=f"{mode.name} needs CUDA: skipped on {device}")
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        if args.fault:
            inject_fault(args.fault, rank, finish)
        result["phase"] = "import"
        from bench import bench_gpt

        if device == "cpu":
            from nemo_gtp.cpu.compat import enable_cpu_compat

            enable_cpu_compat(nemo=False)  # megatron only: NeMo's patches are not needed
        hidden, ffn, heads, vocab, seq, mbs = model_shape(args)
        ns = argparse.Namespace(
            layers=layers,
            hidden=hidden,
            ffn=ffn,
            heads=heads,
            vocab=vocab,
            max_seq=seq,
            optimizer_kernels=args.optimizer_kernels,
        )
        result["phase"] = "build"
        result["import_s"] = time.monotonic() - start
        if mode.builder == "mfsdp":
            model, optimizer, step, runtime, params = build_megatron_fsdp(ns, world, device)
        else:
            model, optimizer, step, runtime = bench_gpt.build(
                ns, mode.builder, world, device, mode.recompute
            )
            params = logical_params(model)
        result.update(params=params, build_s=time.monotonic() - start - result["import_s"])
        if device == "cuda":
            result.update(
                build_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                build_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            )
            torch.cuda.reset_peak_memory_stats()
        batch = bench_gpt.make_batch(ns, mbs, seq, device)
        times, losses, saved = [], [], 0
        for i in range(args.steps):
            result["phase"] = f"step {i + 1}"
            sync(device)
            t0 = time.perf_counter()
            if device == "cpu":
                with SavedTensorBytes(model) as counter:
                    losses.append(step(batch))
                saved = max(saved, counter.peak)
                check_fake_limit(args, bench_gpt.state_bytes(model, optimizer) + saved)
            else:
                losses.append(step(batch))
            sync(device)
            times.append(time.perf_counter() - t0)
        timed = times[-args.timed_steps :]
        step_s = statistics.median(timed)
        result.update(
            phase="done",
            step_ms=1000 * step_s,
            step_ms_all=[1000 * t for t in times],
            tokens_per_s=world * mbs * seq / step_s,
            losses=losses,
            gather_backend=runtime.gather_backend.value if runtime is not None else None,
            state_gib=state_gib(bench_gpt, model, optimizer),
        )
        result.update(memory_stats(device, args, saved, result["state_gib"]))
        finish(OK)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the driver as a file
        text = f"{type(err).__name__}: {err}"
        outcome = OOM if any(m in text for m in OOM_MARKERS) else ERROR
        extra: dict = dict(error=text[:2000], traceback=traceback.format_exc()[-4000:])
        try:
            import torch

            if args.device == "cuda":
                extra["allocated_at_failure_gib"] = torch.cuda.memory_allocated() / GIB
                extra["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        except Exception:  # noqa: BLE001
            pass
        finish(outcome, **extra)


def state_gib(bench_gpt, model, optimizer) -> float | None:  # noqa: ANN001
    """Weight + grad + optimizer GiB held by this rank (None where the count fails: a report
    detail must not turn a probe that trained into an error)."""
    try:
        return bench_gpt.state_bytes(model, optimizer) / GIB
    except Exception:  # noqa: BLE001
        return None


def model_shape(args: argparse.Namespace) -> tuple[int, int, int, int, int, int]:
    """(hidden, ffn, heads, vocab, seq, micro-batch): the device default unless overridden."""
    defaults = SHAPES[args.device]
    names = ("hidden", "ffn", "heads", "vocab", "seq", "mbs")
    return tuple(
        getattr(args, n) if getattr(args, n) is not None else d for n, d in zip(names, defaults)
    )


def sync(device: str) -> None:
    """Wait for the device (step timing)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def wait_for_free_device(timeout_s: float = 30.0, slack_gib: float = 2.0) -> float:
    """Wait until the previous probe's processes have released this GPU; seconds waited.

    A killed probe's memory is freed when its processes are reaped, which can lag the kill: a
    probe starting on a GPU still half full would report a false OOM.
    """
    import torch

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        free, total = torch.cuda.mem_get_info()
        if total - free < slack_gib * GIB:
            break
        time.sleep(0.5)
    return time.monotonic() - start


def inject_fault(fault: str, rank: int, finish) -> None:  # noqa: ANN001
    """Driver self-test: rank 1 reports an OOM and dies (``oom``) or stalls (``hang``) while
    rank 0 waits in a collective, as a real one-rank OOM leaves its peer."""
    import torch.distributed as dist

    if rank == 1:
        if fault == "oom":
            finish(OOM, error="FakeOutOfMemory: injected by --fault oom")
        time.sleep(3600)
    dist.barrier()
    raise RuntimeError(f"--fault {fault}: rank 0 left the barrier (the peer never joined)")


def logical_params(model) -> int:  # noqa: ANN001
    """Parameters of the logical model: GTP shards count their logical shape, DTensors (FSDP2)
    their global size."""
    import math

    total = 0
    for p in model.parameters():
        spec = getattr(p, "gtp_spec", None)
        total += math.prod(spec.logical_shape) if spec is not None else p.numel()
    return total


class SavedTensorBytes:
    """CPU smoke: bytes of the distinct storages autograd saves for the backward (the
    activations), excluding parameters; ``peak`` is the step's total."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.params = {
            getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()
        }
        self.seen: set[int] = set()
        self.peak = 0

    def pack(self, t):  # noqa: ANN001, ANN201
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # FSDP2's unsharded params: storage resized away after use
            return t
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.peak += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def check_fake_limit(args: argparse.Namespace, measured: int) -> None:
    """CPU smoke: weights + grads + optimizer state + saved activations against the limit."""
    limit = args.memory_limit_gib or CPU_MEMORY_LIMIT_GIB
    if measured > limit * GIB:
        raise FakeOutOfMemory(
            f"{measured / GIB:.5f} GiB (state + saved activations) > --memory-limit-gib {limit}"
        )


def memory_stats(device: str, args: argparse.Namespace, saved: int, state: float | None) -> dict:
    """This rank's peaks. ``peak_effective_gib`` is what must fit on the device: the allocator's
    reserved peak plus the memory outside it (CUDA context, NCCL, symmetric memory), measured
    at the end; on CPU, state + saved activations (the smoke's stand-in)."""
    if device != "cuda":
        peak = (state or 0.0) + saved / GIB
        limit = args.memory_limit_gib or CPU_MEMORY_LIMIT_GIB
        return dict(
            peak_allocated_gib=peak,
            peak_reserved_gib=peak,
            peak_effective_gib=peak,
            saved_activations_gib=saved / GIB,
            device_total_gib=limit,
        )
    import torch

    free, total = torch.cuda.mem_get_info()
    outside = (total - free) - torch.cuda.memory_reserved()
    reserved = torch.cuda.max_memory_reserved()
    return dict(
        peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
        peak_reserved_gib=reserved / GIB,
        outside_allocator_gib=outside / GIB,
        peak_effective_gib=(reserved + outside) / GIB,
        device_total_gib=total / GIB,
    )


def build_megatron_fsdp(args: argparse.Namespace, world: int, device: str):
    """Megatron-FSDP (megatron-core 0.15's ``FullyShardedDataParallel``, ZeRO-3
    ``optim_grads_params``, one FSDP unit per transformer layer) on bench_gpt's model, with
    megatron's distributed optimizer as Megatron-LM sets it up. Returns bench_gpt.build's
    tuple plus the parameter count (counted before sharding)."""
    if device != "cuda":
        raise RuntimeError("Megatron-FSDP needs CUDA (its device mesh and streams)")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from bench import bench_gpt
    from nemo_gtp.engine import GTPParallelDims
    from nemo_gtp.integrations.megatron import initialize_gtp_parallel

    initialize_gtp_parallel(GTPParallelDims(world_size=world, num_weight_shards=1))
    bench_gpt.seed_model_parallel(device)
    torch.manual_seed(1234)
    config = bench_gpt.model_config(args, device)
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, args.max_seq).cuda()
    params = sum(p.numel() for p in model.parameters())
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,
        bucket_size=max(40_000_000, 1_000_000 * world),  # Megatron-LM's default
    )
    ddp = FullyShardedDataParallel(config, ddp_config, model)
    optimizer = bench_gpt.make_optimizer(ddp, fused=args.optimizer_kernels == "torch_fused")

    def step(batch: dict, marks: list | None = None) -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = bench_gpt.forward_loss(ddp, batch)
        loss.backward()
        ddp.finish_grad_sync()  # what megatron's finalize_model_grads does at DP only
        optimizer.step()
        return float(loss.detach())

    return ddp, optimizer, step, None, params


# ---------------------------------------------------------------------------------------------
# Driver: launch probes, search, report
# ---------------------------------------------------------------------------------------------


def scratch_dir(args: argparse.Namespace) -> str:
    """Where the probes write their per-rank results and logs (created)."""
    path = args.scratch or os.path.join(args.out, "probes")
    os.makedirs(path, exist_ok=True)
    return path


def probe_argv(args: argparse.Namespace, mode: str, layers: int) -> list[str]:
    """This script's command line for one probe rank."""
    argv = module_argv("bench.bench_max_model", "--probe", f"{mode},{layers}")
    argv += ["--scratch", scratch_dir(args)]
    for name in ("out", "device", "steps", "timed_steps", "optimizer_kernels", "fault"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("hidden", "ffn", "heads", "vocab", "seq", "mbs", "memory_limit_gib"):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def kill_group(pgid: int, procs: list[subprocess.Popen]) -> None:
    """SIGKILL the probe's process group (its ranks only) and reap every rank."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        p.wait()


def run_probe(args: argparse.Namespace, mode: str, layers: int, timeout_s: float) -> dict:
    """Run one probe on ``args.world`` ranks; its merged result (see :func:`merge_ranks`)."""
    probes = scratch_dir(args)
    tag = f"{mode}_L{layers}"
    paths = [os.path.join(probes, f"{tag}.rank{r}.json") for r in range(args.world)]
    for p in paths:
        if os.path.exists(p):
            os.remove(p)
    port = free_port()
    argv = probe_argv(args, mode, layers)
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    for rank in range(args.world):
        env = with_root(rank_env(rank, args.world, nccl=True, master_port=port))
        env["LOCAL_WORLD_SIZE"] = str(args.world)  # as torchrun sets it (one node)
        # one new process group (pgid = rank 0's pid) for the probe's ranks: killpg reaches all
        group = procs[0].pid if procs else 0
        with open(os.path.join(probes, f"{tag}.rank{rank}.log"), "w") as log:
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=group
                )
            )
    pgid, failed_at, timed_out = procs[0].pid, None, False
    while True:
        done = [p.poll() is not None for p in procs]
        if all(done):
            break
        now = time.monotonic()
        failed = any(d and p.returncode != 0 for d, p in zip(done, procs))
        if failed_at is None and (failed or any(_failed_file(p) for p in paths)):
            failed_at = now
        if failed_at is not None and now - failed_at > FAIL_GRACE_S:
            break
        if now - start > timeout_s:
            timed_out = True
            break
        time.sleep(0.25)
    kill_group(pgid, procs)
    results = [_read(p) for p in paths]
    merged = merge_ranks(mode, layers, results, timed_out)
    merged["wall_s"] = time.monotonic() - start
    merged["returncodes"] = [p.returncode for p in procs]
    if merged["outcome"] != OK:  # the JSON is all that comes back from the GPU machine
        tails = [_log_tail(os.path.join(probes, f"{tag}.rank{r}.log")) for r in range(args.world)]
        merged["log_tails"] = tails
        merged.setdefault("error", tails[0])  # a rank died without writing its file
        # A rank killed by an OOM outside Python (NCCL, the watchdog) leaves it in its log only,
        # while its peer reports the broken collective as an error.
        if merged["outcome"] == ERROR and any(m in t for t in tails for m in OOM_MARKERS):
            merged["outcome"] = OOM
    return merged


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _failed_file(path: str) -> bool:
    result = _read(path)
    return result is not None and result.get("outcome") != OK


def _log_tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def merge_ranks(mode: str, layers: int, results: list[dict | None], timed_out: bool) -> dict:
    """One probe's outcome from its ranks' files: ok only if every rank trained; else the first
    OOM, else the first error; a timeout or a rank that died without a file otherwise. Memory
    figures are the maximum over the ranks, times rank 0's."""
    merged: dict = dict(mode=mode, layers=layers, ranks=results)
    present = [r for r in results if r is not None]
    bad = [r for r in present if r.get("outcome") != OK]
    if present and len(present) == len(results) and not bad:
        merged["outcome"] = OK
        first = present[0]
        for key in ("params", "step_ms", "step_ms_all", "tokens_per_s", "gather_backend"):
            merged[key] = first.get(key)
        merged["losses"] = first.get("losses")
        for key in (
            "peak_allocated_gib",
            "peak_reserved_gib",
            "peak_effective_gib",
            "outside_allocator_gib",
            "build_peak_allocated_gib",
            "build_peak_reserved_gib",
            "device_total_gib",
            "state_gib",
        ):
            values = [r[key] for r in present if r.get(key) is not None]
            merged[key] = max(values) if values else None
        return merged
    oom = [r for r in bad if r.get("outcome") == OOM]
    err = [r for r in bad if r.get("outcome") == ERROR]
    if oom:
        merged.update(outcome=OOM, error=oom[0].get("error"), phase=oom[0].get("phase"))
    elif err:
        merged.update(outcome=ERROR, error=err[0].get("error"), phase=err[0].get("phase"))
    elif timed_out:
        merged["outcome"] = TIMEOUT
    else:
        merged["outcome"] = ERROR  # a rank died without writing (the driver adds its log)
    return merged


def device_memory_gib(args: argparse.Namespace) -> float:
    """The per-GPU budget: ``--memory-limit-gib``, else nvidia-smi's smallest total (the first
    probe's CUDA figure replaces it), else 139."""
    if args.memory_limit_gib:
        return args.memory_limit_gib
    if args.device == "cpu":
        return CPU_MEMORY_LIMIT_GIB
    if args.gpu_memory_gib:
        return args.gpu_memory_gib
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            totals = [float(v) / 1024 for v in out.split()][: args.world]
            if totals:
                return min(totals)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return 139.0


class Sweep:
    """The whole search: every mode's probes, the calibration shared between modes, reports."""

    def __init__(self, args: argparse.Namespace, runner: Callable | None = None) -> None:
        self.args = args
        self.runner = runner or run_probe  # (args, mode, layers, timeout_s) -> merged result
        hidden, ffn, heads, vocab, seq, mbs = model_shape(args)
        self.shape = ModelShape(  # bench_gpt's models keep megatron's fp32 softmax
            layers=1, hidden=hidden, ffn=ffn, heads=heads, vocab=vocab, seq=seq, softmax_fp32=True
        )
        self.tokens = mbs * seq
        self.overhead_gib = 3.0 if args.device == "cuda" else 0.0
        self.budget_gib = device_memory_gib(args)
        self.start = time.monotonic()
        self.probes: list[dict] = []
        self.modes: dict[str, dict] = {}
        # recompute? -> (intercept, slope) bytes the planner missed, measured on an earlier mode
        self.correction: dict[bool, tuple[float, float]] = {}
        self.longest_ok_s = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def gib(self, value: float) -> str:
        """GiB as text: 0.1 GiB resolution on GPUs, finer for the CPU smoke's MiB budget."""
        return f"{value:.1f}" if self.args.device == "cuda" else f"{value:.5f}"

    def prior(self, name: str) -> tuple[Line, Line, bool]:
        """(planner line, prior for the search, whether the prior is calibrated)."""
        mode = MODES[name]
        line = planner_line(
            mode,
            self.shape,
            world=self.args.world,
            tokens_per_gpu=self.tokens,
            overhead_gib=self.overhead_gib,
        )
        if mode.recompute in self.correction:
            da, db = self.correction[mode.recompute]
            return line, Line(line.a + da, line.b + db), True
        return line, line, False

    def probe_timeout(self) -> tuple[float, bool]:
        """The per-probe limit and whether the sweep's budget set it: ``--probe-timeout-s``,
        tightened once probes have finished (4x the longest successful one, at least 90 s),
        never past the sweep's budget."""
        limit = self.args.probe_timeout_s
        if self.longest_ok_s:
            limit = min(limit, max(90.0, 4 * self.longest_ok_s))
        left = self.args.budget_s - self.elapsed()
        return min(limit, left), left < limit

    def probe(self, name: str, layers: int, purpose: str) -> dict | None:
        """One probe, unless the sweep's time budget cannot fit it (then None)."""
        expected = max(30.0, self.longest_ok_s) if self.args.device == "cuda" else 5.0
        if self.elapsed() + expected > self.args.budget_s:
            return None
        timeout, capped = self.probe_timeout()
        result = self.runner(self.args, name, layers, timeout)
        if result["outcome"] == TIMEOUT and capped:
            result["outcome"] = CUT  # the sweep's end, not the probe, stopped it
        result["purpose"] = purpose
        self.probes.append(result)
        if result["outcome"] == OK:
            self.longest_ok_s = max(self.longest_ok_s, result["wall_s"])
            if (
                self.args.device == "cuda"
                and result.get("device_total_gib")
                and not (self.args.memory_limit_gib or self.args.gpu_memory_gib)
            ):
                self.budget_gib = result["device_total_gib"]  # CUDA's figure over nvidia-smi's
        peak = result.get("peak_effective_gib")
        print(
            f"[max_model] {self.elapsed():6.0f}s {name} L={layers} ({purpose}): "
            f"{result['outcome']} in {result['wall_s']:.0f}s"
            + (f", peak {self.gib(peak)} of {self.gib(self.budget_gib)} GiB" if peak else "")
            + (f" [{str(result.get('error', ''))[:160]}]" if result["outcome"] != OK else ""),
            flush=True,
        )
        self.write_reports()
        return result

    def search(self, name: str, compare_layers: int | None = None) -> None:
        """Find ``name``'s largest layer count (``compare_layers``: probe that size first)."""
        args = self.args
        planner, prior, calibrated = self.prior(name)
        entry = dict(
            mode=name,
            doc=MODES[name].doc,
            planner_max_layers=planner.max_layers(self.budget_gib * GIB),
            status="running",
        )
        self.modes[name] = entry
        points: list[Point] = []
        queue = [(compare_layers, "gtp2 comparison")] if compare_layers else []
        while len(points) < args.max_probes:
            if queue:
                layers, purpose = queue.pop()
            else:
                layers = next_layers(
                    points,
                    prior,
                    self.budget_gib * GIB,
                    first_fraction=None if calibrated else args.first_fraction,
                    margin=args.margin_gib * GIB,
                    max_layers=args.max_layers,
                )
                purpose = "search"
            if layers is None:
                break
            result = self.probe(name, layers, purpose)
            if result is None or result["outcome"] == CUT:
                entry["status"] = "stopped: the sweep's time budget is spent"
                break
            peak = result.get("peak_effective_gib")
            points.append(Point(layers, result["outcome"], peak * GIB if peak else None))
            if result["outcome"] == ERROR:
                error = str(result.get("error", "")).strip()[:400]
                if any(p.outcome == OK for p in points):
                    entry["status"] = f"lower bound: error at {layers} layers: {error}"
                else:
                    entry["status"] = f"cannot run: {error}"
                break
        lo, hi = bracket(points)
        if entry["status"] == "running":
            if hi is not None and hi == lo + 1:
                entry["status"] = "largest found" if lo else "not even 1 layer fits"
            elif lo >= args.max_layers:
                entry["status"] = f"reached --max-layers {args.max_layers}"
            else:
                entry["status"] = "lower bound: --max-probes reached before the boundary"
        entry["largest_layers"] = lo or None
        entry["smallest_failed_layers"] = hi
        if any(p.outcome == OK for p in points):
            fitted = fit_line(points, planner)
            self.correction[MODES[name].recompute] = (fitted.a - planner.a, fitted.b - planner.b)
        self.write_reports()

    def run(self) -> None:
        """Every requested mode; gtp2_recompute starts at gtp2's largest size (the comparison)."""
        for name in self.args.modes.split(","):
            compare = None
            if name == "gtp2_recompute" and self.modes.get("gtp2", {}).get("largest_layers"):
                compare = self.modes["gtp2"]["largest_layers"]
            self.search(name, compare)
        self.write_reports(final=True)

    # --- reports ---------------------------------------------------------------------------

    def best(self, name: str) -> dict | None:
        """The successful probe at ``name``'s largest layer count."""
        largest = self.modes.get(name, {}).get("largest_layers")
        return next(
            (
                p
                for p in reversed(self.probes)
                if p["mode"] == name and p["layers"] == largest and p["outcome"] == OK
            ),
            None,
        )

    def planner_gib(self, name: str, layers: int) -> dict[str, float]:
        shape = ModelShape(**{**self.shape.__dict__, "layers": layers})
        parts = predicted_bytes(
            MODES[name],
            shape,
            world=self.args.world,
            tokens_per_gpu=self.tokens,
            overhead_gib=self.overhead_gib,
        )
        return {k: v / GIB for k, v in parts.items()}

    def recompute_comparison(self) -> dict | None:
        """gtp2_recompute's step time at gtp2's largest size against gtp2's."""
        base = self.best("gtp2")
        if base is None:
            return None
        other = next(
            (
                p
                for p in self.probes
                if p["mode"] == "gtp2_recompute"
                and p["layers"] == base["layers"]
                and p["outcome"] == OK
            ),
            None,
        )
        if other is None:
            return None
        return dict(
            layers=base["layers"],
            gtp2_step_ms=base["step_ms"],
            gtp2_recompute_step_ms=other["step_ms"],
            ratio=other["step_ms"] / base["step_ms"],
        )

    def write_reports(self, final: bool = False) -> None:
        args = self.args
        hidden, ffn, heads, vocab, seq, mbs = model_shape(args)
        for name, entry in self.modes.items():
            best = self.best(name)
            if best is not None:
                parts = self.planner_gib(name, best["layers"])
                entry.update(
                    params=best["params"],
                    step_ms=best["step_ms"],
                    tokens_per_s=best["tokens_per_s"],
                    peak_allocated_gib=best["peak_allocated_gib"],
                    peak_reserved_gib=best["peak_reserved_gib"],
                    peak_effective_gib=best["peak_effective_gib"],
                    gather_backend=best.get("gather_backend"),
                    planner_peak_gib=sum(parts.values()),
                    planner_parts_gib=parts,
                )
        report = dict(
            question="largest GPT that trains (5 steps) per mode at fixed width",
            complete=final,
            command=" ".join([os.path.basename(sys.executable), *sys.argv]),
            env={k: os.environ.get(k) for k in (*NCCL_ENV, "PYTORCH_CUDA_ALLOC_CONF")},
            model=dict(hidden=hidden, ffn=ffn, heads=heads, vocab=vocab, seq=seq, mbs=mbs),
            world=args.world,
            device=args.device,
            budget_gib=self.budget_gib,
            elapsed_s=self.elapsed(),
            args=vars(args),
            modes=self.modes,
            recompute_vs_gtp2=self.recompute_comparison(),
            probes=self.probes,
        )
        with open(os.path.join(args.out, "max_model.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out, "max_model.md"), "w") as f:
            f.write(self.markdown(report))

    def markdown(self, report: dict) -> str:
        m = report["model"]
        lines = [
            f"# Largest GPT per mode ({report['world']} ranks, {report['device']}"
            + ("" if report["complete"] else ", INCOMPLETE: sweep still running or cut")
            + ")",
            "",
            f"GPT hidden {m['hidden']}, ffn {m['ffn']}, {m['heads']} heads, vocab {m['vocab']}, "
            f"seq {m['seq']}, micro-batch {m['mbs']} ({m['mbs'] * m['seq']} tokens per GPU), bf16, "
            f"local spec; {self.args.steps} steps, step time = median of the last "
            f"{self.args.timed_steps}. Budget {self.gib(report['budget_gib'])} GiB per GPU. Sweep "
            f"{report['elapsed_s']:.0f} s, {len(self.probes)} probes.",
            "",
            f"    {report['command']}",
            "",
            "peak alloc / reserved: torch's max_memory_allocated / max_memory_reserved over the "
            "training steps (max over ranks); device: reserved peak + memory outside the "
            "allocator (CUDA context, NCCL, symmetric memory). planner: `nemo_gtp.plan.estimate` "
            "at the same size (its 3 GiB overhead included; the fully sharded modes: the bench's "
            "ZeRO-3 estimate with the planner's activations).",
            "",
            "| mode | largest layers | params | tokens/s | step ms | peak alloc GiB | "
            "peak reserved GiB | device GiB | planner GiB | planner max layers | probes | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, e in self.modes.items():
            n = sum(1 for p in self.probes if p["mode"] == name)
            if e.get("step_ms") is not None:
                lines.append(
                    f"| {name} | {e['largest_layers']} | {count(e['params'])} | "
                    f"{e['tokens_per_s']:.0f} | {e['step_ms']:.1f} | "
                    f"{self.gib(e['peak_allocated_gib'])} | {self.gib(e['peak_reserved_gib'])} | "
                    f"{self.gib(e['peak_effective_gib'])} | {self.gib(e['planner_peak_gib'])} | "
                    f"{e['planner_max_layers']} | {n} | {e['status']} |"
                )
            else:
                lines.append(
                    f"| {name} | — | — | — | — | — | — | — | — | {e['planner_max_layers']} | "
                    f"{n} | {e['status']} |"
                )
        cmp = report["recompute_vs_gtp2"]
        if cmp:
            lines += [
                "",
                f"gtp2_recompute at gtp2's largest size ({cmp['layers']} layers): "
                f"{cmp['gtp2_recompute_step_ms']:.1f} ms vs gtp2 {cmp['gtp2_step_ms']:.1f} ms "
                f"per step = {cmp['ratio']:.3f}x.",
            ]
        if "mfsdp" in self.modes and self.modes["mfsdp"].get("largest_layers") is None:
            lines += ["", f"Megatron-FSDP: {self.modes['mfsdp']['status']}"]
        lines += [
            "",
            "## Probes",
            "",
            "| mode | layers | purpose | outcome | wall s | device GiB | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in self.probes:
            peak = p.get("peak_effective_gib")
            note = "" if p["outcome"] == OK else str(p.get("error") or "")[:120]
            note = note.replace("|", "/").replace("\n", " ")
            lines.append(
                f"| {p['mode']} | {p['layers']} | {p.get('purpose', '')} | {p['outcome']} | "
                f"{p['wall_s']:.0f} | {'' if peak is None else self.gib(peak)} | {note} |"
            )
        return "\n".join(lines) + "\n"


def count(params: int) -> str:
    """A parameter count as text: ``6.72 B`` or ``0.189 M``."""
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.3f} M"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out/max_model")
    parser.add_argument(
        "--scratch", help="probe results and logs (default: a new temporary folder)"
    )
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"subset of {sorted(MODES)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--dry-run", action="store_true", help="same as --device cpu (the CPU smoke)"
    )
    parser.add_argument("--world", type=int, default=2, help="ranks per probe (GPUs)")
    for name in ("hidden", "ffn", "heads", "vocab", "seq", "mbs"):
        parser.add_argument(f"--{name}", type=int, help="model size (default: per --device)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        help="per-rank cap: on CUDA torch's per-process memory fraction, on CPU the fake limit "
        f"(default {CPU_MEMORY_LIMIT_GIB})",
    )
    parser.add_argument("--gpu-memory-gib", type=float, help="budget if not detected")
    parser.add_argument("--max-probes", type=int, default=5, help="per mode")
    parser.add_argument("--max-layers", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=540.0, help="whole sweep, seconds")
    parser.add_argument("--probe-timeout-s", type=float, default=180.0)
    parser.add_argument(
        "--first-fraction",
        type=float,
        default=0.5,
        help="first probe of an uncalibrated mode at this fraction of the planner's prediction",
    )
    parser.add_argument("--margin-gib", type=float, default=1.0, help="kept free by guesses")
    parser.add_argument(
        "--optimizer-kernels", choices=("torch_fused", "megatron"), default="torch_fused"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # MODE,LAYERS: run one probe rank
    parser.add_argument(
        "--fault", default="", choices=("", "oom", "hang"), help=argparse.SUPPRESS
    )  # driver self-test
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    if not 1 <= args.timed_steps <= args.steps:
        parser.error("--timed-steps must be between 1 and --steps")
    if args.device == "cpu" and args.margin_gib == 1.0:
        args.margin_gib = 0.0  # the smoke's budget is a few MiB
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        probe_main(args)
    os.makedirs(args.out, exist_ok=True)
    if args.scratch is None:  # probe files and logs stay out of --out (two files come back)
        args.scratch = tempfile.mkdtemp(prefix="bench_max_model_")
    sweep = Sweep(args)
    print(
        f"[max_model] budget {sweep.budget_gib:.2f} GiB per rank, modes {args.modes}, "
        f"planner max layers: "
        + ", ".join(
            f"{n} {sweep.prior(n)[0].max_layers(sweep.budget_gib * GIB)}"
            for n in args.modes.split(",")
        ),
        flush=True,
    )
    sweep.run()
    print(open(os.path.join(args.out, "max_model.md")).read(), flush=True)


if __name__ == "__main__":
    main()

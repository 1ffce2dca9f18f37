"""The path users run: NeMo's trainer + ``GTPMegatronStrategy`` on a recipe, GTP vs baselines.

Question: What do GTP2 and its baselines cost on the path users run (NeMo trainer + strategy):
step time, memory, host time, and do their losses agree?

Ranks: NCCL, one rank per GPU; ``--shared-device``: the ranks on one GPU through the staged gloo
backend (numerics only, step times meaningless); ``*_cpu`` modes on CPU.

One launch of ``trainer.devices`` processes runs every (mode, tokens per GPU) fit in turn
(torn down in between, as ``python -m nemo_gtp.run --compare-baseline`` does), and rank 0
writes one record per fit: median step time after warmup, tokens/s per GPU, peak memory, loss
curve, exposed GTP communication (measured in separate steps, so its CUDA events never time the
median), and, where asked, a profile of a few more steps: a ``torch.profiler`` summary (GPU
busy vs idle per step) and a cProfile of the host (time in GTP code per call).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    python -m bench.bench_nemo --modes dp2_local,gtp2_local,dp2_te,gtp2_te \\
        --tokens 1024,2048,4096,8192 --out results_dir [--profile-tokens 2048,4096 [--chrome-trace]]

Modes (1B recipe, 24 layers, hidden 2048): ``dp2_local`` / ``gtp2_local``
(``configs/gpt_1b.yaml``, megatron-local linears), ``dp2_te`` / ``gtp2_te``
(``configs/gpt_1b_te.yaml``, NeMo's default TransformerEngine spec), ``dp2_fp8`` /
``gtp2_fp8`` (``configs/gpt_1b_fp8.yaml``, TE's FP8 GEMMs, per-tensor current scaling),
``dp2_fp8param`` / ``gtp2_fp8param`` (the same with ``fp8.param_gather=true``: FP8 primary
weights, GTP's own FP8 shards vs TE's FP8 params), ``dp2_fp8block`` / ``gtp2_fp8block``
(``fp8.recipe=blockwise``: GTP gathers FP8 rows and 128x128 tile scales),
``dp2_fp8blockparam`` / ``gtp2_fp8blockparam`` (blockwise with ``fp8.param_gather=true``: GTP's
FP8 primary shards own their tiles), ``mfsdp_te`` (plain
``MegatronStrategy`` with Megatron-FSDP, when this stack runs it: its error is recorded
otherwise). Tokens per GPU T: sequence 2048 (1024 for T=1024), micro-batch T / sequence,
global batch = micro-batch x 2. A mode takes modifiers: ``gtp2_local@coalesce_mb=96`` (a
``GTPConfig`` field), ``@model.key=value`` (any recipe key), ``@graph`` (megatron's
full-iteration CUDA graph, TE's RNG tracker: needs TE), ``@layergraph`` /
``@layergraph_attn`` (megatron's per-layer graphs, scope ``full`` / ``attn``, TE's RNG tracker),
``@eager`` (no graphs: the TE and FP8 recipes are graphed per layer by default); its baseline is
its base mode's, with the same graphs. Each fit's record and row has its MFU: model FLOPs per
step per GPU (``bench.common.gpt_flops``) over the step time against the device's dense peak.
Per fit the table also splits three steps into the host's time to issue forward + backward
from an idle GPU and what the GPU still had to do after it (a GPU tail near 0: host-bound).

Two ranks on one GPU (numerics only): ``--shared-device`` runs the ``--devices`` ranks all on
``cuda:0`` (each the local rank 0 of its own Lightning "node": ``trainer.devices=1``,
``trainer.num_nodes=<ranks>``), their CUDA collectives staged through host memory over gloo
(``nemo_gtp.cpu.staged_gloo``, backend ``cpu:gloo,cuda:staged_gloo``), on a 4-layer,
hidden-1024 cut of the recipe (``--full-size`` keeps the recipe's shape). Step times, tokens/s,
exposed communication and memory of such a run mean nothing; its losses and grad norms do:
the report adds each mode's parity against its baseline (max |loss diff|, relative loss and
grad-norm differences, verdict at ``nemo_gtp.run``'s tolerance). CUDA graphs and Megatron-FSDP
are refused there. ``dp2_cpu`` / ``gtp2_cpu`` (``configs/tiny_cpu.yaml``, fp32) run the same
launch on CPU, ``--dry-run`` prints the launch plan after checking every recipe:

    python -m bench.bench_nemo --shared-device --modes dp2_te,gtp2_te --tokens 2048 \
        --warmup 2 --timed 18 --fit-timeout 150 --out results_dir
    python -m bench.bench_nemo --shared-device --modes dp2_cpu,gtp2_cpu --out /tmp/sd  # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import faulthandler
import gzip
import io
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import ROOT, free_port, mfu_text, module_argv, with_root

MODES = {
    "dp2_local": ("configs/gpt_1b.yaml", ["strategy.num_weight_shards=1"]),
    "gtp2_local": ("configs/gpt_1b.yaml", []),
    "dp2_te": ("configs/gpt_1b_te.yaml", ["strategy.num_weight_shards=1"]),
    "gtp2_te": ("configs/gpt_1b_te.yaml", []),
    "gtp2_te_sr": ("configs/gpt_1b_te.yaml", ["+gtp.shard_replicated_params_over_gtp=true"]),
    "gtp2_local_rs2": ("configs/gpt_1b.yaml", ["+gtp.separate_reduce_scatter_group=true"]),
    "gtp2_local_d2": ("configs/gpt_1b.yaml", ["+gtp.prefetch_depth=2"]),
    "gtp2_local_d2_rs2": (
        "configs/gpt_1b.yaml",
        ["+gtp.prefetch_depth=2", "+gtp.separate_reduce_scatter_group=true"],
    ),
    "gtp2_local_ce": ("configs/gpt_1b.yaml", ["+gtp.copy_engine_min_tokens=0"]),
    "gtp2_local_ce_rs2": (
        "configs/gpt_1b.yaml",
        ["+gtp.copy_engine_min_tokens=0", "+gtp.separate_reduce_scatter_group=true"],
    ),
    # tiny fp32 GPT on CPU (gloo; staged_gloo under --shared-device): the launch, dry-run
    "dp2_cpu": ("configs/tiny_cpu.yaml", ["strategy.num_weight_shards=1"]),
    "gtp2_cpu": ("configs/tiny_cpu.yaml", []),
    # TE's FP8 GEMMs, per-tensor current scaling (design §1.3): FP8 gathers of bf16 shards;
    # "fp8param": fp8.param_gather=true, FP8 primary weights (GTP: its own FP8 shards; DP: TE's)
    "dp2_fp8": ("configs/gpt_1b_fp8.yaml", ["strategy.num_weight_shards=1"]),
    "gtp2_fp8": ("configs/gpt_1b_fp8.yaml", []),
    "dp2_fp8param": (
        "configs/gpt_1b_fp8.yaml",
        ["strategy.num_weight_shards=1", "fp8.param_gather=true"],
    ),
    "gtp2_fp8param": ("configs/gpt_1b_fp8.yaml", ["fp8.param_gather=true"]),
    # blockwise FP8 (TE's Float8BlockScaling, 128x128 weight tiles): GTP gathers FP8 rows and
    # tile scales; DP2 quantizes its own weights
    "dp2_fp8block": (
        "configs/gpt_1b_fp8.yaml",
        ["strategy.num_weight_shards=1", "fp8.recipe=blockwise"],
    ),
    "gtp2_fp8block": ("configs/gpt_1b_fp8.yaml", ["fp8.recipe=blockwise"]),
    # blockwise FP8 primary weights (fp8.param_gather=true): GTP's shards are FP8 with their own
    # tile scales; DP2 keeps TE's Float8BlockwiseQTensor params
    "dp2_fp8blockparam": (
        "configs/gpt_1b_fp8.yaml",
        ["strategy.num_weight_shards=1", "fp8.recipe=blockwise", "fp8.param_gather=true"],
    ),
    "gtp2_fp8blockparam": (
        "configs/gpt_1b_fp8.yaml",
        ["fp8.recipe=blockwise", "fp8.param_gather=true"],
    ),
    "mfsdp_te": (
        "configs/gpt_1b_te.yaml",
        [
            "strategy.num_weight_shards=1",
            "+strategy.fsdp=megatron",
            "ddp.use_distributed_optimizer=true",
            # NeMo's strategy asserts megatron's DDP config asks for FSDP too (2xH200 run of
            # 2026-12-01: "MCore FSDP is not enabled in ddp_config" without it)
            "+ddp.use_megatron_fsdp=true",
            "+ddp.data_parallel_sharding_strategy=optim_grads_params",
        ],
    ),
}
BASELINE = {
    "gtp2_local": "dp2_local",
    "gtp2_te": "dp2_te",
    "gtp2_te_sr": "dp2_te",
    "gtp2_local_rs2": "dp2_local",
    "gtp2_local_ce": "dp2_local",
    "gtp2_local_d2": "dp2_local",
    "gtp2_local_d2_rs2": "dp2_local",
    "gtp2_local_ce_rs2": "dp2_local",
    "dp2_local": "dp2_te",
    "mfsdp_te": "dp2_te",
    "gtp2_cpu": "dp2_cpu",
    "gtp2_fp8": "dp2_fp8",
    "gtp2_fp8param": "dp2_fp8param",
    "gtp2_fp8block": "dp2_fp8block",
    "gtp2_fp8blockparam": "dp2_fp8blockparam",
}
CPU_CONFIGS = {"configs/tiny_cpu.yaml"}  # their own data shape: --tokens only labels the fit
SHARED_DEVICE_SHAPE = (  # --shared-device: numerics need no 1B model, the staged copies are slow
    "model.num_layers=4",
    "model.hidden_size=1024",
    "model.ffn_hidden_size=4096",
    "model.num_attention_heads=8",
)


TOP_LEVEL_KEYS = ("resume", "restore")  # recipe keys a mode modifier may set without a dot
# Modifiers a mode's baseline shares: the layout beside GTP, and the optimizer (a Muon GTP2 run
# is compared with a Muon DP2 run, design §1.6); ``muon.*`` and ``peft.*`` keys too (a LoRA
# GTP2 run is compared with a LoRA DP2 run, design §1.1 "Frozen weights"), and ``restore`` (both
# fine-tune the same pretrained checkpoint).
LAYOUT_KEYS = (
    "strategy.context_parallel_size",
    "strategy.pipeline_model_parallel_size",
    "strategy.virtual_pipeline_model_parallel_size",
    "model.share_embeddings_and_output_weights",  # PP on CPU: an untied output layer
    "model.num_layers",
    "data.global_batch_size",  # PP: microbatches per step
    "optim.optimizer",
    "optim.use_distributed_optimizer",
    "ddp.use_distributed_optimizer",
)


def layout_modifiers(knobs: list[str]) -> str:
    """The ``@key=value`` modifiers among ``knobs`` that a mode's baselines share
    (:data:`LAYOUT_KEYS`), joined in their order: ``"@strategy.context_parallel_size=2"``."""
    shared = [
        k
        for k in knobs
        if k.split("=", 1)[0] in LAYOUT_KEYS or k.startswith(("muon.", "peft.", "restore="))
    ]
    return "".join(f"@{k}" for k in shared)


def resolve_mode(mode: str) -> tuple[str, list[str], str | None]:
    """``base[@key=value...]`` → (config, overrides, baseline mode); each ``@key=value`` is a
    ``GTPConfig`` field (``gtp2_local@coalesce_mb=64@prefetch_depth=2``), or, with a dot, any
    recipe key (``@model.cuda_graph_scope=full_iteration``, ``@resume=<dir>/step=N``). A
    modified mode's baseline is its base mode's baseline, or ``base@graph`` when the modifiers
    include ``@graph`` (below).
    ``mode#k`` is repeat k of ``mode`` (``--repeat``); its baseline is the baseline's repeat k.
    A layout modifier (:data:`LAYOUT_KEYS`, e.g. ``@strategy.context_parallel_size=2``) goes to
    the baseline too: GTP2·CP2 is compared with CP2·DP2."""
    base, *knobs = mode.split("#")[0].split("@")
    config, overrides = MODES[base]
    extra = []
    for knob in knobs:
        if knob in GRAPH_KINDS:  # megatron's CUDA graphs (local implementation, TE's RNG)
            extra += [f"+{k}" for k in GRAPH_KINDS[knob]]
        else:  # a recipe key (dotted, or a top-level one: resume=<dir>/step=N), else GTPConfig's
            top = knob.split("=", 1)[0] in TOP_LEVEL_KEYS
            extra.append(f"+{knob}" if "." in knob or top else f"+gtp.{knob}")
    baseline = BASELINE.get(base)
    for kind in GRAPH_KINDS:
        if baseline and kind in knobs:
            baseline += f"@{kind}"
    if baseline:
        baseline += layout_modifiers(knobs)
    if baseline and "#" in mode:
        baseline += "#" + mode.split("#")[1]
    return config, [*overrides, *extra], baseline


GRAPH_OVERRIDES = (
    "model.cuda_graph_impl=local",  # enable_cuda_graph trips a re-run __post_init__ in NeMo
    "model.cuda_graph_scope=full_iteration",
    "strategy.use_te_rng_tracker=true",
)
GRAPH_KINDS = {  # mode modifier -> recipe overrides (design §3.5)
    "graph": GRAPH_OVERRIDES,  # one graph per step
    "layergraph": (  # one graph per transformer layer (megatron's CudaGraphManager)
        "model.cuda_graph_impl=local",
        "model.cuda_graph_scope=full",
        "strategy.use_te_rng_tracker=true",
    ),
    "layergraph_attn": (  # the same under megatron-core 0.15 (whole layers either way)
        "model.cuda_graph_impl=local",
        "model.cuda_graph_scope=attn",
        "strategy.use_te_rng_tracker=true",
    ),
    # no CUDA graphs, whatever the recipe says (the GPU recipes turn per-layer graphs on)
    "eager": ("model.cuda_graph_impl=none", "model.cuda_graph_scope=full"),
}
EAGER = "eager"
"""The :data:`GRAPH_KINDS` modifier that turns graphs off; every other kind turns them on."""


def file_stem(text: str) -> str:
    """``text`` as a plain file name (letters, digits, ``._-``): mode modifiers hold ``@ = / %
    #``, and the device tool returns no file whose name holds them."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def token_overrides(tokens: int, config: str | None = None) -> list[str]:
    """The recipe overrides for ``tokens`` per GPU: sequence 2048 (1024 below 2k), micro-batch
    tokens / sequence, global batch two micro-batches; none for the CPU recipes (own shape)."""
    if config in CPU_CONFIGS:
        return []
    seq = 1024 if tokens < 2048 else 2048
    mbs = max(1, tokens // seq)
    return [
        f"data.seq_length={seq}",
        f"data.micro_batch_size={mbs}",
        f"data.global_batch_size={2 * mbs}",
    ]


def world_overrides(world: int, shared_device: bool) -> list[str]:
    """The recipe's world: ``world`` local ranks, or under ``shared_device`` ``world`` one-rank
    "nodes" (every rank is local rank 0: ``cuda:0``) on the staged backend."""
    if not shared_device:
        return [f"trainer.devices={world}"]
    from nemo_gtp.cpu.staged_gloo import BACKEND

    return [
        "trainer.devices=1",
        f"+trainer.num_nodes={world}",
        f"+strategy.process_group_backend={BACKEND}",
    ]


def shared_device_refusal(mode: str) -> str | None:
    """Why ``mode`` cannot run under ``--shared-device`` (None: it can)."""
    base, *knobs = mode.split("#")[0].split("@")
    graphed = [k for k in knobs if k in GRAPH_KINDS and k != EAGER]
    if graphed:
        return (
            f"{mode}: CUDA graphs cannot capture the staged backend's host copies; drop "
            f"@{'/@'.join(graphed)} under --shared-device"
        )
    if base == "mfsdp_te":
        return f"{mode}: Megatron-FSDP needs an NCCL backend; not under --shared-device"
    return None


def rank_environment(rank: int, world: int, shared_device: bool, port: int) -> dict[str, str]:
    """Process ``rank``'s environment. ``shared_device``: Lightning sees local rank 0 of node
    ``rank`` (``NODE_RANK``), so every rank takes ``cuda:0``; ``RANK`` stays the global rank."""
    from nemo_gtp.recipes.launch import rank_env

    env = rank_env(rank, world, nccl=True, master_port=port)
    if shared_device:
        env.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    return env


def launch_plan(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """(the runs, in order, each with its recipe and overrides; the errors, one line each:
    refused modes and recipes that fail the CLI's checks)."""
    from nemo_gtp.recipes.config import RecipeError, load_recipe
    from nemo_gtp.recipes.validate import validate_recipe

    profile = {int(t) for t in args.profile_tokens.split(",") if t}
    runs, errors = [], []
    for tokens, repeat in ((int(t), k) for t in args.tokens.split(",") for k in range(args.repeat)):
        for mode in args.modes.split(","):
            if mode.split("#")[0].split("@")[0] not in MODES:
                errors.append(f"{mode}: unknown mode (modes: {', '.join(MODES)})")
                continue
            refusal = shared_device_refusal(mode) if args.shared_device else None
            if refusal:
                errors.append(refusal)
                continue
            config, overrides, _ = resolve_mode(mode)
            shape = []
            if args.shared_device and not args.full_size and config not in CPU_CONFIGS:
                shape = list(SHARED_DEVICE_SHAPE)  # first: a mode's @model.key=value wins
            if args.shared_device:  # the GPU recipes' default graphs cannot capture staging
                shape += [f"+{k}" for k in GRAPH_KINDS[EAGER]]
            run = {
                "mode": mode if repeat == 0 else f"{mode}#{repeat}",
                "tokens_per_gpu": tokens,
                "config": config,
                "overrides": [  # later wins: a mode's @data.global_batch_size=N over the default
                    *shape,
                    *token_overrides(tokens, config),
                    *overrides,
                    *world_overrides(args.devices, args.shared_device),
                ],
                "profile": tokens in profile and repeat == 0,
            }
            try:
                cfg = load_recipe(str(ROOT / config), run["overrides"])
                validate_recipe(cfg)
                run["precision"] = str(cfg.get("precision", "bf16-mixed"))
            except (RecipeError, ValueError) as err:
                errors.append(f"{mode}: {err}")
                continue
            runs.append(run)
    return runs, errors


# ----------------------------------------------------------------------------- one rank
def _sync() -> None:
    """Wait for the GPU (no-op on CPU, where ``dp2_cpu`` / ``gtp2_cpu`` run)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used, by ``name:tid``
    (Linux ``/proc``; empty elsewhere). Two snapshots around the timed steps say whether the
    main thread competes for cores with busy helper threads (NCCL's proxy, the watchdog, the
    autograd device thread)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_budget() -> dict:
    """The cores this process may use: affinity, and the cgroup quota (``cpu.max``) if any."""
    info = {"affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        info["cgroup_cpu_max"] = Path("/sys/fs/cgroup/cpu.max").read_text().strip()
    except OSError:
        pass
    return info


def thread_cpu_per_step(before: dict, after: dict, steps: int, top: int = 8) -> dict:
    """CPU ms per step of the ``top`` busiest threads between two :func:`thread_cpu_seconds`
    readings (which thread a host-bound step waits on)."""
    used = {k: (after[k] - before.get(k, 0.0)) * 1000 / steps for k in after}
    busiest = sorted(used.items(), key=lambda kv: -kv[1])[:top]
    return {k: round(v, 1) for k, v in busiest if v > 0}


def dump_weights(strategy: object, path: str) -> None:
    """Rank 0 saves the model's full weights as the model without GTP holds them, each
    dequantized into a plain tensor (``nemo_gtp.full_state_dict``: GTP shards gathered, FP8
    primary shards dequantized; TE's FP8 params, ``Float8Tensor``, dequantized here), on the
    CPU. Collective (every rank calls it); TE's ``_extra_state`` entries are left out."""
    import torch
    import torch.distributed as dist

    from nemo_gtp import full_state_dict

    weights = {}
    for key, value in full_state_dict(strategy).items():
        if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        if type(value) is not torch.Tensor:  # a TE quantized tensor (megatron's FP8 params)
            value = value.dequantize()
        weights[key] = value.detach().cpu().clone()
    if dist.get_rank() == 0:
        torch.save(weights, path)


# --host-timer: this rank process's bench.common.GTPHostTimer (module-level: NeMo deep-copies
# callbacks, and the timer's thread-local depth cannot be copied)
_HOST_TIMER = None


def steps_callback(warmup: int, timed: int, profile: bool, timing: bool = True):  # noqa: ANN202
    """The rank's Lightning callback (Lightning imported here: the parent process stays light).
    ``timing=False`` (``--shared-device``): no exposed-communication or host/GPU split steps,
    whose numbers would mean nothing; the run is ``warmup + timed`` steps (+ profiling)."""
    import lightning.pytorch as pl

    class _Steps(pl.Callback):
        """Lightning callback: step wall times, losses, peak memory; exposed-communication and
        profiling windows after the timed steps."""

        def __init__(self, warmup: int, timed: int, profile: bool) -> None:
            self.warmup, self.timed, self.profile = warmup, timed, profile
            self.extra = 3 if timing else 0  # steps in each of the exposed and split windows
            self.records: list[dict] = []
            self.exposed: dict[str, float] = {}
            self.trace_path: str | None = None  # --chrome-trace: where rank 0 writes it
            self.pstats_path: str | None = None  # rank 0: the host profile, every function
            self.dump_prefix: str | None = None  # --dump-weights: <out>/weights_<mode>_<tokens>
            self.dumped_start = False
            self.split: list[dict[str, float]] = []
            self.gtp_stats: dict[str, int] = {}  # CommStats of the last split-window step
            # (of the last timed step without those windows)
            self.torch_profile: dict = {}
            self.host_profile = ""
            self._start = 0.0
            self._prof = None
            self._torch_prof = None
            self._threads: dict[str, float] = {}
            self._timed_wall = 0.0
            self.thread_cpu_ms_per_step: dict[str, float] = {}
            self._timer_start: dict = {}
            self.host_inside: dict = {}  # ms per timed step inside GTP / DDP / optimizer entries
            self.phase: list[dict[str, float]] = []  # timed steps: fwd+bwd issue, the rest

        @property
        def windows(self) -> dict[str, range]:
            """Step ranges: timed, exposed-communication, torch.profiler, cProfile."""
            t0 = self.warmup + self.timed
            t1 = t0 + 2 * self.extra  # the profiling windows follow
            return {
                "timed": range(self.warmup, t0),
                "exposed": range(t0, t0 + self.extra),
                "split": range(t0 + self.extra, t1),
                "torch": range(t1, t1 + 3) if self.profile else range(0),
                "host": range(t1 + 3, t1 + 6) if self.profile else range(0),
            }

        @property
        def stats_step(self) -> int:
            """The step whose GTP ``CommStats`` are recorded without split-window steps
            (``timing=False``): the last timed one (counts and bytes mean something there too)."""
            return -1 if self.extra else self.warmup + self.timed - 1

        @property
        def total_steps(self) -> int:
            return self.warmup + self.timed + 2 * self.extra + (6 if self.profile else 0)

        def on_train_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if self.dump_prefix:
                dump_weights(trainer.strategy, f"{self.dump_prefix}_end.pt")

        def on_before_optimizer_step(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            """Host-bound or GPU-bound? In the split window (the GPU idle at the batch start):
            the host's time to issue forward + backward, then how long the GPU still needs."""

            if trainer.global_step in self.windows["timed"]:  # no sync: the step's own pace
                self.phase.append({"fwd_bwd_ms": 1000 * (time.perf_counter() - self._start)})
            if trainer.global_step not in self.windows["split"]:
                return
            issued = time.perf_counter()
            _sync()
            done = time.perf_counter()
            self.split.append(
                {
                    "host_issue_ms": round(1000 * (issued - self._start), 2),
                    "gpu_tail_ms": round(1000 * (done - issued), 2),
                }
            )

        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            import torch

            from nemo_gtp.strategy import gtp_runtimes

            # the first batch: after a checkpoint load, what was loaded; after NeMo's PEFT
            # transform too (at the epoch start: the adapters, and the GTP shards registered)
            if self.dump_prefix and not self.dumped_start:
                self.dumped_start = True
                dump_weights(trainer.strategy, f"{self.dump_prefix}_start.pt")
            step, w = trainer.global_step, self.windows
            if step == w["timed"].start:  # which threads burn CPU during the timed steps
                self._threads, self._timed_wall = thread_cpu_seconds(), time.perf_counter()
                if _HOST_TIMER is not None:
                    self._timer_start = _HOST_TIMER.snapshot()
            if step == w["timed"].stop and _HOST_TIMER is not None and self._timer_start:
                self.host_inside = _HOST_TIMER.per_step(
                    self._timer_start, _HOST_TIMER.snapshot(), len(w["timed"])
                )
            if step == w["timed"].stop and self._threads:
                self.thread_cpu_ms_per_step = thread_cpu_per_step(
                    self._threads, thread_cpu_seconds(), len(w["timed"])
                )
                self.thread_cpu_ms_per_step["wall"] = round(
                    1000 * (time.perf_counter() - self._timed_wall) / len(w["timed"]), 1
                )
            if w["exposed"] and step == w["exposed"].start:
                for runtime in gtp_runtimes(trainer):
                    runtime.wait_timer.enable()
                    runtime.wait_timer.collect()
            if w["exposed"] and step == w["exposed"].stop:
                for runtime in gtp_runtimes(trainer):
                    runtime.wait_timer.enable(False)
            if w["torch"] and step == w["torch"].start:
                self._torch_prof = torch.profiler.profile(
                    activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        torch.profiler.ProfilerActivity.CUDA,
                    ]
                )
                self._torch_prof.__enter__()
            if w["host"] and step == w["host"].start:
                self._prof = cProfile.Profile()
                self._prof.enable()
            if step in w["split"] or step == self.stats_step:
                for runtime in gtp_runtimes(trainer):
                    runtime.stats.reset()
            _sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002

            from nemo_gtp.strategy import gtp_runtimes

            _sync()
            step, w = trainer.global_step - 1, self.windows
            ms = 1000 * (time.perf_counter() - self._start)
            if step in w["timed"] and self.phase and "rest_ms" not in self.phase[-1]:
                self.phase[-1]["rest_ms"] = ms - self.phase[-1]["fwd_bwd_ms"]
            loss = trainer.callback_metrics.get("reduced_train_loss")
            norm = trainer.callback_metrics.get("grad_norm")  # NeMo logs it at every step
            self.records.append(
                {
                    "step": step,
                    "ms": round(ms, 2),
                    "loss": float(loss) if loss is not None else None,
                    "grad_norm": float(norm) if norm is not None else None,
                }
            )
            if step in w["split"] or step == self.stats_step:  # gathers, bytes, prefetches, ...
                self.gtp_stats = {}
                for runtime in gtp_runtimes(trainer):
                    for key, value in dataclasses.asdict(runtime.stats).items():
                        self.gtp_stats[key] = self.gtp_stats.get(key, 0) + value
            if w["exposed"] and step == w["exposed"].stop - 1:
                for runtime in gtp_runtimes(trainer):
                    for kind, seconds in runtime.wait_timer.collect().items():
                        self.exposed[kind] = self.exposed.get(kind, 0.0) + seconds / 3
            if w["torch"] and step == w["torch"].stop - 1:
                self._torch_prof.__exit__(None, None, None)
                if self.trace_path:  # the profiled steps' timeline, for chrome://tracing
                    self._torch_prof.export_chrome_trace(self.trace_path)
                    with (
                        open(self.trace_path, "rb") as raw,
                        gzip.open(self.trace_path + ".gz", "wb") as packed,
                    ):
                        shutil.copyfileobj(raw, packed)
                    os.remove(self.trace_path)
                self.torch_profile = _summarize_torch_profile(
                    self._torch_prof, len(w["torch"]), [r["ms"] for r in self.records[-3:]]
                )
            if w["host"] and step == w["host"].stop - 1:
                self._prof.disable()
                if self.pstats_path:  # for offline diffs of two modes (pstats.Stats(path))
                    self._prof.dump_stats(self.pstats_path)
                text = io.StringIO()
                stats = pstats.Stats(self._prof, stream=text)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats(45)
                self.host_profile = text.getvalue()

    return _Steps(warmup, timed, profile)


def _summarize_torch_profile(prof, steps: int, step_ms: list[float]) -> dict:
    """GPU busy time per step (union of kernel / memcpy intervals on each stream's device),
    against the step's wall time: idle = wall - busy is time the GPU waited for the host."""
    intervals, nccl = [], []
    for event in prof.events():
        if (
            getattr(event, "device_type", None) is not None
            and str(event.device_type).endswith("CUDA")
            and event.time_range.end > event.time_range.start
        ):
            span = (event.time_range.start, event.time_range.end)
            (nccl if "nccl" in event.name.lower() else intervals).append(span)
    per_step = 1000 * steps
    wall_ms = statistics.mean(step_ms) if step_ms else float("nan")
    busy_ms = _union_us(intervals + nccl) / per_step
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return {
        "gpu_busy_ms_per_step": round(busy_ms, 2),
        # the same GEMMs and kernels in every mode: slower here = SMs shared with NCCL kernels
        "compute_kernel_ms_per_step": round(sum(e - s for s, e in intervals) / per_step, 2),
        "compute_busy_ms_per_step": round(_union_us(intervals) / per_step, 2),
        # NCCL kernel time includes spinning while a peer has not arrived yet
        "nccl_kernel_ms_per_step": round(sum(e - s for s, e in nccl) / per_step, 2),
        "wall_ms_per_step": round(wall_ms, 2),
        "gpu_idle_fraction": round(max(0.0, 1 - busy_ms / wall_ms), 3),
        "top_cpu_ops": table,
    }


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    busy, current = 0.0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                busy += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        busy += current[1] - current[0]
    return busy


def timed_fit(
    cfg: object, callbacks: list, steps: object, store: str, world: int, tokens_per_gpu: int
) -> dict:
    """Build and run one fit of recipe ``cfg`` (``steps``, one of ``callbacks``, is its
    :func:`steps_callback`; ``store``: a fresh file store path): the median step of the timed
    window, tokens/s per GPU, peak memory above what earlier fits left allocated, the loss
    curve and the exposed GTP communication."""
    import torch
    import torch.distributed as dist

    from nemo_gtp.recipes.loader import build_fit

    fit = build_fit(cfg, callbacks=callbacks)
    fit.trainer.strategy.store = dist.FileStore(store, world)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated() if cuda else 0  # what earlier fits left allocated
    fit.run()
    del fit
    timed = [r["ms"] for r in steps.records if r["step"] in steps.windows["timed"]]
    median = statistics.median(timed)
    return dict(
        step_ms=round(median, 2),
        tokens_per_s_per_gpu=round(tokens_per_gpu / median * 1000),
        peak_gib=round(((torch.cuda.max_memory_allocated() if cuda else 0) - leftover) / 2**30, 2),
        leftover_gib=round(leftover / 2**30, 2),
        losses=[r["loss"] for r in steps.records],
        grad_norms=[r["grad_norm"] for r in steps.records],
        exposed_ms={k: round(v * 1000, 3) for k, v in steps.exposed.items()},
    )


def _rank_main(spec_path: str) -> None:
    import torch

    from bench.common import mfu_fields, start_recording, stop_and_report
    from nemo_gtp.recipes.launch import teardown_fit
    from nemo_gtp.recipes.loader import load_recipe

    spec = json.loads(Path(spec_path).read_text())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if spec.get("shared_device"):  # registers "staged_gloo", the recipes' process-group backend
        import nemo_gtp.cpu.staged_gloo  # noqa: F401
    global _HOST_TIMER
    if spec.get("host_timer") and _HOST_TIMER is None:  # before any model is built (TE's
        from bench.common import GTP_ENTRIES, GTPHostTimer, te_entries  # pre-hooks bind at build)

        entries = GTP_ENTRIES + (te_entries() if spec.get("te_timer") else ())
        _HOST_TIMER = GTPHostTimer.install(entries)
    out = []
    for i, run in enumerate(spec["runs"]):
        record = {k: run[k] for k in ("mode", "tokens_per_gpu")}
        if spec.get("fit_timeout"):  # a hung fit: every thread's stack in the rank's log, exit
            faulthandler.dump_traceback_later(spec["fit_timeout"], exit=True)
        try:
            steps = steps_callback(
                spec["warmup"], spec["timed"], run["profile"], timing=not spec.get("shared_device")
            )
            name = file_stem(f"{run['mode']}_{run['tokens_per_gpu']}")
            if spec.get("dump_weights"):
                steps.dump_prefix = str(Path(spec["out"], f"weights_{name}"))
            if rank == 0 and run["profile"]:
                steps.pstats_path = str(Path(spec["out"], f"host_profile_{name}.pstats"))
                if spec.get("chrome_trace"):
                    steps.trace_path = str(Path(spec["out"], f"trace_{name}.json"))
            cfg = load_recipe(
                str(ROOT / run["config"]),
                [*run["overrides"], f"trainer.max_steps={steps.total_steps}"],
            )
            store = str(Path(spec["dir"], f"store{i}"))
            trace = spec.get("memory_trace") and rank == 0 and torch.cuda.is_available()
            if trace:  # from before the model is built: setup's blocks are in the replay too
                start_recording()
            record.update(timed_fit(cfg, [steps], steps, store, world, run["tokens_per_gpu"]))
            if not spec.get("shared_device"):  # model FLOPs per step against the device's peak
                device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
                record.update(mfu_fields(cfg, world, record["step_ms"], device), device=device)
            if trace:
                report = stop_and_report(top=30, stack=True)
                Path(spec["out"], f"memory_peak_{name}.txt").write_text(report)
            record.update(
                # forward + backward: host issue time vs what the GPU still had left after it
                split_ms={
                    key: round(statistics.median(s[key] for s in steps.split), 2)
                    for key in ("host_issue_ms", "gpu_tail_ms")
                }
                if steps.split
                else {},
                torch_profile={k: v for k, v in steps.torch_profile.items() if k != "top_cpu_ops"},
                gtp_stats_per_step=steps.gtp_stats,
                thread_cpu_ms_per_step=steps.thread_cpu_ms_per_step,
                cpu_budget=cpu_budget(),
                # timed steps, medians: the host's pace through forward + backward (no sync)
                # and the rest of the step (optimizer, drains, the GPU's catch-up)
                phase_ms={
                    key: round(statistics.median(p[key] for p in steps.phase), 2)
                    for key in ("fwd_bwd_ms", "rest_ms")
                }
                if steps.phase and all("rest_ms" in p for p in steps.phase)
                else {},
                host_inside=steps.host_inside,
            )
            if rank == 0 and run["profile"]:
                Path(spec["out"], f"host_profile_{name}.txt").write_text(steps.host_profile)
                Path(spec["out"], f"torch_profile_{name}.txt").write_text(
                    steps.torch_profile.get("top_cpu_ops", "")
                )
        except Exception as err:  # record and go on: one broken mode must not hide the rest
            record["error"] = f"{type(err).__name__}: {err}"[:2000]
            if rank == 0:
                traceback.print_exc()
        out.append(record)
        # every rank's own view (host split, thread CPU) goes to its log (rank<k>.log)
        print(
            json.dumps({"rank": rank, **{k: v for k, v in record.items() if k != "losses"}}),
            flush=True,
        )
        if rank == 0:
            # after every fit: a later hang or kill leaves the earlier records to the report
            Path(spec["dir"], "records.json").write_text(json.dumps(out))
        try:
            teardown_fit()
        finally:
            faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- parent
def report(records: list[dict], out: Path) -> str:
    """The launch's markdown table (``bench_nemo.md``, returned too): one row per fit against its
    baseline, then the parity, repeat, graph, thread and gathered-bytes summaries; outside
    ``--shared-device`` also the step-time ratio plot ``bench_nemo_ratio.png``."""
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records}
    lines = [
        "| mode | tokens/GPU | step ms | MFU | vs baseline | tokens/s/GPU | peak GiB | "
        "exposed gather / RS ms | host issue / GPU tail ms | GPU idle | "
        "compute / NCCL kernel ms | skipped prefetch / fallback | gathered MiB/step | "
        "max loss rel diff vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(
                f"| {r['mode']} | {r['tokens_per_gpu']} | failed: {r['error'][:160]} "
                "| | | | | | | | | | | |"
            )
            continue
        base_mode = resolve_mode(r["mode"])[2] or ""
        base = by.get((base_mode, r["tokens_per_gpu"]))
        ratio, diff = "", ""
        if base and "error" not in base:
            ratio = f"{r['step_ms'] / base['step_ms']:.3f}× {base_mode}"
            worst = max_rel(r["losses"], base["losses"])
            diff = "" if worst is None else f"{worst:.1e}"
        exposed = r.get("exposed_ms", {})
        idle = r.get("torch_profile", {}).get("gpu_idle_fraction")
        split = r.get("split_ms", {})
        split_text = f"{split['host_issue_ms']:.1f} / {split['gpu_tail_ms']:.1f}" if split else ""
        prof = r.get("torch_profile", {})
        kernels = (
            f"{prof['compute_kernel_ms_per_step']:.1f} / {prof['nccl_kernel_ms_per_step']:.1f}"
            if "nccl_kernel_ms_per_step" in prof
            else ""
        )
        stats = r.get("gtp_stats_per_step") or {}
        misses = f"{stats['prefetch_skipped']} / {stats['fallback_allocations']}" if stats else ""
        gathered = f"{stats['gather_bytes'] / 2**20:.1f}" if stats else ""
        lines.append(
            f"| {r['mode']} | {r['tokens_per_gpu']} | {r['step_ms']:.1f} | {mfu_text(r)} | "
            f"{ratio} | "
            f"{r['tokens_per_s_per_gpu']} | {r['peak_gib']} | "
            f"{exposed.get('gather', 0):.2f} / {exposed.get('reduce_scatter', 0):.2f} | "
            f"{split_text} | {'' if idle is None else f'{idle:.0%}'} | {kernels} | {misses} | "
            f"{gathered} | {diff} |"
        )
    shared = next((r["shared_device"] for r in records if r.get("shared_device")), 0)
    table = (
        (SHARED_DEVICE_NOTE.format(n=shared) + "\n\n" if shared else "")
        + "\n".join(lines)
        + _parity_summary(records)
        + _repeat_summary(records)
        + _graph_vs_eager(records)
        + _thread_summary(records)
        + bytes_summary(records)
    )
    (out / "bench_nemo.md").write_text(table + "\n")
    if shared:  # a step-time ratio plot of a shared GPU would only mislead
        return table
    try:
        _plot(records, out / "bench_nemo_ratio.png")
    except Exception as err:  # noqa: BLE001 (matplotlib missing: the table is the result)
        print(f"plot skipped: {err}")
    return table


BYTES_TWINS = {  # an FP8-gathering mode -> the bf16 GTP mode of the same model (design §1.3)
    "gtp2_fp8": "gtp2_te",
    "gtp2_fp8param": "gtp2_te",
    "gtp2_fp8block": "gtp2_te",
    "gtp2_fp8blockparam": "gtp2_te",
}


def bytes_summary(records: list[dict]) -> str:
    """One ``GATHER BYTES`` line per FP8 mode whose bf16 twin (:data:`BYTES_TWINS`) ran at the
    same tokens: gathered bytes per step, FP8 / bf16 (the FP8 gather's target is 0.50 ± 3 %;
    counted from the runtimes' ``CommStats``, so it holds under ``--shared-device`` too)."""
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records if "error" not in r}
    lines = []
    for (mode, tokens), r in by.items():
        base, _, repeat = mode.partition("#")
        twin_mode = BYTES_TWINS.get(base)
        twin = by.get((f"{twin_mode}#{repeat}" if repeat else twin_mode or "", tokens))
        ours = (r.get("gtp_stats_per_step") or {}).get("gather_bytes")
        theirs = ((twin or {}).get("gtp_stats_per_step") or {}).get("gather_bytes")
        if ours and theirs:
            ratio = ours / theirs
            verdict = "within" if abs(ratio - 0.5) <= 0.015 else "OUTSIDE"
            lines.append(
                f"GATHER BYTES {mode} / {twin['mode']} at {tokens}: {ours} / {theirs} = "
                f"{ratio:.4f} per step ({verdict} 0.50 +- 3 %)"
            )
    return "\n\n" + "\n".join(lines) if lines else ""


SHARED_DEVICE_NOTE = (
    "**--shared-device: {n} ranks on one GPU**, every collective staged through host memory "
    "over gloo (backend staged_gloo). Step times, tokens/s, exposed communication, GPU idle, "
    "kernel times and peak memory below are NOT meaningful (the ranks share the GPU and the "
    "host copies are synchronous); losses and grad norms are: see the parity table."
)


def parity(record: dict, base: dict) -> dict:
    """Loss and grad-norm agreement of ``record`` with its baseline ``base`` over their common
    steps: max |loss diff|, max relative loss and grad-norm differences, and whether the loss
    stays within ``nemo_gtp.run``'s tolerance for the recipe's precision."""
    from nemo_gtp.run import TOLERANCE

    pairs = [
        (a, b) for a, b in zip(record["losses"], base["losses"]) if a is not None and b is not None
    ]
    tolerance = TOLERANCE.get(record.get("precision") or "", TOLERANCE["bf16-mixed"])
    rel = max_rel(record["losses"], base["losses"])
    return {
        "steps": len(pairs),
        "first_loss": (pairs[0] if pairs else None),
        "max_abs_loss_diff": max((abs(a - b) for a, b in pairs), default=None),
        "max_rel_loss_diff": rel,
        "max_rel_grad_norm_diff": max_rel(record.get("grad_norms"), base.get("grad_norms")),
        "tolerance": tolerance,
        "match": rel is not None and rel <= tolerance,
    }


def _parity_summary(records: list[dict]) -> str:
    """Each mode against its baseline in this launch (same size): :func:`parity_section`."""
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records if "error" not in r}
    pairs = []
    for (mode, tokens), r in by.items():
        config, overrides, base_mode = resolve_mode(mode)
        base = by.get((base_mode or "", tokens))
        if base is None or resolve_mode(base_mode)[0] != config:
            continue  # no baseline here, or another recipe's (dp2_local's is dp2_te: speed only)
        pairs.append((mode, base_mode, tokens, r, base))
    # Linears built as their GTP shards start from the unsharded build's rows (design §3.1
    # "Exact init"), sliced ones are cut from it: every pair starts from the same weights.
    notes: list[str] = []
    return parity_section(pairs, notes)


def parity_section(pairs: list[tuple[str, str, int, dict, dict]], notes: list[str]) -> str:
    """The parity table of ``(mode, baseline mode, tokens per GPU, record, baseline record)``
    pairs, one row each (:func:`parity`: loss curves and grad norms), the ``notes`` below it,
    then one ``PARITY ... match / DIFFERS`` line per pair (the run's verdicts); empty when no
    pair has a common step. ``bench_moe.py`` renders its pairs with it too.

    Example::

        parity_section([("gtp2_te", "dp2_te", 2048, gtp_record, dp_record)], [])
    """
    rows, verdicts = [], []
    for mode, base_mode, tokens, r, base in pairs:
        p = parity(r, base)
        if not p["steps"]:
            continue
        first = p["first_loss"]
        first_text = "identical" if first[0] == first[1] else f"{first[0]:.6f} / {first[1]:.6f}"
        norm = p["max_rel_grad_norm_diff"]
        verdict = "match" if p["match"] else "DIFFERS"
        rows.append(
            f"| {mode} | {base_mode} | {tokens} | {p['steps']} | {first_text} | "
            f"{p['max_abs_loss_diff']:.2e} | {p['max_rel_loss_diff']:.2e} | "
            f"{'' if norm is None else f'{norm:.2e}'} | {p['tolerance']:.0e} | {verdict} |"
        )
        verdicts.append(
            f"PARITY {mode} vs {base_mode} at {tokens} tokens/GPU: {verdict} (max rel loss diff "
            f"{p['max_rel_loss_diff']:.2e}, max |loss diff| {p['max_abs_loss_diff']:.2e}, "
            f"max rel grad-norm diff {'n/a' if norm is None else f'{norm:.2e}'} over "
            f"{p['steps']} steps; tolerance {p['tolerance']:.0e})"
        )
    if not rows:
        return ""
    head = [
        "",
        "",
        "Parity vs baseline (same launch, same size; step 0 = the first training step):",
        "",
        "| mode | baseline | tokens/GPU | steps | step-0 loss mode / baseline | "
        "max abs loss diff | max rel loss diff | max rel grad-norm diff | tolerance | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join([*head, *rows, *(["", *notes] if notes else []), "", *verdicts])


def _thread_summary(records: list[dict]) -> str:
    """Rank 0's busiest threads (CPU ms per timed step) next to the step's wall time."""
    rows = [r for r in records if r.get("thread_cpu_ms_per_step")]
    if not rows:
        return ""
    lines = [
        "",
        "",
        f"CPU time per timed step by thread, rank 0 (cores: {rows[0].get('cpu_budget')}):",
        "",
        "| mode | tokens/GPU | wall ms | busiest threads (CPU ms) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        threads = dict(r["thread_cpu_ms_per_step"])
        wall = threads.pop("wall", "")
        busiest = ", ".join(f"{k.split(':')[0]} {v}" for k, v in list(threads.items())[:5])
        lines.append(f"| {r['mode']} | {r['tokens_per_gpu']} | {wall} | {busiest} |")
    return "\n".join(lines)


def _eager_twins(mode: str) -> list[str]:
    """``gtp2_te@graph`` -> ``[gtp2_te@eager, gtp2_te]``: the same mode without CUDA graphs,
    explicitly eager (the GPU recipes are graphed by default) or as its recipe has it (an
    eager recipe); empty for a mode without a graph modifier."""
    base, *knobs = mode.split("#")[0].split("@")
    if not any(k in GRAPH_KINDS and k != EAGER for k in knobs):
        return []
    rest = [k for k in knobs if k not in GRAPH_KINDS]
    twins = ["@".join([base, EAGER, *rest])]
    if base in MODES and not recipe_graphed(MODES[base][0]):
        twins.append("@".join([base, *rest]))
    return twins


def recipe_graphed(config: str) -> bool:
    """Whether the recipe ``config`` (a path under the repository root) turns CUDA graphs on by
    itself (``model.cuda_graph_impl`` other than ``none``)."""
    from omegaconf import OmegaConf

    impl = OmegaConf.select(OmegaConf.load(ROOT / config), "model.cuda_graph_impl", default=None)
    return impl not in (None, "none")


def max_rel(a: list | None, b: list | None) -> float | None:
    """The largest relative difference of curve ``a`` from curve ``b`` over their common steps
    (steps either misses, or where ``b`` is 0, left out); None without one."""
    pairs = [(x, y) for x, y in zip(a or [], b or []) if x is not None and y]
    return max(abs(x - y) / abs(y) for x, y in pairs) if pairs else None


def _graph_vs_eager(records: list[dict]) -> str:
    """A graphed mode against its eager twin at the same size (design §3.5): step 1's loss,
    the largest relative loss and grad-norm differences over the run, step time and the host's
    time to issue forward + backward."""
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records if "error" not in r}
    lines = []
    for (mode, tokens), r in by.items():
        twin = next((by[(t, tokens)] for t in _eager_twins(mode) if (t, tokens) in by), None)
        if twin is None:
            continue
        first = (r["losses"] or [None])[0], (twin["losses"] or [None])[0]
        loss_rel, norm_rel = (
            max_rel(r["losses"], twin["losses"]),
            max_rel(r.get("grad_norms"), twin.get("grad_norms")),
        )
        host = (
            r.get("split_ms", {}).get("host_issue_ms"),
            twin.get("split_ms", {}).get("host_issue_ms"),
        )
        lines.append(
            f"| {mode} | {tokens} | {first[0]} / {first[1]} | "
            f"{'' if loss_rel is None else f'{loss_rel:.1e}'} | "
            f"{'' if norm_rel is None else f'{norm_rel:.1e}'} | "
            f"{r['step_ms'] / twin['step_ms']:.3f} | "
            f"{f'{host[1] / host[0]:.1f}×' if host[0] and host[1] else ''} |"
        )
    if not lines:
        return ""
    head = [
        "",
        "",
        "Graphed vs the same mode eager (same size):",
        "",
        "| graphed mode | tokens/GPU | step-1 loss graphed / eager | max loss rel diff | "
        "max grad-norm rel diff | step time graphed / eager | host issue eager / graphed |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines)


def _repeat_summary(records: list[dict]) -> str:
    """With ``--repeat``: per mode and size, the median step over the repeats and the ratio of
    medians to its baseline (each repeat ran every mode once, interleaved)."""
    if not any("#" in r["mode"] for r in records):
        return ""
    steps: dict[tuple[str, int], list[float]] = {}
    work: dict[tuple[str, int], float] = {}  # MFU x step ms: the same for every repeat
    for r in records:
        if "error" not in r:
            key = (r["mode"].split("#")[0], r["tokens_per_gpu"])
            steps.setdefault(key, []).append(r["step_ms"])
            if r.get("mfu") is not None:
                work[key] = r["mfu"] * r["step_ms"]
    lines = [
        "",
        "",
        "Over the repeats (modes interleaved in each repeat):",
        "",
        "| mode | tokens/GPU | repeats | median step ms | MFU at the median | steps ms | "
        "ratio of medians |",
        "|---|---|---|---|---|---|---|",
    ]
    for (mode, tokens), values in steps.items():
        base = resolve_mode(mode)[2]
        ratio = ""
        if base and (base, tokens) in steps:
            ratio = (
                f"{statistics.median(values) / statistics.median(steps[(base, tokens)]):.3f}"
                f"× {base}"
            )
        median = statistics.median(values)
        mfu = f"{100 * work[(mode, tokens)] / median:.1f} %" if (mode, tokens) in work else ""
        lines.append(
            f"| {mode} | {tokens} | {len(values)} | {median:.1f} | {mfu} | "
            f"{', '.join(f'{v:.1f}' for v in values)} | {ratio} |"
        )
    return "\n".join(lines)


def _plot(records: list[dict], png: Path) -> None:
    from bench.common import plot_ratio_series

    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records if "error" not in r}
    series = {}
    modes = dict.fromkeys(m for m, _ in by)
    for mode in modes:
        base = resolve_mode(mode)[2]
        if base is None or "#" in mode:  # repeats: the summary table has them
            continue
        xs = sorted(t for m, t in by if m == mode and (base, t) in by)
        series[f"{mode} / {base}"] = (
            xs,
            [by[(mode, t)]["step_ms"] / by[(base, t)]["step_ms"] for t in xs],
        )
    plot_ratio_series(
        series,
        str(png),
        title="NeMo 1B recipe, GTPMegatronStrategy, 2 GPUs",
        ylabel="step time ratio",
    )


def _wait_all(procs: list, grace_s: float = 60.0) -> list[int]:
    """Wait for every rank; once one has failed, give the others ``grace_s`` and then kill
    them (a rank that died leaves its peers blocked in a collective)."""
    failed_at = None
    while any(proc.poll() is None for proc, _ in procs):
        if failed_at is None and any(proc.poll() not in (None, 0) for proc, _ in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(1.0)
    for _, log in procs:
        log.close()
    return [proc.returncode for proc, _ in procs]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="dp2_local,gtp2_local,dp2_te,gtp2_te")
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--profile-tokens", default="", help="also profile at these sizes")
    parser.add_argument(
        "--chrome-trace",
        action="store_true",
        help="with --profile-tokens: also write rank 0's timeline of the profiled steps "
        "(trace_<mode>_<tokens>.json.gz, chrome://tracing or Perfetto)",
    )
    parser.add_argument(
        "--host-timer",
        action="store_true",
        help="record per rank the host ms per timed step inside GTP's entry points, megatron's "
        "DDP bucket calls and optimizer step (bench.common.GTPHostTimer; ~1 us per wrapped call)",
    )
    parser.add_argument(
        "--te-timer",
        action="store_true",
        help="with --host-timer: TE's Python entry points and C++ functions timed too, each "
        "its own entry (bench.common.te_entries): the same TE call's host µs in every mode",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timed", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2, help="ranks (one per GPU unless shared)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run every mode this many times, interleaved"
    )
    parser.add_argument(
        "--fit-timeout",
        type=float,
        default=0,
        help="seconds per fit (build, steps, teardown); past it each rank writes every "
        "thread's stack to its log and exits (finding a hang)",
    )
    parser.add_argument(
        "--dump-weights",
        action="store_true",
        help="rank 0 writes every fit's full weights, dequantized, at its train start (after a "
        "checkpoint load) and end: weights_<mode>_<tokens>_{start,end}.pt, the mode's "
        "characters outside [A-Za-z0-9._-] as _ (python -m bench.tools compare-weights)",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="rank 0 records its CUDA allocations per fit (Python stacks, from before the build) "
        "and writes what is live at its peak, per allocation site: memory_peak_<mode>_<tokens>.txt",
    )
    add_launch_arguments(parser, SHARED_DEVICE_SHAPE)
    args = parser.parse_args(argv)
    check_launch_arguments(parser, args)
    return args


def add_launch_arguments(parser: argparse.ArgumentParser, cut: tuple[str, ...]) -> None:
    """``--shared-device``, ``--full-size`` (``cut``: the recipe overrides it skips),
    ``--dry-run`` and ``--out``, as this script and ``bench_moe.py`` take them."""
    parser.add_argument(
        "--shared-device",
        action="store_true",
        help="all ranks on one GPU (cuda:0), collectives staged through host memory over gloo "
        "(backend staged_gloo), the model cut down: numerics only, step times mean nothing",
    )
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="with --shared-device: keep the recipe's model shape (default: "
        + ", ".join(override.split(".", 1)[1] for override in cut)
        + ")",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every run's recipe and print the launch plan (runs, per-rank environment); "
        "launch nothing",
    )
    parser.add_argument("--out", required=True)


def check_launch_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What :func:`add_launch_arguments` and ``--devices`` (None: the modes' own) cannot take."""
    if args.full_size and not args.shared_device:
        parser.error("--full-size only applies with --shared-device")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")


PLAN_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    runs, errors = launch_plan(args)
    port = free_port()
    if args.dry_run or errors:
        plan = {
            "shared_device": args.shared_device,
            "runs": runs,
            "ranks": [
                {
                    k: rank_environment(r, args.devices, args.shared_device, port)[k]
                    for k in PLAN_ENV
                }
                for r in range(args.devices)
            ],
            "errors": errors,
        }
        print(json.dumps(plan, indent=1))
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        return 2 if errors else 0
    out.mkdir(parents=True, exist_ok=True)
    if args.shared_device:
        print(
            f"--shared-device: {args.devices} ranks on cuda:0, collectives staged through the "
            "host (staged_gloo): numerics only, step times mean nothing",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "dir": tmp,
                    "out": str(out.resolve()),
                    "warmup": args.warmup,
                    "chrome_trace": args.chrome_trace,
                    "host_timer": args.host_timer or args.te_timer,
                    "te_timer": args.te_timer,
                    "dump_weights": args.dump_weights,
                    "memory_trace": args.memory_trace,
                    "timed": args.timed,
                    "fit_timeout": args.fit_timeout,
                    "shared_device": args.shared_device,
                }
            )
        )
        procs = []
        for rank in range(args.devices):
            env = rank_environment(rank, args.devices, args.shared_device, port)
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
            procs.append(
                (
                    subprocess.Popen(
                        module_argv("bench.bench_nemo", "--rank-main", str(spec)),
                        env=with_root(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        codes = _wait_all(procs)
        records_path = Path(tmp, "records.json")
        records = json.loads(records_path.read_text()) if records_path.exists() else []
    precision = {run["mode"]: run["precision"] for run in runs}
    for record in records:
        record["precision"] = precision.get(record["mode"])
        record["shared_device"] = args.devices if args.shared_device else 0  # ranks on one GPU
    (out / "bench_nemo.json").write_text(json.dumps(records, indent=1))
    print(report(records, out))
    return max(codes)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-main":
        _rank_main(sys.argv[2])
    else:
        sys.exit(main())

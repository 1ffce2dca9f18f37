"""One-invocation benchmark: replicated DDP vs torch FSDP2 vs GTP on the same GPT.

Question: Does GTP2 keep DDP's step time and FSDP2's memory at the megatron level (1.34 B GPT, local
spec), and which gather backend wins at which tokens per GPU?

Ranks: NCCL, one rank per GPU (``torchrun``). Its ``build`` also runs on CPU/gloo for
``bench.bench_max_model``'s CPU probes.

Builds megatron-core's GPTModel (local layer spec, bf16) and, in one process group, trains it
three ways for every shape of a tokens-per-GPU sweep:

- ``ddp``:   megatron DDP over all ranks, distributed optimizer, fp32 grad reduce, overlap.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per transformer layer + root, bf16 compute,
             fp32 reduce and fp32 sharded master params, ``torch.optim.AdamW(fused=True)``.
- ``gtp``:   TP1·GTP=world (nemo_gtp), megatron DDP over the replicate group, distributed
             optimizer, fp32 grad reduce.

Reports step time (median of ``--steps`` after ``--warmup``), tokens/s, peak memory, GTP's
exposed communication (stall of the compute stream on gathers / reduce-scatters, CUDA events)
and weight+grad+optimizer bytes per rank, as a markdown table (ratios to DDP) plus JSON, and a
PNG of the step-time ratio against tokens per GPU.

    torchrun --nproc-per-node 2 -m bench.bench_gpt --out bench_out
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from bench.common import fuse_adam, install_torch_kernels, write_host_profile
from nemo_gtp.engine import GTPConfig, GTPParallelDims
from nemo_gtp.integrations.megatron import (
    GTPDistributedDataParallel,
    gtp_process_groups,
    initialize_gtp_parallel,
    make_finalize_model_grads,
    shard_model,
)

# The GTP variants the benchmark knows (mode name -> engine config).
GTP_MODES = {
    "gtp": GTPConfig(gather_backend="process_group"),
    "gtp_ce": GTPConfig(gather_backend="copy_engine"),
    "gtp_auto": GTPConfig(gather_backend="auto"),
    "gtp_rs2": GTPConfig(gather_backend="process_group", separate_reduce_scatter_group=True),
    # default gather + embeddings/output/norms reduced and optimizer-sharded over DP x GTP
    "gtp_sr": GTPConfig(gather_backend="auto", shard_replicated_params_over_gtp=True),
    # NCCL gather with the GTP communicator on a high-priority stream / limited to 8 CTAs
    "gtp_hiprio": GTPConfig(gather_backend="process_group"),
    "gtp_ctas8": GTPConfig(gather_backend="process_group"),
}
# ProcessGroupNCCL.Options of the GTP communicator per mode (stream priority, channels).
GTP_PG_OPTIONS = {"gtp_hiprio": dict(is_high_priority_stream=True), "gtp_ctas8": dict(max_ctas=8)}


def gtp_pg_options(mode: str) -> object | None:
    """NCCL options for ``mode``'s GTP group, or None (the defaults)."""
    spec = GTP_PG_OPTIONS.get(mode)
    if spec is None:
        return None
    options = dist.ProcessGroupNCCL.Options(
        is_high_priority_stream=spec.get("is_high_priority_stream", False)
    )
    if "max_ctas" in spec:
        options.config.max_ctas = spec["max_ctas"]
    return options


# megatron's full activation recompute, one layer per checkpoint (``build(recompute=True)``).
FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)


def model_config(
    args: argparse.Namespace, device: str = "cuda", recompute: bool = False, bias: bool = False
) -> TransformerConfig:
    """The benchmark GPT's config: ``args.layers/hidden/heads`` (``args.ffn``, default 4 x
    hidden), bf16, local-spec friendly (no fusions), no dropout, linear biases if ``bias``. On
    ``device="cpu"`` the weights are initialized on the host (megatron's default initializes
    them on the GPU)."""
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=getattr(args, "ffn", None) or 4 * args.hidden,
        num_attention_heads=args.heads,
        use_cpu_initialization=device == "cpu",
        bf16=True,
        params_dtype=torch.bfloat16,
        add_bias_linear=bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        pipeline_dtype=torch.bfloat16,
        **(FULL_RECOMPUTE if recompute else {}),
    )


def make_optimizer(
    ddp: object, *, pg_collection: object = None, lr: float = 1e-4, fused: bool = False
) -> object:
    """The benchmarks' optimizer: megatron's distributed Adam (bf16, weight decay 0.01, clip 1),
    over ``pg_collection`` when given; ``fused``: torch's fused AdamW / foreach norm kernels
    (``bench.common.install_torch_kernels``) so every mode runs the same optimizer kernels."""
    groups = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=0.01,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [ddp],
        use_gloo_process_groups=False,
        **groups,
    )
    if fused:
        install_torch_kernels()
        fuse_adam(optimizer)
    return optimizer


def seed_model_parallel(device: str, seed: int = 1234) -> None:
    """megatron's model-parallel RNG seeding on ``device`` (the CPU variant needs cpu_compat)."""
    if device == "cuda":
        model_parallel_cuda_manual_seed(seed)
    else:
        from nemo_gtp.cpu.compat import model_parallel_cpu_manual_seed

        model_parallel_cpu_manual_seed(seed)


def build(
    args: argparse.Namespace, mode: str, world: int, device: str = "cuda", recompute: bool = False
):
    """Model, optimizer and a train-step closure for ``mode``.

    ``device="cpu"`` (gloo, after ``nemo_gtp.cpu.compat.enable_cpu_compat``) is for the
    CPU smoke runs of ``bench_max_model.py``; ``recompute`` turns on megatron's full activation
    recompute (:data:`FULL_RECOMPUTE`).
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    gtp = world if mode.startswith("gtp") else 1
    groups = initialize_gtp_parallel(
        GTPParallelDims(world_size=world, num_weight_shards=gtp),
        gtp_pg_options=gtp_pg_options(mode),
    )
    seed_model_parallel(device)
    torch.manual_seed(1234)
    config = model_config(args, device, recompute)
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, args.max_seq).to(device)
    runtime = None
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model.float()  # FSDP2 keeps fp32 sharded master params, computes in bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.decoder.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

        def step(batch: dict, marks: list | None = None) -> float:
            mark(marks)
            loss = forward_loss(model, batch)
            mark(marks)
            loss.backward()
            mark(marks)
            # megatron's optimizer clips at 1.0 in the ddp/gtp modes: same work here
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark(marks)
            return float(loss.detach())

        return model, optimizer, step, None
    model = Float16Module(config, model)  # bf16 everywhere, as NeMo's precision plugin does
    if mode.startswith("gtp"):
        runtime = shard_model(model, groups, GTP_MODES[mode])
    pgs = gtp_process_groups(groups, GTP_MODES.get(mode))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        grad_reduce_in_fp32=True,
    )
    ddp = GTPDistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
    optimizer = make_optimizer(
        ddp, pg_collection=pgs, fused=args.optimizer_kernels == "torch_fused"
    )
    finalize = make_finalize_model_grads(groups)

    def step(batch: dict, marks: list | None = None) -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        mark(marks)
        loss = forward_loss(ddp, batch)
        mark(marks)
        loss.backward()
        mark(marks)
        finalize([ddp])
        optimizer.step()
        mark(marks)
        return float(loss.detach())

    return ddp, optimizer, step, runtime


def mark(marks: list | None) -> None:
    """Record a CUDA event at a phase boundary (forward | backward | finalize+optimizer)."""
    if marks is not None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)


PHASES = ("forward", "backward", "optimizer")


def forward_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")  # None on GPUs: megatron builds the causal mask
    out = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    return out.float().mean()


def make_batch(args: argparse.Namespace, mbs: int, seq: int, device: str = "cuda") -> dict:
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab, (mbs, seq + 1), device=device, generator=gen)
    batch = dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(seq, device=device).expand(mbs, seq),
    )
    if device != "cuda":  # megatron's default causal mask is built on the GPU
        ones = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device)
        batch["attention_mask"] = torch.triu(ones, diagonal=1)
    return batch


def state_bytes(model: torch.nn.Module, optimizer: object) -> int:
    """Weight + grad + optimizer-state bytes held by this rank."""
    seen, total = set(), 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not torch.is_tensor(t):
            return
        t = getattr(t, "_local_tensor", t)
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key in seen:
            return
        seen.add(key)
        total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p.data)
        add(getattr(p, "main_grad", None))
        add(p.grad)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in getattr(inner, "state", {}).values():
            for value in state.values():
                add(value)
        # megatron's fp32 master copies (mixed precision: distributed and non-distributed)
        for name in (
            "shard_fp32_from_float16_groups",
            "fp32_from_float16_groups",
            "shard_fp32_groups",
        ):
            for group in getattr(opt, name, None) or []:
                for p in group:
                    add(p)
    return total


def replicated_bytes(model: torch.nn.Module, shards: int) -> int:
    """Weight+grad+optimizer bytes of plain replicated training (bf16 W, fp32 grad, fp32 master
    and Adam moments: 18 B/param) for the *logical* model this rank's shards belong to."""
    numel = 0
    for p in model.parameters():
        spec = getattr(p, "gtp_spec", None)
        if spec is not None:
            numel += math.prod(spec.logical_shape)
        else:
            numel += p.numel() * shards
    return 18 * numel


def gtp_shard_share(model: torch.nn.Module) -> float | None:
    """Elements this rank holds of the GTP-sharded weights / their logical elements.

    The memory invariant: 1/GTP within 5 % (padding). The weights' main_grad and
    optimizer state are shard-shaped, so they follow the same share.
    """
    held = logical = 0
    for p in model.parameters():
        spec = getattr(p, "gtp_spec", None)
        if spec is not None:
            held += p.numel()
            logical += math.prod(spec.logical_shape)
    return held / logical if logical else None


def profile(args: argparse.Namespace, mode: str, step, batch: dict) -> None:  # noqa: ANN001
    """Kernel-time table of a few steps (explains where a step's time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(batch)
        torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)
    nccl = sum(e.device_time_total for e in events if "nccl" in e.key.lower())
    gemm = sum(
        e.device_time_total
        for e in events
        if any(k in e.key.lower() for k in ("gemm", "nvjet", "sm90", "cutlass"))
    )
    with open(os.path.join(args.out, f"profile_{mode}_{args.profile_shape}.txt"), "w") as f:
        f.write(f"mode={mode} shape={args.profile_shape} steps=3\n")
        f.write(
            f"kernel time ms per step: total {total / 3e3:.1f}, gemm {gemm / 3e3:.1f}, "
            f"nccl {nccl / 3e3:.1f}, other {(total - gemm - nccl) / 3e3:.1f}\n\n"
        )
        f.write(events.table(sort_by="device_time_total", row_limit=30))


EXPOSED_STEPS = 5


def host_profile(args: argparse.Namespace, mode: str, step, batch: dict) -> None:  # noqa: ANN001
    """Where the host's time goes (cProfile, 5 steps): small shapes are launch-bound."""
    import cProfile

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    for _ in range(5):
        step(batch)
    host = time.perf_counter() - start
    prof.disable()
    torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return
    write_host_profile(
        os.path.join(args.out, f"host_profile_{mode}_{args.profile_shape}.txt"),
        f"mode={mode} shape={args.profile_shape}: 5 steps, host {1000 * host / 5:.1f} ms/step "
        "under cProfile",
        prof,
    )


def write_per_weight_exposed(
    args: argparse.Namespace, mode: str, shape: str, per_weight: dict[tuple[str, str], float]
) -> None:
    """The per-layer exposed-communication profile: ms per step each weight's gather / RS kept
    the compute stream waiting, in model order (rank 0, appended to ``exposed_<mode>.txt``)."""
    if dist.get_rank() != 0 or not per_weight:
        return
    names = list(dict.fromkeys(name for _, name in per_weight))
    lines = [
        f"\n## mode={mode} shape={shape}: exposed ms per step ({EXPOSED_STEPS} steps), "
        "weight | gather | reduce-scatter"
    ]
    for name in names:
        ag = 1000 * per_weight.get(("gather", name), 0.0) / EXPOSED_STEPS
        rs = 1000 * per_weight.get(("reduce_scatter", name), 0.0) / EXPOSED_STEPS
        lines.append(f"{name} | {ag:.3f} | {rs:.3f}")
    with open(os.path.join(args.out, f"exposed_{mode}.txt"), "a") as f:
        f.write("\n".join(lines) + "\n")


def run_mode(args: argparse.Namespace, mode: str, world: int, shapes: list[tuple[int, int]]):
    if args.memory_trace:
        from bench.common import start_recording

        start_recording()
    model, optimizer, step, runtime = build(args, mode, world)
    built_gib = torch.cuda.memory_allocated() / 2**30
    records = []
    for mbs, seq in shapes:
        batch = make_batch(args, mbs, seq)
        if runtime is not None and runtime.config.gather_backend == "auto":
            runtime.reset_gather_backend()  # a real run has one shape: decide for this one
        torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(args.warmup):
                step(batch)
        except torch.cuda.OutOfMemoryError:
            records.append(dict(mode=mode, mbs=mbs, seq=seq, tokens_per_gpu=mbs * seq, oom=True))
            torch.cuda.empty_cache()
            continue
        times, phases = [], {name: [] for name in PHASES}
        for _ in range(args.steps):
            marks: list = []
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(batch, marks)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            for name, a, b in zip(PHASES, marks, marks[1:]):
                phases[name].append(a.elapsed_time(b))
        exposed = {}
        if runtime is not None:  # separate steps: the stall timer's events cost host time
            runtime.wait_timer.enable(per_weight=True)
            runtime.wait_timer.collect()
            runtime.wait_timer.take_per_weight()
            for _ in range(EXPOSED_STEPS):
                step(batch)
            exposed = runtime.wait_timer.collect()
            write_per_weight_exposed(
                args, mode, f"{mbs}x{seq}", runtime.wait_timer.take_per_weight()
            )
            runtime.wait_timer.enable(False)
        median = statistics.median(times)
        if args.profile and f"{mbs}x{seq}" == args.profile_shape:
            profile(args, mode, step, batch)
        if args.host_profile and f"{mbs}x{seq}" == args.profile_shape:
            host_profile(args, mode, step, batch)
        records.append(
            dict(
                mode=mode,
                mbs=mbs,
                seq=seq,
                tokens_per_gpu=mbs * seq,
                step_ms=1000 * median,
                tokens_per_s=world * mbs * seq / median,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                exposed_gather_ms=1000 * exposed.get("gather", 0.0) / EXPOSED_STEPS
                if runtime
                else None,
                exposed_rs_ms=1000 * exposed.get("reduce_scatter", 0.0) / EXPOSED_STEPS
                if runtime
                else None,
                state_gib=state_bytes(model, optimizer) / 2**30,
                replicated_state_gib=replicated_bytes(model, 1) / 2**30,
                gtp_shard_share=gtp_shard_share(model),
                built_gib=built_gib,
                gather_backend=runtime.gather_backend.value if runtime is not None else None,
                device_used_gib=(lambda fr, tot: (tot - fr) / 2**30)(*torch.cuda.mem_get_info()),
                reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                **{f"{name}_ms": statistics.median(v) for name, v in phases.items()},
            )
        )
        if dist.get_rank() == 0:
            print(json.dumps(records[-1]), flush=True)
    if args.memory_trace:
        from bench.common import stop_and_report

        text = stop_and_report()
        if dist.get_rank() == 0:
            with open(os.path.join(args.out, f"memory_peak_{mode}.txt"), "w") as f:
                f.write(f"mode={mode} shapes={args.shapes}\n{text}\n")
            print(text, flush=True)
    del model, optimizer, step, runtime
    gc.collect()
    torch.cuda.empty_cache()
    return records


def write_report(args: argparse.Namespace, records: list[dict], world: int) -> None:
    with open(os.path.join(args.out, "bench_gpt.json"), "w") as f:
        json.dump(
            dict(
                args=vars(args),
                world=world,
                device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                records=records,
            ),
            f,
            indent=1,
        )
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records if not r.get("oom")}
    tokens = sorted({r["tokens_per_gpu"] for r in records})
    lines = [
        f"GPT {args.layers}L h{args.hidden} ffn{4 * args.hidden} heads{args.heads} vocab "
        f"{args.vocab}, bf16, {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"optimizer kernels: {args.optimizer_kernels}",
        "",
        "step = median of the steps; fwd / bwd / opt = medians of the phases (CUDA events: "
        "forward, backward, finalize + optimizer step). peak = torch allocator peak; device = "
        "GPU memory in use at the end (allocator cache, NCCL, symmetric memory). state = "
        "weight+grad+optimizer bytes per rank; 'vs repl.' divides by plain replicated training "
        "(18 B/param).",
        "",
        "| tokens/GPU | mode | gather | step ms | vs DDP | vs FSDP2 | fwd / bwd / opt ms | "
        "tokens/s | peak GiB | device GiB | state GiB (vs repl.) | exposed AG / RS ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tokens:
        base, fsdp = by.get(("ddp", t)), by.get(("fsdp2", t))
        for mode in ("ddp", "fsdp2", *GTP_MODES):
            r = by.get((mode, t))
            if r is None:
                continue
            ratio = r["step_ms"] / base["step_ms"] if base else float("nan")
            vs_fsdp = r["step_ms"] / fsdp["step_ms"] if fsdp else float("nan")
            exposed = (
                "—"
                if r["exposed_gather_ms"] is None
                else (f"{r['exposed_gather_ms']:.2f} / {r['exposed_rs_ms']:.2f}")
            )
            lines.append(
                f"| {t} | {mode} | {r.get('gather_backend') or '—'} | {r['step_ms']:.1f} | "
                f"{ratio:.3f} | {vs_fsdp:.3f} | {r['forward_ms']:.1f} / {r['backward_ms']:.1f} / "
                f"{r['optimizer_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
                f"{r['device_used_gib']:.1f} | {r['state_gib']:.2f} "
                f"({r['state_gib'] / r['replicated_state_gib']:.3f}) | {exposed} |"
            )
    shares = {r["gtp_shard_share"] for r in records if r.get("gtp_shard_share")}
    for share in sorted(shares):
        ok = abs(share * world - 1.0) <= 0.05
        lines.append(
            f"\nGTP-sharded weights held per rank: {share:.4f} of the logical elements "
            f"(1/GTP = {1 / world:.4f}): {'OK' if ok else 'FAILED'} (±5 %)"
        )
    # The memory invariant over the whole model: weight + grad + optimizer bytes per rank
    # = 1/GTP of plain replicated training (±5 %).
    for mode in GTP_MODES:
        r = next((r for r in records if r["mode"] == mode and not r.get("oom")), None)
        if r is not None:
            share = r["state_gib"] / r["replicated_state_gib"] * world
            lines.append(
                f"\n{mode}: weight+grad+optimizer per rank {r['state_gib']:.2f} GiB = "
                f"{share:.3f} x (replicated / GTP): "
                f"{'OK' if share <= 1.05 else 'FAILED'} (<= 1/GTP + 5 %)"
            )
    with open(os.path.join(args.out, "bench_gpt.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        from bench.common import plot_ratio

        plot_ratio(
            os.path.join(args.out, "bench_gpt.json"), os.path.join(args.out, "bench_gpt_ratio.png")
        )
    except ImportError:  # matplotlib absent on the GPU machine: plot later from the JSON
        pass
    except ValueError as err:  # e.g. no ddp baseline among the modes: nothing to plot
        print(f"[bench] no plot: {err}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--max-seq", type=int, default=2048)
    parser.add_argument("--shapes", default="1x1024,1x2048,2x2048,4x2048,8x2048")
    parser.add_argument("--modes", default="ddp,fsdp2,gtp,gtp_ce,gtp_auto")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-shape", default="4x2048")
    parser.add_argument(
        "--optimizer-kernels",
        choices=("torch_fused", "megatron"),
        default="torch_fused",
        help="megatron modes: torch fused AdamW + foreach norms like FSDP2 "
        "(torch_fused) or megatron's no-TE/no-apex fallbacks",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile 5 steps at --profile-shape (host overhead)",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="write what is live at each mode's allocation peak",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # every report below writes into it
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    records = []
    for mode in args.modes.split(","):
        records += run_mode(args, mode, world, shapes)
    if dist.get_rank() == 0:
        write_report(args, records, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

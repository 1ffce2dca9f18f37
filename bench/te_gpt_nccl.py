"""TransformerEngine layer spec under GTP on GPUs: GTP2 vs DP2, and the local spec alike.

Question: Does the TransformerEngine layer spec under GTP (pre-sharded TE linears, the
``DistributedWeight`` protocol) track DP2 at the megatron level, at what step time?

Ranks: NCCL, one rank per GPU (``torchrun``); without CUDA the local modes run on gloo (a
smoke test of the plumbing).

    torchrun --nproc-per-node 2 -m bench.te_gpt_nccl --out te_out

megatron-core's GPTModel with ``get_gpt_layer_with_transformer_engine_spec()`` (bf16,
Float16Module, GTP-aware megatron DDP, distributed Adam, ``forward_backward_no_pipelining``),
trained from the same initial weights on the same global batches:

- ``te_dp2``: the stock TE spec, TP1·DP2 (the reference).
- ``te_gtp2``: the spec through ``gtp_layer_spec`` (linears built as shards), TP1·GTP2.
- ``te_gtp2_unfused``: as ``te_gtp2`` without fused wgrad accumulation (TE hands
  ``finalize_group_grads`` a bf16 wgrad instead of writing into ``grad_buffer()``).
- ``te_gtp2_sliced``: the stock TE spec built full, sliced by ``shard_model``.
- ``local_dp2`` / ``local_gtp2``: the megatron-local spec, as the project's GPU results so far.
- ``te_bias_dp2`` / ``te_bias_gtp2``: the TE pair with ``add_bias_linear=True`` (few steps).

TE runs use TE's fused wgrad accumulation (``fuse_wgrad_accumulation``, which megatron sets from
``gradient_accumulation_fusion``) except ``te_gtp2_unfused``. megatron's local output layer
refuses ``gradient_accumulation_fusion`` without apex, so it is switched on per TE module after
the build. Equal initial weights: every run loads a reference full init of its spec (GTP shards
take their slice), which is a benchmark device only; the pre-sharded build itself never holds a
full weight. Writes ``te_gpt_nccl.json`` (per-step losses, grad norms, timings, exposed
communication, checks) and prints a summary.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import os
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from bench.bench_gpt import (  # the same benchmark GPT
    make_optimizer,
    model_config,
    seed_model_parallel,
)
from bench.common import write_host_profile
from nemo_gtp.engine import GTPConfig, GTPShardedParam, is_gtp_param
from nemo_gtp.integrations.megatron import (
    GTPDistributedDataParallel,
    GTPShardPlan,
    gtp_layer_spec,
    gtp_process_groups,
    make_finalize_model_grads,
    shard_model,
)
from tests.harness.gpt import Run, gtp_groups, load_full_weights

# mode -> (spec, gtp, pre-sharded, fused wgrad, bias)
MODES = {
    "te_dp2": ("te", 1, False, True, False),
    "te_gtp2": ("te", 2, True, True, False),
    "te_gtp2_unfused": ("te", 2, True, False, False),
    "te_gtp2_sliced": ("te", 2, False, True, False),
    "local_dp2": ("local", 1, False, False, False),
    "local_gtp2": ("local", 2, False, False, False),
    "te_bias_dp2": ("te", 1, False, True, True),
    "te_bias_gtp2": ("te", 2, True, True, True),
}
PAIRS = [
    ("te_gtp2", "te_dp2"),
    ("te_gtp2_unfused", "te_dp2"),
    ("te_gtp2_sliced", "te_dp2"),
    ("local_gtp2", "local_dp2"),
    ("te_bias_gtp2", "te_bias_dp2"),
]
EXPOSED_STEPS = 5  # the last steps of each mode, timed for exposed communication only
CALLS = {"grad_buffer": 0, "finalize_group_grads": 0}
# CUDA + NCCL on the GPU machine; CPU + gloo (local modes only) to smoke-test the script.
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def _peak(reset: bool = False) -> int:
    if not CUDA:
        return 0
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def _count(name: str) -> None:
    original = getattr(GTPShardedParam, name)

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        CALLS[name] += 1
        return original(self, *args, **kwargs)

    setattr(GTPShardedParam, name, counted)


def layer_spec(kind: str):  # noqa: ANN201
    return (
        get_gpt_layer_with_transformer_engine_spec()
        if kind == "te"
        else (get_gpt_layer_local_spec())
    )


_REFERENCE: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}


def reference_weights(args: argparse.Namespace, kind: str, bias: bool) -> dict:
    """The full init every run of ``(kind, bias)`` starts from (stock spec, fixed seeds)."""
    if (kind, bias) not in _REFERENCE:
        seed_model_parallel(DEVICE, 1234)
        torch.manual_seed(1234)
        model = GPTModel(model_config(args, bias=bias), layer_spec(kind), args.vocab, args.seq)
        model = model.to(DEVICE)
        _REFERENCE[(kind, bias)] = {n: p.detach().clone() for n, p in model.named_parameters()}
        del model
    return _REFERENCE[(kind, bias)]


def batch(args: argparse.Namespace, step: int, microbatch: int, data_rank: int) -> dict:
    """Learnable synthetic sequences: ``start + stride * i (mod vocab)``."""
    gen = torch.Generator().manual_seed(100_000 * step + 100 * microbatch + data_rank)
    start = torch.randint(0, args.vocab, (args.mbs, 1), generator=gen)
    stride = torch.randint(1, 16, (args.mbs, 1), generator=gen)
    tokens = ((start + stride * torch.arange(args.seq + 1)) % args.vocab).to(DEVICE)
    # causal mask: implied on CUDA (TE's causal attention; megatron's default mask is on "cuda")
    mask = None if CUDA else torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1)
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(args.seq, device=DEVICE).expand(args.mbs, args.seq),
        attention_mask=mask,
    )


def wrap_for_training(
    config: object,
    model: torch.nn.Module,
    groups: object,
    lr: float,
    bucket_size: int | None = None,
) -> tuple[object, object]:
    """GTP-aware megatron DDP (distributed optimizer, overlapped fp32 grad reduce; megatron's
    bucket size unless ``bucket_size``) and the benchmarks' distributed Adam around ``model``,
    with the GTP finalize installed on ``config``: ``(ddp, optimizer)``."""
    pgs = gtp_process_groups(groups)
    ddp = GTPDistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            grad_reduce_in_fp32=True,
            bucket_size=bucket_size,
        ),
        model,
        pg_collection=pgs,
    )
    optimizer = make_optimizer(ddp, pg_collection=pgs, lr=lr)
    config.finalize_model_grads_func = make_finalize_model_grads(groups)
    config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def forward_backward_step(
    args: argparse.Namespace,
    ddp: object,
    optimizer: object,
    forward_backward: object,
    step: int,
    data_rank: int,
) -> list:
    """Zero the grads and run one step's micro-batches of this data rank forward and backward
    (megatron's schedule); the reduced losses. The caller runs ``optimizer.step()``.

    ``args.microbatch_split`` (default 1): run each micro-batch as that many equal parts, the
    same samples and the same loss in a different summation order (a noise-floor twin)."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    split = getattr(args, "microbatch_split", 1)
    data = [batch(args, step, m, data_rank) for m in range(args.microbatches)]
    if split > 1:
        data = [
            {
                k: v if v is None or v.shape[0] != args.mbs else v.chunk(split)[i]
                for k, v in b.items()
            }
            for b in data
            for i in range(split)
        ]
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=[ddp],
        num_microbatches=args.microbatches * split,
        seq_length=args.seq,
        micro_batch_size=args.mbs // split,
        forward_only=False,
    )


def forward_step(data_iterator, model):  # noqa: ANN001, ANN201
    data = next(data_iterator)
    out = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])

    def loss_func(output: torch.Tensor):  # noqa: ANN202
        loss_sum = output.float().sum()
        tokens = torch.tensor(output.numel(), device=output.device, dtype=torch.int)
        # clone: megatron divides the returned loss in place (by tokens and microbatches)
        return loss_sum, tokens, {"lm loss": loss_sum.detach().clone()}

    return out, loss_func


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    kind, gtp, presharded, fused, bias = MODES[mode]
    steps = args.bias_steps if bias else args.steps
    groups = gtp_groups(Run(gtp=gtp))
    config = model_config(args, bias=bias)
    reference = reference_weights(args, kind, bias)
    gtp_config = GTPConfig()
    spec = layer_spec(kind)
    if presharded:
        spec = gtp_layer_spec(spec, groups, gtp_config)
    _sync()
    base_mem = _allocated()
    _peak(reset=True)
    seed_model_parallel(DEVICE, 4321)
    model = GPTModel(config, spec, args.vocab, args.seq).to(DEVICE)
    build_peak_gib = (_peak() - base_mem) / 2**30
    load_full_weights(model, reference)
    model = Float16Module(config, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = shard_model(model, groups, gtp_config) if gtp > 1 else None
    shard_warnings = [
        str(w.message) for w in caught if "GTP" in str(w.message) or "shard_model" in str(w.message)
    ]
    if fused:
        for module in model.modules():
            if hasattr(module, "fuse_wgrad_accumulation"):
                module.fuse_wgrad_accumulation = True
    ddp, optimizer = wrap_for_training(config, model, groups, args.lr)
    data_rank = parallel_state.get_data_parallel_rank()
    forward_backward = get_forward_backward_func()
    losses, grad_norms, times, exposed, dummy_grads = [], [], [], {}, 0
    # too short a run (the bias modes' correctness check): no exposed-wait steps
    exposed_from = steps - EXPOSED_STEPS if steps - EXPOSED_STEPS > args.timing_from else steps
    CALLS.update(grad_buffer=0, finalize_group_grads=0)
    _peak(reset=True)
    profiled = range(args.timing_from, args.timing_from + 5) if args.host_profile else range(0)
    prof = cProfile.Profile()
    for step in range(steps):
        if args.host_profile and step == profiled.start:
            prof.enable()
        if args.host_profile and step == profiled.stop:
            prof.disable()
            _write_host_profile(args, mode, prof, len(profiled))
        if step == args.timing_from and runtime is not None:
            runtime.stats.reset()
        if step == exposed_from and runtime is not None:
            # the last EXPOSED_STEPS steps: the stall timer's events cost host time, which a
            # host-bound step would show, so the timed steps run without it
            runtime.wait_timer.enable(per_weight=True)
            runtime.wait_timer.collect()
        _sync()
        start = time.perf_counter()
        reduced = forward_backward_step(args, ddp, optimizer, forward_backward, step, data_rank)
        dummy_grads += sum(p.grad is not None for p in model.parameters() if is_gtp_param(p))
        _, grad_norm, _ = optimizer.step()
        _sync()
        times.append(time.perf_counter() - start)
        if runtime is not None and step >= exposed_from:
            for k, v in runtime.wait_timer.collect().items():
                exposed[k] = exposed.get(k, 0.0) + v
        loss = torch.stack([r["lm loss"] for r in reduced]).sum()
        dist.all_reduce(loss)
        tokens = args.mbs * args.seq * args.microbatches * dist.get_world_size()
        losses.append(float(loss) / tokens)
        grad_norms.append(float(grad_norm))
    timed = max(steps - args.timing_from, 1)
    per_weight: dict[str, dict[str, float]] = {}
    if runtime is not None:
        for (kind, name), seconds in runtime.wait_timer.take_per_weight().items():
            per_weight.setdefault(kind, {})[name] = 1000 * seconds / EXPOSED_STEPS
        runtime.wait_timer.enable(False)
    record = dict(
        mode=mode,
        spec=kind,
        gtp=gtp,
        presharded=presharded,
        fused_wgrad=fused,
        bias=bias,
        steps=steps,
        losses=losses,
        grad_norms=grad_norms,
        step_ms_median=1000
        * statistics.median(times[max(args.timing_from, profiled.stop) : exposed_from] or times),
        peak_train_gib=_peak() / 2**30,
        build_peak_gib=build_peak_gib,
        gtp_params=0 if runtime is None else len(runtime.params),
        exposed_gather_ms_per_step=1000 * exposed.get("gather", 0.0) / EXPOSED_STEPS,
        exposed_rs_ms_per_step=1000 * exposed.get("reduce_scatter", 0.0) / EXPOSED_STEPS,
        exposed_ms_per_step_by_weight=per_weight,
        stats_per_step=None
        if runtime is None
        else {k: v / timed for k, v in vars(runtime.stats).items()},
        protocol_calls_per_step={k: v / steps for k, v in CALLS.items()},
        gtp_param_grads_left=dummy_grads,
        shard_warnings=shard_warnings,
        gtp_weight_types=sorted(
            {type(m).__name__ for m in model.modules() if is_gtp_param(m._parameters.get("weight"))}
        ),
    )
    del model, ddp, optimizer, runtime
    config.finalize_model_grads_func = None
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return record


def _write_host_profile(
    args: argparse.Namespace, mode: str, prof: cProfile.Profile, steps: int
) -> None:
    """cProfile of ``steps`` steps (rank 0): where a host-bound step's time goes."""
    if dist.get_rank() == 0:
        write_host_profile(
            os.path.join(args.out, f"host_profile_{mode}.txt"),
            f"mode={mode}: {steps} steps under cProfile",
            prof,
            (("tottime", 30), ("cumulative", 40)),
        )


def compare(a: dict, b: dict) -> dict:
    n = min(len(a["losses"]), len(b["losses"]))
    loss_rel = [abs(x - y) / abs(y) for x, y in zip(a["losses"][:n], b["losses"][:n])]
    gn_rel = [abs(x - y) / abs(y) for x, y in zip(a["grad_norms"][:n], b["grad_norms"][:n])]
    return dict(
        steps=n,
        max_loss_rel=max(loss_rel),
        step1_loss_rel=loss_rel[0],
        max_grad_norm_rel=max(gn_rel),
        step1_grad_norm_rel=gn_rel[0],
        first10_max_grad_norm_rel=max(gn_rel[:10]),
        final_loss=(a["losses"][n - 1], b["losses"][n - 1]),
    )


def checks(args: argparse.Namespace) -> dict:
    """The TE-only behaviours the CPU suite cannot reach."""
    import transformer_engine
    import transformer_engine.pytorch as te

    from nemo_gtp.integrations.megatron.sharding.spec import presharded_classes

    out: dict = {"te_version": transformer_engine.__version__}
    groups = gtp_groups(Run(gtp=2))
    classes = presharded_classes()
    out["presharded_classes"] = sorted(c.__name__ for c in classes.values())
    config = copy.copy(model_config(args, bias=False))
    config.delay_wgrad_compute = True  # megatron's own check allows it only with MoE overlap
    cls = next(c for b, c in classes.items() if b.__name__ == "TEColumnParallelLinear")
    try:
        cls(
            256,
            1024,
            gtp=GTPShardPlan.from_groups(groups),
            config=config,
            init_method=torch.nn.init.normal_,
            gather_output=False,
            bias=False,
            skip_bias_add=True,
            is_expert=False,
        )
        out["delay_wgrad_rejected"] = "NOT rejected"
    except ValueError as exc:
        out["delay_wgrad_rejected"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard_model(
            torch.nn.ModuleDict(
                {"ln_mlp": te.LayerNormMLP(256, 1024, params_dtype=torch.bfloat16)}
            ),
            groups,
        )
    out["layernorm_mlp_warnings"] = [
        str(w.message) for w in caught if "LayerNormMLP" in str(w.message)
    ]
    return out


def add_run_args(
    parser: argparse.ArgumentParser,
    *,
    layers: int,
    hidden: int,
    heads: int,
    steps: int,
    timing_from: int,
) -> None:
    """The model and training-run options :func:`wrap_for_training`,
    :func:`forward_backward_step` and ``bench_gpt.model_config`` read (``args.layers``, ...),
    with each script's own model size and run length."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--timing-from", type=int, default=timing_from)
    parser.add_argument("--lr", type=float, default=3e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_run_args(parser, layers=8, hidden=2048, heads=16, steps=50, timing_from=10)
    parser.add_argument("--bias-steps", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="te_out")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile 5 steps from --timing-from (excluded from the median)",
    )
    args = parser.parse_args()
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # CPU smoke test of the local modes
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat()
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    _count("grad_buffer")
    _count("finalize_group_grads")
    result: dict = dict(
        args=vars(args),
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        world=dist.get_world_size(),
        torch=torch.__version__,
        records={},
    )
    try:
        result["checks"] = checks(args) if CUDA else {}
    except Exception:  # noqa: BLE001 - report and go on with the training comparison
        result["checks"] = {"error": traceback.format_exc()}
    if rank == 0:
        print("[te-gtp] checks", json.dumps(result["checks"]), flush=True)
    for mode in args.modes.split(","):
        try:
            record = run_mode(args, mode)
        except Exception:  # noqa: BLE001
            record = {"mode": mode, "error": traceback.format_exc()}
        result["records"][mode] = record
        if rank == 0:
            print(
                f"[te-gtp] {mode}:",
                json.dumps({k: v for k, v in record.items() if k not in ("losses", "grad_norms")}),
                flush=True,
            )
            with open(os.path.join(args.out, "te_gpt_nccl.json"), "w") as f:
                json.dump(result, f, indent=1)
    result["comparisons"] = {}
    for a, b in PAIRS:
        ra, rb = result["records"].get(a, {}), result["records"].get(b, {})
        if "losses" in ra and "losses" in rb:
            result["comparisons"][f"{a} vs {b}"] = compare(ra, rb)
    if rank == 0:
        for name, c in result["comparisons"].items():
            print(f"[te-gtp] {name}: {json.dumps(c)}", flush=True)
        with open(os.path.join(args.out, "te_gpt_nccl.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

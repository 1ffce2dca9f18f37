"""Host cost of GTP per weight per step: a chain of tiny GTP linears vs the same chain without GTP.

Question: How many host microseconds does GTP add per weight per step?

Ranks: NCCL, one rank per GPU (``torchrun``); or, with ``--fake-world N``, rank 0 of a fake
process group of N ranks in one process (one GPU, or CPU), the world ``bench.host_fake`` measures
the NeMo step in, so the two per-weight figures compare like for like.

The GEMMs are tiny, so the GPU is never the bottleneck and a step's wall time is the host time
it takes to issue it. The difference between a GTP chain and a plain chain, divided by the
number of weights, is what GTP's Python and collective issue cost per weight per step (forward
gather + backward gather + wgrad reduce-scatter + finalize), the figure that decides whether a
small-token step becomes host-bound.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    torchrun --nproc-per-node 2 -m bench.host_cost --weights 64 --steps 200 --out host_cost.json
    python -m bench.host_cost --fake-world 2 --modes te_plain,te_gtp_co4 --weights 96 ...

Modes: ``plain`` (torch linears; megatron-style ``main_grad`` accumulation in a post-accumulate
hook), ``gtp`` (GTP over all ranks, process-group gather), ``gtp_coN`` (coalescing units of N
weights: one gather / reduce-scatter per N weights), ``gtp_ce`` (copy-engine gather),
``te_plain`` / ``te_gtp`` / ``te_gtp_coN`` (the same with TransformerEngine ``te.Linear`` s in
bf16, GTP through TE's DistributedWeight protocol; needs TE), ``collectives`` (only the three
collectives per weight, issued and waited through
:class:`~nemo_gtp.engine.collectives.GroupCollectives`: the floor any per-weight design pays).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime, shard_linear


def _chain(n: int, hidden: int, device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(n)]).to(
        device
    )


def _plain(n: int, hidden: int, device: torch.device) -> tuple[torch.nn.Module, None]:
    model = _chain(n, hidden, device)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)

        def accumulate(param: torch.Tensor) -> None:  # what megatron DDP's hook does
            param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(accumulate)
    return model, None


def _gtp(
    n: int, hidden: int, device: torch.device, backend: str, unit: int = 1
) -> tuple[torch.nn.Module, object]:
    model = _chain(n, hidden, device)
    groups = GTPParallelDims(
        world_size=dist.get_world_size(), num_weight_shards=dist.get_world_size()
    ).build()
    options = {"gather_backend": backend}
    if unit > 1:  # coalescing units of ``unit`` weights (fp32 hidden x hidden each)
        options["coalesce_mb"] = unit * hidden * hidden * 4 / 2**20
    try:
        runtime = GTPRuntime(groups, GTPConfig(**options))
    except (AttributeError, TypeError, ValueError):  # the engine before GTPRuntime took
        # GTPGroups: the same script measures it (bench/results)
        backend = "nccl" if backend == "process_group" else backend
        runtime = GTPRuntime(groups.gtp, GTPConfig(gather_backend=backend))
    for i, layer in enumerate(model):
        param = shard_linear(layer, runtime, f"{i}.weight")
        param.main_grad = torch.zeros_like(param)
        param.register_grad_accum_hook(lambda: None)  # DDP's grad-ready hook slot
    model.gtp_runtime = runtime
    return model, runtime


def _protocol_chain(
    layers: list[torch.nn.Module], gtp: bool, coalesce_mb: float | None = None
) -> tuple[torch.nn.Module, object]:
    """``layers`` (linears whose weight TE's protocol can drive) as one chain: plain (the wgrad
    goes to autograd; a megatron-style hook adds it into an fp32 ``main_grad``, as NeMo's
    recipes without ``gradient_accumulation_fusion``), or with GTP weights driven through TE's
    DistributedWeight protocol (wgrad written into GTP's scratch, ``adopt_te_linear``)."""
    from nemo_gtp.integrations.megatron.sharding.te import adopt_te_linear

    model = torch.nn.Sequential(*layers)
    if not gtp:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

            def accumulate(param: torch.Tensor) -> None:
                param.main_grad.add_(param.grad)
                param.grad = None

            p.register_post_accumulate_grad_hook(accumulate)
        return model, None
    groups = GTPParallelDims(
        world_size=dist.get_world_size(), num_weight_shards=dist.get_world_size()
    ).build()
    options: dict = {"gather_backend": "process_group"}
    if coalesce_mb is not None:
        options["coalesce_mb"] = coalesce_mb
    runtime = GTPRuntime(groups, GTPConfig(**options))
    for i, layer in enumerate(model):
        param = runtime.shard_parameter(layer, "weight", f"{i}.weight")
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.register_grad_accum_hook(lambda: None)
        adopt_te_linear(layer)
    model.gtp_runtime = runtime
    return model, runtime


def _te_chain(
    n: int, hidden: int, device: torch.device, gtp: bool, unit: int = 1
) -> tuple[torch.nn.Module, object]:
    """The chain of TransformerEngine ``te.Linear`` s (bf16), plain or GTP (``_protocol_chain``);
    ``unit`` > 1: coalescing units of that many weights."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layers = [
        te.Linear(hidden, hidden, bias=False, params_dtype=torch.bfloat16, device=device)
        for _ in range(n)
    ]
    return _protocol_chain(layers, gtp, unit * hidden * hidden * 2 / 2**20 if unit > 1 else None)


class _ProtocolLinearFn(torch.autograd.Function):
    """TE ``Linear``'s calls on a weight, without TE (``proto_*`` modes; CPU too): the
    DistributedWeight protocol in TE 2.20's order for a GTP weight (materialize for the forward;
    in the backward ``grad_buffer()``, materialize for the dgrad, wgrad into the buffer,
    ``finalize_group_grads``), the plain GEMMs and an autograd wgrad otherwise."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.distributed = getattr(weight, "is_distributed_weight", False)
        full = weight.materialize_group_for_forward()[0] if ctx.distributed else weight
        ctx.save_for_backward(x)
        ctx.weight = weight
        return x @ full.t()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        if not ctx.distributed:
            return grad @ weight, grad.t() @ x
        buffer = weight.grad_buffer()
        full = weight.materialize_group_for_backward()[0]
        dgrad = grad @ full
        torch.mm(grad.t(), x, out=buffer)
        weight.finalize_group_grads(buffer)  # TE hands a group of one its wgrad alone
        return dgrad, None


class _ProtocolLinear(torch.nn.Module):
    """A bias-free linear whose GEMMs go through :class:`_ProtocolLinearFn`."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden, hidden, device=device))
        torch.nn.init.normal_(self.weight, std=hidden**-0.5)
        self.fuse_wgrad_accumulation = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ProtocolLinearFn.apply(x, self.weight)


def _proto_chain(
    n: int, hidden: int, device: torch.device, gtp: bool
) -> tuple[torch.nn.Module, object]:
    """``proto_plain`` / ``proto_gtp``: the protocol path of the NeMo TE recipes (GTP weights
    adopted as TE linears are, default coalescing units) on any device, TE not needed."""
    torch.manual_seed(0)
    return _protocol_chain([_ProtocolLinear(hidden, device) for _ in range(n)], gtp)


STACK_DEPTH = 0  # extra Python frames around each step (NeMo's call depth is ~60-100)


def _sync() -> None:
    """Wait for the device (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(model: torch.nn.Module, runtime: object, x: torch.Tensor, depth: int = -1) -> None:
    if depth < 0:
        depth = STACK_DEPTH
    if depth > 0:  # what a deep framework stack costs per collective (the flight recorder)
        _step(model, runtime, x, depth - 1)
        return
    model(x).sum().backward()
    if runtime is not None:
        runtime.drain()


def _collectives_only(
    n: int, hidden: int, device: torch.device, steps: int, warmup: int
) -> tuple[float, float]:
    from nemo_gtp.engine.collectives import GroupCollectives

    ops = GroupCollectives(dist.group.WORLD)
    size = dist.get_world_size()
    shard = torch.randn(hidden // size, hidden, device=device)
    full = torch.empty(hidden, hidden, device=device)
    out = torch.empty_like(shard)

    def one() -> None:
        for _ in range(n):  # forward gather, backward gather, reduce-scatter; each waited
            ops.all_gather(full, shard).wait()
            ops.all_gather(full, shard).wait()
            ops.reduce_scatter(out, full, average=True).wait()
            shard.add_(out, alpha=0.0)

    for _ in range(warmup):
        one()
    _sync()
    issue, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        one()
        issue.append(time.perf_counter() - start)
        _sync()
        wall.append(time.perf_counter() - start)
    return statistics.median(issue), statistics.median(wall)


def _time(
    model: torch.nn.Module, runtime: object, x: torch.Tensor, steps: int, warmup: int
) -> tuple[float, float]:
    """(host seconds to issue one step, wall seconds of one step), medians.

    Each step starts on an idle GPU (synchronized before) and is timed until its last launch
    returns, so the host never blocks on a full launch queue or on the GPU: the issue time is
    pure host work, whatever the tiny NCCL kernels' latency is.
    """
    for _ in range(warmup):
        _step(model, runtime, x)
    _sync()
    dist.barrier()
    issue, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        _step(model, runtime, x)
        issue.append(time.perf_counter() - start)
        _sync()
        wall.append(time.perf_counter() - start)
    return statistics.median(issue), statistics.median(wall)


def _profile(model: torch.nn.Module, runtime: object, x: torch.Tensor, steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        _step(model, runtime, x)
    _sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _api_profile(model: torch.nn.Module, runtime: object, x: torch.Tensor, steps: int) -> str:
    """``torch.profiler`` CPU-side table of ``steps`` steps: time per op and per CUDA runtime /
    driver call (stream waits, event records, launches), which cProfile cannot see."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(steps):
            _step(model, runtime, x)
        _sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def _init_world(fake_world: int) -> torch.device:
    """NCCL under torchrun (one rank per GPU), or rank 0 of a fake world of ``fake_world``
    ranks (collectives return at once and move nothing, though torch's fake backend copies
    each all-gather input into its output): the device this rank runs on."""
    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return torch.device("cuda", local_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--modes", default="plain,gtp,gtp_ce,collectives")
    parser.add_argument(
        "--stack-depth",
        type=int,
        default=0,
        help="run each step under this many extra Python frames",
    )
    parser.add_argument(
        "--fake-world",
        type=int,
        default=0,
        help="run as rank 0 of a fake world of this many ranks in this one process (torch's fake "
        "backend, as bench.host_fake: one GPU, or CPU without one) instead of under torchrun",
    )
    parser.add_argument("--profile", help="write a cProfile report of each GTP mode here (dir)")
    parser.add_argument("--out", help="JSON results (rank 0)")
    args = parser.parse_args()
    global STACK_DEPTH
    STACK_DEPTH = args.stack_depth
    device = _init_world(args.fake_world)
    x32 = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)
    x16 = x32.detach().to(torch.bfloat16).requires_grad_()  # TE chains run in bf16
    seconds: dict[str, float] = {}
    walls: dict[str, float] = {}
    for mode in args.modes.split(","):
        if mode == "collectives":
            seconds[mode], walls[mode] = _collectives_only(
                args.weights, args.hidden, device, args.steps, args.warmup
            )
            continue
        x = x16 if mode.startswith("te_") else x32
        if mode == "plain":
            model, runtime = _plain(args.weights, args.hidden, device)
        elif mode.startswith("proto_"):  # proto_plain, proto_gtp
            model, runtime = _proto_chain(args.weights, args.hidden, device, mode == "proto_gtp")
        elif mode.startswith("te_"):  # te_plain, te_gtp, te_gtp_coN
            unit = int(mode[len("te_gtp_co") :]) if mode.startswith("te_gtp_co") else 1
            model, runtime = _te_chain(args.weights, args.hidden, device, mode != "te_plain", unit)
        else:
            backend = "copy_engine" if mode == "gtp_ce" else "process_group"
            unit = int(mode[len("gtp_co") :]) if mode.startswith("gtp_co") else 1
            model, runtime = _gtp(args.weights, args.hidden, device, backend, unit)
        seconds[mode], walls[mode] = _time(model, runtime, x, args.steps, args.warmup)
        if args.profile:  # every rank runs the same steps (the peers' collectives match)
            text = _profile(model, runtime, x, 20) + "\n" + _api_profile(model, runtime, x, 20)
            if dist.get_rank() == 0:
                os.makedirs(args.profile, exist_ok=True)
                with open(os.path.join(args.profile, f"host_cost_{mode}.txt"), "w") as f:
                    f.write(text)
        del model, runtime
    if dist.get_rank() == 0:
        n = args.weights
        result = {
            "weights": n,
            "hidden": args.hidden,
            "tokens": args.tokens,
            "stack_depth": args.stack_depth,
            "ranks": (
                f"fake process group, {'one GPU' if device.type == 'cuda' else 'CPU'}"
                if args.fake_world
                else f"NCCL, {dist.get_world_size()} GPUs"
            ),
            "flight_recorder_env": {
                k: os.environ.get(k)
                for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
            },
            "note": "host issue time per step (GPU idle at step start), per weight below",
            "host_issue_us_per_step": {m: round(s * 1e6, 1) for m, s in seconds.items()},
            "wall_us_per_step": {m: round(s * 1e6, 1) for m, s in walls.items()},
            "us_per_weight": {m: round(s * 1e6 / n, 2) for m, s in seconds.items()},
        }
        for base, prefix in (
            ("plain", "gtp"),
            ("te_plain", "te_gtp"),
            ("proto_plain", "proto_gtp"),
        ):
            if base in seconds:
                result.setdefault("gtp_extra_us_per_weight", {}).update(
                    {
                        m: round((s - seconds[base]) * 1e6 / n, 2)
                        for m, s in seconds.items()
                        if m.startswith(prefix)
                    }
                )
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

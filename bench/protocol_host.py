"""Host µs per weight per step of GTP's DistributedWeight protocol path alone (no TE, no GEMMs).

Rank 0 of a 2-rank world on torch's fake process-group backend drives a chain of N GTP weights
exactly as TransformerEngine's linears call the protocol: forward consumes in order, then
backward consumes, ``grad_buffer()`` and ``finalize_group_grads`` in reverse, then the drain.
Runs on CPU or one GPU; comparing the two separates GTP's Python from its CUDA calls.

    python bench/protocol_host.py --device cuda --weights 96 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--unit", type=int, default=8, help="weights per coalescing unit")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key of --profile")
    parser.add_argument("--top", type=int, default=22, help="rows --profile prints")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime

    device = torch.device(args.device)
    groups = GTPParallelDims(world_size=2, num_weight_shards=2).build()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    unit_mb = args.unit * args.hidden * args.hidden * dtype.itemsize / 2**20
    runtime = GTPRuntime(groups, GTPConfig(gather_backend="process_group", coalesce_mb=unit_mb))
    params = []
    for i in range(args.weights):
        layer = torch.nn.Linear(args.hidden, args.hidden, bias=False, device=device, dtype=dtype)
        param = runtime.shard_parameter(layer, "weight", f"{i}.weight")
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=device)
        param.register_grad_accum_hook(lambda: None)
        param.gtp_state.forward_grad_enabled = True  # what TE's forward pre-hook records
        params.append(param)

    def step() -> None:
        with torch.no_grad():  # TE's autograd forward / backward run without grad
            for param in params:
                if getattr(param, "is_distributed_weight", False):
                    param.materialize_group_for_forward()
            for param in reversed(params):
                if getattr(param, "is_distributed_weight", False):
                    param.materialize_group_for_backward()
                    param.finalize_group_grads(param.grad_buffer())
        runtime.drain()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        sync()
    record = {
        "device": args.device,
        "weights": args.weights,
        "unit": args.unit,
        "us_per_weight_per_step": round(statistics.median(times) / args.weights * 1e6, 2),
        "min_us_per_weight_per_step": round(min(times) / args.weights * 1e6, 2),
        "gather_collectives_per_step": runtime.stats.gather_collectives // (args.steps + 5),
    }
    print(json.dumps(record), flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(10):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()

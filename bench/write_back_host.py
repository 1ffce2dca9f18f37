"""Host µs per weight of the FP8 primary write-back (``write_back_fp8_primary``, design §1.3).

Rank 0 of a 2-rank world on torch's fake process-group backend (collectives return at once)
holds N GTP2 FP8 primary shards of small weights, so the write-back's own host work (its Python
and kernel launches, not its kernels' time) is what a step pays: the optimizer's write-back of
megatron's ``quantize_param_shard``, once per step. Per recipe: median µs per weight per
write-back over ``--steps`` calls after two warm-up calls, the device synchronized around each.

    python bench/write_back_host.py --device cuda --weights 96
    python bench/write_back_host.py --device cpu --weights 96 --recipes blockwise
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def measure(recipe: str, weights: int, steps: int, device: str) -> dict:
    """Median host µs per weight per write-back for ``weights`` FP8 primary shards."""
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime
    from nemo_gtp.engine.fp8 import FP8Scaling
    from nemo_gtp.engine.fp8_primary import (
        fp8_primary_init_value,
        make_fp8_primary,
        write_back_fp8_primary,
    )

    groups = GTPParallelDims(world_size=2, num_weight_shards=2).build()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=128))
    params = []
    for i in range(weights):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(
            torch.randn(256, 128, device=device, dtype=torch.bfloat16)
        )
        runtime.shard_parameter(module, "weight", f"w{i}")
        params.append(module.weight)
    scaling = FP8Scaling(recipe)
    make_fp8_primary(runtime, scaling)
    masters = [fp8_primary_init_value(p).float().reshape(-1).clone() for p in params]
    offsets = [0] * len(params)
    times = []
    for i in range(steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        write_back_fp8_primary(params, masters, offsets, groups.replicate)
        elapsed = time.perf_counter() - start  # host time: the kernels run behind it
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(elapsed)
    return {
        "recipe": recipe,
        "weights": weights,
        "device": device,
        "us_per_weight": round(statistics.median(times) / weights * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recipes", default="tensorwise,blockwise")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    for recipe in args.recipes.split(","):
        print(json.dumps(measure(recipe, args.weights, args.steps, args.device)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

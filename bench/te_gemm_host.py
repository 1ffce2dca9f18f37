"""Host time of TransformerEngine's GEMM calls by wgrad mode, on one GPU (no GTP, no NCCL).

On the NeMo TE path GTP2's ``generic_gemm`` calls took ~20 µs more host time each than DP2's
(same GEMMs; ``results/2026-12-01_user_path_2xH200.md`` section 4). The difference between the
two paths at the GEMM: with GTP, TE's fused wgrad accumulation writes the wgrad into a
preallocated fp32 buffer (``fuse_wgrad_accumulation`` through ``grad_buffer()``); DP2's recipe
leaves the fusion off and TE returns a bf16 wgrad. This times a chain of ``te.Linear`` s
(bf16, the 1B recipe's shapes) forward + backward in three modes and reports host µs per
GEMM call (cProfile of ``generic_gemm``) and per step (the host's issue time from an idle GPU):

- ``plain``: no fusion, bf16 wgrad to autograd (a hook adds it into an fp32 ``main_grad``);
- ``fused_fp32``: ``fuse_wgrad_accumulation=True``, fp32 ``main_grad``;
- ``fused_bf16``: the same with a bf16 ``main_grad``.

    PYTHONPATH=/tmp/te:/tmp/site:$PWD python bench/te_gemm_host.py --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch

SHAPES = [(2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048)]  # in, out: qkv, proj, fc1, fc2


def _chain(mode: str, layers: int) -> torch.nn.Sequential:
    import transformer_engine.pytorch as te

    linears = []
    for _ in range(layers):
        for fan_in, fan_out in SHAPES:
            linear = te.Linear(fan_in, fan_out, bias=False, params_dtype=torch.bfloat16)
            weight = linear.weight
            dtype = torch.bfloat16 if mode == "fused_bf16" else torch.float32
            weight.main_grad = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
            if mode == "plain":

                def accumulate(param: torch.Tensor) -> None:  # megatron DDP's hook
                    param.main_grad.add_(param.grad)
                    param.grad = None

                weight.register_post_accumulate_grad_hook(accumulate)
            else:
                linear.fuse_wgrad_accumulation = True
            linears.append(linear)
    return torch.nn.Sequential(*linears)


def _step(model: torch.nn.Module, inputs: dict[int, torch.Tensor]) -> None:
    """Every linear on an input of its width (the shapes do not chain), then one backward:
    forward, dgrad and wgrad GEMM of each."""
    total = sum(linear(inputs[linear.in_features]).float().sum() for linear in model)
    total.backward()


def measure(mode: str, layers: int, tokens: int, steps: int) -> dict:
    """Host issue time per step (GPU idle at the start) and cProfile's generic_gemm time."""
    torch.manual_seed(0)
    model = _chain(mode, layers).cuda()
    x = {
        width: torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for width in {fan_in for fan_in, _ in SHAPES}
    }
    for _ in range(3):
        _step(model, x)
    torch.cuda.synchronize()
    issue = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(model, x)
        issue.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        _step(model, x)
    torch.cuda.synchronize()
    profiler.disable()
    gemm_calls, gemm_s = 0, 0.0
    for (_, _, name), (_, calls, tottime, _, _) in pstats.Stats(profiler).stats.items():
        if "generic_gemm" in name:
            gemm_calls, gemm_s = calls, tottime
    return {
        "mode": mode,
        "host_issue_ms_per_step": round(1000 * statistics.median(issue), 3),
        "gemm_calls_per_step": gemm_calls // 5,
        "generic_gemm_us_per_call": round(1e6 * gemm_s / max(1, gemm_calls), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="plain,fused_fp32,fused_bf16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = [measure(m, args.layers, args.tokens, args.steps) for m in args.modes.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "te_gemm_host.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "device": torch.cuda.get_device_name()}, f)


if __name__ == "__main__":
    main()

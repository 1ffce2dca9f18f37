"""torch's fp32-accumulating wgrad GEMM (``TorchWgradAccumulation``) against megatron's unfused
path: error against fp64, time, in-place write, CUDA-graph capture.

Question: does the GEMM the strategy hands megatron without apex cost what the bf16 GEMM alone
costs, and sum more exactly than the GEMM + fp32 add it replaces?

Ranks: one process, one GPU (no collectives).

    python -m bench.wgrad_fusion_gemm [--tokens 4096]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from nemo_gtp.integrations.megatron.wgrad_fusion import (
    accumulate_wgrad,
    fused_accumulation_available,
)

SHAPES = ((50304, 2048), (6144, 2048), (2048, 8192))
"""(out, in): an output layer, a 1B recipe's qkv and fc2."""


def _ms(fn: Callable[[], object], calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def _row(out_f: int, in_f: int, tokens: int) -> str:
    x = torch.randn(tokens, 1, in_f, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 1, out_f, device="cuda", dtype=torch.bfloat16)
    x2, dy2 = x.reshape(-1, in_f), dy.reshape(-1, out_f)
    start = torch.randn(out_f, in_f, device="cuda")
    exact = start.double() + dy2.double().t() @ x2.double()

    def error(grad: torch.Tensor) -> float:
        return ((grad.double() - exact).abs().max() / exact.abs().max()).item()

    fused = start.clone()
    address = fused.data_ptr()
    accumulate_wgrad(x, dy, fused)
    assert fused.data_ptr() == address, "not in place"
    unfused = start.clone().add_(torch.mm(dy2.t(), x2))
    side = torch.cuda.Stream()  # warm up off the capture stream, then capture one call
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        accumulate_wgrad(x, dy, start.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph, captured = torch.cuda.CUDAGraph(), start.clone()
    with torch.cuda.graph(graph):
        accumulate_wgrad(x, dy, captured)
    graph.replay()
    torch.cuda.synchronize()
    scratch = start.clone()
    fused_ms = _ms(lambda: accumulate_wgrad(x, dy, scratch))
    unfused_ms = _ms(lambda: scratch.add_(torch.mm(dy2.t(), x2)))
    gemm_ms = _ms(lambda: torch.mm(dy2.t(), x2))
    return (
        f"| {out_f} x {in_f} | {fused_ms:.3f} | {unfused_ms:.3f} | {gemm_ms:.3f} | "
        f"{error(fused):.1e} | {error(unfused):.1e} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    if not fused_accumulation_available():
        print("no fp32-accumulating GEMM here (needs CUDA and torch >= 2.8)")
        return 1
    torch.manual_seed(0)
    print("| out x in | fused ms | GEMM + add ms | GEMM ms | fused error | unfused error |")
    print("|---|---|---|---|---|---|")
    for out_f, in_f in SHAPES:
        print(_row(out_f, in_f, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The parity oracle on GPUs with NCCL (issue: engine "Done when").

Runs the CPU test suite's GPT parity cases (``tests.harness.gpt``) on CUDA devices
with NCCL, fp32, TF32 off, and writes one JSON line per case with the largest relative error.

    torchrun --nproc-per-node 2 bench/parity_nccl.py --out parity_nccl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from tests.harness.gpt import Run, assert_parity, train

CASES = {
    2: [
        Run(gtp=2),
        Run(gtp=2, per_token=True),
        Run(gtp=2, ffn=72, hidden=48),
        Run(gtp=2, distopt=True),
        Run(gtp=2, gather_backend="copy_engine"),
        Run(gtp=2, distopt=True, gather_backend="copy_engine"),
        Run(gtp=2, gather_backend="auto"),  # 32 tokens/GEMM: NCCL
        Run(gtp=2, gather_backend="auto", ce_min_tokens=16),  # copy engine
        Run(gtp=2, separate_rs=True),
        # bf16 + megatron's mixed-precision optimizers: they write params through .data, which
        # moves no version counter; the copy-engine mirror must still see every step's weights.
        Run(gtp=2, bf16=True, distopt=True, gather_backend="copy_engine"),
        Run(gtp=2, bf16=True, gather_backend="copy_engine"),
        # replicated params reduced / optimizer-sharded over DP x GTP (two chained optimizers)
        Run(gtp=2, distopt=True, shard_replicated=True),
        Run(gtp=2, distopt=True, shard_replicated=True, per_token=True),
        Run(
            gtp=2,
            bf16=True,
            distopt=True,
            shard_replicated=True,
            gather_backend="auto",
            ce_min_tokens=16,
        ),
    ],
    4: [
        Run(gtp=2),
        Run(tp=2, gtp=2),
        Run(gtp=4),
        Run(gtp=4, fp32_accum=True),
        Run(tp=2, gtp=2, per_token=True, distopt=True),
        Run(gtp=2, distopt=True, shard_replicated=True),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="parity_nccl.json")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    records = []
    for case in CASES.get(world, CASES[2]):
        start = time.perf_counter()
        reference = train(dataclasses.replace(case, gtp=1))
        result = train(case)
        # bf16 vs the DP run: summation order differs, so only a loose check; the copy-engine
        # run below must still be bit-identical to the NCCL-gather run.
        worst = assert_parity(result, reference, tol=5e-2 if case.bf16 else 1e-5)
        backend = result["runtime"].gather_backend.value
        if case.gather_backend != "auto":  # "nccl" is the config alias of "process_group"
            expected = "process_group" if case.gather_backend == "nccl" else case.gather_backend
            assert backend == expected, (case, backend)
        elif dist.get_rank() == 0:
            print(f"[parity-nccl] {case}: auto chose {backend}", flush=True)
        if case.gather_backend not in ("nccl", "process_group"):
            # same bytes gathered: bit-identical to the run with NCCL's all-gather
            nccl = train(dataclasses.replace(case, gather_backend="process_group"))
            assert nccl["losses"] == result["losses"], "copy-engine losses differ from NCCL's"
            for name, weight in nccl["weights"].items():
                assert torch.equal(weight, result["weights"][name]), name
            if dist.get_rank() == 0:
                print(f"[parity-nccl] {case}: bit-identical to the NCCL gather run", flush=True)
        records.append(
            dict(
                case=dataclasses.asdict(case),
                world=world,
                max_rel_err=worst,
                passed=True,
                seconds=round(time.perf_counter() - start, 1),
                device=torch.cuda.get_device_name(),
                backend="nccl",
                gather_backend=backend,
                torch=torch.__version__,
            )
        )
        if dist.get_rank() == 0:
            print(f"[parity-nccl] {case}: max rel err {worst:.2e}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

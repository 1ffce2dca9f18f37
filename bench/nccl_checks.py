"""Does GTP hold on GPUs with NCCL at the megatron level? Parity and checkpoint interop.

Question: do the CPU suite's GPT parity cases hold on CUDA with NCCL, and does a checkpoint
saved at TP1·GTP2 load at TP2 and DP2 bit for bit?

Ranks: NCCL, one rank per GPU (launch with ``torchrun``).

Two checks, fp32 with TF32 off:

- ``parity``: the CPU test suite's GPT parity cases (``tests.harness.gpt``) against the same run
  without GTP (1e-5; bf16 cases 5e-2), on 2 ranks or, with 4, the TP2·GTP2 / GTP4 cases; the
  copy-engine and ``auto`` gathers also bit for bit against the NCCL all-gather run. One JSON
  line per case with its largest relative error.
- ``ckpt``: 3 steps at TP1·GTP2 saved with ``save_gtp_checkpoint`` (model + distributed
  optimizer), loaded into the same GPT built at TP2 and at DP2 (no GTP); every full weight
  compared bit for bit (design §3.3).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    torchrun --nproc-per-node 2 -m bench.nccl_checks parity --out parity_nccl.jsonl
    torchrun --nproc-per-node 2 -m bench.nccl_checks ckpt --dir /tmp/gtp_ckpt --out ckpt_nccl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist


def cases() -> dict[int, list]:
    """The parity cases per world size: 2 ranks (GTP2 variants) or 4 (TP2·GTP2, GTP4, GTP2)."""
    from tests.harness.gpt import Run

    return {
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


def run_parity(args: argparse.Namespace) -> None:
    """Every case of :func:`cases` for this world size, one JSON line each into ``args.out``."""
    from tests.harness.gpt import assert_parity, train

    world = dist.get_world_size()
    records = []
    table = cases()
    for case in table.get(world, table[2]):
        start = time.perf_counter()
        reference = train(dataclasses.replace(case, gtp=1))
        result = train(case)
        # bf16 vs the DP run: summation order differs, so only a loose check; the copy-engine
        # run below must still be bit-identical to the NCCL-gather run.
        worst = assert_parity(result, reference, tol=5e-2 if case.bf16 else 1e-5)
        backend = result["runtime"].gather_backend.value
        if case.gather_backend != "auto":
            assert backend == case.gather_backend, (case, backend)
        elif dist.get_rank() == 0:
            print(f"[parity-nccl] {case}: auto chose {backend}", flush=True)
        if case.gather_backend != "process_group":
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


def full_weights(setup: dict) -> dict[str, torch.Tensor]:
    """Every weight gathered over GTP and TP to its full logical shape."""
    from megatron.core import parallel_state

    from tests.harness.gpt import full_tensor

    out, tp_group = {}, parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    for name, param in setup["ddp"].module.named_parameters():
        local = full_tensor(param, param.data, setup["groups"])
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            local = torch.cat(parts, dim=param.partition_dim)
        out[name] = local.cpu()
    return out


def run_ckpt(args: argparse.Namespace) -> None:
    """Save at TP1·GTP2, load at TP2 and at DP2, compare every full weight (JSON: ``args.out``)."""
    from nemo_gtp.integrations.megatron import load_gtp_checkpoint, save_gtp_checkpoint
    from tests.harness.gpt import Run, build, train_built

    saved_run = Run(gtp=2, steps=3, distopt=True)
    setup = build(saved_run)
    train_built(setup, saved_run)
    save_gtp_checkpoint(args.dir, setup["ddp"], setup["optimizer"], setup["groups"])
    want = full_weights(setup)
    records = []
    for name, run in (
        ("TP2", Run(tp=2, steps=0, distopt=True)),
        ("DP2", Run(steps=0, distopt=True)),
    ):
        target = build(run)
        load_gtp_checkpoint(args.dir, target["ddp"], target["optimizer"], target["groups"])
        got = full_weights(target)
        mismatched = [k for k in want if not torch.equal(want[k], got[k])]
        records.append(
            dict(
                saved="TP1·GTP2",
                loaded=name,
                tensors=len(want),
                bit_identical=not mismatched,
                mismatched=mismatched[:5],
            )
        )
        if dist.get_rank() == 0:
            print(
                f"[ckpt-nccl] save TP1·GTP2 -> load {name}: {len(want)} weights, "
                f"{'bit-identical' if not mismatched else f'MISMATCH {mismatched[:5]}'}",
                flush=True,
            )
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=records),
                f,
                indent=1,
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``parity`` or ``ckpt`` and where to write."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", choices=("parity", "ckpt"))
    parser.add_argument("--out", default=None, help="parity_nccl.jsonl / ckpt_nccl.json")
    parser.add_argument("--dir", default="/tmp/gtp_ckpt", help="ckpt: the checkpoint directory")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = "parity_nccl.jsonl" if args.check == "parity" else "ckpt_nccl.json"
    return args


def main(argv: list[str] | None = None) -> None:
    """One check on an NCCL world of ``torchrun``'s ranks (one GPU each)."""
    args = parse_args(argv)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.check == "parity":
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl")
    (run_parity if args.check == "parity" else run_ckpt)(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

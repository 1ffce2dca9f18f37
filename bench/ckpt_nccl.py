"""Checkpoint interop on GPUs with NCCL: save at TP1·GTP2, load at TP2 and at DP2 (design §3.3).

    torchrun --nproc-per-node 2 bench/ckpt_nccl.py --dir /tmp/gtp_ckpt --out ckpt_nccl.json

Trains 3 steps at GTP2, saves model + distributed-optimizer state with
``save_gtp_checkpoint``, then rebuilds the same GPT at TP2 (no GTP) and at DP2 (no GTP), loads,
and compares every full (gathered) weight bit for bit with the saved run's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_gtp.integrations.megatron import load_gtp_checkpoint, save_gtp_checkpoint
from tests.harness.gpt import Run, build, full_tensor, train_built


def full_weights(setup: dict) -> dict[str, torch.Tensor]:
    """Every weight gathered over GTP and TP to its full logical shape."""
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/gtp_ckpt")
    parser.add_argument("--out", default="ckpt_nccl.json")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

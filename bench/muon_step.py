"""GPU time of Muon's Newton–Schulz per optimizer step: every GTP peer vs each matrix's owner.

Question: How much Newton–Schulz GPU time does Muon's owner split save per rank?

Ranks: none: one GPU, no collective (each rank's share is computed, not communicated).

Muon orthogonalizes every hidden matrix each step (design §1.6 "Muon"). With
``orthogonalize="every_rank"`` a GTP rank does all of it (as a DP replica does without GTP);
with ``"owner"`` only the matrices :func:`~nemo_gtp.engine.muon.assign_owners` gives it, bucket
by bucket. This times the Newton–Schulz kernels alone on one GPU for a GPT's matrices (the 1B
recipe's by default): all of them, and rank 0's share at GTP sizes 2 and 4 (the busiest rank's
share is within one matrix of it). No collective runs.

    python -m bench.muon_step --layers 24 --hidden 2048 --ffn 8192 --out muon_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nemo_gtp.engine.muon import assign_owners, newton_schulz


def matrices(layers: int, hidden: int, ffn: int, qkv: int) -> list[tuple[int, int]]:
    """The (out, in) shapes of a GPT's hidden matrices, layer by layer (qkv, proj, fc1, fc2)."""
    return [(qkv, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers


def owned(shapes: list[tuple[int, int]], gtp: int, bucket_mb: float) -> list[int]:
    """Indices rank 0 owns at GTP size ``gtp``, buckets cut as ``GTPMuon`` cuts them."""
    out, bucket, held, start = [], [], 0, 0
    for index, (rows, cols) in enumerate(shapes + [(0, 0)]):
        size = rows * cols * 4
        if index == len(shapes) or (bucket and held + size > bucket_mb * 2**20):
            out += [start + i for i, o in enumerate(assign_owners(bucket, gtp)) if o == 0]
            bucket, held, start = [], 0, index
        if index < len(shapes):
            bucket.append((rows, cols))
            held += size
    return out


def time_ns(updates: list[torch.Tensor], dtype: torch.dtype, repeats: int) -> float:
    """Median ms to orthogonalize ``updates`` once each."""
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for update in updates:
            newton_schulz(update, dtype=dtype)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--qkv", type=int, default=0, help="qkv rows (default 3 x hidden)")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    shapes = matrices(args.layers, args.hidden, args.ffn, args.qkv or 3 * args.hidden)
    gen = torch.Generator(device="cuda").manual_seed(0)
    updates = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    record = {"shapes": len(shapes), "device": torch.cuda.get_device_name()}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        every = time_ns(updates, dtype, args.repeats)
        record[f"every_rank_ms_{name}"] = round(every, 2)
        for gtp in (2, 4):
            mine = [updates[i] for i in owned(shapes, gtp, args.bucket_mb)]
            ms = time_ns(mine, dtype, args.repeats)
            record[f"owner_gtp{gtp}_rank0_ms_{name}"] = round(ms, 2)
            record[f"owner_gtp{gtp}_matrices"] = len(mine)
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

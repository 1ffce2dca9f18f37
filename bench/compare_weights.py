"""Are two weight dumps the same model? Key by key, bit for bit, else by how much.

Compares two ``torch.save``d dicts of full weights (``bench_nemo.py --dump-weights`` writes them:
GTP shards gathered, FP8 weights dequantized), e.g. what a GTP2 run saved in its checkpoint
against what a DP2 run loaded from it (design §3.3: a checkpoint reshards to any layout):

    python bench/compare_weights.py save/weights_gtp2_fp8param_checkpoint.dir_..._2048_end.pt \\
        load/weights_dp2_fp8param_resume_..._strategy.ckpt_load_optimizer_false_2048_start.pt

Prints one line per key that differs (max |diff|, max relative diff), then ``WEIGHTS: equal``
(every key in both, same shape and dtype, bit for bit) or ``WEIGHTS: DIFFER (...)``; exit
status 0 / 1. ``--rtol R``: also call a key equal within a relative R (reported as such).
"""

from __future__ import annotations

import argparse
import sys

import torch


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> list[str]:
    """One line per key that is not bit for bit equal (missing, other shape / dtype, values);
    the last line is the verdict."""
    lines, bad, close = [], 0, 0
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            lines.append(f"{key}: only in {'the first' if key in a else 'the second'}")
            bad += 1
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            bad += 1
            continue
        if torch.equal(x, y):
            continue
        diff = (x.double() - y.double()).abs()
        rel = (diff / y.double().abs().clamp_min(1e-30)).max().item()
        within = rel <= rtol
        close += within
        bad += not within
        lines.append(
            f"{key}: max |diff| {diff.max().item():.3e}, max rel {rel:.3e}, "
            f"{int((diff > 0).sum())} of {diff.numel()} elements differ"
            + (" (within --rtol)" if within else "")
        )
    keys = len(a.keys() | b.keys())
    if bad:
        lines.append(f"WEIGHTS: DIFFER ({bad} of {keys} keys)")
    else:
        extra = f", {close} within rtol {rtol:g}" if close else ""
        lines.append(f"WEIGHTS: equal ({keys} keys: {keys - close} bit for bit{extra})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--rtol", type=float, default=0.0)
    args = parser.parse_args(argv)
    a = torch.load(args.first, map_location="cpu", weights_only=True)
    b = torch.load(args.second, map_location="cpu", weights_only=True)
    lines = compare(a, b, args.rtol)
    print("\n".join(lines))
    return 0 if lines[-1].startswith("WEIGHTS: equal") else 1


if __name__ == "__main__":
    sys.exit(main())

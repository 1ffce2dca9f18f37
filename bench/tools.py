"""Offline tools over what the benchmarks wrote (no GPU, no process group).

Questions answered, one subcommand each:

- ``compare-weights A B [--rtol R]``: are two weight dumps (``bench.bench_nemo --dump-weights``:
  GTP shards gathered, FP8 weights dequantized) the same model, key by key, bit for bit, else by
  how much? E.g. what a GTP2 run saved in its checkpoint against what a DP2 run loaded from it
  (design §3.3: a checkpoint reshards to any layout). Prints one line per differing key, then
  ``WEIGHTS: equal`` or ``WEIGHTS: DIFFER (...)``; exit status 0 / 1. ``--quantize-second
  tensorwise``: first cast the second dump's linear weights to FP8 per tensor, as TE's current
  scaling does (:func:`quantized_linears`): do FP8 primary start weights equal the quantization of
  the bf16 run's start weights (design §3.1 "Exact init")?
- ``pstats-diff MODE BASELINE [--steps N] [--top K]``: where does one mode's host time go that
  another's does not? Diffs two cProfile dumps (``bench.bench_nemo --profile-tokens``,
  ``bench.host_fake``) by own time per step.
- ``plot-ratio BENCH_GPT_JSON OUT_PNG``: step-time ratio against tokens per GPU of a
  ``bench.bench_gpt`` run (needs matplotlib).

    python -m bench.tools compare-weights save/weights_gtp2_..._end.pt load/weights_dp2_..._start.pt
    python -m bench.tools pstats-diff host_profile_gtp2_te_2048.pstats \\
        host_profile_dp2_te_2048.pstats
"""

from __future__ import annotations

import argparse
import sys

from bench.common import compare, plot_ratio, pstats_diff


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The subcommand and its arguments (module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cw = sub.add_parser("compare-weights", help="two weight dumps, key by key, bit for bit")
    cw.add_argument("first")
    cw.add_argument("second")
    cw.add_argument("--rtol", type=float, default=0.0, help="also call a key equal within this")
    cw.add_argument(
        "--quantize-second",
        choices=("tensorwise",),
        help="cast the second dump's linear weights to FP8 first (per-tensor current scaling)",
    )
    pd = sub.add_parser("pstats-diff", help="own time per step of two cProfile dumps")
    pd.add_argument("mode", help="the dump to explain (e.g. GTP2's)")
    pd.add_argument("baseline", help="the dump to compare against (e.g. DP2's)")
    pd.add_argument("--steps", type=int, default=3, help="profiled steps in each dump")
    pd.add_argument("--top", type=int, default=30)
    pr = sub.add_parser("plot-ratio", help="step-time ratio plot of a bench_gpt.json")
    pr.add_argument("json_path")
    pr.add_argument("png_path")
    return parser.parse_args(argv)


def quantized_linears(weights: dict, kind: str) -> dict:
    """``weights`` with every 2-D ``linear_*.weight`` cast to FP8 and back in its own dtype:
    one scale per tensor from its amax, TE's current-scaling formula
    (:func:`nemo_gtp.engine.fp8.quantize_shard`, bit for bit TE's quantizer on a GPU). The
    reference an FP8 primary run's start weights are compared with: the bf16 run's start
    weights, quantized as one tensor on one rank.

    Example::

        quantized_linears({"decoder.layers.0.mlp.linear_fc1.weight": w}, "tensorwise")
    """
    from nemo_gtp.engine.fp8 import FP8Scaling, quantize_shard

    scaling = FP8Scaling(kind)
    out = dict(weights)
    for key, value in weights.items():
        if ".linear_" in key and key.endswith(".weight") and value.dim() == 2:
            out[key] = quantize_shard(value, scaling).dequantize(value.dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; the exit status of ``compare-weights`` is its verdict."""
    args = parse_args(argv)
    if args.command == "pstats-diff":
        print(pstats_diff(args.mode, args.baseline, args.steps, args.top))
        return 0
    if args.command == "plot-ratio":
        plot_ratio(args.json_path, args.png_path)
        return 0
    import torch

    a = torch.load(args.first, map_location="cpu", weights_only=True)
    b = torch.load(args.second, map_location="cpu", weights_only=True)
    if args.quantize_second:
        b = quantized_linears(b, args.quantize_second)
    lines = compare(a, b, args.rtol)
    print("\n".join(lines))
    return 0 if lines[-1].startswith("WEIGHTS: equal") else 1


if __name__ == "__main__":
    sys.exit(main())

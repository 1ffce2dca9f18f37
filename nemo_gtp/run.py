"""Run a recipe: ``python -m nemo_gtp.run configs/<recipe>.yaml [key=value ...]``.

``--compare-baseline`` trains the recipe twice, as written (GTP) and with
``strategy.num_weight_shards`` set to the tensor-parallel size (plain TP + DP, same global
batch), both in one launch of ``trainer.devices`` processes (one after the other, see
``nemo_gtp.recipes.launch``), then prints both loss curves side by side.

Examples::

    python -m nemo_gtp.run configs/tiny_cpu.yaml --compare-baseline
    python -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=50 strategy.num_weight_shards=2
    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=10 \
        +checkpoint.dir=ckpts +checkpoint.every_n_train_steps=10
    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=20 +resume=ckpts/step=9
"""

from __future__ import annotations

import argparse
import sys
import time


def _compare(config: str, overrides: list[str]) -> int:
    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.launch import launch_fits

    cfg = load_recipe(config, overrides)
    tp = int(cfg.strategy.get("tensor_model_parallel_size", 1))
    shards = int(cfg.strategy.get("num_weight_shards") or tp)
    runs = {
        f"GTP (TP{tp}·GTP{shards // tp})": overrides,
        f"baseline (TP{tp}, no GTP)": [*overrides, f"strategy.num_weight_shards={tp}"],
    }
    start = time.perf_counter()
    for name, args in runs.items():
        print(f"=== {name}: python -m nemo_gtp.run {config} {' '.join(args)}", flush=True)
    try:
        logs = launch_fits(config, runs)
    except RuntimeError as err:
        print(f"training failed: {err}", flush=True)
        return 1
    names = list(logs)
    print(f"\n{'step':>5} | {names[0]:>22} | {names[1]:>22} | rel diff")
    by_step = [{r["step"]: r["loss"] for r in logs[n]} for n in names]
    for step in sorted(by_step[0]):
        a, b = by_step[0][step], by_step[1].get(step, float("nan"))
        print(f"{step:>5} | {a:>22.5f} | {b:>22.5f} | {abs(a - b) / abs(b):.1e}")
    for name in names:
        times = sorted(r["ms"] for r in logs[name][5:]) or [float("nan")]
        peak = max((r.get("peak_gib", 0.0) for r in logs[name]), default=0.0)
        print(
            f"{name}: median step {times[len(times) // 2]:.1f} ms"
            + (f", peak memory {peak:.2f} GiB" if peak else "")
        )
    first, last = logs[names[0]][0]["loss"], logs[names[0]][-1]["loss"]
    print(
        f"\nGTP loss {first:.3f} -> {last:.3f} over {len(logs[names[0]])} steps; "
        f"both runs took {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nemo_gtp.run``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML, e.g. configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value (OmegaConf dot paths)")
    parser.add_argument("--compare-baseline", action="store_true")
    parser.add_argument("--loss-log", help="append per-step losses (JSON lines) here")
    args = parser.parse_args(argv)
    if args.compare_baseline:
        return _compare(args.config, args.overrides)
    from nemo_gtp.recipes.loader import LossLog, build_fit, load_recipe

    cfg = load_recipe(args.config, args.overrides)
    callbacks = [LossLog(args.loss_log)] if args.loss_log else []
    build_fit(cfg, callbacks=callbacks).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE under expert GTP through NeMo: EGTP2 vs EP2 (and EP1 · DP2), SequentialMLP and TEGroupedMLP.

One launch of 2 processes runs every mode of ``configs/moe_1b.yaml`` in turn (NeMo trainer +
``GTPMegatronStrategy``, torn down in between, as ``bench_nemo.py`` does) and rank 0 writes one
record per fit: median step time, tokens/s per GPU, peak memory, routed-expert parameters per
GPU, the expert runtime's collectives (weights per gather: a whole group of local experts per
collective, design §3.4), exposed GTP communication and the loss curve.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    PYTHONPATH=/tmp/te:/tmp/site:$PWD python bench/bench_moe.py --out bench/results/DIR
    python bench/bench_moe.py --dry-run --out /tmp/moe   # every mode's recipe checked, no launch

Modes (dense part DP2 in all of them, so only the experts differ; 4096 tokens per GPU):
``seq_*``: megatron ``SequentialMLP`` experts (local spec), ``grouped_*``: ``TEGroupedMLP``
(TE spec, ``moe_grouped_gemm``, TransformerEngine's ``GroupedLinear``); ``*_dp2``: experts whole
on both GPUs (EP1, expert DP2), ``*_ep2``: 4 of the 8 experts per GPU (EP2), ``*_egtp2``: half
of every expert's rows per GPU (EP1 · EGTP2). The loss of an ``egtp2`` mode is compared with
its ``dp2`` mode (the same initial weights: EP changes megatron's expert init seeds), its step
time and memory with its ``ep2`` mode (the issue's baseline). A mode takes modifiers as in
``bench_nemo.py``: ``seq_egtp2@prefetch_depth=2`` (a ``GTPConfig`` field) or ``@model.key=v``.

The whole run is bounded by ``--timeout`` (default 175 s): ranks still running then are killed
and the fits that finished are reported (rank 0 rewrites ``records.json`` after every fit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = "configs/moe_1b.yaml"
_SEQ = ["model.layer_spec=local", "model.moe_grouped_gemm=false"]
_GROUPED = ["model.layer_spec=te", "model.moe_grouped_gemm=true"]
_DENSE_DP2 = ["strategy.num_weight_shards=1"]
_DP2 = ["strategy.expert_model_parallel_size=1", "strategy.expert_num_weight_shards=1"]
_EP2 = ["strategy.expert_model_parallel_size=2", "strategy.expert_num_weight_shards=1"]
_EGTP2 = ["strategy.expert_model_parallel_size=1", "strategy.expert_num_weight_shards=2"]
MODES = {
    "seq_dp2": [*_SEQ, *_DENSE_DP2, *_DP2],
    "seq_ep2": [*_SEQ, *_DENSE_DP2, *_EP2],
    "seq_egtp2": [*_SEQ, *_DENSE_DP2, *_EGTP2],
    "grouped_dp2": [*_GROUPED, *_DENSE_DP2, *_DP2],
    "grouped_ep2": [*_GROUPED, *_DENSE_DP2, *_EP2],
    "grouped_egtp2": [*_GROUPED, *_DENSE_DP2, *_EGTP2],
    # the recipe as shipped: dense GTP2 as well
    "seq_gtp2_egtp2": [*_SEQ, *_EGTP2],
    "grouped_gtp2_egtp2": [*_GROUPED, *_EGTP2],
}
DEFAULT_MODES = "seq_dp2,seq_ep2,seq_egtp2,grouped_dp2,grouped_ep2,grouped_egtp2"


def baselines(mode: str) -> tuple[str | None, str | None]:
    """(loss baseline, speed baseline) of ``mode``: its ``dp2`` and ``ep2`` twins, modifiers
    dropped; None for a mode that is a baseline itself."""
    base = mode.split("@")[0]
    if not base.endswith("egtp2"):
        return None, None
    family = base.split("_")[0]
    return f"{family}_dp2", f"{family}_ep2"


def resolve_mode(mode: str) -> list[str]:
    """The recipe overrides of ``mode`` (``base[@knob=value...]``, see the module docstring)."""
    base, *knobs = mode.split("@")
    if base not in MODES:
        raise SystemExit(f"unknown mode {base!r}: known are {', '.join(MODES)}")
    extra = [f"+{knob}" if "." in knob else f"+gtp.{knob}" for knob in knobs]
    return [*MODES[base], *extra]


def check_modes(modes: list[str]) -> list[str]:
    """Every mode's recipe through the CLI's checks (no torch); the errors, one line each."""
    sys.path.insert(0, str(ROOT))
    from nemo_gtp.recipes.config import RecipeError, load_recipe
    from nemo_gtp.recipes.validate import validate_recipe

    errors = []
    for mode in modes:
        try:
            validate_recipe(load_recipe(str(ROOT / CONFIG), resolve_mode(mode)))
        except (RecipeError, ValueError) as err:
            errors.append(f"{mode}: {err}")
    return errors


# ----------------------------------------------------------------------------- one rank
def _expert_probe(reset_at: int):  # noqa: ANN202
    """Lightning callback: routed-expert parameters on this GPU and the expert runtime's
    collectives from step ``reset_at`` on (the observing first step excluded)."""
    import lightning.pytorch as pl

    class _Probe(pl.Callback):
        def __init__(self) -> None:
            self.numbers: dict = {}

        def _expert_runtimes(self, trainer) -> list:  # noqa: ANN001
            from nemo_gtp.strategy import gtp_runtimes

            return [r for r in gtp_runtimes(trainer) if r.axis.value == "expert"]

        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step == reset_at:
                for runtime in self._expert_runtimes(trainer):
                    runtime.stats.reset()

        def on_train_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            from nemo_gtp.engine import ChainId

            model = trainer.strategy.model
            numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
            self.numbers = {"expert_params_per_gpu_m": round(numel / 1e6, 1)}
            for runtime in self._expert_runtimes(trainer):
                stats = runtime.stats
                self.numbers.update(
                    expert_gathers=stats.gathers,
                    expert_gather_collectives=stats.gather_collectives,
                    expert_reduce_scatters=stats.reduce_scatters,
                    expert_reduce_scatter_collectives=stats.reduce_scatter_collectives,
                    expert_prefetch_skipped=stats.prefetch_skipped,
                    expert_fallback_allocations=stats.fallback_allocations,
                    expert_units={
                        cid.value: [len(u) for u in runtime.chains[cid].units]
                        for cid in (ChainId.EXPERT_FC1, ChainId.EXPERT_FC2)
                    },
                    expert_max_live_buffers={
                        cid.value: n for cid, n in runtime.max_live_buffers.items() if n
                    },
                )

    return _Probe()


def _rank_main(spec_path: str) -> None:

    sys.path.insert(0, str(HERE))
    from bench_nemo import _steps_callback, timed_fit

    from nemo_gtp.recipes.launch import teardown_fit
    from nemo_gtp.recipes.loader import load_recipe

    spec = json.loads(Path(spec_path).read_text())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = []
    for i, run in enumerate(spec["runs"]):
        record: dict = {"mode": run["mode"]}
        started = time.perf_counter()
        try:
            steps = _steps_callback(spec["warmup"], spec["timed"], False)
            probe = _expert_probe(reset_at=spec["warmup"])
            cfg = load_recipe(
                str(ROOT / CONFIG), [*run["overrides"], f"trainer.max_steps={steps.total_steps}"]
            )
            store = str(Path(spec["dir"], f"store{i}"))
            fitted = timed_fit(cfg, [steps, probe], steps, store, world, spec["tokens_per_gpu"])
            record.update(fitted, **probe.numbers)
        except Exception as err:  # record and go on: one broken mode must not hide the rest
            record["error"] = f"{type(err).__name__}: {err}"[:2000]
            if rank == 0:
                traceback.print_exc()
        finally:
            teardown_fit()
        record["fit_s"] = round(time.perf_counter() - started, 1)
        out.append(record)
        if rank == 0:  # after every fit: a timeout still leaves the finished ones
            Path(spec["dir"], "records.json").write_text(json.dumps(out))
            print(json.dumps({k: v for k, v in record.items() if k != "losses"}), flush=True)


# ----------------------------------------------------------------------------- parent
def _max_rel_diff(a: list, b: list) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and y != 0]
    return max(abs(x - y) / abs(y) for x, y in pairs) if pairs else None


def report(records: list[dict], out: Path) -> str:
    """The markdown table (also written to ``out/bench_moe.md``)."""
    by = {r["mode"]: r for r in records}
    lines = [
        "| mode | step ms | vs EP2 | tokens/s/GPU | peak GiB | expert params/GPU (M) | "
        "expert weights per gather / per reduce-scatter | exposed gather / RS ms | "
        "max loss rel diff vs DP2 | loss first → last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error'][:200]} |||||||||")
            continue
        loss_base, speed_base = (by.get(m) for m in baselines(r["mode"]))
        ratio = diff = ""
        if speed_base and "error" not in speed_base:
            ratio = f"{r['step_ms'] / speed_base['step_ms']:.3f}×"
        if loss_base and "error" not in loss_base:
            worst = _max_rel_diff(r["losses"], loss_base["losses"])
            diff = "" if worst is None else f"{worst:.1e}"
        per = ""
        if r.get("expert_gather_collectives"):
            rs = r["expert_reduce_scatters"] / max(1, r["expert_reduce_scatter_collectives"])
            per = f"{r['expert_gathers'] / r['expert_gather_collectives']:.1f} / {rs:.1f}"
        losses = [x for x in r["losses"] if x is not None]
        curve = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else ""
        exposed = r.get("exposed_ms", {})
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.1f} | {ratio} | {r['tokens_per_s_per_gpu']} | "
            f"{r['peak_gib']} | {r.get('expert_params_per_gpu_m', '')} | {per} | "
            f"{exposed.get('gather', 0):.2f} / {exposed.get('reduce_scatter', 0):.2f} | {diff} | "
            f"{curve} |"
        )
    table = "\n".join(lines)
    (out / "bench_moe.md").write_text(
        "# bench_moe.py: MoE recipe (configs/moe_1b.yaml), 2 GPUs, 4096 tokens per GPU\n\n"
        + table
        + "\n\nvs EP2: step time over the same family's `ep2` mode; loss diff: over its `dp2` "
        "mode (same initial weights). Expert weights per gather: weights one expert-runtime "
        "all-gather / reduce-scatter carries, over the steps after warmup (8 = one collective "
        "per group of 8 local experts at EP1).\n"
    )
    return table


def _launch(spec: Path, out: Path, devices: int, timeout: float) -> int:
    from nemo_gtp.recipes.launch import rank_env

    procs = []
    for rank in range(devices):
        env = rank_env(rank, devices, nccl=True)
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--rank-main", str(spec)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills all it started
        )
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(124)
            print(f"rank {procs.index((proc, log))}: killed after the {timeout:.0f} s timeout")
        log.close()
    return max(codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timed", type=int, default=20, help="timed steps (6 more follow)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=175.0, help="seconds for all fits")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--dry-run", action="store_true", help="check every mode's recipe, launch nothing"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    errors = check_modes(modes)
    for error in errors:
        print(f"error: {error}")
    if args.dry_run or errors:
        print(f"{len(modes) - len(errors)} of {len(modes)} modes pass the recipe checks")
        return 1 if errors else 0
    runs = [{"mode": mode, "overrides": resolve_mode(mode)} for mode in modes]
    work = out / "work"
    work.mkdir(exist_ok=True)
    for stale in work.iterdir():
        stale.unlink()
    spec = work / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "runs": runs,
                "dir": str(work.resolve()),
                "warmup": args.warmup,
                "timed": args.timed,
                "tokens_per_gpu": 4096,  # configs/moe_1b.yaml: sequence 2048 x micro-batch 2
            }
        )
    )
    code = _launch(spec, out, args.devices, args.timeout)
    path = work / "records.json"
    records = json.loads(path.read_text()) if path.exists() else []
    (out / "bench_moe.json").write_text(json.dumps(records, indent=1))
    print(report(records, out))
    done = [r for r in records if "error" not in r]
    print(f"{len(done)} of {len(modes)} fits finished (exit status of the ranks: {code})")
    return 0 if len(done) == len(modes) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-main":
        _rank_main(sys.argv[2])
    else:
        sys.exit(main())

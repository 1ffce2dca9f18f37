"""MoE under expert GTP through NeMo: EGTP2 vs EP2 (and EP1 · DP2), SequentialMLP and TEGroupedMLP.

Question: Does expert GTP (EGTP2) beat EP2 on step time and memory and track expert DP on loss,
through NeMo?

Ranks: NCCL, one rank per GPU; ``--shared-device``: the ranks on one GPU through the staged gloo
backend (numerics only); ``cpu_*`` modes on CPU.

One launch runs every mode of ``configs/moe_1b.yaml`` in turn (NeMo trainer +
``GTPMegatronStrategy``, torn down in between, as ``bench_nemo.py`` does) and rank 0 writes one
record per fit: median step time, tokens/s per GPU, peak memory, routed-expert parameters per
GPU, the expert runtime's collectives (weights per gather: a whole group of local experts per
collective, design §3.4), exposed GTP communication, the loss and grad-norm curves, and each
mode's parity with its loss baseline (``bench_nemo.py``'s table and verdict).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    PYTHONPATH=/tmp/te:/tmp/site:$PWD python -m bench.bench_moe --out bench/results/DIR
    python -m bench.bench_moe --dry-run --out /tmp/moe   # every mode's recipe checked, no launch

Modes (dense part DP in all of them but ``*_gtp2_egtp2``, so only the experts differ; 4096
tokens per GPU): ``seq_*``: megatron ``SequentialMLP`` experts (local spec), ``grouped_*``:
``TEGroupedMLP`` (TE spec, ``moe_grouped_gemm``, TransformerEngine's ``GroupedLinear``). On 2
ranks: ``*_dp2``: experts whole on both (EP1, expert DP2), ``*_ep2``: 4 of the 8 experts per
rank (EP2), ``*_egtp2``: half of every expert's rows per rank (EP1 · EGTP2). On 4 ranks:
``*_ep2_dp2`` (EP2, expert DP2), ``*_ep2_egtp2`` (EP2 · EGTP2), ``*_ep4``. A mode's ranks are
its own (``--devices`` defaults to them; one launch runs modes of one size); the global batch is
micro-batch x ranks. The loss of an ``egtp2`` mode is compared with its ``dp2`` twin of the same
EP (the same initial weights: EP changes megatron's expert init seeds, and expert linears built
as EGTP shards start from the unsharded build's rows, design §3.1 "Exact init"), its step
time and memory with the twin that shards the experts by EP instead (the issue's baseline). A
mode takes modifiers as in ``bench_nemo.py``: ``seq_egtp2@prefetch_depth=2`` (a ``GTPConfig``
field) or ``@model.key=v``. ``cpu_*`` (``configs/moe_tiny_cpu.yaml``, fp32, ``SequentialMLP``,
allgather dispatcher) run the same launch on CPU.

One GPU (numerics only): ``--shared-device`` runs the ranks all on ``cuda:0`` (each the local
rank 0 of its own Lightning "node"), their CUDA collectives staged through host memory over gloo
(``nemo_gtp.cpu.staged_gloo``), as ``bench_nemo.py --shared-device`` does (its helpers), on a
cut of the recipe (:data:`SHARED_DEVICE_SHAPE`: 2 layers, hidden 512, 4 experts top-2,
sequence 512, vocabulary 1024, so the host-staged collectives stay small; ``--full-size``
keeps the recipe's shape). Step times, tokens/s, exposed communication and memory of such a run
mean nothing; losses, grad norms and the collective counts do:

    python -m bench.bench_moe --shared-device --modes grouped_dp2,grouped_egtp2 \\
        --timeout 165 --out DIR                        # EGTP2 vs EP1 · DP2, 2 ranks
    python -m bench.bench_moe --shared-device --modes grouped_ep2_dp2,grouped_ep2_egtp2 \\
        --timeout 165 --out DIR                        # EP2 · EGTP2 vs EP2 · DP2, 4 ranks
    python -m bench.bench_moe --shared-device --modes cpu_ep2_dp2,cpu_ep2_egtp2 --out DIR  # CPU

The whole run is bounded by ``--timeout`` (default 175 s): ranks still running then are killed
and the fits that finished are reported (rank 0 rewrites ``records.json`` after every fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.bench_nemo import (
    SHARED_DEVICE_NOTE,
    add_launch_arguments,
    check_launch_arguments,
    layout_modifiers,
    max_rel,
    parity_section,
    rank_environment,
    world_overrides,
)
from bench.common import ROOT, free_port, module_argv, with_root

CONFIG = "configs/moe_1b.yaml"
CPU_CONFIG = "configs/moe_tiny_cpu.yaml"
SHARED_DEVICE_SHAPE = (  # --shared-device: every collective is a host copy, keep them small
    "model.num_layers=2",
    "model.hidden_size=512",
    "model.ffn_hidden_size=2048",
    "model.num_attention_heads=8",
    "model.num_moe_experts=4",  # EP2: 2 local experts, EP4: 1 (a group of one GEMM)
    "model.moe_ffn_hidden_size=1024",
    "data.seq_length=512",  # 1024 tokens per rank: small all-to-alls
    "data.vocab_size=1024",  # embedding + output layer: 1 M parameters, not 98 M
)
_SEQ = ("model.layer_spec=local", "model.moe_grouped_gemm=false")
_GROUPED = ("model.layer_spec=te", "model.moe_grouped_gemm=true")
_DENSE_DP = ("strategy.num_weight_shards=1",)
_DP = ("strategy.expert_model_parallel_size=1", "strategy.expert_num_weight_shards=1")
_EP2 = ("strategy.expert_model_parallel_size=2", "strategy.expert_num_weight_shards=1")
_EGTP2 = ("strategy.expert_model_parallel_size=1", "strategy.expert_num_weight_shards=2")
_EP2_EGTP2 = ("strategy.expert_model_parallel_size=2", "strategy.expert_num_weight_shards=2")
_EP4 = ("strategy.expert_model_parallel_size=4", "strategy.expert_num_weight_shards=1")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode: recipe overrides on ``config``, its ranks, and the modes it is judged against:
    ``loss_baseline`` (the same initial weights and global batch: parity) and
    ``speed_baseline`` (the same expert bytes per rank by EP instead: step time, memory)."""

    overrides: tuple[str, ...]
    world: int = 2
    loss_baseline: str | None = None
    speed_baseline: str | None = None
    config: str = CONFIG


def _family(name: str, spec: tuple[str, ...], config: str = CONFIG) -> dict[str, Mode]:
    """The modes of one expert implementation (``spec``): 2 and 4 ranks, dense part DP."""
    dense = (*spec, *_DENSE_DP)
    return {
        f"{name}_dp2": Mode((*dense, *_DP), config=config),
        f"{name}_ep2": Mode((*dense, *_EP2), config=config),
        f"{name}_egtp2": Mode((*dense, *_EGTP2), 2, f"{name}_dp2", f"{name}_ep2", config=config),
        f"{name}_ep2_dp2": Mode((*dense, *_EP2), 4, config=config),
        f"{name}_ep4": Mode((*dense, *_EP4), 4, config=config),
        f"{name}_ep2_egtp2": Mode(
            (*dense, *_EP2_EGTP2), 4, f"{name}_ep2_dp2", f"{name}_ep4", config=config
        ),
    }


MODES: dict[str, Mode] = {
    **_family("seq", _SEQ),
    **_family("grouped", _GROUPED),
    # the recipe as shipped: dense GTP2 as well
    "seq_gtp2_egtp2": Mode((*_SEQ, *_EGTP2), 2, "seq_dp2", "seq_ep2"),
    "grouped_gtp2_egtp2": Mode((*_GROUPED, *_EGTP2), 2, "grouped_dp2", "grouped_ep2"),
    # tiny fp32 MoE on CPU (gloo; staged_gloo under --shared-device): the launch, end to end
    **_family("cpu", (), CPU_CONFIG),
}
DEFAULT_MODES = "seq_dp2,seq_ep2,seq_egtp2,grouped_dp2,grouped_ep2,grouped_egtp2"


def baselines(mode: str) -> tuple[str | None, str | None]:
    """(loss baseline, speed baseline) of ``mode``: its modifiers dropped but the layout ones
    (``bench_nemo.LAYOUT_KEYS``, e.g. ``@strategy.context_parallel_size=2``), which its
    baselines share; None for a mode that is a baseline itself."""
    base, *knobs = mode.split("@")
    entry = MODES.get(base)
    if entry is None:
        return None, None
    layout = layout_modifiers(knobs)
    return tuple(b and b + layout for b in (entry.loss_baseline, entry.speed_baseline))


def resolve_mode(mode: str) -> tuple[Mode, list[str]]:
    """``base[@knob=value...]`` → (the base mode, the modifiers' recipe overrides: a
    ``GTPConfig`` field, or with a dot any recipe key). Unknown base: ``ValueError``."""
    base, *knobs = mode.split("@")
    if base not in MODES:
        raise ValueError(f"unknown mode {base!r}: known are {', '.join(MODES)}")
    return MODES[base], [f"+{knob}" if "." in knob else f"+gtp.{knob}" for knob in knobs]


def plan_run(mode: str, world: int, shared_device: bool, full_size: bool) -> dict:
    """One fit of ``mode`` on ``world`` ranks, its recipe through the CLI's checks: config,
    overrides (the cut shape first, so a mode's ``@model.key=v`` wins; global batch = micro x
    ranks; the world, one-rank "nodes" under ``shared_device``), tokens per rank, precision.
    Raises ``RecipeError`` / ``ValueError`` (one line naming the setting)."""
    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.validate import validate_recipe

    entry, knobs = resolve_mode(mode)
    if entry.world != world:
        raise ValueError(
            f"runs on {entry.world} ranks, the launch has {world}: give --devices {entry.world} "
            "or launch it separately"
        )
    shape = []
    if shared_device and not full_size and entry.config != CPU_CONFIG:
        shape = list(SHARED_DEVICE_SHAPE)
    path = str(ROOT / entry.config)
    cfg = load_recipe(path, [*shape, *entry.overrides, *knobs])
    micro, seq = int(cfg.data.micro_batch_size), int(cfg.data.seq_length)
    overrides = [
        *shape,
        *entry.overrides,
        f"data.global_batch_size={micro * world}",  # one microbatch per rank and step
        *knobs,
        *world_overrides(world, shared_device),
    ]
    cfg = load_recipe(path, overrides)
    validate_recipe(cfg)
    return {
        "mode": mode,
        "config": entry.config,
        "overrides": overrides,
        "tokens_per_gpu": micro * seq,
        "precision": str(cfg.get("precision", "bf16-mixed")),
    }


def launch_plan(
    modes: list[str], devices: int | None, shared_device: bool = False, full_size: bool = False
) -> tuple[list[dict], int, list[str]]:
    """(the runs in order, the launch's ranks: ``devices`` or the first known mode's, the
    errors: one line per mode that is unknown, of another size, or fails the recipe checks)."""
    from nemo_gtp.recipes.config import RecipeError

    known = [MODES[m.split("@")[0]] for m in modes if m.split("@")[0] in MODES]
    world = devices or (known[0].world if known else 2)
    runs, errors = [], []
    for mode in modes:
        try:
            runs.append(plan_run(mode, world, shared_device, full_size))
        except (RecipeError, ValueError) as err:
            errors.append(f"{mode}: {err}")
    return runs, world, errors


def check_modes(modes: list[str]) -> list[str]:
    """Every mode's recipe through the CLI's checks on its own ranks, plain and under
    ``--shared-device`` (no torch); the errors, one line each."""
    errors = []
    for mode in modes:
        base = MODES.get(mode.split("@")[0])
        world = base.world if base else 2
        for shared in (False, True):
            errors += [e for e in launch_plan([mode], world, shared)[2] if e not in errors]
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
    from bench.bench_nemo import steps_callback, timed_fit
    from nemo_gtp.recipes.launch import teardown_fit
    from nemo_gtp.recipes.loader import load_recipe

    spec = json.loads(Path(spec_path).read_text())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    shared = spec.get("shared_device", False)
    if shared:  # registers "staged_gloo", the recipes' process-group backend
        import nemo_gtp.cpu.staged_gloo  # noqa: F401
    out = []
    for i, run in enumerate(spec["runs"]):
        record: dict = {"mode": run["mode"], "tokens_per_gpu": run["tokens_per_gpu"]}
        started = time.perf_counter()
        try:
            # shared: no exposed-communication or host/GPU split steps (they would mean nothing)
            steps = steps_callback(spec["warmup"], spec["timed"], False, timing=not shared)
            probe = _expert_probe(reset_at=spec["warmup"])
            cfg = load_recipe(
                str(ROOT / run["config"]),
                [*run["overrides"], f"trainer.max_steps={steps.total_steps}"],
            )
            store = str(Path(spec["dir"], f"store{i}"))
            fitted = timed_fit(cfg, [steps, probe], steps, store, world, run["tokens_per_gpu"])
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
def _parity(records: list[dict]) -> str:
    """Each mode against its loss baseline in this launch: ``bench_nemo.py``'s parity table and
    ``PARITY ...`` verdict lines."""
    by = {r["mode"]: r for r in records if "error" not in r}
    pairs = []
    for mode, r in by.items():
        loss_base = baselines(mode)[0]
        if loss_base in by:
            tokens = r.get("tokens_per_gpu", 4096)  # older records: the recipe's 4096
            pairs.append((mode, loss_base, tokens, r, by[loss_base]))
    notes = [
        "Linears built as their (E)GTP shards, dense and expert, start from the unsharded "
        'build\'s rows (design §3.1 "Exact init"): a GTP or EGTP mode starts from its '
        "baseline's weights (step-0 loss identical) and tracks it within the precision's "
        "tolerance."
    ]
    return parity_section(pairs, notes)


def report(records: list[dict], out: Path) -> str:
    """The markdown table, the parity table and verdicts (also written to
    ``out/bench_moe.md``)."""
    by = {r["mode"]: r for r in records}
    lines = [
        "| mode | step ms | vs speed baseline | tokens/s/GPU | peak GiB | "
        "expert params/GPU (M) | expert weights per gather / per reduce-scatter | "
        "exposed gather / RS ms | max loss rel diff vs loss baseline | loss first → last |",
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
            worst = max_rel(r["losses"], loss_base["losses"])
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
    shared = next((r["shared_device"] for r in records if r.get("shared_device")), 0)
    table = (
        (SHARED_DEVICE_NOTE.format(n=shared) + "\n\n" if shared else "")
        + "\n".join(lines)
        + _parity(records)
    )
    tokens = sorted({r["tokens_per_gpu"] for r in records if "tokens_per_gpu" in r})
    where = f"{shared} ranks on one GPU" if shared else "one GPU per rank"
    (out / "bench_moe.md").write_text(
        f"# bench_moe.py: MoE recipe, {where}, {'/'.join(map(str, tokens))} tokens per GPU\n\n"
        + table
        + "\n\nvs speed baseline: step time over the mode that shards the experts by EP "
        "instead (`egtp2` over `ep2`, `ep2_egtp2` over `ep4`); loss diff: over its `dp2` twin "
        "of the same EP (same initial weights). Expert weights per gather: weights one "
        "expert-runtime all-gather / reduce-scatter carries, over the steps after warmup (8 = "
        "one collective per group of 8 local experts at EP1).\n"
    )
    return table


def _launch(spec: Path, out: Path, world: int, shared: bool, timeout: float) -> int:
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_environment(rank, world, shared, port)
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            module_argv("bench.bench_moe", "--rank-main", str(spec)),
            env=with_root(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills all it started
        )
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    codes = []
    for rank, (proc, log) in enumerate(procs):
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(124)
            print(f"rank {rank}: killed after the {timeout:.0f} s timeout")
        log.close()
    return max(codes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--warmup", type=int, default=None, help="default 4 (2 shared)")
    parser.add_argument(
        "--timed",
        type=int,
        default=None,
        help="timed steps: default 20 (6 more follow), 13 under --shared-device (none follow)",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="ranks (default: the modes' own, 2 or 4)"
    )
    parser.add_argument("--timeout", type=float, default=175.0, help="seconds for all fits")
    add_launch_arguments(parser, SHARED_DEVICE_SHAPE)
    args = parser.parse_args(argv)
    check_launch_arguments(parser, args)
    if args.warmup is None:
        args.warmup = 2 if args.shared_device else 4
    if args.timed is None:
        args.timed = 13 if args.shared_device else 20
    return args


PLAN_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    modes = args.modes.split(",")
    runs, world, errors = launch_plan(modes, args.devices, args.shared_device, args.full_size)
    if args.dry_run or errors:
        plan = {
            "shared_device": args.shared_device,
            "world": world,
            "runs": runs,
            "ranks": [
                {k: rank_environment(r, world, args.shared_device, 0)[k] for k in PLAN_ENV}
                for r in range(world)
            ],
            "errors": errors,
        }
        print(json.dumps(plan, indent=1))
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        print(f"{len(runs)} of {len(modes)} modes pass the recipe checks", file=sys.stderr)
        return 1 if errors else 0
    out.mkdir(parents=True, exist_ok=True)
    if args.shared_device:
        device = "the CPU" if all(r["config"] == CPU_CONFIG for r in runs) else "cuda:0"
        print(
            f"--shared-device: {world} ranks on {device}, collectives staged through the host "
            "(staged_gloo): numerics only, step times mean nothing",
            flush=True,
        )
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
                "shared_device": args.shared_device,
            }
        )
    )
    code = _launch(spec, out, world, args.shared_device, args.timeout)
    path = work / "records.json"
    records = json.loads(path.read_text()) if path.exists() else []
    precision = {run["mode"]: run["precision"] for run in runs}
    for record in records:
        record["precision"] = precision.get(record["mode"])
        record["shared_device"] = world if args.shared_device else 0  # ranks on one GPU
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

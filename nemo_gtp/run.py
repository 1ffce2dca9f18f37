"""Run a recipe: ``python -m nemo_gtp.run configs/<recipe>.yaml [key=value ...]``, or a NeMo
recipe: ``python -m nemo_gtp.run --recipe llama3_8b --num-weight-shards 4 [key=value ...]``.

NeMo recipes (``--recipe``) are handled by :mod:`nemo_gtp.recipes.nemo_cli`: NeMo's
``llm.<name>.pretrain_recipe``, NeMo-Run's overrides, :func:`nemo_gtp.recipes.with_gtp`, launched
through NeMo-Run (torchrun here, or Slurm). The rest of this docstring is about YAML recipes.

The recipe and the overrides are checked in this process before any worker starts
(:mod:`nemo_gtp.recipes.validate`, value ranges in :mod:`nemo_gtp.recipes.ranges`): a wrong key
or value exits with one ``error:`` line naming it. A run first prints its layout, model size and
log directory (:func:`describe_run`), then one line per logged step; NeMo's and Lightning's own
messages go to the log directory's files (:func:`nemo_gtp.recipes.quiet.quiet_console`) unless
``--verbose``. ``--compare-baseline`` trains the recipe twice, as written (GTP) and with
``strategy.num_weight_shards`` (and ``strategy.expert_num_weight_shards``, if the recipe sets it)
set to the tensor-parallel size (plain TP + DP, same global
batch), both in one launch of ``trainer.devices`` processes (one after the other, see
``nemo_gtp.recipes.launch``), prints both loss curves side by side and ends with one
``VERDICT:`` line. Every run logs through NeMo's ``nl.NeMoLogger`` (TensorBoard) into
``--log-dir`` (default ``runs/<recipe name>``; the two runs of ``--compare-baseline`` into its
``gtp/`` and ``baseline/``), and the comparison is drawn from those logs by
:mod:`nemo_gtp.report`.

Examples::

    python -m nemo_gtp.run configs/tiny_cpu.yaml --compare-baseline
    python -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=50 strategy.num_weight_shards=2
    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=10 \
        +checkpoint.dir=ckpts +checkpoint.every_n_train_steps=10
    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=20 +resume=ckpts/step=9
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

# The comparison's tolerance, VERDICT line and report are nemo_gtp.report's (the NeMo-recipe CLI
# prints them too); re-exported here, the command they serve.
from nemo_gtp.report import TOLERANCE, report_comparison, verdict

__all__ = ["TOLERANCE", "build_parser", "check", "main", "report_comparison", "verdict"]

PROG = "python -m nemo_gtp.run"
EPILOG = f"""\
YAML recipe overrides (OmegaConf dot paths, checked before anything starts):
  key=value             change a key the recipe has, e.g. trainer.max_steps=50
  +key=value            add a key, e.g. +data.seed=3 or +model.activation_func=silu
  +checkpoint.dir=DIR +checkpoint.every_n_train_steps=N
                        save a full checkpoint every N steps, as DIR/step=K/ (torch_dist
                        weights/, and NeMo's context/ unless +checkpoint.context=false)
  +resume=DIR/step=K    continue from that checkpoint, at this recipe's layout (any TP/GTP/DP)
  +resume=latest        continue from the newest committed checkpoint in checkpoint.dir (none
                        yet: step 0), so a requeued job reruns the same command
  +restore=DIR/step=K   start from that checkpoint's weights (step 0, a new optimizer): fine-
                        tuning, e.g. with +peft.method=lora (NeMo's LoRA, or canonical_lora;
                        its checkpoints hold the adapters and name this base, +resume restarts
                        from them, NeMo's llm.peft.merge_lora merges them into the base)
  strategy.num_weight_shards=TPxGTP
                        the GTP degree is num_weight_shards / tensor_model_parallel_size;
                        data.global_batch_size must be a multiple of micro_batch_size x DP x GTP
  +faults.collective_timeout_s=S
                        a rank that stops entering collectives ends the job after S s (300)
  +faults.preemption=false
                        a SIGTERM no longer saves at the next step boundary and exits 0
  +callbacks.NAME.target=pkg.mod.Class +callbacks.NAME.ARG=VALUE
                        add a Lightning callback by import path, with its arguments

NeMo recipes (--recipe NAME: nemo.collections.llm.recipes.NAME.pretrain_recipe):
  overrides are NeMo-Run's dotted keys into the recipe, e.g. trainer.max_steps=10
  model.config.num_layers=2 trainer.strategy.tensor_model_parallel_size=2; the recipe is
  converted by nemo_gtp.recipes.with_gtp (settings GTP cannot honour are fixed with a note or
  rejected) and launched through NeMo-Run: torchrun on this machine (--executor local; for
  several nodes run the same command on each with MASTER_ADDR, MASTER_PORT, NODE_RANK set) or
  sbatch (--executor slurm). Everything is checked before anything is launched.
  {PROG} --recipe llama3_8b --num-weight-shards 4 trainer.max_steps=100
  {PROG} --recipe nemotron4_15b --num-weight-shards 8 --nodes 2 --executor slurm \\
      --slurm-account ACCT --slurm-partition batch --job-dir /lustre/me/runs --dryrun
  {PROG} --recipe llama3_8b --num-weight-shards 4 --data data/corpus \\
      --tokenizer sentencepiece:data/tok.model   # python -m nemo_gtp.data builds them

examples:
  {PROG} configs/tiny_cpu.yaml --compare-baseline
  {PROG} configs/tiny_cpu.yaml trainer.max_steps=10 strategy.num_weight_shards=4
  {PROG} configs/tiny_cpu.yaml trainer.max_steps=10 \\
      +checkpoint.dir=ckpts +checkpoint.every_n_train_steps=10
  {PROG} configs/tiny_cpu.yaml trainer.max_steps=20 +resume=ckpts/step=9
  {PROG} configs/gpt_125m.yaml trainer.max_steps=50 --loss-log losses.jsonl   # 2 GPUs
  python -m nemo_gtp.report runs/tiny_cpu/gtp runs/tiny_cpu/baseline -o plot.png
"""


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (``--help`` documents overrides and examples)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train with GTP (GTPMegatronStrategy): a YAML recipe of configs/, or one of "
        "NeMo 2's own recipes (--recipe) launched through NeMo-Run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG.yaml] [key=value ...]",
        help="a recipe YAML (e.g. configs/tiny_cpu.yaml; not with --recipe), then overrides: "
        "key=value or +key=value for YAML, NeMo-Run's key=value for --recipe (see below)",
    )
    parser.add_argument(
        "--compare-baseline",
        action="store_true",
        help="also train without GTP (num_weight_shards = TP, same global batch) in the same "
        "launch, print both loss curves and one VERDICT line (exit 1 if they do not match)",
    )
    parser.add_argument(
        "--loss-log",
        metavar="FILE",
        help='append rank 0\'s per-step {"step", "loss", "ms"} JSON lines to FILE (with '
        '--recipe, in-fit validation losses go to FILE\'s ".val" sibling)',
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        help="TensorBoard logs (NeMo's NeMoLogger) and NeMo's text logs go here; with "
        "--compare-baseline into DIR/gtp and DIR/baseline (default: runs/<recipe name>); a run "
        "that does not resume replaces the TensorBoard logs it finds there",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print NeMo's, Lightning's and megatron's own messages (config dumps, gradient "
        "buckets, model summary) and the known-harmless warnings too; by default the first "
        "lines are the layout, model size and log directory, then one line per logged step, "
        "and those messages are in the log directory's *_log_globalrank-*.txt files",
    )
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="with --compare-baseline: where to draw both runs' loss, step time, exposed GTP "
        "communication and memory (default: <log dir>/gtp_vs_baseline.png); the VERDICT line "
        "names it",
    )
    nemo = parser.add_argument_group("NeMo recipes (--recipe)")
    nemo.add_argument(
        "--recipe",
        metavar="NAME",
        help="a NeMo pretraining recipe (llama3_8b, llama3_70b, nemotron4_15b, ...) or "
        "module:factory returning one",
    )
    nemo.add_argument("--num-weight-shards", type=int, metavar="N", help="TP x GTP")
    nemo.add_argument(
        "--expert-num-weight-shards",
        type=int,
        metavar="N",
        help="MoE: shards per routed-expert weight, ETP x EGTP (default: experts whole)",
    )
    nemo.add_argument(
        "--gtp",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a GTPConfig option, e.g. --gtp pad_for_alignment=16 (repeatable)",
    )
    nemo.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    nemo.add_argument("--devices", type=int, default=8, help="GPUs (processes) per node")
    nemo.add_argument("--name", help="run name (default <recipe>_gtp)")
    nemo.add_argument("--dir", help="NeMo log/checkpoint directory (default ./nemo_experiments)")
    nemo.add_argument(
        "--data",
        action="append",
        metavar="PREFIX",
        help="train on megatron indexed data PREFIX.bin/.idx (NeMo's PreTrainingDataModule, "
        "keeping the recipe's sequence length and batch sizes); repeat to blend",
    )
    nemo.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="the tokenizer --data was built with: sentencepiece:PATH, huggingface:DIR, byte; "
        "without --data, the tokenizer of the recipe's mock data (byte: offline)",
    )
    nemo.add_argument("--executor", choices=("local", "slurm"), default="local")
    nemo.add_argument("--slurm-account")
    nemo.add_argument("--slurm-partition")
    nemo.add_argument("--slurm-time", default="04:00:00")
    nemo.add_argument("--container-image")
    nemo.add_argument("--job-dir", help="Slurm: NeMo-Run's job files, on a shared filesystem")
    nemo.add_argument(
        "--dryrun",
        action="store_true",
        help="check and write what would be launched (Slurm: the sbatch script), launch nothing",
    )
    nemo.add_argument(
        "--cpu",
        action="store_true",
        help="run the recipe on CPU processes with gloo (tests; nemo_gtp.recipes.cpu)",
    )
    return parser


def default_log_dir(config: str) -> Path:
    """``runs/<recipe name>``: where a run of ``config`` logs unless ``--log-dir`` says."""
    return Path("runs", Path(config).stem)


def is_first_process() -> bool:
    """True in the job's global rank 0, before torch.distributed starts: torchrun sets
    ``RANK``; Lightning's launcher re-runs this command for a node's other processes with
    ``LOCAL_RANK=1..`` (and ``NODE_RANK``), the process that launched them being local rank 0."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def fresh_tensorboard_dir(log_dir: Path) -> None:
    """Remove the TensorBoard event files an earlier run left in ``log_dir`` (a new run's curve
    would otherwise be merged with the old one's by step)."""
    import shutil

    from nemo_gtp.recipes.loader import TB_SUBDIR

    shutil.rmtree(log_dir / TB_SUBDIR, ignore_errors=True)


def describe_run(cfg: object, log_dir: Path) -> list[str]:
    """What a user needs before the first step: the layout, the model's size and where the
    logs go (``python -m nemo_gtp.run`` prints these lines first).

    Example::

        describe_run(check("configs/tiny_cpu.yaml", []), Path("runs/tiny_cpu"))
        # ["layout: TP1·GTP2·DP2 on 4 CPU processes (gloo); GPT of ~0.11 M parameters (2 layers,
        #   hidden 64, vocab 128); 30 steps of 16 x 32 tokens", "logs: runs/tiny_cpu (...)"]
    """
    from nemo_gtp.engine.grid import layout_dims
    from nemo_gtp.recipes.model_size import yaml_model_sizes

    trainer, strategy = cfg.trainer, cfg.strategy  # type: ignore[attr-defined]
    world = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    dims = layout_dims(strategy, "strategy").with_world_size(world)
    cpu = str(trainer.get("accelerator", "")) == "cpu"
    data = cfg.data  # type: ignore[attr-defined]
    steps = f"{trainer.get('max_steps')} steps of {data.global_batch_size} x {data.seq_length}"
    logs = f"{log_dir} (TensorBoard; "
    return _first_lines(dims, yaml_model_sizes(cfg), world, cpu, steps, logs)


def describe_nemo_run(recipe: object, args: argparse.Namespace) -> list[str]:
    """:func:`describe_run` for ``--recipe NAME``: the layout, the model's size and where the
    logs go, read from NeMo's recipe after ``with_gtp`` (printed before NeMo-Run launches).

    Example: ``describe_nemo_run(with_gtp(recipe, num_weight_shards=2), args)``.
    """
    from nemo_gtp.recipes.convert import strategy_dims
    from nemo_gtp.recipes.model_shape import recipe_model_sizes
    from nemo_gtp.recipes.sequence import nemo_log_dir

    trainer = recipe.trainer  # type: ignore[attr-defined]
    world = int(args.nodes) * int(args.devices)
    experts = getattr(args, "expert_num_weight_shards", None)
    dims = strategy_dims(trainer.strategy, args.num_weight_shards, experts)
    sizes = recipe_model_sizes(recipe, f"--recipe {args.recipe!r}")
    data = recipe.data  # type: ignore[attr-defined]
    steps = f"{trainer.max_steps} steps of {data.global_batch_size} x {data.seq_length}"
    logs = f"{nemo_log_dir(recipe.log)} ("  # type: ignore[attr-defined]
    return _first_lines(dims.with_world_size(world), sizes, world, args.cpu, steps, logs)


def _first_lines(dims: Any, sizes: dict, world: int, cpu: bool, steps: str, logs: str) -> list[str]:
    """The two first lines of :func:`describe_run` and :func:`describe_nemo_run` (``dims``: the
    run's ``GTPParallelDims`` with its world size)."""
    from nemo_gtp.recipes.model_size import parameter_count

    tp, pp = dims.tensor_model_parallel_size, dims.pipeline_model_parallel_size
    cp = dims.context_parallel_size
    parts = [f"TP{tp}", *[f"PP{pp}"] * (pp > 1), *[f"CP{cp}"] * (cp > 1)]
    parts += [f"GTP{dims.gtp}", f"DP{dims.dp}"]
    where = f"{world} CPU processes (gloo)" if cpu else f"{world} GPUs"
    shape = f"{sizes['layers']} layers, hidden {sizes['hidden']}, vocab {sizes['vocab']}"
    layout = "·".join(parts)
    if sizes["experts"]:
        layout += f", experts EP{dims.expert_model_parallel_size}·EGTP{dims.egtp}"
        shape += f", {sizes['experts']} experts, top-{sizes['topk']}"
    count = parameter_count(**sizes) / 1e6
    return [
        f"layout: {layout} on {where}; GPT of ~{count:.2f} M parameters ({shape}); {steps} tokens",
        f"logs: {logs}NeMo's and Lightning's messages in its *_log_globalrank-*.txt, or here "
        "with --verbose)",
    ]


def check(config: str, overrides: list[str]) -> object:
    """Load and check a recipe in this process (no torch / NeMo): the config, or RecipeError."""
    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.validate import check_installed, validate_recipe

    cfg = load_recipe(config, overrides)
    validate_recipe(cfg)
    check_installed(cfg)
    return cfg


def _compare(
    config: str,
    overrides: list[str],
    cfg: object,
    plot: str | None = None,
    log_dir: str | None = None,
) -> int:
    from nemo_gtp.recipes.launch import launch_fits

    strategy = cfg.strategy  # type: ignore[attr-defined]
    tp = int(strategy.get("tensor_model_parallel_size", 1))
    shards = int(strategy.get("num_weight_shards") or tp)
    baseline = [*overrides, f"strategy.num_weight_shards={tp}"]
    name = f"GTP (TP{tp}·GTP{shards // tp}"
    if strategy.get("expert_num_weight_shards") is not None:  # expert GTP off too (MoE recipes)
        etp = int(strategy.get("expert_tensor_parallel_size") or tp)
        baseline.append(f"strategy.expert_num_weight_shards={etp}")
        name += f"·EGTP{int(strategy.expert_num_weight_shards) // etp}"
    check(config, baseline)  # e.g. the baseline's global batch (DP x GTP ranks are the same)
    if cfg.get("checkpoint") or cfg.get("resume") is not None:  # type: ignore[attr-defined]
        from nemo_gtp.recipes.config import RecipeError

        raise RecipeError(  # the baseline would save over (and resume from) the GTP run's saves
            "--compare-baseline trains two runs from step 0: drop checkpoint and resume, or run "
            "without --compare-baseline"
        )
    runs = {f"{name})": overrides, f"baseline (TP{tp}, no GTP)": baseline}
    root = Path(log_dir) if log_dir else default_log_dir(config)
    dirs = dict(zip(runs, (root / "gtp", root / "baseline"), strict=True))
    for directory in dirs.values():
        fresh_tensorboard_dir(directory)
    start = time.perf_counter()
    print("\n".join(describe_run(cfg, root)), flush=True)
    for name, args in runs.items():
        print(f"=== {name}: {PROG} {config} {' '.join(args)}", flush=True)
    try:
        logs = launch_fits(config, runs, log_dirs={n: str(d) for n, d in dirs.items()})
    except RuntimeError as err:
        print(f"training failed: {err}", flush=True)
        print("VERDICT: GTP did not match the baseline (training failed)", flush=True)
        return 1
    precision = str(cfg.get("precision", "32"))  # type: ignore[attr-defined]
    return report_comparison(logs, precision, plot, Path(config).stem, start, log_dirs=dirs)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nemo_gtp.run``; returns the exit status (2: bad input)."""
    from nemo_gtp.recipes.config import RecipeError
    from nemo_gtp.recipes.quiet import quiet_known_warnings

    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # options may sit between the overrides
    if args.verbose:  # inherited by every process started below
        from nemo_gtp.recipes.quiet import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    if args.recipe is not None:
        from nemo_gtp.recipes.nemo_cli import main_recipe

        args.overrides = args.args
        return main_recipe(args, describe=describe_nemo_run)
    if not args.args:
        parser.error("give a recipe YAML (e.g. configs/tiny_cpu.yaml) or --recipe NAME")
    args.config, args.overrides = args.args[0], args.args[1:]
    try:
        cfg = check(args.config, args.overrides)
    except RecipeError as err:  # a user error: one line, no traceback, before any worker
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    quiet_known_warnings()  # not inherited: every process started below installs it too
    if str(cfg.trainer.get("accelerator", "")) == "cpu":  # type: ignore[attr-defined]
        # No NCCL, so no flight recorder to quiet; set the new name so GTP's quiet_flight_recorder
        # leaves the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE alone (torch warns per rank on it).
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    if args.compare_baseline:
        try:
            return _compare(args.config, args.overrides, cfg, args.plot, args.log_dir)
        except RecipeError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
            return 2
    from nemo_gtp.recipes.loader import LossLog, ProgressLog, build_fit
    from nemo_gtp.recipes.resume import LATEST, resume_path

    data, trainer = cfg.data, cfg.trainer  # type: ignore[attr-defined]
    callbacks = [
        ProgressLog(
            tokens_per_step=int(data.global_batch_size) * int(data.seq_length),
            every_n_steps=int(trainer.get("log_every_n_steps", 50)),  # Lightning's default
        )
    ]
    if args.loss_log:
        callbacks.append(LossLog(args.loss_log))
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir(args.config)
    resume = resume_path(cfg)  # resume=latest: the newest committed checkpoint, or none yet
    rank0 = is_first_process()
    if rank0 and str(cfg.get("resume")) == LATEST:  # type: ignore[attr-defined]
        found = f"from {resume}" if resume else "at step 0: no committed checkpoint yet"
        print(f"resume=latest: starting {found} in {cfg.checkpoint.dir}", flush=True)  # type: ignore[attr-defined]
    resumes = resume is not None
    if rank0 and not resumes:  # a resumed run continues its curve
        fresh_tensorboard_dir(log_dir)
    if rank0:
        print("\n".join(describe_run(cfg, log_dir)), flush=True)
    if "RANK" not in os.environ and int(trainer.get("num_nodes", 1)) == 1:  # not torchrun's
        from nemo_gtp.recipes.launch import run_recipe  # watches the ranks, says why one failed

        status = run_recipe(
            args.config, args.overrides, loss_log=args.loss_log, log_dir=str(log_dir)
        )
        if status == 0:
            print(f"TensorBoard logs: {log_dir}; plot: python -m nemo_gtp.report {log_dir}")
        return status
    fit = build_fit(cfg, callbacks=callbacks, log_dir=str(log_dir))  # type: ignore[arg-type]
    fit.run()
    if fit.trainer.global_rank == 0:
        print(f"TensorBoard logs: {log_dir}; plot: python -m nemo_gtp.report {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

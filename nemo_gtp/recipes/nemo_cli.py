"""``python -m nemo_gtp.run --recipe NAME --num-weight-shards N [key=value ...]``: NeMo recipes.

The recipe is NeMo's own (``llm.<NAME>.pretrain_recipe(...)``), the overrides NeMo-Run's
(dotted keys into the recipe, parsed by ``nemo_run.cli``: ``trainer.max_steps=10
model.config.num_layers=2``), the conversion :func:`~nemo_gtp.recipes.convert.with_gtp`, the
launch NeMo-Run's (:mod:`nemo_gtp.recipes.executors`: torchrun on this machine, or Slurm).
Everything that can be checked is checked here, in the parent process, before anything is
launched (:func:`check_recipe`): a bad override, setting, size or batch exits with status 2
and one ``error:`` line naming it.

Example::

    python -m nemo_gtp.run --recipe llama3_8b --num-weight-shards 4 trainer.max_steps=100 \\
        --data data/corpus --tokenizer sentencepiece:data/tok.model
"""

from __future__ import annotations

import copy
import difflib
import importlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.cpu import FUSIONS


def _nemo_recipe_names() -> list[str]:
    """The modules of ``nemo.collections.llm.recipes`` that have a ``pretrain_recipe``."""
    import pkgutil

    from nemo.collections.llm import recipes

    names = []
    for info in pkgutil.iter_modules(recipes.__path__):
        try:
            module = importlib.import_module(f"{recipes.__name__}.{info.name}")
        except Exception:  # a recipe whose optional dependencies are missing
            continue
        if callable(getattr(module, "pretrain_recipe", None)):
            names.append(info.name)
    return sorted(names)


def load_nemo_recipe(name: str, *, run_name: str, directory: str, nodes: int, devices: int) -> Any:
    """``nemo.collections.llm.recipes.<name>.pretrain_recipe(...)``, or ``pkg.module:factory``.

    A ``module:function`` factory is called with the same keywords NeMo's take (``name``,
    ``dir``, ``num_nodes``, ``num_gpus_per_node``) and must return a recipe ``run.Partial``.
    Example::

        recipe = load_nemo_recipe("llama3_8b", run_name="r", directory="/tmp/r", nodes=1,
                                  devices=8)
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise RecipeError(f"--recipe {name!r}: {err}") from None
    else:
        try:
            module = importlib.import_module(f"nemo.collections.llm.recipes.{name}")
            factory = module.pretrain_recipe
        except (ImportError, AttributeError):
            names = _nemo_recipe_names()
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(
                f"--recipe {name!r} is not a NeMo pretraining recipe{hint}: one of "
                f"{', '.join(names)}, or module:factory"
            ) from None
    return factory(name=run_name, dir=directory, num_nodes=nodes, num_gpus_per_node=devices)


def apply_overrides(recipe: Any, overrides: list[str]) -> Any:
    """NeMo-Run's ``key=value`` overrides (``nemo_run.cli.parse_cli_args``), one at a time so
    that an error names the override; :class:`RecipeError` on the first bad one.

    Example::

        apply_overrides(recipe, ["trainer.max_steps=10", "model.config.num_layers=2"])
        apply_overrides(recipe, ["trainer.max_step=10"])  # RecipeError: ... 'trainer.max_steps'?
    """
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. trainer.max_steps=10)")
        try:
            parse_cli_args(recipe, [item])
        except (CLIException, ValueError, TypeError, AttributeError) as err:
            message = _override_problem(recipe, item.split("=", 1)[0].rstrip("+-*/"))
            if message is None:  # nemo_run's message, without the recipe it prints after it
                message = str(err).split(" (Argument:")[0].split(" for <")[0].splitlines()[0]
            raise RecipeError(f"override {item!r}: {message}") from None
    return recipe


def _override_problem(recipe: Any, key: str) -> str | None:
    """What is wrong with the dotted ``key`` (a missing section or parameter), else None."""
    import inspect

    *parents, last = key.split(".")
    target, walked = recipe, []
    for part in parents:
        try:
            target = getattr(target, part)
        except (AttributeError, TypeError):
            return f"the recipe has no {'.'.join([*walked, part])}"
        walked.append(part)
    fn = getattr(target, "__fn_or_cls__", None)
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if last in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    close = difflib.get_close_matches(last, list(params), n=1)
    hint = f" (did you mean {'.'.join([*walked, close[0]])!r}?)" if close else ""
    return f"{getattr(fn, '__name__', fn)} has no parameter {last!r}{hint}"


def _parse_gtp_options(items: list[str]) -> dict[str, Any]:
    """``--gtp key=value`` items -> ``GTPConfig`` keyword arguments (values as YAML scalars)."""
    import yaml

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--gtp {item!r} is not key=value (e.g. --gtp pad_for_alignment=16)")
        options[key] = yaml.safe_load(value)
    return options


def check_recipe(recipe: Any) -> None:
    """Build what is cheap to build (no process, no device): the strategy (its argument checks),
    the model config with the strategy's parallel sizes (megatron's shape checks), the optimizer
    config; indexed data prefixes must exist. :class:`RecipeError` naming the section.

    Example::

        check_recipe(with_gtp(recipe, num_weight_shards=8))  # before run.run(...)
    """
    import fiddle as fdl

    from nemo_gtp.recipes.convert import config_arg
    from nemo_gtp.recipes.ranges import check_nemo_recipe_settings

    check_nemo_recipe_settings(recipe)  # value ranges, the YAML recipes' rules (one place)
    strategy = recipe.trainer.strategy
    try:
        fdl.build(strategy)
    except Exception as err:  # noqa: BLE001 - the strategy's own checks raise ValueError
        raise RecipeError(f"trainer.strategy: {err}".splitlines()[0]) from None
    config = config_arg(config_arg(recipe, "model"), "config")
    if isinstance(config, fdl.Buildable):
        config = copy.deepcopy(config)
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "sequence_parallel",
            "expert_model_parallel_size",
        ):
            value = config_arg(strategy, key)
            if value is not None:
                setattr(config, key, value)
        # Fused kernels are checked against what this process can import (TE, Apex): the
        # parent (a login node, a CPU box) may lack what the GPU workers have.
        for key in FUSIONS:
            if key in config.__arguments__ or hasattr(config, key):
                setattr(config, key, False)
        try:
            built = fdl.build(config)
        except Exception as err:  # noqa: BLE001 - megatron's config checks
            raise RecipeError(f"model.config: {err}".splitlines()[0]) from None
        heads, groups = built.num_attention_heads, getattr(built, "num_query_groups", None)
        if groups and heads % groups:
            raise RecipeError(
                f"model.config.num_attention_heads={heads} must be a multiple of "
                f"model.config.num_query_groups={groups}"
            )
    optim = config_arg(config_arg(recipe, "optim"), "config")
    if isinstance(optim, fdl.Buildable):
        try:
            fdl.build(optim)
        except Exception as err:  # noqa: BLE001
            raise RecipeError(f"optim.config: {err}".splitlines()[0]) from None
    paths = config_arg(config_arg(recipe, "data"), "paths")
    if isinstance(paths, str | list):
        from nemo_gtp.data.module import check_indexed_prefix, is_blend_weight

        for path in [paths] if isinstance(paths, str) else paths:
            if not is_blend_weight(path):
                try:
                    check_indexed_prefix(str(path), where="data.paths")
                except ValueError as err:
                    raise RecipeError(str(err)) from None


def _check_baseline(recipe: Any) -> None:
    """The recipe as given (no GTP): its layout tiles the world, its batch divides, and its
    strategy and configs build."""
    from nemo_gtp.recipes.convert import check_batch_arithmetic, config_arg, strategy_dims

    strategy = recipe.trainer.strategy
    tp = config_arg(strategy, "tensor_model_parallel_size", 1)
    check_batch_arithmetic(recipe, strategy_dims(strategy, tp, None))
    check_recipe(recipe)


def _recipe_precision(recipe: Any) -> str:
    """``"32"`` or the mixed-precision plugin's ``precision`` (the loss tolerance's key)."""
    plugins = recipe.trainer.plugins
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        precision = getattr(plugin, "precision", None)
        if precision is not None:
            return str(precision)
    return "32"


def _add_callback(recipe: Any, callback: Any) -> None:
    callbacks = list(getattr(recipe.trainer, "callbacks", None) or [])
    recipe.trainer.callbacks = [*callbacks, callback]


def _build_recipes(args: Any) -> tuple[Any, Any | None, dict[str, Path]]:
    """The GTP recipe, its baseline (``--compare-baseline``) and their loss logs (``"gtp"``,
    ``"baseline"``), all checked; :class:`RecipeError` naming the first problem."""
    import nemo_run as run

    from nemo_gtp.recipes.convert import with_gtp
    from nemo_gtp.recipes.loader import LossLog, ProgressLog

    if args.num_weight_shards is None:
        raise RecipeError("--recipe needs --num-weight-shards N (= TP x GTP)")
    if args.compare_baseline and args.executor != "local":
        raise RecipeError("--compare-baseline runs with --executor local (it reads both loss logs)")
    recipe = load_nemo_recipe(
        args.recipe,
        run_name=args.name or f"{args.recipe.split(':')[-1]}_gtp",
        directory=args.dir,
        nodes=args.nodes,
        devices=args.devices,
    )
    if args.data:
        if not args.tokenizer:
            raise RecipeError("--data needs --tokenizer (the spec the data was built with)")
        from nemo_gtp.data.module import pretraining_data

        try:
            recipe.data = pretraining_data(args.data, args.tokenizer, like=recipe.data)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    elif args.tokenizer:  # the recipe's own (mock) data with this tokenizer, e.g. "byte" offline
        from nemo_gtp.data.tokenizers import tokenizer_config

        try:
            recipe.data.tokenizer = tokenizer_config(args.tokenizer)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    if args.cpu:
        from nemo_gtp.recipes.cpu import on_cpu

        on_cpu(recipe)
    apply_overrides(recipe, args.overrides)
    launched = {"devices": ("--devices", args.devices), "num_nodes": ("--nodes", args.nodes)}
    for key, (flag, value) in launched.items():
        # the executor starts the flag's count (NeMo-Run parses trainer.devices=2 as "2")
        if str(getattr(recipe.trainer, key, value)) != str(value):
            raise RecipeError(
                f"trainer.{key}={getattr(recipe.trainer, key)} but {flag} {value}: give "
                f"{flag} {getattr(recipe.trainer, key)} instead (the executor starts the "
                "processes from --devices and --nodes)"
            )
    data = recipe.data
    tokens = int(getattr(data, "global_batch_size", 0) or 0) * int(
        getattr(data, "seq_length", 0) or 0
    )
    every = getattr(recipe.trainer, "log_every_n_steps", None) or 50
    _add_callback(recipe, run.Config(ProgressLog, tokens_per_step=tokens, every_n_steps=every))
    logs: dict[str, Path] = {}
    if args.loss_log:
        logs["gtp"] = Path(args.loss_log).absolute()
    baseline = None
    if args.compare_baseline:
        baseline = copy.deepcopy(recipe)
        baseline.log.name = f"{baseline.log.name}_baseline"
        board = getattr(baseline.log, "tensorboard", None)
        if board is not None and getattr(board, "name", None):  # its own series, not GTP's
            board.name = f"{board.name}_baseline"
        _check_baseline(baseline)
        scratch = Path(tempfile.mkdtemp(prefix="nemo_gtp_losses_"))
        logs.setdefault("gtp", scratch / "gtp.jsonl")
        logs["baseline"] = scratch / "baseline.jsonl"
    for which, target in (("gtp", recipe), ("baseline", baseline)):
        if which in logs:
            path = str(logs[which])
            _add_callback(target, run.Config(LossLog, path=path, val_path=_val_log(path)))
    gtp = with_gtp(
        recipe,
        args.num_weight_shards,
        expert_num_weight_shards=getattr(args, "expert_num_weight_shards", None),
        **_parse_gtp_options(args.gtp),
    )
    check_recipe(gtp)
    return gtp, baseline, logs


def tensorboard_dir(recipe: Any) -> Path | None:
    """Where NeMo's logger writes ``recipe``'s TensorBoard events: ``<log.log_dir>/tb_logs/
    <tensorboard.name>`` (NeMo moves the logger under its log dir, ``update_logger_directory``),
    else the logger's own ``save_dir/name``; None without a TensorBoard logger.

    Example::

        tensorboard_dir(llm.llama3_8b.pretrain_recipe(name="r", dir="/tmp/r"))
        # Path('/tmp/r/tb_logs/r')
    """
    log = getattr(recipe, "log", None)
    board = getattr(log, "tensorboard", None)
    if board is None:
        return None
    name = str(getattr(board, "name", "") or "")
    if getattr(log, "update_logger_directory", True) and getattr(log, "log_dir", None):
        return Path(log.log_dir) / "tb_logs" / name
    return Path(str(getattr(board, "save_dir", "tb_logs"))) / name


def _val_log(path: str | Path) -> str:
    """Where :class:`~nemo_gtp.recipes.loader.LossLog` keeps the validation losses of
    ``path``: ``losses.jsonl`` -> ``losses.val.jsonl``."""
    where = Path(path)
    return str(where.with_name(f"{where.stem}.val{where.suffix}"))


def _make_executor(args: Any) -> Any:
    """The NeMo-Run executor the arguments ask for (:mod:`nemo_gtp.recipes.executors`)."""
    from nemo_gtp.recipes.executors import local_executor, slurm_executor
    from nemo_gtp.recipes.quiet import VERBOSE_ENV

    env = {"TORCH_FR_BUFFER_SIZE": "0"} if args.cpu else {}
    if os.environ.get(VERBOSE_ENV) == "1":  # --verbose reaches the ranks
        env[VERBOSE_ENV] = "1"
    else:  # torchrun's agent: its launch settings at INFO, pynvml's notice at import
        env["LOGLEVEL"] = "WARNING"
        env["PYTHONWARNINGS"] = "ignore:The pynvml package is deprecated:FutureWarning"
    if args.executor == "local":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if v not in os.environ]
        if args.nodes > 1 and missing and not args.dryrun:
            raise RecipeError(
                f"--nodes {args.nodes} with --executor local: run this command on every node "
                f"with MASTER_ADDR, MASTER_PORT and NODE_RANK set ({', '.join(missing)} unset), "
                "or use --executor slurm"
            )
        return local_executor(args.devices, nodes=args.nodes, env=env)
    if not args.slurm_account:
        raise RecipeError("--executor slurm needs --slurm-account")
    return slurm_executor(
        account=args.slurm_account,
        partition=args.slurm_partition,
        nodes=args.nodes,
        devices=args.devices,
        time=args.slurm_time,
        container_image=args.container_image,
        job_dir=str(Path(args.job_dir).absolute()) if args.job_dir else "",
        env=env,
    )


def _launch_task(gtp: Any, baseline: Any | None, args: Any) -> Any:
    """What the executor runs: the recipe itself, or :func:`~nemo_gtp.recipes.sequence.
    run_recipes` over serialized recipes (a baseline after it, or ``--cpu``'s compat layer)."""
    import nemo_run as run

    from nemo_gtp.recipes.sequence import run_recipes, serialize

    recipes = [serialize(gtp)] + ([serialize(baseline)] if baseline is not None else [])
    store_dir = ""
    if baseline is not None:
        store_dir = str(Path(gtp.log.log_dir or "nemo_experiments").absolute() / ".stores")
        store_dir = f"{store_dir}/{uuid.uuid4().hex[:12]}"
    return run.Partial(run_recipes, recipes=recipes, store_dir=store_dir, cpu_compat=args.cpu)


def main_recipe(args: Any, describe: Callable[[Any, Any], list[str]] | None = None) -> int:
    """``python -m nemo_gtp.run --recipe ...``; returns the exit status (2: bad input).

    Example::

        main_recipe(build_parser().parse_intermixed_args(["--recipe", "llama3_8b", ...]))

    ``describe(recipe, args)`` (``run.describe_nemo_run``) gives the lines printed before the
    launch: the layout, the model's size, where the logs go.
    """
    from nemo_gtp.recipes.quiet import quiet_known_warnings

    quiet_known_warnings()
    prog = "python -m nemo_gtp.run"
    try:
        import nemo_run as run

        if os.environ.get("NEMORUN_HOME"):  # read once at import: honour a later setting too
            run.config.set_nemorun_home(os.environ["NEMORUN_HOME"])
        gtp, baseline, logs = _build_recipes(args)
        executor = _make_executor(args)
    except RecipeError as err:  # a user error: one line, before anything is launched
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    if describe is not None:
        try:
            lines = describe(gtp, args)
        except RecipeError as err:  # the first lines only: the run itself goes on
            lines = [f"layout: not described ({err})"]
        print("\n".join(lines), flush=True)
    task = _launch_task(gtp, baseline, args)
    title = args.name or f"{args.recipe.split(':')[-1]}_gtp"
    with run.Experiment(title, executor=executor, log_level="WARNING") as exp:
        exp.add(task, name=title, tail_logs=not args.dryrun)
        if args.dryrun:
            exp.dryrun(log=True, delete_exp_dir=False)
            print(f"dryrun: nothing launched; NeMo-Run wrote {exp._exp_dir}", flush=True)
            return 0
        exp.run(sequential=True)
    states = [str(getattr(job, "state", "UNKNOWN")) for job in exp.jobs]
    ok = all(state.endswith("SUCCEEDED") for state in states)
    if not ok:
        print(f"training failed: {', '.join(states)} (logs: {exp._exp_dir})", flush=True)
    if baseline is None:
        return 0 if ok else 1
    from nemo_gtp.report import TOLERANCE, report_comparison

    loss_logs = {name: _read_jsonl(path) for name, path in logs.items()}
    val_logs = {name: _read_jsonl(Path(_val_log(path))) for name, path in logs.items()}
    shutil.rmtree(logs["baseline"].parent, ignore_errors=True)
    tp = getattr(gtp.trainer.strategy, "tensor_model_parallel_size", 1)
    names = {
        "gtp": f"GTP (TP{tp}·GTP{args.num_weight_shards // tp})",
        "baseline": f"baseline (TP{tp}, no GTP)",
    }
    precision = _recipe_precision(gtp)
    tolerance = TOLERANCE.get(precision, TOLERANCE["bf16-mixed"])
    val_ok = _report_validation(val_logs["gtp"], val_logs["baseline"], tolerance)
    boards = {names["gtp"]: tensorboard_dir(gtp), names["baseline"]: tensorboard_dir(baseline)}
    status = report_comparison(
        {names[k]: v for k, v in loss_logs.items()},
        precision,
        args.plot,
        title,
        # the plot of both runs, when both logged to TensorBoard
        log_dirs=boards if all(d is not None and d.is_dir() for d in boards.values()) else None,
    )
    return status if ok and val_ok else 1


def _report_validation(gtp: list[dict], baseline: list[dict], tolerance: float) -> bool:
    """Print each in-fit validation loss of both runs; True when they agree within
    ``tolerance`` (relative) at the same steps (or neither run validated)."""
    base = {r["step"]: r["val_loss"] for r in baseline}
    diffs = []
    for record in gtp:
        step, loss = record["step"], record["val_loss"]
        if step in base:
            diffs.append(abs(loss - base[step]) / abs(base[step]))
            print(f"validation at step {step}: GTP {loss:.5f}, baseline {base[step]:.5f}")
    if not gtp and not baseline:
        return True
    ok = len(diffs) == len(gtp) == len(baseline) and max(diffs) <= tolerance
    worst = f"{max(diffs):.1e}" if diffs else "n/a"
    print(f"validation loss: {'matches' if ok else 'DOES NOT match'} (max rel diff {worst})")
    return ok


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""Turn a recipe YAML (plus Hydra/OmegaConf-style ``key=value`` overrides) into a NeMo fit.

A recipe has the sections NeMo users know from ``nemo llm pretrain`` recipes: ``trainer``
(``nl.Trainer`` arguments), ``strategy`` (``GTPMegatronStrategy`` arguments: the
``MegatronStrategy`` ones plus ``num_weight_shards``), ``ddp`` (megatron
``DistributedDataParallelConfig``), ``gtp`` (``GTPConfig``), ``model`` (``llm.GPTConfig``,
plus ``layer_spec``: ``te`` or ``local``, defaulting to ``te`` when TransformerEngine imports,
as NeMo does), ``data``, ``optim`` (megatron ``OptimizerConfig``), ``precision`` and
``cpu_compat``; optionally ``fp8`` (``format``, ``recipe``, ``param_gather``: NeMo's
``MegatronMixedPrecision(fp8=..., fp8_recipe=..., fp8_param_gather=...)``, TE's FP8 GEMMs;
under GTP with ``recipe: tensorwise`` the weights are gathered in FP8, and with
``param_gather: true`` the GTP shards are FP8 primary weights, design §1.3),
``peft`` (``method: lora`` and NeMo LoRA's ``dim``, ``alpha``, ``dropout``,
``target_modules``: fine-tuning adapters as ``llm.finetune`` sets them up),
``checkpoint`` (``dir``, ``every_n_train_steps``: NeMo ``ModelCheckpoint`` saves, each a
``<dir>/step=N/`` torch_dist checkpoint) and ``resume`` (a checkpoint directory to continue
from with ``trainer.fit(ckpt_path=...)``, at this recipe's layout, whatever layout saved it; or
``latest``: the newest committed checkpoint in ``checkpoint.dir``, step 0 when there is none
yet, the restart of a requeued job: ``nemo_gtp.recipes.resume``; a PEFT run's adapter
checkpoint is resumed as NeMo's ``AdapterPath``: the base it names first), and ``restore`` (a
checkpoint whose weights a run that resumes nothing starts from, NeMo's ``RestoreConfig``: the
pretrained model of a fine-tuning run), ``faults`` and ``callbacks`` (a collective timeout, the
preemption save, Lightning callbacks by import path: :mod:`nemo_gtp.recipes.fault_callbacks`).
``build_fit(..., log_dir=DIR)`` logs through NeMo's ``nl.NeMoLogger`` with its TensorBoard
logger into ``DIR/tb_logs`` (``TB_SUBDIR``): loss, and
:class:`~nemo_gtp.strategy.GTPMetricsCallback`'s step time, memory and GTP metrics, which
``python -m nemo_gtp.report DIR`` draws.

Example::

    cfg = load_recipe("configs/tiny_cpu.yaml", ["trainer.max_steps=50"])
    fit = build_fit(cfg)
    fit.trainer.fit(fit.model, datamodule=fit.data)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from nemo_gtp.recipes.config import load_recipe  # noqa: F401  (re-exported)
from nemo_gtp.recipes.fault_callbacks import fault_callbacks
from nemo_gtp.recipes.resume import resume_path
from nemo_gtp.recipes.schema import (
    ACTIVATIONS,
    ddp_average_in_collective,
    default_layer_spec_name,
    is_cpu_recipe,
)
from nemo_gtp.recipes.validate import TE_MISSING, validate_recipe

TB_SUBDIR = "tb_logs"  # TensorBoard event files under a run's log directory
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Fit:
    """What ``trainer.fit(model, datamodule=data)`` needs."""

    trainer: Any
    model: Any
    data: Any
    ckpt_path: Any = None  # resume from here (``trainer.fit(..., ckpt_path=...)``)
    restore: str | None = None  # start from this checkpoint's weights when not resuming

    def run(self) -> None:
        """``trainer.fit`` with the recipe's model, data and resume checkpoint; a fit that
        resumes nothing starts from the ``restore`` checkpoint's weights (NeMo's
        ``RestoreConfig``: weights only, as ``llm.finetune`` starts from a pretrained model)."""
        if self.restore is not None and self.ckpt_path is None:
            from nemo.lightning.pytorch.strategies.utils import RestoreConfig

            restore = RestoreConfig(path=self.restore, load_artifacts=False)
            self.trainer.strategy.restore_config = restore
        self.trainer.fit(self.model, datamodule=self.data, ckpt_path=self.ckpt_path)


def resume_target(path: str | None) -> Any:
    """What ``trainer.fit(ckpt_path=...)`` resumes from: ``path``, or for a PEFT adapter
    checkpoint (``weights/adapter_metadata.json``) NeMo's ``AdapterPath``, which loads the base
    model it names before the adapters, as NeMo's ``AutoResume`` hands it over.

    Example: ``resume_target("lora/step=9")`` -> ``AdapterPath("lora/step=9", base_model_path=...)``
    """
    if path is None:
        return None
    from nemo.lightning.ckpt_utils import ADAPTER_META_FILENAME
    from nemo.lightning.resume import AdapterPath

    metadata = Path(path) / "weights" / ADAPTER_META_FILENAME
    if not metadata.is_file():
        return path
    base = json.loads(metadata.read_text())["model_ckpt_path"]
    return AdapterPath(Path(path), base_model_path=Path(base))


def _plain(section: Any) -> dict[str, Any]:
    return dict(OmegaConf.to_container(section, resolve=True)) if section is not None else {}


def optimizer_module(cfg: DictConfig) -> Any:
    """The recipe's NeMo optimizer module: megatron's (``optim``, an ``OptimizerConfig``), or
    with ``optim.optimizer=muon`` Muon for the hidden matrices with the ``muon`` section's
    ``MuonConfig`` (design §1.6 "Muon").

    Example::

        optimizer_module(load_recipe("configs/tiny_cpu.yaml", ["optim.optimizer=muon", ...]))
    """
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl

    config = OptimizerConfig(**_plain(cfg.optim))
    if config.optimizer != "muon":
        return nl.MegatronOptimizerModule(config=config)
    from nemo_gtp.integrations.megatron.muon import MuonConfig
    from nemo_gtp.strategy.muon import MuonOptimizerModule

    muon = _plain(cfg.get("muon"))
    if "ns_dtype" in muon:
        muon["ns_dtype"] = _DTYPES[muon["ns_dtype"]]
    return MuonOptimizerModule(config, muon=MuonConfig(**muon))


def build_fit(
    cfg: DictConfig, callbacks: list[Any] | None = None, log_dir: str | None = None
) -> Fit:
    """Build trainer, GPT model and data module from a loaded recipe (checked first).

    ``log_dir``: log as NeMo's recipes do (``nl.NeMoLogger`` with a TensorBoard logger, see
    :func:`setup_nemo_logger`), with :class:`GTPMetricsCallback` added.
    """
    validate_recipe(cfg)  # raises RecipeError naming the key; cheap, no collective
    if cfg.get("cpu_compat", False):
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat(nemo=True)
    from megatron.core.distributed import DistributedDataParallelConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.checkpoint.io import CheckpointSafety
    from nemo_gtp.data.synthetic import (
        ArithmeticGPTDataModule,
        ExportableNullTokenizer,
        SyntheticGPTDataModule,
    )
    from nemo_gtp.engine import GTPConfig
    from nemo_gtp.recipes.quiet import quiet_console
    from nemo_gtp.strategy import GTPDrainCallback, GTPMegatronStrategy, GTPMetricsCallback
    from nemo_gtp.strategy.step_syncs import SyncFreeGradClip, SyncFreeLogging

    quiet_console(log_dir)  # NeMo's and Lightning's notices to the log files (unless --verbose)
    data_cfg = _plain(cfg.data)
    vocab = data_cfg.pop("vocab_size")
    kind = data_cfg.pop("dataset", "arithmetic")
    model_cfg = _plain(cfg.model)
    for key in ("params_dtype", "pipeline_dtype"):
        if key in model_cfg:
            model_cfg[key] = _DTYPES[model_cfg[key]]
    if isinstance(model_cfg.get("activation_func"), str):  # YAML holds names, GPTConfig callables
        model_cfg["activation_func"] = resolve_activation(model_cfg["activation_func"])
    if cfg.get("cpu_compat", False):
        from nemo_gtp.cpu.compat import cpu_gpt_data_step

        model_cfg.setdefault("use_cpu_initialization", True)
        model_cfg["data_step_fn"] = cpu_gpt_data_step
    layer_spec = model_cfg.pop("layer_spec", None) or default_layer_spec_name()
    if layer_spec not in ("te", "local"):
        raise ValueError(f"model.layer_spec must be 'te' or 'local', got {layer_spec!r}")
    if layer_spec == "te" and default_layer_spec_name() != "te":
        raise ValueError(TE_MISSING)
    if layer_spec == "local":  # else NeMo's own default: the TransformerEngine spec
        model_cfg["transformer_layer_spec"] = local_layer_spec
    gpt_config = llm.GPTConfig(vocab_size=vocab, seq_length=data_cfg["seq_length"], **model_cfg)
    # NullTokenizer(n) has vocab_size n + 1; this one is recorded in checkpoints' context/
    tokenizer = ExportableNullTokenizer(vocab - 1)
    optim = optimizer_module(cfg)
    model = llm.GPTModel(gpt_config, tokenizer=tokenizer, optim=optim)
    data_class = ArithmeticGPTDataModule if kind == "arithmetic" else SyntheticGPTDataModule
    gpu = not is_cpu_recipe(cfg)  # pinned batches: no blocking copy to the GPU (NeMo's default)
    data = data_class(
        tokenizer=tokenizer, num_workers=0, pin_memory=gpu, create_attention_mask=True, **data_cfg
    )
    strategy = GTPMegatronStrategy(
        ddp=DistributedDataParallelConfig(
            **{**_plain(cfg.ddp), "average_in_collective": ddp_average_in_collective(cfg)}
        ),
        gtp_config=GTPConfig(**_plain(cfg.get("gtp"))),
        **strategy_kwargs(cfg, model_cfg),
    )
    # checkpoint.on_save_error / checkpoint.verify (stop; checksums at a resume)
    strategy.checkpoint_safety = CheckpointSafety.from_recipe(_plain(cfg.get("checkpoint")))
    trainer_kwargs = _plain(cfg.trainer)
    # the metrics first: a progress line of the same step reads them (ProgressLog)
    metrics = [GTPMetricsCallback()] if log_dir is not None else []
    # the fault callbacks first: their on_exception records a failure before any other waits
    made = [*fault_callbacks(cfg), GTPDrainCallback(), SyncFreeLogging(), SyncFreeGradClip()]
    callbacks = made + metrics + list(callbacks or [])
    if cfg.get("checkpoint"):
        callbacks.append(_model_checkpoint(_plain(cfg.checkpoint)))
        trainer_kwargs["enable_checkpointing"] = True
    if cfg.get("peft"):  # as llm.finetune sets it up: the model's transform and a callback
        from nemo_gtp.strategy.peft import set_peft

        gated = bool(gpt_config.gated_linear_unit)
        callbacks.append(set_peft(model, peft_method(_plain(cfg.peft), gated_mlp=gated)))
    plugins = []
    if cfg.get("precision", "32") == "bf16-mixed":
        plugins.append(nl.MegatronMixedPrecision(precision="bf16-mixed", **fp8_plugin_kwargs(cfg)))
    trainer = nl.Trainer(strategy=strategy, plugins=plugins, callbacks=callbacks, **trainer_kwargs)
    if log_dir is not None:
        setup_nemo_logger(trainer, log_dir)
    ckpt_path = resume_target(resume_path(cfg))
    return Fit(trainer, model, data, ckpt_path=ckpt_path, restore=cfg.get("restore"))


def progress_callbacks(cfg: DictConfig, loss_log: str | None = None) -> list[Any]:
    """What a run of ``python -m nemo_gtp.run`` prints and logs: :class:`ProgressLog` every
    ``trainer.log_every_n_steps`` steps, and rank 0's per-step losses to ``loss_log``
    (:class:`LossLog`) if given. Example: ``build_fit(cfg, callbacks=progress_callbacks(cfg))``.
    """
    data, trainer = cfg.data, cfg.trainer
    made: list[Any] = [
        ProgressLog(
            tokens_per_step=int(data.global_batch_size) * int(data.seq_length),
            every_n_steps=int(trainer.get("log_every_n_steps", 50)),  # Lightning's default
        )
    ]
    if loss_log:
        made.append(LossLog(loss_log))
    return made


def peft_method(section: dict[str, Any], gated_mlp: bool = False) -> Any:
    """The recipe's ``peft`` section as NeMo's PEFT method, with the other keys: ``method:
    lora`` is ``llm.peft.LoRA``, ``canonical_lora`` is ``llm.peft.CanonicalLoRA`` (its default
    targets without a gated MLP's ``linear_fc1_up`` / ``linear_fc1_gate`` unless
    ``gated_mlp``). Under GTP the frozen base linears are the shards and the adapters stay
    replicated (design §1.1 "Frozen weights"). Example::

        peft_method({"method": "lora", "dim": 8})   # LoRA(dim=8, ...)
    """
    from nemo.collections import llm

    from nemo_gtp.recipes.schema import GATED_MLP_TARGETS, PEFT_TARGETS

    section = dict(section)
    method = section.pop("method")
    if method == "lora":
        return llm.peft.LoRA(**section)
    if method != "canonical_lora":
        raise ValueError(f"peft.method={method!r}: one of {', '.join(PEFT_TARGETS)}")
    if "target_modules" not in section and not gated_mlp:
        targets = [t for t in PEFT_TARGETS[method] if t not in GATED_MLP_TARGETS]
        section["target_modules"] = targets
    return llm.peft.CanonicalLoRA(**section)


def fp8_plugin_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The recipe's ``fp8`` section as ``MegatronMixedPrecision`` arguments, checked against
    this device first (MXFP8 needs compute capability 10.0, ...; the error names the recipe
    key). Empty without an ``fp8`` section.

    Example::

        fp8_plugin_kwargs(cfg)   # {"fp8": "hybrid", "fp8_recipe": "tensorwise", ...}
    """
    section = _plain(cfg.get("fp8"))
    if not section:
        return {}
    from nemo_gtp.engine.fp8 import check_fp8_training_for_gtp
    from nemo_gtp.engine.grid import layout_dims

    gtp_on = layout_dims(_plain(cfg.get("strategy"))).gtp_enabled
    kwargs = {
        "fp8": section["format"],
        "fp8_recipe": section.get("recipe") or "delayed",
        "fp8_param_gather": bool(section.get("param_gather", False)),
    }
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    try:
        check_fp8_training_for_gtp(
            kwargs["fp8"],
            kwargs["fp8_recipe"],
            fp8_param=gtp_on and kwargs["fp8_param_gather"],
            capability=capability,
            keys={"fp8": "fp8.format", "fp8_recipe": "fp8.recipe", "fp8_param": "fp8.param_gather"},
        )
    except ValueError as err:
        from nemo_gtp.recipes.config import RecipeError

        raise RecipeError(str(err)) from None
    return kwargs


def setup_nemo_logger(trainer: Any, log_dir: str) -> Any:
    """Log ``trainer``'s run as NeMo's recipes do: ``nl.NeMoLogger`` with a TensorBoard logger,
    event files in ``<log_dir>/tb_logs`` (rank 0), NeMo's per-rank text logs in ``log_dir``.

    Call before the fit, on every rank (``llm.train`` does the same). Returns the logger.
    Example::

        setup_nemo_logger(trainer, "runs/tiny_cpu/gtp")   # then trainer.fit(...)
    """
    from lightning.pytorch.loggers import TensorBoardLogger
    from nemo import lightning as nl

    logger = nl.NeMoLogger(
        explicit_log_dir=log_dir,
        tensorboard=TensorBoardLogger(save_dir=TB_SUBDIR, name="", version=""),
    )
    logger.setup(trainer)
    return logger


def resolve_activation(name: str) -> Any:
    """The callable behind a recipe's ``model.activation_func`` name.

    ``silu`` / ``gelu`` / ``relu`` are ``torch.nn.functional``'s, ``squared_relu`` megatron's;
    with ``model.gated_linear_unit: true``, ``silu`` makes SwiGLU. Example::

        resolve_activation("silu")  # torch.nn.functional.silu
    """
    import importlib

    if name not in ACTIVATIONS:
        raise ValueError(
            f"model.activation_func={name!r} is not supported: use one of {', '.join(ACTIVATIONS)}"
        )
    module, _, attr = ACTIVATIONS[name].rpartition(".")
    return getattr(importlib.import_module(module), attr)


def strategy_kwargs(cfg: DictConfig, model_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``strategy`` section as ``GTPMegatronStrategy`` arguments.

    NeMo copies the strategy's ``pipeline_dtype`` into the model config (``None`` unless given),
    which overwrote a recipe's ``model.pipeline_dtype`` and failed megatron's "pipeline_dtype
    must be specified" check under pipeline parallelism: the model's value is passed to the
    strategy too (a ``strategy.pipeline_dtype`` name wins), as a ``torch.dtype``. Under PP with
    neither given, the activations between stages travel in the training dtype: bfloat16 for
    ``precision: bf16-mixed``, else ``model.params_dtype`` (float32 by default).

    Example::

        strategy_kwargs(cfg, {"pipeline_dtype": torch.bfloat16})["pipeline_dtype"]  # bfloat16
    """
    kwargs = _plain(cfg.strategy)
    if isinstance(kwargs.get("pipeline_dtype"), str):
        kwargs["pipeline_dtype"] = _DTYPES[kwargs["pipeline_dtype"]]
    if kwargs.get("pipeline_dtype") is None and model_cfg.get("pipeline_dtype") is not None:
        kwargs["pipeline_dtype"] = model_cfg["pipeline_dtype"]
    if (
        kwargs.get("pipeline_dtype") is None
        and (kwargs.get("pipeline_model_parallel_size") or 1) > 1
    ):
        bf16 = str(cfg.get("precision", "32")) == "bf16-mixed"
        kwargs["pipeline_dtype"] = (
            torch.bfloat16 if bf16 else model_cfg.get("params_dtype", torch.float32)
        )
    return kwargs


def _model_checkpoint(section: dict[str, Any]) -> Any:
    directory = section.pop("dir")
    every = int(section.pop("every_n_train_steps"))
    context = bool(section.pop("context", True))  # NeMo's ModelCheckpoint default
    # other keys were refused by validate_recipe (CHECKPOINT_KEYS), which build_fit runs first
    return model_checkpoint(directory, every, context=context)


def model_checkpoint(
    directory: str,
    every_n_train_steps: int,
    log_dir: str | None = None,
    context: bool = False,
    save_last: bool = False,
) -> Any:
    """NeMo's ``ModelCheckpoint`` saving full (weights + optimizer) checkpoints every n steps.

    Each save is ``<directory>/step=N/`` (a torch_dist ``weights/``); NeMo's run logs go to
    ``log_dir`` (default: ``directory``). ``context``: each save also gets NeMo's ``context/``
    (the serialized model, config and tokenizer), which ``llm.export_ckpt`` (e.g. to Hugging
    Face) reads to rebuild the model. ``save_last``: each save also as ``step=N-last`` (NeMo's
    recipes' default, what NeMo's ``AutoResume(resume_if_exists=True)`` looks for; the recipes
    here resume with ``resume: latest`` instead). Example::

        trainer = nl.Trainer(..., callbacks=[model_checkpoint("ckpts", 10)],
                             enable_checkpointing=True)
    """
    from pathlib import Path

    from nemo import lightning as nl
    from nemo.utils import AppState

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # NeMo's ModelCheckpoint writes its run logs to AppState().log_dir (NeMoLogger sets it).
    AppState().log_dir = path if log_dir is None else Path(log_dir)
    return nl.ModelCheckpoint(
        dirpath=str(path),
        every_n_train_steps=every_n_train_steps,
        save_top_k=-1,
        save_last=save_last,
        monitor="reduced_train_loss",
        filename="{step}",
        save_optim_on_train_end=True,  # else NeMo's train-end save is weights-only
        always_save_context=context,
        save_context_on_train_end=context,
        # Lightning's line names "step=9.ckpt"; NeMo writes the directory "step=9":
        # ProgressLog prints the directory instead.
        verbose=False,
    )


def _step_metrics(trainer: pl.Trainer) -> dict[str, float] | None:
    """What a :class:`~nemo_gtp.strategy.GTPMetricsCallback` of ``trainer`` measured in the step
    that just ended (it runs before the recipe's callbacks), None if it did not measure it."""
    from nemo_gtp.strategy.callbacks import GTPMetricsCallback

    for callback in trainer.callbacks:
        if isinstance(callback, GTPMetricsCallback) and callback.last_step == trainer.global_step:
            return callback.last_metrics
    return None


class LossLog(pl.Callback):
    """Rank 0 appends ``{"step", "loss", "ms"[, "peak_gib"]}`` JSON lines to a file.

    ``loss`` is NeMo's ``reduced_train_loss`` (averaged over the data-parallel ranks);
    ``peak_gib`` (GPU) this fit's peak of allocated memory since training started, net of what
    was allocated before the fit began (a fit run earlier in the same process, as
    ``--compare-baseline``'s GTP fit before its baseline, is not counted); ``ms``
    rank 0's wall time of the step: ``train/step_s`` of the trainer's
    :class:`~nemo_gtp.strategy.GTPMetricsCallback` when it measured the step (the value its
    loggers, and so ``python -m nemo_gtp.report``, get), else this callback's own timer. With
    ``val_path``, every in-fit validation also appends ``{"step", "val_loss"}`` there.

    Example::

        fit = build_fit(cfg, callbacks=[LossLog("losses.jsonl")])
    """

    def __init__(self, path: str, val_path: str | None = None) -> None:
        self.path = path
        self.val_path = val_path
        self._start = 0.0
        self._before_fit = 0  # bytes allocated when the fit began (its model not yet built)

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.val_path is None or trainer.global_rank != 0 or trainer.sanity_checking:
            return
        loss = trainer.callback_metrics.get("val_loss")
        if loss is not None:
            with open(self.val_path, "a") as f:
                record = {"step": trainer.global_step, "val_loss": float(loss)}
                f.write(json.dumps(record) + "\n")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls it before the model is built: what is allocated now is not this fit's
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._before_fit = torch.cuda.memory_allocated()

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():  # peak of this fit, not of an earlier one in the process
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank != 0:
            return
        loss = trainer.callback_metrics.get("reduced_train_loss")
        seconds = time.perf_counter() - self._start
        metrics = _step_metrics(trainer)
        if metrics is not None:  # the step time the loggers got: the report reads the same
            seconds = metrics["train/step_s"]
        # unrounded: the VERDICT's median must be the report's, to the last digit it prints
        record = {"step": trainer.global_step, "loss": float(loss), "ms": 1000 * seconds}
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() - self._before_fit
            record["peak_gib"] = round(peak / 2**30, 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class ProgressLog(pl.Callback):
    """Global rank 0 prints one line every ``trainer.log_every_n_steps`` steps (and the last).

    ``step 10/30 | loss 3.97967 | 85.2 ms | 7,520 tokens/s | GTP exposed comm 12.3%``: the
    loss is NeMo's ``reduced_train_loss``, the step time rank 0's wall time of that step, tokens
    per second ``global_batch_size x seq_length`` over it. With GTP on, the exposed-communication
    share is rank 0's stall on GTP collectives over the step (design §3.1 "Overlap design"),
    timed only in the steps that print, so the other steps pay nothing for it (on GPU the timer
    records CUDA events around each wait). A resumed fit first prints the step it resumed from.

    Example::

        fit = build_fit(cfg, callbacks=[ProgressLog(tokens_per_step=16 * 32)])
    """

    def __init__(self, tokens_per_step: int, every_n_steps: int = 1) -> None:
        self.tokens_per_step = tokens_per_step
        self.every = max(1, every_n_steps)
        self._start = 0.0
        self._timed: list[Any] = []
        self._saved: set[str] = set()

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # a resumed ModelCheckpoint restored the earlier run's saves: not this run's to report
        self._saved.update(self._known_saves(trainer))
        if trainer.global_rank == 0 and trainer.global_step > 0:
            print(f"resumed at step {trainer.global_step} from {trainer.ckpt_path}", flush=True)

    @staticmethod
    def _known_saves(trainer: pl.Trainer) -> list[str]:
        paths = []
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            paths += [
                *getattr(callback, "best_k_models", {}),
                getattr(callback, "last_model_path", ""),
            ]
        return [path for path in paths if path]

    def _report_saves(self, trainer: pl.Trainer) -> None:
        """Print each checkpoint directory committed since the last call (the checkpoint
        callback runs after this one, so a save shows at the next step or at the end; an
        asynchronous one once NeMo's finalizer has committed its ``weights/``)."""
        from nemo.lightning.ckpt_utils import ckpt_to_dir

        for path in self._known_saves(trainer):
            if path not in self._saved:
                directory = ckpt_to_dir(path)
                if (directory / "weights").is_dir():
                    self._saved.add(path)
                    print(f"saved checkpoint {directory}", flush=True)

    def on_fit_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """The last saves: after every ``on_train_end``, NeMo's blocking commit of the
        asynchronous saves included."""
        if trainer.global_rank == 0:
            self._report_saves(trainer)

    def _prints(self, trainer: pl.Trainer, step: int) -> bool:
        return step % self.every == 0 or step == trainer.max_steps

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        from nemo_gtp.strategy.callbacks import (
            GTPMetricsCallback,
            gtp_runtimes,
            start_wait_timing,
        )

        self._timed = []
        if trainer.global_rank == 0:
            self._report_saves(trainer)
        if trainer.global_rank != 0 or not self._prints(trainer, trainer.global_step + 1):
            return
        if not any(isinstance(c, GTPMetricsCallback) for c in trainer.callbacks):
            self._timed = start_wait_timing(gtp_runtimes(trainer))
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from nemo_gtp.strategy.callbacks import (
            gtp_runtimes,
            stop_wait_timing,
        )

        step = trainer.global_step
        if trainer.global_rank != 0 or not self._prints(trainer, step):
            return
        exposed = None
        if self._timed:
            exposed = sum(stop_wait_timing(self._timed).values())
        seconds = time.perf_counter() - self._start  # after collect(): CUDA work is done
        # else a GTPMetricsCallback timed this step, if Lightning logged it (it runs first)
        metrics = _step_metrics(trainer)
        if metrics is not None:
            seconds = metrics["train/step_s"]
            if exposed is None and gtp_runtimes(trainer):
                exposed = metrics.get("gtp/exposed_comm_s")
        loss = trainer.callback_metrics.get("reduced_train_loss")
        loss_text = f"{float(loss):.5f}" if loss is not None else "n/a"
        line = (
            f"step {step}/{trainer.max_steps} | loss {loss_text} | {1000 * seconds:.1f} ms | "
            f"{self.tokens_per_step / seconds:,.0f} tokens/s"
        )
        if exposed is not None:
            line += f" | GTP exposed comm {100 * min(1.0, exposed / seconds):.1f}%"
        print(line, flush=True)

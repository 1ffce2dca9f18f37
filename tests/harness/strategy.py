"""Run real ``nl.Trainer`` fits (NeMo 2.7.3, CPU/gloo) in processes spawned here.

Lightning initializes torch.distributed itself: each spawned process gets ``MASTER_ADDR``,
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``NODE_RANK``, which makes Lightning's
``LightningEnvironment`` treat it as externally launched (no re-launch of pytest). The
rendezvous goes through a ``FileStore`` handed to the strategy (``MegatronStrategy.store``, which
NeMo passes to ``init_process_group``), not a TCP port: a port chosen in advance can be taken by
gloo's own ephemeral connections (or another job) before the fit binds it. Several fits run in
one process (process start + ``import nemo`` dominate the cost); between fits the harness tears
down megatron / NeMo globals and the process group.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.harness.spawn import COLLECTIVE_TIMEOUT_S, start_ranks

VOCAB, SEQ, MBS, GBS, STEPS = 128, 16, 2, 8, 10
VAL_BATCHES = 2  # validation / test steps per evaluation (each a global batch of GBS samples)
BANNER_PREFIX = "GTP enabled."
# A tiny MoE for Fit.model_kwargs: 4 SequentialMLP experts (expert GTP's kind), top-2, the
# allgather dispatcher (the alltoall one needs CUDA events).
MOE_MODEL = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False,
)


def pipelined(pp: int = 2, vp: int | None = None) -> dict[str, Any]:
    """``Fit`` keywords for ``pp`` pipeline stages (``vp``: model chunks per rank, megatron's
    interleaved schedule) of a 4-layer model: fp32 activations between stages, untied output
    layer (megatron copies a tied embedding to the last stage through CUDA).

    Example::

        Fit("pp2_gtp2", gtp=2, **pipelined(2))
    """
    strategy = {"pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32}
    if vp is not None:
        strategy["virtual_pipeline_model_parallel_size"] = vp
    model = {"num_layers": 4, "share_embeddings_and_output_weights": False}
    return {"strategy_kwargs": strategy, "model_kwargs": model}


@dataclass(frozen=True)
class Fit:
    """One ``trainer.fit``: layout, GTP on/off, what to record."""

    name: str
    tp: int = 1
    gtp: int = 1
    gtp_strategy: bool = False  # GTPMegatronStrategy even at gtp=1 (else plain MegatronStrategy)
    steps: int = STEPS
    metrics: bool = False
    log_every: int = 1  # the trainer's log_every_n_steps
    bf16: bool = False  # NeMo's MegatronMixedPrecision("bf16-mixed") plugin
    distopt: bool = True  # False: NeMo's default ddp="megatron" and the non-distributed Adam
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    # checkpoints (relative paths are under the run's ``out_dir``): NeMo ModelCheckpoint every n
    # steps into ``checkpoint_dir``; stop (as if killed) after ``stop_after`` steps;
    # ``trainer.fit(ckpt_path=resume_from)``; full weights to ``weights_to`` after the fit;
    # ``trainer.save_checkpoint(save_to)`` after the fit. ``expect_error``: the fit must fail;
    # its result is ``{"name", "error"}`` and the launch goes on with the next fit.
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    save_last: bool = False  # ModelCheckpoint's save_last (NeMo recipes: a ``-last`` copy)
    # NeMo's AutoResume (``llm.train``'s restart-from-last): resume_if_exists from this
    # directory's newest ``*-last`` checkpoint before ``trainer.fit(model, datamodule=data)``
    auto_resume: str | None = None
    # ``llm.finetune``'s start from a pretrained checkpoint: NeMo's AutoResume with
    # ``RestoreConfig(path=restore_from)`` (weights only); with ``auto_resume`` too, a restart
    # resumes from the newest checkpoint there when one exists (PEFT: an adapter checkpoint)
    restore_from: str | None = None
    checkpoint_context: bool = False  # each save also gets NeMo's context/ (export_ckpt needs it)
    stop_after: int | None = None
    resume_from: str | None = None
    weights_to: str | None = None
    save_to: str | None = None
    expect_error: bool = False
    # full state (weights, + optimizer; its fp32 mains alone with ckpt_load_optimizer=False;
    # every rank's gathered)
    # to ``state_to`` at global step ``state_at``: right after the load for a fit resumed at that
    # step (objects.StateDump)
    state_at: int | None = None
    state_to: str | None = None
    # a tiny ``llm.LlamaModel`` (Llama 3 shape: RMSNorm, SwiGLU, RoPE, GQA with 2 query groups,
    # untied output layer), the model class NeMo's Hugging Face exporter is registered for;
    # otherwise ``llm.GPTModel``
    llama: bool = False
    # a tiny ``llm.MixtralModel`` (the Llama shape with 4 top-2 SequentialMLP experts per layer,
    # RoPE base 1e6; TE's MoE state-dict names: tests.harness.hf.te_named_moe_local_spec), the
    # model class NeMo's Mixtral Hugging Face exporter is registered for
    mixtral: bool = False
    # a Hugging Face tokenizer directory (NeMo's AutoTokenizer, recorded in context/ for the
    # exporters that save it) instead of the vocabulary-free NullTokenizer
    tokenizer_dir: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # more GPTConfig fields (MoE)
    # MoE experts as TEGroupedMLP of the CPU GroupedLinear stand-ins (tests.harness.te_grouped)
    # instead of NeMo's local spec's SequentialMLP
    grouped_experts: bool = False
    # evaluation: validate every ``val_every`` training steps (``VAL_BATCHES`` steps each), after
    # a sanity check of ``sanity_val_steps``; ``evaluate_after``: ``trainer.validate`` then
    # ``trainer.test`` on the same trainer after the fit. ``entry="validate"`` / ``"test"``: no
    # fit; a fresh trainer and model run that entry point (``ckpt_path=resume_from``).
    val_every: int = 0
    sanity_val_steps: int = 0
    evaluate_after: bool = False
    entry: str = "fit"
    # more OptimizerConfig fields; megatron's FP8 params emulated on full weights (the reference
    # of FP8 primary GTP shards: objects.EmulatedFP8Params)
    optim_kwargs: dict[str, Any] = field(default_factory=dict)
    emulate_fp8_params: bool = False
    # Muon for the hidden matrices (MuonOptimizerModule, fp32 Newton-Schulz; needs distopt=False)
    muon: bool = False
    # parameter-efficient fine-tuning as ``llm.finetune(..., peft=...)`` sets it up
    # (objects.make_peft: "lora", NeMo's LoRA; "freeze_attention")
    peft: str | None = None
    # a NeMo recipe (``llm.<recipe>.pretrain_recipe``) instead of the tiny model: built and
    # shrunk as the CLI does (tests.harness.families: its overrides, or ``recipe_overrides``),
    # trained through ``llm.pretrain``; ``expert_gtp``: expert GTP (``expert_num_weight_shards``)
    recipe: str | None = None
    recipe_overrides: tuple[str, ...] | None = None
    expert_gtp: int = 1
    # parameters whose names contain one of these are frozen (requires_grad=False) as the model
    # is built, before GTP shards it and DDP and the optimizer see it (e.g. a fine-tune that
    # leaves the attention as it was imported)
    freeze: tuple[str, ...] = ()
    # after the fit, the model's logits on LOGITS_BATCH fixed token sequences (every rank runs
    # the forward; rank 0 saves {"tokens", "logits"} there)
    logits_to: str | None = None
    # the host reads (.item(), float(), data-dependent shapes: a host sync each on a GPU) of
    # this training step, by Python site (objects.HostReadsWindow): result["host_reads"]
    host_reads_at: int | None = None
    # megatron's gradient clipping decided on the device (SyncFreeGradClip, the recipes' way)
    clip_on_device: bool = False


# ---------------------------------------------------------------------------------- recorders
class _RecordingDataset(torch.utils.data.Dataset):
    """Delegates to NeMo's mock dataset and records every sample index this rank loads."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.indices = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, idx: int) -> Any:
        self.indices.append(int(idx))
        return self.inner[idx]

    def collate_fn(self, batch: Any) -> Any:
        return self.inner.collate_fn(batch)


class _LineCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _make_callbacks() -> tuple[Any, Any]:
    from tests.harness.objects import MemoryLogger, Recorder

    return Recorder(), MemoryLogger()


def _eval_recorder() -> Any:
    from tests.harness.objects import EvalRecorder

    return EvalRecorder()


def gtp_leftovers(strategy: Any) -> list[dict[str, int]]:
    """:meth:`GTPRuntime.outstanding` of every runtime of ``strategy`` (empty without GTP)."""
    return [runtime.outstanding() for runtime in getattr(strategy, "gtp_runtimes", [])]


def _metric(results: list[dict[str, Any]], key: str) -> float:
    """``key`` of the one dataloader's metrics that ``trainer.validate`` / ``test`` returned."""
    (metrics,) = results
    return float(metrics[key])


def _banners(catcher: _LineCatcher) -> list[str]:
    return [line for line in catcher.lines if line.startswith(BANNER_PREFIX)]


def _logged(logger: Any, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every ``key`` a :class:`MemoryLogger` received."""
    return [(step, float(m[key])) for step, m in logger.records if key in m]


def _evaluate_only(
    fit: Fit, trainer: Any, model: Any, data: Any, strategy: Any, evals: Any, logger: Any
) -> dict[str, Any]:
    """``trainer.validate`` or ``trainer.test`` on a trainer that never ran fit."""
    run = trainer.validate if fit.entry == "validate" else trainer.test
    returned = run(model, datamodule=data, ckpt_path=fit.resume_from)
    return {
        "name": fit.name,
        "returned": returned,
        "gtp_params": sum(len(r.params) for r in getattr(strategy, "gtp_runtimes", [])),
        "leftovers_after": gtp_leftovers(strategy),
        "logged_val_loss": _logged(logger, "val_loss"),
        **evals.results(),
    }


def _stopper(steps: int) -> Any:
    from tests.harness.objects import StopAfter

    return StopAfter(steps)


def full_weights(strategy: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the (single-chunk) model as the full logical tensor, on every rank, by
    its ``state_dict()`` name.

    :func:`nemo_gtp.full_state_dict` (GTP shards gathered, pad rows dropped), then TP pieces
    concatenated along their partition dim, so runs of any layout compare bit for bit.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_gtp import full_state_dict
    from nemo_gtp.integrations.megatron import unwrapped_module

    full = full_state_dict(strategy)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    # parameters under their state_dict() names (a layer spec may rename them there)
    for name, param in unwrapped_module(strategy).state_dict(keep_vars=True).items():
        if not isinstance(param, torch.nn.Parameter):
            continue
        tensor = full[name].contiguous()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
            tensor = torch.cat(parts, dim=param.partition_dim)
        out[name] = tensor.clone()
    return out


# ---------------------------------------------------------------------------------- one fit
def _ddp_config() -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        grad_reduce_in_fp32=True,
        bucket_size=20_000,
        average_in_collective=False,
        check_for_nan_in_grad=True,
    )


def _gpt_config(
    tp: int,
    llama: bool = False,
    grouped_experts: bool = False,
    mixtral: bool = False,
    **model_kwargs: Any,
) -> Any:
    """The tiny model's config: ``llm.GPTConfig``, or ``llm.Llama3Config`` when ``llama``;
    ``grouped_experts``: ``TEGroupedMLP`` experts of the CPU stand-ins."""
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.cpu.compat import cpu_gpt_data_step

    config_class, extra, layer_spec = llm.GPTConfig, {}, local_layer_spec
    if llama:
        from nemo.collections.llm.gpt.model.llama import Llama3Config

        from tests.harness.objects import te_named_local_layer_spec

        config_class, extra = Llama3Config, {"num_query_groups": 2}
        layer_spec = te_named_local_layer_spec
    if grouped_experts:
        from tests.harness.te_grouped import grouped_local_layer_spec as layer_spec
    if mixtral:
        from nemo.collections.llm.gpt.model.mixtral import MixtralConfig

        from tests.harness.hf import te_named_moe_local_spec as layer_spec

        config_class = MixtralConfig
        extra = {**MOE_MODEL, "num_query_groups": 2, "moe_ffn_hidden_size": 128}
        extra["rotary_base"] = 1e6
    settings = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=SEQ,
        transformer_layer_spec=layer_spec,
        use_cpu_initialization=True,
        make_vocab_size_divisible_by=64,  # padded vocab 128 at TP1 and TP2: checkpoints interop
        params_dtype=torch.float32,
        bf16=False,
        tensor_model_parallel_size=tp,
        # attention key bias: mathematically zero gradient whose rounding noise Adam amplifies
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        gradient_accumulation_fusion=False,
        data_step_fn=cpu_gpt_data_step,
    )
    return config_class(**{**settings, **extra, **model_kwargs})  # model_kwargs may resize


def _fit(fit: Fit, world: int, store_path: str | None) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.utils import get_model_config
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

    from nemo_gtp import GTPMegatronStrategy, GTPMetricsCallback, SyntheticGPTDataModule

    tokenizer_class = NullTokenizer
    if fit.checkpoint_context:  # serializable in context/, and what the HF exporters read
        from nemo_gtp.data.synthetic import ExportableNullTokenizer as tokenizer_class
    tokenizer = tokenizer_class(VOCAB - 1)
    if fit.tokenizer_dir:
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

        tokenizer = AutoTokenizer(fit.tokenizer_dir)
    optim_config = OptimizerConfig(
        optimizer="adam",
        use_distributed_optimizer=fit.distopt,
        lr=1e-3,
        clip_grad=1.0,
        weight_decay=0.01,
        **fit.optim_kwargs,
    )
    scheduler = nl.lr_scheduler.CosineAnnealingScheduler(
        warmup_steps=3, max_steps=fit.steps, min_lr=1e-4
    )
    if fit.muon:
        from nemo_gtp.integrations.megatron.muon import MuonConfig
        from nemo_gtp.strategy.muon import MuonOptimizerModule

        muon = MuonConfig(ns_dtype=torch.float32)
        optim = MuonOptimizerModule(optim_config, lr_scheduler=scheduler, muon=muon)
    else:
        optim = nl.MegatronOptimizerModule(optim_config, lr_scheduler=scheduler)
    from nemo.collections.llm.gpt.model.llama import LlamaModel

    from tests.harness.objects import TestableGPTModel

    evaluates = bool(fit.val_every or fit.evaluate_after or fit.entry != "fit")
    model_class = LlamaModel if fit.llama else TestableGPTModel if evaluates else llm.GPTModel
    if fit.mixtral:
        model_class = llm.MixtralModel
    config = _gpt_config(fit.tp, fit.llama, fit.grouped_experts, fit.mixtral, **fit.model_kwargs)
    model = model_class(config, tokenizer=tokenizer, optim=optim)
    if fit.freeze:
        _freeze_when_built(model, fit.freeze)
    data = SyntheticGPTDataModule(
        seq_length=SEQ,
        tokenizer=tokenizer,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        num_workers=0,
        pin_memory=False,
        num_train_samples=100_000,
    )
    original_setup = data.setup

    def recording_setup(stage: str = "") -> None:
        original_setup(stage)
        data._train_ds = _RecordingDataset(data._train_ds)

    data.setup = recording_setup
    ddp = _ddp_config() if fit.distopt else "megatron"
    kwargs = {  # NeMo saves asynchronously by default; a Fit opts in with strategy_kwargs
        "tensor_model_parallel_size": fit.tp,
        "ddp": ddp,
        "process_group_backend": "gloo",
        "ckpt_async_save": False,
        **fit.strategy_kwargs,
    }
    if fit.gtp > 1 or fit.gtp_strategy:
        strategy = GTPMegatronStrategy(num_weight_shards=fit.tp * fit.gtp, **kwargs)
    else:
        strategy = nl.MegatronStrategy(**kwargs)
    if store_path is not None:  # rendezvous without a TCP port; None: the launcher's env://
        strategy.store = dist.FileStore(store_path, world)
    recorder, memory_logger = _make_callbacks()
    evals = _eval_recorder()
    metrics_cb = GTPMetricsCallback() if fit.metrics else None
    callbacks = [recorder, evals] + ([metrics_cb] if metrics_cb else [])
    if fit.stop_after:
        callbacks.append(_stopper(fit.stop_after))
    if fit.state_to:  # before the FP8 emulation: its train start re-quantizes the weights
        from tests.harness.objects import StateDump

        loads_optimizer = fit.strategy_kwargs.get("ckpt_load_optimizer", True)
        callbacks.append(StateDump(fit.state_at, fit.state_to, optimizer=loads_optimizer))
    if fit.peft:  # as llm.finetune's _setup: the model's transform, and the PEFT callback
        from nemo_gtp.strategy.peft import set_peft
        from tests.harness.objects import make_peft

        callbacks.append(set_peft(model, make_peft(fit.peft)))
    if fit.emulate_fp8_params:
        from tests.harness.objects import EmulatedFP8Params

        callbacks.append(EmulatedFP8Params())
    if fit.clip_on_device:
        from nemo_gtp.strategy.step_syncs import SyncFreeGradClip

        callbacks.append(SyncFreeGradClip())
    reads_window = None
    if fit.host_reads_at is not None:  # the first callback
        from tests.harness.objects import HostReadsWindow

        reads_window = HostReadsWindow(fit.host_reads_at)
        callbacks = [reads_window, *callbacks]
    if fit.checkpoint_every:
        from nemo_gtp.recipes.loader import model_checkpoint

        memory_logger.directory = str(Path(fit.checkpoint_dir).parent)  # trainer.log_dir
        callbacks.append(
            model_checkpoint(
                fit.checkpoint_dir,
                fit.checkpoint_every,
                log_dir=memory_logger.directory,
                context=fit.checkpoint_context,
                save_last=fit.save_last,
            )
        )
    trainer = nl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        max_steps=fit.steps,
        strategy=strategy,
        logger=memory_logger,
        callbacks=callbacks,
        enable_checkpointing=bool(fit.checkpoint_every),
        enable_progress_bar=False,
        limit_val_batches=VAL_BATCHES if evaluates else 0,
        limit_test_batches=VAL_BATCHES,
        val_check_interval=fit.val_every or None,
        num_sanity_val_steps=fit.sanity_val_steps,
        use_distributed_sampler=False,
        log_every_n_steps=fit.log_every,
        plugins=[nl.MegatronMixedPrecision(precision="bf16-mixed")] if fit.bf16 else None,
    )
    catcher = _LineCatcher()
    logging.getLogger("nemo_logger").addHandler(catcher)
    try:
        if fit.entry != "fit":  # a fresh trainer and model that never ran fit
            result = _evaluate_only(fit, trainer, model, data, strategy, evals, memory_logger)
            return {**result, "banners": _banners(catcher)}
        if fit.auto_resume or fit.restore_from:  # as llm.train / llm.finetune do
            restore = None
            if fit.restore_from:
                restore = nl.RestoreConfig(path=fit.restore_from, load_artifacts=False)
            resume = nl.AutoResume(
                restore_config=restore,
                resume_if_exists=bool(fit.auto_resume),
                resume_ignore_no_checkpoint=True,
                resume_from_directory=fit.auto_resume,
            )
            resume.setup(trainer, model)
        trainer.fit(model, datamodule=data, ckpt_path=fit.resume_from)
    finally:
        logging.getLogger("nemo_logger").removeHandler(catcher)
    indices = data._train_ds.indices  # an evaluation's data.setup() re-creates the dataset
    if fit.save_to:
        trainer.save_checkpoint(fit.save_to)
    after: dict[str, Any] = {}
    if fit.evaluate_after:  # the same trainer, after its fit
        after["validate_after"] = _metric(trainer.validate(model, datamodule=data), "val_loss")
        after["test_after"] = trainer.test(model, datamodule=data)
        after["leftovers_after"] = gtp_leftovers(strategy)
    if fit.weights_to:
        weights = full_weights(strategy)
        if dist.get_rank() == 0:
            torch.save(weights, fit.weights_to)
    if fit.logits_to:
        logits = model_logits(strategy)
        if dist.get_rank() == 0:
            torch.save(logits, fit.logits_to)
    runtimes = getattr(strategy, "gtp_runtimes", [])
    ddp = strategy.megatron_parallel[0].module
    optimizer = strategy.optimizers[0].mcore_optimizer
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    optimizer = chained[0]  # the dense one
    expert_optimizer = chained[1] if len(chained) > 1 else None  # MoE: the expert one
    out = {
        "name": fit.name,
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "lrs": recorder.lrs,
        **recorder.end,
        "data_rank": parallel_state.get_data_parallel_rank(),
        "data_size": parallel_state.get_data_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "indices": indices,
        "banners": _banners(catcher),
        "gtp_params": sum(len(r.params) for r in runtimes),
        "gtp_runtimes": len(runtimes),
        "leftovers": gtp_leftovers(strategy),
        "presharded_modules": sum(
            type(m).__name__.startswith("GTP") and hasattr(m, "gtp_column")
            for m in strategy.megatron_parallel[0].modules()
        ),
        "fallback_allocations": sum(r.stats.fallback_allocations for r in runtimes),
        "reduce_scatters": sum(r.stats.reduce_scatters for r in runtimes),
        "frozen_gtp_params": sum(not p.requires_grad for r in runtimes for p in r.params),
        "gtp_params_with_grad": sum(p.grad is not None for r in runtimes for p in r.params),
        "timed_waits": sum(r.wait_timer.timed for r in runtimes),
        "shard_dtypes": sorted({str(p.dtype) for r in runtimes for p in r.params}),
        "metrics": metrics_cb.last_metrics if metrics_cb else {},
        "logged_metric_steps": [s for s, m in memory_logger.records if "gtp/gather_bytes" in m],
        "logged_loss_steps": [s for s, m in memory_logger.records if "reduced_train_loss" in m],
        "ddp_class": type(ddp).__name__,
        "ddp_dp_size": dist.get_world_size(ddp.intra_dp_cp_group),
        "chained_optimizers": len(chained),
        "inner_optimizers": [type(getattr(o, "optimizer", None)).__name__ for o in chained],
        "optimizer_dp_size": dist.get_world_size(optimizer.data_parallel_group)
        if fit.distopt
        else None,
        "expert_optimizer_dp_size": dist.get_world_size(expert_optimizer.data_parallel_group)
        if fit.distopt and expert_optimizer is not None
        else None,
        "gtp_finalize": bool(
            getattr(get_model_config(ddp).finalize_model_grads_func, "gtp_finalize", False)
        ),
        "sampler_kwargs": strategy.distributed_sampler_kwargs,
        "drain_callback": any(type(c).__name__ == "GTPDrainCallback" for c in trainer.callbacks),
        "checkpoint_io": type(strategy.checkpoint_io).__name__,
        **evals.results(),
        "logged_val_loss": _logged(memory_logger, "val_loss"),
        **after,
    }
    if reads_window is not None:
        out["host_reads"] = reads_window.reads.per_step(1)
    if any(r.fp8_primary is not None for r in runtimes):
        out["fp8_primary"] = _fp8_primary_state(runtimes, ddp, optimizer)
    if fit.metrics and runtimes:
        out["expected_gather_bytes_per_pass"] = sum(  # per runtime: dense and expert sizes
            sum(math.prod(p.gtp_spec.gathered_shape) * 4 for p in r.params) * (r.size - 1) // r.size
            for r in runtimes
        )
    return out


LOGITS_BATCH = 2


def model_logits(strategy: Any, seed: int = 1234) -> dict[str, torch.Tensor]:
    """``{"tokens", "logits"}``: the trained megatron model's logits ``[b, s, vocab]`` (eval
    mode, causal mask) on ``LOGITS_BATCH`` random sequences of ``SEQ`` tokens (collective: every
    rank runs the forward, GTP gathering its weights)."""
    from nemo_gtp.integrations.megatron import unwrapped_module

    module = unwrapped_module(strategy)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (LOGITS_BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(LOGITS_BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked
    was_training = module.training
    module.eval()
    with torch.no_grad():
        logits = module(tokens, positions, mask)
    module.train(was_training)
    return {"tokens": tokens, "logits": logits.detach().clone()}


def _freeze_when_built(model: Any, names: tuple[str, ...]) -> None:
    """Freeze ``model``'s parameters named by ``names`` right after ``configure_model``."""
    configure = model.configure_model

    def configure_then_freeze(*args: Any, **kwargs: Any) -> Any:
        out = configure(*args, **kwargs)
        for name, param in model.module.named_parameters():
            if any(part in name for part in names):
                param.requires_grad_(False)
        return out

    model.configure_model = configure_then_freeze


def _fp8_primary_state(runtimes: list, ddp: Any, optimizer: Any) -> dict[str, Any]:
    """What the model transform made of megatron's ``fp8_param`` (design §1.3 "FP8 primary
    weights"): shard and master dtypes, the megatron hooks, the last step's gathers, and the
    shards that are not exactly their fp32 main slices quantized with the whole master's
    scale (collective)."""
    from nemo_gtp.integrations.megatron.fp8_primary import fp8_primary_hooks_installed
    from tests.harness.gpt import fp8_primary_write_back_errors

    params = [p for r in runtimes for p in r.params]
    return {
        "shards": len(params),
        "training_dtypes": sorted({str(p.gtp_state.fp8_primary_dtype) for p in params}),
        "master_dtypes": sorted(
            {str(p.main_param.dtype) for p in params if getattr(p, "main_param", None) is not None}
        ),
        "hooks_installed": fp8_primary_hooks_installed(),
        "fp8_quantizes": sum(r.stats.fp8_quantizes for r in runtimes),
        "fp8_gathers": sum(r.stats.fp8_gathers for r in runtimes),
        "gathers": sum(r.stats.gathers for r in runtimes),
        "write_back_errors": fp8_primary_write_back_errors({"ddp": ddp, "optimizer": optimizer}),
    }


def _under(fit: Fit, out_dir: str) -> Fit:
    """``fit`` with its relative checkpoint / weight paths made absolute under ``out_dir``."""
    keys = (
        "checkpoint_dir",
        "resume_from",
        "auto_resume",
        "restore_from",
        "weights_to",
        "save_to",
        "state_to",
        "logits_to",
        "tokenizer_dir",
    )
    paths = {key: getattr(fit, key) for key in keys}
    return dataclasses.replace(
        fit,
        **{
            key: str(Path(out_dir, value))
            for key, value in paths.items()
            if value is not None and not Path(value).is_absolute()
        },
    )


def _report(fit: Fit, rank: int, out_dir: str) -> None:
    import traceback

    report = f"fit {fit.name}: {traceback.format_exc()}"
    Path(out_dir, f"error{rank}.txt").write_text(report)


def _live(*classes: type) -> list[int]:
    """How many objects of each of ``classes`` the collector tracks, in one walk (``type()``:
    some NeMo stand-ins raise on ``__class__``)."""
    counts = [0] * len(classes)
    for obj in gc.get_objects():
        kind = type(obj)
        for i, cls in enumerate(classes):
            counts[i] += issubclass(kind, cls)
    return counts


def _worker(rank: int, world: int, fits: list[Fit], out_dir: str) -> None:
    from megatron.core.models.gpt import GPTModel as MegatronGPTModel

    from nemo_gtp.cpu.compat import enable_cpu_compat
    from nemo_gtp.engine.param import GTPShardedParam
    from nemo_gtp.recipes.launch import teardown_fit

    torch.set_num_threads(1)
    # NeMo's MegatronStrategy reads its process-group timeout from this variable (whatever the
    # backend): a rank stuck in a collective fails the fit instead of hanging for gloo's 30 min.
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(COLLECTIVE_TIMEOUT_S))
    enable_cpu_compat()
    results = []
    alive_before, weights_before = _live(MegatronGPTModel, GTPShardedParam)
    for index, fit in enumerate(fits):
        fit = _under(fit, out_dir)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
        start = time.perf_counter()
        try:
            store = str(Path(out_dir, f"store{index}"))
            if fit.recipe is not None:
                from tests.harness.families import recipe_fit

                result = recipe_fit(fit, world, store, out_dir)
            else:
                result = _fit(fit, world, store)
        except Exception as err:
            if not fit.expect_error:
                _report(fit, rank, out_dir)
                raise
            result = {"name": fit.name, "error": f"{type(err).__name__}: {err}"}
        except BaseException:
            _report(fit, rank, out_dir)
            raise
        finally:
            teardown_fit()
        # how many megatron GPTModels the fit left alive once torn down (a finished fit's model
        # must not outlive it: teardown_fit releases what held it)
        alive, weights = _live(MegatronGPTModel, GTPShardedParam)
        result["models_kept_by_fit"] = alive - alive_before
        result["gtp_weights_kept_by_fit"] = weights - weights_before
        alive_before, weights_before = alive, weights
        if fit.expect_error and "error" not in result:
            raise AssertionError(f"fit {fit.name} was expected to fail but succeeded")
        result["wall_s"] = time.perf_counter() - start
        results.append(result)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def run_fits(fits: list[Fit], world: int, out_dir: str | Path) -> list[list[dict[str, Any]]]:
    """Run ``fits`` in order on ``world`` spawned ranks; returns ``results[rank][fit_index]``."""
    try:
        start_ranks(_worker, (world, fits, str(out_dir)), world, join=True)
    except Exception as err:  # the first rank to die is often a victim: show every rank's error
        reports = "\n".join(
            f"--- rank {r}: {Path(out_dir, f'error{r}.txt').read_text()[-3000:]}"
            for r in range(world)
            if Path(out_dir, f"error{r}.txt").exists()
        )
        raise RuntimeError(f"a rank failed; per-rank errors:\n{reports}") from err
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]

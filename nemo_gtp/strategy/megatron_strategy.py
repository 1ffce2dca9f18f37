"""``GTPMegatronStrategy``: NeMo's ``MegatronStrategy`` with Generalized Tensor Parallelism.

GTP is switched on by ``num_weight_shards`` (design §2.1 ``--tensor-parallel-num-weight-shards``,
= TP x GTP), expert GTP by ``expert_num_weight_shards`` (= ETP x EGTP, MoE models, design §1.4).
With both equal to their TP sizes (the default) every hook below returns to plain
``MegatronStrategy`` behaviour (design §1.5: off is a no-op).

Hooks, in the order NeMo / Lightning run them:

===========================  =====================================================================
``__init__``                 validate every GTP-relevant argument (no collectives yet)
``connect``                  CUDA-graph warmup >= 2 on the model config (design §2.4)
                             (per-layer graphs: ``shard_model`` splits the chains per layer);
                             FP8 primary weights' settings checked (``fp8_param``, design §1.3)
``setup_distributed``        NeMo's process groups, then the GTP groups (design §3.1; kept for a
                             second run on the same trainer); TE linears of the config's layer
                             spec set to build as their shard
``setup``                    NeMo's setup; adds :class:`GTPDrainCallback`; fit: NeMo's
                             telemetry configured as ``llm.train`` does (plain ``trainer.fit``);
                             validate / test / predict: each GTP peer keeps its own shard across
                             NeMo's parameter broadcast (:mod:`nemo_gtp.strategy.evaluation`)
``init_model_parallel``      precision conversion -> ``shard_model`` (FP8 primary shards under
                             ``fp8_param``) -> GTP-aware megatron DDP
``setup_optimizers``         megatron optimizer over the GTP process groups (design §3.2); fit
                             only (Lightning's rule; NeMo's setup builds one for every entry point)
``on_train_start``           GTP-aware ``finalize_model_grads``; the one-line config log (§2.3)
``training_step``            NeMo's; keeps the reduced loss for the one-read NaN check (faults)
``on_validation_end`` etc.   drain: no GTP communication of an evaluation loop outlives it
``save_checkpoint`` / load   GTP-aware sharded state dict, atomic ``torch_dist`` commit, layout-
                             independent optimizer format; FP8 primary shards re-quantized from
                             the loaded weights, then from the loaded fp32 mains (design §3.3
                             "FP8 primary weights"): :mod:`nemo_gtp.strategy.checkpoint_hooks`
===========================  =====================================================================

Batch arithmetic (design §3.1): every GTP peer eats its own microbatch, so
``global_batch = micro x DP x GTP x num_microbatches``. megatron's data-parallel group is
DP x GTP with our rank order, so NeMo's sampler, microbatch calculator, consumed-samples and
logged batch size need no change.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config
from nemo.lightning.pytorch.strategies import MegatronStrategy
from nemo.lightning.pytorch.strategies.utils import init_model_parallel as nemo_init_model_parallel
from nemo.utils import AppState
from nemo.utils import logging as nemo_logging

from nemo_gtp.engine import GTPConfig, GTPGroups, GTPParallelDims, GTPRuntime, runtimes_of
from nemo_gtp.engine.collectives import quiet_flight_recorder
from nemo_gtp.engine.grid import layout_dims, on_world
from nemo_gtp.integrations.megatron import (
    gtp_process_groups,
    initialize_gtp_parallel,
    make_finalize_model_grads,
    preshard_config_layer_spec,
)
from nemo_gtp.integrations.megatron.wgrad_fusion import enable_gradient_accumulation_fusion
from nemo_gtp.strategy.callbacks import GTPDrainCallback
from nemo_gtp.strategy.checkpoint_hooks import GTPCheckpointHooks
from nemo_gtp.strategy.checkpoint_io import install_gtp_sharded_state_dict
from nemo_gtp.strategy.cuda_graphs import (
    enforce_cuda_graph_warmup,
    graph_safe_gtp_config,
    install_full_iteration_graph,
    install_lean_layer_replay,
    reject_cuda_graph_capture,
    release_graphs_at_exit,
)
from nemo_gtp.strategy.ddp import gtp_ddp_class, nemo_ddp_class
from nemo_gtp.strategy.evaluation import KeptShards, keep_shards
from nemo_gtp.strategy.faults import ensure_nonfinite_check
from nemo_gtp.strategy.model_transform import convert_then_shard, shard_model_chunk
from nemo_gtp.strategy.optimizer import megatron_optimizer_pg_collection
from nemo_gtp.strategy.peft import install_gtp_adapter_io
from nemo_gtp.strategy.validation import (
    refuse_unknown_arguments,
    validate_ddp_config,
    validate_fp8_primary,
    validate_gtp_config,
    validate_moe_config,
    validate_strategy_args,
)

_MEGATRON_SIGNATURE = inspect.signature(MegatronStrategy.__init__)
_GTP_ARGS = ("num_weight_shards", "expert_num_weight_shards", "gtp_config")


def gtp_banner(config: GTPConfig, dims: GTPParallelDims) -> str:
    """The iteration-0 line (design §2.3 style), e.g.
    ``GTP enabled. GTPConfig(pad_for_alignment=16, ...) tp=2 gtp=2 dp=1 (...)``."""
    experts = ""
    if dims.egtp > 1 or dims.expert_model_parallel_size > 1:
        experts = (
            f"; experts: etp={dims.etp} ep={dims.expert_model_parallel_size} egtp={dims.egtp} "
            f"edp={dims.edp} (expert_num_weight_shards={dims.expert_num_weight_shards})"
        )
    return (
        f"GTP enabled. {config!r} tp={dims.tensor_model_parallel_size} gtp={dims.gtp} "
        f"dp={dims.dp} (num_weight_shards={dims.num_weight_shards}, data-parallel ranks "
        f"DP x GTP={dims.data_parallel_size}){experts}"
    )


def configure_nemo_telemetry(trainer: pl.Trainer) -> None:
    """Give NeMo's one-logger telemetry the training config ``llm.train`` would have given it.

    NeMo's telemetry is enabled on the process whose ``RANK`` is 0 when NeMo is imported (any
    external launcher: torchrun, Slurm) and needs a training config before the first
    ``ModelCheckpoint`` save; only ``llm.train`` sets it. A plain ``trainer.fit`` (the README's
    pattern) then died at that save with ``OneLoggerError: Training telemetry config must be
    set before the start of training`` on rank 0, the other ranks with ``Connection closed by
    peer``. Sets it the way ``llm.train`` does (NeMo's ``CallbackGroup.update_config``, which
    also attaches NeMo's telemetry callback to the trainer).

    The telemetry keeps one training config per process (a second one is refused). A later fit
    in the same process that checkpoints, validates or saves asynchronously where the first did
    not then failed at its first such step (``OneLoggerError: Timer for span
    checkpoint_save_sync is not active``): for such a fit the telemetry is switched off for the
    rest of the process, with a note, since it would record the fit wrongly anyway.
    """
    from nemo.lightning.callback_group import CallbackGroup
    from nemo.lightning.one_logger_callback import get_nemo_v2_callback_config
    from nv_one_logger.training_telemetry.api.training_telemetry_provider import (
        TrainingTelemetryProvider,
    )

    group = CallbackGroup.get_instance()  # first: it configures the telemetry provider
    provider = TrainingTelemetryProvider.instance()
    current = provider.config.telemetry_config
    if current is None:
        group.update_config(nemo_version="v2", trainer=trainer, data=trainer.datamodule)
        return
    wanted = get_nemo_v2_callback_config(trainer=trainer, data=trainer.datamodule)
    differs = [
        name
        for name, have in (
            ("is_save_checkpoint_enabled", current.is_save_checkpoint_enabled),
            ("is_validation_iterations_enabled", current.is_validation_iterations_enabled),
        )
        if bool(wanted[f"{name}_or_fn"]) != bool(have)
    ]
    if str(wanted["save_checkpoint_strategy"]) != str(current.save_checkpoint_strategy):
        differs.append("save_checkpoint_strategy")
    if differs:
        nemo_logging.info(
            "NeMo's telemetry keeps the training config of this process's first fit; this fit "
            f"differs in {', '.join(differs)}: telemetry off for the rest of the process"
        )
        provider.force_disable_logging()


class GTPMegatronStrategy(GTPCheckpointHooks, MegatronStrategy):
    """``MegatronStrategy`` that shards linear weights over a GTP axis (design §2.1, §2.3).

    Args:
        num_weight_shards: shards per dense linear weight, = TP x GTP; ``None`` means TP (GTP
            off). Must be a positive multiple of ``tensor_model_parallel_size``.
        expert_num_weight_shards: shards per routed-expert linear weight, = ETP x EGTP (the
            expert twin of ``num_weight_shards``, beside ``expert_model_parallel_size`` and
            ``expert_tensor_parallel_size``); ``None`` means ETP (expert GTP off). Expert GTP
            shards megatron ``SequentialMLP`` and ``TEGroupedMLP`` experts (not the legacy
            ``GroupedMLP``), design §1.4.
        gtp_config: GTP knobs (design §2.4); ``None`` uses the defaults.
            ``calculate_per_token_loss`` is mirrored from the model config.
        *args, **kwargs: every ``MegatronStrategy`` argument, unchanged.

    Attributes:
        gtp_dims: the :class:`GTPParallelDims` of this run, the one source of every GTP size
            (``gtp_size``, ``num_weight_shards``, ``gtp_enabled`` are read from it): built and
            checked at construction without a world size, completed with it (and checked again)
            in ``setup_distributed``.
        gtp_groups: this rank's GTP process groups, from ``setup_distributed`` on.

    Example::

        strategy = GTPMegatronStrategy(
            tensor_model_parallel_size=2, num_weight_shards=4,            # TP2 x GTP2
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                              overlap_grad_reduce=True),
        )
        trainer = nl.Trainer(devices=8, strategy=strategy, plugins=nl.MegatronMixedPrecision(
            precision="bf16-mixed"))
    """

    # NeMo's IOMixin wraps __init__ once per class to record its arguments (see
    # io_transform_args); the flag is inherited, so without this ours would never be recorded.
    __wrapped_init__ = False

    def __init__(
        self,
        *args: Any,
        num_weight_shards: int | None = None,
        expert_num_weight_shards: int | None = None,
        gtp_config: GTPConfig | None = None,
        **kwargs: Any,
    ) -> None:
        bound = _MEGATRON_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        margs = dict(bound.arguments)
        refuse_unknown_arguments(margs["kwargs"], [*margs, *_GTP_ARGS])
        # Every size is derived and checked by the grid, statically: no world exists yet.
        # setup_distributed completes it with the world size.
        dims = layout_dims(
            {
                **margs,
                "num_weight_shards": num_weight_shards,
                "expert_num_weight_shards": expert_num_weight_shards,
            }
        )
        if gtp_config is not None and not isinstance(gtp_config, GTPConfig):
            raise ValueError(f"gtp_config must be a GTPConfig or None, got {type(gtp_config)}")
        # The non-size checks apply as soon as either weight axis shards (GTP or expert GTP).
        validate_strategy_args(margs, dims.gtp if dims.gtp > 1 else dims.egtp)
        validate_gtp_config(gtp_config, margs, dims.gtp)
        io = getattr(self, "__io__", None)
        super().__init__(*args, **kwargs)
        if io is not None:  # the parent's IOMixin wrapper re-recorded only its own arguments
            self.__io__ = io
        self.gtp_dims = dims
        self.gtp_config = gtp_config
        self.gtp_groups: GTPGroups | None = None
        self.gtp_runtimes: list[GTPRuntime] = []
        self._gtp_pgs: ProcessGroupCollection | None = None
        self._gtp_world: dist.ProcessGroup | None = None  # the default group gtp_groups live in
        self._kept_shards: KeptShards | None = None
        # True from the training loop's start until its end: NeMo's AsyncFinalizerCallback
        # commits the asynchronous saves made in between (see save_checkpoint).
        self._fit_commits_async_saves = False
        self.last_train_loss: torch.Tensor | None = None
        """The last training step's reduced loss, on the device (:meth:`training_step`)."""
        self._gtp_banner_due = False  # set by on_train_start: _install_gtp_finalize logs it

    def io_transform_args(self, init_fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Arguments NeMo's IOMixin records (``__io__``, checkpoint ``context/``), flattened.

        NeMo binds them to ``__init__``'s signature, which here is ``*args, **kwargs`` plus the
        GTP arguments; that would record a single ``kwargs={...}`` entry that does not rebuild
        the strategy. Record every argument under its ``MegatronStrategy`` name instead.
        """
        from nemo.lightning.io.mixin import _io_transform_args

        gtp = {k: kwargs.pop(k) for k in _GTP_ARGS if k in kwargs}
        bound = _MEGATRON_SIGNATURE.bind_partial(self, *args, **kwargs)
        flat = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
        flat.update(bound.arguments.get("kwargs", {}), **gtp)

        def recorded(self: Any, **kw: Any) -> None: ...

        recorded.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in flat]
        )
        return _io_transform_args(self, recorded, **flat)  # NeMo's value conversion

    # Derived from the one dims object, never stored twice.
    @property
    def gtp_size(self) -> int:
        """The GTP degree, ``num_weight_shards / tensor_model_parallel_size``."""
        return self.gtp_dims.gtp

    @property
    def num_weight_shards(self) -> int:
        """Shards per dense linear weight, TP x GTP (``tensor_model_parallel_size`` if unset)."""
        return self.gtp_dims.num_weight_shards

    @property
    def expert_num_weight_shards(self) -> int:
        """Shards per expert linear weight, ETP x EGTP (ETP if unset)."""
        return self.gtp_dims.expert_num_weight_shards

    @property
    def gtp_enabled(self) -> bool:
        """True when weights are sharded over a GTP axis of size > 1."""
        return self.gtp_dims.gtp_enabled

    # ------------------------------------------------------------------ before the model exists
    def connect(self, model: pl.LightningModule) -> None:
        """NeMo's connect, then CUDA-graph warmup >= 2 under GTP (design §2.4)."""
        super().connect(model)
        config = getattr(model, "config", None)
        if self.gtp_enabled and config is not None:
            note = enforce_cuda_graph_warmup(config)
            if note:
                nemo_logging.info(note)
            self._validate_fp8_primary(model)

    def _validate_fp8_primary(self, model: pl.LightningModule) -> None:
        """megatron's ``fp8_param`` under GTP (design §1.3 "FP8 primary weights"): checked once
        NeMo's ``connect`` has copied the precision plugin's settings into the model, DDP and
        optimizer configs, before any process group exists."""
        optim = getattr(getattr(model, "optim", None), "config", None)
        validate_fp8_primary(model.config, self.ddp_config, optim, self.gtp_dims.egtp)

    def setup_distributed(self) -> None:
        """NeMo's process groups (megatron ``parallel_state``), then the GTP groups.

        Before either, with GTP on or off: megatron's ``gradient_accumulation_fusion`` is made
        buildable without apex where torch has the GEMM, else refused by name
        (:func:`~nemo_gtp.integrations.megatron.wgrad_fusion.enable_gradient_accumulation_fusion`).
        """
        note = enable_gradient_accumulation_fusion(getattr(self.model, "config", None))
        if note:
            nemo_logging.info(note)
        if self.gtp_enabled and getattr(self.model, "config", None) is not None:
            reject_cuda_graph_capture(  # before any process group exists
                self.model.config,
                use_te_rng_tracker=bool(self.use_te_rng_tracker),
                pipeline_parallel=self.pipeline_model_parallel_size,
            )
            validate_moe_config(self.model.config, self.gtp_dims.egtp, self.gtp_enabled)
            self.gtp_config, note = graph_safe_gtp_config(self.model.config, self.gtp_config)
            if note:
                nemo_logging.info(note)
        note = quiet_flight_recorder() if self.gtp_enabled else None
        if note:
            nemo_logging.info(note)
        dims = None
        if self.gtp_enabled:  # pure arithmetic: every size error before any collective
            dims = on_world(self.gtp_dims, self.num_processes, self.num_nodes)
        super().setup_distributed()
        if dims is None:
            return
        release_graphs_at_exit(getattr(self.model, "config", None))
        # A second run on this trainer (trainer.validate after trainer.fit) keeps the process
        # groups, which the model's runtime is built on.
        if self.gtp_groups is None or dist.group.WORLD is not self._gtp_world:
            self._build_gtp_groups(dims)
        # TE linears are built as their shard (design §3.1 "One init path"): the groups exist now
        # and NeMo's configure_model, which builds the model from this config, runs next.
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "transformer_layer_spec"):
            preshard_config_layer_spec(config, self.gtp_groups, self.gtp_config)

    def _build_gtp_groups(self, dims: GTPParallelDims) -> None:
        if not parallel_state.model_parallel_is_initialized():
            # NeMo skips its model-parallel init when torch.distributed was initialized before
            # the trainer ran (e.g. a second fit in one process); the GTP grid is checked against
            # megatron's, so initialize it the way NeMo would have.
            nemo_init_model_parallel(self.model)
        self.gtp_dims = dims
        # also checks megatron's DP == DP x GTP
        self.gtp_groups = initialize_gtp_parallel(dims)
        self._gtp_world = dist.group.WORLD
        self._gtp_pgs = gtp_process_groups(self.gtp_groups, self.gtp_config)
        app_state = AppState()
        if app_state.data_parallel_size != dims.data_parallel_size:
            raise RuntimeError(
                f"NeMo AppState.data_parallel_size={app_state.data_parallel_size}, but GTP needs "
                f"the data-parallel ranks to be DP x GTP = {dims.data_parallel_size}"
            )

    # ------------------------------------------------------------------ model setup
    def setup(self, trainer: pl.Trainer) -> None:
        """NeMo's setup; under GTP also make sure GTP communication is drained at boundaries.

        Outside fit (``trainer.validate`` / ``test`` / ``predict``, on a fresh trainer or after
        a fit) NeMo's setup does what fit does here too (GTP groups, model transform, runtime),
        then broadcasts every parameter over megatron's data-parallel group, DP x GTP: each GTP
        shard is kept across it and broadcast over the replicate group instead
        (:mod:`nemo_gtp.strategy.evaluation`).
        """
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            configure_nemo_telemetry(trainer)
        if self.gtp_enabled and not any(isinstance(c, GTPDrainCallback) for c in trainer.callbacks):
            trainer.callbacks.append(GTPDrainCallback())
        if self.gtp_enabled and fitting:  # ddp.check_for_nan_in_grad names the parameter
            ensure_nonfinite_check(trainer)
        if self.gtp_enabled:  # NeMo's PEFT callback set its adapter IO up: GTP's beneath it
            install_gtp_adapter_io(self, self.gtp_checkpoint_io)
        super().setup(trainer)
        kept, self._kept_shards = self._kept_shards, None
        if kept is not None:  # kept by init_model_parallel, when not fitting
            kept.restore(self.gtp_groups.replicate)

    def setup_megatron_parallel(self, trainer: pl.Trainer) -> None:
        """NeMo's; under GTP the checkpoint description is GTP-aware from here on, also while
        NeMo's PEFT defers the model transform: linears built as their shard are GTP shards from
        ``configure_model`` on, and the pretrained (or PEFT base) weights load before the
        transform (design §3.3 "PEFT checkpoints")."""
        super().setup_megatron_parallel(trainer)
        if self.gtp_enabled:
            install_gtp_sharded_state_dict(self.megatron_parallel, self.gtp_groups)

    def init_model_parallel(self) -> None:
        """Precision conversion -> GTP sharding -> GTP-aware megatron DDP (NeMo's own wrap)."""
        if not self.gtp_enabled:
            super().init_model_parallel()
            return
        if self.ddp_config is not None:
            validate_ddp_config(self.ddp_config)  # callbacks may have edited it since __init__
        if getattr(self.model, "config", None) is not None:  # again: the same edits
            self._validate_fp8_primary(self.model)
        if self.gtp_groups is None:
            raise RuntimeError(
                "GTPMegatronStrategy.setup_distributed must run before the model "
                "is set up (it builds the GTP process groups)"
            )
        mp = self.megatron_parallel
        if not getattr(mp.convert_module_fn, "gtp_composed", False):
            mp.convert_module_fn = convert_then_shard(mp.convert_module_fn, self._shard_chunk)
        with nemo_ddp_class(gtp_ddp_class(self._gtp_pgs)):
            super().init_model_parallel()
        install_gtp_sharded_state_dict(mp, self.gtp_groups)
        trainer = getattr(mp, "trainer", None)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            self._kept_shards = keep_shards(mp)  # NeMo's setup broadcasts over DP x GTP next

    def _shard_chunk(self, chunk: Any) -> None:
        shard_model_chunk(chunk, self.gtp_groups, self.gtp_config)
        for runtime in runtimes_of(getattr(chunk, "module", chunk)):  # dense and expert
            if all(runtime is not r for r in self.gtp_runtimes):
                self.gtp_runtimes.append(runtime)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """NeMo's optimizer setup with the GTP ``ProcessGroupCollection`` (design §3.2); fit only.

        Lightning builds optimizers only to fit; NeMo's setup builds them for every entry point,
        which outside fit costs optimizer state for nothing and fails under ``trainer.test``
        (NeMo wraps no DDP there, and megatron's ``get_megatron_optimizer`` reads the wrapper's
        ``ddp_config``). Under GTP, validate / test / predict build none.
        """
        if not self.gtp_enabled:
            super().setup_optimizers(trainer)
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        with megatron_optimizer_pg_collection(self._gtp_pgs):
            super().setup_optimizers(trainer)

    # ------------------------------------------------------------------ training
    def on_train_start(self) -> None:
        """Install the GTP ``finalize_model_grads``; rank 0 logs the active configuration.

        Runs after every callback's ``on_fit_start``, where NeMo's ``MegatronOptimizerModule``
        installs its ``finalize_model_grads_func``; ours wraps whatever is there.
        """
        super().on_train_start()
        self._fit_commits_async_saves = True
        # Also without GTP: NeMo 2.7.3 builds the full-iteration graph only under
        # enable_cuda_graph, which megatron-core 0.15 rejects (design §3.5), so a DP baseline
        # asking for cuda_graph_scope="full_iteration" would silently run eager.
        note = install_full_iteration_graph(
            self.megatron_parallel, get_model_config(self.megatron_parallel[0])
        )
        if note and self.is_global_zero:
            nemo_logging.info(note)
        install_lean_layer_replay(self.megatron_parallel)
        self._gtp_banner_due = True  # logged once per fit, once the model is sharded
        self._install_gtp_finalize()

    def training_step(self, dataloader_iter: Any, *args: Any, **kwargs: Any) -> Any:
        """NeMo's step; its reduced loss (a device tensor) stays in :attr:`last_train_loss`, so
        :class:`~nemo_gtp.strategy.faults.NonFiniteGradCheck` checks it with the gradients in
        its one host read per step instead of reading it again after the optimizer step."""
        out = super().training_step(dataloader_iter, *args, **kwargs)
        loss = out.get("loss") if isinstance(out, dict) else out
        self.last_train_loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        return out

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Keep GTP's ``finalize_model_grads`` installed (a few attribute reads per step).

        NeMo's PEFT (``llm.finetune(..., peft=...)``) shards and wraps the model only at the
        first ``on_train_epoch_start``, after ``on_train_start``, and its
        ``MegatronOptimizerModule.on_fit_start`` call then installs NeMo's plain finalize over
        ours: the replicated (adapter) grads would skip their GTP all-reduce.
        """
        super().on_train_batch_start(batch, batch_idx)
        self._install_gtp_finalize()

    def _install_gtp_finalize(self) -> None:
        """Wrap every chunk's ``finalize_model_grads_func`` in GTP's (design §3.2), once per
        chunk; rank 0 logs the active configuration when the first one is wrapped."""
        if not self.gtp_enabled or not self.gtp_runtimes:  # PEFT: not sharded yet
            return
        for chunk in self.megatron_parallel:
            config = get_model_config(chunk)
            current = config.finalize_model_grads_func
            if not getattr(current, "gtp_finalize", False):
                wrapped = make_finalize_model_grads(
                    self.gtp_groups, base=current or megatron_finalize_model_grads
                )
                wrapped.gtp_finalize = True
                config.finalize_model_grads_func = wrapped
        if self._gtp_banner_due:
            self._gtp_banner_due = False
            if self.is_global_zero:
                nemo_logging.info(gtp_banner(self.gtp_runtimes[0].config, self.gtp_dims))

    # ------------------------------------------------------------------ evaluation
    def _drain(self) -> None:
        for runtime in self.gtp_runtimes:
            runtime.drain()

    def on_validation_end(self) -> None:
        """Drain (the forward-only pass leaves no gather behind), then NeMo's (train mode)."""
        self._drain()
        super().on_validation_end()

    def on_test_end(self) -> None:
        """Drain, then NeMo's (train mode)."""
        self._drain()
        super().on_test_end()

    def on_predict_end(self) -> None:
        """Drain, then Lightning's."""
        self._drain()
        super().on_predict_end()

"""The checkpoint hooks of ``GTPMegatronStrategy`` (design §1.8, §3.3), a mixin before NeMo's
``MegatronStrategy`` in its bases: the GTP checkpoint IO (atomic ``torch_dist`` commit, the layout
record), the optimizer state in a layout-independent format, FP8 primary shards re-quantized on
load, and async saves outside a fit committed before the process can exit.

Every method falls through to ``MegatronStrategy`` (``super()``) with GTP off (design §1.5).

Example::

    class GTPMegatronStrategy(GTPCheckpointHooks, MegatronStrategy): ...
"""

from __future__ import annotations

from typing import Any

from nemo.lightning.pytorch.strategies import MegatronStrategy
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

from nemo_gtp.checkpoint.io import CheckpointSafety
from nemo_gtp.checkpoint.optimizer import DEFAULT_SHARDING_TYPE
from nemo_gtp.strategy.checkpoint_io import (
    GTPCheckpointIO,
    fp8_primary_model_load,
    gtp_load_optimizer_states,
    gtp_optimizer_sharded_state_dict,
    gtp_sharded_state_dict_metadata,
)


class GTPCheckpointHooks:
    """The save / load hooks of :class:`~nemo_gtp.strategy.GTPMegatronStrategy` (which sets
    ``gtp_dims``, ``gtp_groups``, ``gtp_runtimes`` and ``_fit_commits_async_saves``); see the
    module docstring. Not a strategy on its own."""

    checkpoint_safety: CheckpointSafety = CheckpointSafety()
    """What a failed save does and what a load verifies (read at each save and load; the recipe
    loader sets it from ``checkpoint.on_save_error`` / ``checkpoint.verify``)."""

    @property
    def checkpoint_io(self) -> Any:
        """NeMo's checkpoint IO; under GTP a :class:`GTPCheckpointIO` (atomic commit, layout)."""
        dims = getattr(self, "gtp_dims", None)  # MegatronStrategy.__init__ runs before ours
        if self._checkpoint_io is None and dims is not None and dims.gtp_enabled:
            io = self.gtp_checkpoint_io()
            self._checkpoint_io = AsyncFinalizableCheckpointIO(io) if self.async_save else io
        return MegatronStrategy.checkpoint_io.fget(self)

    def gtp_checkpoint_io(self) -> GTPCheckpointIO:
        """A new :class:`GTPCheckpointIO` with this strategy's checkpoint settings (synchronous;
        NeMo's async wrapper goes around it)."""
        return GTPCheckpointIO(
            lambda: self.gtp_groups,
            safety=lambda: self.checkpoint_safety,
            save_ckpt_format=self.save_ckpt_format,
            async_save=self.async_save,
            torch_dist_multiproc=self.torch_dist_multiproc,
            assume_constant_structure=self.assume_constant_structure,
            parallel_save=self.parallel_save,
            parallel_save_within_dp=self.parallel_save_within_dp,
            parallel_load=self.parallel_load,
            load_directly_on_device=self.load_directly_on_device,
        )

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        MegatronStrategy.checkpoint_io.fset(self, io)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Drain GTP communication (every ``main_grad`` final), then NeMo's save (collective).

        ``GTPDrainCallback.on_save_checkpoint`` drains too; this covers saves that bypass the
        callbacks and costs nothing when already drained.
        """
        for runtime in self.gtp_runtimes:
            runtime.drain()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.async_save and not self._fit_commits_async_saves:
            # NeMo's async save (its default) only schedules the write: NeMo's
            # AsyncFinalizerCallback commits it at a later train batch or at the train end. A
            # save outside the training loop (``trainer.save_checkpoint`` after ``fit``) has
            # neither: the process exits with the data half-written in ``.weights.saving`` and
            # no ``weights/`` (design §3.3 "Atomic commit"). Finish and commit it here.
            self.checkpoint_io.maybe_finalize_save_checkpoint(blocking=True)

    def on_train_end(self) -> None:
        """NeMo's; from here on no callback commits an async save (every callback's
        ``on_train_end``, NeMo's ``AsyncFinalizerCallback``'s blocking commit included, has
        run before the strategy's)."""
        super().on_train_end()
        self._fit_commits_async_saves = False

    def teardown(self) -> None:
        """NeMo's; also after a fit that raised, where no ``on_train_end`` ran."""
        self._fit_commits_async_saves = False
        super().teardown()

    @property
    def sharded_state_dict_metadata(self) -> dict[str, Any]:
        """NeMo's, with the distributed optimizer in a format that survives layout changes."""
        metadata = super().sharded_state_dict_metadata
        return gtp_sharded_state_dict_metadata(metadata) if self.gtp_enabled else metadata

    def optimizer_sharded_state_dict(
        self, is_loading: bool = False, metadata: dict | None = None
    ) -> dict[str, Any]:
        """The optimizer state keyed like the GTP-aware model state (design §3.3).

        With FP8 primary GTP shards only the distributed optimizer's default
        ``fully_sharded_model_space`` format is supported (design §3.3 "FP8 primary weights");
        any other is refused, naming the setting, before any collective.
        """
        if not self.gtp_enabled:
            return super().optimizer_sharded_state_dict(is_loading=is_loading, metadata=metadata)
        metadata = self.sharded_state_dict_metadata if metadata is None else metadata
        self._check_fp8_primary_format(metadata, is_loading)
        return gtp_optimizer_sharded_state_dict(
            self.megatron_parallel,
            self.lightning_module.optimizers(use_pl_optimizer=False),
            is_loading=is_loading,
            metadata=metadata,
        )

    @property
    def _fp8_primary(self) -> bool:
        return any(r.fp8_primary is not None for r in self.gtp_runtimes)

    def _check_fp8_primary_format(self, metadata: dict[str, Any], loading: bool) -> None:
        """The optimizer-state format FP8 primary shards' checkpoints need (raised on every rank
        alike: the format comes from the strategy's settings, or from the checkpoint loaded)."""
        sharding = metadata.get("distrib_optim_sharding_type", DEFAULT_SHARDING_TYPE)
        if sharding == DEFAULT_SHARDING_TYPE or not self._fp8_primary:
            return
        if loading:
            fix = (
                "the checkpoint's optimizer state was saved in that format: load its weights "
                "only (ckpt_load_optimizer=False)"
            )
        else:
            fix = "set ckpt_optim_fully_reshardable=False"
        raise NotImplementedError(
            f"checkpoints of FP8 primary GTP shards (fp8_param_gather=True) support the "
            f"distributed optimizer's {DEFAULT_SHARDING_TYPE!r} format only, got "
            f"distrib_optim_sharding_type={sharding!r}: {fix} (megatron's dp_reshardable and "
            f"fully_reshardable formats split FP8 param buffers their own way)"
        )

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """NeMo's; FP8 primary GTP shards take the loaded weights quantized with the full
        weight's scale, agreed over GTP (``fp8_primary_model_load``; design §3.3 "FP8 primary
        weights"), not NeMo's plain copy, a cast into FP8 without a scale. The fp32 mains are
        then seeded from the shards' dequantized values, as megatron does for TE's FP8 params;
        a load of the optimizer state that follows replaces them (and re-quantizes the shards
        from the loaded mains)."""
        if not self._fp8_primary:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        with fp8_primary_model_load():
            super().load_model_state_dict(checkpoint, strict=strict)
        if "optimizer" in checkpoint:
            # NeMo seeds the mains only from a checkpoint without an "optimizer" entry, but a
            # checkpoint that holds optimizer state has one (its common part) also when
            # ckpt_load_optimizer=False: the mains kept their initial values, and the first
            # step's write-back would quantize from those instead of the loaded weights.
            for optimizer in self.optimizers:
                optimizer.reload_model_params()

    @property
    def lightning_restore_optimizer(self) -> bool:
        """Lightning restores optimizer state only when ``ckpt_load_optimizer`` asks for it.

        (NeMo leaves it True, so a weights-only checkpoint cannot be resumed from even with
        ``ckpt_load_optimizer=False``: Lightning insists on ``optimizer_states`` first.)
        """
        if not self.gtp_enabled:
            return super().lightning_restore_optimizer
        return bool(self.ckpt_load_optimizer) and super().lightning_restore_optimizer

    def load_optimizer_state_dict(self, checkpoint: Any, selective_restore: bool = False) -> None:
        """Load ``checkpoint["optimizer"]`` into every optimizer (megatron formats, torch Adam);
        FP8 primary GTP shards are then re-quantized from the loaded fp32 mains: bytes and
        scales as the saving run's (``gtp_load_optimizer_states``, design §3.3)."""
        if not self.gtp_enabled:
            super().load_optimizer_state_dict(checkpoint, selective_restore=selective_restore)
            return
        if not self.optimizers and not self._setup_optimizers:
            # NeMo's PEFT resume: Lightning restores before the optimizers exist (PEFT builds
            # them in its apply_transform, then loads the adapter checkpoint's state itself).
            return
        if self.should_restore_optimizer_states(selective_restore=selective_restore):
            gtp_load_optimizer_states(self.optimizers, checkpoint["optimizer"])

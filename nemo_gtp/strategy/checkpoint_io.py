"""Checkpoint save/load of ``GTPMegatronStrategy`` through NeMo's ``torch_dist`` path (§1.8, §3.3).

NeMo's ``MegatronStrategy`` builds every checkpoint request from
``megatron_parallel.sharded_state_dict()`` (model save, model load, and the optimizer's
param-to-key map) and hands it to ``MegatronCheckpointIO``. Under GTP three pieces change:

1. :func:`install_gtp_sharded_state_dict` makes that method GTP-aware
   (:func:`~nemo_gtp.integrations.megatron.checkpoint.make_gtp_sharded_state_dict`): GTP shards
   become pieces of megatron's unpadded global weight, so the checkpoint loads at any
   (TP, GTP, DP) layout and in runs without GTP; replica ids keep GTP peers apart.
2. :class:`GTPCheckpointIO` is NeMo's ``MegatronCheckpointIO`` with the atomic commit of
   :mod:`nemo_gtp.checkpoint.io` (a save interrupted midway never replaces the last good
   ``weights/``), the layout record the inspect CLI prints, and a shape check naming the
   mismatching key before megatron's load.
3. The distributed optimizer defaults to the layout-independent ``fully_sharded_model_space``
   format (NeMo's default ``dp_reshardable`` only survives DP changes); optimizer state is
   built and loaded with the torch-Adam fixes of :mod:`nemo_gtp.checkpoint.optimizer`.
4. FP8 primary GTP shards (design §3.3 "FP8 primary weights") are loaded as
   ``load_gtp_checkpoint`` loads them: :func:`fp8_primary_model_load` keeps their loaded
   (dequantized) weights out of NeMo's copy into the params and quantizes them with the
   GTP-agreed scale; :func:`gtp_load_optimizer_states` then re-quantizes them from the loaded
   fp32 main params (bytes and scales as saved).

[Note: what a NeMo checkpoint directory holds]
``<name>/weights/`` is megatron's distributed checkpoint (committed atomically here: written
as ``<name>/.weights.saving`` and renamed), ``<name>/context/`` is NeMo's IO dump written by
``ModelCheckpoint`` after the save. ``python -m nemo_gtp.checkpoint.show <name>/weights``
shows the layout it was saved with.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nemo.lightning import _strategy_lib
from nemo.lightning.io.pl import MegatronCheckpointIO, ckpt_to_weights_subdir
from nemo.lightning.megatron_parallel import getattr_proxy
from torch.distributed.checkpoint.api import CheckpointException

from nemo_gtp.checkpoint.io import (
    CheckpointSafety,
    check_global_shapes,
    is_complete,
    previous_dir,
    raise_if_incomplete,
    save_checkpoint,
)
from nemo_gtp.checkpoint.layout import LAYOUT_KEY
from nemo_gtp.checkpoint.manifest import checks_checksums, previous_committed, verify_checkpoint
from nemo_gtp.checkpoint.optimizer import (
    DEFAULT_SHARDING_TYPE,
    load_optimizer_state,
    optimizer_sharded_state_dict,
)
from nemo_gtp.engine.fp8_primary import quantize_loaded_fp8_primary
from nemo_gtp.engine.grid import GTPGroups, check_checkpoint_format
from nemo_gtp.integrations.megatron.checkpoint import (
    checkpoint_layout,
    make_gtp_sharded_state_dict,
    set_aside_fp8_primary_values,
)
from nemo_gtp.integrations.megatron.fp8_primary import quantize_fp8_primary_from_main_params


def install_gtp_sharded_state_dict(megatron_parallel: Any, groups: GTPGroups) -> None:
    """Make ``megatron_parallel.sharded_state_dict`` return the GTP-aware state dict (idempotent).

    Example::

        install_gtp_sharded_state_dict(strategy.megatron_parallel, strategy.gtp_groups)
        sd = strategy.megatron_parallel.sharded_state_dict()  # GTP shards as global pieces
    """
    current = megatron_parallel.sharded_state_dict
    if getattr(current, "gtp_aware", False):
        return

    @functools.wraps(current)
    def gtp_sharded_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        with _ddp_attribute_forwarding(megatron_parallel):
            return make_gtp_sharded_state_dict(current(*args, **kwargs), groups)

    gtp_sharded_state_dict.gtp_aware = True  # type: ignore[attr-defined]
    megatron_parallel.sharded_state_dict = gtp_sharded_state_dict


@contextlib.contextmanager
def _ddp_attribute_forwarding(megatron_parallel: Any) -> Iterator[None]:
    """NeMo's attribute forwarding from each model chunk to its DDP, as during the fit.

    ``MegatronParallel.sharded_state_dict`` finds the model's ``sharded_state_dict`` through
    that forwarding; the strategy's teardown (end of ``trainer.fit``) removes it, and the method
    then falls back to a ``module.`` prefix per wrapper level: ``trainer.save_checkpoint`` after
    the fit wrote ``module.module.*`` keys no load finds. With the forwarding back for the call,
    the keys are those of every save during the fit.
    """
    restored = []
    for chunk in megatron_parallel:
        cls = type(chunk)
        if hasattr(chunk, "original_getattr") and cls.__getattr__ is not getattr_proxy:
            restored.append((cls, cls.__getattr__))
            cls.__getattr__ = getattr_proxy
    try:
        yield
    finally:
        for cls, original in reversed(restored):
            cls.__getattr__ = original


def gtp_sharded_state_dict_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """NeMo's metadata with the distributed optimizer's format made layout-independent.

    ``dp_reshardable`` (NeMo's default) keys optimizer buckets by data-parallel rank and cannot
    load at another TP/GTP size; ``fully_reshardable`` (``ckpt_optim_fully_reshardable=True``)
    is kept, it is reshardable and readable by plain megatron.
    """
    if metadata.get("distrib_optim_sharding_type") == "dp_reshardable":
        metadata = {**metadata, "distrib_optim_sharding_type": DEFAULT_SHARDING_TYPE}
    return metadata


def gtp_optimizer_sharded_state_dict(
    megatron_parallel: Any, optimizer: Any, *, is_loading: bool, metadata: dict[str, Any]
) -> dict[str, Any]:
    """The optimizer's sharded state dict keyed by the GTP-aware model state dict.

    ``optimizer`` is NeMo's wrapper (``McoreDistributedOptimizer``) or a megatron optimizer.
    """
    model_sd = {
        key: value
        for key, value in megatron_parallel.sharded_state_dict(metadata=metadata).items()
        if not key.endswith("_extra_state")
    }  # as NeMo does: no optimizer state there
    return optimizer_sharded_state_dict(
        getattr(optimizer, "mcore_optimizer", optimizer),
        model_sd,
        is_loading=is_loading,
        sharding_type=metadata.get("distrib_optim_sharding_type", DEFAULT_SHARDING_TYPE),
        metadata=metadata,
    )


def gtp_load_optimizer_states(optimizers: list[Any], states: list[dict]) -> None:
    """Load each optimizer's loaded sharded state (NeMo's ``checkpoint["optimizer"]`` list).

    FP8 primary shards are then re-quantized from the loaded fp32 main params and all-gathered,
    as after an optimizer step (``quantize_fp8_primary_from_main_params``, design §3.3 "FP8
    primary weights"): their bytes and scales equal the saving run's. Collective over the
    optimizers' groups when there are any (a no-op otherwise).
    """
    for optimizer, state in zip(optimizers, states, strict=True):
        mcore = getattr(optimizer, "mcore_optimizer", optimizer)
        load_optimizer_state(mcore, state)
        quantize_fp8_primary_from_main_params(mcore)


def _without_module_prefix(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


@contextlib.contextmanager
def fp8_primary_model_load() -> Iterator[None]:
    """Inside the block, NeMo's model load quantizes loaded weights into FP8 primary shards.

    NeMo's ``MegatronStrategy.load_model_state_dict`` copies the loaded weights into the
    params with torch's ``load_state_dict`` (``_strategy_lib.load_model_state_dict``, looked up
    at call time), for an FP8 primary shard a cast into its float8 storage without a scale.
    The block replaces that function: FP8 primary shards' loaded (dequantized) weights are set
    aside (``set_aside_fp8_primary_values``), the rest is NeMo's load, then the shards are
    quantized with the full weight's scale (``quantize_loaded_fp8_primary``: amax agreed over
    the GTP group, collective). megatron's ``reload_model_params``, which follows a load without
    optimizer state (NeMo's, or the strategy's), then seeds the fp32 mains from the shards'
    dequantized values (megatron's ``dequantize_fp8_tensor``, routed to them by
    ``install_fp8_primary_hooks``), as megatron does for TE's FP8 params. Design §3.3 "FP8
    primary weights".

    Example::

        with fp8_primary_model_load():
            MegatronStrategy.load_model_state_dict(strategy, checkpoint)
    """
    original = _strategy_lib.load_model_state_dict

    @functools.wraps(original)
    def load_model_state_dict(
        megatron_parallel: Any, checkpoint: Mapping[str, Any], strict: bool = True
    ) -> None:
        checkpoint = dict(checkpoint)
        key = "state_dict" if "state_dict" in checkpoint else None
        state = dict(checkpoint[key]) if key else checkpoint
        params, values = [], []
        for index, chunk in enumerate(megatron_parallel):
            # NeMo's per-chunk state dict: its own entry under virtual pipeline parallelism
            sub = f"model_{index}"
            loaded = state[sub] if isinstance(state.get(sub), Mapping) else state
            kept, fp8, loaded_values = set_aside_fp8_primary_values(
                chunk.named_parameters(), loaded, _without_module_prefix
            )
            if loaded is state:
                state = kept
            else:
                state[sub] = kept
            params += fp8
            values += loaded_values
        if key:
            checkpoint[key] = state
        else:
            checkpoint = state
        original(megatron_parallel, checkpoint, strict=strict)
        if params:
            quantize_loaded_fp8_primary(params, values)

    _strategy_lib.load_model_state_dict = load_model_state_dict
    try:
        yield
    finally:
        _strategy_lib.load_model_state_dict = original


class GTPCheckpointIO(MegatronCheckpointIO):
    """NeMo's ``MegatronCheckpointIO`` with an atomic commit, a layout record and shape checks.

    ``groups`` returns the run's GTP groups when called (they exist only after the strategy's
    distributed setup, the IO object is created before); ``safety`` returns the
    :class:`~nemo_gtp.checkpoint.io.CheckpointSafety` in force (what a failed save does, what a
    load verifies against the commit's manifest; default: stop, sizes). Every
    ``MegatronCheckpointIO`` argument is accepted unchanged; NeMo wraps this in its async IO
    when ``async_save=True`` (the commit then runs as the save's finalize step).

    Example::

        io = GTPCheckpointIO(lambda: strategy.gtp_groups, save_ckpt_format="torch_dist")
    """

    def __init__(
        self,
        groups: Callable[[], GTPGroups | None],
        safety: Callable[[], CheckpointSafety] = CheckpointSafety,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._groups = groups
        self._safety = safety

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        storage_options: Any = None,
        extra_files: dict[str, str] | None = None,
    ) -> Any:
        """Save into ``<path>/weights`` through a staging directory, then commit (collective);
        ``extra_files`` (``{name: text}``) are committed inside ``weights/`` with the data."""
        check_checkpoint_format(self.save_ckpt_format)
        weights = ckpt_to_weights_subdir(path, is_saving=True)
        validate = not (self.validated_consistency and self.assume_constant_structure)
        self.validated_consistency = True
        layout = checkpoint_layout(checkpoint.get("sharded_state_dict", {}), self._groups())
        return save_checkpoint(
            checkpoint,
            weights,
            layout=layout,
            sharded_strategy=self.save_sharded_strategy,
            validate_access_integrity=validate,
            async_save=self.async_save,
            content_metadata=(storage_options or {}).get("content_metadata"),
            extra_files=extra_files,
            on_save_error=self._safety().on_save_error,
        )

    def load_checkpoint(
        self,
        path: Any,
        sharded_state_dict: Any = None,
        map_location: Any = None,
        strict: Any = None,
    ) -> dict[str, Any]:
        """Verify the files against the commit's manifest, shape-check, then NeMo's load (every
        rank); falls back to a checkpoint a crashed commit set aside.

        A damaged file raises :class:`~nemo_gtp.checkpoint.manifest.CheckpointCorruptError`
        naming it (its size always, its CRC-32 with ``verify="checksums"``); without a manifest,
        a load that fails on truncated or missing data files raises
        :class:`~nemo_gtp.checkpoint.io.CheckpointIncompleteError` naming the checkpoint and
        the files (megatron's ``CheckpointException`` names neither).
        """
        path = _committed(Path(path))
        weights = _committed_weights(path)
        verify_checkpoint(weights, checksums=self._checksums(), shared=True)
        check_global_shapes(sharded_state_dict, weights)
        try:
            loaded = super().load_checkpoint(path, sharded_state_dict, map_location, strict)
        except (Exception, CheckpointException) as err:  # the latter is no Exception
            raise_if_incomplete(weights, err)
            raise
        loaded.pop(LAYOUT_KEY, None)
        return loaded

    def load_content_metadata(self, path: Any = None, preloaded_state_dict: Any = None) -> Any:
        """NeMo reads the saved format flags from here before building the load request (the
        first read of a checkpoint: its sizes and metadata files are verified first, on each
        rank alone)."""
        if path is not None:
            path = _committed(Path(path))
            weights = _committed_weights(path)
            verify_checkpoint(weights, checksums=self._checksums(), shared=False)
        return super().load_content_metadata(path, preloaded_state_dict)

    def _checksums(self) -> bool:
        return checks_checksums(self._safety().verify)


def _committed_weights(path: Path) -> Path:
    """The committed weights directory of ``path`` (a NeMo ``step=N`` or its ``weights``);
    ``FileNotFoundError`` naming the previous committed checkpoint when there is none (a save
    that failed or was cut short leaves ``step=N`` without a committed ``weights/``)."""
    weights = ckpt_to_weights_subdir(path, is_saving=False)
    if is_complete(Path(weights)):
        return Path(weights)
    previous = previous_committed(path)
    instead = f"+resume={previous}" if previous is not None else "no earlier one is there"
    raise FileNotFoundError(
        f"{path} holds no committed checkpoint (no {Path(weights).name}/metadata.json: its save "
        f"failed or was cut short); resume from the previous committed checkpoint: {instead}"
    )


def _committed(path: Path) -> Path:
    """``path``, or the weights a commit crashed between its two renames left set aside."""
    weights = path / "weights"
    if path.name != "weights" and not weights.exists() and is_complete(previous_dir(weights)):
        return previous_dir(weights)
    return path

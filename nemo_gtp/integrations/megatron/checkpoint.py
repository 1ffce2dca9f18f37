"""GTP-aware sharded state dicts for megatron models and optimizers (design §1.8, §3.3).

megatron builds ``model.sharded_state_dict()`` as if every GTP shard were the whole TP-local
weight. :func:`make_gtp_sharded_state_dict` post-processes it:

- every parameter entry becomes a :class:`~nemo_gtp.checkpoint.pieces.RowMap` factory that
  describes the local tensor as pieces of megatron's own *unpadded* global (the note in
  :mod:`nemo_gtp.checkpoint.pieces` says why unpadded). For a GTP shard of rank ``g`` that is the
  offsets table of design §3.3 in unpadded rows: column-parallel rows start at ``tp_rank·rows_tp +
  g·shard_rows``, row-parallel rows at ``g·shard_rows`` with the TP offset on axis 1, no-TP rows at
  ``g·shard_rows``; pad rows are left out;
- ``replica_id`` takes its DP coordinate from the GTP-excluded replicate group (GTP peers hold
  different data, not replicas); every entry GTP does not shard (norms, biases, embeddings,
  ``_extra_state`` objects) folds ``gtp_rank`` into its TP coordinate, so exactly one GTP peer
  writes it — also in the distributed optimizer's ``fully_sharded_model_space`` format, which
  zeroes the DP coordinate;
- routed experts (megatron ``SequentialMLP``, and ``TEGroupedMLP`` whose ``GroupedLinear``
  describes each expert's ``weight{i}`` in the same format) do the same on the expert grid:
  megatron already put the global expert index (EP) and the ETP offset in their entries, the EGTP
  offset goes on the rows as above, the DP coordinate is the expert replicate rank (EDP) and the
  EGTP rank folds into the TP coordinate of the entries EGTP leaves whole (design §3.3 "Routed
  experts").

Because the factory keeps the parameter as its ``data``, megatron's optimizers match their state
to it by identity and re-key it (``optimizer.state.exp_avg.<key>`` ...), so master weights and
Adam moments get the same layout-independent pieces (§3.3 "Optimizer state"). Apply it in runs
without GTP too: the weights then stay byte-compatible with megatron's own format, and the
optimizer state is in the same layout-independent format as in GTP runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.distributed import DistributedDataParallel

from nemo_gtp.checkpoint.io import load_checkpoint, save_checkpoint
from nemo_gtp.checkpoint.layout import CheckpointLayout
from nemo_gtp.checkpoint.optimizer import (
    DEFAULT_SHARDING_TYPE,
    load_optimizer_state,
    optimizer_sharded_state_dict,
)
from nemo_gtp.checkpoint.pieces import RowMap, RowSegment
from nemo_gtp.engine.fp8_primary import (
    dequantize_fp8_primary,
    is_fp8_primary,
    quantize_loaded_fp8_primary,
)
from nemo_gtp.engine.grid import GTPGroups
from nemo_gtp.engine.param import is_gtp_param
from nemo_gtp.integrations.megatron.fp8_primary import quantize_fp8_primary_from_main_params
from nemo_gtp.integrations.megatron.sharding.built import is_presharded
from nemo_gtp.integrations.megatron.sharding.experts import is_expert_param


def gtp_sharded_state_dict(
    model: torch.nn.Module,
    groups: GTPGroups | None,
    *,
    prefix: str = "",
    metadata: dict | None = None,
) -> dict[str, Any]:
    """``model.sharded_state_dict()`` made GTP-aware (see the module docstring).

    ``groups=None`` means a run without GTP (replicate group = megatron's data-parallel group).

    Example::

        model_sd = gtp_sharded_state_dict(model, groups)
        optim_sd = optimizer_sharded_state_dict(optimizer, model_sd)
        save_checkpoint({"model": model_sd, "optimizer": optim_sd}, path,
                        layout=checkpoint_layout(model_sd, groups))
    """
    return make_gtp_sharded_state_dict(
        model.sharded_state_dict(prefix=prefix, metadata=metadata), groups
    )


def make_gtp_sharded_state_dict(sharded_state_dict: dict, groups: GTPGroups | None) -> dict:
    """Rewrite megatron's model sharded state dict for GTP, in place; returns it.

    Routed experts (megatron ``SequentialMLP`` and ``TEGroupedMLP``, design §3.3 "Routed
    experts") take the expert grid: megatron already composed the expert index (EP offset) with
    the ETP offset; the EGTP offset goes on the out_features axis as for dense GTP shards, and
    the replica id counts the expert replicate group (EGTP peers hold different rows, expert-DP
    ranks are replicas).
    """
    if groups is not None and groups.dims.gtp_enabled:
        _reject_unknown_expert_entries(sharded_state_dict)
    gtp_rank, gtp_size = (0, 1) if groups is None else (groups.gtp_rank, groups.gtp_size)
    if groups is None:
        replicate_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        expert_rank = parallel_state.get_expert_data_parallel_rank()
        egtp_rank, egtp_size = 0, 1
    else:
        replicate_rank = dist.get_rank(groups.replicate_cp)  # CP peers hold the same shards
        expert_rank = dist.get_rank(groups.expert_replicate)
        egtp_rank, egtp_size = groups.expert_gtp_rank, groups.expert_gtp_size

    over_gtp = groups is not None and _replicated_params_over_gtp(sharded_state_dict)
    expert_modules = _expert_module_keys(sharded_state_dict)

    def fold(
        replica_id: ReplicaId, gtp_sharded: bool, expert: bool, state_over_gtp: bool = False
    ) -> ReplicaId:
        rank, size, replica = (
            (egtp_rank, egtp_size, expert_rank) if expert else (gtp_rank, gtp_size, replicate_rank)
        )
        if isinstance(replica_id, tuple) and len(replica_id) == 3:
            if state_over_gtp:
                # shard_replicated_params_over_gtp: megatron's own DP coordinate (over DP x GTP)
                # elects one writer of the weight, and the distributed optimizer, which zeroes
                # it, writes every GTP peer's distinct slice of the replicated params' state.
                return replica_id
            pp, tp, _ = replica_id  # megatron's (PP, TP, DP); its DP coordinate counts GTP peers
            return (pp, tp if gtp_sharded else tp * size + rank, replica)
        if gtp_sharded or rank == 0:  # not megatron's layout: only keep GTP peers apart
            return replica_id
        return (replica_id, rank)

    def visit(value: Any) -> Any:
        expert = _module_key(value) in expert_modules
        if isinstance(value, ShardedObject):
            return replace(value, replica_id=fold(value.replica_id, False, expert))
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            row_map = _row_map(value)
            gtp_sharded = is_gtp_param(value.data)
            if gtp_sharded and groups is None:
                raise ValueError(f"{value.key} is GTP-sharded: pass the run's GTPGroups")
            if row_map is None:
                if gtp_sharded:
                    raise NotImplementedError(
                        f"{value.key}: cannot describe this GTP-sharded entry "
                        f"({type(value).__name__}) to the checkpoint"
                    )
                return replace(value, replica_id=fold(value.replica_id, False, expert, over_gtp))
            state_over_gtp = over_gtp and not gtp_sharded and not expert
            replica_id = fold(value.replica_id, gtp_sharded, expert, state_over_gtp)
            factory = row_map.factory(value.key, value.data, replica_id)
            if is_fp8_primary(value.data):
                factory = replace(factory, build_fn=_dequantized_build(factory.build_fn))
            return factory
        return value

    dict_list_map_inplace(visit, sharded_state_dict)
    return sharded_state_dict


def _dequantized_build(build_rows: Any) -> Any:
    """A factory build that stores an FP8 primary shard as its dequantized rows (design §3.3
    "FP8 primary weights").

    megatron describes a TransformerEngine FP8 param in its nominal dtype and every reader gets
    its dequantized values (per-tensor current scaling keeps no scaling state to store), so
    the checkpoint of an FP8 model is the one of the same model in the training dtype. The
    optimizer's states reuse the factory with their own (fp32) tensors as ``data``: only the
    model weight itself is dequantized.
    """

    def build(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: Any) -> Any:
        if is_fp8_primary(data):
            data = dequantize_fp8_primary(data)
        return build_rows(key, data, replica_id, flattened_range)

    return build


def _reject_unknown_expert_entries(sharded_state_dict: dict) -> None:
    """Refuse routed-expert params megatron does not describe per expert (``weight``/``bias``).

    ``SequentialMLP`` and ``TEGroupedMLP`` (one ``GroupedLinear`` weight per expert, keyed like
    ``SequentialMLP``'s with the global expert index as a prepended axis) are; anything else
    tagged as an expert is not known to be, and is refused rather than saved wrongly.
    """
    for value in nested_values(sharded_state_dict):
        key = getattr(value, "key", "")
        if is_expert_param(getattr(value, "data", None)) and key.rsplit(".", 1)[-1] not in (
            "weight",
            "bias",
        ):
            raise NotImplementedError(
                f"checkpoints of these MoE experts under GTP are not supported ({key}): use "
                "megatron's SequentialMLP (moe_grouped_gemm=False) or TEGroupedMLP (the TE layer "
                "spec with moe_grouped_gemm=True), or train without checkpoints and use "
                "nemo_gtp.full_state_dict for the weights"
            )


def _module_key(value: Any) -> str | None:
    """The sharded key of the module an entry belongs to (``...experts.linear_fc1``)."""
    key = getattr(value, "key", None)
    return key.rsplit(".", 1)[0] if isinstance(key, str) else None


def _expert_module_keys(sharded_state_dict: dict) -> set[str]:
    """Module keys of the routed experts, whose entries live on the expert grid.

    Tagged expert params (under GTP) and megatron's ``SequentialMLP`` keys (``...experts.<linear>``
    also without GTP, where nothing is tagged); ``_extra_state`` objects carry no param to ask and
    are matched by their module key.
    """
    keys = set()
    for value in nested_values(sharded_state_dict):
        key = _module_key(value)
        if key is not None and (
            is_expert_param(getattr(value, "data", None)) or "experts" in key.split(".")[:-1]
        ):
            keys.add(key)
    return keys


def _replicated_params_over_gtp(sharded_state_dict: dict) -> bool:
    """Whether the model's GTP runtime has ``shard_replicated_params_over_gtp`` on (False while
    no weight is registered yet: linears built as their shard before the model transform, whose
    pretrained weights NeMo's PEFT loads first; a load reads no replica id)."""
    for value in nested_values(sharded_state_dict):
        data = getattr(value, "data", None)
        if is_gtp_param(data) and not is_presharded(data):
            # one runtime per model: its first registered weight answers
            return data.runtime.config.shard_replicated_params_over_gtp
    return False


def _row_map(entry: ShardedTensor | ShardedTensorFactory) -> RowMap | None:
    """The row map of a parameter entry, or ``None`` for entries left to megatron."""
    data = entry.data
    if not isinstance(data, torch.nn.Parameter) or data.dim() == 0:
        return None
    if isinstance(entry, ShardedTensor):
        segments = _tensor_segments(entry)
        allow_mismatch = entry.allow_shape_mismatch
    else:
        segments = _factory_segments(entry)
        allow_mismatch = False
    if segments is None:
        return None
    first_row = data.gtp_spec.gtp_rank * data.gtp_spec.shard_dim0 if is_gtp_param(data) else 0
    return RowMap(tuple(data.shape), first_row, tuple(segments), allow_mismatch)


def _logical_shape(data: torch.Tensor) -> tuple[int, ...]:
    """Shape of the TP-local weight a param stands for (the unsharded one for a GTP shard)."""
    return tuple(data.gtp_spec.logical_shape) if is_gtp_param(data) else tuple(data.shape)


def _tensor_segments(entry: ShardedTensor) -> list[RowSegment] | None:
    if entry.flattened_range is not None:
        return None
    rows = _logical_shape(entry.data)[0]
    shape, offset = list(entry.global_shape), list(entry.global_offset)
    if is_gtp_param(entry.data):
        # megatron scaled the TP grid by the shard's rows; rescale it by the logical rows.
        if entry.axis_fragmentations is None:
            return None
        axis = entry.prepend_axis_num
        shape[axis] = entry.axis_fragmentations[axis] * rows
        offset[axis] = entry.global_offset[axis] // entry.local_shape[0] * rows
    return [RowSegment(0, rows, "", tuple(shape), tuple(offset))]


def _factory_segments(entry: ShardedTensorFactory) -> list[RowSegment] | None:
    """Segments of a megatron factory that cuts a param into row blocks (SwiGLU ``fc1``).

    The factory's own build runs on a meta tensor of the logical TP-local shape; each
    ShardedTensor it returns is a block of whole rows, located by its view's storage offset.
    Anything else (a factory that transforms values, flattens, ...) is not understood.
    """
    logical = _logical_shape(entry.data)
    meta = torch.empty(logical, dtype=entry.data.dtype, device="meta")
    try:
        built = entry.build_fn(entry.key, meta, entry.replica_id, None)
    except Exception:  # noqa: BLE001 - not a factory we can describe; the caller decides
        return None
    row_numel = math.prod(logical[1:])
    segments = []
    for sub in nested_values(built):
        if not (
            isinstance(sub, ShardedTensor)
            and sub.flattened_range is None
            and sub.data is not None
            and sub.data.is_contiguous()
            and tuple(sub.data.shape[1:]) == logical[1:]
            and sub.data.storage_offset() % row_numel == 0
            and sub.key.startswith(entry.key)
        ):
            return None
        start = sub.data.storage_offset() // row_numel
        segments.append(
            RowSegment(
                start,
                start + sub.data.shape[0],
                sub.key[len(entry.key) :],
                tuple(sub.global_shape),
                tuple(sub.global_offset),
            )
        )
    segments.sort(key=lambda seg: seg.local_start)
    covered = 0
    for seg in segments:
        if seg.local_start != covered:
            return None
        covered = seg.local_stop
    return segments if covered == logical[0] else None


def checkpoint_layout(sharded_state_dict: dict, groups: GTPGroups | None) -> CheckpointLayout:
    """The layout record of this run (collective over the world: padding from every stage)."""
    padded, pad_for_alignment = {}, None
    for value in nested_values(sharded_state_dict):
        data = getattr(value, "data", None)
        if isinstance(value, ShardedTensorFactory) and is_gtp_param(data):
            spec = data.gtp_spec
            padded[value.key] = (spec.logical_shape[0], spec.padded_dim0)
            state = data.gtp_state.runtime
            runtime = state() if state is not None else None
            if runtime is not None:
                pad_for_alignment = runtime.config.pad_for_alignment
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (padded, pad_for_alignment))
    for other, pad in every:
        padded.update(other)
        pad_for_alignment = pad_for_alignment if pad is None else pad
    dims = None if groups is None else groups.dims
    return CheckpointLayout(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        gtp_size=1 if dims is None else dims.gtp,
        data_parallel_size=(
            parallel_state.get_data_parallel_world_size(with_context_parallel=True)
            if dims is None
            else dims.dp
        ),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        world_size=dist.get_world_size(),
        pad_for_alignment=pad_for_alignment if padded else None,
        padded_rows=padded,
    )


def set_aside_fp8_primary_values(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    loaded: Mapping[str, Any],
    normalize: Callable[[str], str] = lambda name: name,
) -> tuple[dict[str, Any], list[torch.nn.Parameter], list[torch.Tensor | None]]:
    """Keep an FP8 primary shard's loaded value out of torch's ``load_state_dict`` (design §3.3
    "FP8 primary weights").

    torch's load copies a loaded value into the param, for an FP8 primary shard a cast into its
    float8 storage without a scale. Returns a copy of ``loaded`` whose entries for FP8 primary
    shards are the shards' own bytes (so that copy changes nothing), the FP8 primary params of
    ``named_params`` in their order, and the loaded value of each (``None`` where ``loaded``
    has none): what :func:`~nemo_gtp.engine.fp8_primary.quantize_loaded_fp8_primary` takes
    after the load. ``normalize`` maps both the param names and the keys of ``loaded`` to one
    form (NeMo's loaded keys and its model chunks' names differ in their ``module.`` prefixes).
    ``loaded`` itself is left as it is.

    Example::

        loaded, fp8, values = set_aside_fp8_primary_values(model.named_parameters(), loaded)
        model.load_state_dict(loaded)
        quantize_loaded_fp8_primary(fp8, values)
    """
    fp8 = {normalize(name): p for name, p in named_params if is_fp8_primary(p)}
    if not fp8:
        return dict(loaded), [], []
    kept, values = {}, {}
    for key, value in loaded.items():
        param = fp8.get(normalize(key))
        if param is not None:
            values[normalize(key)] = value
            value = param.detach()
        kept[key] = value
    return kept, list(fp8.values()), [values.get(name) for name in fp8]


def load_model_state(model: torch.nn.Module, loaded: dict, *, strict: bool = True) -> Any:
    """Copy a loaded model state dict (the result of loading a GTP-aware one) into ``model``.

    The GTP factories already merged every shard to its param's shape with zeros in the pad;
    the pad rows are zeroed again afterwards so the invariant holds whatever wrote the values.
    FP8 primary shards (design §3.3 "FP8 primary weights") receive the checkpoint's values
    quantized with the scale of the whole loaded weight (amax agreed over the GTP group, as
    TransformerEngine re-quantizes an FP8 param it copies a loaded value into); collective over
    each GTP group then. Returns ``load_state_dict``'s missing/unexpected keys.
    """
    loaded, fp8, values = set_aside_fp8_primary_values(model.named_parameters(), loaded)
    result = model.load_state_dict(loaded, strict=strict)
    if fp8:
        quantize_loaded_fp8_primary(fp8, values)
    with torch.no_grad():
        for param in model.parameters():
            if is_gtp_param(param) and not is_fp8_primary(param):
                spec = param.gtp_spec
                valid = spec.logical_shape[0] - spec.gtp_rank * spec.shard_dim0
                param.data[max(valid, 0) :].zero_()
    return result


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # megatron DDP would prefix every key with "module."; checkpoints key the bare model.
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def save_gtp_checkpoint(
    checkpoint_dir: str,
    model: torch.nn.Module,
    optimizer: Any,
    groups: GTPGroups | None,
    *,
    sharding_type: str = DEFAULT_SHARDING_TYPE,
    optimizer_metadata: dict | None = None,
    extra: dict | None = None,
    **save_kwargs: Any,
) -> Any:
    """Save model (+ optimizer) atomically as ``{"model": ..., "optimizer": ..., **extra}``.

    Collective. ``optimizer=None`` saves weights only; ``extra`` holds more common state;
    ``optimizer_metadata`` goes to megatron's optimizer ``sharded_state_dict``; ``save_kwargs``
    to :func:`~nemo_gtp.checkpoint.io.save_checkpoint` (``async_save=True`` returns its request).

    Example::

        save_gtp_checkpoint("ckpt/step100", model, optimizer, groups)
    """
    _check_fp8_primary_sharding(_unwrap(model), optimizer, sharding_type)
    model_sd = gtp_sharded_state_dict(_unwrap(model), groups)
    state = {"model": model_sd, **(extra or {})}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(
            optimizer, model_sd, sharding_type=sharding_type, metadata=optimizer_metadata
        )
    return save_checkpoint(
        state, checkpoint_dir, layout=checkpoint_layout(model_sd, groups), **save_kwargs
    )


def load_gtp_checkpoint(
    checkpoint_dir: str,
    model: torch.nn.Module,
    optimizer: Any,
    groups: GTPGroups | None,
    *,
    sharding_type: str = DEFAULT_SHARDING_TYPE,
    optimizer_metadata: dict | None = None,
) -> dict:
    """Load a checkpoint of any layout into ``model`` (+ ``optimizer``); returns the loaded dict.

    Collective. Raises :class:`~nemo_gtp.checkpoint.io.CheckpointShapeMismatchError` when the
    model's shapes differ from the checkpoint's. FP8 primary shards are re-quantized from the
    loaded weights, then, when the optimizer is loaded too, from its fp32 main params (their
    bytes and scales then equal the saving run's, design §3.3 "FP8 primary weights").
    """
    model = _unwrap(model)
    _check_fp8_primary_sharding(model, optimizer, sharding_type)
    model_sd = gtp_sharded_state_dict(model, groups)
    request = {"model": model_sd}
    if optimizer is not None:
        request["optimizer"] = optimizer_sharded_state_dict(
            optimizer,
            model_sd,
            is_loading=True,
            sharding_type=sharding_type,
            metadata=optimizer_metadata,
        )
    loaded = load_checkpoint(request, checkpoint_dir)
    load_model_state(model, loaded["model"])
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"])
        quantize_fp8_primary_from_main_params(optimizer)
    return loaded


def _check_fp8_primary_sharding(model: torch.nn.Module, optimizer: Any, sharding_type: str) -> None:
    """FP8 primary shards' optimizer state is tested in the default format only (raised before
    any collective)."""
    if optimizer is None or sharding_type == DEFAULT_SHARDING_TYPE:
        return
    if any(is_fp8_primary(p) for p in model.parameters()):
        raise NotImplementedError(
            f"checkpoints of FP8 primary GTP shards support the distributed optimizer's "
            f"sharding_type={DEFAULT_SHARDING_TYPE!r} only, got sharding_type={sharding_type!r}: "
            f"pass sharding_type={DEFAULT_SHARDING_TYPE!r} (megatron's dp_reshardable and "
            f"fully_reshardable formats split FP8 param buffers their own way)"
        )

"""FP8 primary GTP shards under megatron DDP and the distributed optimizer (design §1.3
"FP8 primary weights", "The megatron hook").

megatron-core 0.15 supports FP8 params (``fp8_param_gather``) through four functions of
``megatron.core.fp8_utils`` that its DDP, param buffer and distributed optimizer import by name:

- ``is_float8tensor(param)``: DDP gives the param a ``uint8`` param buffer, the optimizer seeds
  the fp32 main param from ``param.get_high_precision_init_val()`` and skips the plain copy of
  the main param into the model param after the step;
- ``modify_underlying_storage(param, uint8_view)``: DDP re-points the param at its buffer slice;
- ``quantize_param_shard(params, mains, offsets, data_parallel_group)``: the optimizer casts its
  fp32 main slices into the FP8 params (then DDP all-gathers the buffer's bytes);
- ``dequantize_fp8_tensor(param)``: the optimizer re-seeds its fp32 main params from the FP8
  params' values (``reload_model_params``: NeMo's load of a checkpoint's weights without its
  optimizer state).

:func:`install_fp8_primary_hooks` wraps those names in those three modules: a GTP FP8 primary
shard (``engine/fp8_primary.py``) answers ``is_float8tensor`` with True, its storage moves as
bytes, its write-back is :func:`~nemo_gtp.engine.fp8_primary.write_back_fp8_primary` with the
amax agreed over the data-parallel (replicate) group and, per tensor, the runtime's GTP group
(a blockwise tile lies within one shard), and its value
is :func:`~nemo_gtp.engine.fp8_primary.dequantize_fp8_primary` (megatron's own function would
hand the shard to TE's ``dequantize``, which a plain float8 tensor does not scale). Every other
tensor goes to megatron's own function. The wrappers are installed once per process and
delegate everything that is not a GTP shard, so they are inert for a model without FP8 primary
shards.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_gtp.engine.fp8_primary import (
    dequantize_fp8_primary,
    is_fp8_primary,
    write_back_fp8_primary,
)

_MODULES = (
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.distrib_optimizer",
)
_MARK = "_nemo_gtp_fp8_primary"


def check_fp8_primary_ddp(ddp_config: object) -> None:
    """Settings megatron DDP needs for FP8 primary GTP shards (raised before any collective).

    DDP takes the gradient buffer's dtype from ``param.dtype`` unless ``grad_reduce_in_fp32``
    (an FP8 primary shard's dtype is float8, unlike TE's nominal-dtype tensors), and only the
    distributed optimizer keeps fp32 main params for FP8 params.

    Example::

        check_fp8_primary_ddp(DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                            use_distributed_optimizer=True))
    """
    if not getattr(ddp_config, "grad_reduce_in_fp32", False):
        raise ValueError(
            "ddp: FP8 primary GTP shards (fp8_param_gather) need "
            "DistributedDataParallelConfig(grad_reduce_in_fp32=True) (NeMo: "
            "MegatronMixedPrecision(grad_reduce_in_fp32=True), its default, sets it): megatron "
            "DDP would otherwise allocate the gradient buffer in the shard's float8 dtype"
        )
    if not getattr(ddp_config, "use_distributed_optimizer", False):
        raise ValueError(
            "ddp: FP8 primary GTP shards (fp8_param_gather) need "
            "DistributedDataParallelConfig(use_distributed_optimizer=True): only megatron's "
            "distributed optimizer keeps the fp32 main params FP8 params are written back from"
        )


def _is_float8tensor(original: Callable[[torch.Tensor], bool]) -> Callable[[torch.Tensor], bool]:
    def is_float8tensor(tensor: torch.Tensor) -> bool:
        return is_fp8_primary(tensor) or original(tensor)

    setattr(is_float8tensor, _MARK, original)
    return is_float8tensor


def _modify_underlying_storage(original: Callable[..., None]) -> Callable[..., None]:
    def modify_underlying_storage(tensor: torch.Tensor, new_raw_data: torch.Tensor) -> None:
        if not is_fp8_primary(tensor):
            original(tensor, new_raw_data)
            return
        # The shard's FP8 bytes into its uint8 buffer slice, then the param (and its FP8Shard
        # record) viewed there: the optimizer's write-back and DDP's all-gather then share them.
        new_raw_data.copy_(tensor.detach().view(torch.uint8))
        tensor.data = new_raw_data.view(tensor.dtype)
        state = tensor.gtp_state
        state.fp8.data = tensor.data

    setattr(modify_underlying_storage, _MARK, original)
    return modify_underlying_storage


def _quantize_param_shard(original: Callable[..., None]) -> Callable[..., None]:
    def quantize_param_shard(
        model_params: Sequence[torch.Tensor],
        main_params: Sequence[torch.Tensor | None],
        start_offsets: Sequence[int | None],
        data_parallel_group: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        ours: tuple[list, list, list] = ([], [], [])
        rest: tuple[list, list, list] = ([], [], [])
        for param, main, start in zip(model_params, main_params, start_offsets, strict=True):
            for out, value in zip(ours if is_fp8_primary(param) else rest, (param, main, start)):
                out.append(value)
        # Every rank of the replicate and GTP groups holds the same params in the same buffer
        # order, so the write-back's runtimes come in the same order on every rank.
        if ours[0]:
            write_back_fp8_primary(*ours, data_parallel_group)
        original(*rest, data_parallel_group, *args, **kwargs)

    setattr(quantize_param_shard, _MARK, original)
    return quantize_param_shard


def _dequantize_fp8_tensor(
    original: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    def dequantize_fp8_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if is_fp8_primary(tensor):
            return dequantize_fp8_primary(tensor)
        return original(tensor)

    setattr(dequantize_fp8_tensor, _MARK, original)
    return dequantize_fp8_tensor


_WRAPPERS = {
    "is_float8tensor": _is_float8tensor,
    "modify_underlying_storage": _modify_underlying_storage,
    "quantize_param_shard": _quantize_param_shard,
    "dequantize_fp8_tensor": _dequantize_fp8_tensor,
}


def install_fp8_primary_hooks() -> None:
    """Route megatron's FP8-param functions to GTP's FP8 primary shards (idempotent).

    Called by ``GTPDDPMixin`` when the module it wraps has FP8 primary shards, before megatron
    allocates its buffers. Example::

        make_fp8_primary(model.gtp_runtime, FP8Scaling("tensorwise"))   # or "blockwise"
        ddp = GTPDistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
    """
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr, wrap in _WRAPPERS.items():
            current = getattr(module, attr, None)
            if current is not None and not hasattr(current, _MARK):
                setattr(module, attr, wrap(current))


def fp8_primary_hooks_installed() -> bool:
    """Whether :func:`install_fp8_primary_hooks` has run in this process."""
    module = importlib.import_module(_MODULES[-1])
    return hasattr(module.quantize_param_shard, _MARK)


def quantize_fp8_primary_from_main_params(optimizer: Any) -> bool:
    """Re-quantize every FP8 primary shard from the distributed optimizer's fp32 main params,
    then all-gather the param buffers, as after an optimizer step (design §3.3 "FP8 primary
    weights"). Returns whether the optimizer holds any FP8 primary shard.

    After a checkpoint load the shards hold the saved (dequantized) weights re-quantized; the
    main params just loaded are what the saving run quantized its shards from, so this gives
    back its FP8 bytes and scales bit for bit (the scale recomputed from dequantized values can
    differ in its last bit). Collective over every rank of the optimizer's groups.

    Example::

        load_optimizer_state(optimizer, loaded["optimizer"])
        quantize_fp8_primary_from_main_params(optimizer)
    """
    chunks: dict[int, Any] = {}
    found = False
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        get = getattr(opt, "_get_fp8_params_and_shard_fp32_from_fp8", None)
        if get is None:
            continue
        ours = [entry for entry in zip(*get(), strict=True) if is_fp8_primary(entry[0])]
        if ours:
            write_back_fp8_primary(*zip(*ours), opt.data_parallel_group)
            found = True
            for chunk in opt.model_chunks:
                chunks.setdefault(id(chunk), chunk)
    for chunk in chunks.values():
        # each replicate rank cast only its own slices: megatron's param all-gather completes
        # the shards (the FP8 bytes travel in the uint8 param buffer)
        chunk.start_param_sync(force_sync=True)
    return found

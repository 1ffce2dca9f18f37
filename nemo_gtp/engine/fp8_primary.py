"""FP8 primary weights as GTP shards: the shard *is* FP8, its master lives in the optimizer
(design §1.3 "FP8 primary weights").

megatron's ``fp8_param_gather`` (TransformerEngine's ``quantized_model_init``) keeps a model
weight as FP8 data plus a per-tensor ``scale_inv`` (1 byte per element), the distributed
optimizer an fp32 master of the param's data-parallel slice; after each step the optimizer
quantizes its slice into the FP8 param with an amax all-reduced over the data-parallel group,
and the FP8 bytes are all-gathered. Under GTP the param is a GTP shard, so the same contract
holds one level down:

- :func:`make_fp8_primary` turns every shard of a runtime into FP8 storage (the
  ``GTPShardedParam``'s own data becomes ``float8``; no training-dtype shard is kept). Its
  per-tensor scale is agreed over the GTP group (one all-reduce MAX of a packed amax vector),
  so the shards are exactly the rows of the full weight quantized on one rank. The training-
  dtype values are kept aside once, for the optimizer's master
  (:func:`fp8_primary_init_value`; the FP8 values would lose precision at step 0, as TE notes
  for its own FP8 params).
- The runtime gathers the param's own bytes (``GTPRuntime.fp8_primary``): no refresh cast, no
  FP8 copy; the TE consumer wraps the gathered rows as for the FP8 gather.
- :func:`write_back_fp8_primary` (``engine/fp8_write_back.py``, planned once for the lists
  megatron passes every step) is the optimizer's write-back: each rank holds the fp32
  master of a flat slice of its shard (megatron's distributed optimizer splits the shard over
  the replicate group), or none. The amax of every slice's real elements (pad rows excluded)
  goes into one vector, all-reduced (MAX) over each group given (the replicate group, then the
  GTP group: together every piece of the full TP-local weight), then every rank sets the agreed
  scale and casts its slice. After the replicate group's all-gather of the FP8 bytes (megatron's
  param all-gather) each GTP peer's shard equals the rows of the full master quantized on one
  rank, bit for bit.

Blockwise scaling (megatron ``fp8_recipe="blockwise"``, TE's ``Float8BlockScaling``: one scale
per 128x128 tile) follows the same contract with one scale per tile instead of one per weight: a
tile never spans two GTP shards (the shards' rows are whole tiles, checked by
:func:`make_fp8_primary`), so the amax of a tile is agreed over the replicate group only (its
pieces are the distributed optimizer's slices of one shard), never over GTP. Each shard keeps
its tiles' ``scale_inv`` in the gather-ready layout of the FP8 gather (padded to whole
``SCALE_COLUMN_ALIGN`` columns, ``gtp_state.fp8_scale_wire``): the runtime gathers the FP8 rows
and those scales in one collective. Every rank computes every tile's scale from the agreed amax,
so the scales never travel with megatron's param all-gather.

The master is rounded to the training dtype before the amax and the cast, as TE does
(``quantize_master_weights``) for either recipe. Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_gtp.engine.fp8 import (
    FP8_DTYPES,
    SCALAR_STRIDE,
    FP8Scaling,
    FP8Shard,
    ScalingKind,
    check_block_alignment,
    dequantize_fp8,
)
from nemo_gtp.engine.fp8_gather import padded_scale_shape
from nemo_gtp.engine.fp8_write_back import is_fp8_primary, write_back_fp8_primary
from nemo_gtp.engine.param import GTPShardedParam

__all__ = [
    "dequantize_fp8_primary",
    "fp8_primary_init_value",
    "is_fp8_primary",
    "make_fp8_primary",
    "quantize_loaded_fp8_primary",
    "write_back_fp8_primary",
]


def _check_scaling(scaling: FP8Scaling) -> None:
    if scaling.kind is ScalingKind.DELAYED:
        raise NotImplementedError(
            "FP8 primary GTP shards support fp8_recipe='tensorwise' (per-tensor current "
            "scaling) and 'blockwise' (128x128 tiles), got fp8_recipe='delayed': set "
            "fp8_recipe='tensorwise' or 'blockwise', or fp8_param_gather=False (the shards then "
            "stay in the training dtype)"
        )


def _check_tiles(params: Sequence[GTPShardedParam], scaling: FP8Scaling, pad: int) -> None:
    """Blockwise: every shard is a 2-D weight of whole tiles (a tile's scale is its owner's)."""
    for param in params:
        if param.dim() != 2:
            raise ValueError(
                f"{param.gtp_state.name}: blockwise FP8 primary weights must be 2-D, got shape "
                f"{tuple(param.shape)}"
            )
        check_block_alignment(param.gtp_spec, scaling.block, pad)


def _scalars(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """amax, scale, scale_inv vectors with one aligned element per weight."""
    return tuple(
        torch.zeros(n * SCALAR_STRIDE, dtype=torch.float32, device=device) for _ in range(3)
    )


def make_fp8_primary(runtime: object, scaling: FP8Scaling) -> None:
    """Make every shard of ``runtime`` an FP8 primary weight (collective over its GTP group).

    Each shard's real rows are quantized with the full weight's scale (amax agreed over the GTP
    group; blockwise each tile's own); the param's data becomes the FP8 tensor (pad rows zero),
    its scale / scale_inv / amax (``param.gtp_state.fp8``) views into runtime-wide vectors (per
    tile: grids, ``scale_inv`` in the gather-ready ``fp8_scale_wire``), the training dtype is
    remembered as ``gtp_state.fp8_primary_dtype`` (the GEMM and gradient dtype) and the
    training-dtype shard is kept for the optimizer's master until
    :meth:`GTPShardedParam.clear_high_precision_init_val`. The quantization itself is
    :func:`write_back_fp8_primary` of each shard's own values. Run it after the model is built
    and before DDP wraps it (DDP moves the param's storage into its buffer). Checks run before
    the collective.

    Example::

        make_fp8_primary(model.gtp_runtime, FP8Scaling("tensorwise"))
    """
    _check_scaling(scaling)
    params = list(runtime.params)
    if not params:
        return
    if runtime.weight_groups:
        raise NotImplementedError(
            "FP8 primary weights are not supported for GTP weight groups (routed experts) yet: "
            "set fp8_param_gather=False, or keep the experts whole (expert_num_weight_shards)"
        )
    for param in params:
        if param.dtype in FP8_DTYPES or is_fp8_primary(param):
            raise ValueError(f"{param!r} is already an FP8 primary weight")
        if not param.dtype.is_floating_point:
            raise ValueError(f"{param!r}: FP8 primary weights need a floating-point shard")
    blockwise = scaling.kind is ScalingKind.BLOCKWISE
    if blockwise:
        _check_tiles(params, scaling, runtime.config.pad_for_alignment)
    device = params[0].device
    if not blockwise:  # runtime-wide, one aligned slot per weight
        amax, scale, scale_inv = _scalars(len(params), device)
    with torch.no_grad():
        for i, param in enumerate(params):
            state = param.gtp_state
            state.fp8_init = param.detach().clone()
            state.fp8_primary_dtype = param.dtype
            data = torch.zeros(param.shape, dtype=scaling.fp8_dtype, device=device)
            if blockwise:  # per tile; scale_inv lives in the gather-ready (padded) layout
                grid = scaling.scale_shape(tuple(param.shape))
                wire = torch.zeros(
                    padded_scale_shape(*param.shape, scaling), dtype=torch.float32, device=device
                )
                state.fp8_scale_wire = wire
                state.fp8 = FP8Shard(
                    data,
                    wire[:, : grid[1]],
                    torch.ones(grid, dtype=torch.float32, device=device),
                    torch.zeros(grid, dtype=torch.float32, device=device),
                    scaling,
                )
            else:
                view = slice(i * SCALAR_STRIDE, i * SCALAR_STRIDE + 1)
                state.fp8 = FP8Shard(data, scale_inv[view], scale[view], amax[view], scaling)
            param.data = data
    # The initial quantization is a write-back of the whole shard from its own values.
    masters = [p.gtp_state.fp8_init.reshape(-1) for p in params]
    write_back_fp8_primary(params, masters, [0] * len(params), keep_plan=False)
    runtime.fp8_primary = scaling


def fp8_primary_init_value(param: GTPShardedParam) -> torch.Tensor:
    """The training-dtype shard :func:`make_fp8_primary` quantized (the optimizer master's
    initial value), or the dequantized shard once cleared.

    Example::

        master = fp8_primary_init_value(param).float().view(-1)[start:end].clone()
    """
    return param.get_high_precision_init_val()


def dequantize_fp8_primary(
    param: GTPShardedParam, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The FP8 shard times its ``scale_inv`` (per tile for blockwise), in ``dtype`` (default:
    the training dtype).

    Example::

        dequantize_fp8_primary(param).shape == param.shape
    """
    state = param.gtp_state
    shard = state.fp8
    return dequantize_fp8(
        param.detach(), shard.scale_inv, shard.scaling, dtype or state.fp8_primary_dtype
    )


def quantize_loaded_fp8_primary(
    params: Sequence[GTPShardedParam], values: Sequence[torch.Tensor | None]
) -> None:
    """Quantize loaded values into FP8 primary shards with the full weight's scale (design §3.3
    "FP8 primary weights").

    ``values[i]`` is the loaded (dequantized, training-dtype or fp32) shard of ``params[i]``,
    shaped like it, pad rows ignored; ``None`` keeps the param's own dequantized values. A
    per-tensor amax is agreed over each param's GTP group (one all-reduce per runtime, in the
    order the runtimes first appear: every GTP peer passes the same params in the same order);
    a tile's is its owner's. Every replicate rank holds the whole loaded shard, so no other
    group is involved. Values that are themselves a dequantized FP8 weight come back as the
    same values: per tensor as the same FP8 bytes (the round trip through the training dtype
    moves a value far less than half an FP8 step); blockwise a tile whose largest code had
    rounded down to half the FP8 maximum comes back with twice the codes and half the
    power-of-two scale (the same values; :func:`write_back_fp8_primary` from the loaded fp32
    masters restores the saving run's bytes).

    Example::

        quantize_loaded_fp8_primary([layer.weight], [loaded["decoder...weight"]])
    """
    if len(params) != len(values):
        raise ValueError("quantize_loaded_fp8_primary: params and values differ in length")
    sources = []
    for param, value in zip(params, values):
        if not is_fp8_primary(param):
            raise ValueError(f"{param!r} is not an FP8 primary weight (make_fp8_primary)")
        if value is not None and tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{param.gtp_state.name}: loaded value of shape {tuple(value.shape)} for a shard "
                f"of shape {tuple(param.shape)}"
            )
        source = dequantize_fp8_primary(param, torch.float32) if value is None else value
        sources.append(source.detach().reshape(-1))
    write_back_fp8_primary(params, sources, [0] * len(sources), keep_plan=False)

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
- :func:`write_back_fp8_primary` is the optimizer's write-back: each rank holds the fp32
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

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_gtp.engine.fp8 import (
    FP8_DTYPES,
    FP8Scaling,
    FP8Shard,
    ScalingKind,
    _cast,
    _real_rows,
    check_block_alignment,
    dequantize_fp8,
    scale_from_amax,
)
from nemo_gtp.engine.fp8_gather import _SCALAR_STRIDE as _STRIDE  # cuBLAS-aligned scalars
from nemo_gtp.engine.fp8_gather import padded_scale_shape
from nemo_gtp.engine.param import GTPShardedParam

_INF = float("inf")


def is_fp8_primary(param: object) -> bool:
    """True for a GTP shard whose storage is FP8 (:func:`make_fp8_primary`).

    Example::

        is_fp8_primary(layer.weight)   # True after make_fp8_primary(layer's runtime, ...)
    """
    return isinstance(param, GTPShardedParam) and param.gtp_state.fp8_primary_dtype is not None


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
    return tuple(torch.zeros(n * _STRIDE, dtype=torch.float32, device=device) for _ in range(3))


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
                view = slice(i * _STRIDE, i * _STRIDE + 1)
                state.fp8 = FP8Shard(data, scale_inv[view], scale[view], amax[view], scaling)
            param.data = data
    # The initial quantization is a write-back of the whole shard from its own values.
    masters = [p.gtp_state.fp8_init.reshape(-1) for p in params]
    write_back_fp8_primary(params, masters, [0] * len(params))
    runtime.fp8_primary = scaling


def fp8_primary_init_value(param: GTPShardedParam) -> torch.Tensor:
    """The training-dtype shard :func:`make_fp8_primary` quantized (the optimizer master's
    initial value), or the dequantized shard once cleared.

    Example::

        master = fp8_primary_init_value(param).float().view(-1)[start:end].clone()
    """
    state = param.gtp_state
    if state.fp8_init is not None:
        return state.fp8_init
    return dequantize_fp8_primary(param)


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


def write_back_fp8_primary(
    params: Sequence[GTPShardedParam],
    masters: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    replicate_group: dist.ProcessGroup | None = None,
) -> None:
    """Quantize each param's master slice into its FP8 shard with the full weight's scales.

    ``masters[i]`` is the fp32 master of the flat elements ``[start_offsets[i], +numel)`` of
    ``params[i]``'s shard on this rank, or ``None`` when another replicate rank holds all of it
    (megatron's ``quantize_param_shard`` convention). ``replicate_group``: the group whose
    members hold the other slices of the same shards (the distributed optimizer's data-parallel
    group), ``None`` when every rank holds its whole shard. Params of several runtimes (dense and
    expert axes) are written back runtime by runtime, in the order the runtimes first appear in
    ``params`` (the same on every rank: each holds the same params in the same order).

    The amax of every scaling unit goes into one vector, all-reduced (MAX) once per group that
    holds pieces of it: per tensor the replicate group, then the runtime's GTP group (together
    every piece of the TP-local weight); blockwise the replicate group only (a tile lies within
    one shard). Every rank then sets every param's scales (the replicas need them after the
    param all-gather) and casts only its own slices, pad elements written as zeros. All checks
    run before the first collective; every rank of the groups calls it with the same ``params``.

    Example::

        optimizer.step()     # fp32 masters updated
        write_back_fp8_primary(params, masters, offsets, replicate_group)
        # then all-gather the FP8 bytes over the replicate group (megatron's param gather)
    """
    if not (len(params) == len(masters) == len(start_offsets)):
        raise ValueError("write_back_fp8_primary: params, masters, start_offsets differ in length")
    if not params:
        return
    for param, master, start in zip(params, masters, start_offsets):
        if not is_fp8_primary(param):
            raise ValueError(f"{param!r} is not an FP8 primary weight (make_fp8_primary)")
        if master is None:
            continue
        if start is None or start < 0 or start + master.numel() > param.numel():
            raise ValueError(
                f"{param.gtp_state.name}: master slice [{start}, +{master.numel()}) outside the "
                f"shard's {param.numel()} elements"
            )
    by_runtime: dict[int, list[int]] = {}
    for i, param in enumerate(params):
        by_runtime.setdefault(id(param.runtime), []).append(i)
    with torch.no_grad():
        for members in by_runtime.values():  # one runtime: one GTP group, one recipe
            ours = [params[i] for i in members]
            mine = [masters[i] for i in members], [start_offsets[i] for i in members]
            scaling = ours[0].gtp_state.fp8.scaling
            if scaling.kind is ScalingKind.BLOCKWISE:
                _write_back_tiles(ours, *mine, [replicate_group], scaling)
            else:
                _write_back_tensors(ours, *mine, [replicate_group, ours[0].runtime.group])


def _real_elements(param: GTPShardedParam) -> int:
    """Flat elements of the shard's real rows (design §1.3 pad rows after them)."""
    cols = param.numel() // max(param.shape[0], 1)
    return _real_rows(param.gtp_spec, param.shape[0]) * cols


def _rounded_slice(param: GTPShardedParam, master: torch.Tensor, start: int) -> torch.Tensor:
    """The master slice in fp32 after TE's rounding to the training dtype, pad elements zero."""
    values = master.detach().reshape(-1).to(param.gtp_state.fp8_primary_dtype).float()
    keep = max(0, min(values.numel(), _real_elements(param) - start))
    if keep < values.numel():
        values = values.clone()
        values[keep:] = 0
    return values


def _all_reduce_max(amax: torch.Tensor, groups: Sequence[dist.ProcessGroup | None]) -> None:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


WRITE_BACK_CHUNK_ELEMENTS = 1 << 24
"""Elements of a master slice the write-back casts at once (design §1.3 "FP8 primary weights"):
its fp32 working copies stay a few times 64 MiB whatever the model's size (one piece of one
weight at a time, in two passes: the amax, then after the collective the cast); a 1B model's
largest shard is one piece."""


def _pieces(
    param: GTPShardedParam, master: torch.Tensor | None, start: int | None, rows_per_unit: int
):
    """``(piece start, master elements)`` of a master slice, cut at multiples of whole units
    of ``rows_per_unit`` rows (a tile row, or a row) at most ~:data:`WRITE_BACK_CHUNK_ELEMENTS`
    long; nothing when the rank holds none of it."""
    if master is None or not master.numel():
        return
    flat = master.detach().reshape(-1)
    unit = rows_per_unit * (param.numel() // max(param.shape[0], 1))
    step = max(1, WRITE_BACK_CHUNK_ELEMENTS // unit) * unit
    at, end = start, start + flat.numel()
    while at < end:
        stop = min(end, (at // step + 1) * step)
        yield at, flat[at - start : stop - start]
        at = stop


# Rounding to the training dtype is monotonic and symmetric, so the amax of the rounded master
# is the rounded amax of the master: the amax pass reads the fp32 master as it is (one max
# kernel, no working copy) and rounds the result, bit for bit what TE computes on the rounded
# values; the cast pass rounds the values it casts.


def _cast_into(
    target: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, limit
) -> None:
    """``target`` (FP8) = saturating cast of ``values`` rounded to ``dtype``, times ``scale``."""
    target.copy_((values.to(dtype) * scale).clamp_(-limit, limit))


def _write_back_tensors(params, masters, start_offsets, groups) -> None:
    """Per-tensor current scaling: one amax per weight, agreed over replicate x GTP."""
    n, k = len(params), _STRIDE
    device = params[0].device
    amax = torch.zeros(n * k, dtype=torch.float32, device=device)
    reals, slots = [], []
    for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
        real = _real_elements(param)
        for at, piece in _pieces(param, master, start, 1):
            if at < real:
                reals.append(piece[: real - at])
                slots.append(i * k)
    if reals:  # every piece's amax in one multi-tensor kernel, the max per weight
        norms = torch.stack(torch._foreach_norm(reals, _INF)).float()
        index = torch.tensor(slots, dtype=torch.long, device=device)
        amax.index_reduce_(0, index, norms, "amax")
    for dtype in {p.gtp_state.fp8_primary_dtype for p in params}:  # TE's rounding of the master
        rows = [i * k for i, p in enumerate(params) if p.gtp_state.fp8_primary_dtype is dtype]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        amax.index_copy_(0, index, amax.index_select(0, index).to(dtype).float())
    _all_reduce_max(amax, groups)
    scaling = params[0].gtp_state.fp8.scaling
    scale = scale_from_amax(amax, scaling)
    scale_inv = torch.reciprocal(scale)
    for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
        state = param.gtp_state
        shard = state.fp8
        view = slice(i * k, i * k + 1)
        shard.amax.copy_(amax[view])
        shard.scale.copy_(scale[view])
        shard.scale_inv.copy_(scale_inv[view])
        flat = param.detach().view(-1)
        real = _real_elements(param)
        for at, piece in _pieces(param, master, start, 1):
            keep = max(0, min(piece.numel(), real - at))
            target = flat[at : at + piece.numel()]
            _cast_into(
                target[:keep],
                piece[:keep],
                state.fp8_primary_dtype,
                shard.scale,
                shard.scaling.fp8_max,
            )
            target[keep:].view(torch.uint8).zero_()  # pad elements: FP8 zeros


def _tile_window(
    values: torch.Tensor, start: int, shape: torch.Size, block: tuple[int, int]
) -> tuple[int, int, torch.Tensor]:
    """The tile rows a flat slice ``[start, +numel)`` of a ``shape`` weight touches: (first
    tile row, the slice's offset in the window, the window as ``(tile rows, rows, tile
    columns, columns)`` blocks, zero outside the slice)."""
    cols = shape[1]
    block_rows, block_cols = block
    first = start // cols // block_rows
    last = (start + values.numel() - 1) // cols // block_rows
    window = torch.zeros((last - first + 1) * block_rows * cols, device=values.device)
    offset = start - first * block_rows * cols
    window[offset : offset + values.numel()] = values
    col_tiles = math.ceil(cols / block_cols)
    padded = F.pad(window.view(-1, cols), (0, col_tiles * block_cols - cols))
    return first, offset, padded.view(last - first + 1, block_rows, col_tiles, block_cols)


def _whole_tiles(
    param: GTPShardedParam, at: int, piece: torch.Tensor, block
) -> torch.Tensor | None:
    """``piece`` viewed as ``(tile rows, rows, tile columns, columns)`` when it is whole tile
    rows of real elements and the columns whole tiles (the common case: no working copy);
    None otherwise (a distributed optimizer's slice edge, pad rows, a partial tile column)."""
    cols = param.shape[1]
    block_rows, block_cols = block
    unit = block_rows * cols
    if cols % block_cols or at % unit or piece.numel() % unit:
        return None
    if at + piece.numel() > _real_elements(param):
        return None
    return piece.view(-1, block_rows, cols // block_cols, block_cols)


def _write_back_tiles(params, masters, start_offsets, groups, scaling: FP8Scaling) -> None:
    """Blockwise: one amax per tile, agreed over the replicate group (TE's partial amax of each
    rank's slice, then MAX); every tile's scale on every rank, each rank casts its slice. The
    pieces are whole tile rows (except at the slice's ends), so each tile's partial amax comes
    from one piece."""
    block = scaling.block
    sizes = [param.gtp_state.fp8.amax.numel() for param in params]
    bounds = [0, *itertools.accumulate(sizes)]
    amax = torch.zeros(bounds[-1], dtype=torch.float32, device=params[0].device)
    for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
        dtype = param.gtp_state.fp8_primary_dtype
        grid = amax[bounds[i] : bounds[i + 1]].view(param.gtp_state.fp8.amax.shape)
        for at, piece in _pieces(param, master, start, block[0]):
            tiles = _whole_tiles(param, at, piece, block)
            if tiles is not None:  # the rounded amax, from the master as it is
                first = at // (block[0] * param.shape[1])
                peak = torch.linalg.vector_norm(tiles, _INF, dim=(1, 3)).to(dtype).float()
            else:
                values = _rounded_slice(param, piece, at)
                first, _, tiles = _tile_window(values, at, param.shape, block)
                peak = tiles.abs().amax(dim=(1, 3))
            grid[first : first + tiles.shape[0]] = peak
    _all_reduce_max(amax, groups)
    scale = scale_from_amax(amax, scaling)
    scale_inv = torch.reciprocal(scale)
    for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
        state = param.gtp_state
        shard = state.fp8
        part = slice(bounds[i], bounds[i + 1])
        shard.amax.copy_(amax[part].view(shard.amax.shape))
        shard.scale.copy_(scale[part].view(shard.scale.shape))
        shard.scale_inv.copy_(scale_inv[part].view(shard.scale.shape))  # the wire's columns
        flat = param.detach().view(-1)
        for at, piece in _pieces(param, master, start, block[0]):
            target = flat[at : at + piece.numel()]
            tiles = _whole_tiles(param, at, piece, block)
            if tiles is not None:
                first = at // (block[0] * param.shape[1])
                tile_scale = shard.scale[first : first + tiles.shape[0], None, :, None]
                _cast_into(
                    target.view(tiles.shape),
                    tiles,
                    state.fp8_primary_dtype,
                    tile_scale,
                    scaling.fp8_max,
                )
                continue
            values = _rounded_slice(param, piece, at)
            first, offset, tiles = _tile_window(values, at, param.shape, block)
            tile_scale = shard.scale[first : first + tiles.shape[0], None, :, None]
            cast = _cast(tiles, tile_scale, scaling).view(-1, tiles.shape[2] * tiles.shape[3])
            target.copy_(cast[:, : param.shape[1]].reshape(-1)[offset : offset + values.numel()])


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
    write_back_fp8_primary(params, sources, [0] * len(sources))  # runtime by runtime

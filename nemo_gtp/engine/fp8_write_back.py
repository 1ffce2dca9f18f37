"""The optimizer's write-back into FP8 primary GTP shards (design §1.3 "FP8 primary weights").

After each optimizer step every rank holds the fp32 master of a flat slice of its shard
(megatron's distributed optimizer splits the shard over the replicate group), or none.
:func:`write_back_fp8_primary` agrees the amax of every scaling unit (a weight per tensor, a
128x128 tile blockwise) over the groups holding pieces of it, sets every shard's scales on
every rank, and casts each rank's own slices into the FP8 shard; the replicate group's
all-gather of the FP8 bytes (megatron's param all-gather) then completes the shards.

The lists megatron passes are the same every step (the same params, the same fp32 master
tensors updated in place, the same offsets), so what the write-back does for them is planned
once (:class:`_Plan`: every view, tile layout, slot index and fast/slow decision) and kept on
the runtime; the steady-state step runs one reduction kernel and one cast per piece, and a
handful of whole-vector kernels for everything else (the host cost per weight stays tens of
µs, as the rest of the step's). A list that differs (another master tensor, a moved param, a
checkpoint load's values) gets a plan of its own. Pure torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_gtp.engine.fp8 import SCALAR_STRIDE, FP8Scaling, ScalingKind, cast_to_fp8, scale_from_amax
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.shard import real_rows

_INF = float("inf")

WRITE_BACK_CHUNK_ELEMENTS = 1 << 24
"""Elements of a master slice the write-back casts at once (design §1.3 "FP8 primary weights"):
its fp32 working copies stay a few times 64 MiB whatever the model's size (one piece of one
weight at a time, in two passes: the amax, then after the collective the cast); a 1B model's
largest shard is one piece."""


def is_fp8_primary(param: object) -> bool:
    """True for a GTP shard whose storage is FP8 (``make_fp8_primary``).

    Example::

        is_fp8_primary(layer.weight)   # True after make_fp8_primary(layer's runtime, ...)
    """
    return isinstance(param, GTPShardedParam) and param.gtp_state.fp8_primary_dtype is not None


def write_back_fp8_primary(
    params: Sequence[GTPShardedParam],
    masters: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    replicate_group: dist.ProcessGroup | None = None,
    *,
    keep_plan: bool = True,
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
    ``keep_plan=False`` (one-off values, e.g. a checkpoint's) does not keep the plan, nor
    through it the values, beyond the call.

    Example::

        optimizer.step()     # fp32 masters updated
        write_back_fp8_primary(params, masters, offsets, replicate_group)
        # then all-gather the FP8 bytes over the replicate group (megatron's param all-gather)
    """
    if not (len(params) == len(masters) == len(start_offsets)):
        raise ValueError("write_back_fp8_primary: params, masters, start_offsets differ in length")
    if not params:
        return
    by_runtime: dict[int, list[int]] = {}
    for i, param in enumerate(params):
        if not is_fp8_primary(param):
            raise ValueError(f"{param!r} is not an FP8 primary weight (make_fp8_primary)")
        by_runtime.setdefault(id(param.runtime), []).append(i)
    plans = []
    for members in by_runtime.values():  # one runtime: one GTP group, one recipe
        runtime = params[members[0]].runtime
        ours = [params[i] for i in members]
        mine = [masters[i] for i in members], [start_offsets[i] for i in members]
        key = _Plan.key(ours, *mine, replicate_group)
        plan = runtime.fp8_write_back_plan
        if plan is None or plan.signature != key:
            plan = _Plan(ours, *mine, replicate_group, key)  # checks the slices
            if keep_plan:
                runtime.fp8_write_back_plan = plan
        plans.append(plan)
    with torch.no_grad():
        for plan in plans:
            plan.run()


def _real_elements(param: GTPShardedParam) -> int:
    """Flat elements of the shard's real rows (design §1.3 pad rows after them)."""
    cols = param.numel() // max(param.shape[0], 1)
    return real_rows(param.gtp_spec, param.shape[0]) * cols


def _rounded_slice(param: GTPShardedParam, master: torch.Tensor, start: int) -> torch.Tensor:
    """The master slice in fp32 after TE's rounding to the training dtype, pad elements zero."""
    values = master.detach().reshape(-1).to(param.gtp_state.fp8_primary_dtype).float()
    keep = max(0, min(values.numel(), _real_elements(param) - start))
    if keep < values.numel():
        values = values.clone()
        values[keep:] = 0
    return values


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
# kernel, no working copy) and rounds the whole amax vector once, bit for bit what TE computes
# on the rounded values; the cast pass rounds the values it casts.


def _cast_into(
    target: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, limit
) -> None:
    """``target`` (FP8) = saturating cast of ``values`` rounded to ``dtype``, times ``scale``."""
    target.copy_((values.to(dtype) * scale).clamp_(-limit, limit))


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


class _Plan:
    """The write-back of one runtime's ``params`` from ``masters`` at ``start_offsets``, every
    view and decision made once (module docstring).

    ``amax`` / ``scale`` / ``scale_inv`` are the working vectors (per tensor one aligned slot
    per weight, blockwise every tile of every weight, weight after weight); the shard records
    receive them with one multi-tensor copy each. A fast piece (per tensor any piece; blockwise
    whole tile rows of real elements) is a precomputed ``(master view, target view, scale
    view)``; the rest (blockwise slice edges and pad rows) go through a working window.
    """

    @staticmethod
    def key(params, masters, start_offsets, replicate_group) -> tuple | None:
        """What a plan is valid for: the params' and masters' identities and storage, the
        offsets, the group (None: a master that is not contiguous, never planned for reuse)."""
        entries = []
        for param, master, start in zip(params, masters, start_offsets):
            shard = param.gtp_state.fp8
            held = None
            if master is not None:
                if not master.is_contiguous():
                    return None
                held = (id(master), master.data_ptr(), master.numel(), master.dtype)
            storage = (param.data_ptr(), shard.scale.data_ptr(), shard.scale_inv.data_ptr())
            entries.append((id(param), storage, held, start))
        return id(replicate_group), tuple(entries)

    def __init__(self, params, masters, start_offsets, replicate_group, signature) -> None:
        for param, master, start in zip(params, masters, start_offsets):
            if master is None:
                continue
            if start is None or start < 0 or start + master.numel() > param.numel():
                raise ValueError(
                    f"{param.gtp_state.name}: master slice [{start}, +{master.numel()}) outside "
                    f"the shard's {param.numel()} elements"
                )
        self.signature = signature
        self.scaling: FP8Scaling = params[0].gtp_state.fp8.scaling
        self.blockwise = self.scaling.kind is ScalingKind.BLOCKWISE
        groups = [replicate_group] if self.blockwise else [replicate_group, params[0].runtime.group]
        self.groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
        shards = [p.gtp_state.fp8 for p in params]
        sizes = [s.amax.numel() if self.blockwise else SCALAR_STRIDE for s in shards]
        bounds = [0, *itertools.accumulate(sizes)]
        device = params[0].device
        self.amax, self.scale, self.scale_inv = (
            torch.zeros(bounds[-1], dtype=torch.float32, device=device) for _ in range(3)
        )
        # each weight's part of the vectors: its tiles, or the first element of its slot
        parts = [slice(b, b + (size if self.blockwise else 1)) for b, size in zip(bounds, sizes)]
        self.copies = []
        for name, vector in (
            ("amax", self.amax),
            ("scale", self.scale),
            ("scale_inv", self.scale_inv),
        ):
            targets = [getattr(shard, name) for shard in shards]
            sources = [vector[part].view(t.shape) for part, t in zip(parts, targets)]
            self.copies.append((targets, sources))
        dtypes = [p.gtp_state.fp8_primary_dtype for p in params]
        if len(set(dtypes)) == 1:
            self.rounding = [(dtypes[0], [slice(None)])]
        else:
            self.rounding = [
                (dtype, [part for part, d in zip(parts, dtypes) if d is dtype])
                for dtype in dict.fromkeys(dtypes)
            ]
        self.reduce: list = []  # fast pieces' amax: (master view, the vector's view)
        self.casts: list = []  # fast pieces' cast: (target, master view, dtype, scale view)
        self.zeros: list = []  # per tensor: pad elements of a piece, as bytes
        self.windows: list = []  # blockwise slow pieces: (param, piece, start, grid, target)
        if self.blockwise:
            self._plan_tiles(params, masters, start_offsets, bounds)
        else:
            self._plan_tensors(params, masters, start_offsets)

    def _plan_tensors(self, params, masters, start_offsets) -> None:
        slots = []
        for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
            flat, real = param.detach().view(-1), _real_elements(param)
            dtype, scale = param.gtp_state.fp8_primary_dtype, param.gtp_state.fp8.scale
            for at, piece in _pieces(param, master, start, 1):
                keep = max(0, min(piece.numel(), real - at))
                target = flat[at : at + piece.numel()]
                if keep:
                    self.reduce.append(piece[:keep])
                    slots.append(i * SCALAR_STRIDE)
                    self.casts.append((target[:keep], piece[:keep], dtype, scale))
                if keep < piece.numel():
                    self.zeros.append(target[keep:].view(torch.uint8))
        self.slots = torch.tensor(slots, dtype=torch.long, device=self.amax.device)

    def _plan_tiles(self, params, masters, start_offsets, bounds) -> None:
        block = self.scaling.block
        for i, (param, master, start) in enumerate(zip(params, masters, start_offsets)):
            shard = param.gtp_state.fp8
            grid = self.amax[bounds[i] : bounds[i + 1]].view(shard.amax.shape)
            flat, dtype = param.detach().view(-1), param.gtp_state.fp8_primary_dtype
            for at, piece in _pieces(param, master, start, block[0]):
                target = flat[at : at + piece.numel()]
                tiles = _whole_tiles(param, at, piece, block)
                if tiles is None:
                    self.windows.append((param, piece, at, grid, target))
                    continue
                first = at // (block[0] * param.shape[1])
                rows = slice(first, first + tiles.shape[0])
                self.reduce.append((tiles, grid[rows]))
                scale = shard.scale[rows, None, :, None]
                self.casts.append((target.view(tiles.shape), tiles, dtype, scale))

    def run(self) -> None:
        """One write-back: amaxes, the collectives, scales into the shard records, casts."""
        amax, block, limit = self.amax, self.scaling.block, self.scaling.fp8_max
        amax.zero_()  # the units this rank holds nothing of
        if self.blockwise:
            for tiles, out in self.reduce:
                torch.linalg.vector_norm(tiles, _INF, dim=(1, 3), dtype=torch.float32, out=out)
            for param, piece, at, grid, _ in self.windows:
                values = _rounded_slice(param, piece, at)
                first, _, tiles = _tile_window(values, at, param.shape, block)
                grid[first : first + tiles.shape[0]] = tiles.abs().amax(dim=(1, 3))
        elif self.reduce:  # every piece's amax in one multi-tensor kernel, the max per weight
            norms = torch.stack(torch._foreach_norm(self.reduce, _INF)).float()
            amax.index_reduce_(0, self.slots, norms, "amax")
        for dtype, parts in self.rounding:  # TE's rounding of the master (module comment)
            for part in parts:
                values = amax[part]
                values.copy_(values.to(dtype))
        for group in self.groups:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        self.scale.copy_(scale_from_amax(amax, self.scaling))
        torch.reciprocal(self.scale, out=self.scale_inv)
        for targets, sources in self.copies:
            torch._foreach_copy_(targets, sources)
        for target, values, dtype, scale in self.casts:
            _cast_into(target, values, dtype, scale, limit)
        for pad in self.zeros:
            pad.zero_()  # FP8 zeros
        for param, piece, at, _, target in self.windows:
            scale = param.gtp_state.fp8.scale
            values = _rounded_slice(param, piece, at)
            first, offset, tiles = _tile_window(values, at, param.shape, block)
            cast = cast_to_fp8(
                tiles, scale[first : first + tiles.shape[0], None, :, None], self.scaling
            )
            cast = cast.view(-1, tiles.shape[2] * tiles.shape[3])[:, : param.shape[1]]
            target.copy_(cast.reshape(-1)[offset : offset + values.numel()])

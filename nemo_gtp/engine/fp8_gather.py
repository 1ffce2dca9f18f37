"""FP8 gathers through the runtime: shards quantized once per step, gathered as FP8 bytes
(design §1.3 "FP8 gather").

When the consumer of a gathered weight runs its GEMM in FP8 with per-tensor current scaling
(TransformerEngine under FP8 autocast), gathering the training dtype wastes half the bytes and
makes the consumer quantize the whole gathered weight again at every microbatch. Instead the
runtime keeps an FP8 copy of every shard (:class:`FP8ShardCache`), quantized once per optimizer
step with a scale agreed over the GTP group, and gathers those bytes:

- *one collective per runtime and step for the scales*: the local amax of every shard goes into
  one fp32 vector, all-reduced (MAX) over the GTP group at the first FP8 gather after a drain
  (the optimizer may have written the shards then; a param whose version counter moved also
  triggers it). Every peer then casts its rows with the full weight's scale, so the gathered
  bytes are the quantization of the full weight, bit for bit, and ``scale_inv`` is the same
  tensor on every peer: it is not gathered at all;
- *FP8 bytes on the wire*: the gather moves 1 byte per element into a ticket-cache buffer of the
  FP8 dtype (stable addresses, as for the training dtype; ``CommStats.gather_bytes`` counts
  them, half of a BF16 gather);
- *what the consumer needs beside the rows*: a backward gather on hardware without non-TN FP8
  GEMMs (Hopper) also gets a stable, contiguous buffer for the column-wise (transposed) copy,
  which the consumer fills once per gathered weight (:attr:`FP8Gathered.transpose`).

Blockwise scaling (one scale per block, e.g. TE's 128x128 weight tiles) needs no collective for
its scales: a block never spans two shards (the shards' rows are whole blocks), so each rank
quantizes its own blocks and the per-block ``scale_inv`` travel with the data, in the same
coalesced collective, into a stable scale buffer per gather slot. Each shard's scale rows are
padded to a multiple of :data:`SCALE_COLUMN_ALIGN` columns, so the gathered scales are already
in the layout a blockwise FP8 GEMM reads (TE's ``Float8BlockQuantizer.get_scale_shape``).

The consumer is abstract here (:class:`QuantizedGather`); the TransformerEngine one lives in
``nemo_gtp.integrations`` and wraps :class:`FP8Gathered` in TE's ``Float8Tensor``. Pure torch.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nemo_gtp.engine.fp8 import (
    SCALAR_STRIDE,
    FP8Scaling,
    FP8Shard,
    ScalingKind,
    cast_to_fp8,
    dequantize_fp8,
    quantize_into,
    scale_from_amax,
)
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.shard import real_rows
from nemo_gtp.engine.slots import Direction, GatherState, GTPStateError

_INF = float("inf")
_BWD = Direction.BWD
_ASYNC, _READY = GatherState.ASYNC_WAIT, GatherState.DATA_READY
_BLOCKWISE = ScalingKind.BLOCKWISE
SCALE_COLUMN_ALIGN = 4
"""Blockwise ``scale_inv`` rows are padded to a multiple of this many columns (zeros): the layout
cuBLAS's blockwise FP8 GEMM reads (TE pads its scales the same way), kept from the shard through
the gather, so no copy is needed before the GEMM."""


def padded_scale_shape(rows: int, cols: int, scaling: FP8Scaling) -> tuple[int, int]:
    """Shape of the gather-ready ``scale_inv`` of a ``rows x cols`` blockwise weight: one row per
    row block, one column per column block, padded to :data:`SCALE_COLUMN_ALIGN`.

    Example::

        padded_scale_shape(256, 2048, FP8Scaling("blockwise"))   # (2, 16)
        padded_scale_shape(256, 300, FP8Scaling("blockwise"))    # (2, 4): 3 blocks + 1 pad
    """
    block_rows, block_cols = scaling.block
    column_blocks = math.ceil(cols / block_cols)
    aligned = math.ceil(column_blocks / SCALE_COLUMN_ALIGN) * SCALE_COLUMN_ALIGN
    return (math.ceil(rows / block_rows), aligned)


class FP8Gathered:
    """One gather slot's FP8 gathered weight, as a consumer sees it (built once per buffer).

    - ``data``: the unpadded FP8 rows, a view of the slot's ticket-cache buffer (contiguous);
    - ``scale_inv``: the agreed per-tensor ``scale_inv`` (shape ``(1,)``, fp32), the same tensor
      as the local FP8 shard's: identical on every GTP peer, so it is not gathered;
    - ``transpose``: for a backward gather when the consumer asked for it, a contiguous buffer of
      shape ``(data.shape[-1], *data.shape[:-1])`` in the FP8 dtype for the column-wise copy,
      filled by the consumer (e.g. TE's transpose kernel) once per gathered weight; else None;
    - ``scaling``: the recipe; ``consumer``: free for the consumer to cache its wrapper object
      (a TE ``Float8Tensor``) across steps.

    Blockwise: ``scale_inv`` is the gathered per-block ``scale_inv`` (:func:`padded_scale_shape`
    of ``data``), and a backward view with ``transpose`` also has ``columnwise_scale_inv``, a
    stable fp32 buffer of :func:`padded_scale_shape` of the transposed weight, which the consumer
    fills with the transpose's scales (for square blocks, the transposed scale grid).

    Example::

        view = runtime.fp8_gathered(param, Direction.FWD)   # after materialize(..., fp8=...)
        weight = view.data.float() * view.scale_inv          # the dequantized weight
    """

    __slots__ = ("data", "scale_inv", "transpose", "scaling", "consumer", "columnwise_scale_inv")

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        transpose: torch.Tensor | None,
        scaling: FP8Scaling,
        columnwise_scale_inv: torch.Tensor | None = None,
    ) -> None:
        self.data = data
        self.scale_inv = scale_inv
        self.transpose = transpose
        self.scaling = scaling
        self.columnwise_scale_inv = columnwise_scale_inv
        self.consumer: Any = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` (per block for blockwise) in ``dtype``, a new tensor (tests,
        debugging)."""
        return dequantize_fp8(self.data, self.scale_inv, self.scaling, dtype)


class QuantizedGather(Protocol):
    """What a runtime asks the consumer of its protocol gathers (set as
    ``GTPRuntime.quantized_gather``; design §1.3 "FP8 gather").

    ``forward_scaling`` is asked at every forward protocol consume: the FP8 recipe the consumer's
    GEMM runs with now, or ``None`` to gather the training dtype (FP8 off, or a recipe the
    runtime does not gather in). The backward consume of a weight reuses what its forward got.
    ``wrap`` turns the gathered view into what the consumer receives. With
    ``transpose_for_backward`` backward gathers carry a :attr:`FP8Gathered.transpose` buffer.

    Example (the pure-torch consumer of the tests)::

        class Dequantizing:
            transpose_for_backward = False
            def forward_scaling(self, param): return SCALING
            def wrap(self, param, direction, gathered): return gathered.dequantize(param.dtype)

        runtime.quantized_gather = Dequantizing()
    """

    transpose_for_backward: bool

    def forward_scaling(self, param: GTPShardedParam) -> FP8Scaling | None:
        """The scaling this forward consume gathers in; None: the training dtype."""

    def wrap(
        self, param: GTPShardedParam, direction: Direction, gathered: FP8Gathered
    ) -> torch.Tensor:
        """What the consumer's GEMM receives for ``gathered``."""


def check_gather_scaling(scaling: FP8Scaling) -> None:
    """The runtime gathers per-tensor current scaling and blockwise scaling (design §1.3 "FP8
    gather").

    Delayed scaling needs the consumer's own scale (its amax history) at each quantize: it is
    consumed from the training-dtype gather (the consumer quantizes).

    Example::

        check_gather_scaling(FP8Scaling("tensorwise"))   # ok
        check_gather_scaling(FP8Scaling("delayed"))      # NotImplementedError
    """
    if scaling.kind is ScalingKind.DELAYED:
        raise NotImplementedError(
            "the GTP runtime gathers FP8 with per-tensor current scaling (fp8_recipe="
            "'tensorwise') or blockwise scaling (fp8_recipe='blockwise'), got 'delayed': a "
            "QuantizedGather must return None for it (the training dtype is gathered and the "
            "consumer quantizes)"
        )


class FP8ShardCache:
    """The FP8 copy of every shard of one runtime, refreshed once per optimizer step.

    Each param's :class:`FP8Shard` (``param.gtp_state.fp8``) is allocated once; its ``scale``,
    ``scale_inv`` and ``amax`` are views into three runtime-wide fp32 vectors, so one
    all-reduce agrees every weight's amax and one vector op computes every scale. Stale after
    :meth:`mark_stale` (the runtime's drain) and when a param's version counter moved.

    Example::

        cache = FP8ShardCache()
        cache.refresh(runtime.params, FP8Scaling(), runtime.group)   # collective over GTP
        runtime.params[0].gtp_state.fp8.data                         # its FP8 shard
    """

    def __init__(self) -> None:
        self.scaling: FP8Scaling | None = None  # what every cached shard holds; None: stale
        self.refreshes = 0
        self._amax: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._scale_inv: torch.Tensor | None = None
        self._nonempty: list[int] = []  # params with real rows on this rank
        self._index: torch.Tensor | None = None  # the same, on the device (no copy per step)

    def mark_stale(self) -> None:
        """The shards may have changed (optimizer step, load): the next FP8 gather refreshes."""
        self.scaling = None

    def is_fresh(self, param: GTPShardedParam, scaling: FP8Scaling) -> bool:
        """Whether ``param``'s FP8 shard holds the current weight quantized with ``scaling``."""
        return self.scaling is scaling and param._version == param.gtp_state.fp8_version

    def refresh(
        self, params: list[GTPShardedParam], scaling: FP8Scaling, group: dist.ProcessGroup
    ) -> None:
        """Quantize every shard of ``params`` with its GTP-agreed scale (collective over
        ``group``: every GTP peer calls it at the same point, with the same params).

        Only each shard's real rows (design §1.3 pad rows excluded) enter the amax and the
        cast; the pad rows of the FP8 shard are zero from its allocation on.
        """
        check_gather_scaling(scaling)
        if scaling.kind is ScalingKind.BLOCKWISE:
            self._refresh_blocks(params, scaling)
            return
        n = len(params)
        device = params[0].device
        if (
            self._amax is None
            or self._amax.numel() != n * SCALAR_STRIDE
            or self._amax.device != device
            or any(
                p.gtp_state.fp8 is None
                or p.gtp_state.fp8.data.dtype != scaling.fp8_dtype
                or p.gtp_state.fp8.scaling.kind is not scaling.kind  # blockwise before
                for p in params
            )
        ):
            self._allocate(params, scaling, device)
        masters = [p.detach() for p in params]
        real = [real_rows(p.gtp_spec, p.shape[0]) for p in params]
        nonempty = self._nonempty
        with torch.no_grad():
            # The amax of every non-empty shard in one multi-tensor kernel; empty ones stay 0.
            self._amax.zero_()
            if nonempty:
                norms = torch._foreach_norm([masters[i][: real[i]] for i in nonempty], _INF)
                self._amax.index_copy_(0, self._index, torch.stack(norms).float())
            dist.all_reduce(self._amax, op=dist.ReduceOp.MAX, group=group)
            self._scale.copy_(scale_from_amax(self._amax, scaling))
            torch.reciprocal(self._scale, out=self._scale_inv)
            for i in nonempty:
                shard = params[i].gtp_state.fp8
                rows = real[i]
                shard.data[:rows].copy_(
                    cast_to_fp8(masters[i][:rows].float(), shard.scale, scaling)
                )
        for param in params:
            param.gtp_state.fp8_version = param._version
        self.scaling = scaling
        self.refreshes += 1

    def _refresh_blocks(self, params: list[GTPShardedParam], scaling: FP8Scaling) -> None:
        """Blockwise: every rank quantizes its own blocks (no collective), then copies the
        per-block ``scale_inv`` into the shard's gather-ready scale rows. A shard that is not
        whole blocks (its consumer gathers it in the training dtype) is skipped."""
        for param in params:
            if param.dim() != 2 or param.shape[0] % scaling.block[0]:
                continue
            state = param.gtp_state
            shard = state.fp8
            if shard is None or shard.scaling != scaling or shard.data.shape != param.shape:
                with torch.inference_mode(False):  # outlives an evaluation that made it
                    shard = state.fp8 = FP8Shard.empty(tuple(param.shape), scaling, param.device)
                    state.fp8_scale_wire = torch.zeros(
                        padded_scale_shape(*param.shape, scaling),
                        dtype=torch.float32,
                        device=param.device,
                    )
                state.fp8_wire = shard.data.view(torch.uint8)
            quantize_into(param.detach(), shard, spec=param.gtp_spec)
            state.fp8_scale_wire[:, : shard.scale_inv.shape[1]].copy_(shard.scale_inv)
            state.fp8_version = param._version
        self.scaling = scaling
        self.refreshes += 1

    def _allocate(self, params: list[GTPShardedParam], scaling: FP8Scaling, device: torch.device):
        n, k = len(params), SCALAR_STRIDE
        with torch.inference_mode(False):  # outlives an evaluation loop that ran the first gather
            # Three separate allocations: each starts aligned, and so does every k-th element.
            self._amax, self._scale, self._scale_inv = (
                torch.zeros(n * k, dtype=torch.float32, device=device) for _ in range(3)
            )
            for i, param in enumerate(params):
                data = torch.zeros(param.shape, dtype=scaling.fp8_dtype, device=device)
                state = param.gtp_state
                state.fp8 = FP8Shard(
                    data=data,
                    scale_inv=self._scale_inv[i * k : i * k + 1],
                    scale=self._scale[i * k : i * k + 1],
                    amax=self._amax[i * k : i * k + 1],
                    scaling=scaling,
                )
                state.fp8_wire = data.view(torch.uint8)
                state.fp8_version = -1
            self._nonempty = [
                i for i, p in enumerate(params) if p.numel() and real_rows(p.gtp_spec, p.shape[0])
            ]
            self._index = torch.tensor(
                [i * k for i in self._nonempty], dtype=torch.long, device=device
            )


def transposed_view(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``(shape[-1], *shape[:-1])`` view at the start of the flat buffer ``flat``
    (the column-wise copy of a weight of ``shape``, whatever the buffer's padded size).

    Example::

        transposed_view(torch.empty(96 * 64, dtype=torch.uint8), (72, 64)).shape   # (64, 72)
    """
    columnwise = (shape[-1], *shape[:-1])
    return flat[: math.prod(columnwise)].view(columnwise)


class FP8GatherSide:
    """The FP8 formats of a ``GTPRuntime``'s gathers (design §1.3 "FP8 gather", "FP8 primary
    weights").

    Part of the runtime, split off by concern, not a class of its own: it owns the state
    :meth:`setup_fp8_gather_side` sets up, and the gather side
    (:class:`~nemo_gtp.engine.gather.GatherSide`) asks it for the bytes an FP8 gather moves;
    it hands the consumer the FP8 gathered weight and the weight a GEMM that is not FP8-aware
    multiplies with.

    Offers the other parts: ``canonical_fp8``, ``known_fp8``, ``fp8_gather_source``,
    ``fp8_primary``, ``fp8_gathered``, ``gemm_weight``, ``quantized_gather``, ``fp8_shards``,
    ``setup_fp8_gather_side``. Uses from the other parts: ``weight_cache`` (the gather side's
    ticket cache, for the column-wise and scale buffers).

    Example::

        full = runtime.materialize(param, Direction.FWD, fp8=FP8Scaling("tensorwise"))
        view = runtime.fp8_gathered(param, Direction.FWD)   # rows, scale_inv, recipe
    """

    def setup_fp8_gather_side(self) -> None:
        """The FP8 state: the consumer that asks for FP8 gathers (set by the integration, e.g.
        TE's), the FP8 copies of the shards, the one FP8Scaling object in use, and the FP8
        primary shards' scaling and write-back plan (called once, from ``GTPRuntime.__init__``)."""
        self.quantized_gather: QuantizedGather | None = None
        self.fp8_shards = FP8ShardCache()
        self.known_fp8: FP8Scaling | None = None
        """The one ``FP8Scaling`` object of the recipe in use (:meth:`canonical_fp8`): a consume
        whose recipe is this very object skips the equality check."""
        self.fp8_primary: FP8Scaling | None = None
        """Set by ``make_fp8_primary``: every shard is an FP8 primary weight in this scaling and
        every gather moves the shards' own FP8 bytes (design §1.3 "FP8 primary weights")."""
        self.fp8_write_back_plan: object | None = None
        """The optimizer write-back's plan for this runtime's shards (``fp8_write_back``),
        built at the first write-back and reused while megatron passes the same lists."""

    def canonical_fp8(self, fp8: FP8Scaling) -> FP8Scaling:
        """One ``FP8Scaling`` object per recipe in use (identity checks on the hot path)."""
        if fp8 != self.known_fp8:
            check_gather_scaling(fp8)
            self.known_fp8 = fp8
        return self.known_fp8

    def fp8_gathered(self, param: GTPShardedParam, direction: Direction) -> FP8Gathered:
        """The FP8 gathered weight ``materialize(..., fp8=...)`` left in ``direction``'s slot.

        Built once per cache buffer (stable object, stable tensors); a backward slot carries
        the column-wise buffer when the consumer asked for one
        (``QuantizedGather.transpose_for_backward``).
        """
        state = param.gtp_state
        slot = state.slot(direction)
        if slot.state is not _READY or slot.fmt is None:
            raise GTPStateError(
                f"{state.name}: no FP8 gathered weight in the {direction.value} slot "
                f"(state {slot.state.value}, format {slot.fmt})"
            )
        full = slot.full
        view = slot.fp8_view
        blockwise = slot.fmt.kind is _BLOCKWISE
        if view is None or view.data is not full:
            transpose = columnwise_scales = None
            policy = self.quantized_gather
            cache = slot.cache
            own = cache is not None and slot.buffer is cache.buffer  # else a fallback buffer
            rows, cols = full.shape
            # Outside inference mode: the consumer writes the column-wise view later, in training.
            with torch.inference_mode(False):
                if direction is _BWD and policy is not None and policy.transpose_for_backward:
                    if own:
                        flat = self.weight_cache.companion(cache)
                    else:  # a fallback buffer (misprediction): its own column-wise buffer
                        flat = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
                    transpose = transposed_view(flat, tuple(full.shape))
                    if blockwise:
                        shape = padded_scale_shape(cols, rows, slot.fmt)
                        columnwise_scales = (
                            self.weight_cache.scales(cache, "columnwise", shape)
                            if own
                            else torch.zeros(shape, dtype=torch.float32, device=full.device)
                        )
            # blockwise: the gathered block scales of the unpadded rows (a row prefix)
            scale_inv = slot.scales[: -(-rows // slot.fmt.block[0])] if blockwise else None
            view = FP8Gathered(
                full,
                state.fp8.scale_inv if scale_inv is None else scale_inv,
                transpose,
                slot.fmt,
                columnwise_scales,
            )
            if own:
                slot.fp8_view = view
        if not blockwise:  # per tensor: the agreed scale, the same tensor on every GTP peer
            view.scale_inv = state.fp8.scale_inv
        return view

    def gemm_weight(
        self, param: GTPShardedParam, direction: Direction, full: torch.Tensor
    ) -> torch.Tensor:
        """What a GEMM that is not FP8-aware multiplies with: ``full`` (from :meth:`materialize`)
        as is, or for FP8 primary shards the gathered FP8 rows dequantized into the training
        dtype (a new tensor per call: the CPU / local-linear path; TE consumes the FP8 rows).
        Blockwise: per tile, with the tile scales gathered beside the rows."""
        if self.fp8_primary is None:
            return full
        state = param.gtp_state
        fp8 = self.fp8_primary
        scale_inv = state.slot(direction).scales if fp8.kind is _BLOCKWISE else state.fp8.scale_inv
        return dequantize_fp8(full, scale_inv, fp8, state.fp8_primary_dtype)

    def fp8_gather_source(self, param: GTPShardedParam, fmt: FP8Scaling) -> torch.Tensor:
        """The bytes an FP8 gather of ``param`` moves: its FP8 shard, quantized first if stale
        (collective: once per step for all shards, design §1.3 "FP8 gather"); an FP8 primary
        shard's own bytes."""
        if self.fp8_primary is not None:  # the optimizer wrote them (write_back_fp8_primary)
            return param.detach().view(torch.uint8)
        if not self.fp8_shards.is_fresh(param, fmt):
            # Gathers of the previous FP8 shards still in flight read them: complete them first.
            for other in self.params:
                for slot in (other.gtp_state.fwd, other.gtp_state.bwd):
                    if slot.state is _ASYNC and slot.fmt is not None:
                        slot.complete()
            self.fp8_shards.refresh(self.params, fmt, self.group)
            self.stats.fp8_quantizes += 1
            if self.trace is not None:
                self.trace.append(("fp8_quantize", "", ""))
        return param.gtp_state.fp8_wire

"""FP8 GTP shards: quantize a master shard, gather it quantized, write back (design §1.3).

Engine plumbing (pure torch, ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``): the runtime's FP8
gather (:mod:`nemo_gtp.engine.fp8_gather`) and FP8 primary weights
(:mod:`nemo_gtp.engine.fp8_primary`) use its scale formula and cast (design §1.3 "FP8 shards").

Why the scales need care under GTP: a gathered weight is the concatenation of every peer's shard,
and a GEMM consumes it with one ``scale_inv`` per scaling unit. A unit owned by one rank (a block
of a blockwise recipe) can be scaled locally; a unit spread over every rank (the whole tensor of a
per-tensor recipe) needs every peer to agree on its scale, hence one all-reduce MAX of the local
amax over the GTP group before the cast. Either way the gathered bytes are bit-identical to
quantizing the full weight on one rank.

Scale formula (TransformerEngine's current scaling, ``compute_scale_from_amax``; fp32 throughout)::

    amax'     = max(amax, epsilon)
    scale     = fp8_max / amax' / 2**margin         (margin: DelayedScaling's; 0 otherwise)
    scale     = FLT_MAX   if scale is +inf          (amax' is subnormal-small)
    scale     = 1         if amax' == 0 or amax' is inf   (delayed scaling: the previous scale)
    scale     = 2**floor(log2(scale))  if power_2_scales  (clear the mantissa bits)
    scale_inv = 1 / scale
    data      = cast_to_fp8(clamp(x * scale, -fp8_max, fp8_max))   (saturating, round-to-nearest)

``fp8_max`` is 448 for E4M3 and 57344 for E5M2. TE's FP8 weights use E4M3 under both megatron
``fp8`` formats (``"e4m3"`` and ``"hybrid"``; E5M2 is for gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_gtp.engine.collectives import CommHandle, GroupCollectives
from nemo_gtp.engine.fp8_recipe import (
    FP8_FORMATS,
    FP8_PRIMARY,
    FP8_PRIMARY_RECIPES,
    FP8_RECIPES,
    GATHER_FP8,
    GATHER_TRAINING_DTYPE,
    ScalingKind,
    check_fp8_training_for_gtp,
    check_low_precision_recipe,
    device_capability,
)
from nemo_gtp.engine.shard import ShardSpec, real_rows

__all__ = [  # the recipe names and checks live in fp8_recipe; re-exported for fp8's users
    "FP8_DTYPES",
    "FP8_FORMATS",
    "FP8_PRIMARY",
    "FP8_PRIMARY_RECIPES",
    "FP8_RECIPES",
    "GATHER_FP8",
    "GATHER_TRAINING_DTYPE",
    "SCALAR_STRIDE",
    "FP8Scaling",
    "FP8Shard",
    "ScalingKind",
    "all_gather_fp8",
    "block_pad_for_alignment",
    "cast_to_fp8",
    "check_block_alignment",
    "check_fp8_training_for_gtp",
    "check_low_precision_recipe",
    "dense_gather_nbytes",
    "dequantize_fp8",
    "device_capability",
    "quantize_into",
    "quantize_shard",
    "scale_from_amax",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 element types a shard can hold."""

SCALAR_STRIDE = 4
"""Elements between two weights' scalars in a runtime-wide fp32 scale / scale_inv / amax vector.

cuBLAS refuses an FP8 GEMM whose scale pointer is not 16-byte aligned ("the requested
functionality is not supported"): each weight's scalar sits at a multiple of 4 fp32 elements of
its vector (the pad elements stay 0 and are never read)."""

_FLT_MAX = torch.finfo(torch.float32).max
_EXPONENT_MASK = 0x7F800000  # fp32 sign 0, exponent bits only: 2**floor(log2(x)) for x > 0


@dataclass(frozen=True)
class FP8Scaling:
    """An FP8 shard's recipe: kind, element type, block and the scale-formula options.

    ``power_2_scales=None`` picks TE's default: power-of-two scales for blockwise, full fp32
    scales for per-tensor recipes. ``margin`` is megatron's ``fp8_margin`` (delayed scaling).

    Example::

        FP8Scaling("tensorwise")                          # E4M3, per-tensor current scaling
        FP8Scaling("blockwise", block=(128, 128))         # TE's Float8BlockScaling weights
    """

    kind: ScalingKind | str = ScalingKind.TENSORWISE
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    block: tuple[int, int] = (128, 128)
    epsilon: float = 0.0
    power_2_scales: bool | None = None
    margin: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ScalingKind(self.kind))
        except ValueError:
            names = [k.value for k in ScalingKind]
            raise ValueError(
                f"FP8 shards support fp8_recipe in {names}, got {self.kind!r}"
            ) from None
        if self.fp8_dtype not in FP8_DTYPES:
            raise ValueError(
                f"FP8Scaling.fp8_dtype must be one of {FP8_DTYPES}, got {self.fp8_dtype}"
            )
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"FP8Scaling.block must be two positive sizes, got {self.block}")
        if self.epsilon < 0 or self.margin < 0:
            raise ValueError(
                f"FP8Scaling.epsilon and margin must be >= 0, got {self.epsilon}, {self.margin}"
            )
        if self.power_2_scales is None:
            object.__setattr__(self, "power_2_scales", self.kind is ScalingKind.BLOCKWISE)

    @property
    def fp8_max(self) -> float:
        """Largest finite value of the element type (448 for E4M3, 57344 for E5M2)."""
        return float(torch.finfo(self.fp8_dtype).max)

    def scale_shape(self, shard_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scale tensors of a shard: ``(1,)`` per tensor, one per block otherwise."""
        if self.kind is not ScalingKind.BLOCKWISE:
            return (1,)
        if len(shard_shape) != 2:
            raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {tuple(shard_shape)}")
        rows, cols = shard_shape
        block_rows, block_cols = self.block
        if rows % block_rows:
            raise ValueError(
                f"a shard of {rows} rows splits {block_rows}x{block_cols} FP8 blocks; "
                f"check_block_alignment names the GTPConfig.pad_for_alignment it needs"
            )
        return (rows // block_rows, math.ceil(cols / block_cols))


def scale_from_amax(
    amax: torch.Tensor, scaling: FP8Scaling, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 scales from fp32 amaxes, by the module docstring's formula (TE's convention).

    Where amax is zero or infinite the scale is 1, or ``previous`` when given (delayed
    scaling keeps its last scale there).

    Example::

        scale_from_amax(torch.tensor([2.0]), FP8Scaling())   # tensor([224.])
    """
    amax = amax.float()
    clamped = torch.clamp_min(amax, scaling.epsilon) if scaling.epsilon > 0 else amax
    # Tensor / tensor: IEEE division as in TE (``float / tensor`` multiplies by a reciprocal).
    scale = torch.full_like(clamped, scaling.fp8_max) / clamped
    if scaling.margin:
        scale = scale / (2.0**scaling.margin)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
    keep = torch.ones_like(scale) if previous is None else previous.float().expand_as(scale)
    scale = torch.where((clamped == 0) | torch.isinf(clamped), keep, scale)
    if scaling.power_2_scales:
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return scale


@dataclass
class FP8Shard:
    """One GTP shard (or a gathered weight) in FP8: data, scales and recipe (design §1.3).

    ``data`` is the FP8 tensor (shard rows, pad rows included, zero); ``scale_inv`` is what a
    GEMM multiplies back (shape :meth:`FP8Scaling.scale_shape`); ``scale`` and ``amax`` are the
    quantizer's state. On a gathered blockwise weight ``scale`` and ``amax`` are ``None``: the
    GEMM needs ``scale_inv`` only, the scales stay with the ranks that own the blocks. Every
    tensor is allocated once; :func:`quantize_into` and :func:`all_gather_fp8` write into them
    in place (stable addresses, as CUDA graphs need).

    Example::

        shard = quantize_shard(master_shard, FP8Scaling("tensorwise"), groups.gtp, spec=spec)
        full = shard.empty_gathered(gtp_size)
        all_gather_fp8(shard, full, groups.gtp).wait()
        shard.gather_nbytes(gtp_size)    # half of dense_gather_nbytes(..., torch.bfloat16, ...)
        full.dequantize()                # the padded weight, for tests and checkpoints
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    scale: torch.Tensor | None
    amax: torch.Tensor | None
    scaling: FP8Scaling

    @classmethod
    def empty(
        cls, shape: tuple[int, ...], scaling: FP8Scaling, device: torch.device | str = "cpu"
    ) -> FP8Shard:
        """Zero data, unit scales, zero amax for a shard of ``shape`` (TE's initial state)."""
        scale_shape = scaling.scale_shape(tuple(shape))
        ones = dict(dtype=torch.float32, device=device)
        return cls(
            data=torch.zeros(shape, dtype=scaling.fp8_dtype, device=device),
            scale_inv=torch.ones(scale_shape, **ones),
            scale=torch.ones(scale_shape, **ones),
            amax=torch.zeros(scale_shape, **ones),
            scaling=scaling,
        )

    @property
    def payload_nbytes(self) -> int:
        """Bytes one rank contributes to a gather: 1 per element, plus block scales."""
        nbytes = self.data.numel() * self.data.element_size()
        if self.scaling.kind is ScalingKind.BLOCKWISE:
            nbytes += self.scale_inv.numel() * self.scale_inv.element_size()
        return nbytes

    def gather_nbytes(self, gtp_size: int) -> int:
        """Bytes this rank receives per gather of this shard (``CommStats.gather_bytes``'s
        convention; per-tensor scales are agreed beforehand, not gathered)."""
        return self.payload_nbytes * (gtp_size - 1)

    def empty_gathered(self, gtp_size: int) -> FP8Shard:
        """A preallocated gathered weight for :func:`all_gather_fp8` (allocate once, reuse)."""
        shape = (self.data.shape[0] * gtp_size, *self.data.shape[1:])
        full = FP8Shard.empty(shape, self.scaling, self.data.device)
        if self.scaling.kind is ScalingKind.BLOCKWISE:
            full.scale = full.amax = None
        return full

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` in ``dtype`` (per block for blockwise), a new tensor."""
        return dequantize_fp8(self.data, self.scale_inv, self.scaling, dtype)


def dequantize_fp8(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    scaling: FP8Scaling,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * scale_inv`` in ``dtype``, a new tensor: one ``scale_inv`` per tensor, or for
    blockwise a grid of one per block (extra columns, e.g. the gather-ready padding, ignored).

    Example::

        dequantize_fp8(shard.data, shard.scale_inv, shard.scaling, torch.bfloat16)
    """
    values = data.float()
    if scaling.kind is not ScalingKind.BLOCKWISE:
        return (values * scale_inv).to(dtype)
    rows, cols = values.shape
    block_rows, block_cols = scaling.block
    scales = scale_inv[: math.ceil(rows / block_rows), : math.ceil(cols / block_cols)]
    scales = scales.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return (values * scales[:rows, :cols]).to(dtype)


def dense_gather_nbytes(shard_shape: tuple[int, ...], dtype: torch.dtype, gtp_size: int) -> int:
    """Bytes a rank receives per gather of a plain ``dtype`` shard (the runtime's count).

    Example::

        dense_gather_nbytes((48, 64), torch.bfloat16, 2)   # 6144; an FP8 shard: 3072
    """
    return math.prod(shard_shape) * torch.empty((), dtype=dtype).element_size() * (gtp_size - 1)


def cast_to_fp8(values: torch.Tensor, scale: torch.Tensor, scaling: FP8Scaling) -> torch.Tensor:
    """Saturating cast of ``values * scale`` to FP8 (torch's plain cast would overflow): the
    cast of the module docstring's formula, shared by every quantize (shards, the FP8 gather's
    refresh, the FP8 primary write-back).

    Example::

        cast_to_fp8(torch.tensor([1000.0]), torch.tensor([1.0]), FP8Scaling())   # 448 in E4M3
    """
    limit = scaling.fp8_max
    return torch.clamp(values * scale, -limit, limit).to(scaling.fp8_dtype)


def quantize_into(
    master: torch.Tensor,
    out: FP8Shard,
    group: dist.ProcessGroup | None = None,
    *,
    spec: ShardSpec | None = None,
) -> FP8Shard:
    """Quantize the high-precision ``master`` shard into ``out``'s tensors, in place.

    The optimizer write-back: after a step updated the fp32/bf16 master shard, this refreshes
    the FP8 data, scale, scale_inv and amax without reallocating any of them. Per-tensor kinds
    all-reduce the amax (MAX) over ``group`` so every GTP peer uses one scale (``None``: a
    single rank, e.g. the full-tensor reference); blockwise needs no collective. With ``spec``
    the shard's pad rows are excluded from the amax and written as zeros, whatever ``master``
    holds there. Every check runs before the collective.

    Example::

        optimizer.step()
        quantize_into(master_shard, fp8_shard, groups.gtp, spec=param.gtp_spec)
    """
    scaling = out.scaling
    if tuple(master.shape) != tuple(out.data.shape):
        raise ValueError(
            f"master shard shape {tuple(master.shape)} != FP8 shard {tuple(out.data.shape)}"
        )
    if not master.is_floating_point() or master.dtype in FP8_DTYPES:
        raise ValueError(f"the master shard must be fp32/bf16/fp16, got {master.dtype}")
    if out.scale is None or out.amax is None:
        raise ValueError("cannot quantize into a gathered blockwise weight (it has no scales)")
    values = master.detach().float()
    real = real_rows(spec, values.shape[0])
    if real < values.shape[0]:
        values = values.clone()  # .float() of an fp32 master aliases it: never write there
        values[real:] = 0
    with torch.no_grad():
        if scaling.kind is ScalingKind.BLOCKWISE:
            _quantize_blocks(values, out)
        else:
            _quantize_tensor(values, out, group)
    return out


def _quantize_tensor(values: torch.Tensor, out: FP8Shard, group: dist.ProcessGroup | None) -> None:
    amax = out.amax
    if values.numel():
        amax.copy_(values.abs().amax())
    else:
        amax.zero_()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if out.scaling.kind is ScalingKind.TENSORWISE:
        out.scale.copy_(scale_from_amax(amax, out.scaling))
    # DELAYED: quantize with the scale the history chose; amax now holds this weight's.
    torch.reciprocal(out.scale, out=out.scale_inv)
    out.data.copy_(cast_to_fp8(values, out.scale, out.scaling))


def _quantize_blocks(values: torch.Tensor, out: FP8Shard) -> None:
    rows, cols = values.shape
    block_rows, block_cols = out.scaling.block
    row_blocks, col_blocks = out.scale.shape
    # Zero columns complete the last block; they change no amax and are cut off again.
    padded = F.pad(values, (0, col_blocks * block_cols - cols))
    blocks = padded.view(row_blocks, block_rows, col_blocks, block_cols)
    out.amax.copy_(blocks.abs().amax(dim=(1, 3)))
    out.scale.copy_(scale_from_amax(out.amax, out.scaling))
    torch.reciprocal(out.scale, out=out.scale_inv)
    quantized = cast_to_fp8(blocks, out.scale[:, None, :, None], out.scaling)
    out.data.copy_(quantized.view(rows, col_blocks * block_cols)[:, :cols])


def quantize_shard(
    master: torch.Tensor,
    scaling: FP8Scaling,
    group: dist.ProcessGroup | None = None,
    *,
    spec: ShardSpec | None = None,
) -> FP8Shard:
    """A new :class:`FP8Shard` of ``master`` (allocate, then :func:`quantize_into`).

    Example::

        shard = quantize_shard(param.detach(), FP8Scaling("blockwise"), spec=param.gtp_spec)
    """
    return quantize_into(
        master, FP8Shard.empty(tuple(master.shape), scaling, master.device), group, spec=spec
    )


def _gather_views(shard: FP8Shard) -> list[torch.Tensor]:
    """What a gather moves, as bytes: FP8 data, plus the block scales of a blockwise shard.

    Every view keeps dim 0, so gathering each over dim 0 concatenates the shards' rows and
    block rows in rank order (fp32 scales as 4 bytes each: one dtype for the whole gather).
    """
    views = [shard.data.view(torch.uint8)]
    if shard.scaling.kind is ScalingKind.BLOCKWISE:
        views.append(shard.scale_inv.view(torch.uint8))
    return views


def all_gather_fp8(
    shard: FP8Shard,
    out: FP8Shard,
    group: dist.ProcessGroup | GroupCollectives,
    *,
    async_op: bool = False,
) -> CommHandle:
    """Gather every GTP peer's FP8 shard into the preallocated ``out`` (1 byte per element).

    Per-tensor: the data is gathered, the (agreed) scale copied locally. Blockwise: the data and
    the per-block ``scale_inv`` are gathered in one coalesced collective. Shapes and recipes are
    checked before the collective. ``out`` comes from :meth:`FP8Shard.empty_gathered`.
    ``group`` may be the runtime's :class:`GroupCollectives` (no per-call option building).

    Example::

        handle = all_gather_fp8(shard, full, groups.gtp, async_op=True)
        ...              # overlapped compute
        handle.wait()    # full.data / full.scale_inv hold the gathered weight
    """
    ops = group if isinstance(group, GroupCollectives) else GroupCollectives(group)
    size = ops.size
    expected = (shard.data.shape[0] * size, *shard.data.shape[1:])
    if out.scaling != shard.scaling or tuple(out.data.shape) != expected:
        raise ValueError(
            f"gather buffer {tuple(out.data.shape)} / {out.scaling} does not fit a shard "
            f"{tuple(shard.data.shape)} / {shard.scaling} gathered over {size} ranks "
            f"(use FP8Shard.empty_gathered)"
        )
    sources, targets = _gather_views(shard), _gather_views(out)
    if shard.scaling.kind is not ScalingKind.BLOCKWISE:
        out.scale_inv.copy_(shard.scale_inv)
        out.scale.copy_(shard.scale)
        out.amax.copy_(shard.amax)
    if len(sources) == 1:
        work = ops.all_gather(targets[0], sources[0])
    else:
        work = ops.all_gather_coalesced(targets, sources)
    handle = CommHandle(work)
    if not async_op:
        handle.wait()
    return handle


def block_pad_for_alignment(block_rows: int, pad_for_alignment: int = 1) -> int:
    """The smallest ``GTPConfig.pad_for_alignment`` that is a multiple of both arguments.

    With it every shard has a multiple of ``block_rows`` rows for any weight shape (each shard
    is a multiple of ``pad_for_alignment`` rows, design §1.3 "Padding").

    Example::

        block_pad_for_alignment(128, 16)   # 128
        block_pad_for_alignment(1, 16)     # 16 (1x128 blocks never split)
    """
    return math.lcm(block_rows, pad_for_alignment)


def check_block_alignment(
    spec: ShardSpec, block: tuple[int, int], pad_for_alignment: int | None = None
) -> None:
    """Raise ``ValueError`` naming ``GTPConfig.pad_for_alignment`` if shards split a block.

    ``pad_for_alignment`` is the configured value, for the advice. Blockwise FP8 scales each
    block on the rank that owns it, so a shard must hold whole blocks; run this before
    quantizing or gathering anything.

    Example::

        spec = ShardSpec.for_weight((300, 256), gtp_size=2, gtp_rank=0, pad_for_alignment=16)
        check_block_alignment(spec, (128, 128), 16)   # ValueError: ... pad_for_alignment=128
    """
    block_rows = block[0]
    if spec.shard_dim0 % block_rows == 0:
        return
    needed = block_pad_for_alignment(block_rows, pad_for_alignment or 1)
    current = (
        "" if pad_for_alignment is None else f"GTPConfig.pad_for_alignment={pad_for_alignment} "
    )
    raise ValueError(
        f"blockwise FP8 with {block[0]}x{block[1]} blocks: {current}gives the weight "
        f"{spec.logical_shape} shards of {spec.shard_dim0} rows at GTP {spec.gtp_size}, which "
        f"split blocks; set GTPConfig.pad_for_alignment={needed} (a multiple of {block_rows})"
    )

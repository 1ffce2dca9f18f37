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

import enum
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_gtp.engine.collectives import CommHandle, GroupCollectives
from nemo_gtp.engine.param import ShardSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 element types a shard can hold."""

_FLT_MAX = torch.finfo(torch.float32).max
_EXPONENT_MASK = 0x7F800000  # fp32 sign 0, exponent bits only: 2**floor(log2(x)) for x > 0


class ScalingKind(enum.Enum):
    """How an FP8 shard is scaled; values are megatron's ``fp8_recipe`` names."""

    TENSORWISE = "tensorwise"
    """Per-tensor current scaling: the scale comes from the weight's own amax at each quantize,
    agreed over the GTP group (one all-reduce MAX of a 4-byte amax)."""
    DELAYED = "delayed"
    """Per-tensor delayed scaling: the quantize uses the scale already in the shard (set by the
    caller from an amax history, :func:`scale_from_amax`) and records the GTP-global amax of the
    new weight in ``amax`` for that history."""
    BLOCKWISE = "blockwise"
    """One scale per ``block`` (1x128 or 128x128); a block never spans two shards, so each rank
    scales its own blocks with no collective."""


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


def _real_rows(spec: ShardSpec | None, rows: int) -> int:
    """Rows of this shard that hold weight (the rest are the tail pad of design §1.3)."""
    if spec is None:
        return rows
    start = spec.gtp_rank * spec.shard_dim0
    return max(0, min(rows, spec.logical_shape[0] - start))


def _cast(values: torch.Tensor, scale: torch.Tensor, scaling: FP8Scaling) -> torch.Tensor:
    """Saturating cast of ``values * scale`` to FP8 (torch's plain cast would overflow)."""
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
    real = _real_rows(spec, values.shape[0])
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
    out.data.copy_(_cast(values, out.scale, out.scaling))


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
    quantized = _cast(blocks, out.scale[:, None, :, None], out.scaling)
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


FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""megatron's ``fp8_recipe`` values."""
FP8_FORMATS = ("e4m3", "hybrid")
"""megatron's ``fp8`` values."""


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """CUDA compute capability of ``device``; ``None`` for a CPU (no FP8 tensor cores).

    Example::

        device_capability("cpu")      # None
        device_capability("cuda:0")   # (9, 0) on an H200
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def check_low_precision_recipe(
    fp8: str | None,
    fp8_recipe: str | None = "delayed",
    fp4: str | None = None,
    fp4_recipe: str | None = "nvfp4",
    capability: tuple[int, int] | None = None,
) -> ScalingKind | None:
    """Validate megatron's ``fp8`` / ``fp8_recipe`` / ``fp4`` settings for FP8 GTP shards.

    Pure (no collective): run it before any process group exists. Rejects MXFP8 and NVFP4 below
    compute capability 10.0 (Hopper and older, and a CPU: ``capability=None``), FP8 GEMMs below
    8.9, unknown names, and the recipes the shards cannot hold yet. Returns the shards'
    :class:`ScalingKind`, or ``None`` when FP8 is off. On a CPU the per-tensor and blockwise
    recipes pass: the engine plumbing runs there with torch's FP8 types (TE does not).

    Example::

        check_low_precision_recipe("e4m3", "blockwise", capability=(9, 0))  # BLOCKWISE
        check_low_precision_recipe("e4m3", "mxfp8", capability=(9, 0))      # ValueError
    """
    where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    blackwell = capability is not None and capability >= (10, 0)
    if fp4 is not None:
        if fp4_recipe != "nvfp4":
            raise ValueError(f"fp4_recipe must be 'nvfp4', got {fp4_recipe!r}")
        if not blackwell:
            raise ValueError(
                f"fp4={fp4!r} (NVFP4) needs compute capability >= 10.0 (Blackwell); this is "
                f"{where}: unset fp4, or use fp8 with fp8_recipe='blockwise' or 'tensorwise'"
            )
        raise NotImplementedError(
            "NVFP4 GTP shards are not implemented yet (design §1.3); unset fp4"
        )
    if fp8 is None:
        return None
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be one of {FP8_FORMATS} or None, got {fp8!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    if fp8_recipe == "mxfp8":
        if not blackwell:
            raise ValueError(
                f"fp8_recipe='mxfp8' needs compute capability >= 10.0 (Blackwell); this is "
                f"{where}: set fp8_recipe='blockwise' (1x128/128x128 blocks) or 'tensorwise'"
            )
        raise NotImplementedError(
            "MXFP8 GTP shards are not implemented yet (design §1.3); set fp8_recipe="
            "'blockwise' or 'tensorwise'"
        )
    if capability is not None and capability < (8, 9):
        raise ValueError(
            f"fp8={fp8!r} needs FP8 tensor cores (compute capability >= 8.9); this is {where}: "
            f"unset fp8"
        )
    if fp8_recipe == "blockwise" and capability is not None and capability < (9, 0):
        raise ValueError(
            f"fp8_recipe='blockwise' needs compute capability >= 9.0 (Hopper); this is {where}: "
            f"set fp8_recipe='tensorwise'"
        )
    return ScalingKind(fp8_recipe)


GATHER_FP8 = "fp8"
""":func:`check_fp8_training_for_gtp`: the runtime gathers FP8 bytes (design §1.3 "FP8 gather")."""
GATHER_TRAINING_DTYPE = "training_dtype"
""":func:`check_fp8_training_for_gtp`: the runtime gathers the training dtype and TE quantizes the
gathered weight itself (recipes the FP8 gather does not cover yet)."""
FP8_PRIMARY = "fp8_primary"
""":func:`check_fp8_training_for_gtp`: the shards are FP8 primary weights and every gather moves
their own FP8 bytes (design §1.3 "FP8 primary weights"; ``fp8_param`` with per-tensor current
scaling or blockwise scaling)."""
FP8_PRIMARY_RECIPES = ("tensorwise", "blockwise")
"""The ``fp8_recipe`` values FP8 primary GTP shards support (design §1.3 "FP8 primary
weights"): one scale per weight agreed over replicate x GTP, or one per 128x128 tile."""

_KEYS = {
    "fp8": "fp8",
    "fp8_recipe": "fp8_recipe",
    "fp8_param": "fp8_param",
    "fp4": "fp4",
    "fp4_recipe": "fp4_recipe",
}


def check_fp8_training_for_gtp(
    fp8: str | None,
    fp8_recipe: str | None = "delayed",
    fp4: str | None = None,
    fp4_recipe: str | None = "nvfp4",
    *,
    fp8_param: bool = False,
    capability: tuple[int, int] | None = None,
    keys: dict[str, str] | None = None,
) -> str | None:
    """Validate the FP8 / FP4 settings of a GTP run: FP8 compute, and FP8 primary weights.

    Pure, no collective: run it before any process group. ``capability`` is the GPU's compute
    capability, or ``None`` when unknown (a launcher without the GPU: only names are checked,
    the device repeats the check). ``keys`` maps ``fp8``, ``fp8_recipe``, ``fp8_param``,
    ``fp4``, ``fp4_recipe`` to the caller's names of those settings, so the error names the
    key the user writes (e.g. ``fp8.recipe`` in a recipe YAML). Returns ``None`` when neither
    is on, :data:`GATHER_FP8` when the runtime will gather FP8 bytes (per-tensor current
    scaling, ``fp8_recipe="tensorwise"``; ``"blockwise"``, for every weight whose shards are
    whole 128-row tiles, the others in the training dtype), :data:`GATHER_TRAINING_DTYPE` for
    the recipes whose gathered weight TE quantizes itself (``"delayed"``; MXFP8 / NVFP4 on
    Blackwell), :data:`FP8_PRIMARY` for FP8 primary weights (``fp8_param`` with
    ``fp8_recipe="tensorwise"`` or ``"blockwise"``: the shards themselves are FP8, design §1.3
    "FP8 primary weights"). Raises ``ValueError`` for FP8 primary weights under any other
    recipe (delayed, MXFP8) or with FP4, unknown names and recipes the hardware cannot run (MXFP8 /
    NVFP4 below compute capability 10.0, FP8 below 8.9, blockwise below 9.0).

    Example::

        check_fp8_training_for_gtp("hybrid", "tensorwise", capability=(9, 0))   # "fp8"
        check_fp8_training_for_gtp("hybrid", "tensorwise", fp8_param=True)     # "fp8_primary"
        check_fp8_training_for_gtp("e4m3", "delayed", fp8_param=True)          # ValueError
        check_fp8_training_for_gtp("e4m3", "mxfp8", capability=(9, 0))         # ValueError
    """
    key = {**_KEYS, **(keys or {})}
    where = "" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    known = capability is not None
    if fp8_param and fp4 is not None:
        raise ValueError(
            f"{key['fp8_param']}=True with {key['fp4']}={fp4!r}: FP4 primary weights are not "
            f"supported with GTP (design §1.3): set {key['fp8_param']}=False"
        )
    if fp4 is not None:
        if fp4_recipe != "nvfp4":
            raise ValueError(f"{key['fp4_recipe']} must be 'nvfp4', got {fp4_recipe!r}")
        if known and capability < (10, 0):
            raise ValueError(
                f"{key['fp4']}={fp4!r} (NVFP4) needs compute capability >= 10.0 (Blackwell); "
                f"this is {where}: unset {key['fp4']}, or use {key['fp8']} with "
                f"{key['fp8_recipe']}='tensorwise'"
            )
        return GATHER_TRAINING_DTYPE
    if fp8 is None:
        return None
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"{key['fp8']} must be one of {FP8_FORMATS} or None, got {fp8!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"{key['fp8_recipe']} must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    if known and capability < (8, 9):
        raise ValueError(
            f"{key['fp8']}={fp8!r} needs FP8 tensor cores (compute capability >= 8.9); this is "
            f"{where}: unset {key['fp8']}"
        )
    if fp8_recipe == "mxfp8" and known and capability < (10, 0):
        raise ValueError(
            f"{key['fp8_recipe']}='mxfp8' needs compute capability >= 10.0 (Blackwell); this is "
            f"{where}: set {key['fp8_recipe']}='tensorwise' (per-tensor current scaling, "
            f"gathered in FP8 under GTP) or 'blockwise'"
        )
    if fp8_recipe == "blockwise" and known and capability < (9, 0):
        raise ValueError(
            f"{key['fp8_recipe']}='blockwise' needs compute capability >= 9.0 (Hopper); this is "
            f"{where}: set {key['fp8_recipe']}='tensorwise'"
        )
    if fp8_param and fp8_recipe not in FP8_PRIMARY_RECIPES:
        raise ValueError(
            f"{key['fp8_param']}=True (FP8 primary weights, megatron's fp8_param_gather) with "
            f'{key["fp8_recipe"]}={fp8_recipe!r} is not supported with GTP (design §1.3 "FP8 '
            f"primary weights\": GTP's FP8 primary shards use per-tensor current scaling or "
            f"128x128 blockwise scaling): set {key['fp8_recipe']}='tensorwise' or 'blockwise', "
            f"or {key['fp8_param']}=False (the shards then stay in the training dtype)"
        )
    if fp8_param:
        return FP8_PRIMARY
    return GATHER_FP8 if fp8_recipe in ("tensorwise", "blockwise") else GATHER_TRAINING_DTYPE

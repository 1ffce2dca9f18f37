"""TransformerEngine's FP8 GEMMs fed from GTP's FP8 gathers (design §1.3 "FP8 gather").

Under ``te.autocast`` / ``fp8_autocast`` with per-tensor current scaling (megatron
``fp8_recipe="tensorwise"``, TE's ``Float8CurrentScaling``), a TE ``Linear`` /
``LayerNormLinear`` whose weight is a :class:`GTPShardedParam` would otherwise receive the
gathered weight in the training dtype and quantize all of it again at every microbatch (twice:
forward, and row- plus column-wise for the backward). :class:`TEFP8Gather` is the runtime's
``QuantizedGather`` consumer instead: the runtime gathers the FP8 copy of the shards (quantized
once per optimizer step with the GTP-agreed scale, half the bytes on the wire) and this class
hands TE a ``Float8Tensor`` over that buffer, which TE uses as it uses an FP8 primary weight:
its forward takes the tensor's own quantizer and skips the cast (``quantize_weight`` returns a
``QuantizedTensor`` as is), its backward skips the re-quantize of a distributed weight that is
already quantized and asks for column-wise usage, which on Hopper (no non-TN FP8 GEMM) writes
the transpose into the stable buffer the runtime provides, once per gathered weight.

The ``Float8Tensor`` objects are made once per gather slot and buffer; their ``_data``,
``_scale_inv`` and ``_transpose`` are views of the runtime's stable tensors, set again at each
hand-out (TE's usage updates drop fields of the object), so a step allocates no device memory.

Blockwise scaling (``fp8_recipe="blockwise"``, TE's ``Float8BlockScaling`` with its default
128x128 weight tiles) gathers FP8 too: every rank quantizes its own tiles once per step (no
collective; the shards' rows are whole tiles), the tiles' ``scale_inv`` travel with the rows,
and TE gets a ``Float8BlockwiseQTensor`` over the gathered rows and scales. Its backward needs
the column-wise copy (the transpose and the transposed scale grid, the same tiles' values),
written into the runtime's stable buffers at each backward hand-out by TE's transpose kernel
and one scale copy (what TE's ``_create_columnwise`` does, its views planned once per
buffer). A weight whose shard rows are not whole tiles (``GTPConfig.pad_for_alignment`` below
128) is gathered in the training dtype and quantized by TE, as before.

Other recipes gather the training dtype (TE quantizes the gathered weight itself): delayed
scaling's scale comes from TE's amax history, 1x128 weight blocks and MXFP8 / NVFP4 scales are
not gathered.
"""

from __future__ import annotations

import torch

from nemo_gtp.engine.fp8 import FP8Scaling, ScalingKind
from nemo_gtp.engine.fp8_gather import FP8Gathered
from nemo_gtp.engine.param import Direction, GTPShardedParam

TE_TILE = 128
"""Rows and columns of TE's blockwise weight tiles (``Float8BlockQuantizer.block_len``)."""

_FP8_DTYPES = {  # TE Format name -> the dtype of forward tensors (weights)
    "E4M3": torch.float8_e4m3fn,
    "HYBRID": torch.float8_e4m3fn,  # E4M3 forward, E5M2 gradients
    "E5M2": torch.float8_e5m2,
}


def fp8_scaling_of_recipe(recipe: object) -> FP8Scaling | None:
    """The :class:`FP8Scaling` the runtime gathers weights in under TE ``recipe``, or ``None``.

    Per-tensor current scaling (``Float8CurrentScaling``): its weight quantizer is E4M3 under
    the ``E4M3`` and ``HYBRID`` formats, and uses power-of-two scales when the recipe says so
    (``use_power_2_scales``). Blockwise (``Float8BlockScaling`` with 2-D weight tiles,
    ``w_block_scaling_dim=2``): 128x128 tiles, the weight quantizer's ``power_2_scale`` and
    ``amax_epsilon``. Duck-typed on TE's recipe API, so it runs without TE.

    Example::

        fp8_scaling_of_recipe(Float8CurrentScaling(fp8_format=Format.HYBRID))
        # FP8Scaling(kind=TENSORWISE, fp8_dtype=torch.float8_e4m3fn, ...)
        fp8_scaling_of_recipe(DelayedScaling())   # None: TE quantizes the gathered weight
    """
    fmt = getattr(getattr(recipe, "fp8_format", None), "name", None)
    dtype = _FP8_DTYPES.get(fmt)
    if dtype is None:
        return None
    block = getattr(recipe, "float8_block_scaling", None)
    if block is not None and block():
        if getattr(recipe, "w_block_scaling_dim", None) != 2:  # 1x128 weight blocks
            return None
        weight = getattr(recipe, "fp8_quant_fwd_weight", None)
        return FP8Scaling(
            "blockwise",
            fp8_dtype=dtype,
            block=(TE_TILE, TE_TILE),
            power_2_scales=bool(getattr(weight, "power_2_scale", True)),
            epsilon=float(getattr(weight, "amax_epsilon", 0.0)),
        )
    current = getattr(recipe, "float8_current_scaling", None)
    if current is None or not current():
        return None
    return FP8Scaling(
        "tensorwise",
        fp8_dtype=dtype,
        power_2_scales=bool(getattr(recipe, "use_power_2_scales", False)),
    )


class TEFP8Gather:
    """The runtime's ``QuantizedGather`` consumer for TE linears (module docstring).

    Installed by ``shard_model`` on every runtime that drives TE linears when
    ``GTPConfig.fp8_gather`` is on (default); inert outside FP8 autocast.

    Example::

        runtime.quantized_gather = TEFP8Gather()
        with te.autocast(recipe=Float8CurrentScaling()):
            out = model(x)          # TE's GEMMs get Float8Tensor weights gathered in FP8
    """

    def __init__(self) -> None:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
            Float8BlockQuantizer,
            Float8BlockwiseQTensor,
        )
        from transformer_engine.pytorch.tensor.float8_tensor import (
            Float8CurrentScalingQuantizer,
            Float8Tensor,
        )
        from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

        self._state = FP8GlobalStateManager
        self._tensor = Float8Tensor
        self._quantizer = Float8CurrentScalingQuantizer
        self._block_tensor = Float8BlockwiseQTensor
        self._block_quantizer = Float8BlockQuantizer
        self._fp8_transpose = tex.fp8_transpose
        self._te_dtypes = {
            torch.float8_e4m3fn: tex.DType.kFloat8E4M3,
            torch.float8_e5m2: tex.DType.kFloat8E5M2,
        }
        # Hopper runs FP8 GEMMs in the TN layout only: the dgrad GEMM needs the transpose.
        self.transpose_for_backward = torch.cuda.is_available() and not (
            is_non_tn_fp8_gemm_supported()
        )
        self._scalings: dict[tuple, FP8Scaling | None] = {}

    def forward_scaling(self, param: GTPShardedParam) -> FP8Scaling | None:
        """The scaling of the FP8 autocast region TE runs in now; None outside one or for a
        recipe the runtime does not gather in."""
        state = self._state
        if not state.is_fp8_enabled():
            return None
        recipe = state.get_fp8_recipe()
        # megatron makes a new recipe object per layer: key the cache on what decides.
        weight = getattr(recipe, "fp8_quant_fwd_weight", None)
        key = (
            type(recipe),
            getattr(recipe, "fp8_format", None),
            getattr(recipe, "use_power_2_scales", None),
            getattr(recipe, "w_block_scaling_dim", None),
            getattr(weight, "power_2_scale", None),
            getattr(weight, "amax_epsilon", None),
        )
        if key not in self._scalings:
            self._scalings[key] = fp8_scaling_of_recipe(recipe)
        scaling = self._scalings[key]
        if scaling is not None and scaling.kind is ScalingKind.BLOCKWISE:
            if param.gtp_spec.shard_dim0 % TE_TILE:  # a tile would span two shards
                return None
        return scaling

    def wrap(
        self, param: GTPShardedParam, direction: Direction, gathered: FP8Gathered
    ) -> torch.Tensor:
        """A TE ``Float8Tensor`` (blockwise: ``Float8BlockwiseQTensor``) over the gathered FP8
        rows (made once per gathered buffer)."""
        if gathered.scaling.kind is ScalingKind.BLOCKWISE:
            return self._wrap_blocks(param, direction, gathered)
        # Fresh byte views at every hand-out: TE may drop or clear the fields of the object it
        # was handed (update_usage, clear_tensor_data), never the runtime's buffers behind them.
        data = gathered.data.view(torch.uint8)
        transpose = None if gathered.transpose is None else gathered.transpose.view(torch.uint8)
        tensor = gathered.consumer
        if tensor is None:
            scaling = gathered.scaling
            te_dtype = self._te_dtypes[scaling.fp8_dtype]
            quantizer = self._quantizer(
                te_dtype,
                data.device,
                rowwise=True,
                columnwise=direction is Direction.BWD,
                force_pow_2_scales=bool(scaling.power_2_scales),
                amax_epsilon=scaling.epsilon,
            )
            tensor = gathered.consumer = self._tensor(
                shape=data.shape,
                # an FP8 primary shard's own dtype is FP8: TE wants the training dtype
                dtype=param.training_dtype,
                data=data,
                fp8_scale_inv=gathered.scale_inv,
                fp8_dtype=te_dtype,
                # TE's LayerNormLinear reads requires_grad from the tensor it is handed to decide
                # on the wgrad (not from the param), as for the training-dtype gather.
                requires_grad=param.requires_grad,
                data_transpose=None,
                quantizer=quantizer,
                device=data.device,
            )
        tensor._data = data
        tensor._scale_inv = gathered.scale_inv
        tensor._transpose = transpose
        # Invalid until TE's backward asks for column-wise usage: its transpose kernel then
        # writes into this stable buffer (once per gathered weight).
        tensor._transpose_invalid = True
        return tensor

    def _wrap_blocks(
        self, param: GTPShardedParam, direction: Direction, gathered: FP8Gathered
    ) -> torch.Tensor:
        """The blockwise ``Float8BlockwiseQTensor``: the gathered rows and tile scales; in a
        backward hand-out also the column-wise copy, written into the runtime's stable
        transpose and scale buffers (one transpose kernel and one scale copy per gathered
        weight, planned once per buffer: :class:`_BlockHandOut`)."""
        hand_out = gathered.consumer
        if hand_out is None:
            hand_out = gathered.consumer = self._block_hand_out(param, direction, gathered)
        tensor = hand_out.tensor
        # Fresh byte views at every hand-out, as for per tensor (TE may drop or clear them).
        data = gathered.data.view(torch.uint8)
        tensor._rowwise_data = data
        tensor._rowwise_scale_inv = gathered.scale_inv
        if hand_out.scale_to is None:  # a forward buffer, or no column-wise copy asked for
            tensor._columnwise_data = tensor._columnwise_scale_inv = None
            return tensor
        # What TE's ``_create_columnwise`` does for 2-D tiles (the tiles' transpose, the scale
        # grid transposed), without its per-call checks, shapes and slicing: the rows are a
        # contiguous cache buffer and the scale views are fixed for the life of the buffer.
        columnwise = gathered.transpose.view(torch.uint8)
        tensor._columnwise_data = columnwise
        tensor._columnwise_scale_inv = gathered.columnwise_scale_inv
        self._fp8_transpose(data, tensor._fp8_dtype, out=columnwise)
        hand_out.scale_to.copy_(hand_out.scale_from)
        return tensor

    def _block_hand_out(
        self, param: GTPShardedParam, direction: Direction, gathered: FP8Gathered
    ) -> _BlockHandOut:
        """The TE tensor of one gathered buffer and, for a backward buffer with a column-wise
        copy, the scale views of its transpose (made at the buffer's first hand-out)."""
        scaling = gathered.scaling
        te_dtype = self._te_dtypes[scaling.fp8_dtype]
        quantizer = self._block_quantizer(
            te_dtype,
            rowwise=True,
            columnwise=direction is Direction.BWD,
            amax_epsilon=scaling.epsilon,
            force_pow_2_scales=bool(scaling.power_2_scales),
            block_scaling_dim=2,
        )
        data = gathered.data.view(torch.uint8)
        tensor = self._block_tensor(
            data.shape,
            param.training_dtype,
            rowwise_data=data,
            rowwise_scale_inv=gathered.scale_inv,
            columnwise_data=None,
            columnwise_scale_inv=None,
            fp8_dtype=te_dtype,
            quantizer=quantizer,
            is_2D_scaled=True,
            requires_grad=param.requires_grad,
            device=data.device,
        )
        if direction is not Direction.BWD or gathered.transpose is None:
            return _BlockHandOut(tensor, None, None)
        # TE's own scale copy: the overlap of the transposed row-wise grid and the column-wise
        # grid (both padded to cuBLAS's 4-column layout, so their shapes differ).
        source = gathered.scale_inv.transpose(-2, -1)
        target = gathered.columnwise_scale_inv
        h = min(target.shape[0], source.shape[0])
        w = min(target.shape[1], source.shape[1])
        return _BlockHandOut(tensor, source[0:h, 0:w], target[0:h, 0:w])


class _BlockHandOut:
    """What :meth:`TEFP8Gather._wrap_blocks` keeps per gathered buffer (``FP8Gathered.consumer``):
    the ``Float8BlockwiseQTensor`` handed to TE, and for a backward buffer the fixed views its
    column-wise scale copy reads (``scale_from``) and writes (``scale_to``); None otherwise."""

    __slots__ = ("tensor", "scale_from", "scale_to")

    def __init__(
        self,
        tensor: torch.Tensor,
        scale_from: torch.Tensor | None,
        scale_to: torch.Tensor | None,
    ) -> None:
        self.tensor = tensor
        self.scale_from = scale_from
        self.scale_to = scale_to


def install_te_fp8_gather(runtime: object) -> bool:
    """Make ``runtime`` gather FP8 for TE linears under per-tensor current scaling.

    Returns False (nothing installed) when TransformerEngine cannot be imported.

    Example::

        install_te_fp8_gather(model.gtp_runtime)
    """
    try:
        consumer = TEFP8Gather()
    except ImportError:
        return False
    runtime.quantized_gather = consumer
    return True

"""TransformerEngine's FP8 linear, reduced to what the weight protocol sees, for CPU tests.

TE cannot run on CPU. This stand-in mirrors, in pure torch, what TE 2.20's ``LayerNormLinear``
does with a weight under FP8 autocast (design §1.3 "Consumer-quantized backward"):

- the forward quantizes the weight with the module's weight quantizer
  (``module._get_weight_quantizers()``, row- and column-wise), and keeps that quantized weight
  for the backward when the weight is its own; a distributed weight is materialized through the
  protocol instead, and nothing quantized is kept;
- the backward uses a distributed weight's ``materialize_group_for_backward()`` result as is: a
  training-dtype weight meeting the FP8 grad output in the dgrad GEMM raises (cuBLAS refuses it
  on the GPU); a quantized one is asked for column-wise usage and the GEMM reads its transpose
  (Hopper: TN GEMMs only), which must exist;
- between forward and backward, :meth:`StandInTELinear.autocast_exit` does to the quantizer
  what TE's autocast exit does under delayed scaling: the scale moves on, the amax is reset.

Quantizers: :class:`StandInCurrentQuantizer` (per-tensor current scaling: the scale from the
tensor's amax) and :class:`StandInDelayedQuantizer` (the scale it is given; it records the amax;
the constructor and attributes of TE's ``Float8Quantizer``). Like TE's per-tensor FP8 cast
on Hopper, neither quantizes column-wise without row-wise. Both make
:class:`StandInFP8Tensor`, which holds a reference to the quantizer that made it, as TE's do.

Example::

    linear = StandInTELinear(16, 40, StandInCurrentQuantizer())
    linear.fp8 = True
    y = linear(x); y.backward(dy)
    linear.backward_weights[-1]        # what the dgrad GEMM received
"""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.te_grouped import (
    finalize_weight_grads,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)

FP8_MAX = 448.0  # E4M3


def _cast(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scaled = (tensor.float() * scale).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn)


class StandInFP8Tensor:
    """A TE ``Float8TensorStorage`` stand-in: ``_data`` (row-wise), ``_transpose``
    (column-wise), ``_scale_inv``, ``_quantizer``."""

    def __init__(
        self,
        data: torch.Tensor | None,
        transpose: torch.Tensor | None,
        scale_inv: torch.Tensor,
        quantizer: Any,
    ) -> None:
        self._data, self._transpose = data, transpose
        self._scale_inv, self._quantizer = scale_inv, quantizer

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """TE's on Hopper: the transpose is made from the data; data cannot come back."""
        if columnwise_usage and self._transpose is None:
            if self._data is None:
                raise RuntimeError("FP8 data is required to generate FP8 data transpose")
            self._transpose = self._data.t().contiguous()
        if rowwise_usage and self._data is None:
            raise RuntimeError("Cannot generate FP8 data, even from FP8 data transpose")
        if rowwise_usage is False:
            self._data = None
        if columnwise_usage is False:
            self._transpose = None

    def dequantize_columnwise(self) -> torch.Tensor:
        """The weight as the dgrad GEMM reads it: from the transpose."""
        if self._transpose is None:
            raise RuntimeError("column-wise FP8 data missing for the dgrad GEMM")
        return (self._transpose.float() * self._scale_inv).t()

    def dequantize(self) -> torch.Tensor:
        """The weight as the forward GEMM reads it: from the row-wise data."""
        return self._data.float() * self._scale_inv


class _StandInQuantizer:
    """TE ``Quantizer`` usage flags and call."""

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise
        self.internal = False

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """As TE's ``Quantizer.set_usage``."""
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def _scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, tensor: torch.Tensor) -> StandInFP8Tensor:
        if self.columnwise_usage and not self.rowwise_usage:  # TE's per-tensor cast (Hopper)
            raise RuntimeError("Quantizing in only the columnwise direction not supported yet!")
        scale = self._scale_for(tensor)
        data = _cast(tensor, scale)
        return StandInFP8Tensor(
            data if self.rowwise_usage else None,
            data.t().contiguous() if self.columnwise_usage else None,
            scale.reciprocal(),
            self,
        )


class StandInCurrentQuantizer(_StandInQuantizer):
    """Per-tensor current scaling: ``scale = FP8_MAX / amax(tensor)``."""

    def _scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        return FP8_MAX / tensor.detach().abs().amax().float().clamp_min(1e-12)


class StandInDelayedQuantizer(_StandInQuantizer):
    """Delayed scaling (TE ``Float8Quantizer``'s constructor): quantizes with ``scale``, writes
    the tensor's amax into ``amax``."""

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype: Any,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype

    def _scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        self.amax.copy_(tensor.detach().abs().amax().float())
        return self.scale.clone()


def _is_distributed(weight: object) -> bool:
    return bool(getattr(weight, "is_distributed_weight", False))


class _StandInLinearFunction(torch.autograd.Function):
    """TE ``_LayerNormLinear`` (no norm, no bias) as the weight protocol sees it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: Any):  # noqa: ANN205
        distributed = _is_distributed(weight)
        full = materialize_weight_for_forward([weight])[0] if distributed else weight
        fp8 = module.fp8
        workspace = None
        if fp8:
            (quantizer,) = module._get_weight_quantizers()
            quantizer.set_usage(rowwise=True, columnwise=True)
            workspace = quantizer(full.detach())
            used = workspace.dequantize()
        else:
            used = full.detach().float()
        ctx.save_for_backward(x, weight)
        # TE does not keep a distributed weight's quantized workspace (re-gathered instead).
        ctx.workspace = None if distributed else workspace
        ctx.fp8, ctx.distributed, ctx.module = fp8, distributed, module
        return (x.float() @ used.t()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # noqa: ANN205
        x, weight = ctx.saved_tensors
        if ctx.distributed:
            used = materialize_weight_for_backward([weight])[0]
        else:
            used = ctx.workspace if ctx.fp8 else weight
        ctx.module.backward_weights.append(used)
        if ctx.fp8:
            if not isinstance(used, StandInFP8Tensor):
                raise RuntimeError(
                    "cuBLAS Error: an unsupported value or parameter was passed to the function "
                    "(stand-in: a training-dtype weight meets the FP8 grad output in dgrad)"
                )
            used.update_usage(columnwise_usage=True)
            dense = used.dequantize_columnwise()
        else:
            dense = used.detach().float()
        dgrad = (dy.float() @ dense).to(dy.dtype)
        wgrad = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if ctx.distributed:
            finalize_weight_grads([weight], [wgrad])
            return dgrad, None, None
        return dgrad, wgrad, None


class StandInTELinear(torch.nn.Module):
    """A TE ``LayerNormLinear`` stand-in (module docstring): ``fp8`` (set by TE from the
    autocast state at each forward), ``fp8_meta["recipe"]``, ``quantizers["scaling_fwd"]``
    (input, weight, output) and ``_get_weight_quantizers()``; ``backward_weights`` lists what
    each backward's dgrad GEMM received."""

    def __init__(self, in_features: int, out_features: int, quantizer: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features))
        self.fp8 = False
        self.fp8_meta: dict[str, Any] = {"recipe": None}
        self.quantizers = {"scaling_fwd": [None, quantizer, None]}
        self.backward_weights: list[Any] = []

    def _get_weight_quantizers(self) -> list[Any]:
        return [self.quantizers["scaling_fwd"][1] if self.fp8 else None]

    def autocast_exit(self) -> None:
        """What TE's autocast exit does to a delayed-scaling quantizer: a new scale (here the
        old one halved), the current amax slot reset."""
        quantizer = self.quantizers["scaling_fwd"][1]
        if isinstance(quantizer, StandInDelayedQuantizer):
            quantizer.scale.mul_(0.5)
            quantizer.amax.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y = x W^T`` through the stand-in autograd function."""
        return _StandInLinearFunction.apply(x, self.weight, self)

"""megatron-core's ``gradient_accumulation_fusion`` without apex (design §2.4 "Fused wgrad
accumulation without apex").

With the setting on, every linear accumulates its weight gradient into ``main_grad`` inside
the wgrad GEMM instead of handing autograd a bf16 gradient that megatron's DDP then adds in a
separate fp32 kernel per weight: TE's linears through TE's own ``fuse_wgrad_accumulation``,
megatron's own linears (the output layer of the TE spec is a ``ColumnParallelLinear``) through
apex's ``fused_weight_gradient_mlp_cuda``. Without apex, megatron refuses the setting when it
builds such a layer, so a stack without apex ran every weight unfused.

torch has that GEMM on CUDA (``addmm`` with half-precision inputs and an fp32 result,
``out_dtype``): :class:`TorchWgradAccumulation` offers apex's two entry points on it and
:func:`enable_gradient_accumulation_fusion` hands them to megatron when apex is missing. On a
device without the kernel (CPU) the same sum is an fp32 ``addmm_``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")
"""Whether this torch has ``addmm(..., out_dtype=)`` (torch >= 2.8; its kernel is CUDA-only)."""


def fused_accumulation_available() -> bool:
    """Whether torch has the half-precision GEMM with an fp32 accumulator on this machine."""
    return ADDMM_OUT_DTYPE and torch.cuda.is_available()


def accumulate_wgrad(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output.T @ total_input`` over all leading dimensions, in
    ``main_grad``'s dtype, in one GEMM where the device has it.

    Example::

        accumulate_wgrad(x, dy, weight.main_grad)  # x [s, b, in], dy [s, b, out]
    """
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1]).t()
    input_2d = total_input.reshape(-1, total_input.shape[-1])
    if grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d, input_2d)
    elif main_grad.dtype == torch.float32 and main_grad.is_cuda and ADDMM_OUT_DTYPE:
        # beta = 1 into the fp32 buffer: the products are summed in fp32, never rounded to bf16
        torch.addmm(main_grad, grad_2d, input_2d, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(grad_2d.to(main_grad.dtype), input_2d.to(main_grad.dtype))


class TorchWgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` interface on :func:`accumulate_wgrad`: what
    megatron's own linears call under ``gradient_accumulation_fusion``.

    Example::

        TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """fp32 ``main_grad``: the GEMM's fp32 sum accumulates into it."""
        accumulate_wgrad(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """fp16 / bf16 ``main_grad`` (megatron's ``accumulate_allreduce_grads_in_fp32=False``)."""
        accumulate_wgrad(total_input, grad_output, main_grad)


def enable_gradient_accumulation_fusion(config: Any) -> str | None:
    """Let megatron build ``config`` with ``gradient_accumulation_fusion`` on this stack.

    Nothing to do when the setting is off or apex's extension is installed. Else, on CUDA with
    torch's fp32-accumulating GEMM, megatron's linears get :class:`TorchWgradAccumulation` as
    their extension (process-wide, for every model built afterwards) and a note for the log is
    returned. Else a ``ValueError`` names the setting to turn off. Call before the model is
    built (the strategy's ``setup_distributed`` does).

    Example::

        note = enable_gradient_accumulation_fusion(model.config)
    """
    if not getattr(config, "gradient_accumulation_fusion", False):
        return None
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return None  # apex's extension, or ours from an earlier fit
    if not fused_accumulation_available():
        raise ValueError(
            "model.gradient_accumulation_fusion=true needs apex's fused_weight_gradient_mlp_cuda "
            "or torch's fp32-accumulating addmm on CUDA (torch >= 2.8 with a GPU); set "
            "model.gradient_accumulation_fusion=false"
        )
    install_torch_wgrad_accumulation()
    return (
        "gradient_accumulation_fusion: apex's fused_weight_gradient_mlp_cuda is not installed; "
        "megatron's own linears accumulate their wgrad with torch's fp32-accumulating addmm"
    )


def install_torch_wgrad_accumulation() -> None:
    """Hand megatron's linears :class:`TorchWgradAccumulation` as apex's extension, whatever
    the device (on CPU its sum is an fp32 ``addmm_``: the CPU tests drive megatron's fused
    backward through it). :func:`enable_gradient_accumulation_fusion` checks first.

    Example::

        install_torch_wgrad_accumulation()
        ColumnParallelLinear(..., config=config)  # config.gradient_accumulation_fusion=True
    """
    from megatron.core.tensor_parallel import layers

    # megatron-core 0.15 reads both at call time: the flag when it builds a linear, the
    # extension in the linear's backward.
    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True

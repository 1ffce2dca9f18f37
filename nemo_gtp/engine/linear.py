"""The autograd path for linears without TransformerEngine (design §3.1, local linears).

Forward: materialize (gather) → GEMM → release. Backward: re-materialize → dgrad GEMM → release;
wgrad GEMM into pooled scratch → reduce-scatter into ``main_grad`` (deferred finalize). The
gathered weight is never saved for backward, so between the two GEMMs only the shard is resident.

Tensor-parallel communication mirrors megatron-core's
``linear_with_grad_accumulation_and_async_allreduce``: the dgrad all-reduce over TP (column
parallel, overlapped with the wgrad GEMM) and, under sequence parallelism, the input all-gather
and the dgrad reduce-scatter along the sequence dimension.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_gtp.engine.collectives import all_gather_single, reduce_scatter_single
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.runtime import GTPRuntime
from nemo_gtp.engine.slots import Direction


@dataclass(frozen=True)
class TPComm:
    """Tensor-parallel communication a GTP linear performs around its GEMMs."""

    group: dist.ProcessGroup | None = None
    allreduce_dgrad: bool = False
    sequence_parallel: bool = False


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


_MM_OUT_DTYPE_OK: dict[str, bool] = {}


def _wgrad_gemm(grad_2d: torch.Tensor, x_2d: torch.Tensor, out: torch.Tensor) -> None:
    """``out = grad^T @ x``; ``out`` may be wider (fp32 main_grad) than the activations (bf16).

    The mixed case uses one GEMM with an fp32 epilogue (``mm(..., out_dtype=)``, CUDA) where
    available, as TE's fused wgrad accumulation does, instead of a bf16 GEMM plus a copy.
    """
    if out.dtype == grad_2d.dtype:
        torch.mm(grad_2d.t(), x_2d, out=out)
        return
    device = out.device.type
    if _MM_OUT_DTYPE_OK.get(device, True):
        try:
            torch.mm(grad_2d.t(), x_2d, out_dtype=out.dtype, out=out)
            _MM_OUT_DTYPE_OK[device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[device] = False
    out.copy_(torch.mm(grad_2d.t(), x_2d))


class _GTPLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with W a :class:`GTPShardedParam` (gathered around each GEMM)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        weight: GTPShardedParam,
        bias: torch.Tensor | None,
        tp: TPComm,
        will_backward: bool,
    ) -> torch.Tensor:
        runtime = weight.runtime
        total_x = _gather_sequence(x, tp.group) if tp.sequence_parallel else x
        if runtime.gather_backend is None:  # read once, by gather_backend="auto"
            runtime.note_tokens(total_x.numel() // total_x.shape[-1])
        full = runtime.materialize(weight, Direction.FWD, will_backward=will_backward)
        if runtime.trace is not None:
            runtime.record("gemm", weight, Direction.FWD)
        out = torch.matmul(total_x, runtime.gemm_weight(weight, Direction.FWD, full).t())
        runtime.release(weight, Direction.FWD)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x)
        ctx.weight, ctx.tp, ctx.has_bias = weight, tp, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight: GTPShardedParam = ctx.weight
        tp: TPComm = ctx.tp
        runtime = weight.runtime
        total_x = _gather_sequence(x, tp.group) if tp.sequence_parallel else x
        grad_in, dgrad_work = None, None
        if ctx.needs_input_grad[0]:
            full = runtime.materialize(weight, Direction.BWD)
            if runtime.trace is not None:
                runtime.record("gemm", weight, Direction.BWD)
            grad_in = torch.matmul(grad_out, runtime.gemm_weight(weight, Direction.BWD, full))
            runtime.release(weight, Direction.BWD)
            if tp.allreduce_dgrad and not tp.sequence_parallel:
                dgrad_work = dist.all_reduce(grad_in, group=tp.group, async_op=True)
        else:  # keep the backward chain flowing for the weights before this one
            runtime.prefetch_neighbour(weight, Direction.BWD)
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:  # a frozen weight (PEFT) has no wgrad: no GEMM, no RS
            x_2d = total_x.reshape(-1, total_x.shape[-1])
            scratch = runtime.wgrad_scratch(weight)
            _wgrad_gemm(grad_2d, x_2d, weight.gtp_spec.unpad(scratch))
            runtime.reduce_scatter_wgrad(weight, scratch)
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if grad_in is not None and tp.sequence_parallel:
            grad_in = _reduce_scatter_sequence(grad_in, tp.group)
        if dgrad_work is not None:
            dgrad_work.wait()
        return grad_in, None, grad_bias, None, None


def gtp_linear(
    x: torch.Tensor,
    weight: GTPShardedParam,
    bias: torch.Tensor | None = None,
    tp: TPComm = TPComm(),
) -> torch.Tensor:
    """``F.linear`` for a GTP-sharded weight (design §1.1 per-weight materialization).

    Example::

        y = gtp_linear(x, layer.weight, layer.bias)   # layer.weight is a GTPShardedParam
    """
    will_backward = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    return _GTPLinearFunction.apply(x, weight, bias, tp, will_backward)


def _sharded_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return gtp_linear(x, self.weight, self.bias)


def shard_linear(module: torch.nn.Linear, runtime: GTPRuntime, name: str) -> GTPShardedParam:
    """Shard a ``torch.nn.Linear``'s weight in place; its bias stays replicated.

    Example::

        runtime = GTPRuntime(groups)
        shard_linear(model.fc1, runtime, "fc1.weight")
    """
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"shard_linear expects torch.nn.Linear, got {type(module).__name__}")
    param = runtime.shard_parameter(module, "weight", name)
    module.forward = types.MethodType(_sharded_linear_forward, module)
    return param

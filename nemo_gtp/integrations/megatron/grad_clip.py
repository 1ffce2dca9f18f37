"""megatron's gradient clipping decided on the device: no host read in the optimizer step.

megatron sums the squared gradients on the device, reads the sum on the host (``.item()``),
takes the norm there and, when ``clip_grad / (norm + 1e-6) < 1``, scales every gradient by
that coefficient. On a GPU the read waits for the whole backward to finish; the device then
idles while the host issues the optimizer's kernels and the next step's first ones.
:func:`clip_grads_on_device` keeps the norm, the decision and the scale on the device:

- the sum of squares is megatron's own (its multi-tensor L2 norm, squared in fp32, all-reduced
  over the optimizer's grad-stats group, and the FSDP data-parallel group for DTensor grads);
- the norm is its square root in float64, the coefficient ``clip_grad / (norm + 1e-6)`` too
  (megatron's Python floats), and every gradient is multiplied by its fp32 rounding where it
  is below 1, by 1.0 elsewhere (a NaN norm included, which megatron does not clip either);
- megatron multiplies in fp32 by the same fp32 coefficient, so the gradients are megatron's
  bit for bit. The one difference: megatron's ``** 0.5`` is the C library's ``pow``, ours a
  correctly rounded ``sqrt``; both are within about half a float64 ulp, and the fp32 coefficient
  would see a difference only at a rounding tie.

The price is one multiply over the local gradients on the steps megatron would not clip (it
skips them). The grad norm the step returns is a 0-dim fp32 device tensor: NeMo's strategy logs
it without a copy, and the value logged is the one NeMo logs for megatron's Python float (its
fp32 rounding).

Example::

    undo = clip_grads_on_device(megatron_optimizer)  # a ChainedOptimizer, or one optimizer
    ...
    undo()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _any_device() -> torch.device:
    # a rank whose optimizer holds no gradient still joins the all-reduce
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_norm(grads: list[torch.Tensor], group: Any) -> torch.Tensor:
    """The global L2 norm of ``grads`` (float64, 0-dim, on the device): megatron's fp32 sum of
    squares as ``get_grad_norm_fp32`` computes it before its host read, all-reduced over
    ``group`` (and the FSDP group of DTensor grads), then its square root."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    fsdp_group = None
    for grad in grads:
        fsdp_group = get_data_parallel_group_if_dtensor(grad, fsdp_group)
    grads = [to_local_if_dtensor(grad) for grad in grads]
    if grads:
        overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
    else:
        norm = torch.zeros(1, dtype=torch.float, device=_any_device())
    total = norm**2.0
    if fsdp_group:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=fsdp_group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.reshape(()).double().sqrt()


def _norm(optimizer: Any) -> torch.Tensor:
    """One megatron optimizer's global grad norm (float64, on the device)."""
    grads = optimizer.get_main_grads_for_grad_norm() if optimizer.get_parameters() else []
    return global_norm(grads, optimizer.get_grad_stats_parallel_group())


def _chained_norm(chained: Any) -> torch.Tensor:
    """megatron's ``ChainedOptimizer.get_grad_norm`` on the device."""
    optimizers = chained.chained_optimizers
    if len(optimizers) == 1:
        return _norm(optimizers[0])
    if chained.grads_states_parallel_group_is_shared():
        grads = [g for opt in optimizers for g in opt.get_main_grads_for_grad_norm()]
        return global_norm(grads, chained.get_grad_stats_parallel_group())
    return torch.stack([_norm(opt) ** 2 for opt in optimizers]).sum().sqrt()


def clip_by_norm(
    params: list[torch.Tensor], max_norm: float, norm: torch.Tensor, decoupled: bool
) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` with the norm a device tensor: no host read."""
    from megatron.core.utils import to_local_if_dtensor

    grads = []
    for param in params:
        grad = getattr(param, "decoupled_grad", None) if decoupled else param.grad
        if grad is not None:
            grads.append(to_local_if_dtensor(grad).detach())
    if not grads:
        return
    coeff = max_norm / (norm + 1.0e-6)
    scale = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff)).float()
    torch._foreach_mul_(grads, scale.to(grads[0].device))


@torch.no_grad()
def chained_step(optimizer: Any) -> tuple[bool, torch.Tensor | None, Any]:
    """megatron's ``ChainedOptimizer.step`` with the norm and the clip on the device (what
    :func:`clip_grads_on_device` gives a chain as its ``step``)."""
    if optimizer.prepare_grads():  # a loss scaler's overflow (fp16): a host read of its own
        return False, None, None
    norm = _chained_norm(optimizer)
    for opt in optimizer.chained_optimizers:
        if not getattr(opt, "is_stub_optimizer", False) and opt.config.clip_grad > 0.0:
            _clip(opt, opt.config.clip_grad, norm)
    zeros = optimizer.count_zeros() if optimizer.config.log_num_zeros_in_grad else None
    return optimizer.step_with_ready_grads(), norm.float(), zeros


def _clip(optimizer: Any, max_norm: float, norm: torch.Tensor) -> None:
    """Clip one megatron optimizer's gradients by ``norm`` (its params' grads, or their
    ``decoupled_grad`` under the precision-aware optimizer, as megatron)."""
    if params := optimizer.get_parameters():
        decoupled = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", 0)
        clip_by_norm(params, max_norm, norm, bool(decoupled))


def clip_grads_on_device(optimizer: Any) -> Callable[[], None]:
    """Make a megatron optimizer clip its gradients on the device (module docstring); returns
    the function that restores megatron's own clip. A ``ChainedOptimizer`` gets its ``step``
    (megatron's, with the norm and the clip on the device), any other megatron optimizer its
    ``clip_grad_norm`` (which its ``step`` calls).

    Example: ``undo = clip_grads_on_device(nemo_optimizer.mcore_optimizer)``.
    """
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        # looked up at each call: a profiler may wrap the module's function
        optimizer.step = lambda: chained_step(optimizer)
        return lambda: _restore(optimizer, "step")
    if not isinstance(optimizer, MegatronOptimizer):
        raise TypeError(
            f"clip_grads_on_device takes a megatron-core optimizer, got {type(optimizer).__name__}"
        )

    @torch.no_grad()
    def clip_grad_norm(clip_grad: float) -> torch.Tensor:
        norm = _norm(optimizer)
        _clip(optimizer, clip_grad, norm)
        return norm.float()

    optimizer.clip_grad_norm = clip_grad_norm
    return lambda: _restore(optimizer, "clip_grad_norm")


def _restore(optimizer: Any, method: str) -> None:
    vars(optimizer).pop(method, None)  # the class's method again

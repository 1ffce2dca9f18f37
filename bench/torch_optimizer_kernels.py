"""Give megatron's optimizer torch's fused/foreach kernels where the stack has neither TE nor apex.

Without TransformerEngine or apex, megatron-core 0.15 falls back to per-tensor Python loops for
the grad norm (``local_multi_tensor_l2_norm``: one norm kernel and one device-to-host copy per
tensor), the clip scale and the fp32 -> bf16 param copy, and to unfused ``torch.optim.AdamW``.
A production NeMo stack has TE's fused kernels there. The FSDP2 baseline uses torch's fused
AdamW and foreach norms, so for an equal-work comparison every megatron mode of the benchmark
gets the same torch kernels (``bench_gpt.py --optimizer-kernels torch_fused``; ``megatron`` keeps
the fallbacks).
"""

from __future__ import annotations

import torch


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):  # noqa: ANN001, ANN202
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):  # noqa: ANN001, ANN202
    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src)
    if not (isinstance(scale, float) and scale == 1.0):
        torch._foreach_mul_(dst, scale)


def install_torch_kernels() -> None:
    """Route megatron's multi-tensor fallbacks to torch foreach kernels (process-wide)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = _scale
    if megatron_optimizer.multi_tensor_scale_impl is local_multi_tensor_scale:
        megatron_optimizer.multi_tensor_scale_impl = _scale


def fuse_adam(optimizer: object) -> int:
    """Switch every torch Adam/AdamW inside a megatron optimizer to ``fused=True``.

    Must run before the first step (the per-param step counters are created then). Returns the
    number of param groups switched.
    """
    inners = [
        getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    switched = 0
    for inner in inners:
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and not inner.state:
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched

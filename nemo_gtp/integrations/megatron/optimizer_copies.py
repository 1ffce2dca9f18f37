"""megatron's distributed-optimizer copies, planned once: the host cost per tensor of a GTP rank.

Every step megatron-core 0.15's ``DistributedOptimizer`` copies, tensor by tensor in Python, the
reduced grads of its own range into its fp32 main params' ``.grad``
(``_copy_model_grads_to_main_grads``) and, after Adam, the updated main params back into the
param buffer (``_copy_main_params_to_model_params``): per tensor a few dict lookups keyed by
the tensor, two views and one ``copy_`` launch. A DP2 rank owns half of the model's tensors; a
GTP2 rank (data-parallel size 1 over the optimizer) owns every one of its local tensors, each
half-sized — the same bytes, twice the tensors, twice the Python (design §3.2 "The optimizer's
host cost"; FSDP2's per-parameter sharding has the same property). On a host-bound small step
that is several milliseconds (``bench/results``).

:func:`plan_optimizer_copies` resolves those views once, at the first step, and replaces the
two methods on the optimizer object: grads become one attribute store per tensor (the fp32
grad-buffer views themselves, which ``.float()`` returned before), params one
``torch._foreach_copy_`` per dtype pair — the same values bit for bit (the same round-to-nearest
casts). It installs only where that is exactly what megatron would do: a
``DistributedOptimizer`` with fp32 ``main_grad`` buffers, no FP8 params, no precision-aware
optimizer, no Megatron-FSDP; anything else keeps megatron's own methods.

Example::

    optimizer = get_megatron_optimizer(config, [ddp], pg_collection=pgs)
    plan_optimizer_copies(optimizer)      # ChainedOptimizer or DistributedOptimizer
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from nemo_gtp.engine.fp8_primary import is_fp8_primary


def _is_fp8_param(param: torch.Tensor) -> bool:
    # megatron's check as its optimizer sees it now (the FP8-primary hook wraps that name in
    # the optimizer's module), and GTP's FP8 primary shards by name, whatever the install order
    return is_fp8_primary(param) or bool(distrib_optimizer.is_float8tensor(param))


def _applies(optimizer: DistributedOptimizer) -> bool:
    config, ddp_config = optimizer.config, optimizer.ddp_config
    if getattr(optimizer, "is_stub_optimizer", False) or ddp_config.use_megatron_fsdp:
        return False
    if getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return False
    for group in (*optimizer.model_float16_groups, *optimizer.model_fp32_groups):
        for param in group:
            if _is_fp8_param(param) or getattr(param, "main_grad", None) is None:
                return False
            if param.main_grad.dtype != torch.float32:
                return False
    return True


def _owned(optimizer: DistributedOptimizer, range_key: str) -> Iterator[tuple[Any, Any, Any]]:
    """(model param, its fp32 main param, the span of ``range_key`` megatron copies) for every
    tensor the optimizer owns, in megatron's order (its 16-bit groups, then its fp32 ones)."""
    for model_groups, main_groups in (
        (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
        (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
    ):
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main_param in zip(model_group, main_group):
                span = optimizer._get_model_param_range_map(model_param)[range_key]
                if span.size != main_param.nelement():
                    raise RuntimeError(
                        f"{range_key} range of size {span.size} for a main param of "
                        f"{main_param.nelement()} elements"
                    )
                yield model_param, main_param, span


def _grad_pairs(optimizer: DistributedOptimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(main param, its fp32 grad-buffer view) for every owned tensor."""
    return [
        (main_param, model_param.main_grad.view(-1)[span.start : span.end])
        for model_param, main_param, span in _owned(optimizer, "param")
    ]


def _param_copies(
    optimizer: DistributedOptimizer,
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per (buffer dtype, main dtype): the param-buffer views and the main params they take."""
    by_dtypes: dict[tuple[torch.dtype, torch.dtype], tuple[list, list]] = {}
    for model_param, main_param, span in _owned(optimizer, "gbuf_world_in_bucket"):
        gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[model_param]
        buffer = optimizer.buffers[gbuf_index].buckets[bucket_id].param_data
        view = buffer.view(-1)[span.start : span.end]
        dsts, srcs = by_dtypes.setdefault((view.dtype, main_param.dtype), ([], []))
        dsts.append(view)
        srcs.append(main_param)  # not a detached alias: .data may be reassigned
    return list(by_dtypes.values())


def _install(optimizer: DistributedOptimizer) -> None:
    # The closures see the optimizer through a weak reference: they live in its __dict__, and a
    # strong cycle through its tensors would keep the whole model alive past its last user.
    ref = weakref.ref(optimizer)
    plan: dict[str, Any] = {}

    def copy_model_grads_to_main_grads() -> None:
        pairs = plan.get("grads")
        if pairs is None:
            pairs = plan["grads"] = _grad_pairs(ref())
        for main_param, grad in pairs:
            main_param.grad = grad

    def copy_main_params_to_model_params() -> None:
        copies = plan.get("params")
        if copies is None:
            copies = plan["params"] = _param_copies(ref())
        with torch.no_grad():
            for dsts, srcs in copies:
                torch._foreach_copy_(dsts, srcs)

    optimizer._copy_model_grads_to_main_grads = copy_model_grads_to_main_grads
    optimizer._copy_main_params_to_model_params = copy_main_params_to_model_params


def plan_optimizer_copies(optimizer: Any) -> int:
    """Plan the per-tensor copies of every ``DistributedOptimizer`` in ``optimizer`` (one, or a
    ``ChainedOptimizer`` of several) where they can be exactly replaced; returns how many were.

    Example::

        assert plan_optimizer_copies(optimizer) == 1
    """
    inner: list[Any] = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    planned = 0
    for opt in inner:
        if isinstance(opt, DistributedOptimizer) and _applies(opt):
            _install(opt)
            planned += 1
    return planned


def megatron_method(optimizer: Any, name: str) -> Callable[[], None]:
    """megatron's own ``name`` method of ``optimizer`` (what a planned copy replaced), bound.

    Example::

        megatron_method(optimizer, "_copy_model_grads_to_main_grads")()
    """
    return getattr(type(optimizer), name).__get__(optimizer)

"""Per-rank bytes of weights, gradients and optimizer state, with and without GTP (design §1.7).

"Unsharded" means the same rank without the GTP cut: each GTP weight counted at its TP-local
logical shape, everything else as is (TP, and the distributed optimizer's sharding over the
replicate group, unchanged). So ``weight_bytes / unsharded_weight_bytes`` is the memory GTP saves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nemo_gtp.engine import is_gtp_param


@dataclass(frozen=True)
class MemoryFootprint:
    """Bytes held by one rank (weights, gradient buffers, optimizer state) and the GTP-off twin.

    ``unsharded_optimizer_bytes`` scales the measured optimizer state by the element ratio
    (optimizer state is per element for Adam-like optimizers).
    """

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unsharded_weight_bytes: int
    unsharded_grad_bytes: int
    unsharded_optimizer_bytes: int

    def as_metrics(self, prefix: str = "gtp/") -> dict[str, float]:
        """Flat metrics for a Lightning logger."""
        return {f"{prefix}{k}": float(v) for k, v in vars(self).items()}


def _logical_numel(param: torch.Tensor) -> int:
    if is_gtp_param(param):
        numel = 1
        for size in param.gtp_spec.logical_shape:
            numel *= size
        return numel
    return param.numel()


def _optimizer_state_bytes(optimizers: Iterable[object], model_storages: set[int]) -> int:
    """Tensor bytes in torch optimizer state plus master params that are not model storage."""
    total, seen = 0, set()
    stack = list(optimizers)
    while stack:
        opt = stack.pop()
        # NeMo's McoreDistributedOptimizer -> megatron (Chained)Optimizer -> torch optimizer.
        # A chain first: megatron's ChainedOptimizer.optimizer asserts it holds one optimizer
        # (a MoE model's dense + expert pair, shard_replicated_params_over_gtp's, Muon + Adam).
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:
            stack.extend(chained)
            continue
        for attr in ("mcore_optimizer", "optimizer"):
            inner = getattr(opt, attr, None)
            if inner is not None and inner is not opt:
                stack.append(inner)
                break
        else:
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            for state in opt.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and id(value) not in seen:
                        seen.add(id(value))
                        total += value.numel() * value.element_size()
            for group in opt.param_groups:
                for param in group["params"]:
                    ptr = param.untyped_storage().data_ptr()
                    if ptr not in model_storages and id(param) not in seen:
                        seen.add(id(param))
                        total += param.numel() * param.element_size()
    return total


def memory_footprint(
    modules: Iterable[torch.nn.Module], optimizers: Iterable[object] = ()
) -> MemoryFootprint:
    """Measure this rank's footprint.

    Example::

        fp = memory_footprint(trainer.strategy.megatron_parallel, trainer.strategy.optimizers)
        fp.weight_bytes / fp.unsharded_weight_bytes   # ~ 1 / GTP for a linear-dominated model
    """
    weights = grads = unsharded_w = unsharded_g = numel = unsharded_numel = 0
    storages: set[int] = set()
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            storages.add(param.untyped_storage().data_ptr())
            logical = _logical_numel(param)
            weights += param.numel() * param.element_size()
            unsharded_w += logical * param.element_size()
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grads += grad.numel() * grad.element_size()
                unsharded_g += logical * grad.element_size()
            if param.requires_grad:
                numel += param.numel()
                unsharded_numel += logical
    opt_bytes = _optimizer_state_bytes(optimizers, storages)
    return MemoryFootprint(
        weight_bytes=weights,
        grad_bytes=grads,
        optimizer_bytes=opt_bytes,
        unsharded_weight_bytes=unsharded_w,
        unsharded_grad_bytes=unsharded_g,
        unsharded_optimizer_bytes=(opt_bytes * unsharded_numel // numel) if numel else opt_bytes,
    )

"""``finalize_model_grads`` with the GTP axis completed (design §3.2 touch points 1 and the fence).

Order: (1) drain every runtime — the fence after which no GTP reduce-scatter is in flight and
every GTP ``main_grad`` is final; (2) megatron's own finalize (DDP reduce over the replicate
group, TP/PP all-reduces, per-token scaling over the DP x GTP data group); (3) all-reduce the
replicated params' grads over the GTP group — AVG (1/GTP pre-scale then SUM) by default, SUM
under ``calculate_per_token_loss`` (the design §3.2 table). All three are linear, so running (3)
after megatron's reduction gives the same sum, and it stays correct when DDP overlapped its
bucket reductions with the backward. With ``GTPConfig.shard_replicated_params_over_gtp`` DDP
reduces the replicated params over DP x GTP itself and (3) is skipped.

Routed experts (design §3.2 "Routed experts") mirror the dense side on their own axis: DDP's
expert buffer is reduced over the expert replicate group (EDP) in (2), and (4) the expert params
the EGTP axis leaves whole (expert biases) are all-reduced over the expert GTP group, AVG or SUM
exactly as in (3). Expert params are never part of (3): their replicas are the expert data group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from torch._C import _distributed_c10d as c10d

from nemo_gtp.engine.grid import GTPGroups
from nemo_gtp.engine.param import is_gtp_param
from nemo_gtp.engine.runtime import runtimes_of
from nemo_gtp.integrations.megatron.model_config import mirror_per_token_loss
from nemo_gtp.integrations.megatron.sharding.experts import is_expert_param


def replicated_params(
    model_chunks: Sequence[torch.nn.Module], *, experts: bool = False
) -> list[torch.nn.Parameter]:
    """Trainable params replicated across the GTP group (``experts``: the routed-expert params
    replicated across the expert GTP group), in model order.

    Example::

        params = replicated_params([ddp_model])     # once; the step reads their main_grad
    """
    found = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if (
                param.requires_grad
                and not is_gtp_param(param)
                and (
                    is_expert_param(param)
                    if experts
                    else getattr(param, "allreduce", True)  # megatron marks expert params False
                )
            ):
                found.append(param)
    return found


def allreduce_replicated_grads(
    model_chunks: Sequence[torch.nn.Module],
    group: dist.ProcessGroup,
    *,
    per_token: bool,
    experts: bool = False,
    params: Sequence[torch.nn.Parameter] | None = None,
) -> None:
    """Complete a GTP axis for replicated params: one coalesced all-reduce per dtype.

    ``experts=False``: the dense params over the GTP group; ``experts=True``: the routed-expert
    params over the expert GTP group. ``params``: :func:`replicated_params` found earlier (a
    step then never walks the model).

    The grads are reduced where they are (``main_grad`` views into DDP's buffer): one
    multi-tensor 1/GTP scale and one coalesced all-reduce of the tensor list per dtype. A
    flatten / all-reduce / unflatten round trip would copy every replicated grad twice (the
    embedding's included) and cost a copy launch per param on the host, ~100 per step for a
    24-layer GPT after the backward (design §3.1 "Host cost per weight").

    Example::

        allreduce_replicated_grads([ddp_model], groups.gtp, per_token=False)
        allreduce_replicated_grads([ddp_model], groups.expert_gtp, per_token=False, experts=True)
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    if params is None:
        params = replicated_params(model_chunks, experts=experts)
    for grads in main_grads_by_dtype(params).values():
        if not per_token:
            torch._foreach_mul_(grads, 1.0 / size)
        group.allreduce_coalesced(grads, _SUM_COALESCED).wait()


_SUM_COALESCED = c10d.AllreduceCoalescedOptions()  # SUM: the default reduce op


def main_grads_by_dtype(
    params: Sequence[torch.nn.Parameter],
) -> dict[torch.dtype, list[torch.Tensor]]:
    """The ``main_grad`` of each of ``params`` that has one, per dtype, in order (one
    collective per dtype reduces them).

    Example::

        main_grads_by_dtype(replicated_params([ddp_model]))   # {torch.float32: [...]}
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        grad = getattr(param, "main_grad", None)
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    return by_dtype


def make_finalize_model_grads(
    groups: GTPGroups,
    base: Callable[..., None] = megatron_finalize_model_grads,
) -> Callable[..., None]:
    """A ``config.finalize_model_grads_func`` that is GTP-aware (a plain ``base`` when GTP is off).

    Example::

        model.config.finalize_model_grads_func = make_finalize_model_grads(groups)
    """
    if not groups.dims.gtp_enabled:
        return base
    runtimes: list | None = None
    per_token = False
    ddp_reduces_over_gtp = False  # shard_replicated_params_over_gtp: DDP did step (3)
    dense: list = []
    experts: list = []

    def finalize_model_grads(model: Sequence[torch.nn.Module], *args, **kwargs) -> None:
        nonlocal runtimes, per_token, ddp_reduces_over_gtp, dense, experts
        if runtimes is None:  # found once: no per-step walk over the parameters
            runtimes = runtimes_of(*model)
            dense = replicated_params(model)
            experts = replicated_params(model, experts=True)
            ddp_reduces_over_gtp = any(
                rt.config.shard_replicated_params_over_gtp for rt in runtimes
            )
            model_config = getattr(model[0], "config", None)
            for runtime in runtimes:  # runtimes built without shard_model were never checked
                mirror_per_token_loss(runtime.config, model_config, owner=runtime.name)
            per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
        for runtime in runtimes:
            runtime.drain()
        base(model, *args, **kwargs)
        if not ddp_reduces_over_gtp:
            allreduce_replicated_grads(model, groups.gtp, per_token=per_token, params=dense)
        allreduce_replicated_grads(
            model, groups.expert_gtp, per_token=per_token, experts=True, params=experts
        )

    return finalize_model_grads

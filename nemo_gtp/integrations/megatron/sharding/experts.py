"""Routed experts under GTP: which params are experts, and what they need (design §1.4, §3.2).

megatron-core 0.15 keeps a MoE layer's routed experts in one container module (``SequentialMLP``:
a ``ModuleList`` of dense ``MLP`` experts; ``GroupedMLP`` / ``TEGroupedMLP``: grouped GEMMs).
Everything inside such a container is an *expert param*; everything else (attention, the router,
shared experts, dense MLPs) stays on the dense GTP axis.

Under GTP every expert param is routed to megatron DDP's expert buffer (``allreduce=False``), also
at EP 1 where megatron keeps experts in the dense buffer: its replicas are the *expert* replicate
group (EDP), which differs from the dense one (DP) whenever EGTP != GTP. Expert linears of a
``SequentialMLP`` are sharded over the EGTP axis when ``expert_num_weight_shards > ETP``; the
grouped containers are refused there (their weights are not per-expert linears).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import GTPGroups

_CONTAINERS = (SequentialMLP, GroupedMLP, TEGroupedMLP)


def expert_module_ids(model: torch.nn.Module) -> set[int]:
    """``id`` of every module inside a routed-expert container (the containers included).

    Example::

        ids = expert_module_ids(model)
        [n for n, m in model.named_modules() if id(m) in ids]  # ...mlp.experts.local_experts.0...
    """
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, _CONTAINERS):
            ids.update(id(m) for m in module.modules())
    return ids


def is_expert_param(param: torch.Tensor) -> bool:
    """True for a routed-expert param of a model prepared by ``shard_model`` under GTP."""
    return bool(getattr(param, "gtp_expert", False))


def check_moe_for_gtp(model: torch.nn.Module, groups: GTPGroups, config: GTPConfig) -> bool:
    """Refuse MoE settings GTP cannot honour (before anything is sharded); True if MoE.

    - ``expert_num_weight_shards > ETP`` needs ``SequentialMLP`` experts (megatron's local
      spec, ``moe_grouped_gemm=False``) and a model with routed experts at all;
    - ``GTPConfig.shard_replicated_params_over_gtp`` needs DDP's expert buffer for the GTP
      shards, so it cannot coexist with experts.
    """
    containers = [m for m in model.modules() if isinstance(m, _CONTAINERS)]
    egtp = groups.expert_gtp_size
    if egtp > 1 and not containers:
        raise ValueError(
            f"expert_num_weight_shards={groups.dims.expert_num_weight_shards} (expert GTP={egtp}) "
            "but the model has no routed experts (num_moe_experts unset): set "
            "expert_num_weight_shards=None (or expert_tensor_parallel_size)"
        )
    grouped = [type(m).__name__ for m in containers if not isinstance(m, SequentialMLP)]
    if egtp > 1 and grouped:
        raise ValueError(
            f"expert GTP={egtp} shards SequentialMLP experts only, the model has {grouped[0]} "
            "(grouped GEMM): set moe_grouped_gemm=False (megatron's local layer spec, or the TE "
            "spec without grouped GEMM), or expert_num_weight_shards=None"
        )
    if containers and config.shard_replicated_params_over_gtp:
        raise ValueError(
            "GTPConfig.shard_replicated_params_over_gtp=True uses megatron's expert buffer for "
            "the GTP shards, but the model has routed experts (num_moe_experts is set): set it "
            "False"
        )
    return bool(containers)


def route_expert_params(model: torch.nn.Module, expert_ids: set[int]) -> list[torch.Tensor]:
    """Tag every routed-expert param (``gtp_expert``) and route it to DDP's expert buffer.

    Returns the params tagged. Call after the expert linears were sharded (the tags must sit on
    the shards).
    """
    tagged = []
    for module in model.modules():
        if id(module) not in expert_ids:
            continue
        for param in module.parameters(recurse=False):
            param.gtp_expert = True
            param.allreduce = False  # megatron's expert tag: DDP's expert buffer (design §3.2)
            tagged.append(param)
    return tagged

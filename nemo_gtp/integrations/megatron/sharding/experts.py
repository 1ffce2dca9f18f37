"""Routed experts under GTP: which params are experts, and what they need (design §1.4, §3.2).

megatron-core 0.15 keeps a MoE layer's routed experts in one container module (``SequentialMLP``:
a ``ModuleList`` of dense ``MLP`` experts; ``TEGroupedMLP``: two TransformerEngine
``GroupedLinear``s with one weight per expert, ``weight0..N-1``; ``GroupedMLP``: the legacy
``grouped_gemm`` package, all experts in one tensor). Everything inside such a container is an
*expert param*; everything else (attention, the router, shared experts, dense MLPs) stays on the
dense GTP axis.

Under GTP every expert param is routed to megatron DDP's expert buffer (``allreduce=False``), also
at EP 1 where megatron keeps experts in the dense buffer: its replicas are the *expert* replicate
group (EDP), which differs from the dense one (DP) whenever EGTP != GTP. With
``expert_num_weight_shards > ETP`` the per-expert weights of ``SequentialMLP`` and
``TEGroupedMLP`` are sharded over the EGTP axis, on two chains of the expert runtime, one per role
(fc1, fc2), each block's experts of a role one weight group (:func:`register_expert_groups`,
design §3.4 "Grouped-expert chains"). ``GroupedMLP`` is refused there (no per-expert weights).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import GTPGroups
from nemo_gtp.engine.param import is_gtp_param
from nemo_gtp.engine.runtime import ChainId, GTPRuntime, WeightGroup

_CONTAINERS = (SequentialMLP, GroupedMLP, TEGroupedMLP)
_ROLES = {"linear_fc1": ChainId.EXPERT_FC1, "linear_fc2": ChainId.EXPERT_FC2}


def expert_chain(module_name: str) -> ChainId:
    """The expert runtime's chain of a routed-expert linear, by role (design §3.4): ``fc1``
    linears on :attr:`ChainId.EXPERT_FC1`, ``fc2`` on :attr:`ChainId.EXPERT_FC2`.

    Example::

        expert_chain("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2")  # EXPERT_FC2
    """
    return _ROLES.get(module_name.rsplit(".", 1)[-1], ChainId.UNGRAPHED)


def grouped_weight_names(module: torch.nn.Module) -> list[str]:
    """``weight0 .. weight{N-1}`` of a TransformerEngine ``GroupedLinear`` (one weight per GEMM,
    ``num_gemms`` of them; megatron's ``TEGroupedLinear`` wrappers), else ``[]``.

    Duck-typed, so it needs no TE import: any module with ``num_gemms`` and those parameters.
    """
    count = getattr(module, "num_gemms", None)
    if not isinstance(count, int) or count < 1:
        return []
    names = [f"weight{i}" for i in range(count)]
    if all(isinstance(module._parameters.get(name), torch.Tensor) for name in names):
        return names
    return []


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

    - ``expert_num_weight_shards > ETP`` needs a model with routed experts, of megatron's
      ``SequentialMLP`` or ``TEGroupedMLP`` kind (not the legacy ``GroupedMLP``);
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
    legacy = [m for m in containers if isinstance(m, GroupedMLP)]
    if egtp > 1 and legacy:
        raise ValueError(
            f"expert GTP={egtp} shards SequentialMLP and TEGroupedMLP experts, the model has "
            "megatron's legacy GroupedMLP (grouped_gemm package: the local layer spec with "
            "moe_grouped_gemm=True, or moe_use_legacy_grouped_gemm=True): use the "
            "TransformerEngine layer spec with moe_use_legacy_grouped_gemm=False, set "
            "moe_grouped_gemm=False, or expert_num_weight_shards=None"
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


def check_grouped_linear_for_gtp(name: str, module: torch.nn.Module) -> None:
    """Refuse a TE ``GroupedLinear`` whose path skips the weight protocol (before slicing).

    TE's native grouped-tensor path (``use_grouped_tensor=True``, which the deprecated
    ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=1`` selects) and its single grouped parameter
    never call ``finalize_group_grads``: the experts' gradients would silently be lost.
    """
    if getattr(module, "use_grouped_tensor", False) or getattr(
        module, "single_grouped_weight", False
    ):
        raise ValueError(
            f"{name}: TransformerEngine's grouped-tensor GroupedLinear path (use_grouped_tensor="
            "True or single_grouped_weight=True, e.g. from NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_"
            "GEMM=1 / NVTE_GROUPED_LINEAR_SINGLE_PARAM) does not finalize GTP weights' gradients: "
            "unset those environment variables (or set them 0), or expert_num_weight_shards=None"
        )


def register_expert_groups(model: torch.nn.Module, runtime: GTPRuntime) -> list[WeightGroup]:
    """Make each ``SequentialMLP`` block's local experts of one role one weight group.

    Every local expert's ``linear_fc1`` weight (and, a second group, every ``linear_fc2``) that
    ``runtime`` owns: consumed one by one (``together=False``), gathered and reduce-scattered as
    one collective, a block ahead on its role's chain (design §3.4); built as their expert GTP
    shards (``gtp_layer_spec``, design §3.1 "Exact init") or sliced by ``shard_model``,
    alike. ``TEGroupedMLP``'s
    ``GroupedLinear`` weights are grouped when ``shard_model`` slices or (built as their shards,
    design §3.1 "Exact init") registers them (``together=True``).

    Example::

        groups = register_expert_groups(model, model.gtp_expert_runtime)
        [len(g.params) for g in groups]   # local experts, for 2 roles x MoE blocks
    """

    def owned(param: object) -> bool:
        if not is_gtp_param(param):
            return False
        state = param.gtp_state
        return state.group < 0 and state.runtime is not None and state.runtime() is runtime

    made = []
    for container in model.modules():
        if not isinstance(container, SequentialMLP):
            continue
        for role in _ROLES:
            params = [
                getattr(getattr(expert, role, None), "weight", None)
                for expert in container.local_experts
            ]
            params = [p for p in params if owned(p)]
            if params:
                made.append(runtime.register_group(params, together=False))
    return made

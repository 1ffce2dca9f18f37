"""``shard_model``: make a built megatron-core model's linears GTP shards, in place (§1.5, §3.1).

The one entry point for a built model, whichever way its linears were built:

- built full (megatron-local ``ColumnParallelLinear``/``RowParallelLinear`` from the local layer
  spec, ``torch.nn.Linear``, TE wrappers from megatron's stock TE spec): sliced here, as the
  Megatron-LM's ``wrap_module_params_gtp`` does, so a GTP model starts bit-identical to its non-GTP
  twin;
- built as their shard (:mod:`~nemo_gtp.integrations.megatron.sharding.built`, selected by the
  layer spec of :mod:`~nemo_gtp.integrations.megatron.sharding.spec`): only registered with the
  model's runtime.

The embedding, the output layer, norms and biases stay replicated (their gathers would not
amortize, §1.5). TransformerEngine linears are driven by TE itself through its DistributedWeight
protocol (:mod:`~nemo_gtp.integrations.megatron.sharding.te`).

MoE (design §1.4 "EP / expert GTP"): a model gets up to two runtimes, one per weight axis: the
dense one (GTP group: attention, dense MLPs, shared experts) and the expert one (EGTP group: the
weights of the routed ``SequentialMLP`` / ``TEGroupedMLP`` experts, one chain per role and one
weight group per block and role, see :mod:`~nemo_gtp.integrations.megatron.sharding.experts`).
An axis of size 1 gets no runtime and its linears stay full.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.fp8_primary import make_fp8_primary
from nemo_gtp.engine.graph_rules import layer_graph_scope
from nemo_gtp.engine.grid import GTPGroups, WeightAxis
from nemo_gtp.engine.linear import TPComm, gtp_linear, shard_linear
from nemo_gtp.engine.param import GTPShardedParam, is_gtp_param
from nemo_gtp.engine.runtime import ChainId, GTPRuntime
from nemo_gtp.integrations.megatron.layer_graphs import (
    check_layer_graph_settings,
    install_layer_graphs,
)
from nemo_gtp.integrations.megatron.model_config import (
    fp8_primary_scaling,
    mirror_per_token_loss,
    validate_model_config_for_gtp,
)
from nemo_gtp.integrations.megatron.sharding.built import is_presharded, refuse_fp8_primary_experts
from nemo_gtp.integrations.megatron.sharding.experts import (
    check_grouped_linear_for_gtp,
    check_moe_for_gtp,
    expert_chain,
    expert_module_ids,
    grouped_weight_names,
    register_expert_groups,
    route_expert_params,
)
from nemo_gtp.integrations.megatron.sharding.te import (
    adopt_te_linear,
    set_te_activation_dtype,
    te_grouped_linear_kinds,
    te_parallel_linear_kinds,
    warn_unsharded_te_modules,
)
from nemo_gtp.integrations.megatron.sharding.te_fp8 import install_te_fp8_gather
from nemo_gtp.integrations.te_fp8_backward import install_te_weight_quantize

_MEGATRON_LINEARS = (ColumnParallelLinear, RowParallelLinear)


def is_peft_adapter_module(name: str) -> bool:
    """True for a module inside a PEFT adapter: NeMo's ``AdapterWrapper`` (``LoRALinear``,
    ``DoRALinear``, canonical LoRA) holds the wrapped linear as ``to_wrap`` and the adapter's
    own low-rank linears under ``adapter`` (``adapter_q`` ... for canonical LoRA)."""
    return any(part == "adapter" or part.startswith("adapter_") for part in name.split("."))


def default_should_shard(name: str, module: torch.nn.Module) -> bool:
    """Shard megatron-local, TE parallel and torch linears and TE ``GroupedLinear``s (routed
    experts, all ``weight0..N-1`` together), except the output layer and tied weights.

    Frozen linears are sharded too (design §1.1 "Frozen weights"): a PEFT run's frozen base
    model is where its memory is; such a shard gathers for the forward and the dgrad and
    reduces no wgrad. A PEFT adapter's own linears stay replicated: rank-r matrices, whose
    gathers would cost more than they save.
    """
    if is_peft_adapter_module(name):
        return False
    grouped = grouped_weight_names(module)
    if grouped:
        return not is_gtp_param(module._parameters[grouped[0]])
    if not isinstance(module, (*_MEGATRON_LINEARS, torch.nn.Linear, *te_parallel_linear_kinds())):
        return False
    weight = getattr(module, "weight", None)
    if weight is None or is_gtp_param(weight):
        return False
    if name.split(".")[-1] == "output_layer" or getattr(weight, "shared_embedding", False):
        return False
    return True


def _gtp_forward_impl(
    self: torch.nn.Module,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer: object = None,
    tp_group: object = None,
    **unused: object,
) -> torch.Tensor:
    """Stands in for megatron's ``linear_with_grad_accumulation_and_async_allreduce``."""
    if not isinstance(weight, GTPShardedParam):  # a weight passed explicitly at call time
        return type(self)._forward_impl(
            self,
            input,
            weight,
            bias,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            tp_group=tp_group,
            **unused,
        )
    if grad_output_buffer is not None:
        raise NotImplementedError("defer_embedding_wgrad_compute is not supported for GTP weights")
    group = tp_group if tp_group is not None else self.tp_group
    return gtp_linear(input, weight, bias, TPComm(group, allreduce_dgrad, sequence_parallel))


def shard_model(
    model: torch.nn.Module,
    groups: GTPGroups,
    config: GTPConfig | None = None,
    *,
    should_shard: Callable[[str, torch.nn.Module], bool] = default_should_shard,
) -> GTPRuntime | None:
    """Shard ``model``'s eligible linears in place; return its (primary) runtime.

    Call after the model is built and before DDP wraps it. Dense linears are sharded over
    ``groups.gtp``; the weights of routed MoE experts (each linear of megatron's
    ``SequentialMLP`` experts and each ``weight{i}`` of ``TEGroupedMLP``'s TE ``GroupedLinear``s,
    sliced here or built as their shards by a ``gtp_layer_spec``, design §3.1 "Exact expert
    init") over ``groups.expert_gtp``
    by a second runtime, on one chain per role with a block's experts of a role one weight group
    (design §1.4, §3.4). The model holds them as
    ``model.gtp_runtime`` (dense) and ``model.gtp_expert_runtime`` (experts); an axis of size 1
    gets none. Returned: the dense runtime, or the expert one when only experts are sharded;
    ``runtimes_of(model)`` lists both. With GTP and expert GTP both 1 nothing is touched and
    ``None`` is returned (off is a byte-for-byte no-op, §1.5).

    Params replicated across a GTP group are marked ``shared`` on its ranks other than 0:
    megatron's grad-norm filter then counts them once (design §3.2 point 2; expert params by
    their EGTP rank). Under GTP every routed-expert param goes to DDP's expert buffer
    (``allreduce=False``, design §3.2 "Routed experts").

    Example::

        groups = initialize_gtp_parallel(dims)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size, max_seq)
        runtime = shard_model(model, groups)
        ddp = GTPDistributedDataParallel(config, ddp_config, model,
                                         pg_collection=gtp_process_groups(groups))

    TE layer spec, built as shards (``config`` the same in both calls)::

        spec = gtp_layer_spec(get_gpt_layer_with_transformer_engine_spec(), groups, config)
        model = GPTModel(model_config, spec, vocab_size, max_seq)
        runtime = shard_model(model, groups, config)

    A model config asking for megatron's per-layer CUDA graphs (``cuda_graph_impl="local"``,
    scope ``"full"`` or ``"attn"``) gets one graph segment per captured layer and the GTP graph
    boundary on each (:func:`~nemo_gtp.integrations.megatron.layer_graphs.install_layer_graphs`,
    design §3.5); ``gather_backend="auto"`` then means the process group.

    A model config with megatron's ``fp8_param`` (``fp8_recipe`` "tensorwise" or "blockwise") gets
    FP8 primary shards: after every check, the dense runtime's shards are made FP8 with the full
    weights' scales (``make_fp8_primary``, one all-reduce over GTP), and TE linears get them as
    ``Float8Tensor``s (design §1.3 "FP8 primary weights"); DDP must then be built with
    ``grad_reduce_in_fp32=True`` and the distributed optimizer.

    Raises ``ValueError`` for settings GTP cannot honour (megatron's legacy ``GroupedMLP`` under
    expert GTP, ``delay_wgrad_compute``, a ``calculate_per_token_loss`` mismatch, weights built as
    shards for other groups than ``groups``, per-layer graphs with routed experts or fewer than 2
    warmup steps, ``fp8_param`` with a recipe other than ``"tensorwise"`` / ``"blockwise"``, with
    routed experts under expert GTP or with TE linears to slice, ...) and warns once naming TE
    ``LayerNormMLP``s, which stay unsharded.
    """
    if hasattr(model, "param_to_bucket_group") or isinstance(
        model, torch.nn.parallel.DistributedDataParallel
    ):
        raise ValueError("shard_model must run before DDP wrapping (pass the unwrapped model)")
    if not groups.dims.gtp_enabled:
        return None
    model_config = getattr(model, "config", None)
    config = mirror_per_token_loss(config, model_config)
    validate_model_config_for_gtp(model_config)
    is_moe = check_moe_for_gtp(model, groups, config)
    # megatron's fp8_param: the shards become FP8 primary weights (design §1.3)
    fp8_primary = fp8_primary_scaling(model_config)
    if fp8_primary is not None and is_moe and groups.expert_gtp_size > 1:
        refuse_fp8_primary_experts(model_config)
    graph_scope = layer_graph_scope(model_config)
    if graph_scope is not None:  # megatron's per-layer CUDA graphs (design §3.5)
        config = check_layer_graph_settings(model_config, config, moe=is_moe)
    expert_ids = expert_module_ids(model) if is_moe else set()
    name = type(model).__name__
    runtimes = {
        WeightAxis.DENSE: GTPRuntime(groups, config, name=name) if groups.gtp_size > 1 else None,
        WeightAxis.EXPERT: (
            GTPRuntime(groups, config, name=f"{name}.experts", axis=WeightAxis.EXPERT)
            if groups.expert_gtp_size > 1
            else None
        ),
    }
    te_linears = tuple(te_parallel_linear_kinds())
    te_grouped = tuple(te_grouped_linear_kinds())
    sliced_te: list[str] = []
    te_runtimes: dict[int, GTPRuntime] = {}
    te_quantize_runtimes: dict[int, GTPRuntime] = {}  # dense and grouped TE linears
    for module_name, module in list(model.named_modules()):
        expert = id(module) in expert_ids
        runtime = runtimes[WeightAxis.EXPERT if expert else WeightAxis.DENSE]
        if runtime is None:  # this axis does not shard: the linear stays full
            continue
        # Routed experts run on one chain per role (fc1, fc2), design §3.4.
        chain = expert_chain(module_name) if expert else ChainId.UNGRAPHED
        weight = module._parameters.get("weight")
        grouped = grouped_weight_names(module)
        if grouped and (
            is_presharded(module._parameters[grouped[0]]) or should_shard(module_name, module)
        ):
            # TE GroupedLinear: every expert's weight (built as its shard, or sliced now), one
            # weight group that TE materializes through weight0 (design §3.4 "Grouped-expert
            # chains").
            check_grouped_linear_for_gtp(module_name, module)
            params = []
            for attr in grouped:
                param = module._parameters[attr]
                if is_presharded(param):
                    runtime.register(param, f"{module_name}.{attr}", chain)
                else:
                    param = runtime.shard_parameter(module, attr, f"{module_name}.{attr}", chain)
                    sliced_te += [module_name] if isinstance(module, te_grouped) else []
                params.append(param)
            runtime.register_group(params, together=True)
            adopt_te_linear(module)
            te_quantize_runtimes[id(runtime)] = runtime
            continue
        if is_presharded(weight):  # built as its shard from a gtp_layer_spec: register only
            runtime.register(weight, f"{module_name}.weight", chain)
        elif should_shard(module_name, module):
            if type(weight.data) is not torch.Tensor:  # TE's FP8 param init built it
                raise ValueError(
                    f"{module_name}: its weight was built as a {type(weight.data).__name__} "
                    "(TransformerEngine's FP8 param init, megatron's fp8_param) and GTP slices "
                    "plain weights only: build the TE linears as their GTP shard "
                    "(GTPConfig.preshard_linears='te', the default, or gtp_layer_spec), or set "
                    "fp8_param=False"
                )
            if isinstance(module, (*_MEGATRON_LINEARS, *te_linears)):
                runtime.shard_parameter(module, "weight", f"{module_name}.weight", chain)
                sliced_te += [module_name] if isinstance(module, te_linears) else []
            else:
                shard_linear(module, runtime, f"{module_name}.weight")
        else:
            continue
        if isinstance(module, _MEGATRON_LINEARS):
            module._forward_impl = types.MethodType(_gtp_forward_impl, module)
        elif isinstance(module, te_linears):
            adopt_te_linear(module)  # TE drives the weight through the protocol
            te_runtimes[id(runtime)] = te_quantize_runtimes[id(runtime)] = runtime
    if config.fp8_gather or fp8_primary is not None:
        # TE's FP8 GEMMs get FP8 gathers (design §1.3 "FP8 gather"); FP8 primary shards are FP8
        # whatever fp8_gather says
        for runtime in te_runtimes.values():
            install_te_fp8_gather(runtime)
    for runtime in te_quantize_runtimes.values():  # design §1.3 "Consumer-quantized backward"
        install_te_weight_quantize(runtime)
    if sliced_te and config.preshard_linears != "none":  # "none" slices them on purpose
        sliced_te = list(dict.fromkeys(sliced_te))  # a grouped linear once, not per expert
        warnings.warn(
            f"shard_model sliced {len(sliced_te)} TransformerEngine linear(s) that were built "
            f"full (e.g. {sliced_te[0]}): pass the layer spec through gtp_layer_spec(spec, "
            "groups, config) to build them as shards without materializing full weights",
            stacklevel=2,
        )
    warn_unsharded_te_modules(model)
    _check_all_registered(model)
    if runtimes[WeightAxis.EXPERT] is not None:  # SequentialMLP: a block's role, one group
        register_expert_groups(model, runtimes[WeightAxis.EXPERT])
    experts = {id(p) for p in route_expert_params(model, expert_ids)}
    _mark_shared(model, groups, config, experts)
    if fp8_primary is not None and runtimes[WeightAxis.DENSE] is not None:
        # The one collective here, after every check: the shards become FP8 (design §1.3 "FP8
        # primary weights")
        make_fp8_primary(runtimes[WeightAxis.DENSE], fp8_primary)
        for module in model.modules():
            weight = module._parameters.get("weight")
            if isinstance(module, te_linears) and isinstance(weight, GTPShardedParam):
                set_te_activation_dtype(module, weight.gtp_state.fp8_primary_dtype)
    model.gtp_runtime = runtimes[WeightAxis.DENSE]
    model.gtp_expert_runtime = runtimes[WeightAxis.EXPERT]
    if graph_scope is not None and runtimes[WeightAxis.DENSE] is not None:
        install_layer_graphs(model, runtimes[WeightAxis.DENSE])
    return runtimes[WeightAxis.DENSE] or runtimes[WeightAxis.EXPERT]


def _check_all_registered(model: torch.nn.Module) -> None:
    """Refuse weights built as shards that no runtime took (a layer spec rewritten for other
    groups than ``shard_model``'s: they would never be gathered)."""
    left = [name for name, param in model.named_parameters() if is_presharded(param)]
    if left:
        raise ValueError(
            f"{len(left)} weight(s) were built as GTP shards but no runtime of shard_model owns "
            f"them (e.g. {left[0]}): pass the same GTPGroups (and GTPConfig) to gtp_layer_spec "
            "and shard_model"
        )


def _mark_shared(
    model: torch.nn.Module, groups: GTPGroups, config: GTPConfig, experts: set[int]
) -> None:
    """megatron's ``shared`` mark on params replicated across a GTP axis, on its ranks != 0.

    Each replicated element is then counted once in the world-wide grad norm (design §3.2
    point 2): dense params by their GTP rank, routed-expert params by their EGTP rank (they are
    replicated over EGTP, never over the dense GTP axis, whose peers hold other expert replicas
    or other experts). With ``shard_replicated_params_over_gtp`` each GTP peer owns a distinct
    optimizer slice of the dense replicated params, so they are not marked.
    """
    dense = groups.gtp_rank != 0 and not config.shard_replicated_params_over_gtp
    expert = groups.expert_gtp_rank != 0
    for param in model.parameters():
        if not is_gtp_param(param) and (expert if id(param) in experts else dense):
            param.shared = True

"""TransformerEngine's weight-protocol callers, for CPU tests where TE cannot run.

TE (>= 2.19) drives a custom-parallel weight through four calls, list-shaped, on the leader
``weights[0]`` of a weight group (a ``Linear`` has one weight, a ``GroupedLinear`` one per
expert): ``materialize_group_for_forward()`` before the forward GEMMs,
``materialize_group_for_backward()`` before the dgrad GEMMs, ``finalize_group_grads(wgrads)``
after the wgrad GEMMs (one wgrad per member; it returns what autograd gets as the weights'
grads), and, under ``fuse_wgrad_accumulation``, every member's ``grad_buffer()`` as the wgrad
GEMM's output. This module mirrors that contract from TE's documentation and its
``GroupedLinear`` autograd function (design §3.1 "The bridge", §3.4 "Grouped-expert chains"):

- :func:`materialize_weight_for_forward` / :func:`materialize_weight_for_backward` /
  :func:`finalize_weight_grads`: TE's dispatchers (a plain tensor passes through);
- :class:`CPUGroupedLinear`: a stand-in for megatron's ``TEGroupedLinear`` (constructor
  signature of megatron's ``TEColumnParallelGroupedLinear``, parameters ``weight0..N-1``,
  ``forward(x, m_splits) -> (out, None)``), so megatron's own ``TEGroupedMLP`` can be built on
  CPU around it and sharded by ``shard_model``. Its autograd function makes the protocol calls
  in TE's order: ``grad_buffer()`` of every member (fused path) before the backward
  materialize; wgrads overwritten, not accumulated, for distributed weights; the returned
  grads must be one per weight. :class:`CPUColumnParallelGroupedLinear` (fc1) and
  :class:`CPURowParallelGroupedLinear` (fc2) mirror megatron's two wrappers down to their
  distributed-checkpoint entries: per expert a ``weight`` (and ``_extra_state``) keyed like
  ``SequentialMLP``'s, with the global expert index as a prepended axis, the expert TP axis
  (0 for fc1, 1 for fc2) and the expert data-parallel replica id, so a checkpoint of the
  stand-in has the layout megatron's ``TEGroupedMLP`` writes.

Example::

    submodules = MLPSubmodules(
        linear_fc1=CPUColumnParallelGroupedLinear, linear_fc2=CPURowParallelGroupedLinear
    )
    experts = TEGroupedMLP(num_local_experts, config, submodules, pg_collection=pgs)
"""

from __future__ import annotations

from typing import Any

import torch


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _distributed(weight: object) -> bool:
    return bool(getattr(weight, "is_distributed_weight", False))


def materialize_weight_for_forward(weights: list) -> list:
    """TE's forward dispatcher: the leader materializes its whole group."""
    if not _distributed(weights[0]):
        return list(weights)
    return _as_list(weights[0].materialize_group_for_forward())


def materialize_weight_for_backward(weights: list) -> list:
    """TE's backward dispatcher (same contract as the forward one)."""
    if not _distributed(weights[0]):
        return list(weights)
    return _as_list(weights[0].materialize_group_for_backward())


def finalize_weight_grads(weights: list, wgrads: list) -> list:
    """TE's wgrad dispatcher: one wgrad is passed bare, several as a list."""
    if not _distributed(weights[0]):
        return list(wgrads)
    single = wgrads[0] if len(wgrads) == 1 else wgrads
    return _as_list(weights[0].finalize_group_grads(single))


class _GroupedLinearFunction(torch.autograd.Function):
    """TE ``_GroupedLinear`` (the split-GEMM path, no FP8) reduced to what the protocol sees."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx: Any, inp: torch.Tensor, m_splits: list[int], fuse: bool, *weights: torch.Tensor
    ):
        origin = weights
        dist_weight = _distributed(weights[0])
        if dist_weight:
            weights = tuple(materialize_weight_for_forward(list(weights)))
            if len(weights) != len(origin):
                raise AssertionError(f"leader returned {len(weights)} of {len(origin)} weights")
        out = torch.cat([x @ w.t() for x, w in zip(torch.split(inp, m_splits), weights)])
        # TE keeps the (distributed) origin weights for the backward, never the gathered ones.
        ctx.save_for_backward(inp, *origin)
        ctx.m_splits, ctx.dist_weight = m_splits, dist_weight
        ctx.fuse = fuse and dist_weight
        if ctx.fuse:
            ctx.main_grad_funcs = [w.grad_buffer for w in origin]
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # noqa: ANN205
        inp, *origin = ctx.saved_tensors
        main_grads = [f() for f in ctx.main_grad_funcs] if ctx.fuse else None
        weights = materialize_weight_for_backward(origin) if ctx.dist_weight else origin
        dys, xs = torch.split(dy, ctx.m_splits), torch.split(inp, ctx.m_splits)
        dgrad = torch.cat([d @ w for d, w in zip(dys, weights)])
        if ctx.fuse:
            wgrads = main_grads
        else:
            packed = torch.empty(len(origin), *weights[0].shape, dtype=dy.dtype, device=dy.device)
            wgrads = [packed[i] for i in range(len(origin))]
        for wgrad, d, x in zip(wgrads, dys, xs):
            torch.matmul(d.t(), x, out=wgrad)  # accumulate=False for distributed weights
        if ctx.dist_weight:
            wgrads = finalize_weight_grads(origin, wgrads)
        if len(wgrads) != len(origin):  # autograd needs one grad per weight input
            raise AssertionError(f"finalize returned {len(wgrads)} grads for {len(origin)}")
        return dgrad, None, None, *wgrads


class CPUGroupedLinear(torch.nn.Module):
    """CPU stand-in for megatron's ``TEGroupedLinear`` (see the module docstring).

    ``fuse_wgrad_accumulation`` is on for the ``fc1`` instance and off for ``fc2``, so one
    ``TEGroupedMLP`` exercises both of TE's wgrad paths (``grad_buffer()`` vs a packed wgrad).
    Weights are allocated first, then initialized one after another with ``init_method``, as
    TE's ``reset_parameters`` does.
    """

    column: bool = True
    """Expert TP splits ``output_size`` (megatron's column-parallel wrapper), else the input."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        if bias:
            raise NotImplementedError("CPUGroupedLinear has no bias (add_bias_linear=False)")
        tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        if self.column:  # megatron's wrapper divides what expert TP splits
            output_size //= tp
        else:
            input_size //= tp
        self.num_gemms = num_gemms
        self.out_features = output_size
        self.fuse_wgrad_accumulation = tp_comm_buffer_name == "fc1"
        for i in range(num_gemms):
            weight = torch.empty(output_size, input_size, dtype=config.params_dtype)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))
        if config.perform_initialization:
            for i in range(num_gemms):
                init_method(getattr(self, f"weight{i}").data)
        for param in self.parameters():  # megatron's tag: EP > 1 experts go to DDP's expert buffer
            param.allreduce = not (is_expert and config.expert_model_parallel_size > 1)
        self._register_load_state_dict_pre_hook(_drop_split_extra_states, with_module=True)

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        """``y_i = x_i W_i^T`` per expert split, as TE's ``GroupedLinear``."""
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        splits = [int(m) for m in m_splits]
        return _GroupedLinearFunction.apply(x, splits, self.fuse_wgrad_accumulation, *weights), None

    def get_extra_state(self) -> torch.Tensor:
        """TE's extra state without FP8: an empty byte tensor."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore without FP8."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron's grouped-linear checkpoint entries (see the module docstring)."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("CPUGroupedLinear: singleton_local_shards")
        state = self.state_dict(prefix="", keep_vars=True)
        total = parallel_state.get_expert_model_parallel_world_size() * self.num_gemms
        first = parallel_state.get_expert_model_parallel_rank() * self.num_gemms
        axis = len(sharded_offsets)
        out = {}
        for i in range(self.num_gemms):
            entries = {
                f"{i}.weight": state[f"weight{i}"],
                f"{i}._extra_state": state["_extra_state"],
            }
            offsets = (*sharded_offsets, (axis, first + i, total))
            sub = make_sharded_tensors_for_checkpoint(
                entries, "", {f"{i}.weight": 0 if self.column else 1}, offsets
            )
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{i if i else ''}"] = sub[f"{i}._extra_state"]
        replica = parallel_state.get_expert_data_parallel_rank()
        for entry in out.values():  # replicas along expert DP (megatron's id is (PP, TP, DP))
            entry.replica_id = (*entry.replica_id[:2], replica)
        return out


def _drop_split_extra_states(
    module: CPUGroupedLinear, state_dict: dict, prefix: str, *_: Any
) -> None:
    # A dist-checkpoint load hands back one extra state per expert (_extra_state1..N-1); TE's
    # megatron wrapper merges them into _extra_state, which without FP8 holds nothing.
    for i in range(1, module.num_gemms):
        state_dict.pop(f"{prefix}_extra_state{i}", None)


class CPUColumnParallelGroupedLinear(CPUGroupedLinear):
    """Stand-in for megatron's ``TEColumnParallelGroupedLinear`` (``TEGroupedMLP``'s fc1)."""

    column = True


class CPURowParallelGroupedLinear(CPUGroupedLinear):
    """Stand-in for megatron's ``TERowParallelGroupedLinear`` (``TEGroupedMLP``'s fc2)."""

    column = False


def with_grouped_experts(spec: Any, kinds: dict[type, bool] | None = None) -> Any:
    """A copy of a MoE GPT layer ``spec`` whose routed experts are megatron's ``TEGroupedMLP``
    around ``kinds``' fc1 / fc2 classes (class -> "expert TP splits out_features"; default the
    CPU stand-ins, :func:`grouped_kinds`).

    Example::

        spec = with_grouped_experts(get_gpt_layer_local_spec(num_experts=4))
    """
    import copy

    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    fc1, fc2 = sorted((kinds or grouped_kinds()).items(), key=lambda kv: not kv[1])
    spec = copy.deepcopy(spec)
    spec.submodules.mlp.submodules.experts = ModuleSpec(
        module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=fc1[0], linear_fc2=fc2[0])
    )
    return spec


def grouped_local_layer_spec(config: Any) -> Any:
    """NeMo's ``transformer_layer_spec`` for a MoE GPT on CPU with ``TEGroupedMLP`` experts of
    the stand-ins: megatron's local spec (a function of the config, as NeMo's own specs are, so
    the strategy's pre-sharding rewrites its result) with :func:`with_grouped_experts`.

    Example::

        config = llm.GPTConfig(num_moe_experts=4, transformer_layer_spec=grouped_local_layer_spec)
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_grouped_experts(
        get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    )


def grouped_kinds() -> dict[type, bool]:
    """The stand-ins as ``gtp_layer_spec(..., grouped_kinds=...)`` takes them (class ->
    "expert TP splits out_features"), in place of TE's wrappers."""
    return {CPUColumnParallelGroupedLinear: True, CPURowParallelGroupedLinear: False}

"""Linears built directly as their GTP shard: design §3.1 "One init path", §1.5.

A megatron linear class (TE wrapper or megatron-local) is subclassed so that its constructor is
handed a pre-sharded ``output_size``: the base class then allocates only this rank's
``padded_dim0 / GTP`` rows (the exact init draws one linear's full weight into a scratch at a
time, below), so the model's full weights never exist together. The built weight becomes an
(unregistered) :class:`GTPShardedParam` whose :class:`ShardSpec` (made by the layer's
:class:`GTPShardPlan`) describes the full padded TP-local weight;
:func:`~nemo_gtp.integrations.megatron.sharding.sliced.shard_model` later registers it with the
model's runtime, exactly as it registers the weights it slices itself. The layer spec that
selects these classes is :mod:`~nemo_gtp.integrations.megatron.sharding.spec`.

Every shard is initialized exactly as the unsharded model initializes its rows
(:func:`rows_of_full_init`, design §3.1 "Exact init"), so a run built pre-sharded starts from the
numbers of the run without GTP. Routed experts are built the same way over the expert GTP axis:
``SequentialMLP``'s expert linears by the expert subclasses of :class:`PreShardedLinearMixin`
(``presharded_class(base, column, expert=True)``), ``TEGroupedMLP``'s (a TE ``GroupedLinear``,
one weight per local expert) by :class:`PreShardedGroupedLinearMixin`
(:func:`presharded_grouped_class`).

Subclasses are made on demand by :func:`presharded_class`, so this module needs neither TE nor a
CUDA device; the TE classes are created only when ``transformer_engine`` is importable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nemo_gtp.engine.grid import GTPGroups
from nemo_gtp.engine.param import GTPShardedParam, ShardSpec, carry_param_attributes
from nemo_gtp.integrations.megatron.model_config import validate_model_config_for_gtp
from nemo_gtp.integrations.megatron.sharding.te import plain_weight_init


@dataclass(frozen=True)
class GTPShardPlan:
    """How this rank cuts every weight it builds: its GTP coordinates and padding rule (§1.3).

    A :class:`ShardSpec` without the shape: it travels through the layer spec's params (the
    shapes are known only inside each linear's constructor), where :meth:`spec_for` turns it
    into the weight's spec.

    Example::

        plan = GTPShardPlan.from_groups(groups, pad_for_alignment=16)
        plan.spec_for((72, 64))     # ShardSpec(logical_shape=(72, 64), ..., padded_dim0=96)
    """

    gtp_size: int
    gtp_rank: int
    pad_for_alignment: int = 16

    @classmethod
    def from_groups(cls, groups: GTPGroups, pad_for_alignment: int = 16) -> GTPShardPlan:
        """The plan for this rank of ``groups`` (size and rank from the groups' dims)."""
        return cls(groups.gtp_size, groups.gtp_rank, pad_for_alignment)

    @classmethod
    def for_experts(cls, groups: GTPGroups, pad_for_alignment: int = 16) -> GTPShardPlan:
        """The plan of this rank's routed-expert weights: the expert GTP axis (design §1.4)."""
        return cls(groups.expert_gtp_size, groups.expert_gtp_rank, pad_for_alignment)

    def spec_for(self, shape: tuple[int, ...] | torch.Size) -> ShardSpec:
        """This rank's :class:`ShardSpec` of a TP-local weight of ``shape``."""
        return ShardSpec.for_weight(shape, self.gtp_size, self.gtp_rank, self.pad_for_alignment)


def rows_of_full_init(init_method: Callable[[torch.Tensor], Any], spec: ShardSpec) -> Callable:
    """``init_method`` giving a shard exactly its rows of the unsharded weight (design §3.1
    "Exact init").

    Called on this rank's shard, it initializes a scratch of the full TP-local weight
    (``spec.logical_shape``, the shard's dtype and device) with ``init_method`` — the same call,
    shape and RNG stream as the unsharded model's, so the same numbers and the same stream
    position afterwards — keeps this rank's rows, zeroes the pad rows and drops the scratch. A
    module initializing its weights one after another (TE's ``GroupedLinear``: one per expert;
    ``SequentialMLP``: one linear after another) thus holds one full weight at a time, never all
    of them. A meta shard is left as it is.

    megatron's CPU initialization (``use_cpu_initialization=True``) calls ``init_method`` on a
    *master* weight instead: the layer's TP-global weight, which it then splits over TP. Built
    pre-sharded, that master is every TP rank's shard stacked (``TP x shard_dim0`` rows for a
    column-parallel layer, ``shard_dim0`` rows by the TP-global input width for a row-parallel
    one), so the scratch is the unsharded master (``blocks`` TP-local weights of
    ``spec.logical_shape[0]`` rows, the full input width) and each block of the pre-sharded
    master gets this rank's rows of the unsharded block: megatron's split then hands every TP
    rank exactly its shard. (megatron's ``stride > 1`` interleaving is refused by the caller.)

    Example::

        spec = GTPShardPlan.for_experts(groups, 16).spec_for((48, 32))
        init = rows_of_full_init(config.init_method, spec)
        init(torch.empty(spec.shard_shape))   # the rows init_method gives the full weight
    """

    @functools.wraps(init_method)
    def init(shard: torch.Tensor) -> Any:
        if shard.device.type == "meta":
            return None
        rows = spec.shard_dim0
        blocks = shard.shape[0] // rows
        if shard.dim() != 2 or blocks < 1 or blocks * rows != shard.shape[0]:
            raise ValueError(
                f"rows_of_full_init: asked to initialize a {tuple(shard.shape)} tensor, expected "
                f"a multiple of the shard's {rows} rows (shard shape {spec.shard_shape})"
            )
        logical = spec.logical_shape[0]
        full = torch.empty(
            (blocks * logical, shard.shape[1]), dtype=shard.dtype, device=shard.device
        )
        result = init_method(full)
        start = spec.gtp_rank * rows
        with torch.no_grad():
            for block in range(blocks):
                mine = full[block * logical : (block + 1) * logical][start : start + rows]
                out = shard[block * rows : (block + 1) * rows]
                out[: mine.shape[0]].copy_(mine)
                out[mine.shape[0] :].zero_()
        return result

    return init


class PreShardedLinearMixin:
    """Builds a megatron linear as this rank's GTP shard (mix in before the linear class).

    The base class must take ``(input_size, output_size, *, config, init_method, ...)`` and give
    its weight ``output_size / TP`` rows (column-parallel) or ``output_size`` rows
    (row-parallel), as megatron's TE wrappers and local linears do. ``gtp`` (a
    :class:`GTPShardPlan`) arrives through the layer spec's params (see
    :func:`~nemo_gtp.integrations.megatron.sharding.spec.gtp_layer_spec`). With GTP size 1 the class
    builds exactly what its base builds.

    Every shard gets exactly the unsharded model's rows (:func:`rows_of_full_init`, design §3.1
    "Exact init"). A routed expert's linear reaching a dense class (``is_expert=True``) is
    built full, for ``shard_model`` to slice. The expert classes (``gtp_expert=True``, for
    ``SequentialMLP``'s experts, with the *expert* plan :meth:`GTPShardPlan.for_experts`) build
    each expert linear over the expert GTP axis.
    """

    gtp_column: bool = True
    """True when TP splits ``output_size`` (column-parallel); False when it splits the input."""
    gtp_expert: bool = False
    """True: a routed expert's linear (``is_expert=True``), sharded over expert GTP, exact init."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *args: Any,
        gtp: GTPShardPlan,
        config: Any,
        init_method: Callable,
        **kwargs: Any,
    ) -> None:
        expert = bool(kwargs.get("is_expert"))
        if self.gtp_expert and not expert:
            raise ValueError(
                f"{type(self).__name__} builds a routed expert's linear over expert GTP, but was "
                "built with is_expert=False: swap it only inside SequentialMLP's submodules "
                "(gtp_layer_spec does), or set GTPConfig.preshard_linears='none'"
            )
        # Off is a byte-for-byte no-op (design §1.5). A routed-expert linear reaching a dense
        # class is built full: it belongs to the expert GTP axis, which shard_model slices (§1.4).
        if gtp.gtp_size == 1 or expert != self.gtp_expert:
            super().__init__(
                input_size, output_size, *args, config=config, init_method=init_method, **kwargs
            )
            return
        validate_model_config_for_gtp(config)
        if expert:
            refuse_fp8_primary_experts(config, type(self).__name__)
        if kwargs.get("stride", 1) != 1:
            raise ValueError(
                f"{type(self).__name__}: stride={kwargs['stride']} interleaves the TP split, which "
                "the exact init does not follow: set GTPConfig.preshard_linears='none' "
                "(built full, then sliced)"
            )
        tp = _tp_size(kwargs.get("tp_group"), expert=expert)
        logical_out = output_size // tp if self.gtp_column else output_size
        in_local = input_size if self.gtp_column else input_size // tp
        spec = gtp.spec_for((logical_out, in_local))
        built_out = spec.shard_dim0 * tp if self.gtp_column else spec.shard_dim0
        init = rows_of_full_init(init_method, spec)
        # Under megatron's fp8_param the weight stays plain: shard_model makes it a GTP FP8
        # primary shard (design §1.3 "FP8 primary weights"), not TE's Float8Tensor.
        with plain_weight_init():
            super().__init__(
                input_size, built_out, *args, config=config, init_method=init, **kwargs
            )
        attach_presharded_weight(self, spec)
        # The module computes logical-width outputs (the GEMM sees the gathered weight).
        for attr, value in (
            ("output_size", output_size),
            ("out_features", logical_out),
            ("output_size_per_partition", logical_out),
        ):
            if hasattr(self, attr):
                setattr(self, attr, value)


def refuse_fp8_primary_experts(config: Any, where: str = "") -> None:
    """FP8 primary weights (megatron's ``fp8_param``) are not supported for routed experts
    sharded over expert GTP (``make_fp8_primary`` does not take weight groups): raised before
    any weight is built, naming the settings (design §1.3 "FP8 primary weights").

    Example::

        refuse_fp8_primary_experts(TransformerConfig(..., fp8="hybrid", fp8_param=True))  # raises
    """
    if getattr(config, "fp8_param", False) and getattr(config, "fp8", None) is not None:
        of = f" ({where})" if where else ""
        raise ValueError(
            f"TransformerConfig.fp8_param=True (FP8 primary weights) is not supported for routed "
            f"experts sharded over expert GTP{of}: set expert_num_weight_shards to the expert TP "
            f"size (experts whole; their weights are then TE's own FP8 params), or "
            f"fp8_param=False"
        )


def _tp_size(tp_group: object, *, expert: bool = False) -> int:
    if tp_group is None:
        from megatron.core import parallel_state

        if expert:  # megatron's grouped-expert linears fall back to the expert TP group
            return parallel_state.get_expert_tensor_parallel_world_size()
        return parallel_state.get_tensor_model_parallel_world_size()
    return torch.distributed.get_world_size(tp_group)


class PreShardedGroupedLinearMixin:
    """Builds a grouped-expert linear as this rank's expert GTP shards (mix in before the class).

    For megatron's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (TE
    ``GroupedLinear``, parameters ``weight0..N-1``, one per local expert) and classes with their
    constructor ``(num_gemms, input_size, output_size, *, config, init_method, ..., tp_group)``.
    ``gtp`` is the *expert* plan (:meth:`GTPShardPlan.for_experts`), through the layer spec's
    params (:func:`~nemo_gtp.integrations.megatron.sharding.spec.gtp_layer_spec`). The base
    allocates every expert's weight at its shard shape (``output_size`` pre-sharded as in
    :class:`PreShardedLinearMixin`) and initializes each through :func:`rows_of_full_init`, so
    the shards hold exactly the rows the unsharded model would have, from the same seed; each
    ``weight{i}`` becomes an unregistered :class:`GTPShardedParam` that ``shard_model`` registers
    with the expert runtime as one weight group (design §3.4). With expert GTP size 1 the class
    builds exactly what its base builds.
    """

    gtp_column: bool = True
    """True when expert TP splits ``output_size`` (fc1); False when it splits the input (fc2)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *args: Any,
        gtp: GTPShardPlan,
        config: Any,
        init_method: Callable,
        **kwargs: Any,
    ) -> None:
        if gtp.gtp_size == 1:
            super().__init__(
                num_gemms,
                input_size,
                output_size,
                *args,
                config=config,
                init_method=init_method,
                **kwargs,
            )
            return
        validate_model_config_for_gtp(config)
        refuse_fp8_primary_experts(config, type(self).__name__)
        tp = _tp_size(kwargs.get("tp_group"), expert=True)
        logical_out = output_size // tp if self.gtp_column else output_size
        in_local = input_size if self.gtp_column else input_size // tp
        spec = gtp.spec_for((logical_out, in_local))
        built_out = spec.shard_dim0 * tp if self.gtp_column else spec.shard_dim0
        super().__init__(
            num_gemms,
            input_size,
            built_out,
            *args,
            config=config,
            init_method=rows_of_full_init(init_method, spec),
            **kwargs,
        )
        for i in range(num_gemms):
            attach_presharded_weight(self, spec, f"weight{i}", f"bias{i}")
        if hasattr(self, "out_features"):  # the GEMMs see the gathered weights
            self.out_features = logical_out


def attach_presharded_weight(
    module: torch.nn.Module, spec: ShardSpec, weight: str = "weight", bias: str = "bias"
) -> GTPShardedParam:
    """Turn ``module.<weight>`` (already shard-shaped) into an unregistered GTP shard.

    The base class initialized every row, pad rows included; those are zeroed (design §1.3: pad
    rows hold zeros and never receive gradient). A bias (``module.<bias>``) the base class built
    shard-sized is re-registered at the logical width (zeros, as megatron initializes biases):
    it adds onto the gathered GEMM output and stays replicated over GTP (§1.5). A TE
    ``GroupedLinear`` names them ``weight{i}`` / ``bias{i}``.
    """
    old = module._parameters[weight]
    if type(old.data) is not torch.Tensor:
        raise NotImplementedError(
            f"{type(module).__name__}: GTP shards plain tensors only, got a "
            f"{type(old.data).__name__} weight (built inside TransformerEngine's FP8 param init "
            "by a class that does not build plain weights there; GTP's FP8 primary weights are "
            'made from plain shards after shard_model, design §1.3 "FP8 primary weights"): '
            "set fp8_param_gather=False, or build this linear outside quantized_model_init"
        )
    if tuple(old.shape) != spec.shard_shape:
        raise ValueError(
            f"{type(module).__name__} built a weight of shape {tuple(old.shape)}, expected the "
            f"shard shape {spec.shard_shape}"
        )
    pad_from = spec.logical_shape[0] - spec.gtp_rank * spec.shard_dim0
    with torch.no_grad():
        old.data[max(pad_from, 0) :].zero_()
    param = GTPShardedParam(old.data, old.requires_grad, spec=spec)
    carry_param_attributes(old, param)
    module._parameters[weight] = param
    old_bias = module._parameters.get(bias)
    if old_bias is not None and old_bias.numel() > 0:
        if old_bias.numel() != spec.shard_dim0:
            raise ValueError(
                f"{type(module).__name__} built a bias of {old_bias.numel()} elements, expected "
                f"the shard width {spec.shard_dim0}"
            )
        full = torch.nn.Parameter(
            torch.zeros(spec.logical_shape[0], dtype=old_bias.dtype, device=old_bias.device),
            requires_grad=old_bias.requires_grad,
        )
        carry_param_attributes(old_bias, full)
        module._parameters[bias] = full
    return param


def is_presharded(param: object) -> bool:
    """True for a GTP shard built by a pre-sharded linear and not yet owned by a runtime."""
    return isinstance(param, GTPShardedParam) and param.gtp_state.runtime is None


@functools.cache
def presharded_class(base: type, column: bool, expert: bool = False) -> type:
    """The pre-sharded subclass of megatron linear class ``base`` (one class per base and kind).

    ``expert=True``: the class for a routed expert's linear (``SequentialMLP``), built over the
    expert GTP axis with the unsharded model's exact init (design §3.1 "Exact init"); give
    it :meth:`GTPShardPlan.for_experts`.

    Example::

        cls = presharded_class(ColumnParallelLinear, column=True)
        layer = cls(1024, 4096, gtp=plan, config=config, init_method=init, bias=False,
                    gather_output=False)
    """
    section = "'Exact init'" if expert else "'One init path'"
    axis = "expert GTP shard" if expert else "GTP shard"
    return type(
        f"GTP{'Expert' if expert else ''}{base.__name__}",
        (PreShardedLinearMixin, base),
        {
            "gtp_column": column,
            "gtp_expert": expert,
            "__module__": __name__,
            "__doc__": f"{base.__name__} built as its {axis} (design §3.1 {section}).",
        },
    )


@functools.cache
def presharded_grouped_class(base: type, column: bool) -> type:
    """The pre-sharded subclass of grouped-expert linear class ``base`` (one class per base).

    Example::

        cls = presharded_grouped_class(TEColumnParallelGroupedLinear, column=True)
        fc1 = cls(4, 1024, 2816, gtp=GTPShardPlan.for_experts(groups), config=config,
                  init_method=init, bias=False, skip_bias_add=False, is_expert=True)
    """
    return type(
        f"GTP{base.__name__}",
        (PreShardedGroupedLinearMixin, base),
        {
            "gtp_column": column,
            "__module__": __name__,
            "__doc__": (
                f"{base.__name__} built as its expert GTP shards (design §3.1 'Exact init')."
            ),
        },
    )

"""Rewrite a megatron layer spec so its parallel linears are built pre-sharded (design §1.5, §3.1).

Opt-in is by linear class (§1.5): :func:`gtp_layer_spec` swaps megatron's column/row-parallel
linear classes — the TE wrappers ``TEColumnParallelLinear``, ``TERowParallelLinear``,
``TELayerNormColumnParallelLinear`` and the megatron-local ``ColumnParallelLinear`` /
``RowParallelLinear`` — for their :mod:`~nemo_gtp.integrations.megatron.sharding.built`
subclasses, which build only this rank's shard; under expert GTP also the routed experts' linears
over the expert GTP axis, with the unsharded model's exact init: those inside ``SequentialMLP``'s
spec (the same local and TE classes, swapped first and only there, for their expert subclasses)
and ``TEGroupedMLP``'s ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (or
whatever grouped linears a ``TEGroupedMLP`` spec names: :func:`grouped_expert_linear_kinds`).
Nothing else in the spec changes: base ``TELinear`` (``parallel_mode="duplicated"``), norms,
attention, TE's ``LayerNormMLP`` and the op-fuser MLP stay as they are (and stay unsharded).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import GTPGroups
from nemo_gtp.integrations.megatron.sharding.built import (
    GTPShardPlan,
    PreShardedGroupedLinearMixin,
    presharded_class,
    presharded_grouped_class,
)
from nemo_gtp.integrations.megatron.sharding.te import (
    te_grouped_linear_kinds,
    te_parallel_linear_kinds,
)


def replace_modules_in_spec(
    spec: Any,
    classes: Mapping[type, type],
    params: Mapping[str, Any],
    *,
    within: tuple[type, ...] = (),
) -> Any:
    """A copy of ``spec`` with every class in ``classes`` swapped and ``params`` added to it.

    Walks ``ModuleSpec``s, submodule dataclasses (``TransformerLayerSubmodules``,
    ``TransformerBlockSubmodules.layer_specs``, ...), lists and tuples. A class appearing bare
    becomes ``ModuleSpec(module=new, params=params)``; a ``ModuleSpec`` of it keeps its own params
    and submodules. Matching is by exact class (a subclass is a different opt-in decision).
    ``within`` (container classes, subclasses included): swap only inside the submodules of a
    ``ModuleSpec`` of one of them (``(SequentialMLP,)``: the routed experts' linears, not the
    shared experts' or the dense MLP's). Parts that contain nothing to swap are returned as they
    are; ``spec`` is never mutated.
    """

    def walk(node: Any, inside: bool) -> Any:
        if isinstance(node, type):
            if inside and node in classes:
                return ModuleSpec(module=classes[node], params=dict(params))
            return node
        if isinstance(node, ModuleSpec):
            module = node.module
            is_class = isinstance(module, type)
            swapped = inside and is_class and module in classes
            enters = inside or (is_class and bool(within) and issubclass(module, within))
            submodules = walk(node.submodules, enters)
            if not swapped and submodules is node.submodules:
                return node
            new = copy.copy(node)
            if swapped:
                new.module = classes[module]
                new.params = {**node.params, **params}
            new.submodules = submodules
            return new
        if isinstance(node, (list, tuple)):
            items = [walk(item, inside) for item in node]
            if all(a is b for a, b in zip(items, node)):
                return node
            return type(node)(items)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {}
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                new_value = walk(value, inside)
                if new_value is not value:
                    changes[field.name] = new_value
            if not changes:
                return node
            new = copy.copy(node)
            for name, value in changes.items():
                object.__setattr__(new, name, value)
            return new
        return node

    return walk(spec, not within)


def presharded_classes(kinds: Mapping[type, bool] | None = None) -> dict[type, type]:
    """Megatron linear classes (``kinds``: class -> "TP splits out_features"; default every
    class GTP opts in: the local linears and, when TransformerEngine is importable, its
    wrappers) mapped to their pre-sharded subclasses.

    Example::

        presharded_classes()   # {ColumnParallelLinear: GTPColumnParallelLinear, ...}
    """
    if kinds is None:
        kinds = _local_and_te_kinds(import_te=True)
    return {base: presharded_class(base, column) for base, column in kinds.items()}


def presharded_grouped_classes(kinds: Mapping[type, bool] | None = None) -> dict[type, type]:
    """Grouped-expert linear classes (``kinds``: class -> "expert TP splits out_features";
    default megatron's TE wrappers, when TE is importable) mapped to their pre-sharded
    subclasses (design §3.1 "Exact init").

    Example::

        presharded_grouped_classes()   # {TEColumnParallelGroupedLinear: GTPTEColumn..., ...}
    """
    if kinds is None:
        kinds = te_grouped_linear_kinds(import_te=True)
    return {base: presharded_grouped_class(base, column) for base, column in kinds.items()}


def _module_specs(node: Any) -> Any:
    """Every ``ModuleSpec`` in ``node`` (submodule dataclasses, lists and tuples walked)."""
    if isinstance(node, ModuleSpec):
        yield node
        yield from _module_specs(node.submodules)
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from _module_specs(item)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield from _module_specs(getattr(node, field.name))


def grouped_expert_linear_kinds(spec: Any) -> dict[type, bool]:
    """The grouped-expert linear classes ``spec`` builds ``TEGroupedMLP``s with (its
    ``linear_fc1``: True, expert TP splits out_features; its ``linear_fc2``: False), whatever
    they are: megatron's TE wrappers, or another class with their constructor and
    ``weight0..N-1`` (the CPU stand-ins). Classes already pre-sharded are left out.

    Example::

        grouped_expert_linear_kinds(spec)  # {TEColumnParallelGroupedLinear: True, TERow...: False}
    """
    kinds: dict[type, bool] = {}
    for node in _module_specs(spec):
        if not (isinstance(node.module, type) and issubclass(node.module, TEGroupedMLP)):
            continue
        for name, column in (("linear_fc1", True), ("linear_fc2", False)):
            linear = getattr(node.submodules, name, None)
            linear = linear.module if isinstance(linear, ModuleSpec) else linear
            if isinstance(linear, type) and not issubclass(linear, PreShardedGroupedLinearMixin):
                kinds[linear] = column
    return kinds


def presharded_expert_classes(kinds: Mapping[type, bool] | None = None) -> dict[type, type]:
    """``SequentialMLP``'s expert linear classes (``kinds``: class -> "expert TP splits
    out_features"; default megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear`` and,
    when TE is importable, its TE wrappers) mapped to their expert pre-sharded subclasses, built
    over expert GTP with the unsharded model's exact init (design §3.1 "Exact init").

    Example::

        presharded_expert_classes()   # {ColumnParallelLinear: GTPExpertColumnParallelLinear, ...}
    """
    if kinds is None:
        kinds = _local_and_te_kinds(import_te=True)
    return {base: presharded_class(base, column, expert=True) for base, column in kinds.items()}


def _local_and_te_kinds(*, import_te: bool) -> dict[type, bool]:
    kinds: dict[type, bool] = {ColumnParallelLinear: True, RowParallelLinear: False}
    kinds.update(te_parallel_linear_kinds(import_te=import_te))
    return kinds


_Swap = tuple[Mapping[type, type], GTPShardPlan, tuple[type, ...]]


def _swap(spec: Any, swaps: list[_Swap]) -> Any:
    for classes, plan, within in swaps:
        spec = replace_modules_in_spec(spec, classes, {"gtp": plan}, within=within)
    return spec


def _expert_swaps(
    groups: GTPGroups,
    pad: int,
    sequential: Mapping[type, type] | None,
    grouped: Mapping[type, type] | None,
) -> list[_Swap]:
    """The routed-expert swaps (expert GTP > 1), before any dense one: ``SequentialMLP``'s
    linears only inside its spec (the dense classes would build them full), ``TEGroupedMLP``'s
    grouped linears wherever they appear."""
    if groups.expert_gtp_size == 1:
        return []
    plan = GTPShardPlan.for_experts(groups, pad)
    swaps: list[_Swap] = []
    if sequential:
        swaps.append((sequential, plan, (SequentialMLP,)))
    if grouped:
        swaps.append((grouped, plan, ()))
    return swaps


def gtp_layer_spec(
    spec: Any,
    groups: GTPGroups,
    config: GTPConfig | None = None,
    *,
    grouped_kinds: Mapping[type, bool] | None = None,
) -> Any:
    """``spec`` with its parallel linears built as GTP shards (design §3.1 "One init path").

    Pass the result to the model constructor, then call ``shard_model`` on the built model (it
    registers the pre-built shards with the model's runtimes and shards whatever else is
    eligible). Dense linears are swapped when GTP > 1; with expert GTP > 1 the routed experts'
    linears too, over the expert GTP axis and with exactly the unsharded model's initial values
    (§3.1 "Exact init"): ``SequentialMLP``'s (megatron's local and TE linears inside its
    spec) and ``TEGroupedMLP``'s grouped linears (``grouped_kinds``, default megatron's TE
    wrappers and whatever grouped linears the spec's ``TEGroupedMLP``s name,
    :func:`grouped_expert_linear_kinds`). With both sizes 1 ``spec`` is returned unchanged.
    ``config`` must be the one given to ``shard_model`` (its ``pad_for_alignment`` fixes the
    shard shapes).

    Example::

        groups = initialize_gtp_parallel(dims)
        spec = gtp_layer_spec(get_gpt_layer_with_transformer_engine_spec(), groups, gtp_config)
        model = GPTModel(config, spec, vocab_size, max_seq)
        shard_model(model, groups, gtp_config)
    """
    pad = (config or GTPConfig()).pad_for_alignment
    if grouped_kinds is None:
        grouped_kinds = {
            **te_grouped_linear_kinds(import_te=True),
            **grouped_expert_linear_kinds(spec),
        }
    grouped = presharded_grouped_classes(grouped_kinds)
    swaps = _expert_swaps(groups, pad, presharded_expert_classes(), grouped)
    if groups.gtp_size > 1:
        swaps.append((presharded_classes(), GTPShardPlan.from_groups(groups, pad), ()))
    return _swap(spec, swaps)


def preshard_config_layer_spec(
    model_config: Any,
    groups: GTPGroups,
    config: GTPConfig | None = None,
    classes: Mapping[type, type] | None = None,
    grouped_classes: Mapping[type, type] | None = None,
    expert_classes: Mapping[type, type] | None = None,
) -> bool:
    """Make a model config's ``transformer_layer_spec`` build the given linears pre-sharded.

    For trainers that build the model from a config after the process groups exist (NeMo's
    ``GPTConfig.configure_model``; ``GTPMegatronStrategy`` calls this in its distributed setup).
    The spec may be a ``ModuleSpec`` or a function of the config (NeMo's default TE spec); a
    function is wrapped so its result is rewritten when NeMo calls it. ``classes`` (GTP > 1)
    defaults to the loaded TransformerEngine wrappers (TE linears are never built full), plus
    megatron's local linears under ``GTPConfig.preshard_linears="all"``; otherwise local linears
    keep the build-full-then-slice path that starts bit-identical to a run without GTP.
    Under expert GTP > 1 the routed experts start bit-identical either way (§3.1 "Exact expert
    init"): ``expert_classes`` (``SequentialMLP``'s linears, swapped inside its spec only)
    defaults to megatron's local linears and the loaded TE wrappers
    (:func:`presharded_expert_classes`), ``grouped_classes`` to the loaded TE grouped-expert
    wrappers and whatever grouped linears the spec's ``TEGroupedMLP``s name (a function's: those
    of the spec it returns; :func:`grouped_expert_linear_kinds`). ``preshard_linears="none"``:
    every linear built full and sliced, nothing swapped. Returns whether anything can be swapped
    (False: both GTP sizes 1, ``"none"``, or, under GTP > 1 only, no TE loaded and ``"te"``).

    Example::

        preshard_config_layer_spec(gpt_config, groups, gtp_config)  # before configure_model
    """
    config = config or GTPConfig()
    default = config.preshard_linears != "none"
    if expert_classes is None and default:
        expert_classes = presharded_expert_classes(_local_and_te_kinds(import_te=False))
    if groups.gtp_size > 1 and classes is None and default:
        if config.preshard_linears == "all":
            classes = presharded_classes(_local_and_te_kinds(import_te=False))
        else:
            classes = presharded_classes(te_parallel_linear_kinds(import_te=False))

    def swaps_for(spec: Any) -> list[_Swap]:
        grouped = grouped_classes
        if grouped is None and default:  # TE's wrappers and the spec's own grouped linears
            kinds = te_grouped_linear_kinds(import_te=False)
            grouped = presharded_grouped_classes({**kinds, **grouped_expert_linear_kinds(spec)})
        swaps = _expert_swaps(groups, config.pad_for_alignment, expert_classes, grouped)
        if groups.gtp_size > 1 and classes:
            swaps.append((classes, GTPShardPlan.from_groups(groups, config.pad_for_alignment), ()))
        return swaps

    spec = model_config.transformer_layer_spec
    resolved = isinstance(spec, ModuleSpec) or not callable(spec)
    swaps = swaps_for(spec if resolved else None)
    # a function's spec may name grouped linears of its own: known once NeMo calls it
    later = not resolved and grouped_classes is None and default and groups.expert_gtp_size > 1
    if not (swaps or later) or getattr(spec, "gtp_presharded", False):
        return bool(swaps or later)
    if resolved:
        model_config.transformer_layer_spec = _swap(spec, swaps)
        return True

    @functools.wraps(spec)
    def presharded_spec(*args: Any, **kwargs: Any) -> Any:
        built = spec(*args, **kwargs)
        return _swap(built, swaps_for(built))

    presharded_spec.gtp_presharded = True  # type: ignore[attr-defined]
    model_config.transformer_layer_spec = presharded_spec
    return True

"""``with_gtp``: a NeMo 2 recipe (``llm.*.pretrain_recipe``) with ``GTPMegatronStrategy``.

NeMo's recipe factories return a nemo_run ``run.Partial`` of ``llm.pretrain`` (or
``llm.finetune``) whose ``trainer.strategy`` is a ``run.Config(nl.MegatronStrategy, ...)``.
:func:`with_gtp` returns a copy whose strategy is ``run.Config(GTPMegatronStrategy, ...)`` with
every ``MegatronStrategy`` argument kept, ``num_weight_shards`` (= TP x GTP) and the
``GTPConfig`` options added. Settings GTP cannot honour are fixed when the fix leaves the
training maths unchanged (a logged note names each) and rejected otherwise (:class:`RecipeError`
naming the setting), all before anything is launched (design §2.1 "Bad input", §3.2):

===============================================  =================================================
setting                                          under GTP (num_weight_shards > TP)
===============================================  =================================================
``ddp.average_in_collective=True``               -> False (NeMo's recipes set it; GTP pre-scales by
                                                 1/(DP x GTP) and sums: the same mean, §3.2)
``ddp.overlap_param_gather=True`` (and the       -> False (DDP's param all-gather pre-hook would
optimizer's, ``MegatronCommOverlapCallback``'s)  race GTP's prefetch; a speed knob)
``context_parallel_size > 1``                    kept (the CP peers hold the same shards, §1.4)
``num_distributed_optimizer_instances > 1``      -> 1 (§3.2)
``use_tp_pp_dp_mapping=True``                    -> False (megatron's data group must be DP x GTP)
``model.config.delay_wgrad_compute=True``        -> False (TE would skip GTP's wgrad finalize)
MoE (``model.config.num_moe_experts``)           kept: dense GTP, experts whole unless
                                                 ``expert_num_weight_shards`` > ETP (expert GTP;
                                                 the legacy ``GroupedMLP`` rejected, §1.4)
``fsdp``, Megatron FSDP, ``ddp="pytorch"``       rejected (GTP needs megatron DDP)
per-layer CUDA graphs                            kept for ``cuda_graph_impl="local"``, scope
                                                 ``"full"`` / ``"attn"`` with
                                                 ``use_te_rng_tracker=True``; otherwise rejected
                                                 (TE's graph helper, MoE, PP, recompute; §3.5)
FP8 primary weights (``fp8_param_gather``)      kept with ``fp8_recipe`` tensorwise or
                                                 blockwise: the GTP shards are FP8 (§1.3 "FP8
                                                 primary weights"); rejected with delayed
                                                 scaling, without the
                                                 distributed optimizer or fp32 grad reduction,
                                                 for routed experts over expert GTP
FP8 compute (``trainer.plugins.fp8``)            kept: ``fp8_recipe="tensorwise"`` gathers FP8
                                                 (§1.3 "FP8 gather"); unknown names rejected
                                                 here, MXFP8 / NVFP4 below compute capability
                                                 10.0 on the device (before any weight exists)
``save_ckpt_format`` other than ``torch_dist``   rejected (§3.3)
===============================================  =================================================

Batch arithmetic (design §3.1): GTP peers eat distinct microbatches like data-parallel ranks, so
``global_batch_size = micro_batch_size x (DP x GTP) x microbatches`` with ``DP x GTP = world /
(TP x CP x PP)``: NeMo's sampler sees megatron's data-parallel group, which is DP x GTP. A
global batch that does not divide is rejected, naming ``data.global_batch_size``.

Example::

    from nemo.collections import llm
    recipe = llm.llama3_8b.pretrain_recipe(name="gtp", dir="/ckpt", num_nodes=1,
                                           num_gpus_per_node=8)
    recipe = with_gtp(recipe, num_weight_shards=4)   # TP1 x CP2 x GTP4 (the recipe's CP kept)
    run.run(recipe, executor=run.LocalExecutor(ntasks_per_node=8, launcher="torchrun"))
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
from typing import Any

from nemo_gtp.engine.grid import (
    SIZE_SETTINGS,
    GTPParallelDims,
    check_checkpoint_format,
    check_global_batch,
    layout_dims,
    on_world,
    refuse_legacy_grouped_experts,
)
from nemo_gtp.recipes.config import RecipeError

logger = logging.getLogger(__name__)


def _cls_name(cfg: Any) -> str:
    target = getattr(cfg, "__fn_or_cls__", None)
    return getattr(target, "__name__", repr(target))


def _is_config_of(cfg: Any, cls: type) -> bool:
    target = getattr(cfg, "__fn_or_cls__", None)
    return isinstance(target, type) and issubclass(target, cls)


def config_arg(cfg: Any, name: str, default: Any = None) -> Any:
    """A ``run.Config`` argument, the target's default when unset (``default`` if it has none,
    or when ``cfg`` is not a config: ``None``, a plain value).

    Example::

        config_arg(recipe.trainer.strategy, "tensor_model_parallel_size", 1)   # 1 if unset
    """
    try:
        return getattr(cfg, name)
    except (AttributeError, TypeError):
        return default


class _Conversion:
    """The notes of one :func:`with_gtp` call (logged once the conversion succeeded)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def fix(self, cfg: Any, name: str, where: str, value: Any, why: str) -> None:
        """Set ``cfg.name = value`` when it differs, with a note naming ``where``."""
        old = config_arg(cfg, name)
        if old == value or (old is None and value in (False, 1)):
            return
        setattr(cfg, name, value)
        self.notes.append(f"{where}={old!r} -> {value!r} ({why})")


def with_gtp(
    recipe: Any,
    num_weight_shards: int,
    *,
    expert_num_weight_shards: int | None = None,
    **gtp_options: Any,
) -> Any:
    """``recipe`` (a NeMo recipe ``run.Partial``) with ``GTPMegatronStrategy``; a copy.

    Args:
        recipe: what ``llm.<model>.pretrain_recipe(...)`` (or ``finetune_recipe``) returns: a
            ``run.Partial`` with ``trainer.strategy`` a ``run.Config`` of ``MegatronStrategy``
            (or already of ``GTPMegatronStrategy``: its GTP settings are replaced).
        num_weight_shards: shards per dense linear weight, TP x GTP (design §2.1); equal to
            ``tensor_model_parallel_size`` keeps GTP off (the strategy is then plain
            ``MegatronStrategy``, e.g. for a baseline or an MoE model).
        expert_num_weight_shards: the expert twin for routed experts, ETP x EGTP (expert GTP,
            design §1.4); None keeps the experts whole.
        **gtp_options: ``GTPConfig`` fields (design §2.4), e.g. ``pad_for_alignment=16``.

    Returns a new ``run.Partial``; the argument is not changed. Raises :class:`RecipeError`
    naming the setting for what GTP cannot honour (see the module table); logs one note per
    setting it changed.

    Example::

        recipe = with_gtp(llm.nemotron4_15b.pretrain_recipe(num_nodes=2), num_weight_shards=8)
    """
    from nemo.lightning.pytorch.strategies import MegatronStrategy

    from nemo_gtp.strategy import GTPMegatronStrategy

    trainer = config_arg(recipe, "trainer")
    strategy = config_arg(trainer, "strategy")
    if not _is_config_of(strategy, MegatronStrategy):
        raise RecipeError(
            f"trainer.strategy is {_cls_name(strategy) if strategy is not None else None}: "
            "with_gtp converts a recipe whose trainer.strategy is a run.Config of "
            "nl.MegatronStrategy (what NeMo's llm.*.pretrain_recipe factories return)"
        )
    out = copy.deepcopy(recipe)
    conv = _Conversion()
    strategy = out.trainer.strategy
    args = dict(strategy.__arguments__)
    for key in ("num_weight_shards", "expert_num_weight_shards", "gtp_config"):
        args.pop(key, None)  # re-converting a GTP recipe: this call's settings replace them
    gtp_config = _gtp_config(gtp_options, config_arg(strategy, "gtp_config"))
    new = _strategy_config(GTPMegatronStrategy, args)
    tp = config_arg(new, "tensor_model_parallel_size", 1)
    if isinstance(num_weight_shards, int) and isinstance(tp, int) and num_weight_shards > tp:
        _fix_strategy(conv, new)  # before the sizes are checked
    dims = strategy_dims(new, num_weight_shards, expert_num_weight_shards)
    if dims.gtp > 1:
        _fix_model(conv, out)
        _fix_callbacks_and_optim(conv, out)
        _reject(out, new, dims.gtp, dims.egtp)
        _check_replicated_sharding(out, new, gtp_config)
    new.num_weight_shards = num_weight_shards
    if expert_num_weight_shards is not None:
        new.expert_num_weight_shards = expert_num_weight_shards
    if gtp_config is not None:
        new.gtp_config = gtp_config
    out.trainer.strategy = new
    check_batch_arithmetic(out, dims)
    for note in conv.notes:
        logger.warning("with_gtp: %s", note)
    return out


def _strategy_config(cls: type, args: dict[str, Any]) -> Any:
    import nemo_run as run

    return run.Config(cls, **args)


def strategy_dims(strategy: Any, shards: int, expert_shards: int | None) -> GTPParallelDims:
    """The static :class:`~nemo_gtp.engine.grid.GTPParallelDims` of a recipe's
    ``trainer.strategy`` (a ``run.Config``) with ``shards`` / ``expert_shards`` weight shards;
    :class:`RecipeError` naming ``trainer.strategy`` (:func:`~nemo_gtp.engine.grid.layout_dims`).

    Example::

        strategy_dims(recipe.trainer.strategy, 8, None).gtp   # 8 at TP1
    """
    settings = {key: config_arg(strategy, key) for key in SIZE_SETTINGS}
    settings.update(num_weight_shards=shards, expert_num_weight_shards=expert_shards)
    try:
        return layout_dims(settings, "trainer.strategy")
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _gtp_config(options: dict[str, Any], existing: Any) -> Any:
    """``run.Config(GTPConfig, ...)`` of ``options`` over an existing one; fields checked."""
    import fiddle as fdl
    import nemo_run as run

    from nemo_gtp.engine import GTPConfig

    fields = [f.name for f in dataclasses.fields(GTPConfig)]
    for key in options:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(
                f"GTP option {key}={options[key]!r} is not a GTPConfig field{hint}: known are "
                f"{', '.join(fields)}"
            )
    merged: dict[str, Any] = {}
    if isinstance(existing, fdl.Buildable):
        merged.update(existing.__arguments__)
    elif isinstance(existing, GTPConfig):
        merged.update(dataclasses.asdict(existing))
    merged.update(options)
    if not merged:
        return None
    try:
        GTPConfig(**merged)  # its own value checks name the field
    except (TypeError, ValueError) as err:
        raise RecipeError(str(err)) from None
    return run.Config(GTPConfig, **merged)


def _fix_strategy(conv: _Conversion, strategy: Any) -> None:
    import fiddle as fdl

    conv.fix(
        strategy,
        "use_tp_pp_dp_mapping",
        "trainer.strategy.use_tp_pp_dp_mapping",
        False,
        "megatron's data-parallel group must be DP x GTP, design §3.1",
    )
    conv.fix(
        strategy,
        "num_distributed_optimizer_instances",
        "trainer.strategy.num_distributed_optimizer_instances",
        1,
        "GTP needs one distributed-optimizer instance, design §3.2",
    )
    ddp = config_arg(strategy, "ddp", "megatron")
    if isinstance(ddp, fdl.Buildable):
        conv.fix(
            ddp,
            "average_in_collective",
            "trainer.strategy.ddp.average_in_collective",
            False,
            "GTP pre-scales by 1/(DP x GTP) and sums: the same mean, design §3.2",
        )
        conv.fix(
            ddp,
            "overlap_param_gather",
            "trainer.strategy.ddp.overlap_param_gather",
            False,
            "DDP's param all-gather pre-hook would race GTP's weight prefetch; a speed knob",
        )
        conv.fix(
            ddp,
            "num_distributed_optimizer_instances",
            "trainer.strategy.ddp.num_distributed_optimizer_instances",
            1,
            "GTP needs one distributed-optimizer instance, design §3.2",
        )
        conv.fix(
            ddp,
            "delay_wgrad_compute",
            "trainer.strategy.ddp.delay_wgrad_compute",
            False,
            "TE's delayed wgrad skips GTP's wgrad reduce-scatter",
        )


def _fix_model(conv: _Conversion, recipe: Any) -> None:
    config = config_arg(config_arg(recipe, "model"), "config")
    if config is None:
        return
    conv.fix(
        config,
        "delay_wgrad_compute",
        "model.config.delay_wgrad_compute",
        False,
        "TE's delayed wgrad skips GTP's wgrad reduce-scatter, design §3.1 'The bridge'",
    )


def _fix_callbacks_and_optim(conv: _Conversion, recipe: Any) -> None:
    from nemo.lightning.pytorch.callbacks.megatron_comm_overlap import MegatronCommOverlapCallback

    for i, callback in enumerate(config_arg(recipe.trainer, "callbacks") or []):
        if _is_config_of(callback, MegatronCommOverlapCallback):
            # None lets the callback turn it on whenever DP > 1 (DP x GTP here).
            if config_arg(callback, "overlap_param_gather") is not False:
                old = config_arg(callback, "overlap_param_gather")
                callback.overlap_param_gather = False
                conv.notes.append(
                    f"trainer.callbacks[{i}] (MegatronCommOverlapCallback).overlap_param_gather="
                    f"{old!r} -> False (the callback would turn DDP's param all-gather overlap on;"
                    " it races GTP's weight prefetch)"
                )
    optim_config = config_arg(config_arg(recipe, "optim"), "config")
    if optim_config is not None:
        for name in ("overlap_param_gather", "overlap_param_gather_with_optimizer_step"):
            if name in optim_config.__arguments__:
                conv.fix(
                    optim_config,
                    name,
                    f"optim.config.{name}",
                    False,
                    "mirrors the DDP setting GTP turns off",
                )


def _reject(recipe: Any, strategy: Any, gtp: int, egtp: int = 1) -> None:
    """Settings GTP cannot honour and that change what the user asked for."""
    import fiddle as fdl

    from nemo_gtp.engine.graph_rules import graph_settings, reject_cuda_graph_capture

    shards = f"num_weight_shards={config_arg(strategy, 'tensor_model_parallel_size', 1) * gtp}"
    off = "or leave GTP off (num_weight_shards = tensor_model_parallel_size)"
    if config_arg(strategy, "fsdp") is not None:
        raise RecipeError(
            f"trainer.strategy.fsdp={config_arg(strategy, 'fsdp')!r} is not supported with GTP "
            f"({shards}): set trainer.strategy.fsdp=None (GTP shards the large weights itself) "
            f"{off}"
        )
    ddp = config_arg(strategy, "ddp", "megatron")
    if isinstance(ddp, str) and ddp != "megatron":
        raise RecipeError(
            f"trainer.strategy.ddp={ddp!r} is not supported with GTP: use ddp='megatron' or a "
            "megatron DistributedDataParallelConfig"
        )
    if isinstance(ddp, fdl.Buildable):
        for name in ("use_megatron_fsdp", "use_custom_fsdp"):
            if config_arg(ddp, name):
                raise RecipeError(
                    f"trainer.strategy.ddp.{name}=True (Megatron FSDP) is not supported with GTP: "
                    f"set it False {off}"
                )
    try:
        check_checkpoint_format(
            config_arg(strategy, "save_ckpt_format", "torch_dist"),
            key="trainer.strategy.save_ckpt_format",
        )
    except ValueError as err:
        raise RecipeError(str(err)) from None
    config = config_arg(config_arg(recipe, "model"), "config")
    experts = config_arg(config, "num_moe_experts")
    grouped = experts and config_arg(config, "moe_grouped_gemm")
    legacy = grouped and config_arg(config, "moe_use_legacy_grouped_gemm")
    try:
        refuse_legacy_grouped_experts(
            egtp,
            "model.config.moe_use_legacy_grouped_gemm=True" if legacy else "",
            "set model.config.moe_use_legacy_grouped_gemm=False (TEGroupedMLP) or "
            "model.config.moe_grouped_gemm=False, or leave expert_num_weight_shards=None "
            "(experts whole, dense GTP on)",
        )
    except ValueError as err:
        raise RecipeError(str(err)) from None
    if config is not None:
        try:
            reject_cuda_graph_capture(
                graph_settings(lambda name, default: config_arg(config, name, default)),
                use_te_rng_tracker=bool(config_arg(strategy, "use_te_rng_tracker", False)),
                pipeline_parallel=config_arg(strategy, "pipeline_model_parallel_size", 1) or 1,
                model_key="model.config.",
                strategy_key="trainer.strategy.",
            )
        except ValueError as err:
            raise RecipeError(f"{err} (design §3.5)") from None
    plugins = config_arg(recipe.trainer, "plugins")
    for i, plugin in enumerate(plugins if isinstance(plugins, list) else [plugins]):
        if plugin is None:
            continue
        where = "trainer.plugins" + (f"[{i}]" if isinstance(plugins, list) else "")
        fp8_param = next(
            (name for name in ("fp8_param_gather", "fp8_params") if config_arg(plugin, name)), None
        )
        if config_arg(plugin, "fp8") or config_arg(plugin, "fp4") or fp8_param:
            _check_low_precision_names(plugin, where, fp8_param)
        if fp8_param:
            _check_fp8_primary(recipe, plugin, f"{where}.{fp8_param}", egtp)


def _check_low_precision_names(plugin: Any, where: str, fp8_param: str | None = None) -> None:
    """The precision plugin's FP8 / FP4 names (the hardware is checked on the device);
    ``fp8_param``: the plugin's argument asking for FP8 primary weights."""
    from nemo_gtp.engine.fp8 import check_fp8_training_for_gtp

    names = ("fp8", "fp8_recipe", "fp4", "fp4_recipe")
    keys = {name: f"{where}.{name}" for name in names}
    keys["fp8_param"] = f"{where}.{fp8_param or 'fp8_param_gather'}"
    try:
        check_fp8_training_for_gtp(
            config_arg(plugin, "fp8"),
            config_arg(plugin, "fp8_recipe", "delayed"),
            config_arg(plugin, "fp4"),
            config_arg(plugin, "fp4_recipe", "nvfp4"),
            fp8_param=fp8_param is not None,
            keys=keys,
        )
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _check_fp8_primary(recipe: Any, plugin: Any, key: str, egtp: int) -> None:
    """FP8 primary GTP shards (design §1.3 "FP8 primary weights"; the recipe already checked
    for ``fp8_recipe`` "tensorwise" or "blockwise"): megatron's distributed optimizer, fp32 gradient
    reduction, no routed experts over expert GTP."""
    off = f"or set {key}=False (the shards then stay in the training dtype)"
    where = key.rpartition(".")[0]
    if not config_arg(plugin, "fp8"):
        raise RecipeError(
            f"{key}=True (FP8 primary weights) needs FP8: set {where}.fp8='hybrid' (or 'e4m3') "
            f"and {where}.fp8_recipe='tensorwise' (or 'blockwise'), {off}"
        )
    optim = config_arg(config_arg(recipe, "optim"), "config")
    if optim is not None and not config_arg(optim, "use_distributed_optimizer"):
        raise RecipeError(
            f"{key}=True (FP8 primary weights) under GTP needs megatron's distributed "
            f"optimizer: set optim.config.use_distributed_optimizer=True, {off}"
        )
    if config_arg(plugin, "grad_reduce_in_fp32", True) is False:
        raise RecipeError(
            f"{key}=True (FP8 primary weights) under GTP needs fp32 gradient reduction: set "
            f"{where}.grad_reduce_in_fp32=True, {off}"
        )
    config = config_arg(config_arg(recipe, "model"), "config")
    if egtp > 1 and config_arg(config, "num_moe_experts"):
        raise RecipeError(
            f"{key}=True (FP8 primary weights) is not supported for routed experts sharded "
            f"over expert GTP: leave expert_num_weight_shards=None (experts whole), {off}"
        )


def _check_replicated_sharding(recipe: Any, strategy: Any, gtp_config: Any) -> None:
    import fiddle as fdl

    if gtp_config is None or not config_arg(gtp_config, "shard_replicated_params_over_gtp"):
        return
    ddp = config_arg(strategy, "ddp", "megatron")
    optim = config_arg(config_arg(recipe, "optim"), "config")
    distributed = isinstance(ddp, fdl.Buildable) and config_arg(ddp, "use_distributed_optimizer")
    if not distributed or not (optim is None or config_arg(optim, "use_distributed_optimizer")):
        raise RecipeError(
            "GTP option shard_replicated_params_over_gtp=True shards optimizer state: set "
            "trainer.strategy.ddp.use_distributed_optimizer=True and "
            "optim.config.use_distributed_optimizer=True, or drop the option"
        )


def check_batch_arithmetic(recipe: Any, dims: GTPParallelDims) -> None:
    """The world tiles the layout and ``data.global_batch_size`` divides into microbatches.

    World = ``trainer.devices x trainer.num_nodes``; data-parallel ranks = DP x GTP (each GTP
    peer eats its own microbatch, design §3.1); the rules are
    :func:`~nemo_gtp.engine.grid.on_world` and :func:`~nemo_gtp.engine.grid.check_global_batch`.
    Raises :class:`RecipeError` naming the setting. Example::

        check_batch_arithmetic(recipe, GTPParallelDims(num_weight_shards=8))  # 8 GPUs: gbs % 8
    """
    trainer, data = recipe.trainer, config_arg(recipe, "data")
    devices, nodes = config_arg(trainer, "devices", 1), config_arg(trainer, "num_nodes", 1)
    devices, nodes = (int(v) if isinstance(v, str) and v.isdigit() else v for v in (devices, nodes))
    if not isinstance(devices, int) or not isinstance(nodes, int):
        return  # "auto" and friends: the strategy checks the world it finds
    micro = config_arg(data, "micro_batch_size")
    batch = config_arg(data, "global_batch_size")
    try:
        dims = on_world(dims, devices, nodes, key="num_weight_shards")
        if isinstance(micro, int) and isinstance(batch, int):
            check_global_batch(dims, micro, batch)
    except ValueError as err:
        raise RecipeError(str(err)) from None

"""Strategy-level argument checks for GTP (design §2.1, §3.2), run before any collective.

Every check raises ``ValueError`` naming the setting to change. The checks only apply when GTP is
active (``num_weight_shards > tensor_model_parallel_size``): with GTP off the strategy is plain
``MegatronStrategy`` and accepts whatever it accepts — except a keyword nothing under it takes
(:func:`refuse_unknown_arguments`, a ``TypeError``), which is refused either way, since a typo of
a GTP argument is what turns GTP off. Sizes (``num_weight_shards`` vs TP, CP with
GTP, distributed-optimizer instances, the world size) are not checked here but by
:class:`~nemo_gtp.engine.grid.GTPParallelDims`, the one place that derives them, and the
checkpoint format by :func:`~nemo_gtp.engine.grid.check_checkpoint_format` (the layout rules the
recipe CLI and ``with_gtp`` call too); this module checks the other ``MegatronStrategy``
arguments and the ``GTPConfig``.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from nemo_gtp.engine.fp8 import FP8Scaling
from nemo_gtp.engine.grid import (
    check_checkpoint_format,
    check_expert_shards,
    refuse_legacy_grouped_experts,
)
from nemo_gtp.integrations.megatron.ddp import validate_ddp_config_for_gtp
from nemo_gtp.integrations.megatron.fp8_primary import check_fp8_primary_ddp
from nemo_gtp.integrations.megatron.model_config import fp8_primary_scaling
from nemo_gtp.integrations.megatron.sharding.built import refuse_fp8_primary_experts

# Keywords NeMo 2.7.3's own code passes to MegatronStrategy that no layer under it takes (it drops
# them): ckpt_include_optimizer (ten llm recipes, e.g. mistral_7b), always_save_context (the
# io connector), gradient_accumulation_fusion (the flux recipe). Accepted, so those recipes
# convert to GTP unchanged.
NEMO_DROPPED_KEYWORDS = frozenset(
    {"ckpt_include_optimizer", "always_save_context", "gradient_accumulation_fusion"}
)


def refuse_unknown_arguments(extra: dict[str, Any], known: Iterable[str]) -> None:
    """Refuse keyword arguments no layer under ``MegatronStrategy`` takes.

    ``MegatronStrategy`` hands keywords it does not name to Lightning's ``DDPStrategy``, which
    keeps the ones it does not name for torch's ``DistributedDataParallel``; that wrapper exists
    only with ``ddp="pytorch"``, so with megatron DDP (GTP's only DDP) they vanish and a typo
    such as ``num_weight_shard=2`` would train without GTP and say nothing. Keywords torch's
    wrapper takes stay accepted (NeMo's own recipes pass ``gradient_as_bucket_view=True``), as
    do :data:`NEMO_DROPPED_KEYWORDS`. Applies with GTP off too.

    Example::

        refuse_unknown_arguments({"num_weight_shard": 2}, ["num_weight_shards"])
        # TypeError: ... 'num_weight_shard' (did you mean 'num_weight_shards'?) ...
    """
    passed_on = {
        *inspect.signature(DDPStrategy.__init__).parameters,
        *inspect.signature(DistributedDataParallel.__init__).parameters,
        *NEMO_DROPPED_KEYWORDS,
    }
    unknown = [k for k in extra if k not in passed_on]
    if not unknown:
        return
    choices = sorted({*known, *passed_on} - {"self", "args", "kwargs", "module"})
    close = difflib.get_close_matches(unknown[0], choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(
        f"GTPMegatronStrategy got an unexpected keyword argument {unknown[0]!r}{hint}: neither "
        "MegatronStrategy, Lightning's DDPStrategy nor torch's DistributedDataParallel takes "
        "it (with megatron DDP, MegatronStrategy would drop it without a word)"
    )


def validate_ddp_config(ddp_config: Any) -> None:
    """Reject a megatron ``DistributedDataParallelConfig`` that is wrong under GTP.

    Called at construction and again right before DDP wrapping (callbacks such as NeMo's
    ``MegatronCommOverlapCallback`` may edit the config in between).
    """
    validate_ddp_config_for_gtp(ddp_config)


def validate_strategy_args(args: dict[str, Any], gtp_size: int) -> None:
    """Check ``MegatronStrategy`` arguments (all of them, defaults applied) against GTP.

    ``gtp_size``: the GTP degree (or the expert GTP degree when only experts shard); 1 skips.

    Sizes are :class:`~nemo_gtp.engine.grid.GTPParallelDims`'s; this checks DDP, FSDP, the
    rank-order mapping and the checkpoint format.

    Example::

        validate_strategy_args({"ddp": "pytorch", ...}, gtp_size=2)  # ValueError naming ddp
    """
    if gtp_size == 1:
        return
    ddp = args.get("ddp", "megatron")
    if isinstance(ddp, str):
        if ddp != "megatron":
            raise ValueError(
                f"ddp={ddp!r} is not supported with GTP: use ddp='megatron' or a megatron "
                "DistributedDataParallelConfig (GTP routes grad-ready hooks through megatron DDP)"
            )
    else:
        validate_ddp_config(ddp)
    if args.get("fsdp") is not None:
        raise ValueError(
            f"fsdp={args['fsdp']!r} is not supported with GTP: leave fsdp=None (GTP already "
            "shards the large weights)"
        )
    if args.get("use_tp_pp_dp_mapping", False):
        raise ValueError(
            "use_tp_pp_dp_mapping=True is not supported with GTP: GTP needs megatron's default "
            "'tp-cp-ep-dp-pp' rank order so that megatron's data-parallel group is DP x GTP"
        )
    check_checkpoint_format(args.get("save_ckpt_format", "torch_dist"))


def validate_gtp_config(gtp_config: Any, args: dict[str, Any], gtp_size: int) -> None:
    """Check a ``GTPConfig`` against the strategy's other arguments.

    Example::

        validate_gtp_config(GTPConfig(shard_replicated_params_over_gtp=True),
                            {"ddp": "megatron"}, gtp_size=2)  # ValueError: distributed optimizer
    """
    if gtp_size == 1 or gtp_config is None or not gtp_config.shard_replicated_params_over_gtp:
        return
    ddp = args.get("ddp", "megatron")
    if isinstance(ddp, str) or not getattr(ddp, "use_distributed_optimizer", False):
        raise ValueError(
            "gtp_config.shard_replicated_params_over_gtp=True shards optimizer state: pass "
            "ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, ...) and an "
            "OptimizerConfig with use_distributed_optimizer=True, or set it False"
        )


def validate_moe_config(model_config: Any, egtp: int, gtp_enabled: bool) -> None:
    """Check a model config against expert GTP before any process group (design §1.4).

    ``expert_num_weight_shards > ETP`` (``egtp > 1``) needs routed experts, built as megatron
    ``SequentialMLP`` (``moe_grouped_gemm=False``) or ``TEGroupedMLP`` (``moe_grouped_gemm=True``
    with the TransformerEngine layer spec); megatron's legacy ``GroupedMLP`` (the local spec, or
    ``moe_use_legacy_grouped_gemm=True``) is refused. ``shard_model`` checks the built model
    again for megatron-core users.

    Example::

        validate_moe_config(GPTConfig(num_moe_experts=None), egtp=2, gtp_enabled=True)  # raises
    """
    if not gtp_enabled or model_config is None:
        return
    experts = getattr(model_config, "num_moe_experts", None)
    check_expert_shards(egtp, experts)
    if egtp > 1 and getattr(model_config, "moe_grouped_gemm", False):
        refuse_legacy_grouped_experts(
            egtp,
            legacy_grouped_experts_reason(model_config),
            "use the TransformerEngine layer spec with moe_use_legacy_grouped_gemm=False, set "
            "the model's moe_grouped_gemm=False, or expert_num_weight_shards=None",
        )


def legacy_grouped_experts_reason(model_config: Any) -> str:
    """Why a config with ``moe_grouped_gemm=True`` builds megatron's legacy ``GroupedMLP``
    instead of ``TEGroupedMLP`` (empty when it builds ``TEGroupedMLP``): the legacy flag, NeMo's
    local layer spec, or TransformerEngine not importable (NeMo's default spec falls back to the
    local one)."""
    if getattr(model_config, "moe_use_legacy_grouped_gemm", False):
        return "moe_use_legacy_grouped_gemm=True"
    spec = getattr(model_config, "transformer_layer_spec", None)
    if getattr(spec, "__name__", "") == "local_layer_spec":
        return "the local layer spec (local_layer_spec)"
    if importlib.util.find_spec("transformer_engine") is None:
        return "moe_grouped_gemm=True without TransformerEngine installed"
    return ""


def validate_fp8_primary(
    model_config: Any, ddp_config: Any, optim_config: Any, egtp: int = 1
) -> FP8Scaling | None:
    """FP8 primary GTP shards (megatron's ``fp8_param``, NeMo's ``fp8_param_gather``): the
    settings they need, checked before any collective (design §1.3 "FP8 primary weights").

    Returns the shards' :class:`FP8Scaling`, or ``None`` when ``fp8_param`` is off. Raises
    ``ValueError`` naming the setting: ``fp8_recipe`` other than ``"tensorwise"`` / ``"blockwise"``,
    megatron's bf16 first / last layers, routed experts under expert GTP (``egtp > 1``), DDP without
    ``grad_reduce_in_fp32`` or the distributed optimizer, an ``OptimizerConfig`` without
    ``use_distributed_optimizer`` (megatron's other optimizers copy the fp32 main params into the
    model params with a plain copy, which an FP8 shard cannot take).

    Example::

        validate_fp8_primary(gpt_config, ddp_config, optim_config)   # FP8Scaling("tensorwise")
    """
    scaling = fp8_primary_scaling(model_config)
    if scaling is None:
        return None
    if egtp > 1 and getattr(model_config, "num_moe_experts", None):
        refuse_fp8_primary_experts(model_config, "expert_num_weight_shards > ETP")
    if ddp_config is None or isinstance(ddp_config, str):
        raise ValueError(
            "FP8 primary GTP shards (fp8_param_gather) need megatron DDP with "
            "ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=True, "
            f"use_distributed_optimizer=True), got ddp={ddp_config!r}"
        )
    if optim_config is not None and not getattr(optim_config, "use_distributed_optimizer", False):
        raise ValueError(
            "optim: FP8 primary GTP shards (fp8_param_gather) need megatron's distributed "
            "optimizer: set OptimizerConfig(use_distributed_optimizer=True) (recipes: "
            "optim.use_distributed_optimizer=true), or fp8_param_gather=False"
        )
    check_fp8_primary_ddp(ddp_config)
    return scaling

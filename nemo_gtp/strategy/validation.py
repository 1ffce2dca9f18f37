"""Strategy-level argument checks for GTP (seed §2.1, §3.2), run before any collective.

Every check raises ``ValueError`` naming the setting to change. The checks only apply when GTP is
active (``num_weight_shards > tensor_model_parallel_size``): with GTP off the strategy is plain
``MegatronStrategy`` and accepts whatever it accepts.
"""

from __future__ import annotations

from typing import Any

from nemo_gtp.integrations.megatron.ddp import validate_ddp_config_for_gtp


def gtp_size_from(num_weight_shards: int | None, tensor_model_parallel_size: int) -> int:
    """The GTP degree ``num_weight_shards / TP`` (seed §2.1), validated.

    Example::

        gtp_size_from(8, 2)   # 4
        gtp_size_from(None, 2)  # 1: GTP off
    """
    tp = tensor_model_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be a positive integer, got {tp!r}")
    if num_weight_shards is None:
        return 1
    if not isinstance(num_weight_shards, int) or isinstance(num_weight_shards, bool) or (
        num_weight_shards < 1 or num_weight_shards % tp != 0
    ):
        raise ValueError(
            f"num_weight_shards={num_weight_shards!r} must be a positive multiple of "
            f"tensor_model_parallel_size={tp} (num_weight_shards = TP x GTP, e.g. {2 * tp} for "
            "GTP=2)"
        )
    return num_weight_shards // tp


def expert_gtp_size_from(
    expert_num_weight_shards: int | None, expert_tensor_parallel_size: int | None,
    tensor_model_parallel_size: int,
) -> int:
    """The expert GTP degree ``expert_num_weight_shards / ETP`` (ETP defaults to TP), validated."""
    etp = tensor_model_parallel_size if expert_tensor_parallel_size is None else (
        expert_tensor_parallel_size
    )
    if expert_num_weight_shards is None:
        return 1
    if not isinstance(expert_num_weight_shards, int) or isinstance(
        expert_num_weight_shards, bool
    ) or expert_num_weight_shards < 1 or expert_num_weight_shards % etp != 0:
        raise ValueError(
            f"expert_num_weight_shards={expert_num_weight_shards!r} must be a positive multiple of "
            f"expert_tensor_parallel_size={etp}"
        )
    return expert_num_weight_shards // etp


def validate_ddp_config(ddp_config: Any) -> None:
    """Reject a megatron ``DistributedDataParallelConfig`` that is wrong under GTP.

    Called at construction and again right before DDP wrapping (callbacks such as NeMo's
    ``MegatronCommOverlapCallback`` may edit the config in between).
    """
    validate_ddp_config_for_gtp(ddp_config)


def validate_strategy_args(args: dict[str, Any], gtp_size: int) -> None:
    """Check ``MegatronStrategy`` arguments (all of them, defaults applied) against GTP.

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
    instances = args.get("num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} is not supported with GTP "
            "(seed §3.2): set num_distributed_optimizer_instances=1"
        )
    cp = args.get("context_parallel_size", 1)
    if cp != 1:
        raise ValueError(
            f"context_parallel_size={cp} with GTP is not supported yet: megatron's CP axis would "
            "land on the GTP peers. Set context_parallel_size=1 or num_weight_shards="
            "tensor_model_parallel_size"
        )


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

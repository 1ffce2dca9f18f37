"""megatron ``parallel_state`` alongside the GTP rank grid (design §3.1 "Process groups").

megatron-core 0.15 knows no GTP axis. With the GTP axis placed right after TP and CP, megatron's
default ``tp-cp-ep-dp-pp`` order sees GTP x DP as its data-parallel axis, so its TP/CP/PP/embedding
groups are exactly right and its data-parallel group is our ``data`` group (where the sampler
shards). What megatron must *not* use for gradients is that data-parallel group: DDP and the
optimizer get a ``ProcessGroupCollection`` whose data-parallel groups are the GTP-excluded
replicate group (its ``dp_cp`` groups: the replicate group's CP x DP ranks).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import GTPGroups, GTPParallelDims


def initialize_gtp_parallel(
    dims: GTPParallelDims,
    groups: GTPGroups | None = None,
    gtp_pg_options: object | None = None,
    *,
    virtual_pipeline_model_parallel_size: int | None = None,
) -> GTPGroups:
    """Initialize megatron's ``parallel_state`` (if not yet) and build the GTP groups.

    Collective over the world; every rank calls it once. ``groups`` from an earlier call with
    the same ``dims`` are reused instead of built again (process groups live until the default
    group is destroyed, so rebuilding them only accumulates). ``gtp_pg_options`` goes to
    :meth:`GTPParallelDims.build` (the GTP communicator's NCCL options).
    ``virtual_pipeline_model_parallel_size``: megatron's model chunks per pipeline rank (the
    interleaved schedule); not a rank axis, so the grid does not know it (design §1.4 "PP").

    Example::

        dims = GTPParallelDims(world_size=4, tensor_model_parallel_size=2, num_weight_shards=4)
        groups = initialize_gtp_parallel(dims)
    """
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tensor_model_parallel_size,
            pipeline_model_parallel_size=dims.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=dims.context_parallel_size,
            expert_model_parallel_size=dims.expert_model_parallel_size,
            expert_tensor_parallel_size=dims.expert_tensor_parallel_size,
            order="tp-cp-ep-dp-pp",
            # GTP passes use_gloo_process_groups=False to megatron's optimizer; gloo twins of
            # every megatron group would only cost threads and memory.
            create_gloo_process_groups=False,
        )
    checks = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size (DP x GTP)": parallel_state.get_data_parallel_world_size(),
    }
    expected = {
        "tensor_model_parallel_size": dims.tensor_model_parallel_size,
        "pipeline_model_parallel_size": dims.pipeline_model_parallel_size,
        "data_parallel_size (DP x GTP)": dims.data_parallel_size,
    }
    if checks != expected:
        raise ValueError(
            f"megatron parallel_state was initialized with {checks}, the GTP grid needs "
            f"{expected}: initialize both from the same sizes"
        )
    if groups is None:
        groups = dims.build(gtp_pg_options)
    elif groups.dims != dims:
        raise ValueError(f"groups were built for {groups.dims}, not {dims}")
    mine = {
        name: sorted(next(ranks for ranks in lists if groups.rank in ranks))
        for name, lists in dims.group_ranks().items()
    }
    megatron_groups = {
        "data": parallel_state.get_data_parallel_group(),
        # The expert grid (design §3.1): megatron's expert data-parallel axis is EGTP x EDP.
        "expert_data": parallel_state.get_expert_data_parallel_group(),
    }
    for name, group in megatron_groups.items():
        if sorted(dist.get_process_group_ranks(group)) != mine[name]:
            raise ValueError(
                f"megatron's {name.replace('_', ' ')}-parallel group does not match the GTP "
                f"{name} group: megatron must use the default order 'tp-cp-ep-dp-pp' "
                "(use_tp_pp_dp_mapping=False) and the same expert sizes"
            )
    return groups


def gtp_process_groups(
    groups: GTPGroups, config: GTPConfig | None = None
) -> ProcessGroupCollection:
    """The ``ProcessGroupCollection`` megatron DDP and ``get_megatron_optimizer`` must use.

    Default (design §3.2): the data-parallel fields are the replicate group (DDP and the
    distributed optimizer reduce over it; ``dp_cp`` / ``intra_dp_cp`` its CP x DP twin,
    :attr:`~nemo_gtp.engine.grid.GTPGroups.replicate_cp`); ``mp`` is TP x GTP x PP, so the
    non-distributed optimizer's grad norm sums every GTP shard, and ``DistributedOptimizer`` keys
    state by a rank unique per GTP peer (design §3.3 "Optimizer state").

    Expert side (design §1.4, §3.2): megatron's expert buffer and optimizer reduce and shard over
    ``expt_dp = intra_expt_dp`` = the expert replicate group (EDP, without the EGTP peers, which
    hold different rows), and the expert optimizer's grad-norm group ``tp_ep_pp`` is ETP x EP x
    EGTP x PP. With EGTP 1 both are megatron's own groups.

    With ``config.shard_replicated_params_over_gtp`` (GTP shards tagged ``allreduce=False`` by
    :class:`GTPDDPMixin`): the replicated params take megatron's first buffer and optimizer over
    the whole data group (DP x GTP, and CP: megatron's ``dp_cp``) with the TP x PP
    model-parallel group, exactly as without GTP; the GTP shards take the second (expert-style)
    buffer and optimizer over the ranks holding the same shards (``replicate_cp``) with
    TP x GTP x PP as their model-parallel group.

    Example::

        pgs = gtp_process_groups(groups, gtp_config)
        ddp = GTPDistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
    """
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    if groups.dims.gtp_enabled:
        pgs.expt_dp = pgs.intra_expt_dp = groups.expert_replicate
        pgs.tp_ep_pp = groups.expert_model_parallel
    if groups.gtp_size > 1 and config is not None and config.shard_replicated_params_over_gtp:
        # replicated params: megatron's own dp_cp / intra_dp_cp, as use_mpu_process_groups set
        # them (DP x GTP, and CP); GTP shards: the second (expert-style) buffer over the ranks
        # holding the same shards (CP x DP)
        pgs.dp = groups.data
        pgs.expt_dp = pgs.intra_expt_dp = groups.replicate_cp
        pgs.tp_ep_pp = groups.model_parallel
        pgs.mp = parallel_state.get_model_parallel_group()
        return pgs
    pgs.dp = groups.replicate
    pgs.dp_cp = pgs.intra_dp_cp = groups.replicate_cp
    pgs.mp = groups.model_parallel
    return pgs

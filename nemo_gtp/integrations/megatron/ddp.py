"""megatron DDP with grad-ready hooks routed through the GTP runtime (design §3.2, point 3).

A GTP weight's gradient reaches ``main_grad`` through the runtime's deferred reduce-scatter, not
through autograd's AccumulateGrad (its autograd wgrad is ``None``). DDP's hook for such a param
must therefore fire only after ``{reduce-scatter -> main_grad add}``, so a bucket's collective
never reads a stale ``main_grad`` (the ordering invariant of design §3.2).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.cuda_graphs import is_graph_capturing

from nemo_gtp.engine.grid import GTPParallelDims
from nemo_gtp.engine.param import is_gtp_param


def validate_ddp_config_for_gtp(ddp_config: object) -> None:
    """Reject DDP settings that are wrong under GTP (raised before any collective)."""
    if getattr(ddp_config, "average_in_collective", False):
        raise ValueError(
            "ddp: DistributedDataParallelConfig.average_in_collective=True is incompatible with "
            "GTP (design §3.2: the mean is a pre-scale before a SUM collective). Set "
            "DistributedDataParallelConfig(average_in_collective=False); NeMo's stock recipes "
            "set it True"
        )
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(
        ddp_config, "use_custom_fsdp", False
    ):
        raise ValueError(
            "ddp: Megatron FSDP (use_megatron_fsdp / use_custom_fsdp) is not supported with GTP: "
            "GTP shards weights itself and needs megatron DDP"
        )
    if getattr(ddp_config, "overlap_param_gather", False):
        raise ValueError(
            "ddp: DistributedDataParallelConfig.overlap_param_gather=True is not supported with "
            "GTP: DDP's forward pre-hook param all-gather can race GTP's prefetch of the next "
            "weight's shard. Set overlap_param_gather=False"
        )
    GTPParallelDims.check_distributed_optimizer_instances(
        getattr(ddp_config, "num_distributed_optimizer_instances", 1),
        where="ddp: DistributedDataParallelConfig.",
    )


def check_data_group(runtime: object, pg_collection: object | None) -> None:
    """DDP's data-parallel group must span the GTP peers exactly when the model's
    ``GTPConfig.shard_replicated_params_over_gtp`` says so (else gradients are reduced twice,
    or GTP shards of different rows are summed). Raised before megatron's first collective."""
    dp_cp = (
        getattr(pg_collection, "dp_cp", None)
        if pg_collection is not None
        else parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    gtp_ranks = set(dist.get_process_group_ranks(runtime.group))
    spans_gtp = len(gtp_ranks & set(dist.get_process_group_ranks(dp_cp))) > 1
    wanted = runtime.config.shard_replicated_params_over_gtp
    if spans_gtp != wanted:
        raise ValueError(
            f"DDP's data-parallel group {'spans' if spans_gtp else 'excludes'} the GTP peers but "
            f"GTPConfig.shard_replicated_params_over_gtp={wanted}: build DDP (and the optimizer) "
            "with pg_collection=gtp_process_groups(groups, gtp_config), using the GTPConfig "
            "given to shard_model"
        )


def route_gtp_params_to_second_buffer(
    module: torch.nn.Module, gtp_params: list[torch.nn.Parameter], ddp_config: object
) -> None:
    """``GTPConfig.shard_replicated_params_over_gtp``: tag the GTP shards ``allreduce=False``.

    megatron's DDP then keeps them in its second (expert-style) buffer, reduced over the
    replicate group, while the replicated params take the first buffer over the whole data
    group (DP x GTP); ``get_megatron_optimizer`` builds one optimizer per buffer the same way.
    Every check runs before megatron's first collective.
    """
    if not getattr(ddp_config, "use_distributed_optimizer", False):
        raise ValueError(
            "GTPConfig.shard_replicated_params_over_gtp=True shards optimizer state and needs "
            "DistributedDataParallelConfig(use_distributed_optimizer=True) (and "
            "OptimizerConfig(use_distributed_optimizer=True)); or set it False"
        )
    experts = [
        n
        for n, p in module.named_parameters()
        if not is_gtp_param(p) and not getattr(p, "allreduce", True)
    ]
    if experts:
        raise ValueError(
            "GTPConfig.shard_replicated_params_over_gtp=True uses megatron's expert buffer for "
            f"the GTP shards, but the model has expert params ({experts[0]}, ...): set it False"
        )
    for param in gtp_params:
        param.allreduce = False


class GTPDDPMixin:
    """Mix into megatron's ``DistributedDataParallel`` (or a subclass such as NeMo's ``DDP``).

    Example::

        class MyDDP(GTPDDPMixin, nemo.lightning.megatron_parallel.DDP): ...
    """

    def __init__(self, config, ddp_config, module, *args, **kwargs) -> None:  # noqa: ANN001
        gtp_params = [p for p in module.parameters() if is_gtp_param(p)]
        if gtp_params:
            validate_ddp_config_for_gtp(ddp_config)
            check_data_group(gtp_params[0].runtime, kwargs.get("pg_collection"))
            if gtp_params[0].runtime.config.shard_replicated_params_over_gtp:
                route_gtp_params_to_second_buffer(module, gtp_params, ddp_config)
        super().__init__(config, ddp_config, module, *args, **kwargs)

    def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[..., None]:
        if not is_gtp_param(param):
            return super()._make_backward_post_hook(param)

        # Weak references: the hook lives in the param's own ``gtp_state``. A strong
        # param -> hook -> (DDP, param) cycle runs through the tensor's __dict__, which Python's
        # GC cannot traverse while autograd holds the TensorImpl, so the whole model (weights,
        # grad buffers, optimizer state) would outlive every reference to it.
        ddp_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def grad_ready() -> None:
            ddp, owner = ddp_ref(), param_ref()
            if ddp is None or owner is None or is_graph_capturing():
                return
            if ddp.ddp_config.overlap_grad_reduce and owner in ddp.param_to_bucket_group:
                ddp.param_to_bucket_group[owner].register_grad_ready(owner)

        param.register_grad_accum_hook(grad_ready)

        def drop_dummy_grad(*unused: object) -> None:
            # TE's fused wgrad path (fuse_wgrad_accumulation) hands autograd a dummy shard-shaped
            # wgrad once the real one went through finalize_group_grads; megatron's own hook
            # drops param.grad the same way. The local GTP path returns None (no AccumulateGrad).
            param.grad = None

        return drop_dummy_grad


class GTPDistributedDataParallel(GTPDDPMixin, DistributedDataParallel):
    """megatron-core DDP aware of GTP weights (design §3.2).

    Example::

        ddp = GTPDistributedDataParallel(config, ddp_config, model,
                                         pg_collection=gtp_process_groups(groups))
    """

"""megatron DDP with grad-ready hooks routed through the GTP runtime (design §3.2, point 3).

A GTP weight's gradient reaches ``main_grad`` through the runtime's deferred reduce-scatter, not
through autograd's AccumulateGrad (its autograd wgrad is ``None``). DDP's hook for such a param
must therefore fire only after ``{reduce-scatter -> main_grad add}``, so a bucket's collective
never reads a stale ``main_grad`` (the ordering invariant of design §3.2).

Routed experts (design §3.2 "Routed experts"): megatron pre-scales its expert buffer by
1/``dp_cp`` like the dense one, which under GTP is 1/DP; the expert buffer is rescaled to
EGTP / (DP x GTP) so that, after the EGTP reduce-scatter's 1/EGTP, every expert gradient is the
mean over all DP x GTP data ranks, as without GTP.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.cuda_graphs import is_graph_capturing

from nemo_gtp.engine.fp8_primary import is_fp8_primary
from nemo_gtp.engine.grid import GTPParallelDims, WeightAxis
from nemo_gtp.engine.param import is_gtp_param
from nemo_gtp.engine.runtime import GTPRuntime, runtimes_of
from nemo_gtp.integrations.megatron.fp8_primary import (
    check_fp8_primary_ddp,
    install_fp8_primary_hooks,
)
from nemo_gtp.integrations.megatron.sharding.experts import is_expert_param


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


def check_data_group(runtime: GTPRuntime, pg_collection: object | None) -> None:
    """DDP's data-parallel groups must match the GTP axes (raised before megatron's first
    collective): the dense group spans the GTP peers exactly when the model's
    ``GTPConfig.shard_replicated_params_over_gtp`` says so, the expert group never spans the
    EGTP peers (else gradients are reduced twice, or shards of different rows are summed)."""
    expert = runtime.axis is WeightAxis.EXPERT
    if pg_collection is not None:
        group = getattr(pg_collection, "expt_dp" if expert else "dp_cp", None)
    elif expert:
        group = parallel_state.get_expert_data_parallel_group()
    else:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    peers = set(dist.get_process_group_ranks(runtime.group))
    spans = len(peers & set(dist.get_process_group_ranks(group))) > 1
    wanted = not expert and runtime.config.shard_replicated_params_over_gtp
    if spans != wanted:
        what = "expert data-parallel group (expt_dp)" if expert else "data-parallel group"
        axis = "expert GTP" if expert else "GTP"
        setting = "" if expert else (f" but GTPConfig.shard_replicated_params_over_gtp={wanted}")
        raise ValueError(
            f"DDP's {what} {'spans' if spans else 'excludes'} the {axis} peers{setting}: build "
            "DDP (and the optimizer) with pg_collection=gtp_process_groups(groups, gtp_config), "
            "using the GTPConfig given to shard_model"
        )


def rescale_expert_buffers(ddp: DistributedDataParallel, dims: GTPParallelDims) -> None:
    """Pre-scale DDP's expert buffer by EGTP / (DP x GTP x CP) (mean loss; design §3.2 table).

    An expert's gradient on one rank holds the tokens of every EP peer, so the sum over its
    EGTP x EDP holders (megatron folds CP into the expert data axis) covers all DP x GTP x CP
    ranks: the mean needs 1/(DP x GTP x CP) on that sum. The EGTP reduce-scatter averages
    (1/EGTP), DDP sums over EDP, so DDP's pre-scale must be EGTP / (DP x GTP x CP). megatron
    computes 1/dp_cp, and dp_cp is the replicate group's CP x DP under GTP. Under per-token
    loss megatron pre-scales by 1 and divides by the token count later: nothing to change. Call
    after megatron's constructor, before the first backward.
    """
    if ddp.config.calculate_per_token_loss or not ddp.expert_parallel_buffers:
        return
    factor = dims.egtp / (dims.data_parallel_size * dims.context_parallel_size)
    for buffer in ddp.expert_parallel_buffers:
        buffer.gradient_scaling_factor = factor
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor = factor


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
        runtimes = runtimes_of(module)
        if runtimes:
            validate_ddp_config_for_gtp(ddp_config)
            for runtime in runtimes:
                check_data_group(runtime, kwargs.get("pg_collection"))
            if any(is_fp8_primary(p) for p in module.parameters()):
                # design §1.3 "FP8 primary weights": megatron's FP8-param path, routed to GTP
                check_fp8_primary_ddp(ddp_config)
                install_fp8_primary_hooks()
            if runtimes[0].config.shard_replicated_params_over_gtp:
                gtp_params = [p for p in module.parameters() if is_gtp_param(p)]
                route_gtp_params_to_second_buffer(module, gtp_params, ddp_config)
        super().__init__(config, ddp_config, module, *args, **kwargs)
        if runtimes and any(is_expert_param(p) for p in module.parameters()):
            rescale_expert_buffers(self, runtimes[0].groups.dims)

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


def release_finished_ddp_hooks() -> int:
    """Break the reference cycle every megatron DDP leaves behind, so a finished fit's model,
    gradient buffers and optimizer state can be freed (called by ``teardown_fit``).

    megatron's DDP registers one grad hook per parameter on its ``AccumulateGrad`` node, a
    closure over the DDP and the parameter: node -> hook -> DDP -> module -> parameter -> node.
    The node is a C++ object whose hooks Python's collector does not see, so the cycle is never
    collected: without this, a process that runs several fits keeps every earlier fit's model
    alive (on one GPU, six fits of the 1B recipe filled an H100). Emptying the hooks' closure
    cells cuts the cycle; call it only once the fits whose DDPs are alive are over (their
    backward would find no DDP). Returns how many hooks it emptied.

    Example::

        trainer.fit(model, datamodule=data)
        teardown_fit()  # calls release_finished_ddp_hooks()
    """
    import gc
    import types

    hook_name = f"{DistributedDataParallel.__qualname__}._make_backward_post_hook.<locals>.hook"
    emptied = 0
    for obj in gc.get_objects():  # type(), not isinstance(): some stand-ins raise on __class__
        if (
            type(obj) is types.FunctionType
            and obj.__qualname__ == hook_name
            and obj.__closure__ is not None
        ):
            for cell in obj.__closure__:
                cell.cell_contents = None
            emptied += 1
    return emptied

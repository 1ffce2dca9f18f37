"""The rank grid with the GTP axis (seed §3.1 "Process groups", §1.4).

One object validates every size (:class:`GTPParallelDims`, pure arithmetic, no collectives) and
builds every process group (:meth:`GTPParallelDims.build` -> :class:`GTPGroups`).

Rank order, fastest-varying first (seed §3.1: ``tp-gtp_remat-cp-ep-dp-pp``)::

    dense:  rank = tp + TP*(gtp + GTP*(cp + CP*(dp + DP*pp)))
    expert: rank = etp + ETP*(ep + EP*(egtp + EGTP*(edp + EDP*pp)))

With CP = 1 this is exactly megatron-core's default ``tp-cp-ep-dp-pp`` order with megatron's
data-parallel axis of size ``GTP*DP``: megatron's ``parallel_state`` (which knows nothing of GTP)
keeps finding the right TP/PP groups, and its data-parallel group *is* our ``data`` group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

_DENSE_AXES = ("tp", "gtp", "cp", "dp", "pp")
_EXPERT_AXES = ("etp", "ep", "egtp", "edp", "pp")


def _groups_varying(sizes: dict[str, int], vary: tuple[str, ...]) -> list[list[int]]:
    """All rank lists whose members differ only along ``vary`` (``sizes`` in rank order)."""
    axes = list(sizes)
    strides, stride = {}, 1
    for axis in axes:
        strides[axis] = stride
        stride *= sizes[axis]
    fixed = [a for a in axes if a not in vary]
    groups = []
    for fixed_coords in itertools.product(*(range(sizes[a]) for a in fixed)):
        base = sum(c * strides[a] for a, c in zip(fixed, fixed_coords))
        ranks = [
            base + sum(c * strides[a] for a, c in zip(vary, coords))
            for coords in itertools.product(*(range(sizes[a]) for a in vary))
        ]
        groups.append(sorted(ranks))
    return groups


@dataclass(frozen=True)
class GTPParallelDims:
    """Validated sizes of every parallel axis, GTP included (seed §2.1, §3.1).

    ``num_weight_shards`` is the seed's ``--tensor-parallel-num-weight-shards`` (= TP x GTP) and
    ``expert_num_weight_shards`` its expert twin (= ETP x EGTP). Every invalid combination raises
    ``ValueError`` naming the setting to change, before any collective runs.

    Example::

        dims = GTPParallelDims(world_size=8, tensor_model_parallel_size=2, num_weight_shards=4)
        dims.gtp, dims.dp          # (2, 2)
        groups = dims.build()      # after torch.distributed.init_process_group
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    num_weight_shards: int | None = None
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    expert_num_weight_shards: int | None = None
    num_distributed_optimizer_instances: int = 1
    gtp: int = field(init=False)
    dp: int = field(init=False)
    etp: int = field(init=False)
    egtp: int = field(init=False)
    edp: int = field(init=False)

    def __post_init__(self) -> None:
        def positive(name: str, value: int) -> None:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        tp = self.tensor_model_parallel_size
        for name in ("world_size", "tensor_model_parallel_size", "context_parallel_size",
                     "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "num_distributed_optimizer_instances"):
            positive(name, getattr(self, name))
        shards = tp if self.num_weight_shards is None else self.num_weight_shards
        positive("num_weight_shards", shards)
        if shards % tp != 0:
            raise ValueError(
                f"num_weight_shards={shards} must be a multiple of tensor_model_parallel_size={tp}"
                f" (num_weight_shards = TP x GTP, e.g. {tp * 2} for GTP=2)"
            )
        gtp = shards // tp
        model = tp * gtp * self.context_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % model != 0:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by num_weight_shards x "
                f"context_parallel_size x pipeline_model_parallel_size = {shards} x "
                f"{self.context_parallel_size} x {self.pipeline_model_parallel_size} = {model}: "
                "change num_weight_shards or the number of devices"
            )
        if gtp > 1 and self.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} with GTP={gtp} is not "
                "supported yet: set context_parallel_size=1 or num_weight_shards="
                f"tensor_model_parallel_size ({tp})"
            )
        etp = tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size
        positive("expert_tensor_parallel_size", etp)
        eshards = etp if self.expert_num_weight_shards is None else self.expert_num_weight_shards
        positive("expert_num_weight_shards", eshards)
        if eshards % etp != 0:
            raise ValueError(
                f"expert_num_weight_shards={eshards} must be a multiple of "
                f"expert_tensor_parallel_size={etp} (expert_num_weight_shards = ETP x EGTP)"
            )
        egtp = eshards // etp
        emodel = etp * self.expert_model_parallel_size * egtp * self.pipeline_model_parallel_size
        if self.world_size % emodel != 0:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by expert_num_weight_shards x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {eshards} x "
                f"{self.expert_model_parallel_size} x {self.pipeline_model_parallel_size} = "
                f"{emodel}: change expert_num_weight_shards or expert_model_parallel_size"
            )
        if (gtp > 1 or egtp > 1) and self.num_distributed_optimizer_instances != 1:
            raise ValueError(
                f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}"
                " is not supported with GTP (seed §3.2): set num_distributed_optimizer_instances=1"
            )
        object.__setattr__(self, "num_weight_shards", shards)
        object.__setattr__(self, "expert_tensor_parallel_size", etp)
        object.__setattr__(self, "expert_num_weight_shards", eshards)
        object.__setattr__(self, "gtp", gtp)
        object.__setattr__(self, "dp", self.world_size // model)
        object.__setattr__(self, "etp", etp)
        object.__setattr__(self, "egtp", egtp)
        object.__setattr__(self, "edp", self.world_size // emodel)

    @property
    def gtp_enabled(self) -> bool:
        """True when either weight axis shards (GTP > 1 or EGTP > 1)."""
        return self.gtp > 1 or self.egtp > 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that eat distinct microbatches: DP x GTP (seed §3.1 batch arithmetic)."""
        return self.dp * self.gtp

    def dense_sizes(self) -> dict[str, int]:
        """Dense axis sizes in rank order (fastest first)."""
        return dict(zip(_DENSE_AXES, (self.tensor_model_parallel_size, self.gtp,
                                      self.context_parallel_size, self.dp,
                                      self.pipeline_model_parallel_size)))

    def expert_sizes(self) -> dict[str, int]:
        """Expert axis sizes in rank order (fastest first)."""
        return dict(zip(_EXPERT_AXES, (self.etp, self.expert_model_parallel_size, self.egtp,
                                       self.edp, self.pipeline_model_parallel_size)))

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates of ``rank``: ``{'tp': 1, 'gtp': 0, 'cp': 0, 'dp': 1, 'pp': 0}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world_size={self.world_size}")
        out = {}
        for axis, size in self.dense_sizes().items():
            out[axis], rank = rank % size, rank // size
        return out

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Rank lists of every group :meth:`build` creates, by group name."""
        dense, expert = self.dense_sizes(), self.expert_sizes()
        return {
            "gtp": _groups_varying(dense, ("gtp",)),
            "replicate": _groups_varying(dense, ("dp",)),
            "data": _groups_varying(dense, ("gtp", "dp")),
            "model_parallel": _groups_varying(dense, ("tp", "gtp", "pp")),
            "expert_gtp": _groups_varying(expert, ("egtp",)),
            "expert_replicate": _groups_varying(expert, ("edp",)),
            "expert_data": _groups_varying(expert, ("egtp", "edp")),
        }

    def build(self, gtp_pg_options: object | None = None) -> GTPGroups:
        """Create the GTP process groups; collective over the whole world.

        Every rank must call it in the same order (``torch.distributed.new_group`` is
        collective). Requires an initialized default process group of ``world_size`` ranks.
        ``gtp_pg_options`` (e.g. ``ProcessGroupNCCL.Options`` with a high-priority stream or
        ``config.max_ctas``) applies to the GTP groups only, whose gathers run beside the GEMMs.
        """
        if not dist.is_initialized():
            raise RuntimeError("GTPParallelDims.build() needs torch.distributed initialized first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"GTPParallelDims.world_size={self.world_size} but torch.distributed has "
                f"{dist.get_world_size()} ranks"
            )
        rank = dist.get_rank()
        mine: dict[str, dist.ProcessGroup] = {}
        for name, rank_lists in self.group_ranks().items():
            for ranks in rank_lists:
                options = gtp_pg_options if name == "gtp" else None
                group = dist.new_group(ranks, pg_options=options)
                if rank in ranks:
                    mine[name] = group
        return GTPGroups(dims=self, rank=rank, **mine)


@dataclass(frozen=True)
class GTPGroups:
    """This rank's GTP process groups (seed §3.1). Built by :meth:`GTPParallelDims.build`.

    Attributes:
        gtp: the GTP peers holding the other shards of every dense GTP weight.
        replicate: DP without GTP; megatron DDP and the distributed optimizer reduce over it.
        data: DP x GTP; each member eats a distinct microbatch (megatron's data-parallel group).
        model_parallel: TP x GTP x PP; the grad-norm group of the non-distributed optimizer.
        expert_gtp / expert_replicate / expert_data: the expert-side equivalents.
    """

    dims: GTPParallelDims
    rank: int
    gtp: dist.ProcessGroup
    replicate: dist.ProcessGroup
    data: dist.ProcessGroup
    model_parallel: dist.ProcessGroup
    expert_gtp: dist.ProcessGroup
    expert_replicate: dist.ProcessGroup
    expert_data: dist.ProcessGroup

    @property
    def gtp_size(self) -> int:
        """Size of the dense GTP axis."""
        return self.dims.gtp

    @property
    def gtp_rank(self) -> int:
        """This rank's position on the dense GTP axis."""
        return self.dims.coords(self.rank)["gtp"]

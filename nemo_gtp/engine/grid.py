"""The rank grid with the GTP axis (design §3.1 "Process groups", §1.4).

One object derives and validates every size (:class:`GTPParallelDims`, pure arithmetic, no
collectives; statically from a trainer's arguments, then against the world size with
:meth:`GTPParallelDims.with_world_size`) and builds every process group
(:meth:`GTPParallelDims.build` -> :class:`GTPGroups`, whose GTP size and rank come from it).

Rank order, fastest-varying first (design §3.1 "Process groups")::

    dense:  rank = tp + TP*(cp + CP*(gtp + GTP*(dp + DP*pp)))
    expert: rank = etp + ETP*(ep + EP*(egtp + EGTP*(edp + EDP*pp)))

This is megatron-core's default ``tp-cp-ep-dp-pp`` order with megatron's data-parallel axis of
size ``GTP*DP`` and the GTP axis its fastest part: megatron's ``parallel_state`` (which knows
nothing of GTP) keeps finding the right TP/CP/PP groups, and its data-parallel group *is* our
``data`` group. (Upstream's GTP, which megatron knows, puts GTP before CP; with CP = 1 the two
orders are the same.)
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in build(): the sizes are pure arithmetic, checked without torch
    import torch.distributed as dist

_DENSE_AXES = ("tp", "cp", "gtp", "dp", "pp")
_EXPERT_AXES = ("etp", "ep", "egtp", "edp", "pp")


class WeightAxis(enum.Enum):
    """Which weight-sharding axis a :class:`~nemo_gtp.engine.runtime.GTPRuntime` drives
    (design §1.4 "EP / expert GTP")."""

    DENSE = "dense"
    """The GTP axis: every linear outside the routed experts (attention, dense MLP, shared
    experts), sharded over ``GTPGroups.gtp``."""
    EXPERT = "expert"
    """The expert GTP (EGTP) axis: routed-expert linears, sharded over ``GTPGroups.expert_gtp``,
    beside ETP and EP."""


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


def _check_positive(name: str, value: object, hint: str = "") -> None:
    """``value`` (the setting ``name``) must be a positive ``int`` (``True`` is not a size)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer, got {name}={value!r}"
            + (f" ({hint})" if hint else "")
        )


@dataclass(frozen=True)
class GTPParallelDims:
    """Validated sizes of every parallel axis, GTP included (design §2.1, §3.1).

    The one place that derives and validates the GTP degree: ``num_weight_shards`` is Megatron-LM's
    ``--tensor-parallel-num-weight-shards`` (= TP x GTP) and ``expert_num_weight_shards`` its
    expert twin (= ETP x EGTP). Every invalid combination raises ``ValueError`` naming the setting
    to change, before any collective runs.

    Two stages, because a trainer's arguments are known before its world is:

    - ``world_size=None`` (static): every check that does not need the world size (sizes
      positive, shards vs TP and EGTP vs ETP, CP with expert GTP, distributed-optimizer
      instances);
      ``gtp`` / ``etp`` / ``egtp`` are known, ``dp`` / ``edp`` and the rank grid are not.
    - :meth:`with_world_size` (complete): the same sizes, also checked against the world size.

    Example::

        static = GTPParallelDims(tensor_model_parallel_size=2, num_weight_shards=4)
        static.gtp                 # 2, known before any process group
        dims = static.with_world_size(8)
        dims.gtp, dims.dp          # (2, 2)
        groups = dims.build()      # after torch.distributed.init_process_group
    """

    world_size: int | None = None
    tensor_model_parallel_size: int = 1
    num_weight_shards: int | None = None
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    expert_num_weight_shards: int | None = None
    num_distributed_optimizer_instances: int = 1
    gtp: int = field(init=False)
    etp: int = field(init=False)
    egtp: int = field(init=False)

    def __post_init__(self) -> None:
        tp = self.tensor_model_parallel_size
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "num_distributed_optimizer_instances",
        ):
            _check_positive(name, getattr(self, name))
        if self.world_size is not None:
            _check_positive("world_size", self.world_size)
        shards = tp if self.num_weight_shards is None else self.num_weight_shards
        _check_positive(
            "num_weight_shards", shards, "num_weight_shards = TP x GTP; None means TP, i.e. GTP off"
        )
        if shards % tp != 0:
            raise ValueError(
                f"num_weight_shards={shards} must be a multiple of tensor_model_parallel_size={tp}"
                f" (num_weight_shards = TP x GTP, e.g. {tp * 2} for GTP=2)"
            )
        gtp = shards // tp
        etp = tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size
        _check_positive("expert_tensor_parallel_size", etp)
        eshards = etp if self.expert_num_weight_shards is None else self.expert_num_weight_shards
        _check_positive(
            "expert_num_weight_shards",
            eshards,
            "expert_num_weight_shards = ETP x EGTP; None means ETP, i.e. EGTP off",
        )
        if eshards % etp != 0:
            raise ValueError(
                f"expert_num_weight_shards={eshards} must be a multiple of "
                f"expert_tensor_parallel_size={etp} (expert_num_weight_shards = ETP x EGTP)"
            )
        egtp = eshards // etp
        if gtp > 1 or egtp > 1:
            self.check_distributed_optimizer_instances(self.num_distributed_optimizer_instances)
        object.__setattr__(self, "num_weight_shards", shards)
        object.__setattr__(self, "expert_tensor_parallel_size", etp)
        object.__setattr__(self, "expert_num_weight_shards", eshards)
        object.__setattr__(self, "gtp", gtp)
        object.__setattr__(self, "etp", etp)
        object.__setattr__(self, "egtp", egtp)
        if self.world_size is not None:
            self._check_world_size()

    def _check_world_size(self) -> None:
        """The checks that need the world size: both grids tile it."""
        world, pp = self.world_size, self.pipeline_model_parallel_size
        if world % self._dense_model_size != 0:
            raise ValueError(
                f"world_size={world} is not divisible by num_weight_shards x "
                f"context_parallel_size x pipeline_model_parallel_size = "
                f"{self.num_weight_shards} x {self.context_parallel_size} x {pp} = "
                f"{self._dense_model_size}: change num_weight_shards, "
                + ("context_parallel_size, " if self.context_parallel_size > 1 else "")
                + ("pipeline_model_parallel_size, " if pp > 1 else "")
                + "or the number of devices"
            )
        if world % self._expert_model_size != 0:
            raise ValueError(
                f"world_size={world} is not divisible by expert_num_weight_shards x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = "
                f"{self.expert_num_weight_shards} x {self.expert_model_parallel_size} x {pp} = "
                f"{self._expert_model_size}: change expert_num_weight_shards or "
                "expert_model_parallel_size"
            )

    @staticmethod
    def check_distributed_optimizer_instances(instances: int, where: str = "") -> None:
        """GTP needs one distributed-optimizer instance (design §3.2); ``where`` prefixes the
        setting's name in the message (e.g. ``"ddp: DistributedDataParallelConfig."``)."""
        if instances != 1:
            raise ValueError(
                f"{where}num_distributed_optimizer_instances={instances} is not supported with "
                "GTP (design §3.2): set num_distributed_optimizer_instances=1"
            )

    def with_world_size(self, world_size: int) -> GTPParallelDims:
        """These sizes on a world of ``world_size`` ranks, fully validated.

        Example::

            GTPParallelDims(num_weight_shards=2).with_world_size(3)  # ValueError: not divisible
        """
        return replace(self, world_size=world_size)

    @property
    def has_world_size(self) -> bool:
        """True once the world size is known (``dp``, ``edp`` and the rank grid are defined)."""
        return self.world_size is not None

    @property
    def _dense_model_size(self) -> int:
        return (
            self.num_weight_shards * self.context_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def _expert_model_size(self) -> int:
        return (
            self.expert_num_weight_shards
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )

    def _world(self, what: str) -> int:
        if self.world_size is None:
            raise RuntimeError(
                f"GTPParallelDims.{what} needs the world size: use dims.with_world_size(n)"
            )
        return self.world_size

    @property
    def dp(self) -> int:
        """Replicas of every dense GTP shard (DP without GTP); needs the world size."""
        return self._world("dp") // self._dense_model_size

    @property
    def edp(self) -> int:
        """Replicas of every expert GTP shard; needs the world size."""
        return self._world("edp") // self._expert_model_size

    @property
    def expert_data_parallel_size(self) -> int:
        """megatron's expert data-parallel size, EGTP x EDP (the ranks holding one expert's
        pieces, each fed distinct tokens); needs the world size."""
        return self.egtp * self.edp

    @property
    def gtp_enabled(self) -> bool:
        """True when either weight axis shards (GTP > 1 or EGTP > 1)."""
        return self.gtp > 1 or self.egtp > 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that eat distinct microbatches: DP x GTP (design §3.1 batch arithmetic)."""
        return self.dp * self.gtp

    def dense_sizes(self) -> dict[str, int]:
        """Dense axis sizes in rank order (fastest first); needs the world size."""
        return dict(
            zip(
                _DENSE_AXES,
                (
                    self.tensor_model_parallel_size,
                    self.context_parallel_size,
                    self.gtp,
                    self.dp,
                    self.pipeline_model_parallel_size,
                ),
            )
        )

    def expert_sizes(self) -> dict[str, int]:
        """Expert axis sizes in rank order (fastest first); needs the world size."""
        return dict(
            zip(
                _EXPERT_AXES,
                (
                    self.etp,
                    self.expert_model_parallel_size,
                    self.egtp,
                    self.edp,
                    self.pipeline_model_parallel_size,
                ),
            )
        )

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates of ``rank``: ``{'tp': 1, 'cp': 0, 'gtp': 0, 'dp': 1, 'pp': 0}``."""
        if not 0 <= rank < self._world("coords"):
            raise ValueError(f"rank {rank} outside world_size={self.world_size}")
        out = {}
        for axis, size in self.dense_sizes().items():
            out[axis], rank = rank % size, rank // size
        return out

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Expert coordinates of ``rank``: ``{'etp': 0, 'ep': 1, 'egtp': 1, 'edp': 0, 'pp': 0}``."""
        if not 0 <= rank < self._world("expert_coords"):
            raise ValueError(f"rank {rank} outside world_size={self.world_size}")
        out = {}
        for axis, size in self.expert_sizes().items():
            out[axis], rank = rank % size, rank // size
        return out

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Rank lists of every group :meth:`build` creates, by group name."""
        dense, expert = self.dense_sizes(), self.expert_sizes()
        return {
            "gtp": _groups_varying(dense, ("gtp",)),
            "replicate": _groups_varying(dense, ("dp",)),
            "replicate_cp": _groups_varying(dense, ("cp", "dp")),
            "data": _groups_varying(dense, ("gtp", "dp")),
            "model_parallel": _groups_varying(dense, ("tp", "gtp", "pp")),
            "expert_gtp": _groups_varying(expert, ("egtp",)),
            "expert_replicate": _groups_varying(expert, ("edp",)),
            "expert_data": _groups_varying(expert, ("egtp", "edp")),
            "expert_model_parallel": _groups_varying(expert, ("etp", "ep", "egtp", "pp")),
        }

    def build(self, gtp_pg_options: object | None = None) -> GTPGroups:
        """Create the GTP process groups; collective over the whole world.

        Every rank must call it in the same order (``torch.distributed.new_group`` is
        collective). Requires an initialized default process group of ``world_size`` ranks.
        ``gtp_pg_options`` (e.g. ``ProcessGroupNCCL.Options`` with a high-priority stream or
        ``config.max_ctas``) applies to the GTP and expert-GTP groups only, whose gathers run
        beside the GEMMs.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("GTPParallelDims.build() needs torch.distributed initialized first")
        if dist.get_world_size() != self._world("build()"):
            raise ValueError(
                f"GTPParallelDims.world_size={self.world_size} but torch.distributed has "
                f"{dist.get_world_size()} ranks"
            )
        rank = dist.get_rank()
        mine: dict[str, dist.ProcessGroup] = {}
        for name, rank_lists in self.group_ranks().items():
            if name == "replicate_cp" and self.context_parallel_size == 1:
                continue  # the replicate group itself (below): no second communicator
            for ranks in rank_lists:
                options = gtp_pg_options if name in ("gtp", "expert_gtp") else None
                group = dist.new_group(ranks, pg_options=options)
                if rank in ranks:
                    mine[name] = group
        mine.setdefault("replicate_cp", mine["replicate"])
        return GTPGroups(dims=self, rank=rank, **mine)


@dataclass(frozen=True)
class GTPGroups:
    """This rank's GTP process groups (design §3.1). Built by :meth:`GTPParallelDims.build`.

    Attributes:
        gtp: the GTP peers holding the other shards of every dense GTP weight.
        replicate: DP without GTP (the ranks holding the same shards and eating distinct
            samples).
        replicate_cp: CP x DP without GTP, the ranks holding the same shards; megatron DDP
            and the distributed optimizer reduce and shard over it (its ``dp_cp`` groups; CP
            peers eat the chunks of one sample). The replicate group itself when CP is 1.
        data: DP x GTP; each member eats a distinct microbatch (megatron's data-parallel group,
            without CP).
        model_parallel: TP x GTP x PP; the grad-norm group of the non-distributed optimizer.
        expert_gtp: the EGTP peers holding the other shards of every routed-expert weight.
        expert_replicate: EDP (expert data-parallel without EGTP); DDP's expert buffer and the
            expert optimizer reduce and shard over it.
        expert_data: EGTP x EDP, megatron's expert data-parallel group.
        expert_model_parallel: ETP x EP x EGTP x PP; the expert optimizer's grad-norm group.
    """

    dims: GTPParallelDims
    rank: int
    gtp: dist.ProcessGroup
    replicate: dist.ProcessGroup
    replicate_cp: dist.ProcessGroup
    data: dist.ProcessGroup
    model_parallel: dist.ProcessGroup
    expert_gtp: dist.ProcessGroup
    expert_replicate: dist.ProcessGroup
    expert_data: dist.ProcessGroup
    expert_model_parallel: dist.ProcessGroup

    @property
    def gtp_size(self) -> int:
        """Size of the dense GTP axis."""
        return self.dims.gtp

    @property
    def gtp_rank(self) -> int:
        """This rank's position on the dense GTP axis."""
        return self.dims.coords(self.rank)["gtp"]

    @property
    def expert_gtp_size(self) -> int:
        """Size of the expert GTP (EGTP) axis."""
        return self.dims.egtp

    @property
    def expert_gtp_rank(self) -> int:
        """This rank's position on the expert GTP axis."""
        return self.dims.expert_coords(self.rank)["egtp"]

    def weight_axis(self, axis: WeightAxis) -> tuple[dist.ProcessGroup, int, int]:
        """``(group, size, rank)`` of the weight-sharding ``axis`` (what a runtime drives).

        Example::

            group, size, rank = groups.weight_axis(WeightAxis.EXPERT)  # the EGTP axis
        """
        if axis is WeightAxis.EXPERT:
            return self.expert_gtp, self.expert_gtp_size, self.expert_gtp_rank
        return self.gtp, self.gtp_size, self.gtp_rank


# ------------------------------------------------------------------------------ layout rules
# Each rule of a layout lives here once, torch-free, so the strategy, the recipe CLI
# (recipes.validate, before any worker), with_gtp and the planner refuse a layout with the
# same words. ``key`` / ``prefix`` arguments name the setting as the caller's user writes it
# ("strategy." in a YAML recipe, "trainer.strategy." in a NeMo recipe, "" for the strategy's
# own arguments), so every error names the key to change and the fix.

SIZE_SETTINGS = (
    "tensor_model_parallel_size",
    "num_weight_shards",
    "context_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "expert_num_weight_shards",
    "num_distributed_optimizer_instances",
)
"""The strategy settings :class:`GTPParallelDims` is built from (megatron's names)."""


def layout_dims(settings: Mapping[str, object], where: str = "") -> GTPParallelDims:
    """The static :class:`GTPParallelDims` of a strategy's ``settings`` (a mapping holding any
    of :data:`SIZE_SETTINGS`; a missing or ``None`` one takes the default). ``ValueError``
    naming the setting, prefixed with ``where`` (e.g. ``"trainer.strategy"``) when given.

    Example::

        layout_dims({"num_weight_shards": 3, "tensor_model_parallel_size": 2}, "strategy")
        # ValueError: strategy: num_weight_shards=3 must be a multiple of ...
    """
    sizes = {k: settings[k] for k in SIZE_SETTINGS if settings.get(k) is not None}
    try:
        return GTPParallelDims(world_size=None, **sizes)  # type: ignore[arg-type]
    except ValueError as err:
        if not where:
            raise
        raise ValueError(f"{where}: {err}") from None


def on_world(
    dims: GTPParallelDims, devices: int, nodes: int, key: str = "num_weight_shards"
) -> GTPParallelDims:
    """``dims`` on ``devices x nodes`` ranks (:meth:`GTPParallelDims.with_world_size`), the
    error naming ``key`` (how the caller spells ``num_weight_shards``) and the trainer's sizes.

    Example::

        on_world(GTPParallelDims(num_weight_shards=4), 3, 1, key="strategy.num_weight_shards")
        # ValueError: strategy.num_weight_shards=4 on trainer.devices x trainer.num_nodes = ...
    """
    try:
        return dims.with_world_size(devices * nodes)
    except ValueError as err:
        raise ValueError(
            f"{key}={dims.num_weight_shards} on trainer.devices x trainer.num_nodes = "
            f"{devices} x {nodes} ranks: {err}"
        ) from None


def check_global_batch(
    dims: GTPParallelDims, micro_batch_size: int, global_batch_size: int, prefix: str = "data."
) -> None:
    """The global batch divides into microbatches over the data-parallel ranks, DP x GTP (each
    GTP peer eats its own microbatch, design §3.1); ``dims`` has its world size. ``prefix``
    spells the data section.

    Example::

        check_global_batch(GTPParallelDims(num_weight_shards=4).with_world_size(4), 4, 8)
        # ValueError: data.global_batch_size=8 must be a multiple of ... set ...=16
    """
    ranks = dims.data_parallel_size
    unit = micro_batch_size * ranks
    if global_batch_size % unit != 0:
        fixed = max(1, round(global_batch_size / unit)) * unit
        raise ValueError(
            f"{prefix}global_batch_size={global_batch_size} must be a multiple of "
            f"{prefix}micro_batch_size x data-parallel ranks (DP x GTP = {dims.dp} x {dims.gtp}) "
            f"= {micro_batch_size} x {ranks} = {unit}: set {prefix}global_batch_size={fixed}"
        )


def check_checkpoint_format(save_ckpt_format: str | None, key: str = "save_ckpt_format") -> None:
    """GTP checkpoints are megatron ``torch_dist`` (design §3.3); other formats (zarr, deprecated
    in megatron, or ``None``) would fail only at the first save. For a layout with GTP on; a
    caller whose setting is unset passes its default, ``"torch_dist"``.

    Example::

        check_checkpoint_format("zarr", key="strategy.save_ckpt_format")  # ValueError
    """
    if save_ckpt_format != "torch_dist":
        raise ValueError(
            f"{key}={save_ckpt_format!r} is not supported with GTP: set {key}=torch_dist (GTP "
            "checkpoints are megatron torch_dist, design §3.3)"
        )


def check_pipeline_split(
    num_layers: int, pp: int, vp: int | None = None, key: str = "model.num_layers"
) -> None:
    """The layers split evenly over the ``pp`` pipeline stages (x ``vp`` virtual stages) of
    design §1.4 "PP".

    Example::

        check_pipeline_split(2, 2, 2)  # ValueError: ... set model.num_layers to a multiple of 4
    """
    chunks = pp * (vp or 1)
    if num_layers % chunks:
        what = f"{pp} pipeline stages" + (f" x {vp} virtual stages" if vp else "")
        raise ValueError(
            f"{key}={num_layers} does not split evenly over {what}: set {key} to a multiple of "
            f"{chunks}"
        )


def check_expert_shards(
    egtp: int,
    num_experts: int | None,
    experts_key: str = "num_moe_experts",
    shards_key: str = "expert_num_weight_shards",
) -> None:
    """Expert GTP (``egtp`` > 1: ``expert_num_weight_shards`` > ETP) shards routed experts, so
    the model must have them (design §1.4 "EP / expert GTP"); the keys as the caller spells them.

    Example::

        check_expert_shards(2, None)
        # ValueError: expert GTP=2 (expert_num_weight_shards > ...) ... num_moe_experts is not set
    """
    if egtp > 1 and not num_experts:
        raise ValueError(
            f"expert GTP={egtp} ({shards_key} > the expert tensor-parallel size) shards routed "
            f"experts, but {experts_key} is not set: set {experts_key}, or leave {shards_key} "
            "unset (expert GTP off)"
        )


def refuse_legacy_grouped_experts(egtp: int, reason: str, fix: str) -> None:
    """Expert GTP shards megatron's ``SequentialMLP`` and ``TEGroupedMLP`` experts, not the legacy
    ``GroupedMLP`` (design §1.4). ``reason`` says, in the caller's keys, why its config builds
    the legacy one (empty: it does not); ``fix`` names the settings to change.

    Example::

        refuse_legacy_grouped_experts(2, "moe_use_legacy_grouped_gemm=True",
                                      "set moe_use_legacy_grouped_gemm=False")  # ValueError
    """
    if egtp > 1 and reason:
        raise ValueError(
            f"expert GTP={egtp} shards SequentialMLP and TEGroupedMLP experts, but {reason} "
            "builds megatron's legacy GroupedMLP (grouped_gemm package), which expert GTP does "
            f"not shard (design §1.4): {fix}"
        )

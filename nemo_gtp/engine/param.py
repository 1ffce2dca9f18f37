"""``GTPShardedParam``: one GTP-sharded weight and its per-direction state machines (seed §1.1).

[Note: tensor roles]
- *shard*: the param's own data, rows ``[r*s, (r+1)*s)`` of the TP-local weight padded at the
  tail to ``padded_dim0`` rows (seed §1.3 "Padding"). The optimizer and DDP see only this.
- *gathered weight*: the full padded TP-local weight, all-gathered over the GTP group into a
  buffer of the runtime's weight cache just before a GEMM and released right after it;
  :meth:`ShardSpec.unpad` strips the pad rows before the GEMM sees it.
- *wgrad scratch*: a full padded-shape buffer from the runtime's wgrad pool that the backward
  writes the unsharded weight gradient into; reduce-scattered down to the shard.
- *main_grad*: megatron DDP's gradient-buffer view of this param (shard-shaped); the reduced
  shard is added into it, then DDP's grad-ready hook fires (seed §3.2 ordering invariant).
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from nemo_gtp.engine.collectives import CommHandle
    from nemo_gtp.engine.runtime import GTPRuntime


class Direction(enum.Enum):
    """Which GEMM a gathered weight feeds; each direction has its own state machine and buffer."""

    FWD = "fwd"
    """Forward GEMM; the prefetch chain walks forward order (``next_w``)."""
    BWD = "bwd"
    """Backward dgrad GEMM; the prefetch chain walks reverse order (``prev_w``)."""


class GatherState(enum.Enum):
    """All-gather state of one direction of one weight (§1.1: NONE → ASYNC_WAIT → DATA_READY)."""

    NONE = "none"
    """No gathered copy exists; the direction holds no buffer."""
    ASYNC_WAIT = "async_wait"
    """A prefetch all-gather was issued into a held buffer; its handle is not yet waited."""
    DATA_READY = "data_ready"
    """The gathered weight is complete in the held buffer; released after its GEMM."""


class ReduceScatterState(enum.Enum):
    """Weight-gradient reduce-scatter state of one weight (seed §1.1 ``rs_state``)."""

    NONE = "none"
    """Nothing in flight; main_grad holds every finalized contribution."""
    ASYNC_WAIT = "async_wait"
    """A reduce-scatter was issued; scratch and output stay held until the deferred finalize."""
    DATA_READY = "data_ready"
    """Waited: the reduced shard is in the output buffer, about to be added into main_grad."""


@dataclass(frozen=True)
class ShardSpec:
    """How a TP-local weight is cut along dim 0 over the GTP group (seed §1.3, §1.4).

    Example::

        spec = ShardSpec.for_weight((72, 64), gtp_size=2, gtp_rank=1, pad_for_alignment=16)
        spec.padded_dim0, spec.shard_dim0, spec.pad_length   # (96, 48, 24)
    """

    logical_shape: tuple[int, ...]
    gtp_size: int
    gtp_rank: int
    padded_dim0: int

    @classmethod
    def for_weight(
        cls, shape: tuple[int, ...] | torch.Size, gtp_size: int, gtp_rank: int,
        pad_for_alignment: int,
    ) -> ShardSpec:
        """Spec for a TP-local weight of ``shape``, padding dim 0 to ``pad * gtp`` rows."""
        if len(shape) < 1 or shape[0] < 1:
            raise ValueError(f"cannot GTP-shard a weight of shape {tuple(shape)}")
        unit = pad_for_alignment * gtp_size
        padded = math.ceil(shape[0] / unit) * unit
        return cls(tuple(shape), gtp_size, gtp_rank, padded)

    @property
    def shard_dim0(self) -> int:
        """Rows of every rank's shard (pad included)."""
        return self.padded_dim0 // self.gtp_size

    @property
    def pad_length(self) -> int:
        """Zero rows appended at the tail of the TP-local weight."""
        return self.padded_dim0 - self.logical_shape[0]

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of this rank's shard."""
        return (self.shard_dim0, *self.logical_shape[1:])

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """Shape of the all-gathered (padded) weight and of the wgrad scratch."""
        return (self.padded_dim0, *self.logical_shape[1:])

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard of the TP-local ``full`` weight (a new tensor)."""
        if tuple(full.shape) != self.logical_shape:
            raise ValueError(
                f"weight shape {tuple(full.shape)} does not match spec {self.logical_shape}"
            )
        padded = F.pad(full.detach(), (0, 0) * (full.dim() - 1) + (0, self.pad_length))
        start = self.gtp_rank * self.shard_dim0
        return padded[start : start + self.shard_dim0].clone()

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The logical (unpadded) view of a gathered weight or wgrad scratch."""
        return gathered[: self.logical_shape[0]]


@dataclass
class GatherSlot:
    """State of one direction's all-gather for one weight."""

    state: GatherState = GatherState.NONE
    handle: CommHandle | None = None
    buffer: torch.Tensor | None = None
    key: Any = None


@dataclass
class ReduceScatterSlot:
    """State of one weight's in-flight wgrad reduce-scatter."""

    state: ReduceScatterState = ReduceScatterState.NONE
    handle: CommHandle | None = None
    scratch: torch.Tensor | None = None
    output: torch.Tensor | None = None
    recv: torch.Tensor | None = None


@dataclass
class GTPParamState:
    """Runtime bookkeeping the owning :class:`GTPRuntime` keeps on each param."""

    name: str = ""
    runtime: weakref.ReferenceType[GTPRuntime] | None = None
    chain_id: Any = None
    gather: dict[Direction, GatherSlot] = field(
        default_factory=lambda: {d: GatherSlot() for d in Direction}
    )
    reduce_scatter: ReduceScatterSlot = field(default_factory=ReduceScatterSlot)
    parity: int = 0
    grad_ready_hook: Callable[[], None] | None = None
    forward_grad_enabled: bool = False
    """Grad mode at the owning TE module's call: TE materializes inside its autograd forward,
    where grad mode is off, so the runtime reads this instead (set by a forward pre-hook)."""


class GTPShardedParam(torch.nn.Parameter):
    """The dim-0 GTP shard of a TP-local weight, as an ``nn.Parameter`` (seed §1.1, §3.1).

    Built by the model transform (``nemo_gtp.integrations.megatron.shard_model``) or
    :func:`nemo_gtp.engine.linear.shard_linear`; owned by one :class:`GTPRuntime`, which drives
    its gather / reduce-scatter state machines. DDP and the optimizer treat it as an ordinary
    param of the shard's shape.

    Example::

        spec = ShardSpec.for_weight(full.shape, gtp_size=2, gtp_rank=rank, pad_for_alignment=16)
        param = GTPShardedParam(spec.shard(full), spec=spec)
    """

    is_gtp_weight_remat = True
    is_distributed_weight = True

    gtp_spec: ShardSpec
    gtp_state: GTPParamState

    def __new__(
        cls, data: torch.Tensor | None = None, requires_grad: bool = True, *,
        spec: ShardSpec | None = None,
    ) -> GTPShardedParam:
        if spec is None:
            raise TypeError("GTPShardedParam needs spec=ShardSpec(...)")
        if data is None or tuple(data.shape) != spec.shard_shape:
            raise ValueError(
                f"shard shape {None if data is None else tuple(data.shape)} does not match "
                f"spec.shard_shape {spec.shard_shape}"
            )
        param = super().__new__(cls, data, requires_grad)
        param.gtp_spec = spec
        param.gtp_state = GTPParamState()
        return param

    def __deepcopy__(self, memo: dict) -> GTPShardedParam:
        copy = type(self)(self.data.clone(), self.requires_grad, spec=self.gtp_spec)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, proto: int) -> Any:
        # Pickles as a plain Parameter of the shard: runtime state never leaves the process.
        return (torch.nn.Parameter, (self.data, self.requires_grad))

    def __repr__(self) -> str:
        return (
            f"GTPShardedParam(name={self.gtp_state.name!r}, shard={tuple(self.shape)}, "
            f"logical={self.gtp_spec.logical_shape}, gtp={self.gtp_spec.gtp_rank}/"
            f"{self.gtp_spec.gtp_size}, dtype={self.dtype})"
        )

    @property
    def runtime(self) -> GTPRuntime:
        """The :class:`GTPRuntime` that owns this param."""
        ref = self.gtp_state.runtime
        runtime = ref() if ref is not None else None
        if runtime is None:
            raise RuntimeError(
                f"{self!r} is not registered with a live GTPRuntime (was its model's runtime "
                "dropped, or the param built outside the model transform?)"
            )
        return runtime

    def register_grad_accum_hook(self, hook: Callable[[], None]) -> None:
        """Store DDP's grad-ready hook; fired after each finalize into main_grad (seed §3.2)."""
        self.gtp_state.grad_ready_hook = hook

    # [Note: TransformerEngine DistributedWeight protocol] (seed §3.1 "The bridge")
    # TE >= 2.19 gates on ``is_distributed_weight`` and calls these on the leader of a weight
    # group (``weights[0]``; a te.Linear has a group of one). TE never tells us when its GEMM is
    # done, so a protocol-materialized buffer is released at the next protocol materialize of
    # the same chain and direction (stream order makes that safe) or at the next drain. TE gets
    # a requires-grad alias of the buffer (LayerNormLinear decides on wgrad from it), and its
    # wgrad through finalize_group_grads (or grad_buffer() under fuse_wgrad_accumulation).
    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        """Full weights for TE's forward GEMM (prefetches ``next_w``)."""
        return [self.runtime.materialize_for_protocol(self, Direction.FWD)]

    def materialize_group_for_backward(self) -> list[torch.Tensor]:
        """Full weights for TE's dgrad GEMM (prefetches ``prev_w``)."""
        return [self.runtime.materialize_for_protocol(self, Direction.BWD)]

    def grad_buffer(self) -> torch.Tensor:
        """Full-size (unpadded view) wgrad scratch TE's fused wgrad GEMM writes into."""
        return self.runtime.protocol_grad_buffer(self)

    def finalize_group_grads(self, wgrads: torch.Tensor | list[torch.Tensor]) -> None:
        """Reduce-scatter TE's full wgrad(s) into ``main_grad``; None tells TE it is async."""
        grads = list(wgrads) if isinstance(wgrads, (list, tuple)) else [wgrads]
        if len(grads) != 1:
            raise ValueError(f"{self!r} leads a group of 1 weight, got {len(grads)} wgrads")
        self.runtime.reduce_scatter_foreign_wgrad(self, grads[0])
        return None


def carry_param_attributes(old: torch.Tensor, new: torch.Tensor) -> None:
    """Copy megatron's attributes from param ``old`` onto its replacement ``new``.

    Everything megatron set (``tensor_model_parallel``, ``partition_dim``, ...) is carried over
    except DDP's gradient state (``main_grad``, ``grad_added_to_main_grad``), which belongs to
    the old tensor's shape.

    Example::

        shard = GTPShardedParam(spec.shard(old), old.requires_grad, spec=spec)
        carry_param_attributes(old, shard)
    """
    for key, value in vars(old).items():
        if key not in ("main_grad", "grad_added_to_main_grad"):
            setattr(new, key, value)


def is_gtp_param(tensor: object) -> bool:
    """True for a :class:`GTPShardedParam` (the seed's ``is_gtp_param``)."""
    return isinstance(tensor, GTPShardedParam)

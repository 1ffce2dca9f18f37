"""``GTPShardedParam``: one GTP-sharded weight and the runtime state it carries (design §1.1).

Its state machines (gather slots per direction, the reduce-scatter slot) are
:mod:`nemo_gtp.engine.slots`, its geometry :class:`~nemo_gtp.engine.shard.ShardSpec`.

[Note: tensor roles]
- *shard*: the param's own data, rows ``[r*s, (r+1)*s)`` of the TP-local weight padded at the
  tail to ``padded_dim0`` rows (design §1.3 "Padding"). The optimizer and DDP see only this.
- *gathered weight*: the full padded TP-local weight, all-gathered over the GTP group into a
  buffer of the runtime's weight cache just before a GEMM and released right after it;
  :meth:`ShardSpec.unpad` strips the pad rows before the GEMM sees it.
- *wgrad scratch*: a full padded-shape buffer from the runtime's wgrad pool that the backward
  writes the unsharded weight gradient into; reduce-scattered down to the shard.
- *main_grad*: megatron DDP's gradient-buffer view of this param (shard-shaped); the reduced
  shard is added into it, then DDP's grad-ready hook fires (design §3.2 ordering invariant).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nemo_gtp.engine.fp8 import dequantize_fp8
from nemo_gtp.engine.shard import ShardSpec
from nemo_gtp.engine.slots import (
    Direction,
    GatherSlot,
    GatherState,
    GTPStateError,
    ReduceScatterSlot,
    ReduceScatterState,
    SharedWork,
)

__all__ = [  # the state machines live in nemo_gtp.engine.slots; re-exported for the param's users
    "Direction",
    "GatherSlot",
    "GatherState",
    "GTPParamState",
    "GTPShardedParam",
    "GTPStateError",
    "ReduceScatterSlot",
    "ReduceScatterState",
    "ShardSpec",
    "SharedWork",
    "WeightOwner",
    "carry_param_attributes",
    "is_gtp_param",
]


class WeightOwner(Protocol):
    """What a :class:`GTPShardedParam` asks of the runtime that owns it (``GTPRuntime``).

    The param calls its owner for the TransformerEngine DistributedWeight protocol (the Note on
    :class:`GTPShardedParam`); the runtime implements these and registers itself on the param
    (``GTPParamState.runtime``, a weak reference), so the param never imports the runtime
    (design §1.1: params refer back to their runtime weakly).

    Example::

        owner: WeightOwner = param.runtime
        owner.materialize_group_for_protocol(param, Direction.FWD)
    """

    def materialize_group_for_protocol(
        self, param: GTPShardedParam, direction: Direction
    ) -> list[torch.Tensor]:
        """The full weight of every member of ``param``'s group for TE's GEMM, in order."""

    def protocol_grad_buffer(self, param: GTPShardedParam) -> torch.Tensor:
        """The unpadded view of a pooled wgrad scratch for TE's fused wgrad GEMM."""

    def finalize_group_for_protocol(
        self, param: GTPShardedParam, wgrads: list[torch.Tensor] | tuple[torch.Tensor, ...]
    ) -> int:
        """Reduce-scatter one full wgrad per member of ``param``'s group; its size."""

    def reduce_scatter_foreign_wgrad(self, param: GTPShardedParam, wgrad: torch.Tensor) -> None:
        """Reduce-scatter one full wgrad of ``param`` (a dense linear's, the protocol's hot
        path: what ``finalize_group_for_protocol`` does for a group of one)."""


class GTPParamState:
    """Runtime bookkeeping the owning :class:`GTPRuntime` keeps on each param."""

    __slots__ = (
        "name",
        "runtime",
        "chain_id",
        "chain",
        "segment",
        "ring",
        "fwd",
        "bwd",
        "rs",
        "parity",
        "is_head",
        "grad_ready_hook",
        "forward_grad_enabled",
        "protocol_scratch",
        "rs_unit",
        "fp8",
        "fp8_wire",
        "fp8_scale_wire",
        "fp8_version",
        "fp8_forward",
        "fp8_primary_dtype",
        "fp8_init",
        "consumer",
        "quantize_note",
        "group",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.name = ""
        self.runtime: weakref.ReferenceType[WeightOwner] | None = None  # the GTPRuntime
        self.chain_id: Any = None
        self.chain: Any = None  # the runtime's Chain object for chain_id
        self.segment = -1
        """The CUDA graph this weight is captured in (design §3.5: one segment per captured
        layer, numbered in model order); -1 for eager weights. Chain links, coalescing units and
        deferred reduce-scatters never cross from one segment into another."""
        self.ring = -1
        """With ``GTPConfig.graph_wgrad_ring_size``: the wgrad ring slot of this weight (it is in
        its segment's head unit, whose reduce-scatter runs in the next graph); -1: none."""
        self.fwd = GatherSlot(Direction.FWD)
        self.bwd = GatherSlot(Direction.BWD)
        self.rs = ReduceScatterSlot()
        self.parity = 0
        self.is_head = False  # first of its chain (segment) in forward order: synchronous RS
        self.grad_ready_hook: Callable[[], None] | None = None
        self.forward_grad_enabled = False
        """Grad mode at the owning TE module's call: TE materializes inside its autograd forward,
        where grad mode is off, so the runtime reads this instead (set by a forward pre-hook)."""
        self.protocol_scratch: torch.Tensor | None = None  # TE's grad_buffer(), until finalize
        self.rs_unit: tuple | None = None
        """The params (forward order) whose wgrads reduce-scatter in one collective with this
        one; None: alone (not coalescing, or before the chain order is committed)."""
        self.fp8: Any = None
        """The FP8 copy of the shard the runtime gathers from (an ``FP8Shard``; design §1.3
        "FP8 gather"), its byte view and the param version it was quantized at."""
        self.fp8_wire: torch.Tensor | None = None
        # blockwise FP8 gathers: the shard's per-block scale_inv, gather-ready (fp8_gather)
        self.fp8_scale_wire: torch.Tensor | None = None
        self.fp8_version = -1
        self.fp8_primary_dtype: torch.dtype | None = None
        """For an FP8 primary shard (``make_fp8_primary``, design §1.3 "FP8 primary weights"):
        the training dtype its GEMMs and gradients use (the data itself is FP8; ``fp8`` holds
        its scales); None otherwise."""
        self.fp8_init: torch.Tensor | None = None
        """An FP8 primary shard's training-dtype values before quantization, for the
        optimizer's master; dropped once the master exists."""
        self.fp8_forward: Any = None
        """The FP8 scaling of this weight's last forward protocol consume (None: the training
        dtype); its backward consume gathers the same way."""
        self.consumer: Any = None
        """What the integration driving this weight keeps on it for the runtime's
        ``consumer_quantize`` (TE: the module and the backward quantizer state); None: none."""
        self.quantize_note: Any = None
        """The note of this weight's last forward protocol consume in the training dtype for
        its backward (design §1.3 "Consumer-quantized backward"); None: not quantized."""
        self.group = -1
        """Index of this param's weight group in its runtime's ``weight_groups`` (design §3.4
        "Grouped-expert chains"); -1: in none."""

    def slot(self, direction: Direction) -> GatherSlot:
        """The gather slot of ``direction``."""
        return self.fwd if direction is Direction.FWD else self.bwd


class GTPShardedParam(torch.nn.Parameter):
    """The dim-0 GTP shard of a TP-local weight, as an ``nn.Parameter`` (design §1.1, §3.1).

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
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = True,
        *,
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

    def type(self, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Tensor.type``; an FP8 primary shard's type name is a 16-bit one (design §1.3
        "The megatron hook").

        megatron's distributed optimizer dispatches on ``param.type()`` and keeps an fp32 main
        param only for 16-bit model params; TE's Float8Tensor reports its 16-bit nominal dtype
        there. An FP8 primary shard's storage dtype is float8, so it reports the training
        dtype's name when that is 16-bit, else bfloat16's: the "low-precision param with an
        fp32 master" branch, the only one that fits FP8 storage. Conversion calls are untouched.

        Example::

            param.type()   # 'torch.cuda.BFloat16Tensor' for an FP8 primary shard on a GPU
        """
        nominal = self.gtp_state.fp8_primary_dtype if "gtp_state" in self.__dict__ else None
        if nominal is None or dtype is not None or args or kwargs:
            return super().type(dtype, *args, **kwargs)
        if nominal not in (torch.float16, torch.bfloat16):
            nominal = torch.bfloat16
        return torch.empty(0, dtype=nominal, device=self.device).type()

    def get_high_precision_init_val(self) -> torch.Tensor:
        """The training-dtype values an FP8 primary shard was quantized from: the optimizer
        master's initial value (the name megatron's distributed optimizer asks TE's FP8 params
        for; design §1.3 "FP8 primary weights").

        Example::

            master = param.get_high_precision_init_val().float().view(-1)[start:end].clone()
        """
        state = self.gtp_state
        if state.fp8_init is not None:
            return state.fp8_init
        shard = state.fp8  # cleared: the FP8 shard times its scale_inv, in the training dtype
        return dequantize_fp8(
            self.detach(), shard.scale_inv, shard.scaling, state.fp8_primary_dtype
        )

    def clear_high_precision_init_val(self) -> None:
        """Drop the kept training-dtype values (the optimizer holds its master now)."""
        self.gtp_state.fp8_init = None

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype the weight trains in: its own, or an FP8 primary shard's training dtype
        (its storage is float8; design §1.3 "FP8 primary weights"): what its GEMMs and
        gradients use and what a coalescing unit's size counts (§3.1 "Coalescing units").

        Example::

            param.training_dtype   # torch.bfloat16 for a bf16 weight, FP8 primary or not
        """
        return self.gtp_state.fp8_primary_dtype or self.dtype

    @property
    def runtime(self) -> Any:
        """The ``GTPRuntime`` that owns this param (a :class:`WeightOwner`)."""
        ref = self.gtp_state.runtime
        runtime = ref() if ref is not None else None
        if runtime is None:
            raise RuntimeError(
                f"{self!r} is not registered with a live GTPRuntime (was its model's runtime "
                "dropped, or the param built outside the model transform?)"
            )
        return runtime

    def register_grad_accum_hook(self, hook: Callable[[], None]) -> None:
        """Store DDP's grad-ready hook; fired after each finalize into main_grad (design §3.2)."""
        self.gtp_state.grad_ready_hook = hook

    # [Note: TransformerEngine DistributedWeight protocol] (design §3.1 "The bridge")
    # TE >= 2.19 gates on ``is_distributed_weight`` and calls these on the leader of a weight
    # group (``weights[0]``): a te.Linear has a group of one, a GroupedLinear one weight per
    # expert, registered as a runtime weight group (``GTPRuntime.register_group(...,
    # together=True)``): the leader gathers the whole group in one collective and receives all
    # of its wgrads; followers only answer ``grad_buffer()``. TE never tells us when its GEMM is
    # done, so a protocol-materialized buffer is released at the next protocol materialize of
    # the same chain and direction (stream order makes that safe) or at the next drain. TE gets
    # requires-grad aliases of the buffers (LayerNormLinear decides on wgrad from them), and its
    # wgrads through finalize_group_grads (or grad_buffer() under fuse_wgrad_accumulation).
    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        """Full weights of this param's group for TE's forward GEMM (prefetches ahead)."""
        ref = self.gtp_state.runtime  # the owner without the property's frame (hot path)
        owner = ref() if ref is not None else None
        if owner is None:
            owner = self.runtime  # raises: no live runtime
        return owner.materialize_group_for_protocol(self, Direction.FWD)

    def materialize_group_for_backward(self) -> list[torch.Tensor]:
        """Full weights of this param's group for TE's dgrad GEMM (prefetches ahead)."""
        ref = self.gtp_state.runtime  # the owner without the property's frame (hot path)
        owner = ref() if ref is not None else None
        if owner is None:
            owner = self.runtime  # raises: no live runtime
        return owner.materialize_group_for_protocol(self, Direction.BWD)

    def grad_buffer(self) -> torch.Tensor:
        """Full-size (unpadded view) wgrad scratch TE's fused wgrad GEMM writes into."""
        ref = self.gtp_state.runtime  # the owner without the property's frame (hot path)
        owner = ref() if ref is not None else None
        if owner is None:
            owner = self.runtime  # raises: no live runtime
        return owner.protocol_grad_buffer(self)

    def finalize_group_grads(self, wgrads: torch.Tensor | list[torch.Tensor]) -> list[None] | None:
        """Reduce-scatter TE's full wgrad(s) of this param's group into ``main_grad``.

        Returns None for a group of one and N Nones for a group of N: TE returns them to
        autograd as the weights' grads (async: nothing reaches autograd).
        """
        state = self.gtp_state
        ref = state.runtime
        owner = ref() if ref is not None else None
        if owner is None:
            owner = self.runtime  # raises: no live runtime
        if state.group < 0 and isinstance(wgrads, torch.Tensor):  # a dense TE linear's one
            owner.reduce_scatter_foreign_wgrad(self, wgrads)
            return None
        grads = list(wgrads) if isinstance(wgrads, (list, tuple)) else (wgrads,)
        size = owner.finalize_group_for_protocol(self, grads)
        return None if size == 1 else [None] * size


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
    """True for a :class:`GTPShardedParam` (Megatron-LM's ``is_gtp_param``)."""
    return isinstance(tensor, GTPShardedParam)

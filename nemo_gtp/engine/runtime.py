"""``GTPRuntime``: the one object per model that drives every GTP weight (design §1.1, §3.1, §3.4).

It owns what Megatron-LM's GTP keeps in process-global state — chain cursors and link tables, the
gathered-weight cache, the wgrad pool, the pending reduce-scatters, statistics — so several GTP
models can live (and die) in one process without ever linking to each other (the §3.4 hazard
table, designed away). Params refer back to it weakly; the model holds it strongly.

[Note: lifecycle of one weight in one step]
1. forward ``materialize(FWD)``: wait the prefetched gather (or gather synchronously on the cold
   start / chain head), then issue the async gather of ``next_w`` *before* the GEMM runs.
2. forward GEMM, then ``release(FWD)``: the buffer returns to the cache.
3. backward ``materialize(BWD)``: as 1, prefetching ``prev_w``; dgrad GEMM; ``release(BWD)``.
4. wgrad GEMM into pooled scratch; ``reduce_scatter_wgrad``: pre-scale, issue the async
   reduce-scatter, then finalize every earlier one (one-step deferral): wait, add into
   ``main_grad``, fire DDP's grad-ready hook. The chain head reduces synchronously.
5. ``drain()`` (the fence before anything reads ``main_grad``): finalize what is still pending
   and complete any unconsumed prefetch.

Correctness never depends on the observed order: a weight whose gather was not prefetched is
gathered synchronously, and a prefetch whose buffer is still held is skipped.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from nemo_gtp.engine.buffers import BufferKey, CacheSlot, GTPWeightCache, WgradPool
from nemo_gtp.engine.chain import Chain, ChainId, ChainPhase, WeightGroup, coalescing_units
from nemo_gtp.engine.collectives import GroupCollectives, reduce_scatter_wgrad
from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.consumer_quantize import ConsumerQuantize
from nemo_gtp.engine.copy_engine import (
    EventWork,
    SymmetricShardMirror,
    agree_on_copy_engine,
    copy_engine_available,
)
from nemo_gtp.engine.fp8 import FP8Scaling, ScalingKind, dequantize_fp8
from nemo_gtp.engine.fp8_gather import (
    FP8Gathered,
    FP8ShardCache,
    QuantizedGather,
    check_gather_scaling,
    padded_scale_shape,
    transposed_view,
)
from nemo_gtp.engine.graph_segments import GraphSegments
from nemo_gtp.engine.grid import GTPGroups, WeightAxis
from nemo_gtp.engine.param import (
    Direction,
    GatherSlot,
    GatherState,
    GTPParamState,
    GTPShardedParam,
    GTPStateError,
    ReduceScatterState,
    ShardSpec,
    SharedWork,
    carry_param_attributes,
)
from nemo_gtp.engine.timing import ExposedWaitTimer

_FWD, _BWD = Direction.FWD, Direction.BWD
# -1 outside autograd's backward; a forward consume inside one is an activation-recompute
# forward (megatron's CheckpointFunction, torch.utils.checkpoint), which has its own chain.
_backward_task_id = torch._C._current_graph_task_id
_NONE, _ASYNC, _READY = GatherState.NONE, GatherState.ASYNC_WAIT, GatherState.DATA_READY
_RS_NONE, _RS_STAGED = ReduceScatterState.NONE, ReduceScatterState.STAGED
_LINKED = ChainPhase.LINKED
_BLOCKWISE = ScalingKind.BLOCKWISE


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    """fp32 block scales as the bytes a coalesced gather moves beside the FP8 rows (one dtype
    per collective: gloo's coalesced all-gather mixes none)."""
    return scales.view(torch.uint8)


def _forward_targets(slot: GatherSlot, will_backward: bool) -> tuple[GatherSlot, ...]:
    """What a consume of ``slot`` prefetches along its chain: the next weights, or at the forward
    chain's tail (when a backward follows) the first backward gathers."""
    return slot.ahead if slot.ahead or not will_backward else slot.handover


class GatherBackend(enum.Enum):
    """How a runtime all-gathers its shards (``GTPConfig.gather_backend`` once resolved)."""

    PROCESS_GROUP = "process_group"
    """The process group's all-gather: NCCL kernels on SMs on CUDA, gloo threads on CPU."""
    COPY_ENGINE = "copy_engine"
    """Copy-engine pulls of the peers' shards from symmetric memory (no SMs; one host, CUDA)."""


@dataclass
class CommStats:
    """Counters of GTP communication since the last :meth:`reset` (read by the metrics callback)."""

    gathers: int = 0
    prefetches: int = 0
    prefetch_skipped: int = 0
    gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    fallback_allocations: int = 0
    fp8_gathers: int = 0
    """Gathers that moved FP8 bytes (design §1.3 "FP8 gather"); counted in ``gathers`` too."""
    fp8_quantizes: int = 0
    """Refreshes of the FP8 shard copies: one amax all-reduce each (once per step)."""
    format_regathers: int = 0
    """Prefetched gathers dropped because the consume wanted the other format (FP8 vs the
    training dtype), e.g. at the edge of an FP8 region: time only, never results."""
    gather_collectives: int = 0
    """All-gather calls issued (a coalesced gather of a unit counts once; ``gathers`` counts
    weights)."""
    reduce_scatter_collectives: int = 0
    """Reduce-scatter calls issued (a unit's coalesced one counts once)."""

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, 0)


__all__ = [  # the chain lives in nemo_gtp.engine.chain; re-exported for the runtime's users
    "Chain",
    "ChainId",
    "ChainPhase",
    "CommStats",
    "GatherBackend",
    "GTPRuntime",
    "coalescing_units",
    "runtimes_of",
]


class GTPRuntime(GraphSegments):
    """Per-model driver of every :class:`GTPShardedParam` (design §1.1, §3.1).

    Example::

        groups = GTPParallelDims(world_size=2, num_weight_shards=2).build()
        runtime = GTPRuntime(groups, GTPConfig())    # axis=WeightAxis.EXPERT: the EGTP group
        shard = runtime.shard_parameter(linear, "weight", name="fc1.weight")
        ...                      # forward / backward through nemo_gtp.engine.linear
        runtime.drain()          # before the optimizer reads main_grad

    [Note: the steady-state hot path]
    A step costs every weight three collectives and their waits; the Python around them is kept
    to attribute reads: slots carry their chain links, cache slot and byte counts (set when the
    chain order is committed and at the first gather), collectives go straight to the process
    group (:class:`GroupCollectives`), pooled buffers come from per-weight free lists, and
    nothing is allocated or looked up by key after the first step.
    """

    def __init__(
        self,
        groups: GTPGroups,
        config: GTPConfig | None = None,
        *,
        name: str = "model",
        axis: WeightAxis = WeightAxis.DENSE,
    ) -> None:
        if not isinstance(groups, GTPGroups):
            raise TypeError(
                "GTPRuntime takes the GTPGroups it shards over (GTPParallelDims(...).build() or "
                f"initialize_gtp_parallel(...)), got {type(groups).__name__}"
            )
        self.groups = groups
        self.config = config or GTPConfig()
        self.name = name
        # The one place the weight axis enters: a routed-expert runtime (design §1.4) drives the
        # EGTP group exactly as a dense one drives the GTP group.
        self.axis = axis
        self.group, self.size, self.rank = groups.weight_axis(axis)
        self._nccl = dist.get_backend(self.group) == "nccl"
        self._ops = GroupCollectives(self.group)
        self._mirror: SymmetricShardMirror | None = None
        self.gather_backend: GatherBackend | None = None  # resolved at the first gather
        self._use_mirror = False
        self.tokens_per_gemm = 0
        # A second communicator over the same ranks for the reduce-scatters (see GTPConfig).
        self._rs_group = self.group
        if self.config.separate_reduce_scatter_group and self.size > 1:
            self._rs_group = dist.new_group(
                dist.get_process_group_ranks(self.group),
                backend=dist.get_backend(self.group),
                use_local_synchronization=True,
            )
        self._rs_ops = GroupCollectives(self._rs_group)
        self._fp32_accumulation = (
            self.config.reduce_scatter_with_fp32_accumulation and self.size > 2
        )
        # MEAN (design §3.2): NCCL averages inside the reduce-scatter; elsewhere a 1/GTP pre-scale.
        self._average_in_collective = (
            not self.config.sums_over_gtp and self._nccl and not self._fp32_accumulation
        )
        self._prescale = (
            None if self.config.sums_over_gtp or self._average_in_collective else 1.0 / self.size
        )
        self._prefetch_enabled = self.config.weight_prefetch
        self.params: list[GTPShardedParam] = []
        unit_bytes = self.config.coalesce_mb * 2**20
        self.weight_groups: list[WeightGroup] = []  # register_group's, design §3.4
        self.chains = {
            cid: Chain(cid, self.config.prefetch_depth, unit_bytes, self.weight_groups)
            for cid in ChainId
        }
        self.weight_cache = GTPWeightCache()
        self.wgrad_pool = WgradPool()
        # FP8 gathers (design §1.3 "FP8 gather"): the consumer that asks for them (set by the
        # integration, e.g. TE's), the FP8 copies of the shards, the format of the gathers the
        # consume being served issues, and the one FP8Scaling object in use.
        self.quantized_gather: QuantizedGather | None = None
        self.fp8_shards = FP8ShardCache()
        self._fmt: FP8Scaling | None = None
        self._fp8_known: FP8Scaling | None = None
        self.fp8_primary: FP8Scaling | None = None
        """Set by ``make_fp8_primary``: every shard is an FP8 primary weight in this scaling and
        every gather moves the shards' own FP8 bytes (design §1.3 "FP8 primary weights")."""
        self.fp8_write_back_plan: object | None = None
        """The optimizer write-back's plan for this runtime's shards (``fp8_write_back``),
        built at the first write-back and reused while megatron passes the same lists."""
        # The consumer that quantizes the training-dtype gathers it is handed and needs that
        # quantization redone for its backward (design §1.3 "Consumer-quantized backward").
        self.consumer_quantize: ConsumerQuantize | None = None
        self.stats = CommStats()
        self.wait_timer = ExposedWaitTimer()
        self.trace: list[tuple[str, str, str]] | None = None
        self._label: str | None = None  # trace label of the consume being served
        self.segments: list[tuple[GTPShardedParam, ...]] = []
        """The weights of each captured CUDA graph (design §3.5); in forward order once the
        chain is committed."""
        self.builds = 0
        """Python-side chain building and binding done so far: order commits, recompute links,
        cache and pool bindings, the gather-backend decision. Constant once every weight ran a
        linked forward and backward (the state a CUDA-graph capture must start from)."""
        self._guard: dict[int, tuple[GTPShardedParam, torch.Tensor | None, bool]] | None = None
        # The cross-graph wgrad ring (design §3.5): staged wgrads of a segment's head unit, to
        # be reduce-scattered in the next segment's backward.
        self._ring_size = self.config.graph_wgrad_ring_size
        if self._ring_size and self._fp32_accumulation:
            raise ValueError(
                "GTPConfig.graph_wgrad_ring_size > 0 is not supported together with "
                "reduce_scatter_with_fp32_accumulation at GTP > 2: set one of them off"
            )
        self._carry: list[GTPShardedParam] = []
        self.graph_hook_plans: dict[int, tuple[GTPShardedParam, ...]] = {}
        """Per segment, the weights whose finalize a captured backward graph replays, in order
        (recorded by :meth:`recording_graph_hooks`; the manual hook plan of design §3.5)."""
        self._recording: list[GTPShardedParam] | None = None

    # ----------------------------------------------------------------- construction
    def shard_parameter(
        self,
        module: torch.nn.Module,
        attr: str,
        name: str,
        chain_id: ChainId = ChainId.UNGRAPHED,
    ) -> GTPShardedParam:
        """Replace ``module.<attr>`` by its GTP shard, registered with this runtime.

        The full TP-local weight is sliced (so the GTP model starts identical to the non-GTP
        one); every attribute megatron set on the old param (``tensor_model_parallel``,
        ``partition_dim``, ...) is carried over.
        """
        old = getattr(module, attr)
        spec = ShardSpec.for_weight(old.shape, self.size, self.rank, self.config.pad_for_alignment)
        param = GTPShardedParam(spec.shard(old), old.requires_grad, spec=spec)
        carry_param_attributes(old, param)
        module._parameters[attr] = param
        self.register(param, name, chain_id)
        return param

    def register(
        self, param: GTPShardedParam, name: str, chain_id: ChainId = ChainId.UNGRAPHED
    ) -> None:
        """Make this runtime the owner of ``param`` (joins ``chain_id`` on its first consume)."""
        state = param.gtp_state
        if state.runtime is not None and state.runtime() is not None:
            raise ValueError(f"{param!r} is already registered with a GTPRuntime")
        if param.gtp_spec.gtp_size != self.size:
            raise ValueError(
                f"{name}: shard spec is for GTP size {param.gtp_spec.gtp_size}, runtime group "
                f"has {self.size} ranks"
            )
        state.name, state.chain_id, state.chain = name, chain_id, self.chains[chain_id]
        state.runtime = weakref.ref(self)
        index = len(self.params)
        state.fwd.index = state.bwd.index = index
        self.params.append(param)

    def register_group(
        self, params: list[GTPShardedParam] | tuple[GTPShardedParam, ...], *, together: bool
    ) -> WeightGroup:
        """Make registered ``params`` one weight group: one coalescing unit of its own, so one
        collective per direction gathers them and one reduce-scatters their wgrads, a whole
        unit ahead of use on their chain (design §3.4 "Grouped-expert chains").

        ``together=True``: TransformerEngine hands the group to ``params[0]`` (its
        ``GroupedLinear``): ``materialize_group_for_forward`` / ``_backward`` of the leader
        return every member's weight and its ``finalize_group_grads`` takes every wgrad.
        Register before the group's chain is linked (before its first backward consume).

        Example::

            fc1 = [runtime.shard_parameter(grouped, f"weight{i}", f"fc1.weight{i}",
                                           ChainId.EXPERT_FC1) for i in range(grouped.num_gemms)]
            runtime.register_group(fc1, together=True)
        """
        params = tuple(params)
        if not params:
            raise ValueError("a weight group needs at least one weight")
        chain = params[0].gtp_state.chain
        for param in params:
            state = param.gtp_state
            if state.runtime is None or state.runtime() is not self:
                raise ValueError(f"{param!r} is not registered with this GTPRuntime")
            if state.group >= 0:
                raise ValueError(f"{state.name} already belongs to a weight group")
            if state.chain is not chain:
                raise ValueError(
                    f"a weight group lives on one chain: {state.name} is on "
                    f"{state.chain_id.value}, {params[0].gtp_state.name} on {chain.chain_id.value}"
                )
        if chain.phase is not ChainPhase.OBSERVING:
            raise ValueError(
                f"chain {chain.chain_id.value} is already linked: register weight groups before "
                "the first training step"
            )
        group = WeightGroup(params, together)
        for param in params:
            param.gtp_state.group = len(self.weight_groups)
        self.weight_groups.append(group)
        return group

    def group_of(self, param: GTPShardedParam) -> WeightGroup | None:
        """The :class:`WeightGroup` ``param`` belongs to, or None."""
        index = param.gtp_state.group
        return self.weight_groups[index] if index >= 0 else None

    @property
    def live_buffers(self) -> dict[ChainId, int]:
        """Gathered buffers currently held, per chain."""
        return {cid: chain.live for cid, chain in self.chains.items()}

    @property
    def max_live_buffers(self) -> dict[ChainId, int]:
        """Most gathered buffers held at once, per chain (one-step-ahead: at most 2)."""
        return {cid: chain.max_live for cid, chain in self.chains.items()}

    # ----------------------------------------------------------------- all-gather side
    def materialize(
        self,
        param: GTPShardedParam,
        direction: Direction,
        *,
        will_backward: bool = False,
        fp8: FP8Scaling | None = None,
    ) -> torch.Tensor:
        """The full (unpadded) TP-local weight for a GEMM; prefetches the neighbour first.

        ``will_backward`` (forward only) lets the chain tail hand over to the backward by
        prefetching its own backward gather. ``fp8``: gather the FP8 copy of the shards instead
        (design §1.3 "FP8 gather"; per-tensor current scaling), and prefetch in FP8 too; the
        result is then the FP8 rows (:meth:`fp8_gathered` has their ``scale_inv``).
        """
        state = param.gtp_state
        chain = state.chain
        recompute = False
        if direction is _FWD:
            slot = state.fwd
            recompute = _backward_task_id() != -1
        else:
            slot = state.bwd
            if self._carry and self._carry[0].gtp_state.segment != state.segment:
                self._issue_carry()  # the next graph's first backward consume
        if self.fp8_primary is not None:  # the shards are FP8: nothing else to gather
            fp8 = self.fp8_primary
        if fp8 is not None and fp8 is not self._fp8_known:
            fp8 = self._canonical_fp8(fp8)
        if slot.state is not _NONE and slot.fmt is not fp8:
            # Prefetched in the other format (the edge of an FP8 region): gather again.
            self.release(param, direction)
            self.stats.format_regathers += 1
        self._fmt = fp8
        if chain.phase is ChainPhase.OBSERVING and chain.observe(param, direction):
            self.builds += 1
            self._segments_committed(chain)
        if recompute:
            self._label = "rc"  # trace only
            if chain.recompute_phase is ChainPhase.OBSERVING:
                chain.observe_recompute(param)
        if slot.state is _NONE:
            if recompute or len(slot.unit) == 1:
                self._issue(param, slot, async_op=False)
            else:  # e.g. the chain head: the rest of its unit (not what was consumed), at once
                self._issue_unit(slot.unit[slot.unit_pos :], sync_slot=slot)
        if slot.state is _ASYNC:
            if self.wait_timer.enabled:
                self.wait_timer.timed_wait(slot.complete, "gather", param.device, state.name)
            else:
                slot.complete()
        if self._prefetch_enabled:  # links are empty until their chain is committed
            # a recompute consume follows the recompute chain, never the forward chain's links;
            # it gathers weight by weight (a recompute may re-run only part of a unit)
            if recompute:
                for target in slot.recompute_ahead:
                    if target.state is _NONE:
                        self._prefetch(target)
            else:  # inlined _forward_targets: most consumes lead no unit (nothing to issue)
                targets = slot.ahead if slot.ahead or not will_backward else slot.handover
                if targets:
                    self._prefetch_all(targets)
        self._label = None
        self._fmt = None
        return slot.full

    def _canonical_fp8(self, fp8: FP8Scaling) -> FP8Scaling:
        """One ``FP8Scaling`` object per recipe in use (identity checks on the hot path)."""
        if fp8 != self._fp8_known:
            check_gather_scaling(fp8)
            self._fp8_known = fp8
        return self._fp8_known

    def fp8_gathered(self, param: GTPShardedParam, direction: Direction) -> FP8Gathered:
        """The FP8 gathered weight ``materialize(..., fp8=...)`` left in ``direction``'s slot.

        Built once per cache buffer (stable object, stable tensors); a backward slot carries
        the column-wise buffer when the consumer asked for one
        (``QuantizedGather.transpose_for_backward``).
        """
        state = param.gtp_state
        slot = state.slot(direction)
        if slot.state is not _READY or slot.fmt is None:
            raise GTPStateError(
                f"{state.name}: no FP8 gathered weight in the {direction.value} slot "
                f"(state {slot.state.value}, format {slot.fmt})"
            )
        full = slot.full
        view = slot.fp8_view
        blockwise = slot.fmt.kind is _BLOCKWISE
        if view is None or view.data is not full:
            transpose = columnwise_scales = None
            policy = self.quantized_gather
            cache = slot.cache
            own = cache is not None and slot.buffer is cache.buffer  # else a fallback buffer
            rows, cols = full.shape
            # Outside inference mode: the consumer writes the column-wise view later, in training.
            with torch.inference_mode(False):
                if direction is _BWD and policy is not None and policy.transpose_for_backward:
                    if own:
                        flat = self.weight_cache.companion(cache)
                    else:  # a fallback buffer (misprediction): its own column-wise buffer
                        flat = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
                    transpose = transposed_view(flat, tuple(full.shape))
                    if blockwise:
                        shape = padded_scale_shape(cols, rows, slot.fmt)
                        columnwise_scales = (
                            self.weight_cache.scales(cache, "columnwise", shape)
                            if own
                            else torch.zeros(shape, dtype=torch.float32, device=full.device)
                        )
            # blockwise: the gathered block scales of the unpadded rows (a row prefix)
            scale_inv = slot.scales[: -(-rows // slot.fmt.block[0])] if blockwise else None
            view = FP8Gathered(
                full,
                state.fp8.scale_inv if scale_inv is None else scale_inv,
                transpose,
                slot.fmt,
                columnwise_scales,
            )
            if own:
                slot.fp8_view = view
        if not blockwise:  # per tensor: the agreed scale, the same tensor on every GTP peer
            view.scale_inv = state.fp8.scale_inv
        return view

    def gemm_weight(
        self, param: GTPShardedParam, direction: Direction, full: torch.Tensor
    ) -> torch.Tensor:
        """What a GEMM that is not FP8-aware multiplies with: ``full`` (from :meth:`materialize`)
        as is, or for FP8 primary shards the gathered FP8 rows dequantized into the training
        dtype (a new tensor per call: the CPU / local-linear path; TE consumes the FP8 rows).
        Blockwise: per tile, with the tile scales gathered beside the rows."""
        if self.fp8_primary is None:
            return full
        state = param.gtp_state
        fp8 = self.fp8_primary
        scale_inv = state.slot(direction).scales if fp8.kind is _BLOCKWISE else state.fp8.scale_inv
        return dequantize_fp8(full, scale_inv, fp8, state.fp8_primary_dtype)

    def prefetch_neighbour(
        self, param: GTPShardedParam, direction: Direction, *, will_backward: bool = False
    ) -> None:
        """Issue the async gather the next consume in ``direction`` will need (design §3.1)."""
        # the autograd path gathers the training dtype, or the FP8 primary shards
        self._fmt = self._fp8_known if self.fp8_primary is not None else None
        if self._prefetch_enabled:
            self._prefetch_all(_forward_targets(param.gtp_state.slot(direction), will_backward))

    def release(self, param: GTPShardedParam, direction: Direction) -> None:
        """Return ``param``'s gathered buffer for ``direction`` to the cache."""
        slot = param.gtp_state.fwd if direction is _FWD else param.gtp_state.bwd
        if slot.state is _NONE:
            return
        if slot.state is _ASYNC:
            slot.complete()
        if slot.cache is not None and slot.buffer is slot.cache.buffer:
            slot.cache.release(slot)
        param.gtp_state.chain.live -= 1
        slot.released()

    def _prefetch_all(self, targets: tuple[GatherSlot, ...]) -> None:
        for target in targets:  # each target leads a unit
            if target.state is _NONE:
                if len(target.unit) == 1:
                    self._prefetch(target)
                else:
                    self._issue_unit(target.unit)

    def _prefetch(self, slot: GatherSlot) -> None:
        if self._issue(self.params[slot.index], slot, async_op=True):
            self.stats.prefetches += 1
        else:
            self.stats.prefetch_skipped += 1

    def _bind(self, param: GTPShardedParam, slot: GatherSlot) -> None:
        """Find ``slot``'s cache slot (its ticket) and precompute what each gather reuses."""
        state = param.gtp_state
        if not param.is_contiguous():
            raise ValueError(f"{state.name}: GTP shard is not contiguous")
        fmt = self._fmt
        key = BufferKey(
            param.gtp_spec.gathered_shape,
            param.dtype if fmt is None else fmt.fp8_dtype,
            param.device,
            state.chain_id.value,
            slot.direction.value,
            state.parity,
        )
        self.builds += 1
        slot.cache, slot.rebind = self.weight_cache.slot(key), False
        slot.cache_full = param.gtp_spec.unpad(slot.cache.buffer)
        buffer = slot.cache.buffer
        slot.nbytes = buffer.numel() * buffer.element_size() * (self.size - 1) // self.size
        slot.bound_fmt = fmt
        slot.fp8_view = None
        slot.wire = None if fmt is None else buffer.view(torch.uint8)  # what the wire moves
        slot.scale_wire = None
        if fmt is not None and fmt.kind is _BLOCKWISE:  # the block scales travel with the rows
            shape = padded_scale_shape(*param.gtp_spec.gathered_shape, fmt)
            slot.scale_wire = self.weight_cache.scales(slot.cache, "rowwise", shape)
            scale_bytes = slot.scale_wire.numel() * slot.scale_wire.element_size()
            slot.nbytes += scale_bytes * (self.size - 1) // self.size
        if self._use_mirror and fmt is None:
            slot.pull_plan = self._mirror.pull_plan(buffer, param)
            slot.pull_work = slot.pull_work or EventWork(self._mirror.ops)

    def _cache_of(self, param: GTPShardedParam, slot: GatherSlot) -> CacheSlot:
        """``slot``'s cache slot, bound at its first gather (outside inference mode: the buffer
        and the cached views outlive an evaluation loop that ran the first gather)."""
        cache = slot.cache
        if cache is None or cache.buffer is None or slot.rebind or slot.bound_fmt is not self._fmt:
            with torch.inference_mode(False):
                self._bind(param, slot)
            cache = slot.cache
        return cache

    def _fp8_source(self, param: GTPShardedParam, fmt: FP8Scaling) -> torch.Tensor:
        """The bytes of ``param``'s FP8 shard, quantized first if stale (collective: once per
        step for all shards, design §1.3 "FP8 gather"); an FP8 primary shard's own bytes."""
        if self.fp8_primary is not None:  # the optimizer wrote them (write_back_fp8_primary)
            return param.detach().view(torch.uint8)
        if not self.fp8_shards.is_fresh(param, fmt):
            # Gathers of the previous FP8 shards still in flight read them: complete them first.
            for other in self.params:
                for slot in (other.gtp_state.fwd, other.gtp_state.bwd):
                    if slot.state is _ASYNC and slot.fmt is not None:
                        slot.complete()
            self.fp8_shards.refresh(self.params, fmt, self.group)
            self.stats.fp8_quantizes += 1
            if self.trace is not None:
                self.trace.append(("fp8_quantize", "", ""))
        return param.gtp_state.fp8_wire

    def _issue(self, param: GTPShardedParam, slot: GatherSlot, *, async_op: bool) -> bool:
        if self.gather_backend is None:
            self._resolve_gather_backend(param.device)
        fmt = self._fmt
        # detached: gloo copies the local shard under autograd's eyes. FP8: the shard's FP8 copy,
        # always through the process group (the copy-engine mirror holds the training dtype).
        source = param.detach() if fmt is None else self._fp8_source(param, fmt)
        mirror = self._use_mirror and fmt is None
        cache = self._cache_of(param, slot)
        if cache.try_acquire(slot):
            buffer, full, wire, scales = cache.buffer, slot.cache_full, slot.wire, slot.scale_wire
            if mirror:
                pull_plan, pull_work = slot.pull_plan, slot.pull_work
        else:
            if async_op:
                return False
            # Only reachable when the observed order mispredicts; correctness first.
            buffer = torch.empty(
                param.gtp_spec.gathered_shape,
                dtype=param.dtype if fmt is None else fmt.fp8_dtype,
                device=param.device,
            )
            full = param.gtp_spec.unpad(buffer)
            wire = None if fmt is None else buffer.view(torch.uint8)
            # blockwise: the block scales beside the rows, in their own fallback buffer too
            scales = None if slot.scale_wire is None else torch.zeros_like(slot.scale_wire)
            self.stats.fallback_allocations += 1
            if mirror:
                pull_plan, pull_work = (
                    self._mirror.pull_plan(buffer, param),
                    EventWork(self._mirror.ops),
                )
        if mirror:
            work = self._mirror.pull(pull_plan, param, pull_work)
        elif scales is not None:  # blockwise: rows and block scales, one collective
            work = self._ops.all_gather_coalesced(
                [wire, _bytes(scales)], [source, _bytes(param.gtp_state.fp8_scale_wire)]
            )
        else:
            work = self._ops.all_gather(buffer if fmt is None else wire, source)
        slot.issued(work, buffer, full)
        slot.scales = scales
        slot.fmt = fmt
        self.stats.gather_collectives += 1
        self._note_issued((slot,), None if async_op else slot)
        return True

    def _note_issued(self, slots: Sequence[GatherSlot], sync_slot: GatherSlot | None) -> None:
        """Count the gathers just issued for ``slots`` (one weight, or a unit's members: one
        chain) into their chain's live buffers and the stats, once for them all; trace each
        (``sync_slot``: the one a GEMM waits for, the others are prefetches)."""
        params = self.params
        chain = params[slots[0].index].gtp_state.chain
        chain.live += len(slots)
        if chain.live > chain.max_live:
            chain.max_live = chain.live
        stats = self.stats
        stats.gathers += len(slots)
        for slot in slots:
            stats.gather_bytes += slot.nbytes
        if slots[0].fmt is not None:  # one format per collective
            stats.fp8_gathers += len(slots)
        if self.trace is not None:
            for slot in slots:
                self.record(
                    "ag_issue_async" if slot is not sync_slot else "ag_issue_sync",
                    params[slot.index],
                    self._label or slot.direction,
                )

    def _issue_unit(
        self, unit: tuple[GatherSlot, ...], sync_slot: GatherSlot | None = None
    ) -> None:
        """Gather every not-yet-gathered slot of a coalescing unit in one collective.

        ``sync_slot``: the slot a GEMM is waiting for (must be gathered, into a fallback buffer
        if its cache slot is held); the others are prefetches, skipped when their buffer is held.
        """
        if self.gather_backend is None:
            self._resolve_gather_backend(self.params[unit[0].index].device)
        fmt = self._fmt
        if self._use_mirror and fmt is None:  # copy-engine pulls are per weight anyway
            for slot in unit:
                if slot.state is _NONE:
                    if slot is sync_slot:
                        self._issue(self.params[slot.index], slot, async_op=False)
                    else:
                        self._prefetch(slot)
            return
        members, buffers, shards = [], [], []
        params, stats = self.params, self.stats
        for slot in unit:
            if slot.state is not _NONE:
                continue
            param = params[slot.index]
            source = param.detach() if fmt is None else self._fp8_source(param, fmt)
            cache = self._cache_of(param, slot)
            if cache.try_acquire(slot):
                members.append(slot)
                buffers.append(cache.buffer if fmt is None else slot.wire)
                shards.append(source)
                if slot.scale_wire is not None:  # blockwise: the block scales beside the rows
                    buffers.append(_bytes(slot.scale_wire))
                    shards.append(_bytes(param.gtp_state.fp8_scale_wire))
            elif slot is sync_slot:  # only when the observed order mispredicts
                self._issue(param, slot, async_op=False)
            else:
                stats.prefetch_skipped += 1
        if not members:
            return
        if len(buffers) == 1:
            work = self._ops.all_gather(buffers[0], shards[0])
        else:
            work = self._ops.all_gather_coalesced(buffers, shards)
        stats.gather_collectives += 1
        shared = members[0].unit_work
        if shared.work is not None:  # an earlier gather of this unit is still unwaited
            shared = SharedWork()
        shared.work = work
        for slot in members:
            slot.issued(shared, slot.cache.buffer, slot.cache_full)
            slot.fmt = fmt
            slot.scales = slot.scale_wire
        self._note_issued(members, sync_slot)  # one chain: a unit never crosses chains
        stats.prefetches += len(members) - (sync_slot in members)

    def _resolve_gather_backend(self, device: torch.device) -> None:
        """``GTPConfig.gather_backend`` made concrete, once, at the first gather.

        Every GTP peer reaches its first gather at the same point of the same program, so the
        agreement (and the symmetric-memory rendezvous that follows) are collective-safe here.
        The copy-engine mirror's buffers are made outside inference mode (they outlive it).
        """
        self.builds += 1
        backend = self._choose_gather_backend(device)
        if backend is GatherBackend.COPY_ENGINE:
            with torch.inference_mode(False):
                self._mirror = SymmetricShardMirror(self.params, self.group)
        self.gather_backend = backend
        self._use_mirror = backend is GatherBackend.COPY_ENGINE
        for param in self.params:  # cache bindings carry backend-specific plans
            for slot in (param.gtp_state.fwd, param.gtp_state.bwd):
                slot.rebind = True

    def _choose_gather_backend(self, device: torch.device) -> GatherBackend:
        requested = self.config.gather_backend
        if requested == "process_group":
            return GatherBackend.PROCESS_GROUP
        if not copy_engine_available(self.group, device):
            if requested == "copy_engine":
                raise RuntimeError(
                    "GTPConfig.gather_backend='copy_engine' needs CUDA, NCCL and "
                    "torch.distributed._symmetric_memory: use gather_backend='process_group'"
                )
            return GatherBackend.PROCESS_GROUP
        if not agree_on_copy_engine(
            self.group,
            device,
            self.tokens_per_gemm,
            required=requested == "copy_engine",
            min_tokens=self.config.copy_engine_min_tokens,
        ):
            return GatherBackend.PROCESS_GROUP
        return GatherBackend.COPY_ENGINE

    def needs_forward_grad_mode(self, param: GTPShardedParam) -> bool:
        """Whether :meth:`materialize_group_for_protocol` may still read ``param``'s
        ``forward_grad_enabled`` (what an integration records at each call of the module that
        consumes it): while its chain is observed, and, once linked, on the slot where the
        forward chain hands over to the backward (a unit lead with no forward link ahead).
        Anywhere else the grad mode changes no decision, so the integration may stop
        recording it (design §3.1 "Host cost")."""
        state = param.gtp_state
        if state.chain.phase is ChainPhase.OBSERVING:
            return True
        slot = state.fwd
        return not slot.ahead and bool(slot.handover)

    def note_tokens(self, tokens: int) -> None:
        """Rows of the GEMMs about to run (read by gather_backend='auto' at the first gather)."""
        self.tokens_per_gemm = tokens

    def reset_gather_backend(self) -> None:
        """Decide ``gather_backend`` again at the next gather (e.g. after a sequence-length change).

        Call on every GTP peer at the same step boundary; drains first. The next gather is then
        collective again (agreement, and the mirror's rendezvous if the copy engine is chosen).
        """
        self.drain()
        if self._mirror is not None:
            self._mirror.close()
        self.gather_backend, self._mirror, self._use_mirror = None, None, False

    def protocol_members(self, param: GTPShardedParam) -> tuple[GTPShardedParam, ...]:
        """The weights TE hands to ``param`` as the leader of its group: the whole
        :class:`WeightGroup` when it is consumed together (``GroupedLinear``), else ``param``.

        A follower of such a group is never a leader: TE calls the protocol on ``weights[0]``
        only (``grad_buffer()`` excepted, which every member answers for itself).
        """
        index = param.gtp_state.group
        if index < 0:  # every dense TE linear: no weight group (the protocol's hot path)
            return (param,)
        group = self.weight_groups[index]
        if not group.together:
            return (param,)
        if group.params[0] is not param:
            raise GTPStateError(
                f"{param.gtp_state.name} follows {group.params[0].gtp_state.name} in a weight "
                "group: TransformerEngine materializes and finalizes a group through its leader "
                "(weights[0]) only"
            )
        return group.params

    def materialize_group_for_protocol(
        self, param: GTPShardedParam, direction: Direction
    ) -> list[torch.Tensor]:
        """:meth:`materialize` for TE's DistributedWeight protocol (see the param's Note): the
        full weight of every member of ``param``'s group (:meth:`protocol_members`), in order.

        TE never says when its GEMM is done: the group materialized before on the same chain
        and direction is released here (stream order makes that safe), and a backward consume
        also releases the chain's last forward group (TE keeps no gathered weight past its
        forward call), so the chain tail's forward buffers do not live through the backward.

        What a member is handed: the requires-grad alias of its training-dtype buffer; under
        an FP8 gather (``quantized_gather``, ungrouped weights) the consumer's wrap of the FP8
        rows; in a backward whose forward the ``consumer_quantize`` noted as quantized, the
        consumer's quantization of the buffer (design §1.3 "Consumer-quantized backward").
        """
        state = param.gtp_state
        if state.group < 0 and state.chain.phase is _LINKED:
            dense = self._dense_consume(param, state, direction)
            if dense is not None:
                return dense
        members = self.protocol_members(param)
        chain = state.chain
        last = chain.protocol_last
        which = 0 if direction is _FWD else 1
        previous = last[which]
        if previous is not None and previous is not param:
            for member in self.protocol_members(previous):
                self.release(member, direction)
        if direction is _BWD and last[0] is not None:
            for member in self.protocol_members(last[0]):
                self.release(member, _FWD)
            last[0] = None
        will_backward = torch.is_grad_enabled() or state.forward_grad_enabled
        last[which] = param
        requant = self.consumer_quantize
        if len(members) == 1:  # every dense TE linear: keep the host path short
            policy = self.quantized_gather
            fp8 = None
            if self.fp8_primary is not None:  # design §1.3 "FP8 primary weights"
                full = self.materialize(param, direction, will_backward=will_backward)
                if policy is not None and direction is _FWD:
                    # Outside the consumer's FP8 region (e.g. megatron's first/last layers in
                    # bf16, evaluation without FP8) its GEMM is not FP8: it gets the dequantized
                    # weight, as TE dequantizes its own FP8 params there; the backward follows
                    # its forward.
                    state.fp8_forward = policy.forward_scaling(param)
                if policy is None or state.fp8_forward is None:
                    weight = self.gemm_weight(param, direction, full)
                    return [weight.detach().requires_grad_(param.requires_grad)]
                return [policy.wrap(param, direction, self.fp8_gathered(param, direction))]
            if policy is not None:  # FP8 gathers (design §1.3 "FP8 gather"): ungrouped only
                if direction is _FWD:
                    fp8 = policy.forward_scaling(param)
                    if fp8 is not None and fp8 is not self._fp8_known:
                        fp8 = self._canonical_fp8(fp8)
                    state.fp8_forward = fp8
                else:
                    fp8 = state.fp8_forward
            full = self.materialize(param, direction, will_backward=will_backward, fp8=fp8)
            if fp8 is not None:
                state.quantize_note = None
                return [policy.wrap(param, direction, self.fp8_gathered(param, direction))]
            if requant is not None:  # design §1.3 "Consumer-quantized backward"
                if direction is _FWD:
                    self._note_forward(requant, members)
                elif state.quantize_note is not None:
                    return [requant.backward(param, state.quantize_note, full)]
            return [self._protocol_alias(param, direction, full)]
        # A unit's links sit on the slot its direction consumes first: the first member
        # forward, the last one backward (Chain._commit).
        order = members if direction is _FWD else members[::-1]
        fulls = {id(m): self.materialize(m, direction, will_backward=will_backward) for m in order}
        if requant is not None:
            if direction is _FWD:
                self._note_forward(requant, members)
            elif state.quantize_note is not None:  # the leader's stands for its group's
                return [
                    requant.backward(m, m.gtp_state.quantize_note, fulls[id(m)]) for m in members
                ]
        return [self._protocol_alias(m, direction, fulls[id(m)]) for m in members]

    def _dense_consume(
        self, param: GTPShardedParam, state: GTPParamState, direction: Direction
    ) -> list[torch.Tensor] | None:
        """The protocol consume of a dense TE linear in the steady state, in one frame.

        The case of nearly every consume of a training step: the training dtype (no FP8
        primary shards, no FP8 gather in this consume: a ``quantized_gather`` that answers
        None is asked as in the general path, the one every TE model carries outside FP8
        autocast; a ``consumer_quantize`` is noted on every forward as in the general path, and
        a backward whose forward it quantized takes the general path), a linked chain, no
        recompute forward, no graph carry, no tracing or wait timing. Does what
        :meth:`materialize_group_for_protocol` and :meth:`materialize` do then (the same
        releases, issues, waits, prefetches and alias, in the same order) without the calls
        and branches of the cases that cannot apply; returns None, having changed nothing,
        for any other case (design §3.1 "Host cost per weight").
        """
        if self.fp8_primary is not None or self.trace is not None or self.wait_timer.enabled:
            return None
        last = state.chain.protocol_last
        policy = self.quantized_gather
        if direction is _FWD:
            if _backward_task_id() != -1:  # an activation-recompute forward: its own chain
                return None
            if policy is not None and policy.forward_scaling(param) is not None:
                return None  # an FP8 gather (the general path asks again: same answer)
            slot, which = state.fwd, 0
        else:
            first = last[0]
            if (
                self._carry
                or state.quantize_note is not None  # the consumer quantizes this backward
                or (policy is not None and state.fp8_forward is not None)  # gathered in FP8
                or (first is not None and first.gtp_state.group >= 0)
            ):
                return None
            slot, which = state.bwd, 1
        previous = last[which]
        if slot.fmt is not None or (previous is not None and previous.gtp_state.group >= 0):
            return None
        # -- from here on the general path's steps, in its order
        if previous is not None and previous is not param:
            self.release(previous, direction)
        if which:
            first = last[0]
            if first is not None:
                self.release(first, _FWD)
                last[0] = None
        last[which] = param
        if policy is not None and not which:
            state.fp8_forward = None  # this forward gathers the training dtype
        self._fmt = None
        if slot.state is _NONE:
            if len(slot.unit) == 1:
                self._issue(param, slot, async_op=False)
            else:  # e.g. the chain head: the rest of its unit, at once
                self._issue_unit(slot.unit[slot.unit_pos :], sync_slot=slot)
        if slot.state is _ASYNC:
            slot.complete()
        if self._prefetch_enabled:
            targets = slot.ahead
            if not targets and not which:  # the forward tail hands over to the backward
                if torch.is_grad_enabled() or state.forward_grad_enabled:
                    targets = slot.handover
            if targets:
                self._prefetch_all(targets)
        if not which and self.consumer_quantize is not None:
            self._note_forward(self.consumer_quantize, (param,))
        return [self._protocol_alias(param, direction, slot.full)]

    @staticmethod
    def _note_forward(requant: ConsumerQuantize, members: tuple[GTPShardedParam, ...]) -> None:
        """Keep on each member the consumer's note of this forward for its backward consume
        (None: the forward does not quantize). Taken whatever the grad mode: a layer captured
        in a CUDA graph records none (design §3.5), and a note without a backward is unused."""
        notes = requant.forward_notes(members)
        if notes is None:
            for member in members:
                member.gtp_state.quantize_note = None
            return
        if len(notes) != len(members):
            raise ValueError(
                f"{type(requant).__name__}.forward_notes returned {len(notes)} notes for a "
                f"group of {len(members)} weights"
            )
        for member, note in zip(members, notes):
            member.gtp_state.quantize_note = note

    def _protocol_alias(
        self, param: GTPShardedParam, direction: Direction, full: torch.Tensor
    ) -> torch.Tensor:
        """The gathered ``full`` as TE is handed it: an alias carrying the param's
        ``requires_grad`` (TE 2.20's LayerNormLinear reads requires_grad from the tensor it is
        handed, not from the param, to decide whether to keep its input and compute the wgrad
        at all). TE only reads it (its autograd forward runs without grad), so one alias per
        cache buffer serves every step; a fallback buffer's is never kept."""
        slot = param.gtp_state.fwd if direction is _FWD else param.gtp_state.bwd
        wants_grad = param.requires_grad
        if full is not slot.cache_full:
            return full.detach().requires_grad_(wants_grad)
        cached = slot.alias
        if cached is None or cached[0] is not full or cached[1].requires_grad != wants_grad:
            with torch.inference_mode(False):
                cached = slot.alias = (full, full.detach().requires_grad_(wants_grad))
        return cached[1]

    def finalize_group_for_protocol(
        self, param: GTPShardedParam, wgrads: list[torch.Tensor] | tuple[torch.Tensor, ...]
    ) -> int:
        """TE's ``finalize_group_grads`` on ``param``: reduce-scatter one full wgrad per member
        of its group (:meth:`protocol_members`, same order); returns the group's size."""
        if param.gtp_state.group < 0 and len(wgrads) == 1:  # every dense TE linear
            self.reduce_scatter_foreign_wgrad(param, wgrads[0])
            return 1
        members = self.protocol_members(param)
        if len(wgrads) != len(members):
            plural = "s" if len(members) > 1 else ""
            raise ValueError(
                f"{param!r} leads a group of {len(members)} weight{plural}, got {len(wgrads)} "
                "wgrads"
            )
        for member, wgrad in zip(members, wgrads):
            self.reduce_scatter_foreign_wgrad(member, wgrad)
        return len(members)

    # ----------------------------------------------------------------- reduce-scatter side
    def _bind_pools(self, param: GTPShardedParam, dtype: torch.dtype) -> None:
        self.builds += 1
        spec, rs = param.gtp_spec, param.gtp_state.rs
        rs.scratch_pool = self.wgrad_pool.free_list(
            spec.gathered_shape,
            dtype,
            param.device,
            zero_from=spec.logical_shape[0],
            ring=param.gtp_state.ring,
        )
        rs.output_pool = self.wgrad_pool.free_list(spec.shard_shape, dtype, param.device)
        rs.recv_pool = self.wgrad_pool.free_list(spec.gathered_shape, dtype, param.device)
        numel = spec.padded_dim0 * math.prod(spec.logical_shape[1:])
        rs.nbytes = numel * dtype.itemsize * (self.size - 1) // self.size

    def wgrad_scratch(self, param: GTPShardedParam) -> torch.Tensor:
        """A pooled full-size wgrad buffer (dtype of ``main_grad``); pad rows are zero."""
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            dtype = main_grad.dtype
        else:  # an FP8 primary shard's gradient is in its training dtype
            dtype = param.training_dtype
        pool = param.gtp_state.rs.scratch_pool
        if pool is None or pool.dtype is not dtype:
            self._bind_pools(param, dtype)
            pool = param.gtp_state.rs.scratch_pool
        return pool.get()

    def protocol_grad_buffer(self, param: GTPShardedParam) -> torch.Tensor:
        """Logical (unpadded) view of a pooled scratch for TE's fused wgrad GEMM."""
        state = param.gtp_state
        if state.protocol_scratch is None:
            state.protocol_scratch = self.wgrad_scratch(param)
        return param.gtp_spec.unpad(state.protocol_scratch)

    def reduce_scatter_foreign_wgrad(self, param: GTPShardedParam, wgrad: torch.Tensor) -> None:
        """Reduce-scatter a full logical-shape wgrad produced outside this runtime (e.g. TE).

        ``wgrad`` is either the view :meth:`protocol_grad_buffer` handed out (no copy) or any
        tensor of the logical shape (copied into pooled scratch, pad rows zero).
        """
        spec, state = param.gtp_spec, param.gtp_state
        if wgrad.shape != spec.logical_shape:
            raise ValueError(
                f"{state.name}: wgrad shape {tuple(wgrad.shape)} != logical weight "
                f"shape {spec.logical_shape}"
            )
        scratch, state.protocol_scratch = state.protocol_scratch, None
        if scratch is None or scratch.data_ptr() != wgrad.data_ptr():
            if scratch is not None:
                state.rs.scratch_pool.put(scratch)
            scratch = self.wgrad_scratch(param)
            spec.unpad(scratch).copy_(wgrad)
        self.reduce_scatter_wgrad(param, scratch)

    def reduce_scatter_wgrad(self, param: GTPShardedParam, scratch: torch.Tensor) -> None:
        """Reduce-scatter ``scratch`` (from :meth:`wgrad_scratch`) into ``param``'s main_grad.

        Scaling per design §3.2: MEAN (1/GTP pre-scale, or NCCL's AVG) unless
        ``calculate_per_token_loss`` or ``shard_replicated_params_over_gtp``
        (:attr:`GTPConfig.sums_over_gtp`: SUM). Async with one-step-deferred finalize, except the
        chain head (and everything when ``async_reduction`` is off), which is synchronous.
        """
        state = param.gtp_state
        rs, chain = state.rs, state.chain
        if self._carry and (
            rs.state is _RS_STAGED or self._carry[0].gtp_state.segment != state.segment
        ):
            self._issue_carry()  # the next graph's first wgrad (or the same weight again)
        if rs.state is not _RS_NONE:  # same weight twice in one backward
            if rs.state is _RS_STAGED:
                self._flush_staged(chain)
            self._finalize_all((param,))
            chain.pending_rs[:] = [p for p in chain.pending_rs if p is not param]
        unit = state.rs_unit
        staged = chain.staged
        if staged and (unit is None or staged[0].gtp_state.rs_unit is not unit):
            self._flush_staged(chain)  # a unit whose other wgrads never came (or out of order)
        if self._prescale is not None:
            scratch.mul_(self._prescale)
        if unit is not None and not self._fp32_accumulation:
            rs.staged(scratch)
            staged.append(param)
            if len(staged) == len(unit):
                if state.ring >= 0:  # the segment's head unit: reduced in the next graph
                    self._carry_staged(chain)
                else:
                    self._flush_staged(chain)
            return
        if state.ring >= 0:
            rs.staged(scratch)
            staged.append(param)
            self._carry_staged(chain)
            return
        output = rs.output_pool.get()
        if self._fp32_accumulation:
            recv = rs.recv_pool.get()
            work = reduce_scatter_wgrad(
                output, scratch, self._rs_group, async_op=True, fp32_recv=recv
            )
        else:
            recv = None
            work = self._rs_ops.reduce_scatter(output, scratch, average=self._average_in_collective)
        self.stats.reduce_scatter_collectives += 1
        rs.issued(work, scratch, output, recv)
        self._after_reduce_scatter(
            chain, (param,), state.is_head or not self.config.async_reduction
        )

    def _flush_staged(self, chain: Chain) -> None:
        """Reduce-scatter the staged wgrads of ``chain``'s unit in one collective."""
        params = tuple(chain.staged)
        chain.staged.clear()
        if params:
            self._reduce_scatter_staged(params)

    def _reduce_scatter_staged(self, params: tuple[GTPShardedParam, ...]) -> None:
        """One collective over ``params``' staged wgrads (a coalescing unit, or a carry)."""
        outputs = [p.gtp_state.rs.output_pool.get() for p in params]
        scratches = [p.gtp_state.rs.scratch for p in params]
        average = self._average_in_collective
        if len(params) == 1:
            work = self._rs_ops.reduce_scatter(outputs[0], scratches[0], average=average)
        else:
            work = self._rs_ops.reduce_scatter_coalesced(outputs, scratches, average=average)
        self.stats.reduce_scatter_collectives += 1
        shared = SharedWork()
        shared.work = work
        for param, output, scratch in zip(params, outputs, scratches):
            param.gtp_state.rs.issued(shared, scratch, output, None)
        # A head reduces synchronously (nothing follows it in its chain or graph), unless it
        # is a carried head: then it is the next graph's, finalized by that graph's drain.
        sync = not self.config.async_reduction or any(
            p.gtp_state.is_head and p.gtp_state.ring < 0 for p in params
        )
        self._after_reduce_scatter(params[0].gtp_state.chain, params, sync)

    def _after_reduce_scatter(
        self, chain: Chain, params: tuple[GTPShardedParam, ...], sync: bool
    ) -> None:
        """Count and trace the reduce-scatter just issued for ``params``, finalize the previous
        one of ``chain`` (the one-step deferral), and finalize these at once when ``sync``."""
        stats = self.stats
        stats.reduce_scatters += len(params)
        for param in params:
            stats.reduce_scatter_bytes += param.gtp_state.rs.nbytes  # set with its pools
        if self.trace is not None:
            for param in params:
                self.record("rs_issue_sync" if sync else "rs_issue_async", param, _BWD)
        pending = chain.pending_rs
        if pending:  # the one-step-deferred finalize of the previous weight(s) or unit
            self._finalize_all(pending)
            pending.clear()
        if sync:
            self._finalize_all(params)
        else:
            pending.extend(params)

    def _finalize_all(self, params: list[GTPShardedParam] | tuple[GTPShardedParam, ...]) -> None:
        """Finalize the reduce-scatters of ``params`` (one weight, or a unit): wait, add each
        reduced shard into ``main_grad`` (one multi-tensor add for all of them: one launch per
        unit, not per weight; ``.grad`` without DDP), return the buffers, fire DDP's grad-ready
        hooks — each hook after its weight's add, none under the grad guard (design §3.5)."""
        main_grads, outputs = [], []
        timed = self.wait_timer.enabled
        guard, recording = self._guard, self._recording
        for param in params:
            state = param.gtp_state
            rs = state.rs
            if timed:
                self.wait_timer.timed_wait(rs.complete, "reduce_scatter", param.device, state.name)
            else:
                rs.complete()
            main_grad = getattr(param, "main_grad", None)
            if guard is not None and id(param) not in guard:
                self._back_up_grad(param, main_grad)
            if recording is not None:
                recording.append(param)
            if main_grad is not None:
                main_grads.append(main_grad)
                outputs.append(rs.output)
            elif param.grad is None:
                param.grad = rs.output.to(param.dtype, copy=True)
            else:
                param.grad.add_(rs.output)
        if len(main_grads) == 1:
            main_grads[0].add_(outputs[0])
        elif main_grads:
            torch._foreach_add_(main_grads, outputs)
        for param in params:
            state = param.gtp_state
            state.rs.finished()
            if self.trace is not None:
                self.record("finalize", param, _BWD)
            if state.grad_ready_hook is not None and guard is None:
                state.grad_ready_hook()

    # ----------------------------------------------------------------- fences
    def drain_reduce_scatters(self) -> None:
        """Finalize every pending reduce-scatter (the fence before main_grad is read)."""
        for chain in self.chains.values():  # ChainId order: the same on every GTP peer
            self._flush_staged(chain)
        if self._carry:
            self._issue_carry()
        for chain in self.chains.values():
            pending, chain.pending_rs = chain.pending_rs, []
            if pending:
                self._finalize_all(pending)

    def drain_gathers(self) -> None:
        """Complete and release every outstanding gather (e.g. an unconsumed prefetch)."""
        for chain in self.chains.values():
            chain.protocol_last = [None, None]
        for param in self.params:
            self.release(param, _FWD)
            self.release(param, _BWD)

    def drain(self) -> None:
        """Both fences: no GTP communication is in flight afterwards.

        Also the step boundary: the optimizer may write the shards next (megatron's bf16 path
        does so through ``.data``, invisibly to version counters), so the copy-engine mirror and
        the FP8 shard copies are marked stale here and refreshed by the next gather.
        """
        self.drain_reduce_scatters()
        self.drain_gathers()
        for chain in self.chains.values():  # a recompute order seen in this step is now known
            if chain.recompute_order and chain.recompute_phase is ChainPhase.OBSERVING:
                chain.commit_recompute()
                self.builds += 1
        if self._mirror is not None:
            self._mirror.mark_stale()
        self.fp8_shards.mark_stale()

    # ----------------------------------------------------------------- introspection
    def outstanding(self) -> dict[str, int]:
        """What a :meth:`drain` would still complete: ``gathers`` issued or held (either
        direction) and ``reduce_scatters`` not finalized; both 0 when nothing is in flight.

        Example::

            runtime.drain()
            assert runtime.outstanding() == {"gathers": 0, "reduce_scatters": 0}
        """
        gathers = reduce_scatters = 0
        for param in self.params:
            state = param.gtp_state
            gathers += (state.fwd.state is not _NONE) + (state.bwd.state is not _NONE)
            reduce_scatters += state.rs.state is not ReduceScatterState.NONE
        return {"gathers": gathers, "reduce_scatters": reduce_scatters}

    def enable_trace(self) -> list[tuple[str, str, str]]:
        """Start recording ``(event, param name, direction)`` tuples; returns the list."""
        self.trace = []
        return self.trace

    def record(self, event: str, param: GTPShardedParam, direction: Direction | str) -> None:
        """Append ``(event, param name, direction)`` to the trace, when tracing (direction
        ``"rc"``: a gather of the activation-recompute forward)."""
        if self.trace is not None:
            label = direction if isinstance(direction, str) else direction.value
            self.trace.append((event, param.gtp_state.name, label))


def runtimes_of(*modules: torch.nn.Module) -> list[GTPRuntime]:
    """The live :class:`GTPRuntime` objects owning the GTP weights of ``modules`` (in order).

    Shards built pre-sharded but not yet registered (a layer spec rewritten by
    ``gtp_layer_spec``, before ``shard_model`` ran) have no runtime yet and are skipped.

    Example::

        for runtime in runtimes_of(model):
            runtime.drain()
    """
    found: dict[int, GTPRuntime] = {}
    for module in modules:
        for param in module.parameters():
            if isinstance(param, GTPShardedParam):
                ref = param.gtp_state.runtime
                runtime = ref() if ref is not None else None
                if runtime is not None:
                    found.setdefault(id(runtime), runtime)
    return list(found.values())

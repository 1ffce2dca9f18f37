"""The all-gather side of a :class:`~nemo_gtp.engine.runtime.GTPRuntime` (design §1.1, §3.1).

Mixed into ``GTPRuntime``: everything between a weight's shard and the full weight a GEMM
multiplies with. A consume (:meth:`GatherSide.materialize`) waits the gather its predecessor
prefetched, or gathers synchronously (the cold start, a chain head, a misprediction), then
issues the async gathers of the next units of its chain before the GEMM runs. Gathers land in
the stable buffers of the runtime's ticket cache (:class:`~nemo_gtp.engine.buffers.GTPWeightCache`)
through one of two backends (:class:`GatherBackend`), chosen once at the first gather. A
coalescing unit's members gather in one collective and share its handle
(:class:`~nemo_gtp.engine.slots.SharedWork`).

[Note: a gather slot's binding]
Each direction of each weight keeps its cache slot, the slot's unpadded view, the bytes it
moves and (copy engine) its pull plan on its :class:`~nemo_gtp.engine.slots.GatherSlot`, found
once by :meth:`GatherSide._bind` and again only when ``rebind`` is set (the chain order was
committed, or the backend resolved) or the gather format changed (FP8 vs the training dtype):
the steady-state step follows attributes and allocates nothing (design §3.5 capture).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from nemo_gtp.engine.buffers import BufferKey, CacheSlot, GTPWeightCache
from nemo_gtp.engine.chain import ChainPhase
from nemo_gtp.engine.collectives import GroupCollectives
from nemo_gtp.engine.copy_engine import (
    EventWork,
    SymmetricShardMirror,
    agree_on_copy_engine,
    copy_engine_available,
)
from nemo_gtp.engine.fp8 import FP8Scaling, ScalingKind
from nemo_gtp.engine.fp8_gather import padded_scale_shape
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.slots import Direction, GatherSlot, GatherState, SharedWork

__all__ = ["GatherBackend", "GatherSide", "backward_task_id"]

_FWD, _BWD = Direction.FWD, Direction.BWD
_NONE, _ASYNC = GatherState.NONE, GatherState.ASYNC_WAIT
_BLOCKWISE = ScalingKind.BLOCKWISE

backward_task_id = torch._C._current_graph_task_id
"""The id of the autograd backward running on this thread, -1 outside one: a forward consume
inside a backward is an activation-recompute forward (megatron's ``CheckpointFunction``,
``torch.utils.checkpoint``), which has its own chain (design §3.1).

Example::

    recompute = backward_task_id() != -1
"""


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


class GatherSide:
    """The all-gather side of a ``GTPRuntime``: consumes, prefetches, the gather backends (§3.1).

    Part of the runtime, split off by concern, not a class of its own: it owns the state
    :meth:`setup_gather_side` sets up and reads the runtime's chains, params, stats and trace;
    the FP8 formats of a gather come from :class:`~nemo_gtp.engine.fp8_gather.FP8GatherSide`.

    Offers the other parts: ``issue_gather``, ``issue_unit_gather``, ``prefetch_units``,
    ``prefetch_enabled`` and ``gather_fmt`` (the protocol's dense consume), ``materialize``,
    ``release``, ``drain_gathers``, ``weight_cache``, ``shard_mirror``, ``setup_gather_side``.
    Uses from the other parts: ``canonical_fp8``, ``known_fp8``, ``fp8_gather_source``,
    ``fp8_primary`` (FP8 gathers); ``ring_carry``, ``reduce_scatter_carry``,
    ``commit_graph_segments`` (graph segments).

    Example::

        full = runtime.materialize(param, Direction.FWD, will_backward=True)
        out = x @ runtime.gemm_weight(param, Direction.FWD, full).t()
        runtime.release(param, Direction.FWD)
    """

    def setup_gather_side(self) -> None:
        """The gather side's state: collectives, backend, ticket cache, prefetch switch (called
        once, from ``GTPRuntime.__init__``)."""
        self._ops = GroupCollectives(self.group)
        self.shard_mirror: SymmetricShardMirror | None = None
        """The copy-engine mirror of the shards (``GatherBackend.COPY_ENGINE`` only, else None);
        marked stale at every drain, as the optimizer may write the shards next."""
        self.gather_backend: GatherBackend | None = None  # resolved at the first gather
        self._use_mirror = False
        self.tokens_per_gemm = 0
        self.prefetch_enabled = self.config.weight_prefetch
        """Whether consumes issue the async gathers of their chain's next units."""
        self.weight_cache = GTPWeightCache()
        self.gather_fmt: FP8Scaling | None = None
        """The format of the gathers the consume being served issues (None: the training dtype);
        set by each consume before it issues, read by :meth:`issue_gather` and
        :meth:`issue_unit_gather`."""
        self._label: str | None = None  # trace label of the consume being served

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
            recompute = backward_task_id() != -1
        else:
            slot = state.bwd
            if self.ring_carry and self.ring_carry[0].gtp_state.segment != state.segment:
                self.reduce_scatter_carry()  # the next graph's first backward consume
        if self.fp8_primary is not None:  # the shards are FP8: nothing else to gather
            fp8 = self.fp8_primary
        if fp8 is not None and fp8 is not self.known_fp8:
            fp8 = self.canonical_fp8(fp8)
        if slot.state is not _NONE and slot.fmt is not fp8:
            # Prefetched in the other format (the edge of an FP8 region): gather again.
            self.release(param, direction)
            self.stats.format_regathers += 1
        self.gather_fmt = fp8
        if chain.phase is ChainPhase.OBSERVING and chain.observe(param, direction):
            self.builds += 1
            self.commit_graph_segments(chain)
        if recompute:
            self._label = "rc"  # trace only
            if chain.recompute_phase is ChainPhase.OBSERVING:
                chain.observe_recompute(param)
        if slot.state is _NONE:
            if recompute or len(slot.unit) == 1:
                self.issue_gather(param, slot, async_op=False)
            else:  # e.g. the chain head: the rest of its unit (not what was consumed), at once
                self.issue_unit_gather(slot.unit[slot.unit_pos :], sync_slot=slot)
        if slot.state is _ASYNC:
            if self.wait_timer.enabled:
                self.wait_timer.timed_wait(slot.complete, "gather", param.device, state.name)
            else:
                slot.complete()
        if self.prefetch_enabled:  # links are empty until their chain is committed
            # a recompute consume follows the recompute chain, never the forward chain's links;
            # it gathers weight by weight (a recompute may re-run only part of a unit)
            if recompute:
                for target in slot.recompute_ahead:
                    if target.state is _NONE:
                        self._prefetch(target)
            else:  # inlined _forward_targets: most consumes lead no unit (nothing to issue)
                targets = slot.ahead if slot.ahead or not will_backward else slot.handover
                if targets:
                    self.prefetch_units(targets)
        self._label = None
        self.gather_fmt = None
        return slot.full

    def prefetch_neighbour(
        self, param: GTPShardedParam, direction: Direction, *, will_backward: bool = False
    ) -> None:
        """Issue the async gather the next consume in ``direction`` will need (design §3.1)."""
        # the autograd path gathers the training dtype, or the FP8 primary shards
        self.gather_fmt = self.known_fp8 if self.fp8_primary is not None else None
        if self.prefetch_enabled:
            self.prefetch_units(_forward_targets(param.gtp_state.slot(direction), will_backward))

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

    def prefetch_units(self, targets: tuple[GatherSlot, ...]) -> None:
        """Issue the async gather of each target's unit not gathered yet (each target leads a
        unit: one weight alone, or a coalescing unit in one collective)."""
        for target in targets:  # each target leads a unit
            if target.state is _NONE:
                if len(target.unit) == 1:
                    self._prefetch(target)
                else:
                    self.issue_unit_gather(target.unit)

    def _prefetch(self, slot: GatherSlot) -> None:
        if self.issue_gather(self.params[slot.index], slot, async_op=True):
            self.stats.prefetches += 1
        else:
            self.stats.prefetch_skipped += 1

    def _bind(self, param: GTPShardedParam, slot: GatherSlot) -> None:
        """Find ``slot``'s cache slot (its ticket) and precompute what each gather reuses."""
        state = param.gtp_state
        if not param.is_contiguous():
            raise ValueError(f"{state.name}: GTP shard is not contiguous")
        fmt = self.gather_fmt
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
            slot.pull_plan = self.shard_mirror.pull_plan(buffer, param)
            slot.pull_work = slot.pull_work or EventWork(self.shard_mirror.ops)

    def _cache_of(self, param: GTPShardedParam, slot: GatherSlot) -> CacheSlot:
        """``slot``'s cache slot, bound at its first gather (outside inference mode: the buffer
        and the cached views outlive an evaluation loop that ran the first gather)."""
        cache = slot.cache
        if (
            cache is None
            or cache.buffer is None
            or slot.rebind
            or slot.bound_fmt is not self.gather_fmt
        ):
            with torch.inference_mode(False):
                self._bind(param, slot)
            cache = slot.cache
        return cache

    def issue_gather(self, param: GTPShardedParam, slot: GatherSlot, *, async_op: bool) -> bool:
        """Gather ``param`` into ``slot`` alone (not coalesced), in :attr:`gather_fmt`.

        ``async_op`` (a prefetch): skipped, returning False, when the slot's cache buffer is
        held; else (a GEMM waits) a held buffer means a fallback buffer. True once issued."""
        if self.gather_backend is None:
            self._resolve_gather_backend(param.device)
        fmt = self.gather_fmt
        # detached: gloo copies the local shard under autograd's eyes. FP8: the shard's FP8 copy,
        # always through the process group (the copy-engine mirror holds the training dtype).
        source = param.detach() if fmt is None else self.fp8_gather_source(param, fmt)
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
                    self.shard_mirror.pull_plan(buffer, param),
                    EventWork(self.shard_mirror.ops),
                )
        if mirror:
            work = self.shard_mirror.pull(pull_plan, param, pull_work)
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

    def issue_unit_gather(
        self, unit: tuple[GatherSlot, ...], sync_slot: GatherSlot | None = None
    ) -> None:
        """Gather every not-yet-gathered slot of a coalescing unit in one collective.

        ``sync_slot``: the slot a GEMM is waiting for (must be gathered, into a fallback buffer
        if its cache slot is held); the others are prefetches, skipped when their buffer is held.
        """
        if self.gather_backend is None:
            self._resolve_gather_backend(self.params[unit[0].index].device)
        fmt = self.gather_fmt
        if self._use_mirror and fmt is None:  # copy-engine pulls are per weight anyway
            for slot in unit:
                if slot.state is _NONE:
                    if slot is sync_slot:
                        self.issue_gather(self.params[slot.index], slot, async_op=False)
                    else:
                        self._prefetch(slot)
            return
        members, buffers, shards = [], [], []
        params, stats = self.params, self.stats
        for slot in unit:
            if slot.state is not _NONE:
                continue
            param = params[slot.index]
            source = param.detach() if fmt is None else self.fp8_gather_source(param, fmt)
            cache = self._cache_of(param, slot)
            if cache.try_acquire(slot):
                members.append(slot)
                buffers.append(cache.buffer if fmt is None else slot.wire)
                shards.append(source)
                if slot.scale_wire is not None:  # blockwise: the block scales beside the rows
                    buffers.append(_bytes(slot.scale_wire))
                    shards.append(_bytes(param.gtp_state.fp8_scale_wire))
            elif slot is sync_slot:  # only when the observed order mispredicts
                self.issue_gather(param, slot, async_op=False)
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
                self.shard_mirror = SymmetricShardMirror(self.params, self.group)
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

    def note_tokens(self, tokens: int) -> None:
        """Rows of the GEMMs about to run (read by gather_backend='auto' at the first gather)."""
        self.tokens_per_gemm = tokens

    def reset_gather_backend(self) -> None:
        """Decide ``gather_backend`` again at the next gather (e.g. after a sequence-length change).

        Call on every GTP peer at the same step boundary; drains first. The next gather is then
        collective again (agreement, and the mirror's rendezvous if the copy engine is chosen).
        """
        self.drain()
        if self.shard_mirror is not None:
            self.shard_mirror.close()
        self.gather_backend, self.shard_mirror, self._use_mirror = None, None, False

    def drain_gathers(self) -> None:
        """Complete and release every outstanding gather (e.g. an unconsumed prefetch)."""
        for chain in self.chains.values():
            chain.protocol_last = [None, None]
        for param in self.params:  # the state test inline: most slots hold nothing here
            state = param.gtp_state
            if state.fwd.state is not _NONE:
                self.release(param, _FWD)
            if state.bwd.state is not _NONE:
                self.release(param, _BWD)

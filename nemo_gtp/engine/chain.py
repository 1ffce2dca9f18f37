"""The prefetch chain: a runtime's observed forward order of its weights (design §1.1, §3.4).

A :class:`Chain` records the order of the first forward's consumes, commits it at the first
backward consume, cuts it into coalescing units (design §3.1) and links every unit's leading
gather slots to the units they prefetch, once. Chains of different :class:`ChainId` never link
(eager vs CUDA-graph-captured weights, design §1.2), and inside the GRAPHED chain links never
leave a graph segment (design §3.5). The runtime that owns a chain drives it
(:mod:`nemo_gtp.engine.runtime`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.slots import Direction, SharedWork

_BWD = Direction.BWD


class ChainId(enum.Enum):
    """Prefetch chains; neighbours only ever link params of the same chain (design §1.2)."""

    UNGRAPHED = "ungraphed"
    """Weights that run eagerly (every weight, unless per-layer CUDA graphs capture it)."""
    GRAPHED = "graphed"
    """Weights inside captured CUDA graphs; never linked to eager weights (design §1.2)."""
    EXPERT_FC1 = "expert_fc1"
    """Routed experts' first linears: one weight group per MoE block, linked block to block, so
    a block's consume prefetches the next block's fc1 experts (design §3.4 "Grouped-expert
    chains"). Eager only."""
    EXPERT_FC2 = "expert_fc2"
    """Routed experts' second linears, the same way (a chain of their own: a merged chain would
    link fc1 to fc2 of the same block, one GEMM of runway)."""


class ChainPhase(enum.Enum):
    """Lifecycle of one chain's link table (design §3.4 "Linking", on the first forward)."""

    OBSERVING = "observing"
    """First forward: consumes are appended to the order; nothing is prefetched yet."""
    LINKED = "linked"
    """The order is committed and linked; every consume prefetches its neighbour."""


@dataclass(frozen=True)
class WeightGroup:
    """Weights that always gather and reduce-scatter together, as one coalescing unit.

    ``params`` in their module order; ``together``: TransformerEngine hands the whole group to
    ``params[0]`` (``GroupedLinear``: ``weights[0]`` materializes every expert's weight, and its
    ``finalize_group_grads`` receives every wgrad); otherwise each member is consumed on its own
    (megatron ``SequentialMLP``: one linear per expert) and only the collectives are shared
    (design §3.4 "Grouped-expert chains").
    """

    params: tuple[GTPShardedParam, ...]
    together: bool


def coalescing_units(
    order: list[GTPShardedParam],
    unit_bytes: float,
    groups: list[WeightGroup] | tuple[WeightGroup, ...] = (),
) -> list[tuple[GTPShardedParam, ...]]:
    """Cut a chain's forward order into coalescing units (design §3.1 "Coalescing units").

    Greedy and order-preserving: a unit takes consecutive weights of one dtype and one CUDA-graph
    segment (design §3.5: a collective never spans two graphs) while their gathered (padded)
    bytes in the training dtype (an FP8 primary shard counts as its training dtype, so FP8
    does not double a unit's weights and wgrad scratch) stay within ``unit_bytes``; a weight
    larger than that is a unit alone, so
    ``unit_bytes=0`` gives one unit per weight. The first and the last weight of a captured
    segment are units alone (design §3.5 "Segment heads": the graph gathers its forward and
    backward head units and reduce-scatters its head unit synchronously, so each of those
    exposes one weight's collective, not a layer's). A weight of a :class:`WeightGroup`
    (``groups[param.gtp_state.group]``: the runtime's ``weight_groups``) brings its whole group
    as one unit of its own, whatever its size, at the place of the first member observed
    (members never observed are left out).

    Example::

        coalescing_units(chain.order, 64 * 2**20)   # [(qkv, proj), (fc1,), (fc2, qkv'), ...]
        coalescing_units(captured_layer, 2**30)     # [(qkv,), (proj, fc1), (fc2,)]
    """
    units: list[tuple[GTPShardedParam, ...]] = []
    current: list[GTPShardedParam] = []
    observed = {id(param) for param in order}
    placed: set[int] = set()
    size = 0
    segments = [param.gtp_state.segment for param in order]
    alone = {  # a captured segment's first and last weights
        id(param)
        for i, param in enumerate(order)
        if segments[i] >= 0
        and (
            i == 0
            or segments[i - 1] != segments[i]
            or i + 1 == len(order)
            or segments[i + 1] != segments[i]
        )
    }
    for param in order:
        index = param.gtp_state.group
        if index >= 0:
            if index not in placed:
                placed.add(index)
                if current:
                    units.append(tuple(current))
                    current, size = [], 0
                units.append(tuple(q for q in groups[index].params if id(q) in observed))
            continue
        nbytes = math.prod(param.gtp_spec.gathered_shape) * param.training_dtype.itemsize
        if current and (
            size + nbytes > unit_bytes
            or param.dtype != current[0].dtype
            or param.gtp_state.segment != current[0].gtp_state.segment
            or id(param) in alone
            or id(current[0]) in alone
        ):
            units.append(tuple(current))
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        units.append(tuple(current))
    return units


class Chain:
    """The observed forward order of one chain's weights.

    Committing the order (:meth:`observe` returns True) cuts it into coalescing units and links
    every unit's leading gather slots to the units they prefetch (``GatherSlot.ahead``) once, so
    the steady-state step never searches.

    [Note: graph segments] (design §3.5) A weight captured in a CUDA graph carries the index of
    its graph (``GTPParamState.segment``; -1: eager). Links never leave a segment: a unit's
    ``ahead`` names only units of its own segment, the first unit of every segment is a head
    (its forward gather is not prefetched, so the graph issues it; its reduce-scatter is
    synchronous, so the graph's deferred reduce-scatters finish inside it), and a captured
    segment's forward tail hands nothing over (its backward is another graph). For a chain of
    eager weights (all -1) this is the single-segment chain of design §1.1.
    """

    def __init__(
        self,
        chain_id: ChainId,
        depth: int = 1,
        unit_bytes: float = 0,
        groups: list[WeightGroup] | None = None,
    ) -> None:
        self.chain_id = chain_id
        self.depth = depth  # units gathered ahead of each consume
        self.unit_bytes = unit_bytes  # GTPConfig.coalesce_mb in bytes
        self.weight_groups = groups if groups is not None else []  # the runtime's
        self.phase = ChainPhase.OBSERVING
        self.order: list[GTPShardedParam] = []
        self.units: list[tuple[GTPShardedParam, ...]] = []
        self._seen: set[int] = set()
        self.recompute_phase = ChainPhase.OBSERVING
        self.recompute_order: list[GTPShardedParam] = []
        self._recompute_seen: set[int] = set()
        self.live = 0  # gathered buffers currently held by this chain's weights
        self.max_live = 0
        self.protocol_last: list[GTPShardedParam | None] = [None, None]  # TE: per direction
        # Reduce-scatter bookkeeping is per chain, so interleaved chains (the expert fc1 / fc2
        # roles, whose wgrads alternate in the backward) each stage their own unit and defer
        # their finalize by one unit of their own chain (design §3.4).
        self.staged: list[GTPShardedParam] = []  # wgrads waiting for the rest of their unit
        self.pending_rs: list[GTPShardedParam] = []  # issued, finalized at the next issue

    def observe(self, param: GTPShardedParam, direction: Direction) -> bool:
        """Record a consume during the first pass; True when this consume committed the order.

        The pass ends at the first backward consume, or when a forward consume repeats a weight
        (the next forward started, or a weight is used twice: either way the order is known).
        """
        if self.phase is not ChainPhase.OBSERVING:
            raise RuntimeError(f"chain {self.chain_id.value} is already linked")
        if direction is _BWD or id(param) in self._seen:
            self._commit()
            return True
        self._seen.add(id(param))
        self.order.append(param)
        return False

    def _commit(self) -> None:
        self.phase = ChainPhase.LINKED
        units = self.units = coalescing_units(self.order, self.unit_bytes, self.weight_groups)
        n, depth = len(units), self.depth
        seg = [unit[0].gtp_state.segment for unit in units]
        for u, members in enumerate(units):
            # Weights of units within ``depth`` of each other can be live at once; same-shape
            # ones get different parities (design §3.1), so a prefetch never lands in the buffer
            # a GEMM still reads. Greedy: the smallest parity no such earlier weight uses.
            # Units of another graph segment are never live with this one.
            window = [q for j in range(max(0, u - depth), u) if seg[j] == seg[u] for q in units[j]]
            for param in members:
                state = param.gtp_state
                taken = {
                    q.gtp_state.parity
                    for q in window
                    if q.gtp_spec.gathered_shape == param.gtp_spec.gathered_shape
                    and q.dtype == param.dtype
                }
                state.parity = min(p for p in range(len(window) + 1) if p not in taken)
                window.append(param)
                state.is_head = False
                for slot in (state.fwd, state.bwd):  # parity may have changed the ticket
                    slot.rebind = True
                    slot.ahead, slot.handover = (), ()
            # One collective per unit and direction: members share its handle, and the slot
            # consumed first in each direction carries the links to the units it prefetches.
            fwd_unit = tuple(q.gtp_state.fwd for q in members)
            bwd_unit = tuple(q.gtp_state.bwd for q in reversed(members))
            coalesced = len(members) > 1
            fwd_work, bwd_work = (SharedWork(), SharedWork()) if coalesced else (None, None)
            # A frozen weight (PEFT, design §1.1 "Frozen weights") gathers with its unit but
            # has no wgrad: the unit's reduce-scatter is over its trainable members alone.
            trained = tuple(q for q in members if q.requires_grad)
            for param in members:
                state = param.gtp_state
                state.fwd.unit, state.fwd.unit_work = fwd_unit, fwd_work
                state.bwd.unit, state.bwd.unit_work = bwd_unit, bwd_work
                state.fwd.unit_pos = fwd_unit.index(state.fwd)
                state.bwd.unit_pos = bwd_unit.index(state.bwd)
                state.rs_unit = trained if len(trained) > 1 else None
            fwd_unit[0].ahead = tuple(
                units[j][0].gtp_state.fwd
                for j in range(u + 1, u + 1 + depth)
                if j < n and seg[j] == seg[u]
            )
            bwd_unit[0].ahead = tuple(
                units[j][-1].gtp_state.bwd
                for j in range(u - 1, max(-1, u - 1 - depth), -1)
                if seg[j] == seg[u]
            )
            if u == n - 1 and seg[u] == -1:  # the eager forward tail hands over to the backward
                fwd_unit[0].handover = tuple(
                    units[j][-1].gtp_state.bwd
                    for j in range(n - 1, max(-1, n - 1 - depth), -1)
                    if seg[j] == -1
                )
        # The head unit of the chain and of each graph segment reduces synchronously: its
        # backward is the last, and nothing after it would finalize a deferred reduce-scatter
        # before the next microbatch (whose grad-ready hooks DDP counts as its own). With
        # frozen weights (design §1.1) that is the first unit holding a trained weight, and the
        # marked weight its first trained one (the backward's last of the unit): a frozen
        # weight issues no reduce-scatter to finalize the deferred ones.
        for u in range(n):
            if u > 0 and seg[u] == seg[u - 1]:
                continue
            end = next((j for j in range(u, n) if seg[j] != seg[u]), n)
            head = next((j for j in range(u, end) if any(q.requires_grad for q in units[j])), u)
            first = next((q for q in units[head] if q.requires_grad), units[head][0])
            first.gtp_state.is_head = True

    def observe_recompute(self, param: GTPShardedParam) -> None:
        """Record a recompute-forward consume of the first backward that has any (design §3.1
        "Recompute-forward prefetch chain": membership is observed, not configured)."""
        if id(param) not in self._recompute_seen:
            self._recompute_seen.add(id(param))
            self.recompute_order.append(param)

    def commit_recompute(self) -> None:
        """Link the observed recompute order (at the first drain after it was seen): each
        recompute consume then prefetches the next ``depth`` recompute weights' forward slots,
        across layers (the next layer recomputed runs after this layer's backward)."""
        order, n = self.recompute_order, len(self.recompute_order)
        if self.recompute_phase is not ChainPhase.OBSERVING or not n:
            return
        self.recompute_phase = ChainPhase.LINKED
        for i, param in enumerate(order):
            segment = param.gtp_state.segment
            param.gtp_state.fwd.recompute_ahead = tuple(
                order[j].gtp_state.fwd
                for j in range(i + 1, min(n, i + 1 + self.depth))
                if order[j].gtp_state.segment == segment
            )

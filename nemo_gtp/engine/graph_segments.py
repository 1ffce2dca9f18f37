"""CUDA-graph segments of a :class:`~nemo_gtp.engine.runtime.GTPRuntime` (design §3.5).

Mixed into ``GTPRuntime``: the part of the runtime that exists for CUDA graphs captured per
layer (megatron's per-layer graphs drive it through
:mod:`nemo_gtp.integrations.megatron.layer_graphs`). A *segment* is the set of weights one graph
captures; the runtime keeps every chain link, coalescing unit and deferred reduce-scatter inside
a segment (:class:`~nemo_gtp.engine.chain.Chain`), and this mixin adds what runs at a graph's
edges: the two-stage drain at the end of a captured forward and backward, the grad-ready hooks
a replay must fire by hand, the grad guard around the eager warmup iterations before a capture,
and the optional cross-graph wgrad ring (``GTPConfig.graph_wgrad_ring_size``), which carries a
segment's head-unit reduce-scatter into the next graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from nemo_gtp.engine.chain import Chain, ChainId, ChainPhase
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.slots import Direction, GTPStateError

_FWD, _BWD = Direction.FWD, Direction.BWD
_GradBackup = tuple[GTPShardedParam, torch.Tensor | None, bool]
"""A guarded weight's gradient as it was: the param, the copy, whether it is ``main_grad``."""


class GraphSegments:
    """CUDA-graph segments, the grad guard and the wgrad ring of a ``GTPRuntime`` (§3.5).

    Part of the runtime, split off by concern, not a class of its own: it owns the state
    :meth:`setup_graph_segments` sets up and works on the runtime's chains, params and
    pending reduce-scatters (:class:`~nemo_gtp.engine.reduce_scatter.ReduceScatterSide`).

    Offers the other parts: ``ring_carry``, ``carry_staged``, ``reduce_scatter_carry``,
    ``guarded_grads``, ``back_up_grad``, ``recorded_finalizes``, ``commit_graph_segments``,
    ``setup_graph_segments``. Uses from the other parts: ``release`` (gather side);
    ``finalize_reduce_scatters``, ``flush_staged``, ``reduce_scatter_staged``,
    ``fp32_accumulation``, ``drain_reduce_scatters`` (reduce-scatter side).

    Example::

        runtime.assign_graph_segments([layer0_weights, layer1_weights])   # before any forward
        with runtime.grad_guard():
            warmup_forward_and_backward()                                  # leaves no gradient
    """

    def setup_graph_segments(self) -> None:
        """The graph segments' state: the segments, the grad guard, the wgrad ring and its carry,
        the manual hook plans (called once, from ``GTPRuntime.__init__``, after the
        reduce-scatter side's: the ring excludes FP32 accumulation)."""
        self.segments: list[tuple[GTPShardedParam, ...]] = []
        """The weights of each captured CUDA graph (design §3.5); in forward order once the
        chain is committed."""
        self.guarded_grads: dict[int, _GradBackup] | None = None
        """Inside :meth:`grad_guard`, the gradient backed up at each guarded weight's first
        finalize, by the param's ``id``; None outside, when finalizes fire their grad-ready
        hooks."""
        # The cross-graph wgrad ring (design §3.5): staged wgrads of a segment's head unit, to
        # be reduce-scattered in the next segment's backward.
        self._ring_size = self.config.graph_wgrad_ring_size
        if self._ring_size and self.fp32_accumulation:
            raise ValueError(
                "GTPConfig.graph_wgrad_ring_size > 0 is not supported together with "
                "reduce_scatter_with_fp32_accumulation at GTP > 2: set one of them off"
            )
        self.ring_carry: list[GTPShardedParam] = []
        """The carried head unit: weights whose staged wgrads wait in their ring slots for the
        next graph's reduce-scatter (:meth:`reduce_scatter_carry`)."""
        self.graph_hook_plans: dict[int, tuple[GTPShardedParam, ...]] = {}
        """Per segment, the weights whose finalize a captured backward graph replays, in order
        (recorded by :meth:`recording_graph_hooks`; the manual hook plan of design §3.5)."""
        self.recorded_finalizes: list[GTPShardedParam] | None = None
        """Inside :meth:`recording_graph_hooks`, the weights finalized so far, in order; None
        outside."""

    def assign_graph_segments(self, segments: Sequence[Sequence[GTPShardedParam]]) -> None:
        """Put each group of weights of ``segments`` into the GRAPHED chain as one captured graph.

        ``segments[i]`` are the weights one CUDA graph captures (megatron's per-layer graphs:
        the GTP weights of the i-th captured layer; an empty group is allowed). Every other
        weight stays eager (``ChainId.UNGRAPHED``). Links, coalescing units and deferred
        reduce-scatters then stay inside each graph (design §3.5, the Note on :class:`Chain`).
        Must run before the first forward: a chain's membership is fixed once it is observed
        (design §3.4 hazard table). Calling it again before then replaces the assignment.

        Example::

            runtime.assign_graph_segments([[qkv0, proj0, fc1_0, fc2_0], [qkv1, proj1, ...]])
        """
        for chain in self.chains.values():
            if chain.order or chain.phase is not ChainPhase.OBSERVING:
                raise GTPStateError(
                    f"{self.name}: CUDA-graph segments must be assigned before the first forward "
                    "(the chains are already observed)"
                )
        seen: set[int] = set()
        for members in segments:
            for param in members:
                ref = param.gtp_state.runtime
                if ref is None or ref() is not self:
                    raise ValueError(f"{param!r} is not registered with runtime {self.name}")
                if id(param) in seen:
                    raise ValueError(f"{param.gtp_state.name} is in two CUDA-graph segments")
                seen.add(id(param))
        eager, graphed = self.chains[ChainId.UNGRAPHED], self.chains[ChainId.GRAPHED]
        for param in self.params:
            state = param.gtp_state
            state.chain_id, state.chain, state.segment = ChainId.UNGRAPHED, eager, -1
        for index, members in enumerate(segments):
            for param in members:
                state = param.gtp_state
                state.chain_id, state.chain, state.segment = ChainId.GRAPHED, graphed, index
        self.segments = [tuple(members) for members in segments]

    def commit_graph_segments(self, chain: Chain) -> None:
        """The GRAPHED chain's order was committed: the graph segments take its order too, and
        with the wgrad ring every segment's head unit but the backward's last gets its ring
        slot."""
        if chain.chain_id is not ChainId.GRAPHED or not self.segments:
            return
        rank = {id(p): i for i, p in enumerate(chain.order)}
        last = len(rank)
        self.segments = [
            tuple(sorted(members, key=lambda p: rank.get(id(p), last))) for members in self.segments
        ]
        if not self._ring_size or not chain.units:
            return
        final = chain.units[0][0].gtp_state.segment  # its backward is the last: nothing after
        for unit in chain.units:
            head = unit[0].gtp_state
            if head.is_head and head.segment != final:
                for param in unit:
                    param.gtp_state.ring = head.segment % self._ring_size
                    param.gtp_state.rs.scratch_pool = None  # rebound to its ring slot

    def end_graph_forward(self, segment: int) -> None:
        """End of a captured forward: no gather of ``segment`` outlives its graph.

        The last weight of a segment prefetches nothing; what can remain is a buffer TE's
        protocol still holds (released at the next protocol consume, design §3.1 "The bridge")
        or a mispredicted prefetch. Both are completed and released here, inside the graph.
        """
        chain = self.chains[ChainId.GRAPHED]
        last = chain.protocol_last[0]
        if last is not None and last.gtp_state.segment == segment:
            chain.protocol_last[0] = None
        for param in self.segments[segment]:
            self.release(param, _FWD)

    def end_graph_backward(self, segment: int) -> None:
        """End of a captured backward: the two-stage drain of ``segment`` (design §3.5).

        Stage 1, gathers: every gather of the segment is completed and released (the head's
        backward buffer TE's protocol holds, an unconsumed prefetch). Stage 2, reduce-scatters:
        the segment's staged wgrads are reduce-scattered and every pending reduce-scatter issued
        in this graph is finalized (wait, ``main_grad`` add, grad-ready hook), so no collective
        issued in this graph is waited in another one. With the wgrad ring the segment's head
        unit stays carried: its wgrads wait in their ring slots, not in a collective.
        """
        chain = self.chains[ChainId.GRAPHED]
        last = chain.protocol_last[1]
        if last is not None and last.gtp_state.segment == segment:
            chain.protocol_last[1] = None
        members = self.segments[segment]
        for param in members:
            self.release(param, _BWD)
            self.release(param, _FWD)
        if chain.staged and chain.staged[0].gtp_state.segment == segment:
            self.flush_staged(chain)
        if self.ring_carry and (
            self.ring_carry[0].gtp_state.segment != segment or self.guarded_grads is not None
        ):
            # a carry this graph did not consume must not pass on; under the grad guard (an
            # eager warmup iteration) nothing is carried out of the layer either
            self.reduce_scatter_carry()
        pending = chain.pending_rs
        if pending:  # every graphed one was issued in this graph (its own, or a carry into it)
            mine = [p for p in pending if p.gtp_state.segment >= 0]
            pending[:] = [p for p in pending if p.gtp_state.segment < 0]
            if mine:
                self.finalize_reduce_scatters(mine)

    def fire_graph_hooks(self, segment: int) -> None:
        """Fire the grad-ready hooks of ``segment``'s weights, in backward order (design §3.5).

        A replayed graph runs no Python: its reduce-scatters and ``main_grad`` adds are
        recorded stream work, but the hooks the finalizes called at capture are not. Call this
        after the replayed backward (the manual hook plan): DDP's bucket collectives are then
        ordered after the graph's ``main_grad`` adds on the stream, as in eager mode. The plan
        is the one recorded at capture (:meth:`recording_graph_hooks`), else the segment's
        weights in backward order.

        Example::

            out = replay(x)            # a captured layer
            out.grad_fn.register_hook(lambda *_: runtime.fire_graph_hooks(segment))
        """
        plan = self.graph_hook_plans.get(segment)
        for param in plan if plan is not None else reversed(self.segments[segment]):
            hook = param.gtp_state.grad_ready_hook
            if hook is not None:
                hook()

    @contextlib.contextmanager
    def recording_graph_hooks(self, segment: int) -> Iterator[None]:
        """Record the finalizes of a captured backward as ``segment``'s manual hook plan.

        With the wgrad ring a graph also finalizes the previous graph's head unit and not its
        own, so the plan is what the capture finalized, not the segment's weights.
        """
        self.recorded_finalizes = []
        try:
            yield
        finally:
            self.graph_hook_plans[segment] = tuple(self.recorded_finalizes)
            self.recorded_finalizes = None

    @property
    def carried(self) -> int:
        """Wgrads waiting in the wgrad ring for the next graph's reduce-scatter (design §3.5)."""
        return len(self.ring_carry)

    @contextlib.contextmanager
    def grad_guard(self) -> Iterator[None]:
        """Steps run inside leave every gradient as it was (design §3.5 "Grad guard").

        For the eager warmup iterations megatron runs before it captures a layer: reduce-scatters
        pending on entry are finalized first (they belong to training); inside, the first
        finalize of each weight backs up its ``main_grad`` (or ``.grad``) and grad-ready hooks
        stay silent; on exit everything issued inside is finalized and every touched gradient
        restored, also one written across a graph boundary by a deferred reduce-scatter.

        Example::

            with runtime.grad_guard():
                out = layer(x); torch.autograd.grad(out, params, torch.ones_like(out))
        """
        if self.guarded_grads is not None:
            raise GTPStateError(f"{self.name}: grad_guard is not reentrant")
        self.drain_reduce_scatters()
        self.guarded_grads = {}
        try:
            yield
            self.drain_reduce_scatters()
        finally:
            saved, self.guarded_grads = self.guarded_grads, None
            with torch.no_grad():
                for param, grad, has_main_grad in saved.values():
                    if has_main_grad:
                        param.main_grad.copy_(grad)
                    else:
                        param.grad = grad

    def back_up_grad(self, param: GTPShardedParam, main_grad: torch.Tensor | None) -> None:
        """Keep a copy of ``param``'s gradient (``main_grad``, else ``.grad``) in
        :attr:`guarded_grads`, for :meth:`grad_guard` to restore on exit."""
        if param.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise GTPStateError(
                f"{param.gtp_state.name}: a reduce-scatter was finalized inside a CUDA-graph "
                "capture under grad_guard (only the eager warmup may be guarded)"
            )
        if main_grad is not None:
            self.guarded_grads[id(param)] = (param, main_grad.detach().clone(), True)
        else:
            grad = param.grad
            self.guarded_grads[id(param)] = (param, None if grad is None else grad.clone(), False)

    def carry_staged(self, chain: Chain) -> None:
        """Keep ``chain``'s staged head unit's wgrads (in their ring slots) for the next graph."""
        self.ring_carry.extend(chain.staged)
        if self.trace is not None:
            for param in chain.staged:
                self.record("rs_carry", param, _BWD)
        chain.staged.clear()

    def reduce_scatter_carry(self) -> None:
        """Reduce-scatter the carried head unit now (design §3.5: in the next graph)."""
        params = tuple(self.ring_carry)
        self.ring_carry.clear()
        self.reduce_scatter_staged(params)

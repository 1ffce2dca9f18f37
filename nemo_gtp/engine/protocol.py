"""TransformerEngine's DistributedWeight protocol on a :class:`~nemo_gtp.engine.runtime.GTPRuntime`
(design §3.1 "The bridge", §1.3 "FP8 gather", "Consumer-quantized backward").

Mixed into ``GTPRuntime``: what a :class:`~nemo_gtp.engine.param.GTPShardedParam` answers when TE
calls ``materialize_group_for_forward`` / ``_backward`` and ``finalize_group_grads`` on it (the
param's Note on the protocol). TE never says when its GEMM is done, so a protocol consume
releases the buffers of the one before it on the same chain and direction; the weights of a
weight group consumed together (``GroupedLinear``) come and go through their leader. The
steady-state consume of a dense TE linear takes one short frame
(:meth:`ProtocolSide._dense_consume`, design §3.1 "Host cost per weight").
"""

from __future__ import annotations

import torch

from nemo_gtp.engine.chain import ChainPhase
from nemo_gtp.engine.consumer_quantize import ConsumerQuantize
from nemo_gtp.engine.gather import backward_task_id
from nemo_gtp.engine.param import GTPParamState, GTPShardedParam
from nemo_gtp.engine.slots import Direction, GatherState, GTPStateError

__all__ = ["ProtocolSide"]

_FWD, _BWD = Direction.FWD, Direction.BWD
_NONE, _ASYNC = GatherState.NONE, GatherState.ASYNC_WAIT
_LINKED = ChainPhase.LINKED


class ProtocolSide:
    """TE's DistributedWeight protocol on a ``GTPRuntime``: group consumes, their FP8 and
    consumer-quantized forms, and the wgrads TE hands back (design §3.1 "The bridge").

    Part of the runtime, split off by concern, not a class of its own: it owns
    ``consumer_quantize`` (:meth:`setup_protocol_side`) and drives the gather side
    (:class:`~nemo_gtp.engine.gather.GatherSide`), the FP8 formats
    (:class:`~nemo_gtp.engine.fp8_gather.FP8GatherSide`) and the reduce-scatter side
    (:class:`~nemo_gtp.engine.reduce_scatter.ReduceScatterSide`) for it.

    Offers the other parts: ``setup_protocol_side``. Uses from the other parts: ``materialize``,
    ``release``, and for the dense consume ``issue_gather``, ``issue_unit_gather``,
    ``prefetch_units``, ``prefetch_enabled``, ``gather_fmt`` (gather side); ``canonical_fp8``,
    ``known_fp8``, ``fp8_primary``, ``fp8_gathered``, ``gemm_weight``, ``quantized_gather``
    (FP8 gathers); ``reduce_scatter_foreign_wgrad`` (reduce-scatter side); ``ring_carry``
    (graph segments).

    Example::

        # TE's calls on a GTP weight land here:
        weights = runtime.materialize_group_for_protocol(param, Direction.FWD)
        runtime.finalize_group_for_protocol(param, [wgrad])
    """

    def setup_protocol_side(self) -> None:
        """The consumer that quantizes the training-dtype gathers it is handed and needs that
        quantization redone for its backward (design §1.3 "Consumer-quantized backward");
        called once, from ``GTPRuntime.__init__``."""
        self.consumer_quantize: ConsumerQuantize | None = None

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
                    if fp8 is not None and fp8 is not self.known_fp8:
                        fp8 = self.canonical_fp8(fp8)
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
            if backward_task_id() != -1:  # an activation-recompute forward: its own chain
                return None
            if policy is not None and policy.forward_scaling(param) is not None:
                return None  # an FP8 gather (the general path asks again: same answer)
            slot, which = state.fwd, 0
        else:
            first = last[0]
            if (
                self.ring_carry
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
        self.gather_fmt = None
        if slot.state is _NONE:
            if len(slot.unit) == 1:
                self.issue_gather(param, slot, async_op=False)
            else:  # e.g. the chain head: the rest of its unit, at once
                self.issue_unit_gather(slot.unit[slot.unit_pos :], sync_slot=slot)
        if slot.state is _ASYNC:
            slot.complete()
        if self.prefetch_enabled:
            targets = slot.ahead
            if not targets and not which:  # the forward tail hands over to the backward
                if torch.is_grad_enabled() or state.forward_grad_enabled:
                    targets = slot.handover
            if targets:
                self.prefetch_units(targets)
        if not which and self.consumer_quantize is not None:
            self._note_forward(self.consumer_quantize, (param,))
        full, cached = slot.full, slot.alias
        if (  # the steady state: this cache buffer's alias, made once (_protocol_alias)
            cached is not None
            and cached[0] is full
            and full is slot.cache_full
            and cached[1].requires_grad == param.requires_grad
        ):
            return [cached[1]]
        return [self._protocol_alias(param, direction, full)]

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

"""The state machines of one GTP weight: its gather slots and reduce-scatter slot (design §1.1).

Each direction of a weight (:class:`Direction`) has a :class:`GatherSlot`, walking
``NONE → ASYNC_WAIT → DATA_READY → NONE`` (:class:`GatherState`), and the weight has one
:class:`ReduceScatterSlot` for its wgrad (:class:`ReduceScatterState`). Every transition is a
method that checks the state it leaves and raises :class:`GTPStateError` otherwise, so a broken
protocol fails at the faulty call instead of corrupting a buffer. The runtime drives them
(:mod:`nemo_gtp.engine.runtime`); the param carries them
(:class:`~nemo_gtp.engine.param.GTPParamState`).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = [
    "Direction",
    "GatherSlot",
    "GatherState",
    "GTPStateError",
    "ReduceScatterSlot",
    "ReduceScatterState",
    "SharedWork",
]


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
    """Weight-gradient reduce-scatter state of one weight (design §1.1 ``rs_state``)."""

    NONE = "none"
    """Nothing in flight; main_grad holds every finalized contribution."""
    STAGED = "staged"
    """The wgrad is in scratch, waiting for the rest of its coalescing unit (design §3.1
    "Coalescing units") to reduce-scatter with it in one collective."""
    ASYNC_WAIT = "async_wait"
    """A reduce-scatter was issued; scratch and output stay held until the deferred finalize."""
    DATA_READY = "data_ready"
    """Waited: the reduced shard is in the output buffer, about to be added into main_grad."""


_RS_STAGED = ReduceScatterState.STAGED


class GTPStateError(RuntimeError):
    """A GTP state machine was asked for a transition its current state does not allow."""


class SharedWork:
    """One collective's handle shared by the weights of a coalescing unit: waited once.

    Every member's :meth:`GatherSlot.complete` calls :meth:`wait`; only the first waits on the
    collective (on CUDA that orders the current stream after it, which orders every later
    consume on that stream too). Reused across steps, one per unit and direction.

    Example::

        shared = SharedWork()
        shared.work = ops.all_gather_coalesced(buffers, shards)
        shared.wait(); shared.wait()     # the second call is free
    """

    __slots__ = ("work",)

    def __init__(self) -> None:
        self.work: Any = None

    def wait(self) -> None:
        """Wait for the collective, the first time only."""
        work = self.work
        if work is not None:
            self.work = None
            work.wait()


class GatherSlot:
    """One direction's all-gather state machine of one weight (design §1.1).

    ``NONE → ASYNC_WAIT → DATA_READY → NONE``; each transition is a method that checks the
    state it leaves (the way FSDP2 asserts its training states), so a broken protocol fails at
    the faulty call instead of corrupting a buffer. The runtime fills the links once, when the
    chain order is committed, so the steady-state step only follows attributes:

    - ``ahead``: the slots whose gathers this consume prefetches, nearest first (the next
      ``GTPConfig.prefetch_depth`` weights of the chain in this direction, design §3.1 chains
      table); ``handover``: at the forward chain tail, the first backward slots;
      ``recompute_ahead``: for a forward slot, the next weights in the recompute chain's order
      (the forward re-run inside the backward by activation recompute, design §3.1);
    - ``cache`` / ``cache_full``: the cache slot whose stable buffer this direction gathers
      into, and that buffer's unpadded view; ``rebind``: the ticket changed (the chain order
      was committed, or the gather backend resolved) and is looked up again at the next
      gather — never earlier, so a buffer held across the change is released to the slot
      that holds it (a TE-protocol weight holds its buffer until the next consume);
    - ``unit``: the slots of this direction gathered together with this one in one collective
      (its coalescing unit, design §3.1; ``(self,)`` when weights gather one by one), in
      consume order, with ``unit_pos`` this slot's position in it, and ``unit_work`` the
      :class:`SharedWork` their coalesced gather completes through;
    - ``alias``: ``(full, alias)``, the requires-grad alias of the gathered view handed to TE
      (made once per buffer, not per consume). Links
      (``ahead``, ``handover``) sit on the first slot of each unit in its direction.
    """

    __slots__ = (
        "direction",
        "index",
        "state",
        "work",
        "buffer",
        "full",
        "cache",
        "cache_full",
        "rebind",
        "ahead",
        "handover",
        "recompute_ahead",
        "nbytes",
        "pull_plan",
        "pull_work",
        "unit",
        "unit_pos",
        "unit_work",
        "alias",
        "fmt",
        "bound_fmt",
        "wire",
        "fp8_view",
        "scale_wire",
        "scales",
    )

    def __init__(self, direction: Direction, index: int = -1) -> None:
        self.direction = direction
        self.index = index  # position of the owning param in its runtime's ``params``
        self.state = GatherState.NONE
        self.work: Any = None  # anything with ``wait()``: a c10d Work or a copy-engine event
        self.buffer: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self.cache: Any = None
        self.cache_full: torch.Tensor | None = None
        self.rebind = False
        self.ahead: tuple[GatherSlot, ...] = ()
        self.handover: tuple[GatherSlot, ...] = ()
        self.recompute_ahead: tuple[GatherSlot, ...] = ()  # forward slots, recompute order
        self.nbytes = 0  # bytes this rank receives per gather
        self.pull_plan: Any = None  # copy-engine backend: (rows of cache buffer, peer mirror)
        self.pull_work: Any = None  # copy-engine backend: the slot's reusable event
        self.unit: tuple[GatherSlot, ...] = (self,)
        self.unit_pos = 0
        self.alias: tuple[torch.Tensor, torch.Tensor] | None = None  # (full, TE's alias of it)
        self.unit_work: SharedWork | None = None
        # FP8 gathers (design §1.3 "FP8 gather"): the format of the gather in flight or held
        # (None: the training dtype), the format ``cache`` is bound for, the byte view of the
        # cache buffer a gather writes, and the consumer's view of that buffer.
        self.fmt: Any = None
        self.bound_fmt: Any = None
        self.wire: torch.Tensor | None = None
        self.fp8_view: Any = None
        # blockwise FP8 gathers: the cache slot's gathered scale buffer, and the one the gather
        # in flight or held writes (that buffer, or a fallback's)
        self.scale_wire: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    def issued(self, work: Any, buffer: torch.Tensor, full: torch.Tensor) -> None:
        """NONE → ASYNC_WAIT: a gather into ``buffer`` was issued; ``work.wait()`` completes it."""
        if self.state is not GatherState.NONE:
            raise GTPStateError(f"gather {self.direction.value} issued in state {self.state}")
        self.state, self.work, self.buffer, self.full = GatherState.ASYNC_WAIT, work, buffer, full

    def complete(self) -> None:
        """ASYNC_WAIT → DATA_READY: wait for the gather (on CUDA: order the current stream)."""
        if self.state is not GatherState.ASYNC_WAIT:
            raise GTPStateError(f"gather {self.direction.value} waited in state {self.state}")
        self.work.wait()
        self.state, self.work = GatherState.DATA_READY, None

    def released(self) -> None:
        """DATA_READY → NONE: the GEMM consumed the weight; the buffer goes back."""
        if self.state is not GatherState.DATA_READY:
            raise GTPStateError(f"gather {self.direction.value} released in state {self.state}")
        self.state, self.buffer, self.full = GatherState.NONE, None, None


class ReduceScatterSlot:
    """One weight's wgrad reduce-scatter state machine (design §1.1 ``rs_state``).

    ``NONE → ASYNC_WAIT → DATA_READY → NONE``, transitions checked like :class:`GatherSlot`.
    ``scratch_pool`` / ``output_pool`` are the weight's free lists in the runtime's wgrad pool,
    found once (no per-step key lookups).
    """

    __slots__ = (
        "state",
        "work",
        "scratch",
        "output",
        "recv",
        "scratch_pool",
        "output_pool",
        "recv_pool",
        "nbytes",
    )

    def __init__(self) -> None:
        self.nbytes = 0  # bytes this rank sends per reduce-scatter (set with the pools)
        self.state = ReduceScatterState.NONE
        self.work: Any = None
        self.scratch: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self.scratch_pool: Any = None
        self.output_pool: Any = None
        self.recv_pool: Any = None

    def staged(self, scratch: torch.Tensor) -> None:
        """NONE → STAGED: ``scratch`` holds the wgrad, to be reduced with its unit's others."""
        if self.state is not ReduceScatterState.NONE:
            raise GTPStateError(f"reduce-scatter staged in state {self.state}")
        self.state, self.scratch = ReduceScatterState.STAGED, scratch

    def issued(
        self, work: Any, scratch: torch.Tensor, output: torch.Tensor, recv: torch.Tensor | None
    ) -> None:
        """NONE or STAGED → ASYNC_WAIT: the reduce-scatter of ``scratch`` into ``output`` is in
        flight."""
        if self.state is not ReduceScatterState.NONE and self.state is not _RS_STAGED:
            raise GTPStateError(f"reduce-scatter issued in state {self.state}")
        self.state, self.work = ReduceScatterState.ASYNC_WAIT, work
        self.scratch, self.output, self.recv = scratch, output, recv

    def complete(self) -> None:
        """ASYNC_WAIT → DATA_READY: wait; the reduced shard is in ``output``."""
        if self.state is not ReduceScatterState.ASYNC_WAIT:
            raise GTPStateError(f"reduce-scatter waited in state {self.state}")
        self.work.wait()
        self.state, self.work = ReduceScatterState.DATA_READY, None

    def finished(self) -> None:
        """DATA_READY → NONE: ``output`` was added into main_grad; buffers go back to the pool."""
        if self.state is not ReduceScatterState.DATA_READY:
            raise GTPStateError(f"reduce-scatter finalized in state {self.state}")
        self.scratch_pool.put(self.scratch)
        self.output_pool.put(self.output)
        if self.recv is not None:
            self.recv_pool.put(self.recv)
        self.state, self.scratch, self.output, self.recv = (
            ReduceScatterState.NONE,
            None,
            None,
            None,
        )

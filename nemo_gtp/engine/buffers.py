"""Buffers with stable addresses: the gathered-weight cache and the wgrad pool (design §3.1).

Both allocate on first use and then hand out the same storage every iteration, so the steady
state allocates nothing and a captured CUDA graph replays against the addresses it recorded
(design §1.2 "Idempotent ticket cache"). A weight finds its cache slot and its pool free lists
once; the steady-state step only touches attributes and list ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def refuse_allocation_in_capture(device: torch.device, what: str) -> None:
    """``RuntimeError`` when a pooled buffer would be allocated inside a CUDA-graph capture.

    A buffer born in a capture lives in the graph's private memory pool; the pools must reach
    their steady state in the eager warmup before capture (design §3.5 "Stable addresses"), so
    an allocation here means the warmup did not run the step the graph captures.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"GTP allocated a {what} inside a CUDA-graph capture: the warmup before capture "
            "did not run this step (raise cuda_graph_warmup_steps to >= 2; design §3.5)"
        )


@dataclass(frozen=True)
class BufferKey:
    """Identity (ticket) of one gathered-weight buffer (design §3.1: shape, dtype, direction,
    parity; per chain)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    chain: str
    direction: str
    parity: int


class CacheSlot:
    """One gathered-weight buffer and the gather slot currently holding it (None: free).

    ``companion``: an optional second flat buffer of the same size and dtype, held with the
    buffer (an FP8 gathered weight's column-wise copy, design §1.3 "FP8 gather"); ``scales``:
    fp32 buffers by shape held with it too (a blockwise FP8 weight's gathered and column-wise
    ``scale_inv``).
    """

    __slots__ = ("key", "buffer", "owner", "companion", "scales")

    def __init__(self, key: BufferKey) -> None:
        self.key = key
        self.buffer: torch.Tensor | None = None
        self.owner: object | None = None
        self.companion: torch.Tensor | None = None
        self.scales: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def try_acquire(self, owner: object) -> bool:
        """Hold the buffer for ``owner``; False if another owner holds it (never overwritten)."""
        if self.owner is not None and self.owner is not owner:
            return False
        self.owner = owner
        return True

    def release(self, owner: object) -> None:
        """Give the buffer back; a no-op unless ``owner`` holds it."""
        if self.owner is owner:
            self.owner = None


class GTPWeightCache:
    """Gathered-weight buffers shared by every weight with the same :class:`BufferKey`.

    A weight holds its key's buffer for the span gather → GEMM and releases it after; weights of
    one key therefore share one buffer. Chain neighbours that would share a key get different
    parities (see ``GTPRuntime``), so a prefetch never lands in a buffer whose GEMM is still
    pending; :meth:`CacheSlot.try_acquire` refuses a buffer another owner holds instead of
    overwriting it. :meth:`clear` drops storage but keeps tickets valid (lazy re-allocation).

    Example::

        cache = GTPWeightCache()
        slot = cache.slot(key)                 # same storage every iteration
        if slot.try_acquire(owner): ...        # gather into slot.buffer, GEMM
        slot.release(owner)
    """

    def __init__(self) -> None:
        self._slots: dict[BufferKey, CacheSlot] = {}
        self.allocations = 0

    def slot(self, key: BufferKey) -> CacheSlot:
        """The slot of ``key``, its buffer allocated on first use."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = CacheSlot(key)
        if slot.buffer is None:
            refuse_allocation_in_capture(key.device, "gathered-weight buffer")
            # Never an inference tensor, even when the first gather runs under
            # torch.inference_mode (trainer.validate / test on NCCL): training writes into it next.
            with torch.inference_mode(False):
                slot.buffer = torch.empty(key.shape, dtype=key.dtype, device=key.device)
            self.allocations += 1
        return slot

    def companion(self, slot: CacheSlot) -> torch.Tensor:
        """``slot``'s flat companion buffer (buffer's numel and dtype), allocated on first use."""
        if slot.companion is None:
            key = slot.key
            numel = 1
            for size in key.shape:
                numel *= size
            with torch.inference_mode(False):
                slot.companion = torch.empty(numel, dtype=key.dtype, device=key.device)
            self.allocations += 1
        return slot.companion

    def scales(self, slot: CacheSlot, role: str, shape: tuple[int, ...]) -> torch.Tensor:
        """``slot``'s fp32 scale buffer for ``role`` and ``shape`` (zeros), allocated on first
        use: a blockwise FP8 weight's gathered (``"rowwise"``) or column-wise scales."""
        key = (role, tuple(shape))
        found = slot.scales.get(key)
        if found is None:
            refuse_allocation_in_capture(slot.key.device, "FP8 scale buffer")
            with torch.inference_mode(False):
                found = slot.scales[key] = torch.zeros(
                    shape, dtype=torch.float32, device=slot.key.device
                )
            self.allocations += 1
        return found

    def held(self) -> int:
        """Number of buffers currently held."""
        return sum(slot.owner is not None for slot in self._slots.values())

    def nbytes(self) -> int:
        """Bytes of allocated gathered-weight storage."""
        return sum(
            t.numel() * t.element_size()
            for s in self._slots.values()
            for t in (s.buffer, s.companion, *s.scales.values())
            if t is not None
        )

    def clear(self) -> None:
        """Drop every buffer (tickets stay valid; the next :meth:`slot` re-allocates)."""
        for slot in self._slots.values():
            if slot.owner is not None:
                raise RuntimeError("GTPWeightCache.clear() while a buffer is held; drain first")
            slot.buffer = slot.companion = None
            slot.scales = {}


class FreeList:
    """Recycled buffers of one shape / dtype / device, pad rows zeroed once at allocation.

    ``zero_from`` (rows) marks the alignment tail that no wgrad GEMM writes: it is zeroed when
    the buffer is created and stays zero, so the reduce-scatter never reads stale pad rows.
    """

    __slots__ = ("shape", "dtype", "device", "zero_from", "free", "pool")

    def __init__(
        self,
        pool: WgradPool,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        zero_from: int | None,
    ) -> None:
        self.shape, self.dtype, self.device, self.zero_from = shape, dtype, device, zero_from
        self.free: list[torch.Tensor] = []
        self.pool = pool

    def get(self) -> torch.Tensor:
        """A buffer of this list's shape; contents undefined except the zero tail."""
        if self.free:
            return self.free.pop()
        refuse_allocation_in_capture(self.device, "wgrad / reduce-scatter buffer")
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.zero_from is not None and self.zero_from < self.shape[0]:
            buffer[self.zero_from :].zero_()
        self.pool.allocations += 1
        return buffer

    def put(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`get`."""
        self.free.append(buffer)


class WgradPool:
    """Full-size wgrad scratch and reduce-scatter outputs, recycled (design §3.1).

    Example::

        scratch = pool.free_list((96, 64), torch.float32, torch.device("cpu"), zero_from=72)
        buffer = scratch.get()
        ...
        scratch.put(buffer)
    """

    def __init__(self) -> None:
        self._lists: dict[tuple, FreeList] = {}
        self.allocations = 0

    def free_list(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        zero_from: int | None = None,
        ring: int = -1,
    ) -> FreeList:
        """The free list of ``(shape, dtype, device, zero_from)`` (created on first use).

        ``ring`` >= 0 names a slot of the cross-graph wgrad ring (design §3.5): its buffers are
        never shared with the ordinary list of the same shape, whose buffers the next graph
        reuses while the ring slot still waits for its reduce-scatter.
        """
        key = (tuple(shape), dtype, device, zero_from, ring)
        found = self._lists.get(key)
        if found is None:
            found = self._lists[key] = FreeList(self, tuple(shape), dtype, device, zero_from)
        return found

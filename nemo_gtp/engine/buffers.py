"""Buffers with stable addresses: the gathered-weight cache and the wgrad pool (seed §3.1).

Both allocate on first use and then hand out the same storage every iteration, so the steady
state allocates nothing and a captured CUDA graph replays against the addresses it recorded
(seed §1.2 "Idempotent ticket cache").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferKey:
    """Identity of one gathered-weight buffer (seed §3.1: shape, dtype, fwd, parity; per chain)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    chain: str
    direction: str
    parity: int


class _CacheSlot:
    __slots__ = ("buffer", "owner")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.owner: object | None = None


class GTPWeightCache:
    """Gathered-weight buffers shared by every weight with the same :class:`BufferKey`.

    A weight *acquires* its key's buffer for the span gather → GEMM and *releases* it after;
    weights of one key therefore share one buffer. Chain neighbours that would share a key get
    different parities (see ``GTPRuntime``), so a prefetch never lands in a buffer whose GEMM
    is still pending. :meth:`acquire` refuses a buffer held by another owner instead of
    overwriting it. :meth:`clear` drops storage but keeps keys valid (lazy re-allocation).

    Example::

        cache = GTPWeightCache()
        buf = cache.acquire(key, owner=param)    # same storage every iteration
        cache.release(key, owner=param)
    """

    def __init__(self) -> None:
        self._slots: dict[BufferKey, _CacheSlot] = defaultdict(_CacheSlot)
        self.allocations = 0

    def acquire(self, key: BufferKey, owner: object) -> torch.Tensor | None:
        """The buffer for ``key`` held by ``owner``; None if another owner holds it."""
        slot = self._slots[key]
        if slot.owner is not None and slot.owner is not owner:
            return None
        if slot.buffer is None:
            slot.buffer = torch.empty(key.shape, dtype=key.dtype, device=key.device)
            self.allocations += 1
        slot.owner = owner
        return slot.buffer

    def release(self, key: BufferKey, owner: object) -> None:
        """Give ``key``'s buffer back; a no-op if ``owner`` does not hold it."""
        slot = self._slots.get(key)
        if slot is not None and slot.owner is owner:
            slot.owner = None

    def held(self) -> int:
        """Number of buffers currently held."""
        return sum(slot.owner is not None for slot in self._slots.values())

    def nbytes(self) -> int:
        """Bytes of allocated gathered-weight storage."""
        return sum(
            s.buffer.numel() * s.buffer.element_size()
            for s in self._slots.values() if s.buffer is not None
        )

    def clear(self) -> None:
        """Drop every buffer (keys stay valid; the next acquire re-allocates)."""
        for slot in self._slots.values():
            if slot.owner is not None:
                raise RuntimeError("GTPWeightCache.clear() while a buffer is held; drain first")
            slot.buffer = None


class WgradPool:
    """Recycled full-size wgrad scratch (and reduce-scatter output) buffers (seed §3.1).

    :meth:`get` returns a pooled buffer of the exact shape/dtype/device or allocates one;
    :meth:`put` returns it. Foreign tensors handed to :meth:`put` are ignored, so the pool never
    accumulates buffers it did not create.

    Example::

        scratch = pool.get((96, 64), torch.float32, torch.device("cpu"))
        ...
        pool.put(scratch)
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._owned: dict[int, torch.Tensor] = {}
        self.allocations = 0

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch buffer of ``shape``; contents are undefined."""
        free = self._free[(tuple(shape), dtype, device)]
        if free:
            return free.pop()
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self._owned[id(buffer)] = buffer
        self.allocations += 1
        return buffer

    def put(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`get`."""
        if self._owned.get(id(buffer)) is buffer:
            self._free[(tuple(buffer.shape), buffer.dtype, buffer.device)].append(buffer)

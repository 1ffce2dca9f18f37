"""How long compute waits on GTP communication: the *exposed* part of each collective.

On CUDA a pair of timing events brackets the wait on the compute stream: the elapsed time between
them is exactly the time that stream stalled on the collective (zero when the prefetch finished
in time). Events come from a reusable pool and are read only in :meth:`collect` (one host sync per
step, outside the hot path). On CPU the wait blocks the host, so host time is the same quantity.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class ExposedWaitTimer:
    """Accumulates stall time of the current stream around ``wait`` calls.

    Example::

        timer = ExposedWaitTimer()
        timer.enable()
        timer.timed_wait(handle.wait, "gather", device)
        seconds = timer.collect()        # {"gather": 0.0012}
        timer.enable(per_weight=True)    # also charge each wait to the weight it waited for
        timer.timed_wait(handle.wait, "gather", device, weight="decoder.layers.0.mlp.fc1.weight")
        timer.collect(); timer.take_per_weight()   # {("gather", "decoder...fc1.weight"): 0.0004}
    """

    def __init__(self) -> None:
        self.enabled = False
        self.per_weight = False
        self.timed = 0
        """Waits timed since construction (each costs two CUDA events on GPU)."""
        self._host: dict[str, float] = {}
        self._pending: list[tuple[str, str | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._per_weight: dict[tuple[str, str], float] = {}
        self._free: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def enable(self, on: bool = True, *, per_weight: bool = False) -> None:
        """Start (or stop) timing waits; whoever enables it calls :meth:`collect` every step.

        ``per_weight`` also keeps each weight's share (:meth:`take_per_weight`): the per-layer
        exposed gather / reduce-scatter profile.
        """
        self.enabled, self.per_weight = on, on and per_weight

    def timed_wait(
        self, wait: Callable[[], None], kind: str, device: torch.device, weight: str | None = None
    ) -> None:
        """Run ``wait``; when enabled, charge the stall it causes to ``kind`` (and ``weight``)."""
        if not self.enabled:
            wait()
            return
        weight = weight if self.per_weight else None
        self.timed += 1
        if device.type == "cuda":
            start, end = self._event(), self._event()
            start.record()
            wait()
            end.record()
            self._pending.append((kind, weight, start, end))
            return
        begin = time.perf_counter()
        wait()
        self._charge(kind, weight, time.perf_counter() - begin, self._host)

    def _charge(
        self, kind: str, weight: str | None, seconds: float, totals: dict[str, float]
    ) -> None:
        totals[kind] = totals.get(kind, 0.0) + seconds
        if weight is not None:
            key = (kind, weight)
            self._per_weight[key] = self._per_weight.get(key, 0.0) + seconds

    def collect(self) -> dict[str, float]:
        """Seconds of exposed wait per kind since the last collect (synchronizes CUDA events)."""
        totals = dict(self._host)
        self._host.clear()
        for kind, weight, start, end in self._pending:
            end.synchronize()
            self._charge(kind, weight, start.elapsed_time(end) / 1000.0, totals)
            self._free += (start, end)
        self._pending.clear()
        return totals

    def take_per_weight(self) -> dict[tuple[str, str], float]:
        """Seconds of exposed wait per ``(kind, weight name)`` collected so far; resets them."""
        out, self._per_weight = self._per_weight, {}
        return out

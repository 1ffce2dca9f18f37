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
    """

    def __init__(self) -> None:
        self.enabled = False
        self._host: dict[str, float] = {}
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._free: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def enable(self, on: bool = True) -> None:
        """Start (or stop) timing waits; whoever enables it calls :meth:`collect` every step."""
        self.enabled = on

    def timed_wait(self, wait: Callable[[], None], kind: str, device: torch.device) -> None:
        """Run ``wait`` and, when enabled, charge the stall it causes to ``kind``."""
        if not self.enabled:
            wait()
            return
        if device.type == "cuda":
            start, end = self._event(), self._event()
            start.record()
            wait()
            end.record()
            self._pending.append((kind, start, end))
            return
        begin = time.perf_counter()
        wait()
        self._host[kind] = self._host.get(kind, 0.0) + time.perf_counter() - begin

    def collect(self) -> dict[str, float]:
        """Seconds of exposed wait per kind since the last collect (synchronizes CUDA events)."""
        totals = dict(self._host)
        self._host.clear()
        for kind, start, end in self._pending:
            end.synchronize()
            totals[kind] = totals.get(kind, 0.0) + start.elapsed_time(end) / 1000.0
            self._free += (start, end)
        self._pending.clear()
        return totals

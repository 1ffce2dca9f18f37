"""Where a training step makes the host wait for the GPU: each synchronizing CUDA call, by site.

A graphed step is fast only while the host queues work ahead of the device; every call that
blocks the host until the device catches up (``.item()``, a blocking host-to-device copy,
``torch.cuda.synchronize``) drains that queue, and the device then idles while the host does its
Python work up to the next kernel. torch's sync debug mode warns on each such call;
:class:`SyncSites` turns it on for a window of steps, keeps each warning's Python stack and
counts the calls by site (``bench.host_fake`` records them per step of its free-running window).

Example::

    sites = SyncSites()
    sites.start()
    loss.item()                      # one synchronizing call
    sites.stop()
    sites.per_step(1)                # [[1.0, "train.py:12 step < ..."]]
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from typing import Any

SYNC_MESSAGE = "synchronizing CUDA operation"
"""What torch's sync debug mode says on each call that waits for the device."""

_SKIP = ("/warnings.py", "/bench/sync_sites.py")


def _short(filename: str) -> str:
    """A frame's file as ``package/module.py``: the part after site-packages or the repo."""
    for marker in ("site-packages/", "/src/", "/main/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


class SyncSites:
    """Counts synchronizing CUDA calls by their Python stack (innermost ``depth`` frames) while
    started; :meth:`per_step` lists them, most frequent first. On a machine without CUDA only
    warnings raised with torch's text are counted (what the CPU test feeds it)."""

    def __init__(self, depth: int = 6) -> None:
        self.depth = depth
        self.counts: Counter[str] = Counter()
        self._catch: Any = None

    def start(self) -> None:
        """Count from now: sync debug mode on (CUDA), torch's warnings routed to :meth:`_record`."""
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()  # restores the filters and showwarning at stop()
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if SYNC_MESSAGE in str(message):
                self._record()
            else:
                shown(message, category, filename, lineno, *rest)

        warnings.showwarning = show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def _record(self) -> None:
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith(_SKIP)]
        site = " < ".join(
            f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-self.depth :])
        )
        self.counts[site] += 1

    def stop(self) -> None:
        """Stop counting: sync debug mode off, the warning machinery as it was."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None

    def per_step(self, steps: int) -> list[list[Any]]:
        """``[[calls per step, site], ...]``, most frequent first."""
        return [[round(n / steps, 2), site] for site, n in self.counts.most_common()]

"""Where a training step makes the host wait for the GPU: each synchronizing CUDA call, by site.

A graphed step is fast only while the host queues work ahead of the device; every call that
blocks the host until the device catches up (``.item()``, a blocking host-to-device copy,
``torch.cuda.synchronize``) drains that queue, and the device then idles while the host does its
Python work up to the next kernel. torch's sync debug mode warns on each such call;
:class:`SyncSites` turns it on for a window of steps, keeps each warning's Python stack and
counts the calls by site (``bench.host_fake`` records them per step of its free-running window).
:class:`HostReads` counts, on any device, the calls of that kind a CPU run can see too: the ops
that read a tensor's values on the host (``.item()``, ``float()``, ``bool()``, data-dependent
shapes), so a CPU test can pin which of a GPU step's syncs are whose.

Example::

    sites = SyncSites()
    sites.start()
    loss.item()                      # one synchronizing call
    sites.stop()
    sites.per_step(1)                # [[1.0, "train.py:12 step < ..."]]
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_MESSAGE = "synchronizing CUDA operation"
"""What torch's sync debug mode says on each call that waits for the device."""

_SKIP = ("/warnings.py", "/bench/sync_sites.py")

HOST_READ_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), float(), int(), bool() of a tensor
        "aten::nonzero",
        "aten::masked_select",
        "aten::equal",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
    }
)
"""Ops whose result depends on the values of their input on the host: on a GPU each waits for
the device (boolean-mask indexing is caught as ``aten::index`` with a bool index)."""


def _site(depth: int, skip: tuple[str, ...] = _SKIP) -> str:
    """The calling Python stack's innermost ``depth`` frames whose file names contain none of
    ``skip``, innermost first."""
    frames = [f for f in traceback.extract_stack() if not any(m in f.filename for m in skip)]
    return " < ".join(
        f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-depth:])
    )


def per_step(counts: Counter[str], steps: int) -> list[list[Any]]:
    """``[[count per step, site], ...]`` of ``counts`` over ``steps``, most frequent first."""
    return [[round(n / steps, 2), site] for site, n in counts.most_common()]


def _short(filename: str) -> str:
    """A frame's file as ``package/module.py``: relative to the longest ``sys.path`` entry
    that holds it (site-packages, an install ``--target``, the repository)."""
    roots = sorted((p for p in sys.path if p and filename.startswith(p + "/")), key=len)
    return filename[len(roots[-1]) + 1 :] if roots else filename


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
        self.counts[_site(self.depth)] += 1

    def stop(self) -> None:
        """Stop counting: sync debug mode off, the warning machinery as it was."""
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None

    def per_step(self, steps: int) -> list[list[Any]]:
        """``[[calls per step, site], ...]``, most frequent first."""
        return per_step(self.counts, steps)


class HostReads(TorchDispatchMode):
    """While entered, counts the ops of :data:`HOST_READ_OPS` (and boolean-mask indexing) by
    their Python site, torch's own frames left out: each is a host sync on a GPU, and on CPU
    the same call at the same site (``Tensor.tolist`` of a CPU tensor dispatches no op: not
    seen here; of a GPU tensor it is a copy to the host). Example::

        with HostReads() as reads:
            loss.item()
        reads.per_step(1)            # [[1.0, "train.py:12 step < ..."]]
    """

    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.depth = depth
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in HOST_READ_OPS or (
            name == "aten::index" and any(getattr(i, "dtype", None) is torch.bool for i in args[1])
        ):
            self.counts[_site(self.depth, (*_SKIP, *_TORCH_FRAMES))] += 1
        return func(*args, **(kwargs or {}))

    def start(self) -> None:
        """Count from now (``SyncSites``'s interface: ``host_fake --sync-sites`` on CPU)."""
        self.__enter__()

    def stop(self) -> None:
        """Stop counting."""
        self.__exit__(None, None, None)

    def per_step(self, steps: int) -> list[list[Any]]:
        """``[[reads per step, site], ...]``, most frequent first."""
        return per_step(self.counts, steps)


_TORCH_FRAMES = ("/torch/",)
"""torch's own frames (the dispatch machinery, torch.compile's wrappers): a read inside torch is
named by its caller."""

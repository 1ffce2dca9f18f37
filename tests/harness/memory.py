"""Peak bytes allocated while a function runs, by the allocator's own accounting (tests, benches).

:func:`allocation_peak` answers "how many bytes were live at most while ``fn`` ran, above what
was live before", which is what a build that should never hold a full weight is judged by
(design §3.1 "Exact init"): on CUDA from the caching allocator's counters
(``torch.cuda.max_memory_allocated``), on CPU from the profiler's memory events (every CPU
allocation and free with its size, replayed in order). Sizes, never timings.

Example::

    build = lambda: TEGroupedMLP(4, config, submodules, pg_collection=pgs)
    experts, peak, kept = allocation_peak(build)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def allocation_peak(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, int, int]:
    """``(fn(), peak bytes live above the start, bytes still live at the end)`` on ``device``."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return (
            result,
            torch.cuda.max_memory_allocated() - start,
            torch.cuda.memory_allocated() - start,
        )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # Allocations are charged to the op that made them (its own share, children excluded),
    # frees outside any op appear as "[memory]" events: replay both in start order.
    events = [e for e in prof.events() if e.self_cpu_memory_usage]
    events.sort(key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak, live

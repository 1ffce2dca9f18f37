"""What is live at the peak of a CUDA memory history (explains a peak-memory difference).

:func:`start_recording` (allocations with Python stacks) from before the model is built, run
some steps, then :func:`stop_and_report` replays the allocator's alloc/free trace from zero,
finds the moment of the highest allocated total and groups the blocks live then by the first
stack frame in our code (megatron, nemo_gtp, bench); ``stack=True`` adds the stack of the
allocation that set the peak (which phase of the step).

    start_recording()
    ...  # build, train
    print(stop_and_report(stack=True))
"""

from __future__ import annotations

from collections import Counter

_OURS = ("megatron", "nemo_gtp", "bench", "fsdp")


def _site(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(key in name for key in _OURS):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "<no frames>"


def _replay(snapshot: dict, device: int | None) -> tuple[int, dict[int, tuple[int, list]], list]:
    """Replay the allocator's trace from zero: (peak bytes, the blocks live then as
    ``{addr: (size, frames)}``, the frames of the allocation that set the peak)."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device is not None else max(traces, key=len)
    frees = (
        {"free_completed"}
        if any(e["action"] == "free_completed" for e in trace)
        else {"free_requested"}
    )
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    peak_live: dict[int, tuple[int, list]] = {}
    peak_frames: list = []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, peak_live, peak_frames = total, dict(live), live[event["addr"]][1]
        elif action in frees and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, peak_live, peak_frames


def _by_site(live: dict[int, tuple[int, list]]) -> list[tuple[int, str]]:
    by_site: Counter[str] = Counter()
    for size, frames in live.values():
        by_site[_site(frames)] += size
    return sorted(((b, s) for s, b in by_site.items()), reverse=True)


def peak_breakdown(snapshot: dict, device: int | None = None) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes, [(bytes, allocation site)] of the blocks live at the peak, largest first)."""
    peak, peak_live, _ = _replay(snapshot, device)
    return peak, _by_site(peak_live)


def format_breakdown(result: tuple[int, list[tuple[int, str]]], top: int = 20) -> str:
    """Text table of :func:`peak_breakdown`'s result."""
    peak, rows = result
    lines = [f"peak (traced allocations) {peak / 2**30:.2f} GiB"]
    lines += [f"  {b / 2**30:8.3f} GiB  {site}" for b, site in rows[:top]]
    return "\n".join(lines)


def _stack_text(peak: int, frames: list, depth: int = 16) -> str:
    """The Python stack of the allocation that set the peak, innermost frame first."""
    lines = [f"allocation that set the peak ({peak / 2**30:.2f} GiB):"]
    lines += [
        f"  {f.get('filename', '?').split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
        for f in frames[:depth]
    ]
    return "\n".join(lines)


MAX_ENTRIES = 2_000_000  # allocator events kept: a few steps of a 1B model


def start_recording() -> None:
    """Record this process's CUDA allocations, with Python stacks."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")


def stop_and_report(top: int = 20, stack: bool = False) -> str:
    """Stop recording and return what was live at the peak per site (:func:`format_breakdown`,
    ``top`` rows), with ``stack`` also the stack that set the peak; one replay of the trace."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, live, frames = _replay(snapshot, None)
    text = format_breakdown((peak, _by_site(live)), top)
    return text + "\n" + _stack_text(peak, frames) if stack else text

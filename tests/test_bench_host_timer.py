"""``bench.common.GTPHostTimer``: the in-process host timer ``bench_nemo.py --host-timer`` records
on GPUs counts each entry's outermost call once per thread, gives an entry wrapped again in a
category of its own its inclusive time under its own name, and reports ms, thread CPU ms and
calls per step."""

from __future__ import annotations

import sys
import time
import types

from bench.common import GTPHostTimer


class _Runtime:
    """Stands in for a class whose methods the timer wraps (an entry calls an inner step)."""

    def consume(self) -> int:
        return self.issue() + self.issue()

    def issue(self) -> int:
        time.sleep(0.002)  # wall time the thread does not spend on the CPU
        return 1


def test_outermost_calls_inner_entries_and_per_step_figures() -> None:
    module = types.ModuleType("_timer_probe")
    module.Runtime = _Runtime
    sys.modules["_timer_probe"] = module
    try:
        entries = (
            ("_timer_probe", "Runtime", "consume", "gtp"),
            ("_timer_probe", "Runtime", "issue", "gtp"),  # nested in consume: not counted again
            ("_timer_probe", "Runtime", "issue", "in.issue"),  # its own category: inclusive
            ("_timer_probe", "Missing", "step", "optimizer"),  # absent here: skipped
        )
        timer = GTPHostTimer.install(entries)
        before = timer.snapshot()
        runtime = _Runtime()
        for _ in range(3):
            assert runtime.consume() == 2
        per_step = timer.per_step(before, timer.snapshot(), steps=3)
    finally:
        del sys.modules["_timer_probe"]
    found = per_step["entries"]
    assert set(found) == {"Runtime.consume", "Runtime.issue (in.issue)"}
    assert found["Runtime.consume"]["calls"] == 1.0
    assert found["Runtime.issue (in.issue)"]["calls"] == 2.0
    # two 2 ms sleeps per consume: wall >= 4 ms per step, nearly none of it on the CPU
    assert found["Runtime.consume"]["ms"] >= 4.0
    assert found["Runtime.consume"]["cpu_ms"] < found["Runtime.consume"]["ms"] / 2
    assert per_step["gtp_ms"] == found["Runtime.consume"]["ms"]
    assert per_step["in.issue_ms"] <= per_step["gtp_ms"]

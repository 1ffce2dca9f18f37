"""Host time spent inside GTP's code per step, measured in the process that runs the step.

Comparing two launches (GTP2 vs DP2) on a shared VM mixes GTP's cost with the host's speed
of the hour (the same DP2 fit moved by 30 % between launches). This measures GTP's share
*inside* one process: every entry point through which a step calls into GTP (TE's
DistributedWeight protocol calls, the autograd path's gather / reduce-scatter calls, TE's
forward pre-hook, the drains) is wrapped with a wall-clock accumulator that counts only the
outermost GTP frame of each thread, so nested entries are not counted twice. The optimizer
step (megatron's, in every mode) is timed the same way, separately.

    timer = GTPHostTimer.install()      # before the model is built (TE hooks bind at build)
    before = timer.snapshot()
    ...                                 # N training steps
    per_step = timer.per_step(before, timer.snapshot(), steps=N)
    # {"gtp_ms": 9.8, "entries": {"materialize_group_for_forward": {"ms": ..., "calls": ...}},
    #  "optimizer_ms": 4.1}

Each wrapped call costs the timer ~1 µs (two clock reads and a thread-local lookup); it is
counted into the GTP figure, so the figure is an upper bound by ~1 µs per entry call.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

# (module, class or None for a module-level function, attribute, category)
GTP_ENTRIES = (
    ("nemo_gtp.engine.param", "GTPShardedParam", "materialize_group_for_forward", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "materialize_group_for_backward", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "grad_buffer", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "finalize_group_grads", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "materialize", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "prefetch_neighbour", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "release", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "reduce_scatter_wgrad", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "drain", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "drain_reduce_scatters", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "drain_gathers", "gtp"),
    ("nemo_gtp.engine.graph_segments", "GraphSegments", "end_graph_forward", "gtp"),
    ("nemo_gtp.engine.graph_segments", "GraphSegments", "end_graph_backward", "gtp"),
    ("nemo_gtp.engine.graph_segments", "GraphSegments", "fire_graph_hooks", "gtp"),
    # a captured layer's whole call (replay included): megatron's and GTP's host cost together
    ("nemo_gtp.integrations.megatron.layer_graphs", "GTPCudaGraphManager", "__call__", "layers"),
    ("nemo_gtp.integrations.te_grad_mode", None, "_record", "gtp"),
    ("nemo_gtp.integrations.megatron.sharding.te", None, "_record", "gtp"),  # before it moved
    # inside GTP's entry points, each its own category (inclusive time of every call, nested
    # or not): which part of a consume / finalize costs what (--host-timer's finer split)
    *(
        ("nemo_gtp.engine.runtime", "GTPRuntime", name, f"in.{name}")
        for name in (
            "_issue_unit",
            "_issue",
            "_finalize_all",
            "_protocol_alias",
            "_reduce_scatter_staged",
            "_prefetch_all",
            "materialize",
            "materialize_group_for_protocol",
            "release",
        )
    ),
    ("nemo_gtp.engine.param", "GatherSlot", "complete", "in.gather_complete"),
    ("nemo_gtp.engine.param", "ReduceScatterSlot", "complete", "in.rs_complete"),
    *(
        ("nemo_gtp.engine.collectives", "GroupCollectives", name, f"in.{name}")
        for name in (
            "all_gather",
            "all_gather_coalesced",
            "reduce_scatter",
            "reduce_scatter_coalesced",
        )
    ),
    # megatron's DDP bucket calls (grad-ready registration, grad / param sync issue and wait):
    # every mode makes them, a GTP2 rank over a data group of one
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "register_grad_ready",
        "ddp",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "start_grad_sync",
        "ddp",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "finish_grad_sync",
        "ddp",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "start_param_sync",
        "ddp",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "finish_param_sync",
        "ddp",
    ),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer", "step", "optimizer"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer", "step", "optimizer"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer", "step", "optimizer"),
)


TE_ENTRIES = (
    # TE's Python around its GEMMs, per module kind and direction (inclusive, each its own
    # category), and megatron's TE wrappers: where a TE linear's host time goes in either mode
    *(
        ("transformer_engine.pytorch.module.linear", None, name, f"te.{name}")
        for name in ("_linear_forward_impl", "_linear_setup_ctx", "_linear_backward_impl")
    ),
    ("transformer_engine.pytorch.module.linear", "Linear", "forward", "te.Linear.forward"),
    *(
        (
            "transformer_engine.pytorch.module.layernorm_linear",
            "_LayerNormLinear",
            name,
            f"te.LNL.{name}",
        )
        for name in ("forward", "backward")
    ),
    (
        "transformer_engine.pytorch.module.layernorm_linear",
        "LayerNormLinear",
        "forward",
        "te.LayerNormLinear.forward",
    ),
    *(
        (
            "transformer_engine.pytorch.attention.dot_product_attention.backends",
            "FusedAttnFunc",
            name,
            f"te.attn.{name}",
        )
        for name in ("forward", "backward")
    ),
    *(
        ("megatron.core.extensions.transformer_engine", cls, "forward", f"mcore.{cls}")
        for cls in ("TELayerNormColumnParallelLinear", "TERowParallelLinear")
    ),
)
"""TE's own entry points, timed beside GTP's when asked (``host_fake.py``'s ``%te``,
``bench_nemo.py --te-timer``; every mode pays the same ~1 µs per wrapped call), so the same TE
call's host µs compare across DP2 and GTP2 fits."""


def te_extension() -> Any:
    """TE's C++ module ``transformer_engine_torch``, imported after TE's core library (imported
    first it fails); None without TE."""
    try:
        import transformer_engine.pytorch  # noqa: F401 - loads TE's core library first
        import transformer_engine_torch
    except ImportError:
        return None
    return transformer_engine_torch


def te_entries() -> tuple:
    """:data:`TE_ENTRIES` and every C++ function of ``transformer_engine_torch`` (each its own
    category ``tex.<name>``); empty without TE."""
    tex = te_extension()
    if tex is None:
        return ()
    builtins = sorted(
        name
        for name, fn in vars(tex).items()
        if type(fn).__name__ == "builtin_function_or_method" and not name.startswith("_")
    )
    return (*TE_ENTRIES, *(("transformer_engine_torch", None, n, f"tex.{n}") for n in builtins))


class GTPHostTimer:
    """Accumulated wall time of the outermost GTP (and optimizer) frames, per entry point."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.cpu_ns: dict[str, int] = {}  # the calling thread's CPU time inside (wall - CPU:
        # blocked: the GIL, a CUDA call waiting for the device)
        self.calls: dict[str, int] = {}
        self.category: dict[str, str] = {}
        self._depth = threading.local()

    @classmethod
    def install(cls, entries: tuple = GTP_ENTRIES) -> GTPHostTimer:
        """Wrap every entry that exists in this environment; returns the timer."""
        timer = cls()
        for module_name, class_name, attr, category in entries:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            owner = getattr(module, class_name, None) if class_name else module
            if owner is None or attr not in vars(owner):
                continue  # only what the class itself defines (no double wraps via bases)
            name = f"{class_name}.{attr}" if class_name else attr
            if name in timer.ns:  # wrapped again in a category of its own: its inclusive time
                name = f"{name} ({category})"
            timer.category[name] = category
            setattr(owner, attr, timer._wrap(name, category, vars(owner)[attr]))
        return timer

    def _wrap(self, name: str, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.ns[name], self.cpu_ns[name], self.calls[name] = 0, 0, 0
        depth = self._depth
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, category, 0)
            if level:
                return fn(*args, **kwargs)
            setattr(depth, category, 1)
            start, cpu_start = clock(), cpu_clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] += clock() - start
                self.cpu_ns[name] += cpu_clock() - cpu_start
                self.calls[name] += 1
                setattr(depth, category, 0)

        return timed

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """(wall ns, calls, thread CPU ns) per entry so far."""
        return {name: (self.ns[name], self.calls[name], self.cpu_ns[name]) for name in self.ns}

    def per_step(self, before: dict, after: dict, steps: int) -> dict[str, Any]:
        """Milliseconds and calls per step between two snapshots, by entry and category."""
        entries, totals = {}, {}
        for name, (ns, calls, cpu_ns) in after.items():
            d_ns, d_calls = ns - before[name][0], calls - before[name][1]
            if not d_calls:
                continue
            ms = d_ns / 1e6 / steps
            cpu_ms = (cpu_ns - before[name][2]) / 1e6 / steps
            entries[name] = {
                "ms": round(ms, 3),
                "cpu_ms": round(cpu_ms, 3),
                "calls": round(d_calls / steps, 1),
            }
            category = self.category[name]
            totals[category] = totals.get(category, 0.0) + ms
        return {
            **{f"{c}_ms": round(v, 3) for c, v in sorted(totals.items())},
            "entries": entries,
        }

"""Code the benchmark scripts share (no torch at import: the max-model driver runs without it).

Sections, each answering one small question a benchmark needs on the way:

- launches: :func:`module_argv` / :func:`with_root`, the command line and environment of a
  script's own rank processes (``python -m bench.<name>`` from any directory);
- host profiles: :func:`write_host_profile` writes a cProfile of some steps as text (where a
  host-bound step's time goes); :func:`pstats_diff` diffs two dumps (``bench.tools pstats-diff``);
- memory peaks: :func:`start_recording` / :func:`stop_and_report`, what is live at a CUDA
  allocator's peak per allocation site (why one mode's peak sits above another's);
- ratio plots: :func:`plot_ratio_series` / :func:`plot_ratio` (step-time ratio against tokens
  per GPU, needs matplotlib);
- optimizer kernels: :func:`install_torch_kernels` / :func:`fuse_adam` give megatron's
  optimizer torch's fused / foreach kernels where the stack has neither TE nor apex, so every
  ``bench.bench_gpt`` mode runs the same optimizer kernels as its FSDP2 baseline;
- the in-process host timer: :class:`GTPHostTimer` (``bench.bench_nemo --host-timer``,
  ``bench.host_fake``'s ``host_inside``);
- weight dumps: :func:`compare` (two ``--dump-weights`` files, key by key, bit for bit; design
  §3.3: a checkpoint reshards to any layout; CLI ``python -m bench.tools compare-weights``).

Example::

    from bench.common import GTPHostTimer, write_host_profile
    timer = GTPHostTimer.install()   # before the model is built (TE hooks bind at build)
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: where the recipes (``configs/``) are and the ``-m`` root of ranks."""


# ------------------------------------------------------------------------------- launches
def module_argv(module: str, *args: str) -> list[str]:
    """The command line of a rank process that runs ``python -m <module>`` (a script's own
    ranks: ``module_argv("bench.bench_nemo", "--rank-main", spec)``); its environment needs
    :func:`with_root` so the module and ``nemo_gtp`` are this checkout's from any directory."""
    return [sys.executable, "-m", module, *args]


def free_port() -> int:
    """A free TCP port on this host for one launch's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_root(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository root first on ``PYTHONPATH`` (see :func:`module_argv`)."""
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": f"{ROOT}:{rest}" if rest else str(ROOT)}


# ------------------------------------------------------------------------- host profiles
def write_host_profile(
    path: str,
    header: str,
    prof: cProfile.Profile,
    tables: tuple[tuple[str, int], ...] = (("tottime", 35),),
) -> None:
    """``header`` then one pstats table per ``(sort key, rows)`` in ``tables``, into ``path``."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key, rows in tables:
        stats.sort_stats(key).print_stats(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{header}\n{text.getvalue()}")


def _by_function(path: str) -> tuple[dict[str, tuple[int, float]], float]:
    stats = pstats.Stats(path)
    rows = {}
    for (filename, line, name), (_, calls, tottime, _, _) in stats.stats.items():
        short = filename.split("site-packages/")[-1].split("/nemo_gtp/")[-1]
        rows[f"{short}:{line}({name})"] = (calls, tottime)
    return rows, stats.total_tt


def pstats_diff(mode: str, baseline: str, steps: int, top: int) -> str:
    """The table (text): total own time per step of both dumps, then the ``top`` functions
    with the most extra own time per step in ``mode`` and the ``top // 3`` with the least."""
    a, total_a = _by_function(mode)
    b, total_b = _by_function(baseline)
    rows = []
    for key in set(a) | set(b):
        calls_a, time_a = a.get(key, (0, 0.0))
        calls_b, time_b = b.get(key, (0, 0.0))
        rows.append((time_a - time_b, key, calls_a, calls_b))
    rows.sort(reverse=True)
    per_step = 1000 / steps
    lines = [
        f"own time per step: {total_a * per_step:.1f} ms vs {total_b * per_step:.1f} ms "
        f"(+{(total_a - total_b) * per_step:.1f} ms)",
        "",
        "| extra ms/step | calls (mode / baseline, all steps) | function |",
        "|---|---|---|",
    ]
    for extra, key, calls_a, calls_b in [*rows[:top], *rows[-(top // 3) :]]:
        lines.append(f"| {extra * per_step:+.2f} | {calls_a} / {calls_b} | `{key[:110]}` |")
    return "\n".join(lines)


# ----------------------- memory peaks: what is live at the peak of a CUDA memory history
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


def live_by_site(snapshot: dict) -> list[tuple[int, str]]:
    """[(bytes, allocation site)] of the blocks allocated when ``snapshot``
    (``torch.cuda.memory._snapshot()``) was taken, largest first; a block of a CUDA graph's
    private pool says so. Sites need :func:`start_recording` before the blocks were allocated
    (else ``<no frames>``). What holds a finished fit's memory: ``host_fake --leftover-sites``.

    Example::

        live_by_site(torch.cuda.memory._snapshot())[:3]
        # [(5.2e9, "transformer/cuda_graphs.py:655 create_fwd_graph [graph pool]"), ...]
    """
    plain: dict[int, tuple[int, list]] = {}
    pooled: dict[int, tuple[int, list]] = {}
    for segment in snapshot["segments"]:
        graph_pool = tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        live = pooled if graph_pool else plain
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[len(live)] = (block["size"], block.get("frames", []))
    rows = _by_site(plain) + [(b, f"{site} [graph pool]") for b, site in _by_site(pooled)]
    return sorted(rows, reverse=True)


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


# --------------------------------------------------------------------------- ratio plots
def plot_ratio_series(
    series: dict[str, tuple[list[int], list[float]]], png_path: str, *, title: str, ylabel: str
) -> None:
    """One line per ``label -> (tokens per GPU, ratios)``, log2 x axis, a rule at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def plot_ratio(json_path: str, png_path: str) -> None:
    """Every mode of a ``bench_gpt.json`` against replicated DDP."""
    with open(json_path) as f:
        data = json.load(f)
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in data["records"] if not r.get("oom")}
    tokens = sorted({t for _, t in by})
    series = {}
    for mode in sorted({m for m, _ in by if m != "ddp"}, key=lambda m: (m != "fsdp2", m)):
        xs = [t for t in tokens if (mode, t) in by and ("ddp", t) in by]
        series[f"{mode} / ddp"] = (
            xs,
            [by[(mode, t)]["step_ms"] / by[("ddp", t)]["step_ms"] for t in xs],
        )
    plot_ratio_series(
        series,
        png_path,
        title=f"{data['world']}x {data['device']}",
        ylabel="step time ratio vs replicated DDP",
    )


# - optimizer kernels: torch's fused / foreach kernels for megatron's optimizer fallbacks
def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):  # noqa: ANN001, ANN202
    import torch

    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):  # noqa: ANN001, ANN202
    import torch

    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src)
    if not (isinstance(scale, float) and scale == 1.0):
        torch._foreach_mul_(dst, scale)


def install_torch_kernels() -> None:
    """Route megatron's multi-tensor fallbacks to torch foreach kernels (process-wide)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = _scale
    if megatron_optimizer.multi_tensor_scale_impl is local_multi_tensor_scale:
        megatron_optimizer.multi_tensor_scale_impl = _scale


def fuse_adam(optimizer: object) -> int:
    """Switch every torch Adam/AdamW inside a megatron optimizer to ``fused=True``.

    Must run before the first step (the per-param step counters are created then). Returns the
    number of param groups switched.
    """
    import torch

    inners = [
        getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    switched = 0
    for inner in inners:
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and not inner.state:
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


# ------------------------------------------------------------------------------ host timer
# Host time spent inside GTP's code per step, measured in the process that runs the step.
# Comparing two launches (GTP2 vs DP2) on a shared VM mixes GTP's cost with the host's speed of
# the hour (the same DP2 fit moved by 30 % between launches), so GTP's share is measured
# *inside* one process: every entry point through which a step calls into GTP is wrapped with a
# wall-clock accumulator that counts only the outermost GTP frame of each thread (nested entries
# are not counted twice). The optimizer step is timed the same way, separately. Each wrapped
# call costs the timer ~1 us (two clock reads and a thread-local lookup), counted into the GTP
# figure: an upper bound by ~1 us per entry call.
#
#     timer = GTPHostTimer.install()
#     before = timer.snapshot()
#     ...                                 # N training steps
#     per_step = timer.per_step(before, timer.snapshot(), steps=N)
#     # {"gtp_ms": 9.8, "entries": {"materialize_group_for_forward": {...}}, "optimizer_ms": 4.1}

# (module, class or None for a module-level function, attribute, category)
GTP_ENTRIES = (
    ("nemo_gtp.engine.param", "GTPShardedParam", "materialize_group_for_forward", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "materialize_group_for_backward", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "grad_buffer", "gtp"),
    ("nemo_gtp.engine.param", "GTPShardedParam", "finalize_group_grads", "gtp"),
    ("nemo_gtp.engine.gather", "GatherSide", "materialize", "gtp"),
    ("nemo_gtp.engine.gather", "GatherSide", "prefetch_neighbour", "gtp"),
    ("nemo_gtp.engine.gather", "GatherSide", "release", "gtp"),
    ("nemo_gtp.engine.reduce_scatter", "ReduceScatterSide", "reduce_scatter_wgrad", "gtp"),
    ("nemo_gtp.engine.runtime", "GTPRuntime", "drain", "gtp"),
    ("nemo_gtp.engine.reduce_scatter", "ReduceScatterSide", "drain_reduce_scatters", "gtp"),
    ("nemo_gtp.engine.gather", "GatherSide", "drain_gathers", "gtp"),
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
        (f"nemo_gtp.engine.{module}", owner, name, f"in.{name}")
        for module, owner, name in (
            ("gather", "GatherSide", "issue_unit_gather"),
            ("gather", "GatherSide", "issue_gather"),
            ("reduce_scatter", "ReduceScatterSide", "finalize_reduce_scatters"),
            ("protocol", "ProtocolSide", "_protocol_alias"),
            ("reduce_scatter", "ReduceScatterSide", "reduce_scatter_staged"),
            ("gather", "GatherSide", "prefetch_units"),
            ("gather", "GatherSide", "materialize"),
            ("protocol", "ProtocolSide", "materialize_group_for_protocol"),
            ("gather", "GatherSide", "release"),
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
    ("nemo_gtp.integrations.megatron.grad_clip", None, "chained_step", "optimizer"),
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


OUTER_ENTRIES = tuple(entry for entry in GTP_ENTRIES if not entry[3].startswith("in."))
"""GTP's entry points without the split inside them: what the "inside GTP" total needs, at a
tenth of the timed calls (``bench.host_fake --timer outer``, its default)."""


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


# -------------------------------------------------------------------------- weight dumps
def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> list[str]:
    """One line per key that is not bit for bit equal (missing, other shape / dtype, values);
    the last line is the verdict."""
    import torch

    lines, bad, close = [], 0, 0
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            lines.append(f"{key}: only in {'the first' if key in a else 'the second'}")
            bad += 1
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            bad += 1
            continue
        if torch.equal(x, y):
            continue
        diff = (x.double() - y.double()).abs()
        rel = (diff / y.double().abs().clamp_min(1e-30)).max().item()
        within = rel <= rtol
        close += within
        bad += not within
        lines.append(
            f"{key}: max |diff| {diff.max().item():.3e}, max rel {rel:.3e}, "
            f"{int((diff > 0).sum())} of {diff.numel()} elements differ"
            + (" (within --rtol)" if within else "")
        )
    keys = len(a.keys() | b.keys())
    if bad:
        lines.append(f"WEIGHTS: DIFFER ({bad} of {keys} keys)")
    else:
        extra = f", {close} within rtol {rtol:g}" if close else ""
        lines.append(f"WEIGHTS: equal ({keys} keys: {keys - close} bit for bit{extra})")
    return lines


# ------------------------------------------------------------------------------- model FLOPs
PEAK_DENSE_TFLOPS = (  # (device-name substring, bf16, fp8): dense peaks, no sparsity
    ("H100 PCIe", 756.0, 1513.0),
    ("H100 NVL", 835.0, 1671.0),
    ("H100", 989.0, 1979.0),  # SXM (HBM3): "NVIDIA H100 80GB HBM3"
    ("H200", 989.0, 1979.0),  # "NVIDIA H200", also "NVIDIA GH200 ..."
    ("A100", 312.0, None),
)
"""Each device's dense peak TFLOP/s in bf16 and FP8 (None: no FP8 tensor cores), matched in
order against ``torch.cuda.get_device_name()``; a device matching none gets no MFU."""


def peak_tflops(device_name: str, fp8: bool = False) -> float | None:
    """The dense peak TFLOP/s of ``device_name`` (bf16, or FP8 when ``fp8``), None when unknown:
    an MFU against a guessed peak would be a made-up number."""
    for key, bf16, fp8_peak in PEAK_DENSE_TFLOPS:
        if key in device_name:
            return fp8_peak if fp8 else bf16
    return None


def gpt_flops(model: dict[str, Any], seq_length: int, sequences: int) -> float:
    """Model FLOPs (forward + backward) of a GPT over ``sequences`` sequences of
    ``seq_length`` tokens: Megatron-LM's ``num_floating_point_operations`` (its
    ``transformer_flops``: causal attention, GQA, gated MLP, routed and shared experts, logits)
    for ``model``, a recipe's ``model`` section (GPTConfig's names and defaults).

    Per token, each GEMM counted 3 times (forward, data and weight gradient) at 2 FLOPs per
    multiply-add, with ``h`` hidden, ``q = kv_channels * heads`` the query width, ``g`` the
    query groups, ``a`` the heads, ``s`` the sequence, ``L`` the layers and ``V`` the vocabulary
    padded to a multiple of 128 (megatron's ``make_vocab_size_divisible_by``)::

        attention  12 L h q (1 + g/a + s/(2h))   QKV and output projections, QK^T and AV
                                                 (half of s x s: causal)
        MLP        12 L h f m                    m = 3/2 gated (three GEMMs), else 1; MoE
                                                 layers: f = moe_ffn_hidden_size x topk
                                                 (+ the shared experts' width)
        logits     6 h V

    Recompute, the router and the norms are not counted (model FLOPs, not hardware FLOPs).
    """
    h = model["hidden_size"]
    layers = model["num_layers"]
    heads = model["num_attention_heads"]
    kv = model.get("kv_channels") or h // heads
    groups = model.get("num_query_groups") or heads
    gated = 1.5 if model.get("gated_linear_unit") else 1.0
    ffn = model.get("ffn_hidden_size") or 4 * h
    if model.get("num_moe_experts"):  # every layer a MoE layer (moe_layer_freq 1)
        routed = (model.get("moe_ffn_hidden_size") or ffn) * model.get("moe_router_topk", 2)
        ffn = routed + (model.get("moe_shared_expert_intermediate_size") or 0)
    vocab = model["vocab_size"]
    vocab = -(-vocab // 128) * 128
    q = kv * heads
    attention = 12 * layers * h * q * (1 + groups / heads + seq_length / (2 * h))
    mlp = 12 * layers * h * ffn * gated
    logits = 6 * h * vocab
    return float(sequences * seq_length * (attention + mlp + logits))


def recipe_flops_per_gpu(cfg: Any, world: int) -> float:
    """Model FLOPs each of ``world`` GPUs does per optimizer step of the loaded recipe ``cfg``
    (an OmegaConf recipe): the global batch's FLOPs over the world, whatever the layout (GTP,
    DP, TP and CP split the same model math, every GPU its share)."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["vocab_size"] = cfg.data.vocab_size
    total = gpt_flops(model, cfg.data.seq_length, cfg.data.global_batch_size)
    return total / world


def mfu(flops_per_gpu: float, step_ms: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: ``flops_per_gpu`` per step of ``step_ms`` against ``peak``
    TFLOP/s (None when the peak is unknown)."""
    if peak is None or step_ms <= 0:
        return None
    return flops_per_gpu / (step_ms / 1000) / (peak * 1e12)


def mfu_fields(cfg: Any, world: int, step_ms: float, device_name: str) -> dict[str, Any]:
    """The FLOP fields of a benchmark record: model TFLOP per GPU per step, achieved TFLOP/s,
    the device's dense peak (FP8 for an FP8 recipe) and MFU (None off known GPUs)."""
    flops = recipe_flops_per_gpu(cfg, world)
    fp8 = bool(cfg.get("fp8")) and cfg.fp8.get("format") is not None
    peak = peak_tflops(device_name, fp8=fp8)
    value = mfu(flops, step_ms, peak)
    return {
        "model_tflop_per_gpu_step": round(flops / 1e12, 4),
        "tflops_per_gpu": round(flops / (step_ms / 1000) / 1e12, 1) if step_ms > 0 else None,
        "peak_tflops": peak,
        "mfu": None if value is None else round(value, 4),
    }


def mfu_text(record: dict[str, Any]) -> str:
    """A record's MFU as a table cell: ``"42.1 %"``, or ``""`` (no peak known, or no record)."""
    value = record.get("mfu")
    return "" if value is None else f"{100 * value:.1f} %"

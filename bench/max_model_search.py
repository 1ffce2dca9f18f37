"""Which layer counts ``bench_max_model.py`` probes: planner predictions and the search (no torch).

Every mode's per-GPU peak is a straight line in the layer count, ``a + b * layers`` (weights,
grads, optimizer state, gathered weights and activations all scale with the layers; embeddings,
logits and the CUDA context do not). The planner (``nemo_gtp.plan.estimate``) gives a prior line
per mode; successful probes give measured points. The search keeps the largest layer count that
trained (``lo``) and the smallest that failed (``hi``) and stops when ``hi == lo + 1``. Its next
guess is where the best line it has crosses the memory budget:

- two measured points of this mode: the line through them (exact up to allocator slack);
- one point: the planner's intercept and the slope through that point (the per-layer terms are
  what the planner gets wrong: activations, allocator rounding);
- none: the planner's line, shifted by the intercept and slope errors measured on an earlier
  mode of the same activation class (with or without recompute) when there is one, else
  ``first_fraction`` of the planner's prediction (a calibration probe that is expected to fit:
  the planner counts 2 bytes per attention score, the local spec's unfused attention keeps 6,
  its fp32 softmax output and bf16 probabilities).

A guess the data contradict (at or above a failed count) falls back to bisection; with only
failures so far the next probe is at least a quarter smaller.

Example::

    prior = planner_line(MODES["gtp2"], shape, world=2, tokens_per_gpu=4096)
    layers = next_layers([], prior, budget=139 * GIB, first_fraction=0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nemo_gtp.plan import GIB, Layout, ModelShape, estimate

# Probe outcomes. "oom" and "timeout" bound the search from above; "error" ends the mode.
OK, OOM, TIMEOUT, ERROR = "ok", "oom", "timeout", "error"
FAILED = (OOM, TIMEOUT)


@dataclass(frozen=True)
class Mode:
    """One way to train the model on ``world`` GPUs, as the probe builds it."""

    name: str
    builder: str  # a bench_gpt.build mode, or "mfsdp" (Megatron-FSDP, built here)
    doc: str
    recompute: bool = False
    gtp: bool = False
    shard_replicated: bool = False
    zero3_bytes_per_param: int = 0  # fully sharded modes: state bytes per param over the world
    cuda_only: bool = False

    def layout(self, world: int) -> Layout | None:
        """The planner's layout, or None for the fully sharded modes (no planner layout)."""
        if self.zero3_bytes_per_param:
            return None
        if self.gtp:
            return Layout(1, world, 1, self.recompute, self.shard_replicated)
        return Layout(1, 1, world, self.recompute)


MODES = {
    m.name: m
    for m in (
        Mode(
            "gtp2",
            "gtp_auto",
            "GTP over every GPU (default GTPConfig), megatron DDP + distopt",
            gtp=True,
        ),
        Mode("dp2", "ddp", "megatron DDP, distributed optimizer, fp32 grad reduce"),
        Mode(
            "fsdp2",
            "fsdp2",
            "torch FSDP2 per layer + root, fp32 master params, bf16 compute",
            zero3_bytes_per_param=16,  # fp32 param + fp32 grad + Adam m, v
        ),
        Mode(
            "gtp2_srp",
            "gtp_sr",
            "gtp2 + shard_replicated_params_over_gtp",
            gtp=True,
            shard_replicated=True,
        ),
        Mode(
            "gtp2_recompute",
            "gtp_auto",
            "gtp2 + full activation recompute (uniform, 1 layer)",
            recompute=True,
            gtp=True,
        ),
        Mode(
            "mfsdp",
            "mfsdp",
            "Megatron-FSDP (megatron.core.distributed.fsdp), optim_grads_params",
            zero3_bytes_per_param=18,  # fp32 main + bf16 model shard + fp32 grad + Adam m, v
            cuda_only=True,
        ),
    )
}


def predicted_bytes(
    mode: Mode, shape: ModelShape, *, world: int, tokens_per_gpu: int, overhead_gib: float = 3.0
) -> dict[str, float]:
    """Per-GPU bytes of ``mode`` by the planner (its ``estimate``), split as the planner splits.

    The fully sharded modes have no planner layout: their state is ``zero3_bytes_per_param`` per
    parameter over the world, plus the unsharded bf16 weights of two layers (current and
    prefetched), one layer's bf16 grads and fp32 reduce-scatter input, and the root's unsharded
    embeddings and output layer; activations as the planner's DP layout.
    """
    layout = mode.layout(world)
    if layout is not None:
        return estimate(shape, layout, tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib)
    base = estimate(
        shape, Layout(1, 1, world), tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib
    )
    layer = shape.linear_params_per_layer
    return {
        "state": shape.parameters * mode.zero3_bytes_per_param / world,
        "gather": 2 * 2 * layer + 6 * layer + 2 * shape.embedding_params,
        "activations": base["activations"],
        "overhead": base["overhead"],
    }


@dataclass(frozen=True)
class Line:
    """Peak bytes per GPU = ``a + b * layers``."""

    a: float
    b: float

    def at(self, layers: int) -> float:
        """Bytes at ``layers``."""
        return self.a + self.b * layers

    def max_layers(self, budget: float) -> int:
        """Largest layer count whose bytes stay within ``budget`` (0 when none does)."""
        if self.b <= 0:
            return 10**6
        return max(0, math.floor((budget - self.a) / self.b))


def planner_line(
    mode: Mode, shape: ModelShape, *, world: int, tokens_per_gpu: int, overhead_gib: float = 3.0
) -> Line:
    """The planner's peak as a line in the layer count (it is linear: two points fix it)."""

    def total(layers: int) -> float:
        s = ModelShape(**{**shape.__dict__, "layers": layers})
        return sum(
            predicted_bytes(
                mode, s, world=world, tokens_per_gpu=tokens_per_gpu, overhead_gib=overhead_gib
            ).values()
        )

    one, two = total(1), total(2)
    return Line(one - (two - one), two - one)


@dataclass(frozen=True)
class Point:
    """One probe as the search sees it: layers, outcome, measured peak bytes (None unless ok)."""

    layers: int
    outcome: str
    peak: float | None = None


def fit_line(points: list[Point], prior: Line) -> Line:
    """The best line for a mode from its successful probes (see the module docstring)."""
    ok = {p.layers: p.peak for p in points if p.outcome == OK and p.peak is not None}
    if len(ok) >= 2:
        (l1, p1), (l2, p2) = sorted(ok.items())[-2:]
        slope = (p2 - p1) / (l2 - l1)
        if slope > 0:
            return Line(p2 - slope * l2, slope)
    if ok:
        l0, p0 = max(ok.items())
        slope = (p0 - prior.a) / l0
        if slope > 0:
            return Line(prior.a, slope)
    return prior


def bracket(points: list[Point]) -> tuple[int, int | None]:
    """(largest layer count that trained or 0, smallest failed count above it or None)."""
    lo = max((p.layers for p in points if p.outcome == OK), default=0)
    hi = min((p.layers for p in points if p.outcome in FAILED and p.layers > lo), default=None)
    return lo, hi


def next_layers(
    points: list[Point],
    prior: Line,
    budget: float,
    *,
    first_fraction: float | None = None,
    margin: float = GIB,
    max_layers: int = 256,
) -> int | None:
    """The next layer count to probe, or None when the search is done.

    ``points``: this mode's probes so far; ``prior``: its planner line (already corrected by
    other modes' measurements where there are some); ``budget``: bytes per GPU;
    ``first_fraction``: scale of the very first guess when the prior is uncorrected.
    """
    lo, hi = bracket(points)
    if hi is not None and hi <= lo + 1:
        return None  # the boundary is found
    if hi == 1 or lo >= max_layers:
        return None  # nothing fits, or the cap is reached
    guess = fit_line(points, prior).max_layers(budget - margin)
    if not points and first_fraction is not None:
        guess = max(1, math.floor(first_fraction * guess))
    upper = max_layers if hi is None else hi - 1
    if lo == 0 and hi is not None:  # only failures: shrink by at least a quarter
        return max(1, min(guess, hi - max(1, hi // 4)))
    if guess <= lo:
        return lo + 1  # the line says lo is the largest: confirm that lo + 1 fails
    if guess > upper:
        return (lo + hi) // 2 if hi is not None else upper  # the data contradict the line
    return guess

"""CUDA graphs under GTP through the strategy (design §2.4, §3.5).

Two kinds are supported, both megatron-core's local implementation: the full-iteration graph
(``cuda_graph_scope="full_iteration"``, one graph per step: :class:`FullIterationGraph`) and
per-layer graphs (``cuda_graph_impl="local"`` with scope ``"full"`` or ``"attn"``: each
transformer layer one graph; ``shard_model`` installs the GTP side, see
:mod:`nemo_gtp.integrations.megatron.layer_graphs`). Either way capture must not start before two
warmup steps have run: the first builds the weight-prefetch chain (chains are observed on the
first forward, §3.4) and binds the buffers, the second exercises the steady state.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.graph_rules import (
    SUPPORTED_LAYER_SCOPES,
    cuda_graphs_enabled,
    full_iteration_graphs,
    layer_graph_scope,
    reject_cuda_graph_capture,
)
from nemo_gtp.integrations.megatron.graph_replay import use_lean_replay
from nemo_gtp.integrations.megatron.layer_graphs import release_live_cuda_graphs

__all__ = [
    "SUPPORTED_LAYER_SCOPES",
    "cuda_graphs_enabled",
    "enforce_cuda_graph_warmup",
    "full_iteration_graphs",
    "graph_safe_gtp_config",
    "install_lean_layer_replay",
    "layer_graph_scope",
    "reject_cuda_graph_capture",
    "release_graphs_at_exit",
]

MIN_GTP_CUDA_GRAPH_WARMUP_STEPS = 2


def release_graphs_at_exit(config: Any) -> bool:
    """With CUDA graphs on, reset every live graph at interpreter exit, before NeMo's own exit
    handler destroys the process group (handlers run last-registered first): a graph holding
    captured NCCL collectives made that destroy wait forever (design §3.5). Call after NeMo's
    ``setup_distributed`` (which registers its handler); idempotent. Returns whether it did.

    Example::

        super().setup_distributed()
        release_graphs_at_exit(self.model.config)
    """
    if not cuda_graphs_enabled(config):
        return False
    atexit.unregister(release_live_cuda_graphs)  # once, and after NeMo's handler
    atexit.register(release_live_cuda_graphs)
    return True


def enforce_cuda_graph_warmup(config: Any) -> str | None:
    """Raise ``config.cuda_graph_warmup_steps`` to 2 when CUDA graphs are on; return a note.

    Returns ``None`` when nothing changed (graphs off, or already >= 2 warmup steps).

    Example::

        config.cuda_graph_impl, config.cuda_graph_warmup_steps = "local", 0
        enforce_cuda_graph_warmup(config)   # "GTP: cuda_graph_warmup_steps raised from 0 to 2 ..."
        config.cuda_graph_warmup_steps      # 2
    """
    if not cuda_graphs_enabled(config):
        return None
    steps = getattr(config, "cuda_graph_warmup_steps", None)
    if steps is not None and steps >= MIN_GTP_CUDA_GRAPH_WARMUP_STEPS:
        return None
    config.cuda_graph_warmup_steps = MIN_GTP_CUDA_GRAPH_WARMUP_STEPS
    io = getattr(config, "__io__", None)  # NeMo's serialized copy of the config: keep it in sync
    if io is not None and hasattr(io, "cuda_graph_warmup_steps"):
        io.cuda_graph_warmup_steps = MIN_GTP_CUDA_GRAPH_WARMUP_STEPS
    return (
        f"GTP: cuda_graph_warmup_steps raised from {steps} to "
        f"{MIN_GTP_CUDA_GRAPH_WARMUP_STEPS} (the first warmup builds the weight-prefetch chain, "
        "the second exercises the prefetch path; design §2.4)"
    )


def graph_safe_gtp_config(
    config: Any, gtp_config: GTPConfig | None
) -> tuple[GTPConfig | None, str]:
    """The ``GTPConfig`` a CUDA graph can replay, and a note when it was changed.

    A replay runs no Python, so everything a step does must be stream work captured once: the
    copy-engine gather is not (its mirror refresh and barriers are decided on the host every
    step, on a cached stream), so ``gather_backend="auto"`` becomes ``"process_group"``, and an
    explicit ``"copy_engine"`` is an error naming the setting. The same holds for per-layer
    graphs. Graphs off: returned unchanged.

    Example::

        gtp_config, note = graph_safe_gtp_config(model.config, GTPConfig())
        gtp_config.gather_backend   # "process_group" under full_iteration graphs
    """
    full = full_iteration_graphs(config)
    if not full and layer_graph_scope(config) is None:
        return gtp_config, ""
    kind = "the full-iteration CUDA graph" if full else "per-layer CUDA graphs"
    current = gtp_config or GTPConfig()
    if current.gather_backend == "copy_engine":
        raise ValueError(
            f"GTPConfig.gather_backend='copy_engine' cannot be captured in {kind}: use "
            "gather_backend='process_group' (or 'auto'), or cuda_graph_impl='none'"
        )
    if current.gather_backend == "process_group":
        return gtp_config, ""
    return dataclasses.replace(current, gather_backend="process_group"), (
        f"GTP: gather_backend 'auto' -> 'process_group' under {kind} "
        "(copy-engine pulls are host-driven each step; design §3.5)"
    )


class FullIterationGraph:
    """Runs NeMo's training steps through one ``FullCudaGraphWrapper`` with GTP's warmup.

    NeMo 2.7.3 builds a fresh wrapper for every step (``MegatronStep.forward_backward_func``),
    with megatron's default of one warmup step and only for ``enable_cuda_graph`` (which
    megatron-core 0.15 then rejects when NeMo re-runs the config's ``__post_init__``). This
    object is a NeMo megatron callback: ``on_megatron_step_start`` hands every training step
    the same wrapper, built with ``warmup`` >= 2 eager steps — the first observes and links the
    prefetch chains and binds every buffer, the second runs the linked steady state once — so
    the captured step allocates nothing and replays exactly what every later step does
    (design §3.5). Validation steps stay eager.

    Example::

        megatron_parallel.callbacks.add(FullIterationGraph(warmup=2))
    """

    def __init__(self, warmup: int) -> None:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        self.warmup = warmup
        self.wrapper = FullCudaGraphWrapper(get_forward_backward_func(), warmup)

    def on_megatron_step_start(self, step: Any) -> Any:
        """NeMo's step transform: training steps run through the graph wrapper."""
        if not step.forward_only:
            step.__dict__["forward_backward_func"] = self.wrapper  # over NeMo's cached_property
        return step


def install_full_iteration_graph(megatron_parallel: Any, config: Any) -> str | None:
    """Add a :class:`FullIterationGraph` to NeMo's megatron callbacks; a note (None: graphs off).

    Example::

        install_full_iteration_graph(strategy.megatron_parallel, model.config)
    """
    if not full_iteration_graphs(config):
        return None
    connector = megatron_parallel.callbacks
    if any(
        isinstance(c, FullIterationGraph)
        for c in connector.callbacks.get("on_megatron_step_start", [])
    ):
        return None
    warmup = getattr(config, "cuda_graph_warmup_steps", 0) or 0
    graph = FullIterationGraph(max(MIN_GTP_CUDA_GRAPH_WARMUP_STEPS, warmup))
    connector.add(graph)
    return (
        f"GTP: full-iteration CUDA graph captured after {graph.warmup} eager warmup steps "
        "(design §3.5)"
    )


def install_lean_layer_replay(megatron_parallel: Any) -> int:
    """Per-layer graphs of every model chunk replay through the lean manager, GTP or not.

    megatron's replay walks each layer's modules and checks its arguments on every call, ~4 of
    the ~29 ms the host takes to queue a graphed 1B forward and backward
    (:mod:`~nemo_gtp.integrations.megatron.graph_replay`: same graphs, same inputs, bit for
    bit). GTP's layers have it from ``shard_model``; this gives it to the rest, so a non-GTP
    baseline through this strategy replays as fast. Returns how many layers changed.

    Example::

        install_lean_layer_replay(strategy.megatron_parallel)   # 24 for the 1B DP2 recipe
    """
    return sum(use_lean_replay(chunk) for chunk in megatron_parallel)

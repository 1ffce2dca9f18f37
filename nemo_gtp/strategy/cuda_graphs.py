"""CUDA-graph warmup under GTP (design §2.4 "CUDA-graph warmup under GTP_remat").

The first warmup iteration builds the weight-prefetch chain (chains are observed on the first
forward, §3.4) and the second exercises the prefetch path, so capture must not start before two
warmup steps have run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nemo_gtp.engine.config import GTPConfig

MIN_GTP_CUDA_GRAPH_WARMUP_STEPS = 2


def cuda_graphs_enabled(config: Any) -> bool:
    """Whether a megatron / NeMo model config asks for CUDA graphs (any implementation).

    ``enable_cuda_graph`` / ``external_cuda_graph`` are the deprecated switches megatron-core 0.15
    still honours; ``cuda_graph_impl`` is the current one. ``cuda_graph_scope`` alone does not
    enable anything (its default is ``"full"``), except NeMo's ``"full_iteration"`` scope.
    """
    impl = getattr(config, "cuda_graph_impl", "none")
    return bool(
        getattr(config, "enable_cuda_graph", False)
        or getattr(config, "external_cuda_graph", False)
        or (impl not in (None, "none"))
        or getattr(config, "cuda_graph_scope", None) == "full_iteration"
    )


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


def full_iteration_graphs(config: Any) -> bool:
    """Whether ``config`` asks for megatron's full-iteration CUDA graph (one graph per step).

    ``cuda_graph_scope="full_iteration"`` with the local implementation (``enable_cuda_graph`` or
    ``cuda_graph_impl="local"``); NeMo wraps its step in megatron's ``FullCudaGraphWrapper``
    for it (:func:`install_full_iteration_graph` does so under GTP with the warmup GTP needs).
    """
    return getattr(config, "cuda_graph_scope", None) == "full_iteration" and bool(
        getattr(config, "enable_cuda_graph", False)
        or getattr(config, "cuda_graph_impl", "none") == "local"
    )


def reject_cuda_graph_capture(config: Any) -> None:
    """``ValueError`` when a GTP model asks for per-layer CUDA graphs (not supported yet).

    Full-iteration graphs work under GTP (design §3.5): the whole forward-backward, prefetch
    chains included, is one graph, so no chain crosses a graph boundary. Per-layer capture
    (megatron's ``CudaGraphManager``, scopes ``"full"`` / ``"attn"``, or TE's graph helper) needs
    chains split at every layer boundary, the warmup's gradient guard and the DDP hooks fired
    after replay, none of which exists: a captured GTP layer would replay stale chain state.
    Raised before any process group is created.

    Example::

        reject_cuda_graph_capture(gpt_config)  # ValueError: cuda_graph_impl="local", scope "full"
    """
    if not cuda_graphs_enabled(config) or full_iteration_graphs(config):
        return
    settings = {
        name: getattr(config, name, None)
        for name in (
            "cuda_graph_impl",
            "enable_cuda_graph",
            "external_cuda_graph",
            "cuda_graph_scope",
        )
    }
    raise ValueError(
        f"per-layer CUDA-graph capture of a GTP model is not supported yet ({settings}): use the "
        "full-iteration graph (enable_cuda_graph=True, cuda_graph_scope='full_iteration' on the "
        "model config), turn graphs off (cuda_graph_impl='none', enable_cuda_graph=False, "
        "external_cuda_graph=False), or turn GTP off (num_weight_shards="
        "tensor_model_parallel_size)"
    )


def graph_safe_gtp_config(
    config: Any, gtp_config: GTPConfig | None
) -> tuple[GTPConfig | None, str]:
    """The ``GTPConfig`` a full-iteration graph can replay, and a note when it was changed.

    A replay runs no Python, so everything a step does must be stream work captured once: the
    copy-engine gather is not (its mirror refresh and barriers are decided on the host every
    step, on a cached stream), so ``gather_backend="auto"`` becomes ``"process_group"``, and an
    explicit ``"copy_engine"`` is an error naming the setting. Graphs off: returned unchanged.

    Example::

        gtp_config, note = graph_safe_gtp_config(model.config, GTPConfig())
        gtp_config.gather_backend   # "process_group" under full_iteration graphs
    """
    if not full_iteration_graphs(config):
        return gtp_config, ""
    current = gtp_config or GTPConfig()
    if current.gather_backend == "copy_engine":
        raise ValueError(
            "GTPConfig.gather_backend='copy_engine' cannot be captured in a full-iteration CUDA "
            "graph: use gather_backend='process_group' (or 'auto'), or cuda_graph_scope other "
            "than 'full_iteration'"
        )
    if current.gather_backend == "process_group":
        return gtp_config, ""
    return dataclasses.replace(current, gather_backend="process_group"), (
        "GTP: gather_backend 'auto' -> 'process_group' under the full-iteration CUDA graph "
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

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
import os
from typing import Any

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.integrations.megatron.layer_graphs import (
    layer_graph_scope,
    release_live_cuda_graphs,
)

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


SUPPORTED_LAYER_SCOPES = ("full", "attn")
"""Per-layer scopes GTP supports with ``cuda_graph_impl="local"`` (megatron-core 0.15 captures
the whole layer for both)."""


def reject_cuda_graph_capture(
    config: Any, *, use_te_rng_tracker: bool | None = None, pipeline_parallel: int = 1
) -> None:
    """``ValueError`` naming the setting when a GTP model asks for CUDA graphs GTP cannot take.

    Supported (design §3.5): the full-iteration graph, and megatron's local per-layer graphs
    with scope ``"full"`` or ``"attn"`` (one graph per transformer layer; the GTP chains are
    split at every layer, see :mod:`nemo_gtp.integrations.megatron.layer_graphs`). Refused,
    before any process group exists: TransformerEngine's graph helper
    (``cuda_graph_impl="transformer_engine"`` / ``external_cuda_graph``: NeMo does not drive
    it), other per-layer scopes, per-layer graphs with routed experts, with pipeline
    parallelism, with activation recompute, without a capturable RNG tracker
    (``use_te_rng_tracker``, when the caller knows it) and with ``expandable_segments``.

    Example::

        reject_cuda_graph_capture(gpt_config, use_te_rng_tracker=False)  # ValueError
    """
    if not cuda_graphs_enabled(config) or full_iteration_graphs(config):
        return
    off = "or turn graphs off (cuda_graph_impl='none')"
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "transformer_engine" or getattr(config, "external_cuda_graph", False):
        raise ValueError(
            f"cuda_graph_impl={impl!r} (TransformerEngine's graph helper) is not supported with "
            "GTP: use cuda_graph_impl='local' with cuda_graph_scope='full', 'attn' or "
            f"'full_iteration' {off}"
        )
    scope = layer_graph_scope(config)
    if scope not in SUPPORTED_LAYER_SCOPES:
        raise ValueError(
            f"cuda_graph_scope={scope!r} with per-layer CUDA graphs is not supported with GTP: "
            f"use one of {SUPPORTED_LAYER_SCOPES} or 'full_iteration' {off}"
        )
    what = f"per-layer CUDA graphs (cuda_graph_impl='local', cuda_graph_scope={scope!r})"
    if getattr(config, "num_moe_experts", None):
        raise ValueError(
            f"{what} of a GTP model with routed experts (num_moe_experts="
            f"{config.num_moe_experts}) are not supported: the token dispatch is not "
            f"capturable: turn graphs off (cuda_graph_impl='none')"
        )
    if pipeline_parallel > 1:
        raise ValueError(
            f"{what} with pipeline_model_parallel_size={pipeline_parallel} are not supported "
            f"with GTP: use pipeline_model_parallel_size=1 {off}"
        )
    if getattr(config, "recompute_granularity", None):
        raise ValueError(
            f"{what} with recompute_granularity={config.recompute_granularity!r}: megatron "
            f"captures no recomputed layer; set recompute_granularity=None {off}"
        )
    if use_te_rng_tracker is False:
        raise ValueError(
            f"{what} need a capturable RNG tracker: pass use_te_rng_tracker=True to the "
            f"strategy (as NeMo requires for CUDA graphs) {off}"
        )
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError(
            f"{what} are unsafe with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (megatron "
            f"refuses it): remove expandable_segments from PYTORCH_CUDA_ALLOC_CONF {off}"
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

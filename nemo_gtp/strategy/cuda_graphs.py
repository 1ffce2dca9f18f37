"""CUDA-graph warmup under GTP (design §2.4 "CUDA-graph warmup under GTP_remat").

The first warmup iteration builds the weight-prefetch chain (chains are observed on the first
forward, §3.4) and the second exercises the prefetch path, so capture must not start before two
warmup steps have run.
"""

from __future__ import annotations

from typing import Any

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


def reject_cuda_graph_capture(config: Any) -> None:
    """``ValueError`` when a GTP model would be captured in CUDA graphs (not implemented yet).

    Capture needs what design §3.5 lists — chains split at graph boundaries, gathers issued
    inside the graph, the warmup's gradient guard, the DDP hook fired after replay, the
    two-stage drain — and none of it exists yet: a captured GTP step would replay stale chain
    state and skip DDP's grad-ready hooks. Raised before any process group is created. The
    warmup bump (:func:`enforce_cuda_graph_warmup`) is the part that already exists.

    Example::

        reject_cuda_graph_capture(gpt_config)   # ValueError if cuda_graph_impl="local", ...
    """
    if not cuda_graphs_enabled(config):
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
        f"CUDA-graph capture of a GTP model is not supported yet ({settings}): set "
        "cuda_graph_impl='none', enable_cuda_graph=False, external_cuda_graph=False and "
        "cuda_graph_scope other than 'full_iteration' on the model config, or turn GTP off "
        "(num_weight_shards=tensor_model_parallel_size)"
    )

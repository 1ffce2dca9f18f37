"""Which CUDA graphs GTP can capture (design §3.5): the rules on a model config's graph settings.

One place for them, called by every front end: the strategy before any process group exists,
``with_gtp`` on NeMo's recipes and the YAML check before any worker starts. Pure arithmetic on
config attributes (a megatron ``TransformerConfig``, or any object with the same names); no
torch import, so the command line's pre-launch check stays fast.

Example::

    reject_cuda_graph_capture(gpt_config, use_te_rng_tracker=False)  # ValueError naming it
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

__all__ = [
    "SUPPORTED_LAYER_SCOPES",
    "cuda_graphs_enabled",
    "full_iteration_graphs",
    "graph_settings",
    "layer_graph_scope",
    "reject_cuda_graph_capture",
]


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


def layer_graph_scope(config: Any) -> str | None:
    """The scope of megatron's per-layer CUDA graphs ``config`` asks for, or None.

    ``cuda_graph_impl="local"`` (or the deprecated ``enable_cuda_graph``) with any scope but
    ``"full_iteration"`` (one graph per step, no layer boundary).

    Example::

        layer_graph_scope(TransformerConfig(..., cuda_graph_impl="local"))   # "full"
    """
    if config is None:
        return None
    local = getattr(config, "cuda_graph_impl", "none") == "local" or getattr(
        config, "enable_cuda_graph", False
    )
    scope = getattr(config, "cuda_graph_scope", "full")
    return scope if local and scope != "full_iteration" else None


SUPPORTED_LAYER_SCOPES = ("full", "attn")
"""Per-layer scopes GTP supports with ``cuda_graph_impl="local"`` (megatron-core 0.15 captures
the whole layer for both)."""


GRAPH_SETTINGS = (
    ("cuda_graph_impl", "none"),
    ("enable_cuda_graph", False),
    ("external_cuda_graph", False),
    ("cuda_graph_scope", "full"),
    ("num_moe_experts", None),
    ("recompute_granularity", None),
)
"""The model settings :func:`reject_cuda_graph_capture` reads, with megatron's defaults."""


def graph_settings(read: Callable[[str, Any], Any]) -> types.SimpleNamespace:
    """The model's graph settings (:data:`GRAPH_SETTINGS`) from ``read(name, default)``, for
    front ends that hold a recipe rather than a megatron config (a YAML model section, a fiddle
    config), as :func:`reject_cuda_graph_capture` takes them.

    Example::

        settings = graph_settings(lambda name, default: model.get(name, default))
        reject_cuda_graph_capture(settings, use_te_rng_tracker=True, model_key="model.")
    """
    return types.SimpleNamespace(**{name: read(name, default) for name, default in GRAPH_SETTINGS})


def reject_cuda_graph_capture(
    config: Any,
    *,
    use_te_rng_tracker: bool | None = None,
    pipeline_parallel: int = 1,
    model_key: str = "",
    strategy_key: str | None = None,
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
    ``model_key`` / ``strategy_key`` prefix the names in the message as the caller's user
    writes them (``"model."`` / ``"strategy."`` in a YAML recipe; None: the strategy's
    constructor arguments).

    Example::

        reject_cuda_graph_capture(gpt_config, use_te_rng_tracker=False)  # ValueError
    """
    if not cuda_graphs_enabled(config) or full_iteration_graphs(config):
        return
    m = model_key
    impl_key, scope_key = f"{m}cuda_graph_impl", f"{m}cuda_graph_scope"
    off = f"or turn graphs off ({impl_key}='none')"
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "transformer_engine" or getattr(config, "external_cuda_graph", False):
        raise ValueError(
            f"{impl_key}={impl!r} (TransformerEngine's graph helper) is not supported with "
            f"GTP: use {impl_key}='local' with {scope_key}='full', 'attn' or "
            f"'full_iteration' {off}"
        )
    scope = layer_graph_scope(config)
    if scope not in SUPPORTED_LAYER_SCOPES:
        raise ValueError(
            f"{scope_key}={scope!r} with per-layer CUDA graphs is not supported with GTP: "
            f"use one of {SUPPORTED_LAYER_SCOPES} or 'full_iteration' {off}"
        )
    what = f"per-layer CUDA graphs ({impl_key}='local', {scope_key}={scope!r})"
    if getattr(config, "num_moe_experts", None):
        raise ValueError(
            f"{what} of a GTP model with routed experts ({m}num_moe_experts="
            f"{config.num_moe_experts}) are not supported: the token dispatch is not "
            f"capturable: turn graphs off ({impl_key}='none')"
        )
    pp_key = f"{strategy_key or ''}pipeline_model_parallel_size"
    if pipeline_parallel > 1:
        raise ValueError(
            f"{what} with {pp_key}={pipeline_parallel} are not supported with GTP: use "
            f"{pp_key}=1 {off}"
        )
    if getattr(config, "recompute_granularity", None):
        raise ValueError(
            f"{what} with {m}recompute_granularity={config.recompute_granularity!r}: megatron "
            f"captures no recomputed layer; set {m}recompute_granularity=None {off}"
        )
    if use_te_rng_tracker is False:
        fix = (
            "pass use_te_rng_tracker=True to the strategy"
            if strategy_key is None
            else f"set {strategy_key}use_te_rng_tracker=true"
        )
        raise ValueError(
            f"{what} need a capturable RNG tracker: {fix} (as NeMo requires for CUDA graphs) {off}"
        )
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError(
            f"{what} are unsafe with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (megatron "
            f"refuses it): remove expandable_segments from PYTORCH_CUDA_ALLOC_CONF {off}"
        )

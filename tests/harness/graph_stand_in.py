"""megatron's per-layer CUDA-graph flow on CPU, with an eager stand-in for torch's graph API.

CPU has no CUDA graphs, so nothing can be captured or replayed here. What can run is everything
around it: megatron's ``CudaGraphManager`` recording the first step, ``create_cudagraphs`` with
its per-layer warmup iterations and its capture calls, and the replay path through megatron's
autograd nodes, with GTP's pieces in between (the segment drains, the grad guard, the capture
checks, the grad-ready hooks after each replayed backward, DDP's bucket bookkeeping). Inside
:func:`eager_cuda_graphs` a "capture" runs its body eagerly once and a "replay" does nothing:
the replayed outputs and gradients are those of the capture, so training numbers are not
meaningful, only the control flow (and :attr:`StandIn.replays` counts what was replayed).
The real capture runs on GPUs (``bench/gpu_layer_graphs.py``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StandIn:
    """What :func:`eager_cuda_graphs` yields: the count of graph replays requested inside."""

    replays: int = 0


def _eager_graph_class(stand_in: StandIn) -> type:
    """A class standing in for ``torch.cuda.CUDAGraph``: capture eager, replay counted only."""

    class EagerGraph:
        gtp_eager_stand_in = True

        def register_generator_state(self, state: Any) -> None:
            """RNG states are not captured on CPU."""

        def replay(self) -> None:
            """Count the replay; the captured work does not run again."""
            stand_in.replays += 1

    return EagerGraph


def active() -> bool:
    """Whether :func:`eager_cuda_graphs` is in effect (model builders then ask megatron for its
    graph manager, which they cannot on a plain CPU run)."""
    return bool(getattr(torch.cuda.CUDAGraph, "gtp_eager_stand_in", False))


@contextlib.contextmanager
def eager_cuda_graphs() -> Iterator[StandIn]:
    """Run megatron's local per-layer graph code on CPU with eager stand-in graphs (see module).

    Replaces the ``torch.cuda`` calls megatron's manager and runner make (graph objects and
    capture context, streams, memory pool handles and statistics, synchronization) and lets the
    installed RNG tracker pass megatron's "capturable tracker" check; everything is restored on
    exit. Use around building and training the model.

    Example::

        with eager_cuda_graphs() as graphs:
            setup = build(Run(gtp=2, graph_scope="full"))
            train_built(setup, run)
        assert graphs.replays > 0
    """
    import megatron.core.transformer.cuda_graphs as megatron_graphs
    from megatron.core.tensor_parallel import random as mp_random

    stand_in = StandIn()
    replaced = {
        "CUDAGraph": _eager_graph_class(stand_in),
        "graph": lambda graph, pool=None, capture_error_mode=None: contextlib.nullcontext(),
        "synchronize": lambda *args, **kwargs: None,
        "graph_pool_handle": lambda: 0,
        "current_stream": lambda *args, **kwargs: None,
        "set_stream": lambda stream: None,
        "Stream": lambda *args, **kwargs: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda *args, **kwargs: defaultdict(int),
    }
    saved = {name: getattr(torch.cuda, name) for name in replaced}
    saved_rng_states = megatron_graphs.get_all_rng_states
    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    saved_flag = getattr(tracker, "is_inference_rng_tracker", None)
    for name, value in replaced.items():
        setattr(torch.cuda, name, value)
    megatron_graphs.get_all_rng_states = lambda: {}
    if tracker is not None:
        tracker.is_inference_rng_tracker = True  # megatron only checks it is capturable
    try:
        yield stand_in
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        megatron_graphs.get_all_rng_states = saved_rng_states
        if tracker is not None:
            tracker.is_inference_rng_tracker = saved_flag

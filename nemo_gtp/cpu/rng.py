"""The CPU RNG tracker of :mod:`nemo_gtp.cpu.compat` (patches ``cpu_rng_tracker`` and
``nemo_random_seed``): megatron's RNG tracker over CPU generator states, and the CPU
counterpart of megatron's ``model_parallel_cuda_manual_seed``.

Example::

    enable_cpu_compat()
    model_parallel_cpu_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from nemo_gtp.cpu.patching import PatchState

# Tracker names and seed offsets as used by megatron/core/tensor_parallel/random.py.
_DATA_PARALLEL_RNG = "data-parallel-rng"
_MODEL_PARALLEL_RNG = "model-parallel-rng"
_EXPERT_PARALLEL_RNG = "expert-parallel-rng"
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EXPERT_SEED_EP_STRIDE = 100


# --------------------------------------------------------------------------------------------
# The CPU RNG tracker (``cpu_rng_tracker``, ``nemo_random_seed``)
# --------------------------------------------------------------------------------------------


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """megatron ``CudaRNGStatesTracker`` that keeps and swaps CPU generator states.

    ``add(name, seed)`` records the state of ``torch.default_generator`` seeded with ``seed``;
    ``fork(name)`` swaps that state in for the block, stores the advanced state on exit and
    puts the caller's CPU state back. ``reset``/``get_states``/``set_states`` are megatron's.
    """

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name: str, seed: int) -> None:
        """Track a CPU generator state seeded with ``seed`` under ``name``."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cpu rng state {name} already exists")
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()
        generator.set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the CPU generator state tracked as ``name``."""
        if name not in self.states_:
            raise Exception(f"cpu rng state {name} is not added")
        generator = torch.default_generator
        saved = generator.get_state()
        generator.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = generator.get_state()
            generator.set_state(saved)


def model_parallel_cpu_manual_seed(
    seed: int,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
) -> None:
    """CPU counterpart of megatron's ``model_parallel_cuda_manual_seed``.

    Same scheme as megatron-core 0.15.3: the default generator (here the CPU one, there the
    CUDA one) and the ``data-parallel-rng`` state get ``seed``; ``model-parallel-rng`` gets
    ``seed + 2718 + tp_rank``; ``expert-parallel-rng`` gets
    ``seed + 1024 + 100 * ep_rank + etp_rank``. Ranks default to megatron's parallel_state.
    Resets the installed :class:`CpuRNGStatesTracker`; needs :func:`enable_cpu_compat` first.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    if "cpu_rng_tracker" not in PatchState.active or not isinstance(tracker, CpuRNGStatesTracker):
        raise RuntimeError(
            "model_parallel_cpu_manual_seed needs the CPU RNG tracker: call "
            "nemo_gtp.cpu.compat.enable_cpu_compat() first"
        )
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tensor_model_parallel_seed = seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank
    data_parallel_seed = seed
    expert_parallel_seed = seed + _EXPERT_SEED_OFFSET + _EXPERT_SEED_EP_STRIDE * ep_rank + etp_rank

    tracker.reset()
    torch.default_generator.manual_seed(data_parallel_seed)
    tracker.add(_DATA_PARALLEL_RNG, data_parallel_seed)
    tracker.add(_MODEL_PARALLEL_RNG, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG, expert_parallel_seed)


def redirected_model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """Replacement for megatron's ``model_parallel_cuda_manual_seed`` while compat is on."""
    if te_rng_tracker or inference_rng_tracker or use_cudagraphable_rng:
        raise NotImplementedError(
            "cpu_compat: the TE, inference and CUDA-graph RNG trackers have no CPU version"
        )
    model_parallel_cpu_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)

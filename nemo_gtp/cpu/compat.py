"""Opt-in CPU (gloo) compatibility patches for megatron-core 0.15.3 and NeMo 2.7.3.

What it is for
--------------
Only for the tests and the CPU recipes (``cpu_compat: true``, e.g. the README's main job).
megatron-core and NeMo assume a CUDA device in a handful of places. This module patches exactly
those places so that these run on a CPU-only torch with the gloo backend: megatron's
``GPTModel`` (local layer spec), megatron's ``DistributedDataParallel``,
``get_megatron_optimizer`` (including the distributed optimizer and gradient clipping), the
``forward_backward_no_pipelining`` schedule, and NeMo's ``MegatronStrategy`` with
``nl.Trainer(accelerator="cpu")``. Nothing here is meant for a GPU run.

How to switch it on
-------------------
Nothing is patched on import. Call :func:`enable_cpu_compat` (idempotent) and
:func:`disable_cpu_compat` (restores every original), or use the :func:`cpu_compat` context
manager. Enabling raises ``RuntimeError`` when ``torch.cuda.is_available()`` is True.
After ``parallel_state.initialize_model_parallel`` call :func:`model_parallel_cpu_manual_seed`
(the CPU counterpart of megatron's ``model_parallel_cuda_manual_seed``). With NeMo the seeding
happens inside the strategy (patch ``nemo_random_seed``). With NeMo's ``llm.GPTModel`` also pass
``GPTConfig(data_step_fn=cpu_gpt_data_step)`` (a function, not a patch: see the table). Also set
``TransformerConfig(use_cpu_initialization=True)``: megatron's default initializes weights on
the GPU (a setting, not a patch).

Patches (``all_patches()`` lists them, ``enabled_patches()`` lists the active ones)
-------------------------------------------------------------------------------------
Each patch is named by what it does; sites are package-relative. The NeMo ones are applied only
with ``enable_cpu_compat(nemo=True)`` (or ``None`` when NeMo imports).

==========================  ===================================================================
patch                       site -> fix
==========================  ===================================================================
cuda_stream_shims           nemo/lightning/megatron_parallel.py:MegatronParallel.
                            init_model_parallel (and mcore DDP's communication_stream)
                            -> torch.cuda.Stream/stream/current_stream/default_stream/
                            synchronize become no-op stand-ins
current_device_cpu          megatron/core/distributed/param_and_grad_buffer.py:
                            _ParamAndGradBuffer.__init__, utils.py:GlobalMemoryBuffer,
                            tensor_parallel/mappings.py -> torch.cuda.current_device()
                            returns torch.device("cpu") (megatron only uses it as device=)
optimizer_cuda_tensors      megatron/core/optimizer/optimizer.py:FP32Optimizer/
                            MixedPrecisionOptimizer.__init__ -> module-local ``torch``
                            whose factories map cuda devices to cpu
schedule_token_counter      megatron/core/pipeline_parallel/schedules.py:
                            forward_backward_no_pipelining -> same, total_num_tokens
cpu_rng_tracker             megatron/core/tensor_parallel/random.py:
                            _CUDA_RNG_STATE_TRACKER (forked by DotProductAttention) ->
                            CpuRNGStatesTracker installed; model_parallel_cuda_manual_seed
                            redirected to model_parallel_cpu_manual_seed
checkpoint_rng_states       megatron/core/tensor_parallel/random.py:_get_cuda_rng_state/
                            _set_cuda_rng_state (activation recompute) -> the CPU
                            generator's state
grad_norm_cuda_tensors      megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32/
                            count_zeros_fp32, megatron/core/utils.py:
                            local_multi_tensor_l2_norm -> module-local ``torch``
clip_grad_type_check        megatron/core/optimizer/clip_grads.py:
                            clip_grad_by_total_norm_fp32 (``.type()`` assert) -> runs
                            while Tensor.type() reports torch.cuda.* names (see below)
distopt_type_dispatch       megatron/core/optimizer/distrib_optimizer.py:
                            DistributedOptimizer.__init__ (incl. _build_model_and_main_
                            param_groups); optimizer.py:Float16OptimizerWithFloat16Params
                            (bf16/fp16) -> constructors run under CUDA names
pipeline_tied_embeddings_   megatron/core/models/common/language_module/language_module.py:
rejected                    LanguageModule.setup_embeddings_and_output_layer (PP > 1 with
                            tied embeddings: ``.cuda()``) -> ``NotImplementedError`` naming
                            ``pipeline_model_parallel_size`` and
                            ``share_embeddings_and_output_weights``
moe_router_gemm             megatron/core/transformer/moe/moe_utils.py:
                            RouterGatingLinearFunction (``te_general_gemm`` unbound without
                            TE: ``NameError``) -> the name bound to ``None`` (torch.mm path)
gloo_shared_device          torch/distributed/distributed_c10d.py:
                            _new_process_group_helper (a TCP device and its polling
                            thread per gloo group) -> one device per process
                            (``nemo_gtp.cpu.gloo_device``; time, not results)
checkpoint_results_queue    megatron/core/dist_checkpointing/strategies/filesystem_async.py:
                            _get_write_results_queue (a spawned manager process, which
                            imports torch at the first save) -> a forked one (time, not
                            results)
nemo_random_seed (NeMo)     nemo/lightning/megatron_init.py:_set_random_seed (skips the
                            tracker without GPUs) -> also seeds the CPU tracker
nemo_strategy_logging       nemo/lightning/pytorch/strategies/megatron_strategy.py:
(NeMo)                      MegatronStrategy.training_step/optimizer_step ->
                            module-local ``torch``: pin_memory dropped, .to("cuda") on cpu
nemo_sampler_logging        nemo/lightning/pytorch/plugins/data_sampler.py:
(NeMo)                      MegatronDataSampler.on_megatron_step_end -> same as
                            nemo_strategy_logging
nemo_checkpoint_io (NeMo)   nemo/lightning/io/pl.py:MegatronCheckpointIO.__init__ ->
                            ``parallel_load`` off (megatron's fully-parallel load moves
                            shards between ranks through CUDA tensors);
                            _fix_tensors_device (asserts CUDA is initialized) -> identity
nemo_lora_without_te        nemo/collections/llm/peft/lora.py:LoRA.transform (compares each
(NeMo)                      module's class with ``te.Linear``, which raises without TE),
                            peft/utils.py:HAVE_TE (isinstance on non-classes) -> ``te`` a
                            namespace whose ``Linear`` matches no module; ``HAVE_TE`` False
cpu_gpt_data_step           nemo/collections/llm/gpt/model/base.py:gpt_data_step
(function, not a patch)     (val.cuda()) -> :func:`cpu_gpt_data_step`
==========================  ===================================================================

Not here: NeMo's ``MockDataModule`` never emits an attention mask (it passes
``create_attention_mask`` into the dataset's ``seed`` slot), which
``nemo_gtp.data.synthetic.SyntheticGPTDataModule`` fixes. Not covered either:
pipeline/context/sequence parallelism, MoE's alltoall / flex token dispatchers (CUDA events;
the allgather dispatcher runs), asynchronous checkpoint save, the NeMo memory logging
(``log_memory_usage``).

Why a module-local ``torch`` instead of a ``TorchFunctionMode``
---------------------------------------------------------------
``optimizer_cuda_tensors``, ``schedule_token_counter``, ``grad_norm_cuda_tensors``,
``nemo_strategy_logging`` and ``nemo_sampler_logging`` fix hard-coded ``device="cuda"`` /
``pin_memory=True`` factory calls. Instead of a process-wide mode, the patch replaces the name
``torch`` in the globals of the one module that holds the call with a :class:`_CudaToCpuTorch`
stand-in. It forwards every
attribute to the real ``torch``, except the factory functions (``tensor``, ``zeros``, ...),
which map a cuda ``device=`` to cpu. A ``pin_memory=True`` request (NeMo's "stage a scalar to
the GPU" idiom) is dropped, and the result's ``.to("cuda")``/``.cuda()`` stay on the CPU.
Code outside those modules is not affected.

``clip_grad_type_check`` and ``distopt_type_dispatch`` fix code that dispatches on
``param.type() == "torch.cuda.FloatTensor"``. The patches wrap the
one function or constructor that does it. For the length of that call, ``torch.Tensor.type()``
with no arguments reports a CPU tensor under its ``torch.cuda.*`` name. That is a
process-wide change for the length of the call, so it is not thread-safe against other Python
threads calling ``Tensor.type()`` at that moment.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

__all__ = [
    "CpuRNGStatesTracker",
    "PatchInfo",
    "all_patches",
    "cpu_compat",
    "cpu_gpt_data_step",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "enabled_patches",
    "is_cpu_compat_enabled",
    "model_parallel_cpu_manual_seed",
]

_CPU = torch.device("cpu")
_MISSING = object()

# Tracker names and seed offsets as used by megatron/core/tensor_parallel/random.py.
_DATA_PARALLEL_RNG = "data-parallel-rng"
_MODEL_PARALLEL_RNG = "model-parallel-rng"
_EXPERT_PARALLEL_RNG = "expert-parallel-rng"
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EXPERT_SEED_EP_STRIDE = 100


# --------------------------------------------------------------------------------------------
# Patch bookkeeping
# --------------------------------------------------------------------------------------------


class _Patcher:
    """Records every attribute a patch replaces so that it can be put back."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, attr: str, value: Any) -> None:
        """Replace ``target.attr`` with ``value`` and remember the original."""
        original = vars(target).get(attr, _MISSING)
        self._undo.append((target, attr, original))
        setattr(target, attr, value)

    def undo(self) -> None:
        """Restore the originals in reverse order."""
        while self._undo:
            target, attr, original = self._undo.pop()
            if original is _MISSING:
                delattr(target, attr)
            else:
                setattr(target, attr, original)


@dataclass(frozen=True)
class PatchInfo:
    """One registered patch: its name (what it does), the code it patches, and whether it
    needs NeMo."""

    name: str
    site: str
    nemo: bool
    apply: Callable[[_Patcher], None]

    @property
    def summary(self) -> str:
        """First line of the patch function's docstring."""
        doc = self.apply.__doc__ or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


_REGISTRY: dict[str, PatchInfo] = {}


def _register(
    site: str, *, nemo: bool = False
) -> Callable[[Callable[[_Patcher], None]], Callable[[_Patcher], None]]:
    def decorator(fn: Callable[[_Patcher], None]) -> Callable[[_Patcher], None]:
        name = fn.__name__.removeprefix("_patch_")
        _REGISTRY[name] = PatchInfo(name=name, site=site, nemo=nemo, apply=fn)
        return fn

    return decorator


class _State:
    patcher: _Patcher | None = None
    active: list[str] = []


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def _host_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an int)
    to the CPU device; anything else is returned unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.split(":", 1)[0] == "cuda":
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _StagedHostTensor(torch.Tensor):
    """A CPU tensor that stays on the CPU when code asks to move it to CUDA.

    Returned in place of pinned staging tensors (``nemo_strategy_logging``,
    ``nemo_sampler_logging``) and used for batch tensors in :func:`cpu_gpt_data_step`.
    ``.cuda()``, ``.to("cuda")`` and ``.pin_memory()`` return a plain ``torch.Tensor`` on the
    CPU; every other operation returns plain tensors too, because ``__torch_function__`` is
    disabled for this subclass.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._plain()

    def pin_memory(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._plain()

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        args = tuple(
            _host_device(a) if isinstance(a, str | int | torch.device) else a for a in args
        )
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        return torch.Tensor.to(self._plain(), *args, **kwargs)


_FACTORY_NAMES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange")


def _host_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a torch factory function so that a CUDA ``device=`` becomes cpu and
    ``pin_memory=True`` yields a :class:`_StagedHostTensor` instead of pinned memory."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        staged = bool(kwargs.pop("pin_memory", False))
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        out = factory(*args, **kwargs)
        return out.as_subclass(_StagedHostTensor) if staged else out

    return wrapper


class _CudaToCpuTorch(types.ModuleType):
    """Stand-in for the ``torch`` module inside one patched module (the ``*_cuda_tensors``,
    ``schedule_token_counter`` and ``nemo_*_logging`` patches).

    Every attribute is forwarded to the real ``torch``; only the factory functions in
    ``_FACTORY_NAMES`` are wrapped by :func:`_host_factory`.
    """

    def __init__(self, patched_module: str) -> None:
        super().__init__("torch", f"torch as seen by {patched_module} (cpu_compat)")
        for name in _FACTORY_NAMES:
            setattr(self, name, _host_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_host_torch(patcher: _Patcher, module_name: str) -> None:
    """Replace the global name ``torch`` inside ``module_name`` with a
    :class:`_CudaToCpuTorch`."""
    module = importlib.import_module(module_name)
    if getattr(module, "torch", None) is not torch:
        raise RuntimeError(f"{module_name}.torch is not the torch module; cannot patch it")
    patcher.set(module, "torch", _CudaToCpuTorch(module_name))


_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _type_with_cuda_names(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type`` that reports a CPU tensor as ``torch.cuda.<X>Tensor`` when called with
    no arguments; any conversion call is passed through unchanged."""
    if dtype is not None or args or kwargs:
        return _ORIGINAL_TENSOR_TYPE(self, dtype, *args, **kwargs)
    name = _ORIGINAL_TENSOR_TYPE(self)
    if self.device.type == "cpu" and name.startswith("torch.") and name.count(".") == 1:
        return "torch.cuda." + name.removeprefix("torch.")
    return name


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """For the duration of the block, ``Tensor.type()`` reports CUDA type names
    (``clip_grad_type_check``, ``distopt_type_dispatch``)."""
    previous = torch.Tensor.__dict__.get("type", _MISSING)
    torch.Tensor.type = _type_with_cuda_names  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if previous is _MISSING:
            del torch.Tensor.type
        else:
            torch.Tensor.type = previous  # type: ignore[method-assign]


def _under_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that it runs inside :func:`_cuda_type_names`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


class _HostStream:
    """Stand-in for ``torch.cuda.Stream`` (``cuda_stream_shims``). CPU work is synchronous, so
    every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _host_stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    """Stand-in for ``torch.cuda.stream(s)`` (``cuda_stream_shims``): a null context."""
    return contextlib.nullcontext()


def _host_current_stream(device: Any = None) -> _HostStream:
    """Stand-in for ``torch.cuda.current_stream``/``default_stream`` (``cuda_stream_shims``)."""
    return _HostStream()


def _host_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` (``cuda_stream_shims``): nothing to wait for."""
    return None


def _host_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` (``current_device_cpu``): the CPU device."""
    return _CPU


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
    if "cpu_rng_tracker" not in _State.active or not isinstance(tracker, CpuRNGStatesTracker):
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


def _redirected_model_parallel_cuda_manual_seed(
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


# --------------------------------------------------------------------------------------------
# NeMo's data step on CPU (a function to pass, not a patch)
# --------------------------------------------------------------------------------------------


def _stage(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        return obj.as_subclass(_StagedHostTensor)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(_stage(v) for v in obj)
    return obj


class _StagingIterator:
    """Iterator wrapper whose batches' CPU tensors ignore ``.cuda()``."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner

    def __iter__(self) -> _StagingIterator:
        return self

    def __next__(self) -> Any:
        return _stage(next(self._inner))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def cpu_gpt_data_step(dataloader_iter: Iterator[Any], use_mtp: bool = False) -> dict[str, Any]:
    """NeMo's ``gpt_data_step`` for CPU runs.

    ``nemo/collections/llm/gpt/model/base.py:gpt_data_step`` calls ``val.cuda(non_blocking=True)``
    on every batch tensor. This runs NeMo's own function on an iterator whose batch tensors
    keep ``.cuda()`` on the CPU. Use it as ``llm.GPTConfig(..., data_step_fn=cpu_gpt_data_step)``.
    It does not need :func:`enable_cpu_compat`.
    """
    from nemo.collections.llm.gpt.model.base import gpt_data_step

    return gpt_data_step(_StagingIterator(dataloader_iter), use_mtp=use_mtp)


# --------------------------------------------------------------------------------------------
# The patches
# --------------------------------------------------------------------------------------------


@_register(
    "nemo/lightning/megatron_parallel.py:MegatronParallel.init_model_parallel; "
    "megatron/core/distributed/param_and_grad_buffer.py (communication_stream)",
)
def _patch_cuda_stream_shims(patcher: _Patcher) -> None:
    """``torch.cuda.Stream``/``stream``/``current_stream``/``default_stream``/``synchronize``
    become no-op stand-ins.

    NeMo's ``MegatronParallel.init_model_parallel`` runs ``init_ddp()`` inside
    ``with torch.cuda.stream(torch.cuda.Stream())`` even on CPU; megatron looks these names up
    as ``torch.cuda.<name>`` at call time, so the ``torch.cuda`` module attributes are patched.
    """
    patcher.set(torch.cuda, "Stream", _HostStream)
    patcher.set(torch.cuda, "stream", _host_stream_context)
    patcher.set(torch.cuda, "current_stream", _host_current_stream)
    patcher.set(torch.cuda, "default_stream", _host_current_stream)
    patcher.set(torch.cuda, "synchronize", _host_synchronize)


@_register("torch/distributed/distributed_c10d.py:_new_process_group_helper (gloo devices)")
def _patch_gloo_shared_device(patcher: _Patcher) -> None:
    """Every gloo group made while enabled shares the process's one TCP device
    (:class:`~nemo_gtp.cpu.gloo_device.SharedDeviceGloo`): megatron's dozens of groups per
    layout otherwise keep a polling thread each, which ate half of a 2-core machine's CPU."""
    import torch.distributed.distributed_c10d as c10d

    from nemo_gtp.cpu.gloo_device import SharedDeviceGloo

    patcher.set(c10d, "ProcessGroupGloo", SharedDeviceGloo)


_results_queue: list[tuple[int, Any]] = []  # (pid, queue): this process's forked manager


def _exit_with(parent: int) -> None:
    """In the forked manager: exit once ``parent`` is gone. A rank killed mid-run would
    otherwise leave its manager behind, holding the rank's gloo sockets it inherited (its peers
    would never see the connection close)."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-rank", daemon=True).start()


def _forked_write_results_queue() -> Any:
    """megatron's checkpoint write-results queue, served by a manager *forked* from this
    process (one per process, made at its first save; it exits with the process)."""
    import multiprocessing
    import os
    from multiprocessing.managers import SyncManager

    if not _results_queue or _results_queue[0][0] != os.getpid():
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(_exit_with, (os.getpid(),))
        _results_queue[:] = [(os.getpid(), manager.Queue())]
    return _results_queue[0][1]


@_register(
    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:_get_write_results_queue"
)
def _patch_checkpoint_results_queue(patcher: _Patcher) -> None:
    """The queue a ``torch_dist`` save collects its write results in comes from a forked
    manager, not a spawned one: a spawned manager starts a fresh interpreter that imports torch
    to unpickle the first results (~9 s per rank at its first save on a 2-core machine, 4 ranks
    at once); a forked one has torch already (time, not results: the same files are written).
    megatron forks its writer processes from the same rank the same way."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    patcher.set(filesystem_async, "_get_write_results_queue", _forked_write_results_queue)


@_register(
    "megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBuffer.__init__, "
    "megatron/core/utils.py:GlobalMemoryBuffer.get_tensor, tensor_parallel/mappings.py",
)
def _patch_current_device_cpu(patcher: _Patcher) -> None:
    """``torch.cuda.current_device()`` returns ``torch.device("cpu")``.

    Megatron allocates the DDP grad/param buffers, the global memory buffer and the TP
    collective outputs with ``device=torch.cuda.current_device()`` (looked up on
    ``torch.cuda`` at call time). Megatron only passes the result on as a device (or prints
    it), so a ``torch.device`` works where an int index is expected on GPU.
    """
    patcher.set(torch.cuda, "current_device", _host_current_device)


def _all_gather_bytes(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``all_gather_into_tensor`` of the tensors' bytes (contiguous tensors: the same result)."""
    return torch.distributed.all_gather_into_tensor(
        output.view(torch.uint8), input.view(torch.uint8), *args, **kwargs
    )


@_register(
    "megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
    "start_param_sync (mixed-dtype coalesced all-gather)"
)
def _patch_param_gather_bytes(patcher: _Patcher) -> None:
    """The distributed optimizer's param all-gather moves bytes.

    With FP8 params megatron puts a ``uint8`` bucket and a training-dtype bucket in one bucket
    group and all-gathers them inside one ``_coalescing_manager``; gloo's coalesced
    ``all_gather_into_tensor`` assumes one dtype for the whole batch and corrupts both outputs
    (NCCL runs each op with its own dtype). Gathering every bucket as ``uint8`` views gives the
    same bytes for any dtype (contiguous 1-D buffer and shard views).
    """
    from megatron.core.distributed import param_and_grad_buffer

    patcher.set(param_and_grad_buffer, "dist_all_gather_func", _all_gather_bytes)


@_register("megatron/core/optimizer/optimizer.py:FP32Optimizer/MixedPrecisionOptimizer")
def _patch_optimizer_cuda_tensors(patcher: _Patcher) -> None:
    """Hard-coded ``device='cuda'`` tensors in the optimizer constructors.

    ``FP32Optimizer.__init__`` (``self._scale``) and ``MixedPrecisionOptimizer.__init__``
    (``found_inf``, ``_dummy_overflow_buf``, ``_scale_one``) in
    ``megatron.core.optimizer.optimizer``; that module's ``torch`` becomes a
    :class:`_CudaToCpuTorch`.
    """
    _install_host_torch(patcher, "megatron.core.optimizer.optimizer")


@_register("megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining")
def _patch_schedule_token_counter(patcher: _Patcher) -> None:
    """``total_num_tokens = torch.zeros([], device="cuda")`` in the schedules.

    Site: ``megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining`` (and the
    pipelined schedules, same line); that module's ``torch`` becomes a :class:`_CudaToCpuTorch`.
    """
    _install_host_torch(patcher, "megatron.core.pipeline_parallel.schedules")


@_register(
    "megatron/core/tensor_parallel/random.py:_CUDA_RNG_STATE_TRACKER, "
    "model_parallel_cuda_manual_seed (fork() from DotProductAttention.forward)",
)
def _patch_cpu_rng_tracker(patcher: _Patcher) -> None:
    """Install :class:`CpuRNGStatesTracker` as megatron's RNG tracker.

    ``DotProductAttention.forward`` forks ``model-parallel-rng`` around attention dropout;
    megatron's tracker keeps CUDA generator states. The patch sets
    ``megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER`` (read at call time by
    ``get_cuda_rng_tracker``) and ``_CUDA_RNG_STATE_TRACKER_INITIALIZED``, and points
    ``model_parallel_cuda_manual_seed`` (in ``tensor_parallel.random`` and its re-export in
    ``megatron.core.tensor_parallel``) at the CPU seeding. Seed with
    :func:`model_parallel_cpu_manual_seed`.
    """
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    patcher.set(mp_random, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker())
    patcher.set(mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    for module in (mp_random, tensor_parallel):
        patcher.set(
            module, "model_parallel_cuda_manual_seed", _redirected_model_parallel_cuda_manual_seed
        )


@_register("megatron/core/tensor_parallel/random.py:_get_cuda_rng_state/_set_cuda_rng_state")
def _patch_checkpoint_rng_states(patcher: _Patcher) -> None:
    """Activation recompute saves and restores the CPU generator where it would the CUDA one.

    megatron's ``CheckpointFunction`` (``recompute_granularity="full"``) and
    ``CheckpointWithoutOutput`` record every RNG state before the first forward and restore them
    for the recomputed one through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, read at
    call time from the module. On CPU the state that matters is the default CPU generator's (the
    tracker's states travel separately), so both functions map to it.
    """
    from megatron.core.tensor_parallel import random as mp_random

    patcher.set(mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    patcher.set(
        mp_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)
    )


@_register(
    "megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32/count_zeros_fp32, "
    "megatron/core/utils.py:local_multi_tensor_l2_norm",
)
def _patch_grad_norm_cuda_tensors(patcher: _Patcher) -> None:
    """Hard-coded ``device='cuda'`` tensors in the grad-norm path (every step).

    ``get_grad_norm_fp32`` (``dummy_overflow_buf``, ``total_norm_cuda``, ``grad_norm``) and
    ``count_zeros_fp32`` in ``megatron.core.optimizer.clip_grads``, and
    ``local_multi_tensor_l2_norm`` in ``megatron.core.utils`` (the fallback without apex/TE);
    both modules' ``torch`` become :class:`_CudaToCpuTorch` instances.
    """
    _install_host_torch(patcher, "megatron.core.optimizer.clip_grads")
    _install_host_torch(patcher, "megatron.core.utils")


@_register("megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32 (.type() assert)")
def _patch_clip_grad_type_check(patcher: _Patcher) -> None:
    """``assert param.grad.type() == 'torch.cuda.FloatTensor'`` when ``clip_grad > 0``.

    ``clip_grad_by_total_norm_fp32`` is wrapped so that it runs under CUDA type names. Callers
    look it up as ``megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32`` (imported
    name, used by ``MegatronOptimizer.clip_grad_norm``/``ChainedOptimizer``); the definition in
    ``clip_grads`` is replaced too. Its ``device='cuda'`` buffer is covered by
    ``grad_norm_cuda_tensors``.
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    wrapped = _under_cuda_type_names(original)
    patcher.set(clip_grads, "clip_grad_by_total_norm_fp32", wrapped)
    patcher.set(mcore_optimizer, "clip_grad_by_total_norm_fp32", wrapped)


@_register(
    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.__init__ "
    "(_build_model_and_main_param_groups), optimizer.py:Float16OptimizerWithFloat16Params",
)
def _patch_distopt_type_dispatch(patcher: _Patcher) -> None:
    """The optimizers dispatch on ``param.type()`` (``'torch.cuda.FloatTensor'`` ...).

    ``DistributedOptimizer.__init__`` (directly and through the static
    ``_build_model_and_main_param_groups``) raises ``TypeError`` for ``torch.FloatTensor``;
    ``Float16OptimizerWithFloat16Params.__init__`` has the same check (bf16/fp16 only, not
    exercised by the tests). Both constructors run under CUDA type names.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for cls in (
        distrib_optimizer.DistributedOptimizer,
        mcore_optimizer.Float16OptimizerWithFloat16Params,
    ):
        patcher.set(cls, "__init__", _under_cuda_type_names(cls.__dict__["__init__"]))


@_register(
    "megatron/core/models/common/language_module/language_module.py:LanguageModule."
    "setup_embeddings_and_output_layer (.cuda() of the tied embedding under PP)"
)
def _patch_pipeline_tied_embeddings_rejected(patcher: _Patcher) -> None:
    """Pipeline parallelism with tied input/output embeddings: rejected with a clear error.

    With ``pipeline_model_parallel_size > 1`` and ``share_embeddings_and_output_weights=True``
    megatron copies the embedding to the last stage through ``weight.data.cuda()`` and an
    all-reduce; on a CPU-only torch that dies inside torch's CUDA init. This names the two
    settings instead (a check, not a CPU port: the embedding-grad all-reduce is CUDA-bound too).
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.__dict__["setup_embeddings_and_output_layer"]

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        pp = self.config.pipeline_model_parallel_size  # what megatron's method branches on
        if self.share_embeddings_and_output_weights and pp > 1:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={pp} with share_embeddings_and_output_weights=True"
                " does not run on CPU (megatron moves the tied embedding to CUDA to copy it to "
                "the last pipeline stage): set share_embeddings_and_output_weights=False or "
                "pipeline_model_parallel_size=1"
            )
        original(self)

    name = "setup_embeddings_and_output_layer"
    patcher.set(LanguageModule, name, setup_embeddings_and_output_layer)


@_register("megatron/core/transformer/moe/moe_utils.py:RouterGatingLinearFunction")
def _patch_moe_router_gemm(patcher: _Patcher) -> None:
    """The MoE router's gating GEMM names ``te_general_gemm``, unbound without TE.

    ``RouterGatingLinearFunction.forward/backward`` test ``te_general_gemm is not None``, but
    ``moe_utils`` binds that name only when its TE import succeeds, so without TE every MoE
    forward raises ``NameError``. The patch binds it to ``None``: the function's own
    ``torch.mm`` fallback runs.
    """
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        patcher.set(moe_utils, "te_general_gemm", None)


@_register(
    "nemo/lightning/megatron_init.py:_set_random_seed (called by "
    "initialize_model_parallel_for_nemo)",
    nemo=True,
)
def _patch_nemo_random_seed(patcher: _Patcher) -> None:
    """Seed the CPU RNG tracker where NeMo seeds megatron.

    ``nemo.lightning.megatron_init._set_random_seed`` calls ``model_parallel_cuda_manual_seed``
    only ``if torch.cuda.device_count() > 0``, so on CPU the tracker is never seeded and
    ``DotProductAttention`` fails with "rng state model-parallel-rng is not added". The wrapper
    runs NeMo's function, then :func:`model_parallel_cpu_manual_seed` with NeMo's seed
    (``seed + 100 * pipeline rank``). ``initialize_model_parallel_for_nemo`` looks the name up
    in its module globals, so the module attribute is patched.
    """
    from megatron.core import parallel_state
    from nemo.lightning import megatron_init

    original = megatron_init._set_random_seed

    @functools.wraps(original)
    def _set_random_seed(seed_: int) -> None:
        original(seed_)
        seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
        model_parallel_cpu_manual_seed(seed)

    patcher.set(megatron_init, "_set_random_seed", _set_random_seed)


@_register(
    "nemo/lightning/pytorch/strategies/megatron_strategy.py:"
    "MegatronStrategy.training_step/optimizer_step",
    nemo=True,
)
def _patch_nemo_strategy_logging(patcher: _Patcher) -> None:
    """``torch.tensor(x, pin_memory=True).to("cuda", non_blocking=True)`` before logging.

    ``MegatronStrategy.training_step`` (global_step, reduced_train_loss) and
    ``optimizer_step`` (grad_norm, num_zeros_in_grad); the module's ``torch`` becomes a
    :class:`_CudaToCpuTorch`, so the value is logged as a CPU tensor.
    """
    _install_host_torch(patcher, "nemo.lightning.pytorch.strategies.megatron_strategy")


@_register(
    "nemo/lightning/pytorch/plugins/data_sampler.py:MegatronDataSampler.on_megatron_step_end",
    nemo=True,
)
def _patch_nemo_sampler_logging(patcher: _Patcher) -> None:
    """Same idiom as ``nemo_strategy_logging`` for consumed_samples and global_batch_size.

    Site: ``MegatronDataSampler.on_megatron_step_end``; the module's ``torch`` becomes a
    :class:`_CudaToCpuTorch`.
    """
    _install_host_torch(patcher, "nemo.lightning.pytorch.plugins.data_sampler")


@_register(
    "nemo/lightning/io/pl.py:MegatronCheckpointIO.__init__, _fix_tensors_device",
    nemo=True,
)
def _patch_nemo_checkpoint_io(patcher: _Patcher) -> None:
    """NeMo's checkpoint load assumes CUDA twice.

    - The default ``ckpt_parallel_load=True`` wraps megatron's load in
      ``FullyParallelLoadStrategyWrapper``, whose shard exchange
      (``dist_checkpointing/exchange_utils.py``) allocates and moves every shard with
      ``device="cuda"`` / ``.cuda()``. On CPU every rank reads its own shards instead (the
      result is the same; only who reads which file changes).
    - ``_fix_tensors_device`` (moves loaded CUDA tensors to the current device) asserts
      ``torch.cuda.is_initialized()``; with only CPU tensors it has nothing to do.
    """
    from nemo.lightning.io import pl as nemo_io

    cls = nemo_io.MegatronCheckpointIO
    original = cls.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.parallel_load = False

    patcher.set(cls, "__init__", __init__)
    patcher.set(nemo_io, "_fix_tensors_device", lambda checkpoint: checkpoint)


@_register("nemo/collections/llm/peft/lora.py:LoRA.transform (te.Linear without TE)", nemo=True)
def _patch_nemo_lora_without_te(patcher: _Patcher) -> None:
    """NeMo's LoRA compares every target module's class with ``te.Linear``, which raises
    ``UnavailableError`` where TransformerEngine is missing -> ``te`` is a namespace whose
    ``Linear`` no module is, and the adapter helpers' ``HAVE_TE`` is False (megatron's linears
    get NeMo's ``LoRALinear`` adapters, as on GPUs with the local spec). Nothing changes where
    TE imports."""
    import types

    from nemo.collections.llm.peft import lora, utils

    if not lora.HAVE_TE:
        patcher.set(lora, "te", types.SimpleNamespace(Linear=type("NoTELinear", (), {})))
    # peft/utils.py's HAVE_TE only asks whether megatron's TE wrapper names import, and without
    # TE some are not classes: its isinstance checks on them raise
    if not all(isinstance(cls, type) for cls in (*utils.TECL, *utils.TERL)):
        patcher.set(utils, "HAVE_TE", False)


# --------------------------------------------------------------------------------------------
# Public switch
# --------------------------------------------------------------------------------------------


def all_patches() -> tuple[PatchInfo, ...]:
    """Every registered patch, in the order :func:`enable_cpu_compat` applies them."""
    return tuple(_REGISTRY.values())


def enabled_patches() -> tuple[str, ...]:
    """Names of the patches that are active now (empty when compat is off)."""
    return tuple(_State.active)


def is_cpu_compat_enabled() -> bool:
    """Whether :func:`enable_cpu_compat` is in effect."""
    return _State.patcher is not None


def _nemo_usable() -> bool:
    """Whether NeMo's lightning package imports (for ``enable_cpu_compat(nemo=None)``)."""
    if importlib.util.find_spec("nemo") is None:
        return False
    try:
        importlib.import_module("nemo.lightning")
    except ImportError as exc:
        warnings.warn(
            f"nemo_gtp.cpu.compat: NeMo is installed but nemo.lightning does not import "
            f"({exc}); skipping the NeMo patches",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def enable_cpu_compat(*, nemo: bool | None = None) -> None:
    """Apply the CPU patches (idempotent; a later call only adds patches not yet active).

    Args:
        nemo: also apply the NeMo patches (``nemo_random_seed``, ``nemo_strategy_logging``,
            ``nemo_sampler_logging``, ``nemo_checkpoint_io``). ``None`` (default)
            applies them when ``nemo.lightning`` imports (a few seconds when NeMo is not yet
            imported; a warning if it is installed but broken); ``True`` requires them;
            ``False`` skips them (a megatron-only run).

    Raises:
        RuntimeError: when CUDA is available. These patches are never active with CUDA.
        ImportError: ``nemo=True`` and NeMo does not import. If any patch fails, every patch
            is undone before the error propagates.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "nemo_gtp.cpu.compat is for CPU-only runs (tests, CPU demo), but "
            "torch.cuda.is_available() is True; refusing to patch CUDA code paths"
        )
    pending = [info for info in _REGISTRY.values() if info.name not in _State.active]
    if any(info.nemo for info in pending) and (
        nemo is False or (nemo is None and not _nemo_usable())
    ):
        pending = [info for info in pending if not info.nemo]
    if _State.patcher is None:
        _State.patcher = _Patcher()
        _State.active = []
    patcher = _State.patcher
    try:
        for info in pending:
            info.apply(patcher)
            _State.active.append(info.name)
    except BaseException:
        disable_cpu_compat()
        raise


def disable_cpu_compat() -> None:
    """Undo every patch and restore the originals (no-op when compat is off)."""
    patcher = _State.patcher
    if patcher is None:
        return
    patcher.undo()
    _State.patcher = None
    _State.active = []


@contextlib.contextmanager
def cpu_compat(*, nemo: bool | None = None) -> Iterator[None]:
    """Context manager: :func:`enable_cpu_compat` on entry; on exit :func:`disable_cpu_compat`,
    unless compat was already enabled on entry (then the outer owner keeps it on)."""
    was_enabled = is_cpu_compat_enabled()
    enable_cpu_compat(nemo=nemo)
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_compat()

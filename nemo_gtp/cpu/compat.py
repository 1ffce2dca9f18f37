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
fusions_off                 megatron/core/transformer/transformer_config.py:
                            TransformerConfig.__post_init__ (raises for fused kernels that
                            need TE / Apex / CUDA, e.g. the configs NeMo's HF importers build)
                            -> every fusion off first (the same maths, unfused)
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
nemo_mock_data_mask (NeMo)  nemo/collections/llm/gpt/data/mock.py:MockDataModule.setup
                            (``create_attention_mask`` passed as the dataset's ``seed``:
                            no mask) -> both passed by keyword (recipes' mock data on CPU)
cpu_gpt_data_step           nemo/collections/llm/gpt/model/base.py:gpt_data_step
(function, not a patch)     (val.cuda()) -> :func:`cpu_gpt_data_step`
==========================  ===================================================================

``nemo_gtp.data.synthetic.SyntheticGPTDataModule`` fixes NeMo's ``MockDataModule`` in its own
class, for the harnesses that build their data module. Not covered:
pipeline/context/sequence parallelism, MoE's alltoall / flex token dispatchers (CUDA events;
the allgather dispatcher runs), asynchronous checkpoint save, the NeMo memory logging
(``log_memory_usage``).

Why a module-local ``torch`` instead of a ``TorchFunctionMode``
---------------------------------------------------------------
``optimizer_cuda_tensors``, ``schedule_token_counter``, ``grad_norm_cuda_tensors``,
``nemo_strategy_logging`` and ``nemo_sampler_logging`` fix hard-coded ``device="cuda"`` /
``pin_memory=True`` factory calls. Instead of a process-wide mode, the patch replaces the name
``torch`` in the globals of the one module that holds the call with a stand-in,
:class:`~nemo_gtp.cpu.patching.CudaToCpuTorch`. It forwards every attribute to the real
``torch``, except the factory functions (``tensor``, ``zeros``, ...), which map a cuda
``device=`` to cpu. A ``pin_memory=True`` request (NeMo's "stage a scalar to the GPU" idiom) is
dropped, and the result's ``.to("cuda")``/``.cuda()`` stay on the CPU.
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
import importlib
import importlib.util
import warnings
from collections.abc import Iterator

import torch

# The patch families register themselves on import, in the order enable_cpu_compat applies
# them: megatron-core's (and torch's), then NeMo's.
from nemo_gtp.cpu import megatron_patches as _megatron_patches  # noqa: F401
from nemo_gtp.cpu import nemo_patches as _nemo_patches  # noqa: F401
from nemo_gtp.cpu.nemo_patches import cpu_gpt_data_step
from nemo_gtp.cpu.patching import REGISTRY, Patcher, PatchInfo, PatchState
from nemo_gtp.cpu.rng import CpuRNGStatesTracker, model_parallel_cpu_manual_seed

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


def all_patches() -> tuple[PatchInfo, ...]:
    """Every registered patch, in the order :func:`enable_cpu_compat` applies them."""
    return tuple(REGISTRY.values())


def enabled_patches() -> tuple[str, ...]:
    """Names of the patches that are active now (empty when compat is off)."""
    return tuple(PatchState.active)


def is_cpu_compat_enabled() -> bool:
    """Whether :func:`enable_cpu_compat` is in effect."""
    return PatchState.patcher is not None


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
    pending = [info for info in REGISTRY.values() if info.name not in PatchState.active]
    if any(info.nemo for info in pending) and (
        nemo is False or (nemo is None and not _nemo_usable())
    ):
        pending = [info for info in pending if not info.nemo]
    if PatchState.patcher is None:
        PatchState.patcher = Patcher()
        PatchState.active = []
    patcher = PatchState.patcher
    try:
        for info in pending:
            info.apply(patcher)
            PatchState.active.append(info.name)
    except BaseException:
        disable_cpu_compat()
        raise


def disable_cpu_compat() -> None:
    """Undo every patch and restore the originals (no-op when compat is off)."""
    patcher = PatchState.patcher
    if patcher is None:
        return
    patcher.undo()
    PatchState.patcher = None
    PatchState.active = []


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

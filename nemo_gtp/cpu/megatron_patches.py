"""The megatron-core (and torch) patch family of :mod:`nemo_gtp.cpu.compat`, with the
checkpoint writer's results queue: each ``_patch_*`` function registers itself (the table in
:mod:`nemo_gtp.cpu.compat` lists them) and is applied by ``enable_cpu_compat()``.

Example::

    enable_cpu_compat(nemo=False)   # these patches only: a megatron-core run without NeMo
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from nemo_gtp.cpu.fusions import FUSIONS
from nemo_gtp.cpu.patching import (
    HostStream,
    Patcher,
    host_current_device,
    host_current_stream,
    host_stream_context,
    host_synchronize,
    install_host_torch,
    register,
    under_cuda_type_names,
)
from nemo_gtp.cpu.rng import CpuRNGStatesTracker, redirected_model_parallel_cuda_manual_seed

# --------------------------------------------------------------------------------------------
# The patches
# --------------------------------------------------------------------------------------------


@register(
    "nemo/lightning/megatron_parallel.py:MegatronParallel.init_model_parallel; "
    "megatron/core/distributed/param_and_grad_buffer.py (communication_stream)",
)
def _patch_cuda_stream_shims(patcher: Patcher) -> None:
    """``torch.cuda.Stream``/``stream``/``current_stream``/``default_stream``/``synchronize``
    become no-op stand-ins.

    NeMo's ``MegatronParallel.init_model_parallel`` runs ``init_ddp()`` inside
    ``with torch.cuda.stream(torch.cuda.Stream())`` even on CPU; megatron looks these names up
    as ``torch.cuda.<name>`` at call time, so the ``torch.cuda`` module attributes are patched.
    """
    patcher.set(torch.cuda, "Stream", HostStream)
    patcher.set(torch.cuda, "stream", host_stream_context)
    patcher.set(torch.cuda, "current_stream", host_current_stream)
    patcher.set(torch.cuda, "default_stream", host_current_stream)
    patcher.set(torch.cuda, "synchronize", host_synchronize)


@register("torch/distributed/distributed_c10d.py:_new_process_group_helper (gloo devices)")
def _patch_gloo_shared_device(patcher: Patcher) -> None:
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


@register(
    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:_get_write_results_queue"
)
def _patch_checkpoint_results_queue(patcher: Patcher) -> None:
    """The queue a ``torch_dist`` save collects its write results in comes from a forked
    manager, not a spawned one: a spawned manager starts a fresh interpreter that imports torch
    to unpickle the first results (~9 s per rank at its first save on a 2-core machine, 4 ranks
    at once); a forked one has torch already (time, not results: the same files are written).
    megatron forks its writer processes from the same rank the same way."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    patcher.set(filesystem_async, "_get_write_results_queue", _forked_write_results_queue)


@register(
    "megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBuffer.__init__, "
    "megatron/core/utils.py:GlobalMemoryBuffer.get_tensor, tensor_parallel/mappings.py",
)
def _patch_current_device_cpu(patcher: Patcher) -> None:
    """``torch.cuda.current_device()`` returns ``torch.device("cpu")``.

    Megatron allocates the DDP grad/param buffers, the global memory buffer and the TP
    collective outputs with ``device=torch.cuda.current_device()`` (looked up on
    ``torch.cuda`` at call time). Megatron only passes the result on as a device (or prints
    it), so a ``torch.device`` works where an int index is expected on GPU.
    """
    patcher.set(torch.cuda, "current_device", host_current_device)


def _all_gather_bytes(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``all_gather_into_tensor`` of the tensors' bytes (contiguous tensors: the same result)."""
    return torch.distributed.all_gather_into_tensor(
        output.view(torch.uint8), input.view(torch.uint8), *args, **kwargs
    )


@register(
    "megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
    "start_param_sync (mixed-dtype coalesced all-gather)"
)
def _patch_param_gather_bytes(patcher: Patcher) -> None:
    """The distributed optimizer's param all-gather moves bytes.

    With FP8 params megatron puts a ``uint8`` bucket and a training-dtype bucket in one bucket
    group and all-gathers them inside one ``_coalescing_manager``; gloo's coalesced
    ``all_gather_into_tensor`` assumes one dtype for the whole batch and corrupts both outputs
    (NCCL runs each op with its own dtype). Gathering every bucket as ``uint8`` views gives the
    same bytes for any dtype (contiguous 1-D buffer and shard views).
    """
    from megatron.core.distributed import param_and_grad_buffer

    patcher.set(param_and_grad_buffer, "dist_all_gather_func", _all_gather_bytes)


@register("megatron/core/optimizer/optimizer.py:FP32Optimizer/MixedPrecisionOptimizer")
def _patch_optimizer_cuda_tensors(patcher: Patcher) -> None:
    """Hard-coded ``device='cuda'`` tensors in the optimizer constructors.

    ``FP32Optimizer.__init__`` (``self._scale``) and ``MixedPrecisionOptimizer.__init__``
    (``found_inf``, ``_dummy_overflow_buf``, ``_scale_one``) in
    ``megatron.core.optimizer.optimizer``; that module's ``torch`` becomes a
    :class:`CudaToCpuTorch`.
    """
    install_host_torch(patcher, "megatron.core.optimizer.optimizer")


@register("megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining")
def _patch_schedule_token_counter(patcher: Patcher) -> None:
    """``total_num_tokens = torch.zeros([], device="cuda")`` in the schedules.

    Site: ``megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining`` (and the
    pipelined schedules, same line); that module's ``torch`` becomes a :class:`CudaToCpuTorch`.
    """
    install_host_torch(patcher, "megatron.core.pipeline_parallel.schedules")


@register(
    "megatron/core/tensor_parallel/random.py:_CUDA_RNG_STATE_TRACKER, "
    "model_parallel_cuda_manual_seed (fork() from DotProductAttention.forward)",
)
def _patch_cpu_rng_tracker(patcher: Patcher) -> None:
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
            module, "model_parallel_cuda_manual_seed", redirected_model_parallel_cuda_manual_seed
        )


@register("megatron/core/tensor_parallel/random.py:_get_cuda_rng_state/_set_cuda_rng_state")
def _patch_checkpoint_rng_states(patcher: Patcher) -> None:
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


@register(
    "megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32/count_zeros_fp32, "
    "megatron/core/utils.py:local_multi_tensor_l2_norm",
)
def _patch_grad_norm_cuda_tensors(patcher: Patcher) -> None:
    """Hard-coded ``device='cuda'`` tensors in the grad-norm path (every step).

    ``get_grad_norm_fp32`` (``dummy_overflow_buf``, ``total_norm_cuda``, ``grad_norm``) and
    ``count_zeros_fp32`` in ``megatron.core.optimizer.clip_grads``, and
    ``local_multi_tensor_l2_norm`` in ``megatron.core.utils`` (the fallback without apex/TE);
    both modules' ``torch`` become :class:`CudaToCpuTorch` instances.
    """
    install_host_torch(patcher, "megatron.core.optimizer.clip_grads")
    install_host_torch(patcher, "megatron.core.utils")


@register("megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32 (.type() assert)")
def _patch_clip_grad_type_check(patcher: Patcher) -> None:
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
    wrapped = under_cuda_type_names(original)
    patcher.set(clip_grads, "clip_grad_by_total_norm_fp32", wrapped)
    patcher.set(mcore_optimizer, "clip_grad_by_total_norm_fp32", wrapped)


@register(
    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.__init__ "
    "(_build_model_and_main_param_groups), optimizer.py:Float16OptimizerWithFloat16Params",
)
def _patch_distopt_type_dispatch(patcher: Patcher) -> None:
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
        patcher.set(cls, "__init__", under_cuda_type_names(cls.__dict__["__init__"]))


@register(
    "megatron/core/models/common/language_module/language_module.py:LanguageModule."
    "setup_embeddings_and_output_layer (.cuda() of the tied embedding under PP)"
)
def _patch_pipeline_tied_embeddings_rejected(patcher: Patcher) -> None:
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


@register("megatron/core/transformer/moe/moe_utils.py:RouterGatingLinearFunction")
def _patch_moe_router_gemm(patcher: Patcher) -> None:
    """The MoE router's gating GEMM names ``te_general_gemm``, unbound without TE.

    ``RouterGatingLinearFunction.forward/backward`` test ``te_general_gemm is not None``, but
    ``moe_utils`` binds that name only when its TE import succeeds, so without TE every MoE
    forward raises ``NameError``. The patch binds it to ``None``: the function's own
    ``torch.mm`` fallback runs.
    """
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        patcher.set(moe_utils, "te_general_gemm", None)


# The fused kernels a megatron config may ask for; none exists on CPU (nemo_gtp.cpu.fusions).
CPU_UNAVAILABLE_FUSIONS = FUSIONS


@register("megatron/core/transformer/transformer_config.py:TransformerConfig.__post_init__")
def _patch_fusions_off(patcher: Patcher) -> None:
    """Configs built by NeMo itself ask for fused kernels that do not exist on CPU.

    NeMo's Hugging Face importers (``llm.import_ckpt``) build the model config from the HF
    config with the family's defaults (Llama's ``apply_rope_fusion=True``), and megatron's
    ``__post_init__`` raises without TE ("apply_rope_fusion is not available"). A recipe can
    turn them off (``nemo_gtp.recipes.cpu.on_cpu`` does); a config NeMo builds internally
    cannot. The patch turns every fusion of :data:`CPU_UNAVAILABLE_FUSIONS` off before
    megatron's checks: the same maths, unfused.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__dict__["__post_init__"]

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        for name in CPU_UNAVAILABLE_FUSIONS:
            if getattr(self, name, False):
                setattr(self, name, False)
        original(self)

    patcher.set(TransformerConfig, "__post_init__", __post_init__)

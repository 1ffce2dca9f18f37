"""The NeMo patch family of :mod:`nemo_gtp.cpu.compat` (applied with
``enable_cpu_compat(nemo=True)``, or ``None`` when NeMo imports), and NeMo's data step on CPU,
:func:`cpu_gpt_data_step` (a function to pass, not a patch).

Example::

    config = llm.GPTConfig(..., data_step_fn=cpu_gpt_data_step)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from nemo_gtp.cpu.patching import Patcher, StagedHostTensor, install_host_torch, register
from nemo_gtp.cpu.rng import model_parallel_cpu_manual_seed

# --------------------------------------------------------------------------------------------
# NeMo's data step on CPU (a function to pass, not a patch)
# --------------------------------------------------------------------------------------------


def _stage(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        return obj.as_subclass(StagedHostTensor)
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


@register(
    "nemo/lightning/megatron_init.py:_set_random_seed (called by "
    "initialize_model_parallel_for_nemo)",
    nemo=True,
)
def _patch_nemo_random_seed(patcher: Patcher) -> None:
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


@register(
    "nemo/lightning/pytorch/strategies/megatron_strategy.py:"
    "MegatronStrategy.training_step/optimizer_step",
    nemo=True,
)
def _patch_nemo_strategy_logging(patcher: Patcher) -> None:
    """``torch.tensor(x, pin_memory=True).to("cuda", non_blocking=True)`` before logging.

    ``MegatronStrategy.training_step`` (global_step, reduced_train_loss) and
    ``optimizer_step`` (grad_norm, num_zeros_in_grad); the module's ``torch`` becomes a
    :class:`CudaToCpuTorch`, so the value is logged as a CPU tensor.
    """
    install_host_torch(patcher, "nemo.lightning.pytorch.strategies.megatron_strategy")


@register(
    "nemo/lightning/pytorch/plugins/data_sampler.py:MegatronDataSampler.on_megatron_step_end",
    nemo=True,
)
def _patch_nemo_sampler_logging(patcher: Patcher) -> None:
    """Same idiom as ``nemo_strategy_logging`` for consumed_samples and global_batch_size.

    Site: ``MegatronDataSampler.on_megatron_step_end``; the module's ``torch`` becomes a
    :class:`CudaToCpuTorch`.
    """
    install_host_torch(patcher, "nemo.lightning.pytorch.plugins.data_sampler")


@register(
    "nemo/lightning/io/pl.py:MegatronCheckpointIO.__init__, _fix_tensors_device",
    nemo=True,
)
def _patch_nemo_checkpoint_io(patcher: Patcher) -> None:
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


@register("nemo/collections/llm/peft/lora.py:LoRA.transform (te.Linear without TE)", nemo=True)
def _patch_nemo_lora_without_te(patcher: Patcher) -> None:
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


@register(
    "nemo/collections/llm/gpt/data/mock.py:MockDataModule.setup (create_attention_mask passed "
    "into the dataset's seed slot)",
    nemo=True,
)
def _patch_nemo_mock_data_mask(patcher: Patcher) -> None:
    """NeMo's ``MockDataModule.setup`` builds its datasets with ``create_attention_mask`` as the
    fifth positional argument, which is ``_MockGPTDataset``'s ``seed``: the samples never carry
    an attention mask (megatron's local attention needs one) and the seed is 0 or 1. The
    patched ``setup`` passes both by keyword (seed 42, the dataset's default): NeMo's recipes
    with mock data (``llm.*.pretrain_recipe``) run on CPU. On GPUs TE's attention needs no mask.
    """
    from nemo.collections.llm.gpt.data import mock

    def setup(self: Any, stage: str = "") -> None:
        for attr, split, samples in (
            ("_train_ds", "train", self.num_train_samples),
            ("_validation_ds", "valid", self.num_val_samples),
            ("_test_ds", "test", self.num_test_samples),
        ):
            dataset = mock._MockGPTDataset(
                self.tokenizer,
                split,
                samples,
                self.seq_length,
                create_attention_mask=self.create_attention_mask,
            )
            setattr(self, attr, dataset)

    patcher.set(mock.MockDataModule, "setup", setup)

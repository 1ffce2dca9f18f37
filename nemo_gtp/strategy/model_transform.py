"""The GTP model transform inside NeMo's model setup (design §1.5, §3.1; lifecycle in docs).

``MegatronParallel.init_model_parallel`` applies ``convert_module_fn`` (the precision plugin's
``convert_module``: bf16/fp16 ``Float16Module`` wrapping) to every model chunk right before
``init_ddp``. :func:`convert_then_shard` composes that function with :func:`shard_model`, so
the order is: model built by ``configure_model`` -> precision conversion (the shards get the
training dtype) -> GTP sharding (under megatron's ``fp8_param``: the shards made FP8 primary
weights, megatron's FP8-param functions routed to them; design §1.3 "FP8 primary weights") ->
DDP wrap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_gtp.engine import GTPConfig, GTPGroups, GTPRuntime, runtimes_of
from nemo_gtp.integrations.megatron import mirror_per_token_loss, shard_model
from nemo_gtp.integrations.megatron.fp8_primary import install_fp8_primary_hooks


def shard_model_chunk(
    chunk: torch.nn.Module, groups: GTPGroups, config: GTPConfig | None
) -> GTPRuntime | None:
    """Shard one NeMo model chunk (a LightningModule holding the megatron model as ``.module``).

    Idempotent: a chunk whose weights are already owned by a runtime keeps it (NeMo may run
    ``init_model_parallel`` again, e.g. PEFT's deferred setup). Linears built as their shard
    (TE wrappers from the rewritten layer spec) own no runtime yet: ``shard_model`` registers
    them. Under megatron's ``fp8_param`` ``shard_model`` makes the shards FP8 primary weights;
    megatron's FP8-param functions are then routed to them here, before DDP wraps the chunk
    (design §1.3 "The megatron hook"; the strategy checked DDP's settings at ``connect``).
    """
    module = getattr(chunk, "module", chunk)
    existing = runtimes_of(module)
    if existing:
        return existing[0]
    refuse_dora(module)
    # The strategy owns both configs, so the model's per-token-loss setting wins (the user need
    # not repeat it in GTPConfig); plain shard_model refuses a mismatch instead.
    config = mirror_per_token_loss(config, getattr(module, "config", None), adopt=True)
    runtime = shard_model(module, groups, config)
    if any(r.fp8_primary is not None for r in runtimes_of(module)):
        install_fp8_primary_hooks()
    return runtime


def refuse_dora(module: torch.nn.Module) -> None:
    """Refuse NeMo's DoRA (``llm.peft.DoRA``) under GTP, naming what to use instead: its
    ``DoRALinear`` reads the wrapped linear's whole weight in every forward (the row norms of
    ``W + BA``), and under GTP that weight is a shard (it failed on a shape mismatch inside the
    forward). NeMo's LoRA and canonical LoRA only call the wrapped linear, and run.

    Example: ``refuse_dora(model)`` raises ``ValueError`` if any module is a ``DoRALinear``.
    """
    try:
        from nemo.collections.llm.peft.dora import DoRALinear
    except ImportError:  # a NeMo without DoRA
        return
    for name, sub in module.named_modules():
        if isinstance(sub, DoRALinear):
            raise ValueError(
                f"NeMo's DoRA ({name}) needs each wrapped linear's whole weight in every forward, "
                "and GTP shards it: fine-tune with peft=llm.peft.LoRA() or "
                "llm.peft.CanonicalLoRA(), or without GTP (num_weight_shards = "
                "tensor_model_parallel_size)"
            )


def convert_then_shard(
    convert: Callable[[torch.nn.Module], torch.nn.Module] | None,
    shard: Callable[[torch.nn.Module], object],
) -> Callable[[torch.nn.Module], torch.nn.Module]:
    """``convert_module_fn`` that runs NeMo's precision conversion, then GTP sharding.

    Example::

        mp.convert_module_fn = convert_then_shard(mp.convert_module_fn,
                                                  lambda c: shard_model_chunk(c, groups, None))
    """

    def convert_module_fn(chunk: torch.nn.Module) -> torch.nn.Module:
        if convert is not None:
            chunk = convert(chunk)
        shard(chunk)
        return chunk

    convert_module_fn.gtp_composed = True  # type: ignore[attr-defined]
    return convert_module_fn

"""The GTP model transform inside NeMo's model setup (seed §1.5, §3.1; lifecycle in docs).

``MegatronParallel.init_model_parallel`` applies ``convert_module_fn`` (the precision plugin's
``convert_module``: bf16/fp16 ``Float16Module`` wrapping) to every model chunk right before
``init_ddp``. :func:`convert_then_shard` composes that function with :func:`shard_model`, so
the order is: model built by ``configure_model`` -> precision conversion (the shards get the
training dtype) -> GTP sharding -> DDP wrap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from nemo_gtp.engine import GTPConfig, GTPGroups, GTPRuntime, runtimes_of
from nemo_gtp.integrations.megatron import shard_model


def mirror_model_config(config: GTPConfig | None, model_config: Any) -> GTPConfig:
    """``config`` (or the defaults) with ``calculate_per_token_loss`` copied from the model.

    The seed's ``calculate_per_token_loss`` knob must mirror the model config (§2.4, §3.2 table);
    the strategy sets it instead of making the user repeat it.
    """
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    config = config or GTPConfig()
    if config.calculate_per_token_loss != per_token:
        config = dataclasses.replace(config, calculate_per_token_loss=per_token)
    return config


def shard_model_chunk(
    chunk: torch.nn.Module, groups: GTPGroups, config: GTPConfig | None
) -> GTPRuntime | None:
    """Shard one NeMo model chunk (a LightningModule holding the megatron model as ``.module``).

    Idempotent: a chunk whose weights are already owned by a runtime keeps it (NeMo may run
    ``init_model_parallel`` again, e.g. PEFT's deferred setup). Linears built as their shard
    (TE wrappers from the rewritten layer spec) own no runtime yet: ``shard_model`` registers
    them.
    """
    module = getattr(chunk, "module", chunk)
    existing = runtimes_of(module)
    if existing:
        return existing[0]
    config = mirror_model_config(config, getattr(module, "config", None))
    return shard_model(module, groups, config)


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

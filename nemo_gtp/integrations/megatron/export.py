"""The state dict a run without GTP would have: GTP shards gathered back to whole weights.

:func:`full_state_dict` is the in-memory counterpart of the checkpoint format (design §1.8,
§3.3): there every GTP shard is written as pieces of megatron's unpadded global weight; here
each shard is all-gathered over its GTP group and its pad rows dropped (design §1.3), so the
result is what ``state_dict()`` of the same model built without GTP returns, key for key. TP
shards stay as they are (each TP rank holds its own slice, as megatron's ``state_dict`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import unwrap_model

from nemo_gtp.engine import is_gtp_param
from nemo_gtp.engine.fp8_primary import dequantize_fp8_primary, is_fp8_primary
from nemo_gtp.integrations.megatron.sharding.built import is_presharded


def unwrapped_module(model: Any) -> torch.nn.Module:
    """The bare model inside ``model``'s wrappers (one model chunk).

    Accepts a NeMo strategy (its ``megatron_parallel``), a NeMo ``MegatronParallel`` or any
    list of chunks holding exactly one, a Lightning module holding the model as ``.module``
    (NeMo's ``llm.GPTModel``), megatron's DDP / ``Float16Module``, or the bare model. Duck-typed,
    so this layer imports no NeMo.

    Example::

        gpt = unwrapped_module(strategy)  # strategy -> MegatronParallel -> llm.GPTModel
                                          # -> DDP -> (Float16Module ->) mcore GPTModel
    """
    if hasattr(model, "megatron_parallel"):  # a NeMo MegatronStrategy
        model = model.megatron_parallel
    if isinstance(model, (Sequence, torch.nn.ModuleList)):
        chunks = list(model)
        if len(chunks) != 1:
            raise ValueError(
                f"{len(chunks)} model chunks (virtual pipeline stages): pass one chunk at a time"
            )
        model = chunks[0]
    while True:
        inner = unwrap_model(model)  # megatron's DDP / FSDP / Float16Module
        if inner is not model:
            model = inner
            continue
        # A Lightning module (NeMo's llm.GPTModel) holds the megatron model as ``.module``;
        # megatron's own modules never wrap that way, so stop at the first MegatronModule.
        wrapped = getattr(model, "module", None)
        if isinstance(model, MegatronModule) or not isinstance(wrapped, torch.nn.Module):
            return model
        model = wrapped


def full_state_dict(model: Any) -> dict[str, Any]:
    """``model``'s state dict as the same model without GTP has it (collective over GTP).

    Every GTP weight is all-gathered over its GTP group and its pad rows dropped
    (``ShardSpec.gathered_shape`` / ``ShardSpec.unpad``); every other entry is the tensor
    ``state_dict()`` returns. TP shards stay per TP rank, like megatron's ``state_dict``; keys
    carry no DDP / ``Float16Module`` / Lightning-module prefixes. The gathered tensors are new
    (on the weights' device, in their dtype); the others share storage with the model. An FP8
    primary GTP shard (design §1.3 "FP8 primary weights") comes back dequantized, in its
    training dtype: the values a TE ``Float8Tensor`` param of the model without GTP stands for
    (its FP8 bytes times the one per-tensor ``scale_inv`` every GTP peer shares), not raw FP8
    codes.

    Collective: every rank of each GTP group must call it (one all-gather per GTP weight, in
    parameter order); with GTP off it communicates nothing. ``model``: anything
    :func:`unwrapped_module` accepts (a ``GTPMegatronStrategy`` after ``trainer.fit``, its
    ``megatron_parallel``, a megatron DDP, the bare model).

    Example::

        trainer.fit(model, datamodule=data)
        weights = nemo_gtp.full_state_dict(trainer.strategy)  # on every rank
        if torch.distributed.get_rank() == 0:
            torch.save(weights, "weights_tp_rank0.pt")
    """
    module = unwrapped_module(model)
    state = module.state_dict(keep_vars=True)
    for key, value in state.items():  # before any collective: every rank raises alike
        if is_presharded(value):
            raise ValueError(
                f"full_state_dict: {key} is a GTP shard built before the model transform and "
                "not registered yet (NeMo's PEFT defers the transform to the first train epoch "
                "start): call it after the model is sharded, e.g. at a train batch start"
            )
    out: dict[str, Any] = {}
    for key, value in state.items():
        if is_gtp_param(value):
            spec = value.gtp_spec
            # one scale per weight on every GTP peer: the gathered dequantized shards are the
            # dequantized full weight
            shard = dequantize_fp8_primary(value) if is_fp8_primary(value) else value.detach()
            gathered = torch.empty(spec.gathered_shape, dtype=shard.dtype, device=value.device)
            dist.all_gather_into_tensor(gathered, shard.contiguous(), group=value.runtime.group)
            out[key] = spec.unpad(gathered).clone()  # clone: no hidden pad rows behind it
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach()  # as state_dict() without keep_vars
        else:
            out[key] = value  # e.g. TE's _extra_state
    return out

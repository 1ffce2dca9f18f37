"""Causal attention over a context-parallel group on CPU: a stand-in for TE's CP attention.

megatron-core runs context parallelism only through TransformerEngine's attention
(``DotProductAttention`` refuses ``context_parallel_size > 1``), which needs a GPU. The CPU tests
of GTP with CP (design §3.1 "Process groups") need a model whose CP ranks really cooperate:
:class:`ContextParallelAttention` takes the place of megatron's core attention in the local
layer spec. Each CP rank holds two of the ``2 * CP`` sequence chunks (megatron's load-balanced
layout, ``megatron.core.utils.get_batch_on_this_cp_rank``: chunks ``r`` and ``2 * CP - 1 - r``);
the stand-in all-gathers keys and values over the CP group, puts them in sequence order and
runs causal softmax attention for its own queries. Its backward sums every rank's key/value
gradients and keeps its own chunks. Not fast (the whole sequence's keys on every rank), exact.

    spec = with_context_parallel_attention(get_gpt_layer_local_spec())
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[s, ...]`` chunks over ``group`` along dim 0; backward: the summed gradient's
    own chunk (every rank's queries read every rank's keys)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.length
        return grad[start : start + ctx.length].clone(), None


def chunk_positions(cp_rank: int, cp_size: int, local_length: int) -> torch.Tensor:
    """Sequence positions of a CP rank's ``local_length`` tokens: its chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of ``local_length / 2`` tokens each, in that order."""
    chunk = local_length // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last, last + chunk)])


class ContextParallelAttention(MegatronModule):
    """megatron's core-attention interface (``[s, b, heads, dim]`` in, ``[s, b, heads * dim]``
    out) with causal masking by global position across the CP group; fp32 softmax, no dropout
    (the tests run without it)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type, **_) -> None:  # noqa: ANN001
        super().__init__(config=config)
        self.group = parallel_state.get_context_parallel_group()
        self.cp_size = dist.get_world_size(self.group)
        self.cp_rank = dist.get_rank(self.group)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: object = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        length, batch, heads, dim = query.shape
        keys = _GatherSequence.apply(key, self.group)
        values = _GatherSequence.apply(value, self.group)
        positions = torch.cat(
            [chunk_positions(r, self.cp_size, length) for r in range(self.cp_size)]
        ).to(query.device)
        if key.shape[2] != heads:  # grouped-query attention: each key head serves a group
            keys = keys.repeat_interleave(heads // key.shape[2], dim=2)
            values = values.repeat_interleave(heads // key.shape[2], dim=2)
        mine = chunk_positions(self.cp_rank, self.cp_size, length).to(query.device)
        scores = torch.einsum("sbhd,tbhd->bhst", query.float(), keys.float()) / math.sqrt(dim)
        future = positions[None, :] > mine[:, None]  # [s, t]: key after query
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(query.dtype)
        out = torch.einsum("bhst,tbhd->sbhd", probs, values)
        return out.reshape(length, batch, heads * dim)


def with_context_parallel_attention(spec: object) -> object:
    """A copy of the GPT layer ``spec`` whose core attention is :class:`ContextParallelAttention`
    (``spec.submodules.self_attention.submodules.core_attention``)."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


def cp_local_layer_spec(config: object) -> object:
    """NeMo's ``local_layer_spec`` with :class:`ContextParallelAttention`, as a NeMo
    ``transformer_layer_spec``: ``llm.GPTConfig(..., transformer_layer_spec=cp_local_layer_spec)``
    trains with ``context_parallel_size > 1`` on CPU."""
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    return with_context_parallel_attention(local_layer_spec(config))

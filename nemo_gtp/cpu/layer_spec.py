"""The layer spec a NeMo recipe's model gets on CPU: megatron's local modules, every family.

NeMo's GPU recipes build their layers from TransformerEngine specs; on CPU
(:func:`nemo_gtp.recipes.cpu.on_cpu`) :func:`cpu_layer_spec` builds the same architecture from
megatron's local modules:

- the plain families (Llama, Mixtral, Qwen, ...): NeMo's ``local_layer_spec`` (QK layernorm,
  routed experts and the norm kind taken from the config);
- multi-latent attention or a dense/MoE layer pattern (``moe_layer_freq``, DeepSeek): megatron's
  ``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``, one spec per layer;
- megatron's zero-centered gamma (``layernorm_zero_centered_gamma``: Nemotron's LayerNorm1p,
  Gemma's RMSNorm): :class:`CPUNorm` in place of every norm. Megatron's CPU norm
  (``WrappedTorchNorm``) refuses it and its fused one needs Apex; TE's normalizes
  ``x * (1 + gamma)`` with gamma initialized to zero, which :class:`CPUNorm` computes in torch;
- multi-latent attention: :class:`MLADotProductAttention` (megatron's local attention with
  query/key and value heads of different widths; its own takes one width).

Example::

    recipe.model.config.transformer_layer_spec = cpu_layer_spec
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class CPUNorm(torch.nn.Module):
    """LayerNorm or RMSNorm in torch with megatron's ``zero_centered_gamma`` (weight + 1).

    Built like megatron's norms (``config, hidden_size, eps``); its parameters are ``weight``
    (and ``bias`` for LayerNorm) as in megatron's ``FusedLayerNorm``, so checkpoints and NeMo's
    converters see the usual names. Example::

        norm = CPUNorm(config, hidden_size=64, eps=1e-5)
    """

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        del persist_layer_norm  # a fused-kernel knob
        self.kind = normalization or config.normalization
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"CPUNorm: normalization={self.kind!r} is not LayerNorm or RMSNorm")
        self.zero_centered_gamma = bool(zero_centered_gamma or config.layernorm_zero_centered_gamma)
        self.shape, self.eps = (hidden_size,), eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():  # megatron's grad all-reduce for sequence parallel
            param.sequence_parallel = bool(config.sequence_parallel)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gamma 0 (zero-centered) or 1, beta 0: megatron's ``FusedLayerNorm`` init."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized ``x`` scaled by ``weight`` (+ 1 when zero-centered)."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.kind == "LayerNorm":
            return F.layer_norm(x, self.shape, weight, self.bias, self.eps)
        return F.rms_norm(x, self.shape, weight, self.eps)


def _local_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class MLADotProductAttention(_local_attention()):
    """Megatron's local ``DotProductAttention`` for multi-latent attention: query/key heads of
    ``k_channels`` and value heads of ``v_channels`` (MLA's differ; megatron's local class takes
    neither and sizes its output by ``kv_channels``). The scores and the context are computed
    by the parent's code, which already follows the tensors' head dims; only the output width
    is the value heads'. Example: ``MLASelfAttentionSubmodules(core_attention=
    MLADotProductAttention, ...)``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        if softmax_scale is None and k_channels is not None:
            softmax_scale = k_channels**-0.5
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def cpu_layer_spec(config: Any) -> Any:
    """The local-module spec of ``config``'s architecture (see the module docstring).

    Example: ``GPTConfig(..., transformer_layer_spec=cpu_layer_spec)``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.integrations.megatron.sharding.spec import replace_modules_in_spec

    pattern = config.num_moe_experts and config.moe_layer_freq != 1
    zero_centered = bool(config.layernorm_zero_centered_gamma)
    if config.multi_latent_attention or pattern or zero_centered:
        # a block spec: its final norm comes from the spec too (a layer spec's does not)
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=config.normalization
        )
    else:
        spec = local_layer_spec(config)
    if zero_centered:
        spec = replace_modules_in_spec(spec, {WrappedTorchNorm: CPUNorm}, {})
    if config.multi_latent_attention:
        spec = replace_modules_in_spec(spec, {_local_attention(): MLADotProductAttention}, {})
    return spec

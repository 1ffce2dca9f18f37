"""Tiny Hugging Face checkpoints built here (no download) and NeMo's importer run on CPU.

:func:`make_tiny_llama` writes a ``LlamaForCausalLM`` of the harness's tiny Llama shape
(:mod:`tests.harness.strategy`, ``Fit(llama=True)``: 2 layers, width 64, 4 heads in 2 query
groups, SwiGLU 128, vocabulary 128, RoPE base 500000, untied output layer) with a word-level
tokenizer of 128 ids, as ``save_pretrained`` writes them.

:func:`import_llama` is ``llm.import_ckpt(model=llm.LlamaModel(...), source="hf://DIR")`` in a
process of its own. NeMo's ``HFLlamaImporter`` maps the Hugging Face norms onto TE's fused
layernorm-linear parameters (``linear_qkv.layer_norm_weight``); without TE NeMo builds the
local spec, whose norms are modules of their own (``input_layernorm.weight``), and the mapping
finds no target. The importing process therefore builds NeMo's model with
:class:`LayerNormColumnLinear`, a CPU stand-in of TE's ``LayerNormColumnParallelLinear`` with
its parameter names (the norm's weight on the linear). Megatron's local spec checkpoints its
norms under those same names, so the imported checkpoint restores into the local-spec model the
fine-tune trains.

Example::

    make_tiny_llama(hf_dir)
    start_ranks(import_llama, (str(hf_dir), str(nemo_dir)), 1, join=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 128


# The tiny shape both models share (fp32, 2 layers, GQA 4:2, untied output layer).
_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)  # fmt: skip


def _save_tokenizer(path: str | Path) -> None:
    """A word-level tokenizer of ``VOCAB`` tokens (no download) saved under ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def _save_random(model_class: type, config: Any, path: str | Path, seed: int) -> None:
    """A random ``model_class(config)`` with random norms saved under ``path`` with the
    tokenizer."""
    _save_tokenizer(path)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # HF initializes norms to 1: random ones show a mapping mix-up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)


def make_tiny_llama(path: str | Path, seed: int = 0) -> None:
    """A random tiny ``LlamaForCausalLM`` (fp32) and its tokenizer saved under ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _save_random(LlamaForCausalLM, LlamaConfig(**_SHAPE, rope_theta=500000.0), path, seed)


def make_tiny_mixtral(path: str | Path, seed: int = 0) -> None:
    """A random tiny ``MixtralForCausalLM`` (fp32): the Llama shape above with 4 experts of
    width 128 in every layer, top-2 routing, RoPE base 1e6; the same tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_SHAPE, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)
    _save_random(MixtralForCausalLM, config, path, seed)


def _column_parallel_linear() -> type:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


class LayerNormColumnLinear(_column_parallel_linear()):
    """Megatron's ``ColumnParallelLinear`` with the RMSNorm before it owned as
    ``layer_norm_weight``: TE's ``LayerNormColumnParallelLinear`` names, on CPU."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        self.eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """RMSNorm with ``layer_norm_weight``, then the linear."""
        x = F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return super().forward(x, *args, **kwargs)


def _local_spec(config: Any) -> Any:
    """A copy of megatron's local GPT layer spec for ``config`` (experts, norms), to edit."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
    )


def te_named_spec(config: Any) -> Any:
    """Megatron's local GPT layer spec with TE's parameter names: the input and pre-MLP norms
    folded into ``linear_qkv`` / ``linear_fc1`` (:class:`LayerNormColumnLinear`)."""
    from megatron.core.transformer.identity_op import IdentityOp

    spec = _local_spec(config)
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = LayerNormColumnLinear
    layer.sharded_state_dict_keys_map = {}
    if not config.num_moe_experts:  # TE's MoE layers keep their pre-MLP norm apart
        layer.pre_mlp_layernorm = IdentityOp
        layer.mlp.submodules.linear_fc1 = LayerNormColumnLinear
    return spec


def _transformer_layer() -> type:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return TransformerLayer


def _input_norm_te_name(module: Any, state_dict: dict, prefix: str, metadata: Any) -> None:
    local, te_name = "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"
    if prefix + local in state_dict:
        state_dict[prefix + te_name] = state_dict.pop(prefix + local)


class TENamedMoELayer(_transformer_layer()):
    """A local-spec MoE ``TransformerLayer`` whose ``state_dict()`` names the input norm as TE's
    spec does (the pre-MLP norm stays apart in TE's MoE layers too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_input_norm_te_name)


def te_named_moe_local_spec(config: Any) -> Any:
    """Megatron's local MoE layer spec saved under TE's MoE names: the input norm as
    ``linear_qkv.layer_norm_weight`` (state dict and dist checkpoint), ``pre_mlp_layernorm``
    as it is (megatron's local spec would checkpoint it as ``linear_fc1``'s, which an MoE layer
    does not have)."""
    spec = _local_spec(config)
    spec.module = TENamedMoELayer
    spec.submodules.sharded_state_dict_keys_map = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
    }
    return spec


def import_llama(rank: int, hf_dir: str, out: str, mixtral: bool = False) -> None:
    """NeMo's ``llm.import_ckpt`` of the Hugging Face Llama (``mixtral``: Mixtral) in ``hf_dir``
    into the NeMo checkpoint ``out`` (run it in a process of its own: the module docstring)."""
    del rank
    from nemo_gtp.cpu.compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model import base

    # without TE, NeMo's default spec is base.local_layer_spec (looked up at call time)
    base.local_layer_spec = te_named_spec
    sizes = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    if mixtral:
        model = llm.MixtralModel(llm.MixtralConfig(**sizes))
    else:
        model = llm.LlamaModel(llm.LlamaConfig(**sizes))
    llm.import_ckpt(model=model, source=f"hf://{hf_dir}", output_path=out)

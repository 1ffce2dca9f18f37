"""A GPT's parameter count from its sizes, and the sizes of a YAML recipe's model: no torch.

The planner (``nemo_gtp.plan.ModelShape``) and the recipe CLI's first line (``python -m
nemo_gtp.run``: "GPT of 0.11 M parameters") count with these functions, so both say the same.

Example::

    sizes = yaml_model_sizes(load_recipe("configs/tiny_cpu.yaml"))
    parameter_count(**sizes)   # 106816: NeMo counts 109184 (with biases, position embeddings)
"""

from __future__ import annotations

from typing import Any


def linear_params_per_layer(
    hidden: int, ffn: int, heads: int, query_groups: int | None = None, gated: bool = False
) -> int:
    """qkv + projection + fc1 + fc2 weights of one layer (what GTP shards, design §1.5)."""
    kv = hidden * (query_groups or heads) // heads
    qkv = hidden * (hidden + 2 * kv)
    return qkv + hidden * hidden + hidden * ffn * (2 if gated else 1) + ffn * hidden


def embedding_params(vocab: int, hidden: int, tied: bool = False) -> int:
    """Input embedding plus output layer (one matrix when tied)."""
    return vocab * hidden * (1 if tied else 2)


def parameter_count(
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    vocab: int,
    query_groups: int | None = None,
    gated: bool = False,
    tied_embeddings: bool = False,
    experts: int = 0,
    expert_ffn: int | None = None,
    **_: Any,
) -> int:
    """Every weight of the GPT (linears, embeddings, layer norms; no biases). With ``experts``
    (MoE), each layer's MLP is that many experts of ``expert_ffn`` (default ``ffn``) and a
    router."""
    norms = (2 * layers + 1) * hidden
    linears = layers * linear_params_per_layer(hidden, ffn, heads, query_groups, gated)
    if experts:
        mlp = hidden * ffn * (3 if gated else 2)
        expert = hidden * (expert_ffn or ffn) * (3 if gated else 2)
        linears += layers * (experts * expert + experts * hidden - mlp)
    return linears + embedding_params(vocab, hidden, tied_embeddings) + norms


def yaml_model_sizes(cfg: Any) -> dict[str, Any]:
    """The sizes of a loaded YAML recipe's ``model`` and ``data`` sections, as
    ``ModelShape`` keyword arguments (``layers``, ``hidden``, ``ffn``, ``heads``, ``vocab``,
    ``seq``, ``query_groups``, ``gated``, ``tied_embeddings``, ``experts``, ``softmax_fp32``)."""
    m, d = cfg.get("model", {}), cfg.get("data", {})
    return {
        "layers": int(m.num_layers),
        "hidden": int(m.hidden_size),
        "ffn": int(m.get("ffn_hidden_size") or 4 * m.hidden_size),
        "heads": int(m.num_attention_heads),
        "vocab": int(d.get("vocab_size", m.get("vocab_size", 0)) or 0),
        "seq": int(d.get("seq_length", 2048)),
        "query_groups": m.get("num_query_groups"),
        "gated": bool(m.get("gated_linear_unit", False)),
        # NeMo's GPTConfig ties them unless told not to
        "tied_embeddings": bool(m.get("share_embeddings_and_output_weights", True)),
        "experts": int(m.get("num_moe_experts") or 0),
        "softmax_fp32": bool(m.get("attention_softmax_in_fp32", False)),  # NeMo's default
    }

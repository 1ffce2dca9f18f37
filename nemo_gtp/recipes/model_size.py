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
    shared_ffn: int = 0,
    moe_layers: int | None = None,
    **_: Any,
) -> int:
    """Every weight of the GPT (linears, embeddings, layer norms; no biases). With ``experts``
    (MoE), the MLP of each of ``moe_layers`` layers (default: all) is that many experts of
    ``expert_ffn`` (default ``ffn``), a router and a shared expert of ``shared_ffn`` (0: none).
    """
    norms = (2 * layers + 1) * hidden
    linears = layers * linear_params_per_layer(hidden, ffn, heads, query_groups, gated)
    if experts:
        width = 3 if gated else 2
        moe = layers if moe_layers is None else moe_layers
        expert = hidden * (expert_ffn or ffn) * width
        swap = experts * expert + experts * hidden + hidden * shared_ffn * width
        linears += moe * (swap - hidden * ffn * width)
    return linears + embedding_params(vocab, hidden, tied_embeddings) + norms


def moe_layer_count(freq: Any, layers: int) -> int:
    """Layers with routed experts under megatron's ``moe_layer_freq``: an int k (every k-th
    layer, from the first), a 0/1 list per layer, or that list as megatron's string expression
    (``"([0]*1+[1]*26)"``).

    Example::

        moe_layer_count(1, 4), moe_layer_count([0, 1, 1], 3), moe_layer_count("[0]+[1]*2", 3)
        # (4, 2, 2)
    """
    if isinstance(freq, str):
        import ast

        freq = _list_expression(ast.parse(freq, mode="eval").body)
    if isinstance(freq, int):
        return -(-layers // max(freq, 1))
    return sum(1 for flag in freq if flag)


def _list_expression(node: Any) -> list[int]:
    """megatron's ``moe_layer_freq`` string: lists of ints joined by ``+`` and repeated by
    ``*`` (evaluated without ``eval``)."""
    import ast

    if isinstance(node, ast.List):
        return [int(ast.literal_eval(item)) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _list_expression(node.left) * int(ast.literal_eval(node.right))
    raise ValueError(f"moe_layer_freq: cannot read {ast.unparse(node)!r}")


def moe_sizes(get: Any, layers: int) -> dict[str, Any]:
    """The MoE sizes of a model config read through ``get(key, default)``, as ``ModelShape``
    keyword arguments (``experts``, ``expert_ffn``, ``topk``, ``shared_ffn``, ``moe_layers``)."""
    experts = int(get("num_moe_experts", 0) or 0)
    if not experts:
        return {"experts": 0}
    return {
        "experts": experts,
        "expert_ffn": int(get("moe_ffn_hidden_size", 0) or 0),
        "topk": int(get("moe_router_topk", 2) or 2),
        "shared_ffn": int(get("moe_shared_expert_intermediate_size", 0) or 0),
        "moe_layers": moe_layer_count(get("moe_layer_freq", 1) or 1, layers),
    }


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
        "softmax_fp32": bool(m.get("attention_softmax_in_fp32", False)),  # NeMo's default
        **moe_sizes(lambda key, default=None: m.get(key, default), int(m.num_layers)),
    }

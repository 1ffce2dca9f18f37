"""Per-GPU bytes of a model under one layout (design §1.7): :func:`estimate`."""

from __future__ import annotations

from nemo_gtp.engine.grid import check_pipeline_split
from nemo_gtp.plan.shapes import GIB, Layout, ModelShape

__all__ = ["estimate"]


def estimate(
    model: ModelShape,
    layout: Layout,
    *,
    tokens_per_gpu: int,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    overhead_gib: float = 3.0,
    prefetch_depth: int = 1,
    coalesce_mb: float = 192.0,
    dropout: bool = False,
    flash_attention: bool = False,
    optimizer: str = "adam",
    muon_bucket_mb: float = 256.0,
) -> dict[str, float]:
    """Per-GPU bytes of ``model`` under ``layout`` (see the module docstring for the model).

    ``optimizer="muon"`` (design §1.6 "Muon"): megatron's non-distributed optimizer, so every
    rank keeps whole state for its own params: an fp32 master and a momentum (8 bytes) per
    element of the hidden matrices — 1/(TP·GTP) of them, never divided by DP — and Adam's 12 for
    the rest; plus the step's transient: two buckets of gathered fp32 Muon inputs under GTP
    (``muon_bucket_mb``, ``MuonConfig.gather_bucket_mb``) and Newton–Schulz's bf16 copies of the
    largest matrix (counted in ``optimizer``; they never coexist with the activations, so this
    overestimates a little).

    Activations per layer and token: ``34·h`` bytes with dropout (its masks), ``32·h`` without;
    plus the attention scores ``a·s`` times 5 bytes (scores, dropout mask and output) with
    dropout, 2 without, 4 more with ``ModelShape.softmax_fp32``, none with flash / fused
    attention (TE's default spec).

    MoE (``model.experts``): routed experts' weights, gradients and Adam state are counted
    exactly for the layout's EP × TP × EGTP split (their optimizer state over the expert data
    ranks, :attr:`Layout.expert_replicas`), the router whole, the shared expert like a dense
    MLP; a MoE layer's activations replace the dense MLP's ``19·h`` (``18·h``) per token by
    ``topk`` routed copies (``2·h`` each) through an expert MLP (``2·h + 4·f``, gated
    ``2·h + 6·f``) and the shared expert: an estimate of the permuted buffers, not of a
    dispatcher's capacity padding. Multi-latent attention is counted as plain attention.
    """
    kwargs = dict(
        param_bytes=param_bytes, grad_bytes=grad_bytes, overhead_gib=overhead_gib,
        prefetch_depth=prefetch_depth, coalesce_mb=coalesce_mb, dropout=dropout,
        flash_attention=flash_attention, optimizer=optimizer, muon_bucket_mb=muon_bucket_mb,
    )  # fmt: skip
    if layout.pp == 1:
        whole = (model.layers, model.embedding_params, 1, 1, True)
        return _stage_bytes(model, layout, *whole, tokens_per_gpu, **kwargs)
    check_pipeline_split(model.layers, layout.pp, key="model.layers")
    # Under 1F1B (with at least PP microbatches per step) the first stage keeps PP microbatches'
    # activations of its layers in flight (its warm-up forwards), the last stage one; the first
    # holds the input embedding, the last the output layer (its own copy when tied), the final
    # norm and the logits.
    stage_layers, embedding = model.layers // layout.pp, model.vocab * model.hidden
    first = _stage_bytes(
        model, layout, stage_layers, embedding, 0, layout.pp, False, tokens_per_gpu, **kwargs
    )
    last = _stage_bytes(
        model, layout, stage_layers, embedding, 1, 1, True, tokens_per_gpu, **kwargs
    )
    return max(first, last, key=lambda part: sum(part.values()))


def _stage_bytes(
    model: ModelShape,
    layout: Layout,
    layers: int,
    embedding: float,
    final_norms: int,
    in_flight: int,
    logits: bool,
    tokens_per_gpu: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    overhead_gib: float,
    prefetch_depth: int,
    coalesce_mb: float,
    dropout: bool,
    flash_attention: bool,
    optimizer: str,
    muon_bucket_mb: float,
) -> dict[str, float]:
    """:func:`estimate` for one GPU holding ``layers`` transformer layers, ``embedding``
    elements of embedding / output matrices, ``final_norms`` final layer norms and
    ``in_flight`` microbatches' activations of its layers (``logits``: and the fp32 logits)."""
    tp, gtp, h = layout.tp, layout.gtp, model.hidden
    replicas = layout.dp * layout.cp  # the distributed optimizer shards over CP x DP
    # MoE layers of this stage: attention and the shared expert shard like dense linears, the
    # routed experts over EP x TP x EGTP, the router stays whole
    moe = round(layers * model.moe_layer_count / model.layers)
    dense = layers - moe
    moe_linears = model.attention_params_per_layer + model.mlp_params(model.shared_ffn)
    sharded = (dense * model.linear_params_per_layer + moe * moe_linears) / (tp * gtp)
    replicated = embedding / tp + (2 * layers + final_norms) * h + moe * model.experts * h
    experts = moe * model.expert_params_per_layer / (layout.ep * tp * layout.egtp)
    optimizer_bytes = 12  # fp32 master + Adam m and v
    replicated_shards = replicas * gtp if layout.shard_replicated else replicas
    weights = (sharded + replicated + experts) * param_bytes
    grads = (sharded + replicated + experts) * grad_bytes
    if optimizer == "muon":
        if layout.shard_replicated:
            raise ValueError(
                "optimizer='muon' runs without the distributed optimizer, so "
                "without shard_replicated_params_over_gtp"
            )
        full = model.largest_linear / tp
        inputs = sharded * gtp * 4  # every hidden matrix's whole fp32 Muon input
        transient = (2 * min(muon_bucket_mb * 2**20, inputs) if gtp > 1 else 0) + 3 * full * 2
        optimizer = (sharded + experts) * 8 + replicated * optimizer_bytes + transient
    elif optimizer == "adam":
        optimizer = (
            sharded * optimizer_bytes / replicas
            + replicated * optimizer_bytes / replicated_shards
            + (experts * optimizer_bytes / layout.expert_replicas if experts else 0)
        )
    else:
        raise ValueError(f"--optimizer must be adam or muon, got {optimizer!r}")
    gather = 0.0
    if gtp > 1:  # live gathered units (current + prefetched per direction, the tail's
        # hand-over) and the wgrad scratch of the staged and the in-flight unit; a coalescing
        # unit (GTPConfig.coalesce_mb) is at least the largest weight, at most the model
        full = model.largest_linear / tp
        unit = min(max(full, coalesce_mb * 2**20 / param_bytes), sharded * gtp)
        gather = (2 + prefetch_depth) * unit * param_bytes + 2 * unit * grad_bytes
    if moe and layout.egtp > 1:  # a layer's routed experts on this rank, gathered over EGTP
        unit = model.expert_params_per_layer / (layout.ep * tp)
        gather += (2 + prefetch_depth) * unit * param_bytes + 2 * unit * grad_bytes
    a, s = model.heads, model.seq
    scores = 0 if flash_attention else (5 if dropout else 2) + 4 * model.softmax_fp32
    per_token = (34 if dropout else 32) * h
    per_layer = tokens_per_gpu * (per_token + scores * a * s) / tp
    # an MoE layer: the dense MLP's share (19·h with dropout, for ffn = 4h) replaced by topk
    # routed copies of each token (2·h permuted) through an expert MLP, and the shared expert

    def mlp(width: int) -> float:  # an MLP's saved activations per token
        return 2 * h + (6 if model.gated else 4) * width + (h if dropout else 0)

    routed = model.topk * (2 * h + mlp(model.expert_ffn or model.ffn))
    shared = mlp(model.shared_ffn) if model.shared_ffn else 0
    moe_token = per_token - (19 if dropout else 18) * h + routed + shared
    per_moe_layer = tokens_per_gpu * (moe_token + scores * a * s) / tp
    if layout.recompute:
        largest = max(per_layer if dense else 0, per_moe_layer if moe else 0)
        activations = in_flight * layers * 2 * tokens_per_gpu * h / tp + largest
    else:
        activations = in_flight * (dense * per_layer + moe * per_moe_layer)
    if logits:
        activations += 2 * tokens_per_gpu * model.vocab / tp * 4  # fp32 logits and their grad
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "gather": gather,
        "activations": activations,
        "overhead": overhead_gib * GIB,
    }

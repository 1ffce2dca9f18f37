"""The planner's inputs: a model's sizes, a candidate layout, a plan (per-GPU bytes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nemo_gtp.recipes.model_size import (
    embedding_params,
    linear_params_per_layer,
    parameter_count,
)

__all__ = ["GIB", "Layout", "ModelShape", "Plan"]

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a GPT's memory (a recipe's ``model`` section, or NeMo's config)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq: int
    query_groups: int | None = None  # GQA: key/value heads; None = heads (MHA)
    gated: bool = False  # SwiGLU-style fc1 (two weights in one)
    tied_embeddings: bool = False
    experts: int = 0
    """Routed experts per MoE layer (megatron's ``num_moe_experts``; 0: dense)."""
    softmax_fp32: bool = False
    """megatron's ``attention_softmax_in_fp32`` (NeMo's GPTConfig: False, megatron's default:
    True): unfused attention then also keeps the fp32 softmax output, 4 more bytes per score."""
    expert_ffn: int = 0
    """Width of one routed expert's MLP (``moe_ffn_hidden_size``; 0: ``ffn``)."""
    topk: int = 2
    """Experts each token is routed to (``moe_router_topk``)."""
    shared_ffn: int = 0
    """Width of the shared expert's MLP in each MoE layer (0: none)."""
    moe_layers: int | None = None
    """Layers whose MLP is routed experts (``moe_layer_freq``; None: every layer)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.experts < 0 or (self.experts and not 1 <= self.topk <= self.experts):
            raise ValueError(
                f"model.moe_router_topk={self.topk} must be between 1 and num_moe_experts="
                f"{self.experts}"
            )
        if self.moe_layers is not None and not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"MoE layers {self.moe_layers} must be within 0..{self.layers}")

    @property
    def moe_layer_count(self) -> int:
        """Layers with routed experts (0 for a dense model)."""
        if not self.experts:
            return 0
        return self.layers if self.moe_layers is None else self.moe_layers

    def mlp_params(self, ffn: int) -> int:
        """fc1 + fc2 weights of one MLP of width ``ffn`` (fc1 doubled when gated)."""
        return self.hidden * ffn * (3 if self.gated else 2)

    @property
    def attention_params_per_layer(self) -> int:
        """qkv + projection weights of one layer (multi-latent attention is counted as this)."""
        return linear_params_per_layer(self.hidden, 0, self.heads, self.query_groups, self.gated)

    @property
    def expert_params_per_layer(self) -> int:
        """Every routed expert's fc1 + fc2 of one MoE layer (what EP × ETP × EGTP split)."""
        return self.experts * self.mlp_params(self.expert_ffn or self.ffn)

    @property
    def linear_params_per_layer(self) -> int:
        """qkv + projection + fc1 + fc2 weights of one layer (what GTP shards, design §1.5)."""
        return linear_params_per_layer(
            self.hidden, self.ffn, self.heads, self.query_groups, self.gated
        )

    @property
    def largest_linear(self) -> int:
        """Elements of the largest linear weight (sizes the gathered buffers)."""
        kv = self.hidden * (self.query_groups or self.heads) // self.heads
        return max(
            self.hidden * (self.hidden + 2 * kv), self.hidden * self.ffn * (2 if self.gated else 1)
        )

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output layer (one matrix when tied)."""
        return embedding_params(self.vocab, self.hidden, self.tied_embeddings)

    @property
    def parameters(self) -> int:
        """Every parameter (norms included), for reporting."""
        return parameter_count(**dataclasses.asdict(self))


@dataclass(frozen=True)
class Layout:
    """One candidate: TP × CP × GTP × DP and the memory options."""

    tp: int
    gtp: int
    dp: int
    recompute: bool = False
    shard_replicated: bool = False
    cp: int = 1
    """Context parallelism: the CP peers hold the same weights and split the distributed
    optimizer's state with the DP ranks (megatron's ``dp_cp`` group, design §1.4 "CP")."""
    pp: int = 1
    """Pipeline stages: each GPU holds its stage's layers (design §1.4 "PP"); the estimate is
    the fuller of the first and the last stage."""
    ep: int = 1
    """Expert parallelism: the routed experts of a layer split over EP ranks (MoE only)."""
    egtp: int = 1
    """Expert GTP: each routed expert's weights cut again over EGTP ranks beyond TP (MoE only;
    ``expert_num_weight_shards`` = TP × EGTP, design §1.5 "Experts")."""

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same routed-expert shard (their optimizer state splits over them):
        (GTP · CP · DP) / (EP · EGTP), the expert-data-parallel size."""
        return self.gtp * self.cp * self.dp // (self.ep * self.egtp)

    @property
    def name(self) -> str:
        """E.g. ``TP2·GTP4·DP1 +recompute`` (``TP1·CP2·GTP4·DP1`` with context parallelism,
        ``TP1·PP2·GTP2·DP1`` with pipeline stages)."""
        extra = (" +recompute" if self.recompute else "") + (
            " +shard_replicated" if self.shard_replicated else ""
        )
        cp = (f"·PP{self.pp}" if self.pp > 1 else "") + (f"·CP{self.cp}" if self.cp > 1 else "")
        experts = f" EP{self.ep}·EGTP{self.egtp}" if self.ep * self.egtp > 1 else ""
        return f"TP{self.tp}{cp}·GTP{self.gtp}·DP{self.dp}{experts}{extra}"


@dataclass
class Plan:
    """Per-GPU bytes of one layout."""

    layout: Layout
    bytes: dict[str, float] = field(default_factory=dict)
    budget: float = 0.0  # bytes of one GPU
    fits: bool = False

    @property
    def total(self) -> float:
        """Every counted byte, overhead included."""
        return sum(self.bytes.values())

"""GTP tuning knobs (design §2.4), as one immutable dataclass owned by each runtime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GTPConfig:
    """GTP's tuning knobs (design §2.4), per model rather than process-global.

    Every field changes behaviour. (Megatron's ``check_param_states`` has no counterpart: the
    state machines always check their transitions.)

    Example::

        GTPConfig(pad_for_alignment=16, reduce_scatter_with_fp32_accumulation=True)

    Attributes:
        pad_for_alignment: each rank's dim-0 shard is a multiple of this many rows (§1.3
            "Padding"): the TP-local dim 0 is padded at the tail to a multiple of
            ``pad_for_alignment * gtp_size``. 16 suits BF16/NVFP4, 32 MXFP8, 1 disables padding
            beyond divisibility by the GTP size.
        weight_prefetch: issue the one-step-ahead all-gather of the neighbouring weight (§1.1).
            Off gathers every weight synchronously at its GEMM (debugging the cold-start path).
        prefetch_depth: how many weights ahead each consume gathers (1: the one-step-ahead chain
            of §1.1). 2 gives a small GEMM (e.g. the attention projection before a large MLP
            weight) two GEMMs of runway, for one more gathered buffer per chain and direction.
        coalesce_mb: consecutive weights of a prefetch chain whose gathered (padded) sizes in
            the training dtype (FP8 primary shards count as their training dtype) add up to at
            most this many MiB form one coalescing unit (design §3.1 "Coalescing units"): they
            are all-gathered in one collective, one unit ahead of use, and their
            wgrads reduce-scattered in one collective once the unit's last wgrad exists. Fewer,
            larger collectives cut the host cost and NCCL launches per weight (the small-token
            regime is host- and latency-bound) for up to two units of gathered buffers per
            direction instead of two weights, and a unit's wgrad scratch held until its last
            member's wgrad. 0 (or any size below the smallest weight): one weight per
            collective, the per-weight chain of §1.1.
        async_reduction: reduce-scatter weight gradients asynchronously with the one-step-deferred
            finalize (§1.1). Off reduces synchronously inside each backward.
        calculate_per_token_loss: SUM over the GTP axis instead of MEAN (§3.2 table); must mirror
            the model config's ``calculate_per_token_loss``.
        reduce_scatter_with_fp32_accumulation: replace the wgrad reduce-scatter by an all-to-all
            plus one local FP32 sum (§2.5); bypassed automatically when the GTP axis is <= 2.
        gather_backend: ``"process_group"`` (the GTP process group's all-gather: NCCL kernels
            on CUDA, gloo on CPU), ``"copy_engine"`` (SM-free
            pulls of peers' shards from symmetric memory, CUDA only, every GTP peer on one host;
            costs one extra shard-sized copy of the weights) or ``"auto"``: the copy engine
            where it is faster, i.e. when it is available and the GEMMs see at least
            ``copy_engine_min_tokens`` tokens (decided once, at the first gather, by all GTP
            peers together), else the process group. Default ``"auto"``: the process group on
            CPU/gloo, across hosts and for short micro-batches.
        copy_engine_min_tokens: the ``"auto"`` crossover in tokens per GEMM (rows of the
            activation: micro-batch x sequence / CP). Below it NCCL's all-gather, coalesced
            over a unit, beats per-weight copy-engine pulls; above it hiding the gather behind
            the GEMMs without taking SMs wins (``bench/results``, 2xH200: 4096 per weight,
            8192 with coalescing units).
        separate_reduce_scatter_group: give the wgrad reduce-scatters their own communicator
            (same ranks), so a weight's prefetched all-gather never queues behind the previous
            weight's reduce-scatter on one NCCL stream.
        shard_replicated_params_over_gtp: the params GTP leaves replicated (embeddings, output
            layer, norms, biases) are reduced by megatron DDP over the whole data group
            (DP x GTP) and their distributed-optimizer state is sharded over it, instead of over
            the replicate group plus a finalize all-reduce over GTP (§3.2). GTP shards then
            ride megatron's second (expert-style) buffer over the replicate group, and their
            reduce-scatter over GTP SUMs (DDP's 1/(DP x GTP) pre-scale makes the mean). Saves
            1 - 1/GTP of the replicated params' fp32 master and Adam state per rank, so weight +
            grad + optimizer bytes are 1/GTP of replicated training. Needs the distributed
            optimizer and a model without MoE experts; build DDP and the optimizer with
            ``gtp_process_groups(groups, config)``.
        preshard_linears: which linears a trainer that builds the model from a config
            (``GTPMegatronStrategy``) builds directly as their shard, so the model's full
            weights are never resident together (design §3.1 "One init path"): ``"te"``
            (default) the TransformerEngine parallel linears only, and under expert GTP the
            routed experts' linears (``SequentialMLP``'s, local or TE, and ``TEGroupedMLP``'s
            grouped ones); ``"all"`` also megatron's local ``ColumnParallelLinear`` /
            ``RowParallelLinear``, whose weights are otherwise built full and sliced;
            ``"none"``: every linear built full and sliced, TE's too (each weight materialized
            in full once, at build). Either way a model starts with exactly the non-GTP
            model's values (design §3.1 "Exact init": a pre-sharded linear draws its full
            weight into a scratch, one linear at a time).
        fp8_gather: when a TransformerEngine linear runs its GEMM in FP8 with per-tensor
            current scaling (megatron ``fp8_recipe="tensorwise"``), gather the FP8 copy of its
            shard (quantized once per step with the scale agreed over GTP, design §1.3 "FP8
            gather"): half the bytes of a BF16 gather, and TE uses the gathered ``Float8Tensor``
            without quantizing it again. Off: the training dtype is gathered and TE quantizes
            the gathered weight at every microbatch (its backward gets the weight quantized as
            the forward did, design §1.3 "Consumer-quantized backward"). No effect outside FP8
            autocast, for other recipes, for megatron-local linears and for FP8 primary shards
            (megatron's ``fp8_param``: the shards themselves are FP8 and always gathered so,
            design §1.3 "FP8 primary weights").
        graph_wgrad_ring_size: per-layer CUDA graphs only (design §3.5 "Cross-graph
            reduce-scatter overlap"): 0 (default) waits a layer's last reduce-scatter inside
            its own backward graph; N >= 2 keeps that wgrad in a ring of N fixed-address slots
            and reduce-scatters it inside the next layer's backward graph, overlapping its
            compute, for N extra head-unit wgrad buffers. Needs ``async_reduction``.
    """

    pad_for_alignment: int = 16
    weight_prefetch: bool = True
    prefetch_depth: int = 1
    coalesce_mb: float = 192.0
    async_reduction: bool = True
    calculate_per_token_loss: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    gather_backend: str = "auto"
    copy_engine_min_tokens: int = 8192
    separate_reduce_scatter_group: bool = False
    shard_replicated_params_over_gtp: bool = False
    preshard_linears: str = "te"
    fp8_gather: bool = True
    graph_wgrad_ring_size: int = 0

    @property
    def sums_over_gtp(self) -> bool:
        """Whether the wgrad reduce-scatter over GTP SUMs (else it averages; design §3.2 table)."""
        return self.calculate_per_token_loss or self.shard_replicated_params_over_gtp

    def __post_init__(self) -> None:
        if self.gather_backend not in ("process_group", "copy_engine", "auto"):
            raise ValueError(
                f"GTPConfig.gather_backend must be 'process_group', 'copy_engine' or 'auto', "
                f"got {self.gather_backend!r}"
            )
        if self.preshard_linears not in ("te", "all", "none"):
            raise ValueError(
                "GTPConfig.preshard_linears must be 'te', 'all' or 'none', got "
                f"{self.preshard_linears!r}"
            )
        if self.copy_engine_min_tokens < 0:
            raise ValueError(
                f"GTPConfig.copy_engine_min_tokens must be >= 0, got {self.copy_engine_min_tokens}"
            )
        if self.prefetch_depth < 1:
            raise ValueError(f"GTPConfig.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if not self.coalesce_mb >= 0:
            raise ValueError(f"GTPConfig.coalesce_mb must be >= 0, got {self.coalesce_mb}")
        if self.graph_wgrad_ring_size < 0 or self.graph_wgrad_ring_size == 1:
            raise ValueError(
                "GTPConfig.graph_wgrad_ring_size must be 0 (off) or >= 2 (a layer writes one "
                f"slot while the next reduces another), got {self.graph_wgrad_ring_size}"
            )
        if self.graph_wgrad_ring_size and not self.async_reduction:
            raise ValueError(
                "GTPConfig.graph_wgrad_ring_size > 0 defers reduce-scatters across graphs and "
                "needs async_reduction=True (or set graph_wgrad_ring_size=0)"
            )
        if self.pad_for_alignment < 1:
            raise ValueError(
                f"GTPConfig.pad_for_alignment must be >= 1, got {self.pad_for_alignment}"
            )

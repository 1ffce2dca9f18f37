"""Train megatron-core's GPTModel (local spec) with and without GTP, on CPU/gloo.

Every run goes through the real stack: megatron ``parallel_state``, ``GPTModel``, megatron DDP
(our GTP-aware subclass), ``get_megatron_optimizer`` and ``forward_backward_no_pipelining``.
The GPU benchmarks build their models here too (:func:`build` on NCCL, or on the staged backend
with several ranks sharing one GPU; sizes from :class:`Run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from nemo_gtp.cpu.staged_gloo import world_on_gpu
from nemo_gtp.engine import GTPConfig, GTPGroups, GTPParallelDims, is_gtp_param
from nemo_gtp.engine.fp8 import (
    FP8Scaling,
    ScalingKind,
    cast_to_fp8,
    quantize_shard,
    scale_from_amax,
)
from nemo_gtp.engine.fp8_primary import dequantize_fp8_primary, is_fp8_primary, make_fp8_primary
from nemo_gtp.integrations.megatron import (
    GTPDistributedDataParallel,
    gtp_layer_spec,
    gtp_process_groups,
    initialize_gtp_parallel,
    make_finalize_model_grads,
    plan_optimizer_copies,
    preshard_config_layer_spec,
    presharded_grouped_classes,
    shard_model,
)
from nemo_gtp.integrations.megatron.muon import MuonConfig, get_muon_optimizer
from tests.harness import graph_stand_in

VOCAB, SEQ, MBS, MICROBATCHES = 128, 16, 2, 2


@dataclass(frozen=True)
class Run:
    """One training run's layout and options."""

    tp: int = 1
    gtp: int = 1
    # pipeline parallelism: the layers split over PP stages (megatron's 1F1B schedule, PP
    # outermost in the rank order); needs layers % pp == 0
    pp: int = 1
    vp: int = 1  # virtual pipeline stages (model chunks) per rank: megatron's interleaved 1F1B
    microbatches: int = MICROBATCHES  # per step and data rank (1F1B needs >= pp to overlap)
    # share_embeddings_and_output_weights (GPTModel's default: off); under PP a GPU path only
    # (megatron copies the tied embedding to the last stage through CUDA)
    tied: bool = False
    # context parallelism: each sample's sequence over CP ranks (megatron's load-balanced
    # chunks); on CPU the core attention is tests.harness.cp_attention's stand-in
    cp: int = 1
    steps: int = 10
    per_token: bool = False
    distopt: bool = False
    fp32_accum: bool = False
    hidden: int = 64
    ffn: int = 128
    pad: int = 16
    overlap_grad_reduce: bool = True
    gather_backend: str = "process_group"
    ce_min_tokens: int = 4096  # GTPConfig.copy_engine_min_tokens (gather_backend="auto")
    separate_rs: bool = False  # GTPConfig.separate_reduce_scatter_group
    coalesce_mb: float = 0.0  # GTPConfig.coalesce_mb (0.125: one unit per layer at 64/128)
    bf16: bool = False  # bf16 params + megatron's mixed-precision optimizer (fp32 main params)
    presharded: bool = False  # build the linears as shards (gtp_layer_spec): nothing copied in,
    # every shard starts with the unsharded build's rows (design §3.1 "Exact init")
    # Build only the routed experts (EGTP > 1; SequentialMLP, or grouped) as their expert GTP
    # shards, through the strategy's route (preshard_config_layer_spec, dense linears built full
    # and sliced): nothing is copied in, their exact init gives them the unsharded rows.
    preshard_experts: bool = False
    shard_replicated: bool = False  # GTPConfig.shard_replicated_params_over_gtp (needs distopt)
    recompute: str = ""  # activation recompute: "", "full_uniform", "full_block", "selective"
    # (core attention) or "selective_mlp" (the MLP: GTP weights re-gathered in the backward)
    # MoE (megatron SequentialMLP experts, allgather token dispatcher): experts=0 is a dense GPT.
    experts: int = 0  # num_moe_experts
    grouped: bool = False  # TEGroupedMLP experts (TE's GroupedLinear; on CPU its stand-in)
    glu: bool = False  # gated linear unit: fc1 holds [gate; up] (megatron's SwiGLU checkpoint)
    topk: int = 2  # moe_router_topk
    ep: int = 1  # expert_model_parallel_size
    egtp: int = 1  # expert GTP: expert_num_weight_shards = ETP (= TP) x egtp
    moe_ffn: int = 48  # moe_ffn_hidden_size
    capacity: float | None = None  # moe_expert_capacity_factor (token dropping when set)
    aux_loss: float = 0.0  # moe_aux_loss_coeff (load-balancing loss through the router)
    # megatron's per-layer CUDA graphs (cuda_graph_impl="local"): "" off, "full" or "attn".
    # On CUDA the layers are captured; on CPU (no graphs) the model is built with graphs off and
    # the config switched after, so GTP runs the segmented schedule a captured model runs (or,
    # inside tests.harness.graph_stand_in.eager_cuda_graphs, megatron's graph managers run
    # their capture and replay flow with an eager stand-in for CUDA graphs).
    graph_scope: str = ""
    graph_ring: int = 0  # GTPConfig.graph_wgrad_ring_size (the cross-graph wgrad ring)
    # Model size and training knobs the GPU benchmarks set (the tests keep these defaults).
    layers: int = 2
    heads: int = 4
    vocab: int = VOCAB
    seq: int = SEQ  # sequence length (and the model's max sequence length)
    lr: float = 1e-3
    bucket_size: int | None = 20_000  # DDP buckets; None: megatron's default
    # "local" (megatron-local linears) or "te" (TransformerEngine's spec and RNG tracker: GPU)
    spec: str = "local"
    # On GPU a capturable RNG tracker even without graphs, so eager and graphed runs share one
    # tracker kind (with spec="te" TE's tracker is used either way).
    capturable_rng: bool = False
    # FP8 primary weights (design §1.3, per-tensor current scaling; needs distopt): GTP runs
    # make their shards FP8 (make_fp8_primary, megatron's FP8-param path); a run without GTP
    # emulates megatron's FP8 params on the same weights (fp32 masters kept beside the model,
    # the weights their quantize-dequantize after every step: quantize_full_weights).
    fp8_primary: bool = False
    # FP8 primary weights with blockwise scaling of these tiles (rows, columns); None: per-tensor
    # current scaling. The shards' rows must be whole tiles (GTPConfig.pad_for_alignment).
    fp8_block: tuple[int, int] | None = None
    # "adam" (megatron's) or "muon": Muon for the hidden matrices, Adam for the rest
    # (get_muon_optimizer; Newton-Schulz in fp32 so parity holds to fp32 rounding)
    optimizer: str = "adam"

    @property
    def fp8_scaling(self) -> FP8Scaling:
        """The FP8 primary weights' recipe (``fp8_primary``, ``fp8_block``)."""
        if self.fp8_block is None:
            return FP8Scaling("tensorwise")
        return FP8Scaling("blockwise", block=self.fp8_block)

    @property
    def gtp_on(self) -> bool:
        """Whether either weight axis shards (GTP > 1 or expert GTP > 1)."""
        return self.gtp > 1 or self.egtp > 1


_RECOMPUTE = {
    "": {},
    "full_uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full_block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
}


def _batch(
    run: Run, step: int, microbatch: int, data_rank: int, device: str
) -> dict[str, torch.Tensor]:
    """One micro-batch of ``data_rank`` (megatron's data-parallel rank, CP excluded): this CP
    rank's chunks of it."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * microbatch + data_rank)
    seq = run.seq
    tokens = torch.randint(0, run.vocab, (MBS, seq + 1), generator=gen)
    loss_mask = (torch.rand(MBS, seq, generator=gen) > 0.2).float()
    batch = dict(
        tokens=tokens[:, :-1],
        labels=tokens[:, 1:],
        loss_mask=loss_mask,
        position_ids=torch.arange(seq).expand(MBS, seq),
        attention_mask=torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1),
    )
    if run.cp > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)
    return {k: v.to(device) for k, v in batch.items()}


def _forward_step(data_iterator, model):  # noqa: ANN001
    batch = next(data_iterator)
    per_token_loss = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"]

    def loss_func(output: torch.Tensor):
        loss_sum = (output.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": loss_sum.detach()}

    return per_token_loss, loss_func


def full_tensor(param: torch.Tensor, tensor: torch.Tensor, groups) -> torch.Tensor:  # noqa: ANN001
    """``tensor`` (shaped like ``param``) gathered over GTP to the TP-local logical shape."""
    if not is_gtp_param(param):
        return tensor.detach().clone()
    spec = param.gtp_spec
    out = torch.empty(spec.gathered_shape, dtype=tensor.dtype, device=tensor.device)
    # The param's own axis: the GTP group, or the expert GTP group for a routed expert.
    dist.all_gather_into_tensor(out, tensor.detach().contiguous(), group=param.runtime.group)
    return spec.unpad(out).clone()


def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy TP-local full weights ``full`` (by name) into ``model``; GTP shards take their slice.

    Test/benchmark only: gives a model built as shards the initial weights of a full twin.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = full[name].to(param.device, param.dtype)
            param.copy_(param.gtp_spec.shard(source) if is_gtp_param(param) else source)


_GROUPS: dict[tuple[int, ...], GTPGroups] = {}


def _megatron_matches(run: Run) -> bool:
    """Whether megatron's parallel_state has ``run``'s TP, CP and EP sizes."""
    return (
        parallel_state.get_tensor_model_parallel_world_size() == run.tp
        and parallel_state.get_context_parallel_world_size() == run.cp
        and parallel_state.get_expert_model_parallel_world_size() == run.ep
        and parallel_state.get_pipeline_model_parallel_world_size() == run.pp
        and (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) == run.vp
    )


def gtp_groups(run: Run) -> GTPGroups:
    """GTP groups for ``run``, built once per layout and process.

    Process groups are never freed before the process group itself is destroyed, and every
    gloo group owns threads: rebuilding them for each of a test's runs piles up hundreds.
    megatron's parallel_state is rebuilt only when TP, CP, EP or PP changes.
    """
    world = dist.get_world_size()
    key = (world, run.tp, run.cp, run.gtp, run.ep, run.egtp, run.pp, run.vp)
    vp = run.vp if run.vp > 1 else None
    if key not in _GROUPS:
        if parallel_state.model_parallel_is_initialized() and not _megatron_matches(run):
            parallel_state.destroy_model_parallel()
        dims = GTPParallelDims(
            world_size=world,
            tensor_model_parallel_size=run.tp,
            num_weight_shards=run.tp * run.gtp,
            context_parallel_size=run.cp,
            expert_model_parallel_size=run.ep,
            expert_num_weight_shards=run.tp * run.egtp,
            pipeline_model_parallel_size=run.pp,
        )
        _GROUPS[key] = initialize_gtp_parallel(dims, virtual_pipeline_model_parallel_size=vp)
    elif not _megatron_matches(run):
        parallel_state.destroy_model_parallel()
        initialize_gtp_parallel(  # megatron state only
            _GROUPS[key].dims, _GROUPS[key], virtual_pipeline_model_parallel_size=vp
        )
    return _GROUPS[key]


def _experts_presharded(
    spec: object, run: Run, groups: GTPGroups, gtp_config: GTPConfig, on_gpu: bool
) -> object:
    """``spec`` with only its routed experts built as their expert GTP shards, through the
    strategy's route (``preshard_config_layer_spec``; dense linears stay full, sliced later)."""
    from types import SimpleNamespace

    grouped = presharded_grouped_classes(grouped_linear_kinds(on_gpu)) if run.grouped else {}
    holder = SimpleNamespace(transformer_layer_spec=spec)
    preshard_config_layer_spec(holder, groups, gtp_config, classes={}, grouped_classes=grouped)
    return holder.transformer_layer_spec


def _moe_config(run: Run) -> dict:
    """TransformerConfig fields of ``run``'s MoE layers (none for a dense GPT)."""
    if not run.experts:
        return {}
    return dict(
        num_moe_experts=run.experts,
        moe_router_topk=run.topk,
        expert_model_parallel_size=run.ep,
        moe_ffn_hidden_size=run.moe_ffn,
        moe_token_dispatcher_type="allgather",  # the alltoall dispatcher needs CUDA events
        moe_aux_loss_coeff=run.aux_loss,
        moe_expert_capacity_factor=run.capacity,
        moe_token_drop_policy="probs",
    )


def _graph_config(run: Run) -> dict:
    """TransformerConfig fields of ``run``'s per-layer CUDA graphs (none when off)."""
    if not run.graph_scope:
        return {}
    return dict(
        cuda_graph_impl="local", cuda_graph_scope=run.graph_scope, cuda_graph_warmup_steps=2
    )


def grouped_linear_kinds(on_gpu: bool) -> dict[type, bool]:
    """``TEGroupedMLP``'s linear classes (class -> "expert TP splits out_features"): megatron's TE
    wrappers on GPUs with TE, else the CPU stand-ins of ``tests.harness.te_grouped``."""
    from nemo_gtp.integrations.megatron.sharding import te_grouped_linear_kinds
    from tests.harness.te_grouped import grouped_kinds

    return (on_gpu and te_grouped_linear_kinds(import_te=True)) or grouped_kinds()


def layer_spec(run: Run, on_gpu: bool = False) -> object:
    """megatron's GPT layer spec for ``run`` (local, or TransformerEngine's with
    ``run.spec == "te"``); MoE experts as ``SequentialMLP``, or with ``run.grouped`` as
    ``TEGroupedMLP`` around :func:`grouped_linear_kinds`."""
    from tests.harness.te_grouped import with_grouped_experts

    make_spec = (
        get_gpt_layer_with_transformer_engine_spec if run.spec == "te" else get_gpt_layer_local_spec
    )
    spec = make_spec(num_experts=run.experts or None, moe_grouped_gemm=False)
    if run.experts and run.grouped:
        spec = with_grouped_experts(spec, grouped_linear_kinds(on_gpu))
    if run.cp > 1 and run.spec == "local":  # megatron's local attention refuses CP
        from tests.harness.cp_attention import with_context_parallel_attention

        spec = with_context_parallel_attention(spec)
    return spec


def train(run: Run) -> dict:
    """Train ``run`` on the current world; returns per-rank losses, grad norms, grads, weights.

    gloo runs on CPU through the CPU compatibility layer; NCCL (or the staged backend with
    CUDA: ``staged_gloo.world_on_gpu``) runs on the current CUDA device.
    """
    setup = build(run)
    return train_built(setup, run)


def build(run: Run) -> dict:
    """Model, DDP, optimizer and groups for ``run`` (see :func:`train`).

    Returns ``dict(model=..., ddp=..., chunks=..., optimizer=..., groups=..., device=...)``;
    ``model`` is the one GTP sharded (``Float16Module`` with ``bf16``): its ``gtp_runtime`` when
    GTP is on; ``chunks``: every model chunk's DDP (``Run.vp`` of them; ``ddp`` is the first).
    Example::

        setup = build(Run(gtp=2, layers=4, hidden=1024, ffn=4096, heads=16, vocab=8192,
                          seq=512, lr=3e-4, bucket_size=None, distopt=True))
    """
    on_gpu = world_on_gpu()
    if run.spec not in ("local", "te"):
        raise ValueError(f"Run.spec must be 'local' or 'te', got {run.spec!r}")
    if run.spec == "te" and not on_gpu:
        raise ValueError(
            "Run.spec='te' needs TransformerEngine on GPUs (NCCL or staged_gloo); use 'local'"
        )
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    if not on_gpu:
        # Imported here: GPU runs (the NCCL benchmarks) never load the CPU patches. megatron
        # only: importing NeMo for its patches would cost ~7 s CPU per rank.
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat(nemo=False)
    groups = gtp_groups(run)
    if on_gpu:
        # megatron's graph manager needs a capturable RNG tracker (TE's, or its own graph-safe
        # one); rebuilt for every run, since the tracker is process-global.
        model_parallel_cuda_manual_seed(
            1234,
            te_rng_tracker=run.spec == "te",
            use_cudagraphable_rng=bool(run.graph_scope or run.capturable_rng) and run.spec != "te",
            force_reset_rng=True,
        )
    else:
        from nemo_gtp.cpu.compat import model_parallel_cpu_manual_seed

        model_parallel_cpu_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=run.layers,
        hidden_size=run.hidden,
        ffn_hidden_size=run.ffn,
        num_attention_heads=run.heads,
        tensor_model_parallel_size=run.tp,
        context_parallel_size=run.cp,
        pipeline_model_parallel_size=run.pp,
        virtual_pipeline_model_parallel_size=run.vp if run.vp > 1 else None,
        pipeline_dtype=torch.bfloat16 if run.bf16 else torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if run.bf16 else torch.float32,
        bf16=run.bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=run.per_token,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        # No linear biases: the attention key bias has a mathematically zero gradient (softmax
        # shift invariance), so its grad is rounding noise (~1e-11) that Adam normalizes into
        # lr-sized steps of random sign; any two summation orders then diverge by O(lr).
        # Replicated-param handling stays covered by the norms and embeddings here and by the
        # biased nn.Linear engine tests.
        add_bias_linear=False,
        gated_linear_unit=run.glu,
        **_RECOMPUTE[run.recompute],
        **_moe_config(run),
        **(_graph_config(run) if on_gpu or graph_stand_in.active() else {}),
    )
    gtp_config = GTPConfig(
        calculate_per_token_loss=run.per_token,
        pad_for_alignment=run.pad,
        reduce_scatter_with_fp32_accumulation=run.fp32_accum,
        gather_backend=run.gather_backend,
        copy_engine_min_tokens=run.ce_min_tokens,
        separate_reduce_scatter_group=run.separate_rs,
        coalesce_mb=run.coalesce_mb,
        shard_replicated_params_over_gtp=run.shard_replicated,
        graph_wgrad_ring_size=run.graph_ring,
    )
    spec = layer_spec(run, on_gpu)
    chunks = [  # one model per virtual pipeline stage of this rank (one without VPP)
        _model_chunk(run, config, spec, groups, gtp_config, device, on_gpu, vp_stage)
        for vp_stage in ([None] if run.vp == 1 else range(run.vp))
    ]
    if run.graph_scope and not on_gpu and not graph_stand_in.active():
        for key, value in _graph_config(run).items():
            setattr(config, key, value)
    for chunk in chunks:
        if run.gtp_on:  # each chunk its own runtime and chains
            shard_model(chunk, groups, gtp_config)
            if run.fp8_primary:
                make_fp8_primary(chunk.gtp_runtime, run.fp8_scaling)
    pgs = gtp_process_groups(groups, gtp_config)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=run.overlap_grad_reduce,
        use_distributed_optimizer=run.distopt,
        bucket_size=run.bucket_size,
        grad_reduce_in_fp32=True,
    )
    ddps = [  # megatron buckets the first chunk only (its training loop's disable_bucketing)
        GTPDistributedDataParallel(
            config, ddp_config, chunk, pg_collection=pgs, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(chunks)
    ]
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=run.lr,
        clip_grad=1.0,
        weight_decay=0.01,
        bf16=run.bf16,
        use_distributed_optimizer=run.distopt,
    )
    optimizer = build_optimizer(optimizer_config, ddps, pgs, muon=run.optimizer == "muon")
    if run.gtp_on:  # as GTPMegatronStrategy's optimizer setup does
        plan_optimizer_copies(optimizer)
    config.finalize_model_grads_func = make_finalize_model_grads(groups)
    no_sync = [ddp.no_sync for ddp in ddps]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return dict(
        model=chunks[0], ddp=ddps[0], chunks=ddps, optimizer=optimizer, groups=groups, device=device
    )


def _model_chunk(
    run: Run,
    config: TransformerConfig,
    spec: object,
    groups: GTPGroups,
    gtp_config: GTPConfig,
    device: str,
    on_gpu: bool,
    vp_stage: int | None,
) -> torch.nn.Module:
    """This rank's GPTModel for pipeline stage ``vp_stage`` (``None``: no virtual pipeline),
    built full or as GTP shards, not yet sharded by ``shard_model``."""
    stage = dict(  # this rank's pipeline stage (the whole model at PP 1)
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=run.tied,
        vp_stage=vp_stage,
    )
    if run.presharded and run.gtp_on:
        grouped = grouped_linear_kinds(on_gpu) if run.grouped else {}
        spec = gtp_layer_spec(spec, groups, gtp_config, grouped_kinds=grouped)
    elif run.preshard_experts and run.egtp > 1:
        spec = _experts_presharded(spec, run, groups, gtp_config, on_gpu)
    model = GPTModel(config, spec, run.vocab, run.seq, **stage).to(device)
    if run.bf16:  # norms and inputs in bf16 too, as NeMo's precision plugin does
        model = Float16Module(config, model)
    return model


def build_optimizer(config: OptimizerConfig, chunks: list, pgs: object, *, muon: bool) -> object:
    """megatron's optimizer for the DDP-wrapped model ``chunks`` with the GTP process groups
    ``pgs`` (no gloo groups), or with ``muon`` Muon for the hidden matrices and Adam for the
    rest (Newton–Schulz in fp32, so parity holds to fp32 rounding; design §1.6 "Muon")."""
    if muon:
        return get_muon_optimizer(
            config, chunks, MuonConfig(ns_dtype=torch.float32), pg_collection=pgs
        )
    return get_megatron_optimizer(config, chunks, use_gloo_process_groups=False, pg_collection=pgs)


def train_built(setup: dict, run: Run, first_step: int = 0) -> dict:
    """Run ``run.steps`` training steps on a :func:`build` result, from step ``first_step``
    (each step's batches depend on its number: a resumed run continues the same data)."""
    model, chunks, optimizer = setup["model"], setup["chunks"], setup["optimizer"]
    groups, device = setup["groups"], setup["device"]
    data_rank = parallel_state.get_data_parallel_rank()
    named = [  # a chunk's names are its own (layer numbers local): prefixed under VPP
        (f"chunk{i}.{n}" if len(chunks) > 1 else n, p)
        for i, chunk in enumerate(chunks)
        for n, p in chunk.module.named_parameters()
    ]
    out = {"losses": [], "grad_norms": [], "grads": {}, "weights": {}, "data_rank": data_rank}
    out["builds"] = []  # the runtime's chain-building count after each step
    runtime = getattr(model, "gtp_runtime", None)
    forward_backward = get_forward_backward_func()
    # The emulated FP8 params of a run without GTP: fp32 masters kept here (Run.fp8_primary).
    masters = {}
    if run.fp8_primary and not run.gtp_on:
        masters = {n: p for n, p in named if n.endswith(FP8_PRIMARY_WEIGHTS)}
        masters = quantize_full_weights(masters, run.fp8_scaling)
    for step in range(first_step, first_step + run.steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = [_batch(run, step, m, data_rank, device) for m in range(run.microbatches)]
        reduced = forward_backward(
            forward_step_func=_forward_step,
            # the interleaved schedule reads one iterator per chunk
            data_iterator=iter(batches) if len(chunks) == 1 else [iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=run.microbatches,
            seq_length=run.seq,
            micro_batch_size=MBS,
            forward_only=False,
        )
        out["losses"].append([float(r["lm loss"]) for r in reduced])
        if step == first_step and not run.distopt:
            out["grads"] = {n: full_tensor(p, p.main_grad, groups) for n, p in named}
        if masters:  # the optimizer updates the masters, not their quantization
            with torch.no_grad():
                for name, param in named:
                    if name in masters:
                        param.copy_(masters[name])
        _, grad_norm, _ = optimizer.step()
        if masters:
            masters = quantize_full_weights(
                {n: p for n, p in named if n in masters}, run.fp8_scaling
            )
        out["grad_norms"].append(float(grad_norm))
        out["builds"].append(runtime.builds if runtime is not None else 0)
    out["weights"] = {
        n: full_tensor(p, dequantize_fp8_primary(p) if is_fp8_primary(p) else p.data, groups)
        for n, p in named
    }
    out["fp8_primary"] = sorted(n for n, p in named if is_fp8_primary(p) or n in masters)
    if masters:  # at rest the emulated FP8 params hold their fp32 masters (a resume starts there)
        with torch.no_grad():
            for name, param in named:
                if name in masters:
                    param.copy_(masters[name])
    out["optimizer_state_numel"] = optimizer_state_numel(optimizer)
    out["runtime"] = getattr(model, "gtp_runtime", None)
    out["runtimes"] = [getattr(chunk.module, "gtp_runtime", None) for chunk in chunks]
    out["expert_runtime"] = getattr(model, "gtp_expert_runtime", None)
    return out


# The weights GTP shards in the harness's GPT (local spec): Run.fp8_primary's FP8 weights.
FP8_PRIMARY_WEIGHTS = (
    "linear_qkv.weight",
    "linear_proj.weight",
    "linear_fc1.weight",
    "linear_fc2.weight",
)


_TENSORWISE = FP8Scaling("tensorwise")


def _fp8_dequantized(values: torch.Tensor, scaling: FP8Scaling = _TENSORWISE) -> torch.Tensor:
    """``values`` quantized on one rank (default: per-tensor current scaling) and dequantized."""
    return quantize_shard(values.detach(), scaling).dequantize(values.dtype)


def quantize_full_weights(
    params: dict[str, torch.Tensor], scaling: FP8Scaling = _TENSORWISE
) -> dict[str, torch.Tensor]:
    """megatron's FP8 params emulated on full weights (``scaling``: per-tensor current scaling
    or blockwise, the engine's formula and cast): returns each param's value as its fp32
    master, and sets the param to the master quantized on one rank and dequantized.

    Example::

        masters = quantize_full_weights({"decoder.layers.0.mlp.linear_fc1.weight": w})
    """
    masters = {}
    with torch.no_grad():
        for name, param in params.items():
            masters[name] = param.detach().clone()
            param.copy_(_fp8_dequantized(param, scaling))
    return masters


def _own_fp8_weight_entries(model_sd: dict, module: torch.nn.Module, make: Callable) -> None:
    """Give the model entries of the emulated FP8 weights their own tensor ``make(param)``.

    An fp32 param and its distributed-optimizer main param share storage; megatron's FP8 params
    and their fp32 mains do not, and the emulated run's checkpoint must keep them apart too.
    Call it after the optimizer's state dict matched its entries to the params.
    """
    from dataclasses import replace

    weights = [p for n, p in module.named_parameters() if n.endswith(FP8_PRIMARY_WEIGHTS)]
    replaced = 0
    for key, entry in model_sd.items():
        if any(getattr(entry, "data", None) is p for p in weights):
            model_sd[key] = replace(entry, data=make(entry.data))
            replaced += 1
    assert replaced == len(weights), f"{replaced} of {len(weights)} FP8 weight entries found"


def save_emulated_fp8_checkpoint(path: str, setup: dict, scaling: FP8Scaling = _TENSORWISE) -> None:
    """Save a :func:`build` result of a run without GTP and ``Run.fp8_primary`` (at rest: its
    params hold the fp32 masters) as megatron saves FP8 params (design §3.3 "FP8 primary
    weights"): each FP8 weight as its quantize-dequantize in ``scaling`` (the run's
    ``Run.fp8_scaling``), the distributed optimizer's ``fp32_param`` as the master.
    Collective.

    Example::

        save_emulated_fp8_checkpoint(f"{root}/dp2", setup)
    """
    from nemo_gtp.checkpoint.io import save_checkpoint
    from nemo_gtp.checkpoint.optimizer import optimizer_sharded_state_dict
    from nemo_gtp.integrations.megatron.checkpoint import (
        checkpoint_layout,
        gtp_sharded_state_dict,
    )

    module, groups = setup["ddp"].module, setup["groups"]
    model_sd = gtp_sharded_state_dict(module, groups)
    optim_sd = optimizer_sharded_state_dict(setup["optimizer"], model_sd)
    _own_fp8_weight_entries(model_sd, module, lambda t: _fp8_dequantized(t, scaling))
    state = {"model": model_sd, "optimizer": optim_sd}
    save_checkpoint(state, path, layout=checkpoint_layout(model_sd, groups))


def load_emulated_fp8_checkpoint(path: str, setup: dict, *, optimizer: bool = True) -> None:
    """Load a checkpoint into a :func:`build` result of a run without GTP and
    ``Run.fp8_primary``. With ``optimizer`` the params end at rest (their fp32 masters: the
    distributed optimizer's ``fp32_param`` slices, all-gathered); without it they hold the
    stored weights, which is what a plain FP8 run reads. Collective.

    Example::

        load_emulated_fp8_checkpoint(f"{root}/gtp2", setup)
        train_built(setup, run, first_step=2)
    """
    from nemo_gtp.checkpoint.io import load_checkpoint
    from nemo_gtp.checkpoint.optimizer import load_optimizer_state, optimizer_sharded_state_dict
    from nemo_gtp.integrations.megatron.checkpoint import (
        gtp_sharded_state_dict,
        load_gtp_checkpoint,
        load_model_state,
    )

    ddp, groups = setup["ddp"], setup["groups"]
    if not optimizer:
        load_gtp_checkpoint(path, ddp, None, groups)
        return
    model_sd = gtp_sharded_state_dict(ddp.module, groups)
    optim_sd = optimizer_sharded_state_dict(setup["optimizer"], model_sd, is_loading=True)
    _own_fp8_weight_entries(model_sd, ddp.module, lambda t: t.detach().clone())
    loaded = load_checkpoint({"model": model_sd, "optimizer": optim_sd}, path)
    load_model_state(ddp.module, loaded["model"])
    load_optimizer_state(setup["optimizer"], loaded["optimizer"])
    # the main params are views of this rank's slice of the params: all-gather the rest
    ddp.start_param_sync(force_sync=True)


def fp8_primary_write_back_errors(setup: dict) -> list[str]:
    """Which FP8 primary shards of a trained :func:`build` result are not, bit for bit, their
    fp32 main slices (megatron's distributed optimizer), rounded to the training dtype as the
    write-back does, quantized with the scale of the whole master (amax over every rank: all of
    them hold pieces of the same weights; TP 1). Blockwise: each shard's tiles quantized on
    their own (the main slice must be the whole shard: DP 1). Empty when all are. Collective
    over the world.

    Example::

        assert not fp8_primary_write_back_errors(setup)
    """
    optimizers = getattr(setup["optimizer"], "chained_optimizers", [setup["optimizer"]])
    wrong = []
    for name, param in setup["ddp"].module.named_parameters():
        if not is_fp8_primary(param):
            continue
        scaling = param.gtp_state.fp8.scaling
        main = param.main_param  # this rank's fp32 slice of the shard, or None
        if main is not None:
            main = main.detach().to(param.gtp_state.fp8_primary_dtype).float()
        if scaling.kind is ScalingKind.BLOCKWISE:
            assert main is not None and main.numel() == param.numel(), "blockwise check: DP 1"
            want = quantize_shard(main.view(param.shape), scaling, spec=param.gtp_spec)
            if not torch.equal(param.gtp_state.fp8.scale_inv, want.scale_inv):
                wrong.append(f"{name} tile scales")
            if not torch.equal(param.detach().view(torch.uint8), want.data.view(torch.uint8)):
                wrong.append(f"{name} bytes")
            continue
        amax = torch.zeros(1, device=param.device)
        if main is not None:
            amax = main.abs().max().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        scale = scale_from_amax(amax, scaling)
        if not torch.equal(param.gtp_state.fp8.scale, scale):
            wrong.append(f"{name} scale")
        if main is not None:
            (owner,) = [o for o in optimizers if param in o.model_param_gbuf_map]
            start = owner._get_model_param_range_map(param)["param"].start
            flat = param.detach().view(-1)[start : start + main.numel()]
            want = cast_to_fp8(main, scale, scaling)
            if not torch.equal(flat.view(torch.uint8), want.view(torch.uint8)):
                wrong.append(f"{name} bytes")
    return wrong


def optimizer_state_numel(optimizer) -> int:  # noqa: ANN001
    """Elements of Adam's ``exp_avg`` held by this rank, over every chained optimizer."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            total += state["exp_avg"].numel() if "exp_avg" in state else 0
    return total


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    denom = b.double().norm()
    diff = (a.double() - b.double()).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def assert_parity(gtp: dict, ref: dict, tol: float = 1e-5) -> float:
    """GTP results equal the non-GTP reference within ``tol`` relative (fp32).

    Returns the largest relative error seen (losses, grad norms, grads, weights).
    """
    assert gtp["data_rank"] == ref["data_rank"]
    worst = 0.0

    def check(err: float, what: str) -> None:
        nonlocal worst
        worst = max(worst, err)
        assert err <= tol, f"{what}: rel err {err:.3e}"

    for step, (a, b) in enumerate(zip(gtp["losses"], ref["losses"], strict=True)):
        for x, y in zip(a, b, strict=True):
            check(abs(x - y) / abs(y), f"loss step {step} ({x} vs {y})")
    for step, (a, b) in enumerate(zip(gtp["grad_norms"], ref["grad_norms"], strict=True)):
        check(abs(a - b) / abs(b), f"grad norm step {step} ({a} vs {b})")
    assert gtp["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        check(rel_err(gtp["grads"][name], ref["grads"][name]), f"grad {name}")
    assert gtp["weights"].keys() == ref["weights"].keys()
    for name in ref["weights"]:
        check(rel_err(gtp["weights"][name], ref["weights"][name]), f"weight {name}")
    return worst

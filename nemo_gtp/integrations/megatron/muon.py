"""A megatron optimizer with Muon for the hidden matrices and Adam for the rest (design §1.6).

megatron-core 0.15 builds Adam or SGD only. :func:`get_muon_optimizer` builds, per model part
(dense, and routed experts if any), two megatron optimizers over the same param groups megatron
makes (weight-decay and lr multipliers, expert flag; the lr scheduler drives both): Muon
(:class:`~nemo_gtp.engine.muon.GTPMuon`) for every 2D weight that is not the embedding or the
output layer, megatron's own Adam for the rest, chained (``ChainedOptimizer``: one grad norm
over both, one clip, checkpoints of both). It works with and without GTP: the baseline of a GTP
run is the same call without GTP process groups.

Muon needs whole matrices, which megatron's distributed optimizer cuts into flat ranges, so the
optimizer is megatron's non-distributed one (``use_distributed_optimizer=False``; refused
otherwise, naming the setting). Under GTP its state is still 1/GTP per rank: every rank keeps
its shards' fp32 masters and momenta, and :class:`GTPMuon` brings each matrix's Muon input
together on one GTP peer for the step (design §1.6 "Muon").

Example::

    optimizer = get_muon_optimizer(
        OptimizerConfig(optimizer="muon", lr=2e-2, bf16=True), [ddp], MuonConfig(),
        pg_collection=gtp_process_groups(groups),
    )
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer import (
    ChainedOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
)
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_gtp.engine.muon import ADJUST_LR_FNS, NS_COEFFICIENTS, ORTHOGONALIZE, GTPMuon
from nemo_gtp.engine.param import GTPShardedParam, is_gtp_param


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon's own settings; lr and weight decay are the ``OptimizerConfig``'s (and its
    scheduler's), as for Adam (design §1.6 "Muon").

    Example::

        MuonConfig(momentum=0.95, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    adjust_lr_fn: str | None = None
    """``None`` / ``"original"``: ``sqrt(max(1, rows/cols))``; ``"match_rms_adamw"``:
    ``0.2*sqrt(max(rows, cols))`` (Adam's lr and weight decay carry over)."""
    ns_dtype: torch.dtype = torch.bfloat16
    """dtype of the Newton–Schulz iterations (bf16 as Keller Jordan's Muon; fp32 for parity)."""
    gather_bucket_mb: float = 256.0
    """Under GTP: the most gathered Muon input (whole matrices, fp32) one collective moves."""
    lr_mult: float = 1.0
    """Muon's lr relative to the schedule's (Adam's): its param groups' ``lr_mult`` times this
    (NeMo and megatron's schedulers honour ``lr_mult``), e.g. Adam at 3e-4 and Muon at 2e-2 is
    ``lr=3e-4, lr_mult=66.7``; 1 with ``adjust_lr_fn="match_rms_adamw"``, made to share Adam's."""
    orthogonalize: str = "owner"
    """Under GTP: ``"owner"``, each matrix orthogonalized by one GTP peer (1/GTP of the
    Newton–Schulz work per rank), or ``"every_rank"`` (all of it on every peer); same bits."""

    def __post_init__(self) -> None:
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"MuonConfig.adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {self.adjust_lr_fn!r}"
            )
        if not 0 < self.ns_steps < 100:
            raise ValueError(f"MuonConfig.ns_steps must be in 1..99, got {self.ns_steps}")
        if self.lr_mult <= 0:
            raise ValueError(f"MuonConfig.lr_mult must be > 0, got {self.lr_mult}")
        if self.orthogonalize not in ORTHOGONALIZE:
            raise ValueError(
                f"MuonConfig.orthogonalize must be one of {ORTHOGONALIZE}, got "
                f"{self.orthogonalize!r}"
            )


def embedding_params(model_chunks: list[Any]) -> set[int]:
    """ids of every embedding table's params (word, position, token type: megatron's
    ``VocabParallelEmbedding`` and ``torch.nn.Embedding``): lookups, not matrices, for Muon.

    Example::

        takes_muon(model.embedding.position_embeddings.weight, embedding_params([model]))  # False
    """
    found = set()
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, torch.nn.Embedding) or type(module).__name__.endswith(
                "Embedding"
            ):
                found.update(id(p) for p in module.parameters(recurse=False))
    return found


def takes_muon(param: torch.Tensor, embeddings: set[int] = frozenset()) -> bool:
    """Whether Muon updates ``param``: a 2D weight that is neither an embedding table
    (``embeddings``: :func:`embedding_params`) nor the output layer (megatron's
    ``is_embedding_or_output_parameter``). The MoE router's weight is one.

    Example::

        takes_muon(model.decoder.layers[0].mlp.linear_fc1.weight)   # True
    """
    if param.ndim != 2 or id(param) in embeddings:
        return False
    return not getattr(param, "is_embedding_or_output_parameter", False)


def check_muon_config(config: OptimizerConfig) -> None:
    """Refuse the optimizer settings Muon cannot run with, naming each (before any collective).

    Example::

        check_muon_config(OptimizerConfig(use_distributed_optimizer=True))  # ValueError
    """
    if config.use_distributed_optimizer:
        raise ValueError(
            "Muon needs whole matrices and megatron's distributed optimizer cuts params into "
            "flat ranges: set OptimizerConfig.use_distributed_optimizer=False (and the DDP "
            "config's use_distributed_optimizer=False); under GTP each rank still keeps only "
            "its shards' optimizer state"
        )
    for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
        if getattr(config, name, False):
            raise ValueError(f"Muon does not support OptimizerConfig.{name}=True: set it False")


def _grad_scaler(config: OptimizerConfig) -> Any:
    """megatron's choice of loss scaler for a mixed-precision optimizer."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _muon_part(
    config: OptimizerConfig,
    param_groups: list[dict],
    muon: MuonConfig,
    grad_stats_group: torch.distributed.ProcessGroup,
) -> MegatronOptimizer:
    """megatron's non-distributed wrapper around a :class:`GTPMuon` over ``param_groups``."""
    inner = GTPMuon(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=muon.momentum,
        nesterov=muon.nesterov,
        ns_coefficients=muon.ns_coefficients,
        eps=muon.eps,
        ns_steps=muon.ns_steps,
        adjust_lr_fn=muon.adjust_lr_fn,
        ns_dtype=muon.ns_dtype,
        gather_bucket_mb=muon.gather_bucket_mb,
        orthogonalize=muon.orthogonalize,
    )

    def init_state_fn(optimizer: GTPMuon, config: Any = None) -> None:
        optimizer.init_state()

    if config.fp16 or config.bf16:
        wrapper = Float16OptimizerWithFloat16Params(
            inner, config, _grad_scaler(config), init_state_fn
        )
        # The wrapper handed the inner optimizer fp32 copies of the 16-bit params.
        shards: dict[torch.Tensor, GTPShardedParam] = {}
        pairs = zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups)
        for model_group, main_group in pairs:
            for model_param, main_param in zip(model_group, main_group):
                if is_gtp_param(model_param):
                    shards[main_param] = model_param
        for group in wrapper.fp32_from_fp32_groups:
            for param in group:
                if is_gtp_param(param):
                    shards[param] = param
        inner.shard_of = shards.get
    else:
        wrapper = FP32Optimizer(inner, config, init_state_fn)
    wrapper.grad_stats_parallel_group = grad_stats_group
    return wrapper


def split_param_groups(
    groups: list[dict], embeddings: set[int], lr_mult: float = 1.0
) -> tuple[list[dict], list[dict]]:
    """megatron's param groups, each cut into its Muon params (their ``lr_mult`` times
    ``lr_mult``) and the rest; every group kept, maybe empty, in the same order (ranks must hold
    the same groups for checkpoints).

    Example::

        muon, adam = split_param_groups(_get_param_groups(...), embedding_params(chunks))
    """
    muon, adam = [], []
    for group in groups:
        mine = [takes_muon(p, embeddings) for p in group["params"]]
        muon.append(
            {
                **group,
                "params": [p for p, m in zip(group["params"], mine) if m],
                "lr_mult": group.get("lr_mult", 1.0) * lr_mult,
            }
        )
        adam.append({**group, "params": [p for p, m in zip(group["params"], mine) if not m]})
    return muon, adam


def get_muon_optimizer(
    config: OptimizerConfig,
    model_chunks: list[Any],
    muon: MuonConfig | None = None,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    no_weight_decay_cond: Callable | None = None,
    scale_lr_cond: Callable | None = None,
    lr_mult: float = 1.0,
    default_skip_embedding_weight_decay: bool = False,
    **unused: Any,
) -> MegatronOptimizer:
    """``get_megatron_optimizer``'s counterpart with Muon for the hidden matrices (module
    docstring). ``pg_collection``: the GTP collection under GTP (its model-parallel groups
    count every shard once in the grad norm); megatron's own groups when None. ``unused``
    takes ``get_megatron_optimizer``'s other keywords (gloo groups: the non-distributed
    optimizer uses none).

    Example::

        opt = get_muon_optimizer(OptimizerConfig(lr=0.02), [ddp], MuonConfig(), pg_collection=pgs)
        opt.step()   # -> (success, grad norm, zeros)
    """
    check_muon_config(config)
    if config.optimizer == "muon":  # upstream megatron's name for this split: Adam beside it
        config = dataclasses.replace(config, optimizer="adam")
    muon = muon or MuonConfig()
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    groups = _get_param_groups(
        model_chunks,
        no_weight_decay_cond,
        scale_lr_cond,
        lr_mult,
        lr=config.lr,
        min_lr=config.min_lr,
        decoupled_lr=config.decoupled_lr,
        decoupled_min_lr=config.decoupled_min_lr,
        default_skip_embedding_weight_decay=default_skip_embedding_weight_decay,
    )
    embeddings = embedding_params(model_chunks)
    optimizers = []
    for expert, grad_stats_group in ((False, pgs.mp), (True, pgs.tp_ep_pp)):
        part = [g for g in groups if g["is_expert_parallel"] is expert]
        if not part:
            continue
        muon_groups, adam_groups = split_param_groups(part, embeddings, muon.lr_mult)
        optimizers.append(
            _get_megatron_optimizer_based_on_param_groups(
                config,
                model_chunks=model_chunks,
                param_groups=adam_groups,
                model_parallel_group=grad_stats_group,
            )
        )
        optimizers.append(_muon_part(config, muon_groups, muon, grad_stats_group))
    return ChainedOptimizer(optimizers)

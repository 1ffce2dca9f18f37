"""Build, train and fully gather megatron's GPTModel at any (TP, GTP, DP) layout (checkpoint tests).

The same real stack as :mod:`tests.harness.gpt`: megatron ``parallel_state``, ``GPTModel``
(local spec), our GTP-aware megatron DDP, ``get_megatron_optimizer`` and
``forward_backward_no_pipelining``, on CPU/gloo. Layouts change inside one process: megatron's
``parallel_state`` is rebuilt when TP changes, each layout's GTP groups are built once
(``tests.harness.gpt.gtp_groups``).

:func:`full_state` gathers every weight and every optimizer state tensor (fp32 master weight,
Adam ``exp_avg`` / ``exp_avg_sq``) to the full logical tensor (GTP pad stripped, TP
concatenated, distributed-optimizer ranges assembled), so two layouts compare bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from nemo_gtp.cpu.compat import enable_cpu_compat, model_parallel_cpu_manual_seed
from nemo_gtp.engine import GTPConfig, GTPGroups, is_gtp_param
from nemo_gtp.engine.fp8_primary import dequantize_fp8_primary, is_fp8_primary
from nemo_gtp.integrations.megatron import (
    GTPDistributedDataParallel,
    gtp_process_groups,
    make_finalize_model_grads,
    shard_model,
)
from tests.harness.cp_attention import with_context_parallel_attention
from tests.harness.gpt import Run, build_optimizer, gtp_groups
from tests.harness.spawn import DistributedJob, run_distributed, start_distributed

VOCAB, SEQ, MBS, MICROBATCHES = 128, 16, 2, 2
STATE_KINDS = ("fp32_param", "exp_avg", "exp_avg_sq", "momentum_buffer")  # Adam, Muon
COLLECTIVE_TIMEOUT_S = 240  # a rank stuck in a collective fails the spawn instead of hanging


def run_ranks(fn: Callable, world: int, *args: object) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks with a bounded collective timeout."""
    run_distributed(fn, world, *args, timeout_s=COLLECTIVE_TIMEOUT_S)


def start_ranks(fn: Callable, world: int, *args: object) -> DistributedJob:
    """:func:`run_ranks` without waiting: the caller joins the returned job."""
    return start_distributed(fn, world, *args, timeout_s=COLLECTIVE_TIMEOUT_S)


@dataclass(frozen=True)
class Layout:
    """One (TP, CP, GTP) layout on the current world (DP = world / (TP * CP * GTP)) and the
    model shape."""

    tp: int = 1
    gtp: int = 1
    cp: int = 1
    """Context parallelism (the CPU stand-in of TE's CP attention, ``cp_attention``)."""
    pp: int = 1
    """Pipeline parallelism: the model's two layers one per stage (megatron's 1F1B schedule)."""

    ffn: int = 80
    hidden: int = 64
    pad: int = 16
    distopt: bool = True
    glu: bool = False
    """Gated linear unit: megatron stores fc1 through its SwiGLU factory (gate, up halves)."""
    bias: bool = True
    """Linear biases. Off for loss comparisons across layouts: the attention key bias has a zero
    true gradient whose rounding noise Adam turns into lr-sized steps (:mod:`tests.harness.gpt`)."""
    shard_replicated: bool = False
    """``GTPConfig.shard_replicated_params_over_gtp``: two chained optimizers (replicated params
    over DP x GTP, GTP shards over DP) instead of one."""
    muon: bool = False
    """Muon for the hidden matrices, Adam for the rest (``get_muon_optimizer``; needs
    ``distopt=False``): their momenta are checkpointed as Adam's moments are."""
    bucket_size: int | None = 8_000
    """Small: several DDP buckets, so distributed-optimizer ranges cut params mid-row.
    ``None`` (megatron's default, one bucket here) for ``fully_reshardable``: megatron 0.15
    misplaces its state when buckets are padded ("param range exceeds unpadded buffer")."""

    def __str__(self) -> str:
        world = dist.get_world_size() if dist.is_initialized() else None
        dp = world // (self.tp * self.cp * self.gtp * self.pp) if world else "?"
        glu = ",glu" if self.glu else ""
        glu += ",shard_replicated" if self.shard_replicated else ""
        glu += ",muon" if self.muon else ""
        cp = f"·CP{self.cp}" if self.cp > 1 else ""
        cp = f"·PP{self.pp}{cp}" if self.pp > 1 else cp
        return f"TP{self.tp}{cp}·GTP{self.gtp}·DP{dp}(ffn={self.ffn},pad={self.pad}{glu})"


@dataclass
class Built:
    """A built training setup."""

    layout: Layout
    groups: GTPGroups
    ddp: GTPDistributedDataParallel
    optimizer: object
    config: TransformerConfig


def build(layout: Layout, seed: int = 1234) -> Built:
    """(Re)initialize parallel state for ``layout`` and build model, DDP and optimizer."""
    enable_cpu_compat(nemo=False)  # megatron-only: importing NeMo costs ~7 s CPU per rank
    # megatron's state and this layout's GTP groups, built once per process (tests.harness.gpt)
    groups = gtp_groups(Run(tp=layout.tp, gtp=layout.gtp, cp=layout.cp, pp=layout.pp))
    model_parallel_cpu_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=layout.hidden,
        ffn_hidden_size=layout.ffn,
        num_attention_heads=4,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        gated_linear_unit=layout.glu,
        add_bias_linear=layout.bias,
    )
    spec = get_gpt_layer_local_spec()
    if layout.cp > 1:  # megatron's local attention refuses CP
        spec = with_context_parallel_attention(spec)
    model = GPTModel(
        config,
        spec,
        VOCAB,
        SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # (GPTModel's default: untied; tied embeddings under PP are copied through CUDA)
    )
    gtp_config = GTPConfig(
        pad_for_alignment=layout.pad, shard_replicated_params_over_gtp=layout.shard_replicated
    )
    if layout.gtp > 1:
        shard_model(model, groups, gtp_config)
    pgs = gtp_process_groups(groups, gtp_config)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=layout.distopt,
        bucket_size=layout.bucket_size,
        grad_reduce_in_fp32=True,
    )
    ddp = GTPDistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=layout.distopt
    )
    optimizer = build_optimizer(optimizer_config, [ddp], pgs, muon=layout.muon)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "data_parallel_group_gloo"):
            # megatron refuses gloo groups alongside a pg_collection, but its memory-efficient
            # fully_reshardable checkpoint path needs one; on CPU the replicate group is gloo.
            opt.data_parallel_group_gloo = groups.replicate_cp
    config.finalize_model_grads_func = make_finalize_model_grads(groups)
    config.no_sync_func = ddp.no_sync
    return Built(layout, groups, ddp, optimizer, config)


def _batch(step: int, microbatch: int, data_rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * microbatch + data_rank)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
    batch = dict(
        tokens=tokens[:, :-1],
        labels=tokens[:, 1:],
        loss_mask=torch.ones(MBS, SEQ),
        position_ids=torch.arange(SEQ).expand(MBS, SEQ),
        attention_mask=torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
    )
    return get_batch_on_this_cp_rank(batch)  # this CP rank's chunks (all of it at CP 1)


def _forward_step(data_iterator, model):  # noqa: ANN001
    batch = next(data_iterator)
    out = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )

    def loss_func(output: torch.Tensor):
        loss = (output.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def train(built: Built, steps: int, first_step: int = 0) -> list[float]:
    """Run ``steps`` optimizer steps; returns the losses of the first microbatch."""
    data_rank = parallel_state.get_data_parallel_rank()
    losses = []
    for step in range(first_step, first_step + steps):
        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        data = iter([_batch(step, m, data_rank) for m in range(MICROBATCHES)])
        reduced = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[built.ddp],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        built.optimizer.step()
        # the losses live on the last pipeline stage (0.0 on the others)
        losses.append(float(reduced[0]["lm loss"]) if reduced else 0.0)
    return losses


def _inner_optimizers(optimizer: object) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _local_states(built: Built, param: torch.nn.Parameter) -> tuple[int, int, dict] | None:
    """This rank's (start, end, {kind: flat tensor}) of ``param``'s optimizer state, if any."""
    found = _optimizer_states(built.optimizer, param)
    return None if found is None else found[:3]


def _optimizer_states(
    optimizer: object, param: torch.nn.Parameter, kinds: tuple[str, ...] = STATE_KINDS
) -> tuple[int, int, dict, object] | None:
    """This rank's (start, end, {kind: flat tensor}, group the state is sharded over) of
    ``param``'s optimizer state, if any (group ``None``: a whole copy per rank). ``kinds``
    other than :data:`STATE_KINDS` (the fp32 main alone) only for the distributed optimizer."""
    for opt in _inner_optimizers(optimizer):
        if hasattr(opt, "model_param_group_index_map"):  # DistributedOptimizer
            if param not in opt.model_param_group_index_map:
                continue
            rng = opt._get_model_param_range_map(param)["param"]
            tensors = opt._get_main_param_and_optimizer_states(param)
            tensors["fp32_param"] = tensors.pop("param")
            found = {k: tensors[k] for k in kinds if k in tensors}
            return (rng.start, rng.end, found, opt.data_parallel_group)
        state = opt.optimizer.state.get(param)
        if state is not None:
            found = {"fp32_param": param.detach().view(-1)}
            found.update({k: state[k].view(-1) for k in kinds if k in state})
            return (0, param.numel(), found, None)
    return None


def _replicate_group(built: Built, param: torch.nn.Parameter) -> object:
    """The group ``param``'s optimizer state is sharded over (CP x DP: CP peers hold the same
    params)."""
    # shard_replicated_params_over_gtp: the replicated params' state is spread over DP x GTP
    over_data = built.layout.shard_replicated and not is_gtp_param(param)
    return built.groups.data if over_data else built.groups.replicate_cp


def _in_groups(keys: list[object]) -> dict[int, tuple[object, list[int]]]:
    """Indices of ``keys`` by group, in first-appearance order (the same on every rank, so the
    ranks issue one collective per group in the same order)."""
    by_group: dict[int, tuple[object, list[int]]] = {}
    for index, group in enumerate(keys):
        by_group.setdefault(id(group), (group, []))[1].append(index)
    return by_group


def _assemble_many(
    entries: list[tuple[tuple[int, int, dict] | None, torch.nn.Parameter, object]],
    kinds: tuple[str, ...] = STATE_KINDS,
) -> list[dict[str, torch.Tensor]]:
    """Each entry's ``(local states, param, group)`` joined over its group into shard-shaped
    tensors: one ``all_gather_object`` per group for every entry (a collective costs
    milliseconds on a loaded CPU machine; the checkpoint tests assemble hundreds of params)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in entries]
    for group, indices in _in_groups([entry[2] for entry in entries]).values():
        payload = [  # on the host: objects travel pickled (NCCL too)
            None
            if entries[i][0] is None
            else (
                entries[i][0][0],
                entries[i][0][1],
                {k: v.detach().cpu().clone() for k, v in entries[i][0][2].items()},
            )
            for i in indices
        ]
        ranks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, payload, group=group)
        for position, i in enumerate(indices):
            param = entries[i][1]
            held = next((p for rank in ranks if (p := rank[position]) is not None), None)
            assert held is not None, f"no optimizer state for a {tuple(param.shape)} param"
            for kind in [k for k in kinds if k in held[2]]:  # Adam's moments, or Muon's
                flat = torch.full((param.numel(),), float("nan"), dtype=torch.float32)
                covered = torch.zeros(param.numel(), dtype=torch.bool)
                for rank_payload in ranks:
                    part = rank_payload[position]
                    if part is not None:
                        flat[part[0] : part[1]] = part[2][kind]
                        covered[part[0] : part[1]] = True
                assert covered.all(), (
                    f"optimizer state of a {tuple(param.shape)} param not fully covered"
                )
                out[i][kind] = flat.view(param.shape)
    return out


def _every_rank(tensors: list[torch.Tensor], group: object) -> list[list[torch.Tensor]]:
    """Every rank's copy of each of ``tensors`` (same shapes on every rank of ``group``), in
    rank order: one ``all_gather_into_tensor`` per dtype and device for all of them."""
    world = dist.get_world_size(group)
    out: list[list[torch.Tensor]] = [[] for _ in tensors]
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(index)
    for (dtype, device), indices in by_kind.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        gathered = torch.empty(world * flat.numel(), dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
        per_rank, offset = gathered.view(world, -1), 0
        for i in indices:
            size = tensors[i].numel()
            shape = tensors[i].shape
            out[i] = [per_rank[r, offset : offset + size].view(shape) for r in range(world)]
            offset += size
    return out


def gather_logical_many(
    items: list[tuple[str, torch.nn.Parameter, torch.Tensor]], *, glu: bool = False
) -> list[torch.Tensor]:
    """Each ``(name, param, tensor)``'s ``tensor`` (shaped like ``param``) gathered over the
    param's own weight axis (its runtime's GTP or expert GTP group; pad stripped), then over
    TP, with one collective per group and dtype for all of them.

    A GLU ``fc1`` holds ``[gate; up]`` per TP rank; the full tensor is all gates, then all ups.
    """
    tensors = [tensor.detach().contiguous() for _, _, tensor in items]
    sharded = [i for i, (_, param, _) in enumerate(items) if is_gtp_param(param)]
    for group, positions in _in_groups([items[i][1].runtime.group for i in sharded]).values():
        indices = [sharded[j] for j in positions]
        every = _every_rank([tensors[i] for i in indices], group)
        for i, ranks in zip(indices, every, strict=True):
            tensors[i] = items[i][1].gtp_spec.unpad(torch.cat(ranks)).contiguous()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    split = [i for i, item in enumerate(items) if getattr(item[1], "tensor_model_parallel", False)]
    if tp > 1 and split:
        group = parallel_state.get_tensor_model_parallel_group()
        for i, parts in zip(split, _every_rank([tensors[i] for i in split], group), strict=True):
            name, param = items[i][0], items[i][1]
            if glu and ".linear_fc1." in name:
                halves = [part.chunk(2) for part in parts]
                parts = [gate for gate, _ in halves] + [up for _, up in halves]
            tensors[i] = torch.cat(parts, dim=param.partition_dim)
    return [tensor.clone() for tensor in tensors]


def global_layer_names(model: torch.nn.Module) -> dict[str, str]:
    """Param name -> the name it has at PP 1: a pipeline stage numbers its layers from 0,
    megatron's ``layer_number`` (1-based) is the global one."""
    renamed = {}
    for name, _ in model.named_parameters():
        match = re.match(r"(.*decoder\.layers\.)(\d+)(\..*)", name)
        if match:
            layer = model.get_submodule(match[1] + match[2])
            renamed[name] = f"{match[1]}{layer.layer_number - 1}{match[3]}"
        else:
            renamed[name] = name
    return renamed


def full_state(built: Built, *, weights: bool = True) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state as full logical tensors, keyed ``"<kind>/<param name>"``
    (``weights=False``: the optimizer states only). Under PP, layers by their global number and
    every stage's tensors on every rank, so layouts of any PP size compare directly."""
    named = list(built.ddp.module.named_parameters())
    states = _assemble_many(
        [(_local_states(built, param), param, _replicate_group(built, param)) for _, param in named]
    )
    at_pp1 = global_layer_names(built.ddp.module)
    keys, items = [], []
    for (name, param), found in zip(named, states, strict=True):
        if weights:
            keys.append(f"weight/{at_pp1[name]}")
            items.append((name, param, param.data))
        for kind, tensor in found.items():
            keys.append(f"{kind}/{at_pp1[name]}")
            items.append((name, param, tensor))
    full = dict(zip(keys, gather_logical_many(items, glu=built.layout.glu), strict=True))
    if built.layout.pp == 1:
        return full
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    mine = {key: value.cpu() for key, value in full.items()}
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return {key: value for part in stages for key, value in part.items()}


def expert_key(name: str, first: int) -> str:
    """``name`` of a routed-expert param with its global expert index (``first`` = this EP
    rank's first expert): ``SequentialMLP``'s ``experts.local_experts.<i>.linear_fc1.weight`` and
    ``TEGroupedMLP``'s ``experts.linear_fc1.weight<i>`` both become
    ``experts.experts.<first + i>.linear_fc1.weight``; other names are returned as they are."""
    name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"experts.{first + int(m[1])}.", name)
    return re.sub(
        r"experts\.(linear_fc\d)\.weight(\d+)$",
        lambda m: f"experts.experts.{first + int(m[2])}.{m[1]}.weight",
        name,
    )


def _buffer_group(ddp: object, param: torch.nn.Parameter) -> object:
    """The data-parallel group of the DDP buffer holding ``param`` (dense or expert): the group
    megatron's distributed optimizer shards its state over."""
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if param in buffer.param_index_map:
            return buffer.data_parallel_group
    raise KeyError(f"no DDP buffer holds a param of shape {tuple(param.shape)}")


def moe_full_state(
    ddp: object, optimizer: object | None = None, *, moments: bool = True
) -> dict[str, torch.Tensor]:
    """Every weight (and, given the ``optimizer``, every optimizer state; ``moments=False``:
    the fp32 mains alone, e.g. after a weights-only load, before Adam has moments) of a MoE
    model as full logical tensors, keyed ``"<kind>/<name>"`` with routed experts under their
    global index (:func:`expert_key`), merged over every rank (replicas must agree bit for
    bit): two layouts, expert kinds (``SequentialMLP`` / ``TEGroupedMLP``), EP, EGTP or PP sizes
    compare directly. An FP8 primary shard (design §1.3) gives its dequantized weight as
    ``weight/``, its FP8 bytes as ``fp8/``, its ``scale`` and ``scale_inv`` as ``fp8_scale/``
    and ``fp8_scale_inv/``.

    Shards gather over their own runtime's group (GTP or expert GTP); optimizer states over the
    group their optimizer shards them over (dense or expert data parallel). TP must be 1.
    """
    model = ddp.module
    config = model.config
    local_experts = (config.num_moe_experts or 0) // max(
        1, parallel_state.get_expert_model_parallel_world_size()
    )
    first = parallel_state.get_expert_model_parallel_rank() * local_experts
    distributed = any(
        hasattr(opt, "model_param_group_index_map") for opt in _inner_optimizers(optimizer)
    )
    named = list(model.named_parameters())
    kinds = STATE_KINDS if moments else STATE_KINDS[:1]
    found = [
        None if optimizer is None else _optimizer_states(optimizer, param, kinds)
        for _, param in named
    ]
    if distributed:  # ranges of it on other ranks of its DDP buffer's group, maybe not here
        states = _assemble_many(
            [(f and f[:3], p, _buffer_group(ddp, p)) for (_, p), f in zip(named, found)], kinds
        )
    else:
        states = [
            {} if f is None else {k: t.detach().clone().view(p.shape) for k, t in f[2].items()}
            for (_, p), f in zip(named, found)
        ]
    local, keys, items = {}, [], []
    at_pp1 = global_layer_names(model)  # under PP each stage's layers by their global number
    for (name, param), param_states in zip(named, states, strict=True):
        key = expert_key(at_pp1[name], first)
        if is_fp8_primary(param):
            fp8 = param.gtp_state.fp8
            weight = dequantize_fp8_primary(param)
            keys.append(f"fp8/{key}")
            items.append((name, param, param.view(torch.uint8)))
            local[f"fp8_scale/{key}"] = fp8.scale.detach().clone().cpu()
            local[f"fp8_scale_inv/{key}"] = fp8.scale_inv.detach().clone().cpu()
        else:
            weight = param.data
        keys.append(f"weight/{key}")
        items.append((name, param, weight))
        for kind, tensor in param_states.items():
            keys.append(f"{kind}/{key}")
            items.append((name, param, tensor.to(param.device)))
    for key, full in zip(keys, gather_logical_many(items), strict=True):
        local[key] = full.cpu()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        for key, value in part.items():
            assert key not in merged or torch.equal(merged[key], value), f"replicas differ: {key}"
            merged[key] = value
    return merged


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> int:
    """Bitwise equality of two :func:`full_state` dicts; returns the number of tensors compared."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key in want:
        assert got[key].shape == want[key].shape, (key, got[key].shape, want[key].shape)
        if not torch.equal(got[key], want[key]):
            diff = (got[key] - want[key]).abs().max().item()
            raise AssertionError(f"{key}: loaded state differs from saved (max abs diff {diff})")
    return len(want)

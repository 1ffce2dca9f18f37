"""Linears built as their GTP shard (design §3.1 "One init path"), on megatron-local classes.

The pre-sharding mixin and the spec rewrite are the same for TE's wrappers (GPU only, see
``bench/te_gpt_nccl.py``) and megatron's local linears, so the local classes exercise them here
on CPU/gloo: shapes, padding, exact init (design §3.1 "Exact init"), bias width, registration by
``shard_model``, and a GPT built from a rewritten spec, nothing copied in, matching the non-GTP
run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from nemo_gtp.cpu.compat import enable_cpu_compat
from nemo_gtp.engine import GTPConfig
from nemo_gtp.integrations.megatron import (
    GTPShardPlan,
    replace_modules_in_spec,
    shard_model,
    validate_model_config_for_gtp,
)
from nemo_gtp.integrations.megatron.sharding.built import PreShardedLinearMixin, presharded_class
from nemo_gtp.integrations.megatron.sharding.spec import presharded_classes
from tests.harness.gpt import Run, assert_parity, build, gtp_groups, train, train_built
from tests.harness.spawn import run_distributed


def _config(**overrides: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=True,
        gradient_accumulation_fusion=False,
        **overrides,
    )


def test_spec_rewrite_swaps_parallel_linears_only() -> None:
    plan = GTPShardPlan(gtp_size=2, gtp_rank=1, pad_for_alignment=16)
    spec = get_gpt_layer_local_spec()
    new = replace_modules_in_spec(spec, presharded_classes(), {"gtp": plan})
    attn, mlp = new.submodules.self_attention.submodules, new.submodules.mlp.submodules
    for entry, base in (
        (attn.linear_qkv, ColumnParallelLinear),
        (attn.linear_proj, RowParallelLinear),
        (mlp.linear_fc1, ColumnParallelLinear),
        (mlp.linear_fc2, RowParallelLinear),
    ):
        assert isinstance(entry, ModuleSpec) and entry.params == {"gtp": plan}
        assert issubclass(entry.module, base) and entry.module is not base
    # the input spec is untouched; parts without linears are shared, not copied
    assert spec.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert new.submodules.input_layernorm is spec.submodules.input_layernorm
    assert attn.core_attention is spec.submodules.self_attention.submodules.core_attention
    # a ModuleSpec of a swapped class keeps its own params; block specs are walked too
    block = TransformerBlockSubmodules(
        layer_specs=[spec, ModuleSpec(module=ColumnParallelLinear, params={"gather_output": False})]
    )
    new_block = replace_modules_in_spec(block, presharded_classes(), {"gtp": plan})
    assert new_block.layer_specs[1].params == {"gather_output": False, "gtp": plan}
    assert block.layer_specs[1].module is ColumnParallelLinear


def test_delay_wgrad_compute_is_rejected() -> None:
    config = _config()
    config.delay_wgrad_compute = True  # megatron only allows it with MoE overlap; GTP never
    with pytest.raises(ValueError, match="delay_wgrad_compute=True is incompatible with GTP"):
        validate_model_config_for_gtp(config)
    cls = presharded_class(ColumnParallelLinear, column=True)
    with pytest.raises(ValueError, match="delay_wgrad_compute"):
        cls(
            16,
            72,
            gtp=GTPShardPlan(2, 0),
            config=config,
            init_method=torch.nn.init.normal_,
            bias=False,
            gather_output=False,
        )


def _gather(param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    spec = param.gtp_spec
    out = torch.empty(spec.gathered_shape, dtype=param.dtype)
    dist.all_gather_into_tensor(out, param.detach().contiguous(), group=group)
    return out


def _linears(config: TransformerConfig, plan: GTPShardPlan | None) -> tuple:
    """fc1 (column-parallel, 16 -> 72) and fc2 (row-parallel, 72 -> 40), built as shards of
    ``plan`` or, without one, full."""
    kinds = [(ColumnParallelLinear, True), (RowParallelLinear, False)]
    if plan is not None:
        kinds = [(presharded_class(cls, column=col), col) for cls, col in kinds]
    extra = {} if plan is None else {"gtp": plan}
    (col_cls, _), (row_cls, _) = kinds
    column = col_cls(
        16,
        72,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=True,
        gather_output=False,
        skip_bias_add=False,
        **extra,
    )
    row = row_cls(
        72,
        40,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        **extra,
    )
    return column, row


def _unit_checks(groups) -> None:  # noqa: ANN001
    config = _config()
    plan = GTPShardPlan.from_groups(groups, pad_for_alignment=16)
    torch.manual_seed(11)
    full_column, full_row = _linears(config, None)
    after = torch.randn(3)
    torch.manual_seed(11)
    column, row = _linears(config, plan)
    # exact init: the shards tile the unsharded build's weights, and the RNG stream is left
    # where the unsharded build leaves it (every later draw matches the run without GTP too)
    assert torch.equal(torch.randn(3), after)
    # 72 rows padded to a multiple of 16 x 2 = 96: shards of 48, rank 1 holds 24 zero pad rows
    assert column.weight.shape == (48, 16) and column.weight.gtp_spec.logical_shape == (72, 16)
    assert column.bias.shape == (72,) and not column.bias.any()
    assert column.output_size_per_partition == 72
    assert row.weight.shape == (32, 72) and row.bias.shape == (40,)
    full_col = _gather(column.weight, groups.gtp)
    assert not full_col[72:].any()
    assert torch.equal(full_col[:72], full_column.weight.detach())
    assert torch.equal(_gather(row.weight, groups.gtp)[:40], full_row.weight.detach())
    # shard_model registers the pre-built shards (no slicing) and drives them like its own
    model = torch.nn.ModuleDict({"fc1": column, "fc2": row})
    runtime = shard_model(model, groups, GTPConfig(pad_for_alignment=16))
    assert {p.gtp_state.name for p in runtime.params} == {"fc1.weight", "fc2.weight"}
    full_row = _gather(row.weight, groups.gtp)[:40]
    with torch.no_grad():
        column.bias.normal_()
    torch.manual_seed(7 + groups.gtp_rank)
    x = torch.randn(5, 3, 16, requires_grad=True)
    hidden, _ = column(x)
    out, _ = row(torch.relu(hidden))
    out.square().sum().backward()
    runtime.drain()
    xr = x.detach().clone().requires_grad_()
    wc = full_col[:72].clone().requires_grad_()
    wr = full_row.clone().requires_grad_()
    ref = torch.relu(xr @ wc.t() + column.bias.detach()) @ wr.t() + row.bias.detach()
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(x.grad, xr.grad, atol=1e-5)
    for param, ref_grad in ((column.weight, wc.grad), (row.weight, wr.grad)):
        total = torch.zeros(param.gtp_spec.gathered_shape)
        total[: ref_grad.shape[0]] = ref_grad
        dist.all_reduce(total, group=groups.gtp)
        spec = param.gtp_spec
        shard = total[spec.gtp_rank * spec.shard_dim0 : (spec.gtp_rank + 1) * spec.shard_dim0]
        assert torch.allclose(param.grad, shard / spec.gtp_size, atol=1e-5)


def _worker(rank: int, world: int) -> None:
    enable_cpu_compat(nemo=False)  # megatron only (importing NeMo costs ~7 s CPU per rank)
    run = Run(gtp=2, presharded=True, steps=4)
    _unit_checks(gtp_groups(run))
    for case in (run, dataclasses.replace(run, ffn=72, hidden=48)):
        setup = build(case)
        layer = setup["model"].decoder.layers[0]
        assert type(layer.mlp.linear_fc1).__name__ == "GTPColumnParallelLinear"
        assert type(layer.self_attention.linear_proj).__name__ == "GTPRowParallelLinear"
        result = train_built(setup, case)
        assert len(result["runtime"].params) == 8  # 2 layers x (qkv, proj, fc1, fc2)
        assert_parity(result, train(dataclasses.replace(case, gtp=1, presharded=False)))


def test_presharded_local_linears_gloo() -> None:
    run_distributed(_worker, 2)


def _fake_rank_groups(gtp: int) -> object:
    """This rank's GTPGroups arithmetic without process groups (the spec rewrite uses no
    collective; it only reads the GTP size and rank)."""
    from nemo_gtp.engine import GTPGroups, GTPParallelDims

    dims = GTPParallelDims(world_size=gtp, tensor_model_parallel_size=1, num_weight_shards=gtp)
    return GTPGroups(dims, gtp - 1, *([None] * len(dims.group_ranks())))


def _linear_classes(spec: object) -> set[type]:
    found: set[type] = set()

    def walk(node: object) -> None:
        if isinstance(node, type) and issubclass(node, torch.nn.Module):
            found.add(node)
        elif isinstance(node, ModuleSpec):
            walk(node.module)
            walk(node.submodules)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                walk(getattr(node, field.name))

    walk(spec)
    return {cls for cls in found if issubclass(cls, (ColumnParallelLinear, RowParallelLinear))}


def test_strategy_config_spec_rewrite() -> None:
    """What GTPMegatronStrategy does to a NeMo GPTConfig before ``configure_model``."""
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp.integrations.megatron import preshard_config_layer_spec

    groups = _fake_rank_groups(2)
    config = llm.GPTConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, transformer_layer_spec=local_layer_spec
    )
    # Default classes = the loaded TE wrappers; without TE nothing changes (local linears keep
    # the build-full-then-slice path that starts bit-identical to the non-GTP run).
    assert "transformer_engine" not in __import__("sys").modules
    assert preshard_config_layer_spec(config, groups) is False
    assert config.transformer_layer_spec is local_layer_spec
    # The same rewrite on the local classes: NeMo's spec function gets wrapped, once.
    assert preshard_config_layer_spec(config, groups, GTPConfig(), classes=presharded_classes())
    wrapped = config.transformer_layer_spec
    assert wrapped is not local_layer_spec and wrapped.gtp_presharded
    assert preshard_config_layer_spec(config, groups, classes=presharded_classes())
    assert config.transformer_layer_spec is wrapped
    built = _linear_classes(wrapped(config))
    assert built and all(issubclass(cls, PreShardedLinearMixin) for cls in built), built
    # A ModuleSpec is rewritten in place of the attribute.
    config.transformer_layer_spec = get_gpt_layer_local_spec()
    assert preshard_config_layer_spec(config, groups, classes=presharded_classes())
    assert ColumnParallelLinear not in _linear_classes(config.transformer_layer_spec)
    # preshard_linears="none": "all" would swap the local linears; "none" swaps nothing.
    config.transformer_layer_spec = local_layer_spec
    assert preshard_config_layer_spec(config, groups, GTPConfig(preshard_linears="all"))
    config.transformer_layer_spec = local_layer_spec
    assert preshard_config_layer_spec(config, groups, GTPConfig(preshard_linears="none")) is False
    assert config.transformer_layer_spec is local_layer_spec
    # GTP size 1: untouched.
    assert (
        preshard_config_layer_spec(config, _fake_rank_groups(1), classes=presharded_classes())
        is False
    )
    assert config.transformer_layer_spec is local_layer_spec


def test_grouped_expert_spec_rewrite() -> None:
    """Under expert GTP, ``TEGroupedMLP``'s grouped-expert linears are swapped for their
    pre-sharded subclasses with the *expert* plan (TE's wrappers by default, the CPU stand-ins
    here); dense linears only under GTP > 1; ``preshard_linears="none"`` keeps the default
    classes (design §3.1 "Exact init")."""
    from types import SimpleNamespace

    from nemo_gtp.engine import GTPGroups, GTPParallelDims
    from nemo_gtp.integrations.megatron import (
        gtp_layer_spec,
        preshard_config_layer_spec,
        presharded_grouped_class,
        presharded_grouped_classes,
    )
    from tests.harness.gpt import layer_spec
    from tests.harness.te_grouped import (
        CPUColumnParallelGroupedLinear,
        CPURowParallelGroupedLinear,
        grouped_kinds,
    )

    dims = GTPParallelDims(world_size=4, expert_num_weight_shards=2)  # GTP1 · EGTP2 · EDP2
    groups = GTPGroups(dims, 3, *([None] * len(dims.group_ranks())))
    plan = GTPShardPlan(2, groups.expert_gtp_rank, 8)
    spec = layer_spec(Run(experts=4, grouped=True))
    new = gtp_layer_spec(
        spec, groups, GTPConfig(pad_for_alignment=8), grouped_kinds=grouped_kinds()
    )
    experts = new.submodules.mlp.submodules.experts.submodules
    for entry, base, column in (
        (experts.linear_fc1, CPUColumnParallelGroupedLinear, True),
        (experts.linear_fc2, CPURowParallelGroupedLinear, False),
    ):
        assert entry.module is presharded_grouped_class(base, column)
        assert entry.params == {"gtp": plan}
    assert new.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear  # GTP 1
    # the default grouped kinds: TE's wrappers and whatever the spec's TEGroupedMLP names
    assert gtp_layer_spec(spec, groups, GTPConfig(pad_for_alignment=8)) == new
    # a trainer's config: by default the grouped linears the spec's TEGroupedMLP names (here
    # the stand-ins), in a ModuleSpec and in what a spec function returns (NeMo's form); the
    # default SequentialMLP expert classes find no SequentialMLP here
    classes = presharded_grouped_classes(grouped_kinds())
    for given in (spec, lambda _config: spec):
        config = SimpleNamespace(transformer_layer_spec=given)
        assert preshard_config_layer_spec(config, groups)
        built = config.transformer_layer_spec
        built = built if isinstance(built, type(spec)) else built(config)
        experts = built.submodules.mlp.submodules.experts.submodules
        assert experts.linear_fc1.module is classes[CPUColumnParallelGroupedLinear]
        assert experts.linear_fc2.module is classes[CPURowParallelGroupedLinear]
        assert experts.linear_fc2.params == {"gtp": GTPShardPlan(2, groups.expert_gtp_rank, 16)}
        assert preshard_config_layer_spec(config, groups)  # a second call swaps nothing twice
        again = config.transformer_layer_spec
        again = again if isinstance(again, type(spec)) else again(config)
        assert (
            again.submodules.mlp.submodules.experts.submodules.linear_fc1.module
            is (classes[CPUColumnParallelGroupedLinear])
        )
    config = SimpleNamespace(transformer_layer_spec=spec)
    assert preshard_config_layer_spec(config, groups, grouped_classes={})  # none given: none
    assert config.transformer_layer_spec is spec
    config = SimpleNamespace(transformer_layer_spec=spec)
    assert preshard_config_layer_spec(config, groups, GTPConfig(preshard_linears="none")) is False
    assert config.transformer_layer_spec is spec


def test_sequential_expert_spec_rewrite() -> None:
    """Under expert GTP, ``SequentialMLP``'s expert linears (and only those: not the shared
    experts', not the dense MLP's) are swapped for their expert pre-sharded subclasses with the
    *expert* plan, by ``gtp_layer_spec`` and by the strategy's ``preshard_config_layer_spec``
    (default ``preshard_linears``; ``"none"`` swaps nothing); dense linears with the dense plan
    only under GTP > 1 (design §3.1 "Exact init")."""
    from types import SimpleNamespace

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from nemo_gtp.engine import GTPGroups, GTPParallelDims
    from nemo_gtp.integrations.megatron import gtp_layer_spec, preshard_config_layer_spec

    dims = GTPParallelDims(world_size=8, num_weight_shards=2, expert_num_weight_shards=4)
    groups = GTPGroups(dims, 7, *([None] * len(dims.group_ranks())))  # GTP2 · EGTP4
    dense, expert = GTPShardPlan(2, 1, 8), GTPShardPlan(4, 3, 8)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    moe = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    spec.submodules.mlp = moe  # with shared experts (dense linears inside the MoE layer)
    cfg = GTPConfig(pad_for_alignment=8)

    def expert_entries(new: object) -> tuple:
        experts = new.submodules.mlp.submodules.experts.submodules
        return experts.linear_fc1, experts.linear_fc2

    new = gtp_layer_spec(spec, groups, cfg)
    for entry, base, column in zip(
        expert_entries(new), (ColumnParallelLinear, RowParallelLinear), (True, False)
    ):
        assert entry.module is presharded_class(base, column, expert=True)
        assert entry.module.__name__ == f"GTPExpert{base.__name__}" and entry.params == {
            "gtp": expert
        }
    shared = new.submodules.mlp.submodules.shared_experts.submodules
    for entry in (shared.linear_fc1, new.submodules.self_attention.submodules.linear_qkv):
        assert entry.module is presharded_class(ColumnParallelLinear, True)
        assert entry.params == {"gtp": dense}
    assert spec.submodules.mlp.submodules.experts.submodules.linear_fc1 is ColumnParallelLinear
    # the strategy's route: experts only (local dense linears keep build-full-then-slice)
    config = SimpleNamespace(transformer_layer_spec=spec)
    assert preshard_config_layer_spec(config, groups, cfg)
    new = config.transformer_layer_spec
    assert [e.module for e in expert_entries(new)] == [
        presharded_class(ColumnParallelLinear, True, expert=True),
        presharded_class(RowParallelLinear, False, expert=True),
    ]
    assert new.submodules.mlp.submodules.shared_experts is moe.submodules.shared_experts
    assert new.submodules.self_attention is spec.submodules.self_attention
    config = SimpleNamespace(transformer_layer_spec=spec)
    assert preshard_config_layer_spec(config, groups, GTPConfig(preshard_linears="none")) is False
    assert config.transformer_layer_spec is spec


def test_exact_init_follows_megatron_cpu_initialization() -> None:
    """``rows_of_full_init`` on megatron's CPU-initialization master weight (TP-global, every TP
    rank's shard stacked when built pre-sharded) gives each TP rank exactly its GTP rows of the
    unsharded layer's TP-local weight, and leaves the RNG where the unsharded init leaves it:
    column- and row-parallel at TP2 · GTP2 with padding (72 rows -> 2 x 48)."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from nemo_gtp.integrations.megatron.sharding import rows_of_full_init

    out, inp, tp = 144, 24, 2
    for column in (True, False):
        logical = (out // tp, inp) if column else (out, inp // tp)
        for tp_rank in range(tp):
            torch.manual_seed(3)
            full = torch.empty(logical)
            dim = 0 if column else 1
            _initialize_affine_weight_cpu(
                full,
                out,
                inp,
                logical[dim],
                dim,
                torch.nn.init.normal_,
                rank=tp_rank,
                world_size=tp,
            )
            after = torch.randn(3)
            for gtp_rank in range(2):
                spec = GTPShardPlan(2, gtp_rank, 16).spec_for(logical)
                rows = spec.shard_dim0 * (tp if column else 1)
                shard = torch.empty(spec.shard_shape)
                torch.manual_seed(3)
                _initialize_affine_weight_cpu(
                    shard,
                    rows,
                    inp,
                    spec.shard_dim0 if column else inp // tp,
                    dim,
                    rows_of_full_init(torch.nn.init.normal_, spec),
                    rank=tp_rank,
                    world_size=tp,
                )
                assert torch.equal(shard, spec.shard(full)), (column, tp_rank, gtp_rank)
                assert torch.equal(torch.randn(3), after)
    spec = GTPShardPlan(2, 0, 16).spec_for((72, 24))
    with pytest.raises(ValueError, match="expected a multiple of the shard's 48 rows"):
        rows_of_full_init(torch.nn.init.normal_, spec)(torch.empty(50, 24))


def test_expert_class_refusals() -> None:
    """The expert pre-sharded class refuses a non-expert linear and megatron's interleaved
    ``stride``, each naming the setting (before anything is allocated)."""
    cls = presharded_class(ColumnParallelLinear, column=True, expert=True)
    kwargs = dict(
        gtp=GTPShardPlan(2, 0), config=_config(), init_method=torch.nn.init.normal_, bias=False
    )
    with pytest.raises(ValueError, match="is_expert=False.*preshard_linears='none'"):
        cls(16, 72, gather_output=False, **kwargs)
    with pytest.raises(ValueError, match="stride=2.*preshard_linears='none'"):
        cls(16, 72, gather_output=False, is_expert=True, stride=2, **kwargs)

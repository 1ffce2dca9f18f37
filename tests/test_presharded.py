"""Linears built as their GTP shard (seed §3.1 "One init path"), on megatron-local classes.

The pre-sharding mixin and the spec rewrite are the same for TE's wrappers (GPU only, see
``bench/te_gpt_nccl.py``) and megatron's local linears, so the local classes exercise them here
on CPU/gloo: shapes, padding, per-peer init, bias width, registration by ``shard_model``, and a
GPT trained from a rewritten spec matching the non-GTP run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_harness import Run, _groups, assert_parity, build, train, train_built
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from nemo_gtp.cpu_compat import enable_cpu_compat
from nemo_gtp.engine import GTPConfig
from nemo_gtp.integrations.megatron import (
    GTPShardPlan,
    replace_modules_in_spec,
    shard_model,
    validate_model_config_for_gtp,
)
from nemo_gtp.integrations.megatron.presharded import presharded_class
from nemo_gtp.integrations.megatron.spec_rewrite import presharded_classes


def _config(**overrides: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=True, gradient_accumulation_fusion=False,
        **overrides,
    )


def test_spec_rewrite_swaps_parallel_linears_only() -> None:
    plan = GTPShardPlan(gtp_size=2, gtp_rank=1, pad_for_alignment=16)
    spec = get_gpt_layer_local_spec()
    new = replace_modules_in_spec(spec, presharded_classes(), {"gtp": plan})
    attn, mlp = new.submodules.self_attention.submodules, new.submodules.mlp.submodules
    for entry, base in ((attn.linear_qkv, ColumnParallelLinear), (attn.linear_proj,
                        RowParallelLinear), (mlp.linear_fc1, ColumnParallelLinear),
                        (mlp.linear_fc2, RowParallelLinear)):
        assert isinstance(entry, ModuleSpec) and entry.params == {"gtp": plan}
        assert issubclass(entry.module, base) and entry.module is not base
    # the input spec is untouched; parts without linears are shared, not copied
    assert spec.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert new.submodules.input_layernorm is spec.submodules.input_layernorm
    assert attn.core_attention is spec.submodules.self_attention.submodules.core_attention
    # a ModuleSpec of a swapped class keeps its own params; block specs are walked too
    block = TransformerBlockSubmodules(layer_specs=[
        spec, ModuleSpec(module=ColumnParallelLinear, params={"gather_output": False})])
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
        cls(16, 72, gtp=GTPShardPlan(2, 0), config=config, init_method=torch.nn.init.normal_,
            bias=False, gather_output=False)


def _gather(param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    spec = param.gtp_spec
    out = torch.empty(spec.gathered_shape, dtype=param.dtype)
    dist.all_gather_into_tensor(out, param.detach().contiguous(), group=group)
    return out


def _unit_checks(groups) -> None:  # noqa: ANN001
    config = _config()
    plan = GTPShardPlan.from_groups(groups, pad_for_alignment=16)
    column = presharded_class(ColumnParallelLinear, column=True)(
        16, 72, gtp=plan, config=config, init_method=torch.nn.init.normal_, bias=True,
        gather_output=False, skip_bias_add=False)
    row = presharded_class(RowParallelLinear, column=False)(
        72, 40, gtp=plan, config=config, init_method=torch.nn.init.normal_, bias=True,
        input_is_parallel=True, skip_bias_add=False)
    # 72 rows padded to a multiple of 16 x 2 = 96: shards of 48, rank 1 holds 24 zero pad rows
    assert column.weight.shape == (48, 16) and column.weight.gtp_spec.logical_shape == (72, 16)
    assert column.bias.shape == (72,) and not column.bias.any()
    assert column.output_size_per_partition == 72
    assert row.weight.shape == (32, 72) and row.bias.shape == (40,)
    full_col = _gather(column.weight, groups.gtp)
    assert not full_col[72:].any()
    assert not torch.equal(full_col[:24], full_col[48:72])  # each peer drew its own shard
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
    enable_cpu_compat()
    run = Run(gtp=2, presharded=True, steps=4)
    _unit_checks(_groups(run))
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

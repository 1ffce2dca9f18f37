"""GTPShardedParam's TransformerEngine DistributedWeight protocol, driven as TE's dispatchers do.

TE cannot run on CPU, so its dispatchers are mirrored from TE's documented contract
(``nemo_gtp.testing.te_grouped``): list-shaped, leader = ``weights[0]``, a plain tensor passes
through. Collectives are real (gloo). Weight groups (TE ``GroupedLinear`` experts) are driven
through megatron's ``TEGroupedMLP`` in ``tests/test_moe.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime, shard_linear
from nemo_gtp.testing.spawn import run_distributed
from nemo_gtp.testing.te_grouped import (
    finalize_weight_grads,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)


def _chain_steady_state(groups: object, rank: int, world: int) -> None:
    """A TE model's protocol call order with coalescing units: after the first (observing)
    step, every gather is prefetched into its own ticket — no skipped prefetch, no fallback
    buffer, no weight gathered twice — although a protocol weight holds its buffer until the
    next consume (across the chain's commit too), and the wgrads still reduce exactly."""
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64)]  # qkv, proj, fc1, fc2 of one layer
    layer_bytes = sum(o * i * 4 for o, i in shapes)
    config = GTPConfig(coalesce_mb=2 * layer_bytes / 2**20, pad_for_alignment=8)  # 2 layers
    runtime = GTPRuntime(groups, config)
    weights = []
    for layer in range(3):
        for j, (out_f, in_f) in enumerate(shapes):
            torch.manual_seed(layer * 4 + j)
            weight = shard_linear(torch.nn.Linear(in_f, out_f, bias=False), runtime, f"{layer}.{j}")
            weight.main_grad = torch.zeros_like(weight)
            weights.append(weight)
    n = len(weights)
    for step in range(3):
        runtime.stats.reset()
        for weight in weights:  # TE's forward: autograd functions run with grad mode off
            weight.gtp_state.forward_grad_enabled = True  # what record_grad_mode notes
            with torch.no_grad():
                materialize_weight_for_forward([weight])
        for weight in reversed(weights):
            (full,) = materialize_weight_for_backward([weight])
            finalize_weight_grads([weight], [torch.full_like(full, float(rank + 1))])
        runtime.drain()
        stats = runtime.stats
        assert (stats.gathers, stats.reduce_scatters) == (2 * n, n), (step, stats)
        if step:
            assert (stats.prefetch_skipped, stats.fallback_allocations) == (0, 0), (step, stats)
            assert stats.prefetches == 2 * n - 1, (step, stats)  # all but the chain head
    mean = sum(range(1, world + 1)) / world
    for weight in weights:
        assert torch.equal(weight.main_grad, torch.full_like(weight, 3 * mean))
    assert runtime.outstanding() == {"gathers": 0, "reduce_scatters": 0}


def _worker(rank: int, world: int) -> None:
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 40, bias=False)
    full = linear.weight.detach().clone()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=16))
    weight = shard_linear(linear, runtime, "fc.weight")
    weight.main_grad = torch.zeros_like(weight)
    fired = []
    weight.register_grad_accum_hook(lambda: fired.append(1))

    plain = torch.zeros(3)
    assert materialize_weight_for_forward([plain])[0] is plain
    (w_fwd,) = materialize_weight_for_forward([weight])
    assert w_fwd.shape == (40, 16) and torch.equal(w_fwd, full)
    # TE's LayerNormLinear computes the wgrad only if the tensor it is handed requires grad
    assert w_fwd.requires_grad and w_fwd.is_leaf
    (w_bwd,) = materialize_weight_for_backward([weight])
    assert torch.equal(w_bwd, full)

    spec = weight.gtp_spec
    expected = torch.zeros(spec.gathered_shape)
    # 1) an unfused wgrad TE computed itself (any logical-shape tensor): copied, reduced
    torch.manual_seed(10 + rank)
    wgrad = torch.randn(40, 16)
    assert finalize_weight_grads([weight], [wgrad]) == [None]  # async: TE returns no grad
    total = wgrad.clone()
    dist.all_reduce(total)
    expected[:40] += total / world
    # 2) TE's fused path: wgrad GEMM writes into grad_buffer(), then finalize
    buffer = weight.grad_buffer()
    assert buffer.shape == (40, 16)
    buffer.copy_(2 * wgrad)
    assert finalize_weight_grads([weight], [buffer]) == [None]
    expected[:40] += 2 * total / world
    runtime.drain()
    start = spec.gtp_rank * spec.shard_dim0
    assert torch.allclose(weight.main_grad, expected[start : start + spec.shard_dim0], atol=1e-6)
    assert len(fired) == 2  # DDP's grad-ready hook fires once per finalize, after the add
    assert runtime.live_buffers[weight.gtp_state.chain_id] == 0

    _chain_steady_state(groups, rank, world)

    with pytest.raises(ValueError, match=r"wgrad shape \(8, 16\) != logical weight shape"):
        weight.finalize_group_grads(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="leads a group of 1 weight, got 2 wgrads"):
        weight.finalize_group_grads([wgrad, wgrad])


def test_protocol_dispatch_shapes_and_gradients() -> None:
    run_distributed(_worker, 2)


def test_te_recipes_the_runtime_gathers_in_fp8() -> None:
    """TE recipe -> the FP8Scaling of GTP's FP8 gather (TE's recipe API, duck-typed: no TE
    here). Per-tensor current scaling only; its weights are E4M3 under E4M3 and HYBRID."""
    from types import SimpleNamespace

    from nemo_gtp.engine.fp8 import FP8Scaling
    from nemo_gtp.integrations.megatron.sharding.te_fp8 import fp8_scaling_of_recipe

    def recipe(current: bool, fmt: str, **extra) -> SimpleNamespace:
        return SimpleNamespace(
            float8_current_scaling=lambda: current, fp8_format=SimpleNamespace(name=fmt), **extra
        )

    assert fp8_scaling_of_recipe(recipe(True, "HYBRID")) == FP8Scaling("tensorwise")
    assert fp8_scaling_of_recipe(recipe(True, "E4M3", use_power_2_scales=True)) == FP8Scaling(
        "tensorwise", power_2_scales=True
    )
    e5m2 = fp8_scaling_of_recipe(recipe(True, "E5M2"))
    assert e5m2 is not None and e5m2.fp8_dtype == torch.float8_e5m2
    assert fp8_scaling_of_recipe(recipe(False, "HYBRID")) is None  # delayed, blockwise, MX...
    assert fp8_scaling_of_recipe(object()) is None


def test_model_config_low_precision_checked_for_gtp() -> None:
    """The model config's FP8 settings, before any weight is built (design §1.3): FP8 primary
    weights refused naming the setting; on CPU the device limits are unknown."""
    from types import SimpleNamespace

    from nemo_gtp.integrations.megatron.model_config import (
        check_low_precision_for_gtp,
        validate_model_config_for_gtp,
    )

    assert check_low_precision_for_gtp(SimpleNamespace()) is None
    config = SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=False)
    assert check_low_precision_for_gtp(config) == "fp8"
    config.fp8_recipe = "delayed"
    assert check_low_precision_for_gtp(config) == "training_dtype"
    config.fp8_param = True
    with pytest.raises(ValueError, match=r"TransformerConfig\.fp8_param=True"):
        validate_model_config_for_gtp(config)

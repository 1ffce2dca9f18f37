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

    with pytest.raises(ValueError, match=r"wgrad shape \(8, 16\) != logical weight shape"):
        weight.finalize_group_grads(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="leads a group of 1 weight, got 2 wgrads"):
        weight.finalize_group_grads([wgrad, wgrad])


def test_protocol_dispatch_shapes_and_gradients() -> None:
    run_distributed(_worker, 2)

"""Rank grid: sizes, rank order, and every invalid configuration's message (no collectives)."""

from __future__ import annotations

import pytest

from nemo_gtp.engine import GTPConfig, GTPParallelDims, ShardSpec


def test_sizes_and_rank_order() -> None:
    dims = GTPParallelDims(world_size=8, tensor_model_parallel_size=2, num_weight_shards=4)
    assert (dims.gtp, dims.dp, dims.data_parallel_size) == (2, 2, 4)
    groups = dims.group_ranks()
    assert groups["gtp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]  # GTP right after TP
    assert groups["replicate"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert groups["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["model_parallel"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.coords(5) == {"tp": 1, "gtp": 0, "cp": 0, "dp": 1, "pp": 0}


def test_context_parallel_sits_between_tp_and_gtp() -> None:
    """megatron's tp-cp-ep-dp-pp order with GTP the fastest part of its data-parallel axis:
    CP peers hold the same shards and join the replicate group of DDP (``replicate_cp``)."""
    dims = GTPParallelDims(world_size=16, num_weight_shards=2, context_parallel_size=2)
    assert (dims.gtp, dims.dp, dims.data_parallel_size) == (2, 4, 8)
    groups = dims.group_ranks()
    assert groups["gtp"][:2] == [[0, 2], [4, 6]]  # stride CP
    assert groups["replicate"][0] == [0, 4, 8, 12]
    assert groups["replicate_cp"][0] == [0, 1, 4, 5, 8, 9, 12, 13]  # megatron's dp_cp, no GTP
    assert groups["data"][0] == list(range(0, 16, 2))  # megatron's data-parallel group
    assert groups["model_parallel"][0] == [0, 2]  # TP1 x GTP2 x PP1
    assert dims.coords(3) == {"tp": 0, "cp": 1, "gtp": 1, "dp": 0, "pp": 0}
    plain = GTPParallelDims(world_size=4, num_weight_shards=2).group_ranks()  # CP 1
    assert plain["replicate_cp"] == plain["replicate"] == [[0, 2], [1, 3]]


def test_defaults_are_gtp_off() -> None:
    dims = GTPParallelDims(world_size=4, tensor_model_parallel_size=2)
    assert (dims.gtp, dims.egtp, dims.gtp_enabled) == (1, 1, False)


def test_expert_axes() -> None:
    dims = GTPParallelDims(world_size=8, expert_model_parallel_size=2, expert_num_weight_shards=2)
    assert (dims.etp, dims.egtp, dims.edp) == (1, 2, 2)
    assert dims.group_ranks()["expert_gtp"][0] == [0, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(world_size=8, tensor_model_parallel_size=4, num_weight_shards=6),
            "num_weight_shards=6 must be a multiple of tensor_model_parallel_size=4",
        ),
        (
            dict(world_size=6, num_weight_shards=4),
            "world_size=6 is not divisible by num_weight_shards",
        ),
        (dict(world_size=8, num_weight_shards=0), "num_weight_shards must be a positive integer"),
        (
            dict(world_size=8, expert_tensor_parallel_size=2, expert_num_weight_shards=3),
            "expert_num_weight_shards=3 must be a multiple of expert_tensor_parallel_size=2",
        ),
        (
            dict(world_size=8, expert_model_parallel_size=4, expert_num_weight_shards=4),
            "world_size=8 is not divisible by expert_num_weight_shards",
        ),
        (
            dict(world_size=8, num_weight_shards=2, num_distributed_optimizer_instances=2),
            "num_distributed_optimizer_instances=2 is not supported with GTP",
        ),
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(world_size=4, tensor_model_parallel_size=3), "world_size=4 is not divisible"),
    ],
)
def test_invalid_configurations(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GTPParallelDims(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pad_for_alignment=0), "pad_for_alignment must be >= 1"),
        (dict(gather_backend="nvlink"), "gather_backend must be 'process_group', 'copy_engine'"),
        (dict(preshard_linears="local"), "preshard_linears must be 'te', 'all' or 'none'"),
        (dict(graph_wgrad_ring_size=1), "graph_wgrad_ring_size must be 0 \\(off\\) or >= 2"),
        (dict(graph_wgrad_ring_size=2, async_reduction=False), "needs async_reduction=True"),
    ],
)
def test_invalid_gtp_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GTPConfig(**kwargs)


def test_shard_spec_padding() -> None:
    spec = ShardSpec.for_weight((72, 64), gtp_size=2, gtp_rank=1, pad_for_alignment=16)
    assert (spec.padded_dim0, spec.shard_dim0, spec.pad_length) == (96, 48, 24)
    assert spec.shard_shape == (48, 64) and spec.gathered_shape == (96, 64)
    exact = ShardSpec.for_weight((64, 8), gtp_size=4, gtp_rank=0, pad_for_alignment=1)
    assert exact.pad_length == 0 and exact.shard_dim0 == 16

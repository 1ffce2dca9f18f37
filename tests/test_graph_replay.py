"""The lean per-layer graph replay (``nemo_gtp.integrations.megatron.graph_replay``) against
megatron's own checks.

A CUDA graph cannot replay on CPU; what the lean path changes besides the lists it makes once is
which arguments it lets replay and which tensors it feeds the graph, and both are checked here
against megatron-core's own ``get_mismatch_errors`` / ``get_tensors`` on real megatron objects.
The replay itself (bit-identical losses to megatron's) is a GPU check: ``bench.host_fake``'s
``%megatronreplay``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.cuda_graphs import ArgMetadata, CudaGraphManager, _CudaGraphRunner

from nemo_gtp.integrations.megatron.graph_replay import (
    LeanCudaGraphManager,
    LeanCudaGraphRunner,
    matches_capture,
    replay_inputs,
    use_lean_replay,
)
from nemo_gtp.integrations.megatron.layer_graphs import GTPCudaGraphManager, GTPCudaGraphRunner


def _runner(args: tuple, kwargs: dict) -> LeanCudaGraphRunner:
    """A runner holding only what megatron records of a capture's arguments."""
    runner = LeanCudaGraphRunner.__new__(LeanCudaGraphRunner)
    torch.nn.Module.__init__(runner)
    runner.fwd_graph_input_arg_metas = [ArgMetadata(a) for a in args]
    runner.fwd_graph_input_kwarg_metas = {k: ArgMetadata(v) for k, v in kwargs.items()}
    return runner


_OtherParams = dataclasses.make_dataclass(  # PackedSeqParams' fields, another type
    "_OtherParams", [(f.name, object, None) for f in dataclasses.fields(PackedSeqParams)]
)


def _packed(rows: int) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.zeros(rows, dtype=torch.int32))


def _captured() -> tuple[tuple, dict]:
    hidden = torch.zeros(8, 2, 16)
    return (hidden,), {
        "attention_mask": None,
        "rotary_pos_emb": torch.zeros(8, 1, 1, 16),
        "sequence_len_offset": 3,
        "is_first_microbatch": True,
        "packed_seq_params": _packed(3),
    }


def _calls() -> dict[str, tuple[tuple, dict]]:
    """A replay's arguments, each case one change from the capture's."""
    (hidden,), kw = _captured()
    fresh = {**kw, "rotary_pos_emb": torch.ones(8, 1, 1, 16), "packed_seq_params": _packed(3)}
    return {
        "same": ((torch.ones_like(hidden),), fresh),
        "shape": ((torch.zeros(8, 2, 32),), kw),
        "dtype": ((hidden.bfloat16(),), kw),
        "device": ((hidden.to("meta"),), kw),
        "parameter": ((torch.nn.Parameter(hidden),), kw),
        "value": ((hidden,), {**kw, "sequence_len_offset": 4}),
        "bool": ((hidden,), {**kw, "is_first_microbatch": False}),
        "int_for_bool": ((hidden,), {**kw, "is_first_microbatch": 1}),
        "tensor_for_none": ((hidden,), {**kw, "attention_mask": torch.zeros(1)}),
        "missing": ((hidden,), {k: v for k, v in kw.items() if k != "attention_mask"}),
        "extra": ((hidden,), {**kw, "context": None}),
        "positional": ((hidden, None), kw),
        "field_shape": ((hidden,), {**kw, "packed_seq_params": _packed(5)}),
        "field_value": ((hidden,), {**kw, "packed_seq_params": PackedSeqParams(qkv_format="sbhd")}),
        "other_dataclass": (
            (hidden,),
            {
                **kw,
                "packed_seq_params": _OtherParams(
                    qkv_format="thd", cu_seqlens_q=torch.zeros(3, dtype=torch.int32)
                ),
            },
        ),
        "tuple": (((hidden,),), kw),
    }


@pytest.mark.parametrize("case", sorted(_calls()))
def test_a_lean_match_is_a_match_for_megatron(case: str) -> None:
    """Whatever the lean check lets replay, megatron's check lets replay too; what it does not,
    megatron's own path decides (and names)."""
    runner = _runner(*_captured())
    args, kwargs = _calls()[case]
    lean = matches_capture(runner, args, kwargs)
    try:
        megatron = not _CudaGraphRunner.get_mismatch_errors(runner, args, kwargs)
    except (AssertionError, AttributeError):  # megatron refuses the type (or trips on it)
        megatron = False
    assert lean == (case == "same"), case
    if lean:
        assert megatron
    if case == "other_dataclass":  # equal fields of another dataclass type: megatron's call
        assert megatron


def test_the_lean_replay_feeds_the_graph_what_megatron_does() -> None:
    """The tensors handed to the replay node, in order: megatron's ``get_tensors``, then the
    layer's parameters, listed once."""
    args, kwargs = _calls()["same"]
    expected = _CudaGraphRunner.get_tensors(args, kwargs)
    lean = replay_inputs(args, kwargs)
    assert [id(t) for t in lean] == [id(t) for t in expected]

    runner = _runner(args, kwargs)
    runner.base_module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert runner.graph_params() == tuple(runner.base_module.parameters())
    assert runner.graph_params() is runner.graph_params()


def test_input_grads_as_megatron_hands_them_out() -> None:
    """Without fused wgrad accumulation, and with it where no weight's grad went to
    ``main_grad`` in the graph, the backward hands out the graph's grads as megatron does
    (the dummies, fresh device tensors, are the GPU check's)."""
    runner = _runner((), {})
    runner.base_module = torch.nn.Linear(4, 4)
    runner.static_grad_inputs = [torch.ones(2, 4), torch.ones(4, 4), torch.ones(4)]  # as captured
    for fused in (False, True):
        runner.fuse_wgrad_accumulation = fused
        lean = LeanCudaGraphRunner.get_input_grads_with_dummy_flags(runner)
        megatron = _CudaGraphRunner.get_input_grads_with_dummy_flags(runner)
        assert [id(g) for g in lean[0]] == [id(g) for g in megatron[0]]
        assert list(lean[1]) == list(megatron[1]) == [False] * 3


def _layer_with_manager(kind: type) -> torch.nn.Module:
    layer = torch.nn.Linear(2, 2)
    manager = kind.__new__(kind)  # megatron's __init__ switches the process's CUDA stream
    torch.nn.Module.__init__(manager)
    manager.cudagraph_runners = [_CudaGraphRunner.__new__(_CudaGraphRunner)]  # made in a step
    layer.cudagraph_manager = manager
    return layer


def test_every_layer_with_megatrons_manager_gets_the_lean_one() -> None:
    """``use_lean_replay`` swaps megatron's managers (and only those), with the runners they
    made already; a lean manager's runners become lean runners, a GTP manager's GTP runners,
    both lean."""
    model = torch.nn.Sequential(
        _layer_with_manager(CudaGraphManager),
        _layer_with_manager(GTPCudaGraphManager),
        torch.nn.Linear(2, 2),
    )
    assert use_lean_replay(model) == 1
    assert type(model[0].cudagraph_manager) is LeanCudaGraphManager
    assert [type(r) for r in model[0].cudagraph_manager.cudagraph_runners] == [LeanCudaGraphRunner]
    assert type(model[1].cudagraph_manager) is GTPCudaGraphManager
    assert use_lean_replay(model) == 0
    assert LeanCudaGraphManager.runner_class is LeanCudaGraphRunner
    assert issubclass(GTPCudaGraphManager, LeanCudaGraphManager)
    assert GTPCudaGraphManager.runner_class is GTPCudaGraphRunner
    assert issubclass(GTPCudaGraphRunner, LeanCudaGraphRunner)


def test_a_replay_lists_the_layer_once_as_megatron_walks_it() -> None:
    """The modules whose DDP pre-forward hooks a replay calls (the layer, then each of its
    modules, as megatron's ``__call__``) and the parameters it touches, listed once."""
    layer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    manager = _layer_with_manager(LeanCudaGraphManager).cudagraph_manager
    params, modules = manager._layer_parts(layer)
    assert modules == (layer, *layer.modules())
    assert params == tuple(layer.parameters())
    assert manager._layer_parts(layer)[0] is params

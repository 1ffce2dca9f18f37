"""GTPShardedParam's TransformerEngine DistributedWeight protocol, driven as TE's dispatchers do.

TE cannot run on CPU, so its dispatchers are mirrored from TE's documented contract
(``tests.harness.te_grouped``): list-shaped, leader = ``weights[0]``, a plain tensor passes
through. Collectives are real (gloo). Weight groups (TE ``GroupedLinear`` experts) are driven
through megatron's ``TEGroupedMLP`` in ``tests/test_moe.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime, shard_linear
from nemo_gtp.integrations.te_grad_mode import record_grad_mode
from tests.harness.spawn import run_distributed
from tests.harness.te_grouped import (
    finalize_weight_grads,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)


def _chain_steady_state(groups: object, rank: int, world: int, *, general: bool) -> list:
    """A TE model's protocol call order with coalescing units: after the first (observing)
    step, every gather is prefetched into its own ticket — no skipped prefetch, no fallback
    buffer, no weight gathered twice — although a protocol weight holds its buffer until the
    next consume (across the chain's commit too), and the wgrads still reduce exactly.

    ``general``: a trace on, which keeps every consume off the dense one-frame path
    (``GTPRuntime._dense_consume``); both must give the same trace of collectives."""
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64)]  # qkv, proj, fc1, fc2 of one layer
    layer_bytes = sum(o * i * 4 for o, i in shapes)
    config = GTPConfig(coalesce_mb=2 * layer_bytes / 2**20, pad_for_alignment=8)  # 2 layers
    runtime = GTPRuntime(groups, config)
    runtime.quantized_gather = _InertFP8Gather()  # every TE runtime has one (te_fp8)
    counts = []
    weights, modules = [], []
    for layer in range(3):
        for j, (out_f, in_f) in enumerate(shapes):
            torch.manual_seed(layer * 4 + j)
            module = _TEStandIn(in_f, out_f)
            weight = runtime.shard_parameter(module, "weight", f"{layer}.{j}")
            weight.main_grad = torch.zeros_like(weight)
            record_grad_mode(module)  # what adopt_te_linear does for a TE linear
            weights.append(weight)
            modules.append(module)
    n = len(weights)
    x = torch.zeros(2, 16)
    trace = runtime.enable_trace() if general else None
    general_calls = []  # consumes that took the general path (through materialize)
    materialize = runtime.materialize
    runtime.materialize = lambda *a, **k: general_calls.append(a[0]) or materialize(*a, **k)
    for step in range(3):
        runtime.stats.reset()
        general_calls.clear()
        for module in modules:
            module(x)
        # Once linked, each grad-mode hook went at its module's next call, but the forward
        # chain's hand-over point's (the tail unit's lead): the handover still prefetches.
        hooked = [bool(m._forward_pre_hooks) for m in modules]
        assert hooked == [not step or runtime.needs_forward_grad_mode(w) for w in weights]
        assert step == 0 or sum(hooked) == 1, hooked
        for weight in reversed(weights):
            (full,) = materialize_weight_for_backward([weight])
            finalize_weight_grads([weight], [torch.full_like(full, float(rank + 1))])
        runtime.drain()
        stats = runtime.stats
        assert (stats.gathers, stats.reduce_scatters) == (2 * n, n), (step, stats)
        if step:
            assert (stats.prefetch_skipped, stats.fallback_allocations) == (0, 0), (step, stats)
            assert stats.prefetches == 2 * n - 1, (step, stats)  # all but the chain head
        if step:  # linked: every consume in one frame, unless kept off it
            assert len(general_calls) == (2 * n if general else 0), (step, len(general_calls))
        counts.append(dataclasses.astuple(stats))
    mean = sum(range(1, world + 1)) / world
    for weight in weights:
        assert torch.equal(weight.main_grad, torch.full_like(weight, 3 * mean))
    assert runtime.outstanding() == {"gathers": 0, "reduce_scatters": 0}
    assert trace is None or len(trace) > 0
    return counts


class _InertFP8Gather:
    """TE's FP8 gather consumer outside FP8 autocast: asked at every forward consume, it
    answers None (gather the training dtype); installed on every runtime of TE linears."""

    transpose_for_backward = False

    def forward_scaling(self, param: object) -> None:
        return None

    def wrap(self, param: object, direction: object, gathered: object) -> None:
        raise AssertionError("no FP8 gather outside FP8 autocast")


class _TEStandIn(torch.nn.Linear):
    """A TE linear's protocol consume: its autograd forward runs with grad mode off."""

    def __init__(self, in_f: int, out_f: int) -> None:
        super().__init__(in_f, out_f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return materialize_weight_for_forward([self.weight])[0]


def _fp8_backward_of_training_dtype_gathers(groups: object, rank: int) -> None:
    """TE's FP8 backward of a weight gathered in the training dtype (design §1.3 "Consumer-
    quantized backward"), driven through a stand-in of TE's LayerNormLinear: the backward
    materialization hands TE the weight quantized column-wise only, by the forward's quantizer
    (current scaling) or with the forward's scale (delayed scaling, whose scale moves on at the
    autocast exit; the module's amax is left alone); outputs, dgrads and wgrads equal TE's
    path for a weight of its own, bit for bit. Outside FP8 nothing changes. Without the
    consumer, the stand-in fails as TE's dgrad GEMM does on the GPU."""
    from nemo_gtp.integrations.te_fp8_backward import (
        TEWeightQuantize,
        attach_te_weight_states,
    )
    from tests.harness.te_fp8_stand_in import (
        StandInCurrentQuantizer,
        StandInDelayedQuantizer,
        StandInFP8Tensor,
        StandInTELinear,
    )

    consumer = TEWeightQuantize(delayed_quantizer=StandInDelayedQuantizer)
    config = GTPConfig(pad_for_alignment=16)

    def quantizer(kind: str) -> object:
        if kind == "current":
            return StandInCurrentQuantizer()
        return StandInDelayedQuantizer(torch.tensor(8.0), torch.zeros(1), "e4m3")

    def build(kind: str, with_consumer: bool) -> tuple:
        torch.manual_seed(3)
        ref = StandInTELinear(16, 40, quantizer(kind))
        gtp = StandInTELinear(16, 40, quantizer(kind))
        gtp.load_state_dict(ref.state_dict())
        runtime = GTPRuntime(groups, config)
        weight = runtime.shard_parameter(gtp, "weight", "qkv.weight")
        weight.main_grad = torch.zeros_like(weight)
        # adopt_te_linear's part (the rest imports megatron, slow in spawned ranks)
        attach_te_weight_states(gtp)
        weight.gtp_state.forward_grad_enabled = True  # what its grad-mode hook records
        runtime.consumer_quantize = consumer if with_consumer else None
        return ref, gtp, runtime, weight

    def step(module: StandInTELinear, x: torch.Tensor, dy: torch.Tensor) -> tuple:
        x = x.clone().requires_grad_()
        y = module(x)
        module.autocast_exit()
        y.backward(dy)
        return y.detach(), x.grad

    x, dy = torch.randn(6, 16), torch.randn(6, 40)  # the same on every rank (seeded)
    _, gtp, runtime, _ = build("current", with_consumer=False)
    gtp.fp8 = True
    with pytest.raises(RuntimeError, match="cuBLAS"):
        step(gtp, x, dy)
    runtime.drain_gathers()

    for kind in ("current", "delayed"):
        ref, gtp, runtime, weight = build(kind, with_consumer=True)
        module_q = gtp.quantizers["scaling_fwd"][1]
        for fp8 in (True, False):
            ref.fp8 = gtp.fp8 = fp8
            want, got = step(ref, x, dy), step(gtp, x, dy)
            runtime.drain()
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (kind, fp8)
            want_w, got_w = ref.backward_weights[-1], gtp.backward_weights[-1]
            if not fp8:  # the training-dtype alias, as before
                assert not isinstance(got_w, StandInFP8Tensor), kind
                assert torch.equal(got_w, ref.weight.detach())
                assert weight.gtp_state.quantize_note is None
                continue
            assert isinstance(got_w, StandInFP8Tensor) and got_w._data is None, kind  # col only
            bits = got_w._transpose.view(torch.uint8), want_w._transpose.view(torch.uint8)
            assert torch.equal(*bits), kind
            assert torch.equal(got_w._scale_inv, want_w._scale_inv), kind
            if kind == "current":  # the module's quantizer, its usages restored after
                assert got_w._quantizer is module_q
                assert (module_q.rowwise_usage, module_q.columnwise_usage) == (True, True)
            else:  # the forward's scale, not the module's now; its amax history untouched
                assert got_w._scale_inv * module_q.scale == 0.5  # forward: twice the scale
                assert float(module_q.amax) == 0.0
        spec = weight.gtp_spec
        start = rank * spec.shard_dim0
        rows = ref.weight.grad[start : start + spec.shard_dim0]
        assert torch.allclose(weight.main_grad[: rows.shape[0]], rows, rtol=1e-6, atol=1e-6)

    # A GroupedLinear (weight group led by weight0): each member by its own quantizer.
    grouped = torch.nn.Module()
    for i in range(2):
        grouped.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(24, 16)))
    quantizers = [StandInCurrentQuantizer(), StandInCurrentQuantizer()]
    grouped.fp8, grouped.fp8_meta = True, {"recipe": None}
    grouped._get_weight_quantizers = lambda: quantizers
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=8))
    members = [runtime.shard_parameter(grouped, f"weight{i}", f"fc1.weight{i}") for i in range(2)]
    runtime.register_group(members, together=True)
    assert attach_te_weight_states(grouped) == 2
    runtime.consumer_quantize = consumer
    members[0].gtp_state.forward_grad_enabled = True
    with torch.no_grad():
        fulls = [f.clone() for f in materialize_weight_for_forward(members)]
    got = materialize_weight_for_backward(members)
    for q, tensor, full in zip(quantizers, got, fulls):
        assert tensor._quantizer is q and tensor._data is None
        bits = tensor._transpose.view(torch.uint8), q(full)._transpose.view(torch.uint8)
        assert torch.equal(*bits)
    runtime.drain()


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

    # the dense one-frame consume does exactly what the general path does
    fast = _chain_steady_state(groups, rank, world, general=False)
    assert fast == _chain_steady_state(groups, rank, world, general=True)
    _fp8_backward_of_training_dtype_gathers(groups, rank)

    with pytest.raises(ValueError, match=r"wgrad shape \(8, 16\) != logical weight shape"):
        weight.finalize_group_grads(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="leads a group of 1 weight, got 2 wgrads"):
        weight.finalize_group_grads([wgrad, wgrad])


def test_protocol_dispatch_shapes_and_gradients() -> None:
    run_distributed(_worker, 2)


def test_te_recipes_the_runtime_gathers_in_fp8() -> None:
    """TE recipe -> the FP8Scaling of GTP's FP8 gather (TE's recipe API, duck-typed: no TE
    here). Per-tensor current scaling, its weights E4M3 under E4M3 and HYBRID; blockwise with
    2-D (128x128) weight tiles, the weight quantizer's power-of-two and epsilon settings."""
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
    assert fp8_scaling_of_recipe(recipe(False, "HYBRID")) is None  # delayed, MXFP8, NVFP4
    assert fp8_scaling_of_recipe(object()) is None

    def block(dim: int, **weight) -> SimpleNamespace:
        return recipe(
            False,
            "E4M3",
            float8_block_scaling=lambda: True,
            w_block_scaling_dim=dim,
            fp8_quant_fwd_weight=SimpleNamespace(**weight),
        )

    tiles = fp8_scaling_of_recipe(block(2, power_2_scale=True, amax_epsilon=0.0))
    assert tiles == FP8Scaling("blockwise", block=(128, 128), power_2_scales=True)
    fp32_scales = fp8_scaling_of_recipe(block(2, power_2_scale=False, amax_epsilon=1e-6))
    assert fp32_scales == FP8Scaling(
        "blockwise", block=(128, 128), power_2_scales=False, epsilon=1e-6
    )
    assert fp8_scaling_of_recipe(block(1, power_2_scale=True)) is None  # 1x128 weight blocks


def test_model_config_low_precision_checked_for_gtp() -> None:
    """The model config's FP8 settings, before any weight is built (design §1.3): FP8 primary
    weights taken under per-tensor current scaling, refused naming the setting otherwise (other
    recipes, megatron's bf16 first / last layers, routed experts over expert GTP); on CPU the
    device limits are unknown."""
    from types import SimpleNamespace

    from nemo_gtp.engine.fp8 import FP8Scaling
    from nemo_gtp.integrations.megatron.model_config import (
        check_low_precision_for_gtp,
        fp8_primary_scaling,
        validate_model_config_for_gtp,
    )
    from nemo_gtp.integrations.megatron.sharding.built import refuse_fp8_primary_experts

    assert check_low_precision_for_gtp(SimpleNamespace()) is None
    config = SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=False)
    assert check_low_precision_for_gtp(config) == "fp8"
    assert fp8_primary_scaling(config) is None
    refuse_fp8_primary_experts(config)  # no FP8 params: experts fine
    config.fp8_param = True
    assert check_low_precision_for_gtp(config) == "fp8_primary"
    assert fp8_primary_scaling(config) == FP8Scaling("tensorwise", fp8_dtype=torch.float8_e4m3fn)
    blockwise = SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise", fp8_param=True)
    assert fp8_primary_scaling(blockwise) == FP8Scaling(  # TE's Float8BlockScaling weight tiles
        "blockwise", fp8_dtype=torch.float8_e4m3fn, block=(128, 128), power_2_scales=True
    )
    with pytest.raises(ValueError, match=r"routed experts.*expert_num_weight_shards"):
        refuse_fp8_primary_experts(config)
    config.first_last_layers_bf16 = True
    with pytest.raises(ValueError, match=r"first_last_layers_bf16=True"):
        validate_model_config_for_gtp(config)
    config.first_last_layers_bf16 = False
    config.fp8_recipe = "delayed"
    with pytest.raises(ValueError, match=r"TransformerConfig\.fp8_param=True.*'delayed'"):
        validate_model_config_for_gtp(config)
    config.fp8_param = False
    assert check_low_precision_for_gtp(config) == "training_dtype"

"""Engine behaviour on plain torch.nn.Linear models, real gloo collectives (no megatron)."""

from __future__ import annotations

import copy
import gc
import os
import time
import weakref
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime, shard_linear
from nemo_gtp.engine.copy_engine import decide_copy_engine
from nemo_gtp.engine.runtime import ChainId, GatherBackend
from nemo_gtp.engine.timing import ExposedWaitTimer
from tests.harness.spawn import Outcome, case_values, run_cases


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 16),
    )


def _shard_mlp(model: torch.nn.Module, groups, config: GTPConfig) -> GTPRuntime:
    runtime = GTPRuntime(groups, config)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shard_linear(module, runtime, f"{name}.weight")
    model.gtp_runtime = runtime
    return runtime


def _gather_full(param, group) -> torch.Tensor:
    spec = param.gtp_spec
    out = torch.empty(spec.gathered_shape, dtype=param.dtype)
    dist.all_gather_into_tensor(out, param.detach().contiguous(), group=group)
    return spec.unpad(out)


def _parity_worker(rank: int, world: int, per_token: bool, options: dict) -> None:
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    reference = _mlp(0)
    model = copy.deepcopy(reference)
    options = {"coalesce_mb": 0.0, **options}  # the per-weight chain unless a case coalesces
    runtime = _shard_mlp(model, groups, GTPConfig(calculate_per_token_loss=per_token, **options))
    if options.get("separate_reduce_scatter_group"):
        assert runtime._rs_group is not groups.gtp
        assert dist.get_process_group_ranks(runtime._rs_group) == dist.get_process_group_ranks(
            groups.gtp
        )
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        reduction = "sum" if per_token else "mean"
        ref_loss = torch.nn.functional.mse_loss(reference(x), target, reduction=reduction)
        loss = torch.nn.functional.mse_loss(model(x), target, reduction=reduction)
        assert torch.allclose(loss, ref_loss, rtol=1e-6), (step, loss, ref_loss)
        ref_loss.backward()
        loss.backward()
        runtime.drain()
        op_scale = 1.0 if per_token else 1.0 / world
        for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
            ref_grad = ref_p.grad.clone()
            dist.all_reduce(ref_grad)
            ref_grad *= op_scale
            if name.endswith("weight"):
                spec = p.gtp_spec
                grad = torch.empty(spec.gathered_shape)
                dist.all_gather_into_tensor(grad, p.grad.contiguous(), group=groups.gtp)
                # Pad rows never receive gradient: exactly zero in this rank's shard (rows past
                # the logical dim 0; none on a rank whose shard is all real rows) and in the
                # whole gathered pad, checked on every rank. Every weight here is padded (16
                # rows per rank), so the pad is never empty.
                real_rows = min(
                    spec.shard_dim0, max(0, spec.logical_shape[0] - spec.gtp_rank * spec.shard_dim0)
                )
                assert not p.grad[real_rows:].any(), (step, name, rank)
                assert spec.pad_length > 0, name
                assert not grad[spec.logical_shape[0] :].any(), (step, name)
                grad = spec.unpad(grad)
            else:  # replicated bias: the engine leaves its all-reduce to the integration layer
                grad = p.grad.clone()
                dist.all_reduce(grad)
                grad *= op_scale
            rel = (grad - ref_grad).norm() / ref_grad.norm()
            assert rel < 1e-6, (step, name, float(rel))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None and not hasattr(p, "gtp_spec"):
                    dist.all_reduce(p.grad)
                    p.grad *= op_scale
            for ref_p in reference.parameters():
                dist.all_reduce(ref_p.grad)
                ref_p.grad *= op_scale
                ref_p -= 0.1 * ref_p.grad
                ref_p.grad = None
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
        full = _gather_full(p, groups.gtp) if hasattr(p, "gtp_spec") else p.detach()
        assert torch.allclose(full, ref_p.detach(), rtol=1e-5, atol=1e-6), name
    # "auto" has no copy engine on gloo/CPU: process-group gathers, decided without a collective.
    assert runtime.gather_backend is GatherBackend.PROCESS_GROUP
    assert runtime.tokens_per_gemm == 8
    depth = runtime.config.prefetch_depth
    units = [len(unit) for unit in runtime.chains[ChainId.UNGRAPHED].units]
    if runtime.config.coalesce_mb:  # weights of 4, 5 and 3 KiB (padded, fp32)
        assert units == ([2, 1] if runtime.config.coalesce_mb < 0.011 else [3]), units
        # the unit's wgrads were reduce-scattered together: nothing left staged or pending
        chain = runtime.chains[ChainId.UNGRAPHED]
        assert not chain.staged and not chain.pending_rs
    else:
        assert units == [1, 1, 1]
    walk = units + units[::-1]  # forward units, then the backward's (handed over at the tail)
    live = max(a + b for a, b in zip(walk, walk[1:]))  # a unit and the next one consumed
    bound = live if runtime.config.coalesce_mb else 1 + depth
    assert max(runtime.max_live_buffers.values()) <= bound
    if depth > 1:  # the consume of weight 0 gathered weights 1 and 2 ahead
        assert runtime.stats.prefetches > 0 and runtime.stats.prefetch_skipped == 0
        assert [len(p.gtp_state.fwd.ahead) for p in runtime.params] == [2, 1, 0]


PARITY_OPTIONS = [
    (False, {}),
    (True, {}),
    (False, {"gather_backend": "auto", "separate_reduce_scatter_group": True}),
    (False, {"prefetch_depth": 2}),
    (False, {"coalesce_mb": 0.01}),  # units (fc0, fc1), (fc2)
    (True, {"coalesce_mb": 1.0, "separate_reduce_scatter_group": True}),  # one unit
]


def _parity_case(per_token: bool, options: dict) -> str:
    return f"parity per_token={per_token} {options}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    """Every 2-rank case of this module in one spawn (process start dominates the cost)."""
    cases = [
        (_parity_case(per_token, options), _parity_worker, (per_token, options))
        for per_token, options in PARITY_OPTIONS
    ]
    cases.append(("behaviour", _behaviour_worker, ()))
    cases.append(("units", _units_worker, ()))
    cases.append(("recompute", _recompute_worker, ()))
    cases.append(("forward_only", _forward_only_worker, ()))
    return run_cases(cases, 2, tmp_path_factory.mktemp("engine_linear"))


@pytest.mark.parametrize("per_token, options", PARITY_OPTIONS)
def test_linear_parity_gtp2(
    two_ranks: dict[str, list[Outcome]], per_token: bool, options: dict
) -> None:
    case_values(two_ranks[_parity_case(per_token, options)])


def test_copy_engine_decision() -> None:
    """``gather_backend`` resolution from every peer's (host, tokens per GEMM)."""
    assert decide_copy_engine([5, 5], [4096, 8192], required=False, min_tokens=4096)
    assert not decide_copy_engine([5, 5], [2048, 8192], required=False, min_tokens=4096)
    assert not decide_copy_engine([5, 6], [8192, 8192], required=False, min_tokens=4096)
    assert decide_copy_engine([5, 5], [16, 16], required=True, min_tokens=4096)
    with pytest.raises(RuntimeError, match="gather_backend='process_group' or 'auto'"):
        decide_copy_engine([5, 6], [8192, 8192], required=True, min_tokens=4096)
    with pytest.raises(ValueError, match="copy_engine_min_tokens"):
        GTPConfig(copy_engine_min_tokens=-1)


def test_exposed_wait_timer_per_weight() -> None:
    """Stall per kind, and per weight when asked (the per-layer exposed profile)."""
    cpu = torch.device("cpu")
    timer = ExposedWaitTimer()
    timer.timed_wait(lambda: None, "gather", cpu, "a")  # disabled: nothing charged
    assert timer.collect() == {} and timer.take_per_weight() == {}
    timer.enable(per_weight=True)
    timer.timed_wait(lambda: time.sleep(0.02), "gather", cpu, "a")
    timer.timed_wait(lambda: time.sleep(0.01), "reduce_scatter", cpu, "b")
    totals, per_weight = timer.collect(), timer.take_per_weight()
    assert totals["gather"] >= 0.02 and totals["reduce_scatter"] >= 0.01
    assert per_weight == {
        ("gather", "a"): totals["gather"],
        ("reduce_scatter", "b"): totals["reduce_scatter"],
    }
    assert timer.take_per_weight() == {}
    timer.enable()  # per kind only
    timer.timed_wait(lambda: None, "gather", cpu, "a")
    assert set(timer.collect()) == {"gather"} and timer.take_per_weight() == {}


def _behaviour_worker(rank: int, world: int) -> None:
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    model_a, model_b = _mlp(0), _mlp(1)
    per_weight = GTPConfig(pad_for_alignment=4, coalesce_mb=0)  # the chain of design §1.1
    runtime_a = _shard_mlp(model_a, groups, per_weight)
    runtime_b = _shard_mlp(model_b, groups, per_weight)
    names = [f"{i}.weight" for i in (0, 2, 4)]
    for step in range(3):
        trace = runtime_a.enable_trace()
        x = torch.randn(4, 16)
        model_a(x).square().mean().backward()
        model_b(x).square().mean().backward()  # interleaved second model: must never link to A
        runtime_a.drain()
        runtime_b.drain()
        if step == 0:
            continue
        events = [(e, n, d) for e, n, d in trace]
        counts = Counter((n, d) for e, n, d in events if e.startswith("ag_issue"))
        assert all(counts[(n, d)] == 1 for n in names for d in ("fwd", "bwd")), counts
        # forward: gather of weight i+1 issued before the GEMM that consumes weight i
        for current, following in zip(names, names[1:]):
            issue = events.index(("ag_issue_async", following, "fwd"))
            assert issue < events.index(("gemm", current, "fwd")), events
        # backward: gather of weight i-1 issued before the dgrad GEMM of weight i
        for current, previous in zip(names[1:], names):
            issue = events.index(("ag_issue_async", previous, "bwd"))
            assert issue < events.index(("gemm", current, "bwd")), events
        # only the chain head gathers synchronously in steady state (L-1 of L hidden)
        assert [n for e, n, d in events if e == "ag_issue_sync"] == [names[0]], events
        # reduce-scatters: async with one-step deferral, head synchronous
        rs = [(e, n) for e, n, d in events if e.startswith("rs_issue") or e == "finalize"]
        assert rs == [
            ("rs_issue_async", names[2]),
            ("rs_issue_async", names[1]),
            ("finalize", names[2]),
            ("rs_issue_sync", names[0]),
            ("finalize", names[1]),
            ("finalize", names[0]),
        ], rs
    for runtime in (runtime_a, runtime_b):
        assert max(runtime.max_live_buffers.values()) <= 2, runtime.max_live_buffers
        assert runtime.stats.fallback_allocations == 0
    chain_a = runtime_a.chains[next(iter(runtime_a.chains))].order
    chain_b = runtime_b.chains[next(iter(runtime_b.chains))].order
    assert {id(p) for p in chain_a} == {id(p) for p in runtime_a.params}
    assert not ({id(p) for p in chain_a} & {id(p) for p in chain_b})
    # buffers are stable: no allocation after the first step
    allocations = runtime_a.weight_cache.allocations, runtime_a.wgrad_pool.allocations
    model_a(torch.randn(4, 16)).sum().backward()
    runtime_a.drain()
    assert (runtime_a.weight_cache.allocations, runtime_a.wgrad_pool.allocations) == allocations
    # dropping a model drops its runtime, links and buffers (no process-global state)
    dead = weakref.ref(runtime_a)
    del model_a, runtime_a, chain_a
    gc.collect()
    assert dead() is None


def test_prefetch_order_buffers_and_isolation(two_ranks: dict[str, list[Outcome]]) -> None:
    case_values(two_ranks["behaviour"])


def _units_worker(rank: int, world: int) -> None:
    """Coalescing units (design §3.1): weights 0 and 2 (2560 + 3840 padded fp32 bytes) form one
    unit, weight 4 another; each unit is gathered in one collective one unit ahead, and its
    wgrads reduce-scatter together once the unit's last wgrad exists."""
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    model = _mlp(0)
    runtime = _shard_mlp(model, groups, GTPConfig(pad_for_alignment=4, coalesce_mb=6400 / 2**20))
    names = [f"{i}.weight" for i in (0, 2, 4)]
    for step in range(3):
        trace = runtime.enable_trace()
        model(torch.randn(4, 16)).square().mean().backward()
        runtime.drain()
        if step == 0:
            continue
        events = [(e, n, d) for e, n, d in trace]
        assert [len(u) for u in runtime.chains[ChainId.UNGRAPHED].units] == [2, 1]
        # the head unit is gathered together at the head's consume (the head waits on it)
        assert events[:2] == [
            ("ag_issue_sync", names[0], "fwd"),
            ("ag_issue_async", names[1], "fwd"),
        ]
        # the next unit's gather is issued before the head's GEMM; none at weight 2's consume
        assert events.index(("ag_issue_async", names[2], "fwd")) < events.index(
            ("gemm", names[0], "fwd")
        ), events
        rs = [(e, n) for e, n, d in events if e.startswith("rs_issue") or e == "finalize"]
        assert rs == [
            ("rs_issue_async", names[2]),  # unit (4,): alone
            ("rs_issue_sync", names[1]),  # unit (0, 2) staged until weight 0's wgrad exists;
            ("rs_issue_sync", names[0]),  # it holds the chain head: synchronous
            ("finalize", names[2]),
            ("finalize", names[1]),
            ("finalize", names[0]),
        ], rs
    assert runtime.stats.fallback_allocations == 0 and runtime.stats.prefetch_skipped == 0


def test_coalescing_units(two_ranks: dict[str, list[Outcome]]) -> None:
    case_values(two_ranks["units"])


def _forward_only_worker(rank: int, world: int) -> None:
    """Evaluation passes (no backward) before, between and after training steps."""
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    reference = _mlp(0)
    model = copy.deepcopy(reference)
    runtime = _shard_mlp(model, groups, GTPConfig(pad_for_alignment=4))
    nothing = {"gathers": 0, "reduce_scatters": 0}

    def evaluate(mode) -> None:  # noqa: ANN001
        trace = runtime.enable_trace()
        x = torch.randn(4, 16)
        with mode():
            out, ref = model(x), reference(x)
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-7)
        # forward gathers only, each released by its GEMM: nothing outstanding without a drain
        assert runtime.outstanding() == nothing, runtime.outstanding()
        assert {d for e, _, d in trace if e.startswith("ag_issue")} == {"fwd"}, trace
        assert not [e for e, _, _ in trace if e.startswith("rs") or e == "finalize"], trace
        runtime.trace = None

    def train_step() -> None:
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        for net in (reference, model):
            torch.nn.functional.mse_loss(net(x), target).backward()
        runtime.drain()
        with torch.no_grad():
            for ref_p, p in zip(reference.parameters(), model.parameters()):
                dist.all_reduce(ref_p.grad)
                ref_p.grad /= world
                if hasattr(p, "gtp_spec"):  # the GTP mean of the shard's gradient
                    full = torch.empty(p.gtp_spec.gathered_shape)
                    dist.all_gather_into_tensor(full, p.grad.contiguous(), group=groups.gtp)
                    grad = p.gtp_spec.unpad(full)
                else:
                    dist.all_reduce(p.grad)
                    p.grad /= world
                    grad = p.grad
                assert torch.allclose(grad, ref_p.grad, rtol=1e-5, atol=1e-7)
                ref_p -= 0.1 * ref_p.grad
                p -= 0.1 * p.grad
                ref_p.grad = p.grad = None

    torch.manual_seed(7 + rank)
    # The very first gathers run under inference mode (trainer.validate before any fit, NCCL):
    # the buffers they allocate are later written by training, outside it.
    evaluate(torch.inference_mode)
    evaluate(torch.no_grad)  # the order is committed by now: prefetching forward passes
    for _ in range(2):
        train_step()
        evaluate(torch.inference_mode)
        evaluate(torch.no_grad)
    train_step()
    assert runtime.stats.fallback_allocations == 0


def test_forward_only_passes_leave_nothing_behind(two_ranks: dict[str, list[Outcome]]) -> None:
    """Evaluation forwards (inference mode, no_grad) before and between training steps: outputs
    and the following steps' gradients match the unsharded model; no reduce-scatter, no
    backward gather and nothing outstanding after each pass."""
    case_values(two_ranks["forward_only"])


def test_flight_recorder_quieted_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """GTP turns torch's NCCL flight recorder off by default (a Python stack per collective),
    before torch.distributed initializes, and never overrides an explicit setting."""
    from nemo_gtp.engine.collectives import FLIGHT_RECORDER_ENV, quiet_flight_recorder

    for key in FLIGHT_RECORDER_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    assert "TORCH_FR_BUFFER_SIZE=0" in quiet_flight_recorder()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    assert quiet_flight_recorder() is None and os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")
    assert quiet_flight_recorder() is None and "TORCH_FR_BUFFER_SIZE" not in os.environ


def _recompute_worker(rank: int, world: int) -> None:
    """Activation recompute (reentrant checkpoint, as megatron's ``recompute_granularity=
    "full"``): the forward re-run inside the backward gathers through its own chain, prefetched
    (only its head synchronous), and gradients stay exact."""
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 16))
            for _ in range(3)
        ]
    )
    model = copy.deepcopy(reference)
    runtime = _shard_mlp(model, groups, GTPConfig(pad_for_alignment=4, coalesce_mb=0))

    def run(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        for block in net:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x

    for step in range(3):
        trace = runtime.enable_trace()
        torch.manual_seed(100 * step + rank)
        x = torch.randn(8, 16, requires_grad=True)
        run(reference, x).square().mean().backward()
        run(model, x).square().mean().backward()
        runtime.drain()
        for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
            ref_grad = ref_p.grad.clone()
            dist.all_reduce(ref_grad)
            ref_grad /= world
            if hasattr(p, "gtp_spec"):
                grad = torch.empty(p.gtp_spec.gathered_shape)
                dist.all_gather_into_tensor(grad, p.grad.contiguous(), group=groups.gtp)
                grad = p.gtp_spec.unpad(grad)
            else:
                grad = p.grad.clone()
                dist.all_reduce(grad)
                grad /= world
            assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-7), (step, name)
            ref_p.grad, p.grad = None, None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        recompute = [(e, n) for e, n, d in trace if d == "rc" and e.startswith("ag_issue")]
        # last block first: block 2 is re-run first, then 1, then 0 (6 weights, once each)
        assert sorted(n for _, n in recompute) == sorted(runtime_names(runtime)), recompute
        if step >= 1:  # linked at the first drain: only the recompute chain head is synchronous
            assert [n for e, n in recompute if e == "ag_issue_sync"] == ["2.0.weight"], recompute
    chain = runtime.chains[next(iter(runtime.chains))]
    assert [p.gtp_state.name for p in chain.recompute_order] == [
        "2.0.weight",
        "2.2.weight",
        "1.0.weight",
        "1.2.weight",
        "0.0.weight",
        "0.2.weight",
    ]
    assert runtime.stats.fallback_allocations == 0


def runtime_names(runtime: GTPRuntime) -> list[str]:
    return [p.gtp_state.name for p in runtime.params]


def test_recompute_forward_chain(two_ranks: dict[str, list[Outcome]]) -> None:
    case_values(two_ranks["recompute"])


def test_state_machines_refuse_transitions_from_the_wrong_state() -> None:
    """Each slot method checks the state it leaves (design §1.1)."""
    from nemo_gtp.engine import Direction, GatherState, GTPStateError
    from nemo_gtp.engine.param import GatherSlot, ReduceScatterSlot

    class Done:
        def wait(self) -> None:
            pass

    slot, buffer = GatherSlot(Direction.FWD), torch.zeros(4)
    with pytest.raises(GTPStateError, match="gather fwd waited in state"):
        slot.complete()
    with pytest.raises(GTPStateError, match="gather fwd released in state"):
        slot.released()
    slot.issued(Done(), buffer, buffer[:2])
    with pytest.raises(GTPStateError, match="gather fwd issued in state"):
        slot.issued(Done(), buffer, buffer)
    slot.complete()
    assert slot.state is GatherState.DATA_READY and slot.full.shape == (2,)
    slot.released()
    assert slot.state is GatherState.NONE and slot.buffer is None
    rs = ReduceScatterSlot()
    with pytest.raises(GTPStateError, match="reduce-scatter finalized in state"):
        rs.finished()
    with pytest.raises(GTPStateError, match="reduce-scatter waited in state"):
        rs.complete()


def test_coalescing_units_count_the_training_dtype() -> None:
    """An FP8 primary shard counts as its training dtype in the unit budget: the same units
    as its bf16 twin, not twice the weights (and twice the wgrad scratch) per unit (design §3.1
    "Coalescing units")."""
    from nemo_gtp.engine.chain import coalescing_units
    from nemo_gtp.engine.param import GTPShardedParam, ShardSpec

    def weight(dtype: torch.dtype, fp8_primary: bool) -> GTPShardedParam:
        spec = ShardSpec.for_weight((8, 4), gtp_size=2, gtp_rank=0, pad_for_alignment=1)
        param = GTPShardedParam(torch.zeros(spec.shard_shape, dtype=dtype), spec=spec)
        if fp8_primary:
            param.gtp_state.fp8_primary_dtype = torch.bfloat16
        return param

    budget = 2 * 8 * 4 * 2  # two gathered (8, 4) weights in bf16
    bf16 = coalescing_units([weight(torch.bfloat16, False) for _ in range(4)], budget)
    fp8 = coalescing_units([weight(torch.float8_e4m3fn, True) for _ in range(4)], budget)
    assert [len(u) for u in bf16] == [len(u) for u in fp8] == [2, 2]


def test_coalescing_units_segment_heads() -> None:
    """A captured segment's first and last weights are units alone; the weights between, and
    the eager chain, coalesce as the byte budget allows (design §3.5 "Segment heads")."""
    from nemo_gtp.engine.chain import coalescing_units
    from nemo_gtp.engine.param import GTPShardedParam, ShardSpec

    def weight(segment: int) -> GTPShardedParam:
        spec = ShardSpec.for_weight((8, 4), gtp_size=2, gtp_rank=0, pad_for_alignment=1)
        param = GTPShardedParam(torch.zeros(spec.shard_shape), spec=spec)
        param.gtp_state.segment = segment
        return param

    eager = [weight(-1) for _ in range(4)]
    layers = [[weight(s) for _ in range(4)] for s in (0, 1)]
    pair = [weight(2) for _ in range(2)]
    units = coalescing_units(eager + layers[0] + layers[1] + pair + [weight(3)], 2**20)
    sizes = [len(u) for u in units]
    assert sizes == [4, 1, 2, 1, 1, 2, 1, 1, 1, 1], sizes
    assert units[0] == tuple(eager)
    assert units[1:4] == [(layers[0][0],), tuple(layers[0][1:3]), (layers[0][3],)]
    assert coalescing_units(layers[0], 0) == [(p,) for p in layers[0]]  # no coalescing at all


def test_full_state_dict_of_an_unregistered_shard_names_it() -> None:
    """A linear built as its GTP shard is not registered until the model transform (NeMo's
    PEFT defers it to the first train epoch start): ``full_state_dict`` then names the weight
    and when to call it, before any collective, instead of failing inside a gather."""
    from nemo_gtp import full_state_dict
    from nemo_gtp.engine.param import GTPShardedParam, ShardSpec

    linear = torch.nn.Linear(4, 8, bias=False)
    spec = ShardSpec.for_weight((8, 4), gtp_size=2, gtp_rank=0, pad_for_alignment=1)
    linear.weight = GTPShardedParam(torch.zeros(spec.shard_shape), spec=spec)
    with pytest.raises(ValueError, match="weight is a GTP shard built before the model transform"):
        full_state_dict(linear)

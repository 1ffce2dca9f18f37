"""``staged_gloo`` (``nemo_gtp.cpu.staged_gloo``): every collective through the wrapper.

One 2-rank gloo spawn (module fixture ``two_ranks``) runs every case. On CPU the group takes
the same path as for CUDA tensors, less the stream synchronization: each input is copied to a
host buffer, the gloo collective runs there, the result is copied back. Each case checks its
results against plain gloo over the same ranks where gloo has the collective, else against the
collective's definition; the last case re-creates the world on the staged backend (the default
group and the groups ``new_group`` derives from it) and saves / loads a
``torch.distributed.checkpoint``; then ``bench.gpu_grouped_experts``'s ``--shared-device``
launch re-creates it once more through the script's own ``init_world`` (on CPU). The launch
plans of the GPU checks' one-GPU mode are checked in this process, nothing spawned.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.harness.spawn import Outcome, case_values, run_cases


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(staged group, plain gloo group) over both ranks, built from a gloo world."""
    from nemo_gtp.cpu.staged_gloo import BACKEND, StagedGlooGroup

    staged = dist.new_group([0, 1], backend=BACKEND)
    assert isinstance(staged, StagedGlooGroup), type(staged)
    assert dist.get_backend(staged) == BACKEND and staged.name() == "staged_gloo"
    return staged, dist.new_group([0, 1], backend="gloo")


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values per rank, exact in every dtype used here."""
    values = torch.arange(1, 1 + torch.Size(shape).numel()).reshape(shape) * (rank + 2) % 13
    return values.to(dtype)


def _reductions(rank: int, world: int) -> dict:
    staged, gloo = _groups()
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("SUM", "MAX", "MIN"):
            ours, ref = _data(rank, (3, 5), dtype), _data(rank, (3, 5), dtype)
            dist.all_reduce(ours, op=getattr(dist.ReduceOp, op), group=staged)
            dist.all_reduce(ref, op=getattr(dist.ReduceOp, op), group=gloo)
            assert torch.equal(ours, ref), (dtype, op)
            checked.append(f"{op}:{dtype}")
    # AVG (gloo has none): SUM / world, on a non-contiguous view, asynchronously
    base = _data(rank, (4, 6))
    view = base.t()
    work = dist.all_reduce(view, op=dist.ReduceOp.AVG, group=staged, async_op=True)
    assert work.is_completed()
    assert work.get_future().wait()[0] is not None
    expected = (_data(0, (4, 6)) + _data(1, (4, 6))) / world
    assert torch.equal(base, expected)
    # bool MAX (logical or), a 0-dim tensor, reduce to rank 1
    flag = torch.tensor(rank == 1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=staged)
    scalar = torch.tensor(float(rank + 1))
    dist.all_reduce(scalar, group=staged)
    reduced = _data(rank, (5,))
    dist.reduce(reduced, dst=1, op=dist.ReduceOp.SUM, group=staged)
    want = _data(0, (5,)) + _data(1, (5,)) if rank == 1 else _data(rank, (5,))
    assert torch.equal(reduced, want)
    # allreduce_coalesced: several dtypes in one call
    pair = [_data(rank, (3,)), _data(rank, (2,), torch.bfloat16)]
    staged.allreduce_coalesced(pair).wait()
    assert torch.equal(pair[0], _data(0, (3,)) + _data(1, (3,)))
    assert torch.equal(pair[1], (_data(0, (2,)) + _data(1, (2,))).bfloat16())
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):  # refused before any traffic
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5), group=staged)
    return {"checked": len(checked), "flag": bool(flag), "scalar": float(scalar)}


def _gathers(rank: int, world: int) -> bool:
    staged, gloo = _groups()
    shard = _data(rank, (3, 4))
    ours, ref = torch.empty(6, 4), torch.empty(6, 4)
    dist.all_gather_into_tensor(ours, shard, group=staged)
    dist.all_gather_into_tensor(ref, shard, group=gloo)
    assert torch.equal(ours, ref)
    lists = [torch.empty(3, 4) for _ in range(world)], [torch.empty(3, 4) for _ in range(world)]
    dist.all_gather(lists[0], shard, group=staged)
    dist.all_gather(lists[1], shard, group=gloo)
    assert all(torch.equal(a, b) for a, b in zip(*lists))
    # megatron's distributed optimizer: the input is this rank's slice of the output
    buffer = torch.zeros(8)
    buffer[4 * rank : 4 * rank + 4] = _data(rank, (4,))
    dist.all_gather_into_tensor(buffer, buffer[4 * rank : 4 * rank + 4], group=staged)
    assert torch.equal(buffer, torch.cat([_data(0, (4,)), _data(1, (4,))]))
    # FP8 bytes (GTP's FP8 gather), which gloo cannot gather itself
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        out = torch.empty(8, dtype=fp8)
        dist.all_gather_into_tensor(out, _data(rank, (4,)).to(fp8), group=staged)
        want = torch.cat([_data(0, (4,)), _data(1, (4,))]).to(fp8)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="expected 2 x 48"):
        dist.all_gather_into_tensor(torch.empty(5, 4), shard, group=staged)
    return True


def _reduce_scatters(rank: int, world: int) -> bool:
    staged, gloo = _groups()
    full = _data(rank, (4, 3))
    ours, ref = torch.empty(2, 3), torch.empty(2, 3)
    dist.reduce_scatter_tensor(ours, full, group=staged)
    dist.reduce_scatter_tensor(ref, full, group=gloo)
    assert torch.equal(ours, ref)
    total = _data(0, (4, 3)) + _data(1, (4, 3))
    avg = torch.empty(2, 3, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(avg, full.bfloat16(), op=dist.ReduceOp.AVG, group=staged)
    assert torch.equal(avg, (total / 2).bfloat16()[2 * rank : 2 * rank + 2])
    # megatron's DDP: the output is this rank's slice of the (reduced) input
    buffer = _data(rank, (8,))
    dist.reduce_scatter_tensor(buffer[4 * rank : 4 * rank + 4], buffer, group=staged)
    flat = _data(0, (8,)) + _data(1, (8,))
    assert torch.equal(buffer[4 * rank : 4 * rank + 4], flat[4 * rank : 4 * rank + 4])
    # the list form, uneven pieces
    out = torch.empty(2 + rank)
    dist.reduce_scatter(out, [_data(rank, (2,)), _data(rank + 5, (3,))], group=staged)
    want = [_data(0, (2,)) + _data(1, (2,)), _data(5, (3,)) + _data(6, (3,))][rank]
    assert torch.equal(out, want)
    return True


def _coalesced(rank: int, world: int) -> bool:
    """GTP's GroupCollectives (bound methods, old and new torch names) and megatron's
    ``_coalescing_manager`` (all-gathers of mixed dtypes, reduce-scatters, all-reduces)."""
    from torch.distributed import _coalescing_manager

    from nemo_gtp.engine.collectives import GroupCollectives

    staged, _ = _groups()
    ops = GroupCollectives(staged)
    shards = [_data(rank, (2, 3)), _data(rank, (1, 5), torch.bfloat16)]
    fulls = [torch.empty(4, 3), torch.empty(2, 5, dtype=torch.bfloat16)]
    ops.all_gather(fulls[0], shards[0]).wait()
    assert torch.equal(fulls[0], torch.cat([_data(0, (2, 3)), _data(1, (2, 3))]))
    fulls[0].zero_()
    ops.all_gather_coalesced(fulls, shards).wait()
    for full, shape in zip(fulls, ((2, 3), (1, 5))):
        want = torch.cat([_data(0, shape), _data(1, shape)]).to(full.dtype)
        assert torch.equal(full, want)
    wgrads = [_data(rank, (4, 3)), _data(rank, (2, 5))]
    outs = [torch.empty(2, 3), torch.empty(1, 5)]
    for average in (False, True):
        ops.reduce_scatter_coalesced(outs, wgrads, average=average).wait()
        for out, grad in zip(outs, wgrads):
            total = _data(0, grad.shape) + _data(1, grad.shape)
            want = total.chunk(world)[rank] / (world if average else 1)
            assert torch.equal(out, want)
    ops.reduce_scatter(outs[0], wgrads[0], average=True).wait()
    assert torch.equal(outs[0], ((_data(0, (4, 3)) + _data(1, (4, 3))) / 2)[2 * rank :][:2])
    gathered = [torch.empty(4, 3), torch.empty(2, 5, dtype=torch.bfloat16)]
    with _coalescing_manager(staged, async_ops=True) as cm:
        for out, shard in zip(gathered, shards):
            dist.all_gather_into_tensor(out, shard, group=staged, async_op=True)
    cm.wait()
    assert all(torch.equal(a, b) for a, b in zip(gathered, fulls))
    buffers = [_data(rank, (4,)), _data(rank, (6,))]
    with _coalescing_manager(staged, async_ops=True) as cm:
        for buf in buffers:
            dist.reduce_scatter_tensor(
                buf.chunk(world)[rank], buf, op=dist.ReduceOp.AVG, group=staged, async_op=True
            )
    cm.wait()
    for buf in buffers:
        total = (_data(0, buf.shape) + _data(1, buf.shape)) / 2
        assert torch.equal(buf.chunk(world)[rank], total.chunk(world)[rank])
    with _coalescing_manager(staged):
        for buf in buffers:
            dist.all_reduce(buf, group=staged)
    # TE's FP8 gathers name the device: the group's own start / end of coalescing run too
    gathered = [torch.zeros(4, 3), torch.zeros(2, 5, dtype=torch.bfloat16)]
    with _coalescing_manager(staged, device=torch.device("cpu"), async_ops=True) as cm:
        for out, shard in zip(gathered, shards):
            dist.all_gather_into_tensor(out, shard, group=staged, async_op=True)
    cm.wait()
    assert all(torch.equal(a, b) for a, b in zip(gathered, fulls))
    return True


def _movement(rank: int, world: int) -> bool:
    """all-to-all, broadcast, gather / scatter, object collectives, point-to-point, barrier."""
    staged, gloo = _groups()
    # megatron's MoE dispatcher hands numpy arrays of split sizes on GPUs
    for splits, as_array in ((None, False), ([[1, 3], [2, 2]], False), ([[1, 3], [2, 2]], True)):
        ins = [_data(rank, (4, 2)), _data(rank, (4, 2))]
        out_splits = [s[rank] for s in splits] if splits else None
        rows = sum(out_splits) if splits else 4
        outs = [torch.empty(rows, 2), torch.empty(rows, 2)]
        in_splits = splits[rank] if splits else None
        if as_array:
            out_splits, in_splits = np.array(out_splits), np.array(in_splits)
        for out, inp, group in zip(outs, ins, (staged, gloo)):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        assert torch.equal(outs[0], outs[1]), splits
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, [_data(rank, (2,)) + r for r in range(world)], group=staged)
    assert all(torch.equal(outs[r], _data(r, (2,)) + rank) for r in range(world))
    tensor = _data(rank, (3, 3), torch.bfloat16)
    dist.broadcast(tensor, src=1, group=staged)
    assert torch.equal(tensor, _data(1, (3, 3), torch.bfloat16))
    gathered = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    dist.gather(_data(rank, (3,)), gathered, dst=0, group=staged)
    if rank == 0:
        assert all(torch.equal(g, _data(r, (3,))) for r, g in enumerate(gathered))
    received = torch.empty(3)
    pieces = [_data(r + 7, (3,)) for r in range(world)] if rank == 1 else None
    dist.scatter(received, pieces, src=1, group=staged)
    assert torch.equal(received, _data(rank + 7, (3,)))
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank}, group=staged)
    assert objects == [{"rank": 0}, {"rank": 1}]
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1, group=staged)
    assert box == ["from 1"]
    into = [None] * world if rank == 0 else None
    dist.gather_object(("r", rank), into, dst=0, group=staged)
    if rank == 0:
        assert into == [("r", 0), ("r", 1)]
    got = [None]
    dist.scatter_object_list(got, [10, 11] if rank == 0 else None, src=0, group=staged)
    assert got == [10 + rank]
    # both ranks send before they receive: the sends must not block
    peer = 1 - rank
    inbox = torch.empty(5)
    sent = dist.isend(_data(rank, (5,)), dst=peer, group=staged)
    dist.irecv(inbox, src=peer, group=staged).wait()
    sent.wait()
    assert torch.equal(inbox, _data(peer, (5,)))
    inbox.zero_()
    p2p = [
        dist.P2POp(dist.isend, _data(rank, (5,)) + 1, peer, group=staged),
        dist.P2POp(dist.irecv, inbox, peer, group=staged),
    ]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()
    assert torch.equal(inbox, _data(peer, (5,)) + 1)
    dist.barrier(group=staged)
    return True


def _single_rank_groups(rank: int, world: int) -> bool:
    from nemo_gtp.cpu.staged_gloo import BACKEND

    mine = [dist.new_group([r], backend=BACKEND) for r in range(world)][rank]
    value = _data(rank, (4,))
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mine)
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, value, group=mine)
    dist.reduce_scatter_tensor(value, out, group=mine)
    assert torch.equal(value, _data(rank, (4,))) and torch.equal(out, value)
    return True


def _staged_world(rank: int, world: int, store_dir: str) -> dict:
    """The default group on the staged backend (as NeMo's strategy makes it): ``new_group``
    inherits it, and a ``torch.distributed.checkpoint`` round trip runs through it."""
    import torch.distributed.checkpoint as dcp

    from nemo_gtp.cpu.staged_gloo import BACKEND, StagedGlooGroup

    dist.destroy_process_group()  # the spawn's gloo world
    store = dist.FileStore(os.path.join(store_dir, "staged_world"), world)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world)
    assert isinstance(dist.group.WORLD, StagedGlooGroup) and dist.get_backend() == BACKEND
    child = dist.new_group([0, 1])
    assert isinstance(child, StagedGlooGroup) and dist.get_backend(child) == BACKEND
    state = {"w": _data(rank, (3, 2)), "step": torch.tensor(rank)}
    # every rank saves its own keys (rank-local names: no replica deduplication needed)
    local = {f"{k}{rank}": v for k, v in state.items()}
    dcp.save(local, checkpoint_id=os.path.join(store_dir, "ckpt"))
    loaded = {k: torch.zeros_like(v) for k, v in local.items()}
    dcp.load(loaded, checkpoint_id=os.path.join(store_dir, "ckpt"))
    assert all(torch.equal(loaded[k], local[k]) for k in local)
    dist.barrier()
    return {"backend": dist.get_backend(), "group": type(child).__name__}


def _grouped_experts_world(rank: int, world: int, store_dir: str) -> dict:
    """``python -m bench.gpu_grouped_experts --cpu-smoke --shared-device``'s launch: its ranks
    join the staged world through the script's own ``init_world`` (the CPU form of its one-GPU
    path)."""
    from bench.gpu_grouped_experts import init_world, parse_args
    from nemo_gtp.cpu.staged_gloo import StagedGlooGroup, world_on_gpu

    dist.destroy_process_group()  # the world of the case before
    args = parse_args(["--out", store_dir, "--cpu-smoke", "--shared-device", "--timeout", "60"])
    device = init_world(rank, world, args, os.path.join(store_dir, "grouped_world"))
    assert isinstance(dist.group.WORLD, StagedGlooGroup)
    value = _data(rank, (3,))
    dist.all_reduce(value)
    assert torch.equal(value, _data(0, (3,)) + _data(1, (3,)))
    return {
        "device": device,
        "backend": dist.get_backend(),
        "on_gpu": world_on_gpu(),
        "local_rank": os.environ["LOCAL_RANK"],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    out = tmp_path_factory.mktemp("staged_gloo")
    cases = [
        ("reductions", _reductions, ()),
        ("gathers", _gathers, ()),
        ("reduce_scatters", _reduce_scatters, ()),
        ("coalesced", _coalesced, ()),
        ("movement", _movement, ()),
        ("single_rank_groups", _single_rank_groups, ()),
        # last: these replace the world
        ("staged_world", _staged_world, (str(out),)),
        ("grouped_experts_world", _grouped_experts_world, (str(out),)),
    ]
    return run_cases(cases, 2, out)


def test_reductions(two_ranks: dict[str, list[Outcome]]) -> None:
    """SUM / MAX / MIN as gloo gives them (fp32, bf16, int64), AVG = SUM / 2 (non-contiguous,
    async: a completed Work with a future), bool, 0-dim, reduce, coalesced, PREMUL_SUM refused."""
    assert case_values(two_ranks["reductions"]) == [{"checked": 9, "flag": True, "scalar": 3.0}] * 2


def test_gathers(two_ranks: dict[str, list[Outcome]]) -> None:
    """all_gather(_into_tensor) as gloo, input inside the output, FP8 bytes, a bad size."""
    assert case_values(two_ranks["gathers"]) == [True, True]


def test_reduce_scatters(two_ranks: dict[str, list[Outcome]]) -> None:
    """reduce_scatter_tensor as gloo, bf16 AVG, output inside the input, the list form."""
    assert case_values(two_ranks["reduce_scatters"]) == [True, True]


def test_coalesced(two_ranks: dict[str, list[Outcome]]) -> None:
    """GTP's GroupCollectives and megatron's coalescing manager through the staged group."""
    assert case_values(two_ranks["coalesced"]) == [True, True]


def test_data_movement(two_ranks: dict[str, list[Outcome]]) -> None:
    """all-to-all (even and uneven), broadcast, gather / scatter, object collectives,
    isend / irecv both sending first, batch_isend_irecv, barrier."""
    assert case_values(two_ranks["movement"]) == [True, True]


def test_single_rank_groups(two_ranks: dict[str, list[Outcome]]) -> None:
    assert case_values(two_ranks["single_rank_groups"]) == [True, True]


def test_default_group_and_checkpoint(two_ranks: dict[str, list[Outcome]]) -> None:
    want = {"backend": "cpu:gloo,cuda:staged_gloo", "group": "StagedGlooGroup"}
    assert case_values(two_ranks["staged_world"]) == [want, want]


def test_grouped_experts_shared_device_launch(two_ranks: dict[str, list[Outcome]]) -> None:
    """The self-spawning grouped-experts check's ``--shared-device`` launch, on CPU: the staged
    world, every rank local rank 0, the CPU as the device (no CUDA here)."""
    want = {"device": "cpu", "backend": "cpu:gloo,cuda:staged_gloo", "on_gpu": False}
    assert case_values(two_ranks["grouped_experts_world"]) == [{**want, "local_rank": "0"}] * 2


def test_one_gpu_launch_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--shared-device`` of the GPU checks: every rank on ``cuda:0`` through the staged backend
    (``bench.gpu_grouped_experts`` self-spawned, ``bench.gpu_fp8_check`` under torchrun, where local
    rank 1 maps to ``cuda:0``); without it one GPU per rank on NCCL, as before."""
    from bench.gpu_fp8_check import SHARED_DEVICE_NOTE, summary_markdown
    from bench.gpu_fp8_check import world_plan as fp8_plan
    from bench.gpu_grouped_experts import main, parse_args, world_plan
    from nemo_gtp.cpu.staged_gloo import BACKEND, world_on_gpu

    def plan(rank: int, *flags: str) -> tuple[str, str]:
        return world_plan(rank, parse_args(["--out", "o", *flags]))

    assert plan(0, "--shared-device") == plan(1, "--shared-device") == (BACKEND, "cuda:0")
    assert plan(1) == ("nccl", "cuda:1") and plan(1, "--cpu-smoke") == ("gloo", "cpu")
    assert plan(1, "--cpu-smoke", "--shared-device") == (BACKEND, "cpu")
    if torch.cuda.device_count() == 0:  # refused before any spawn, naming the one-GPU flag
        assert main(["--out", str(tmp_path)]) == 2
        assert "needs 2 GPU(s), found 0 (one GPU: --shared-device)" in capsys.readouterr().err
        assert main(["--out", str(tmp_path), "--shared-device"]) == 2
        assert "needs 1 GPU(s), found 0" in capsys.readouterr().err
    assert fp8_plan(True, 1, cuda=True) == (BACKEND, 0)
    assert fp8_plan(False, 1, cuda=True) == ("nccl", 1)
    assert fp8_plan(True, 1, cuda=False) == (BACKEND, None)
    assert fp8_plan(False, 1, cuda=False) == ("gloo", None)
    assert SHARED_DEVICE_NOTE in summary_markdown({"shared_device": True})
    assert SHARED_DEVICE_NOTE not in summary_markdown({})
    assert world_on_gpu("nccl") and not world_on_gpu("gloo")
    assert world_on_gpu(BACKEND) == torch.cuda.is_available()


def test_registered_and_idempotent() -> None:
    from nemo_gtp.cpu import staged_gloo

    assert staged_gloo.register() == staged_gloo.register() == "cpu:gloo,cuda:staged_gloo"
    assert "STAGED_GLOO" in dist.Backend._plugins
    assert dist.Backend.backend_capability["staged_gloo"] == ["cuda"]


# --------------------------------------------------------------- bench.bench_nemo --shared-device
def test_bench_nemo_shared_device_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """``--shared-device --dry-run``: every rank is local rank 0 of its own node (``cuda:0``),
    the recipes run on the staged backend with the cut-down shape, nothing is launched."""
    import json

    from bench.bench_nemo import SHARED_DEVICE_SHAPE, main

    args = ["--shared-device", "--modes", "dp2_te,gtp2_te", "--tokens", "2048", "--dry-run"]
    assert main([*args, "--out", "unused"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in plan["runs"]] == ["dp2_te", "gtp2_te"]
    for run in plan["runs"]:
        assert run["overrides"][: len(SHARED_DEVICE_SHAPE)] == list(SHARED_DEVICE_SHAPE)
        assert run["overrides"][-3:] == [
            "trainer.devices=1",
            "+trainer.num_nodes=2",
            "+strategy.process_group_backend=cpu:gloo,cuda:staged_gloo",
        ]
        assert run["precision"] == "bf16-mixed"
    ranks = [(r["RANK"], r["LOCAL_RANK"], r["NODE_RANK"], r["WORLD_SIZE"]) for r in plan["ranks"]]
    assert ranks == [("0", "0", "0", "2"), ("1", "0", "1", "2")]
    assert plan["ranks"][0]["MASTER_PORT"] == plan["ranks"][1]["MASTER_PORT"]
    assert main([*args, "--full-size", "--out", "unused"]) == 0  # the recipe's own shape
    assert "model.num_layers=4" not in json.loads(capsys.readouterr().out)["runs"][0]["overrides"]
    # refused before any launch: CUDA graphs, Megatron-FSDP
    assert main([*args[:2], "gtp2_te@graph,mfsdp_te", "--dry-run", "--out", "unused"]) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert "cannot capture the staged backend" in errors[0] and "Megatron-FSDP" in errors[1]
    # without --shared-device: one local rank per GPU, as before
    assert main(["--modes", "dp2_cpu", "--tokens", "64", "--dry-run", "--out", "unused"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["runs"][0]["overrides"][-1] == "trainer.devices=2"
    assert [r["LOCAL_RANK"] for r in plan["ranks"]] == ["0", "1"]
    with pytest.raises(SystemExit):
        main(["--full-size", "--out", "unused"])
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and "--shared-device" in capsys.readouterr().out


def test_bench_nemo_parity_report(tmp_path: Path) -> None:
    """The report of a shared-device run says step times mean nothing and judges each mode's
    losses and grad norms against its baseline at the recipe precision's tolerance."""
    from bench.bench_nemo import report

    fit = {"tokens_per_gpu": 2048, "step_ms": 100.0, "tokens_per_s_per_gpu": 1, "peak_gib": 1.0}
    base = {**fit, "mode": "dp2_te", "losses": [10.0, 9.0, 8.0], "grad_norms": [4.0, 2.0, 1.0]}
    records = [
        {**base, "precision": "bf16-mixed", "shared_device": 2},
        {
            **fit,
            "mode": "gtp2_te",
            "losses": [10.0, 9.009, 8.0],
            "grad_norms": [4.0, 2.0, 1.1],
            "precision": "bf16-mixed",
            "shared_device": 2,
        },
        {**base, "mode": "dp2_local", "losses": [11.0, 10.0, 9.0], "shared_device": 2},
        {**base, "mode": "dp2_cpu", "precision": "32", "shared_device": 2},
        {**base, "mode": "gtp2_cpu", "losses": [10.0, 9.0, 8.001], "shared_device": 2},
    ]
    records[4]["precision"] = "32"
    table = report(records, tmp_path)
    assert table.startswith("**--shared-device: 2 ranks on one GPU**")
    assert "NOT meaningful" in table and not (tmp_path / "bench_nemo_ratio.png").exists()
    row = next(line for line in table.splitlines() if line.startswith("| gtp2_te | dp2_te |"))
    assert "| 3 | identical | 9.00e-03 | 1.00e-03 | 1.00e-01 | 2e-02 | match |" in row
    assert "PARITY gtp2_cpu vs dp2_cpu at 2048 tokens/GPU: DIFFERS (max rel loss diff 1.25e-04" in (
        table
    )
    # linears built as their GTP shards start from the baseline's weights (design §3.1 "Exact
    # init"): no pair needs a note that it starts elsewhere
    assert "draw their own" not in table
    assert "| dp2_local | dp2_te |" not in table  # another recipe: a speed baseline only
    assert (tmp_path / "bench_nemo.md").read_text().strip() == table.strip()

"""GTP distributed checkpoints (design §1.8, §3.3): reshard matrix, crash safety, errors, CLI.

Real multi-process megatron GPTModel + DDP + optimizer on CPU/gloo, no mocks. A spawn costs
~8 s of imports per rank on two cores, so the rank work runs in two spawns shared by the tests
(module fixture ``run``): one of 4 ranks makes every save, then waits while a second one of 2
ranks makes a save that is killed mid-way, then makes every load. Each test then checks its own
recorded outcome.

Reshard matrix: after two Adam steps at layout A the full logical weights, fp32 master weights
and Adam moments (gathered: GTP pad stripped, TP concatenated, distributed-optimizer ranges
joined) are stored as a reference; at layout B the checkpoint is loaded into a freshly built
model and optimizer and the same gathered tensors must be bitwise equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_gtp.checkpoint import (
    CheckpointShapeMismatchError,
    allocate_state,
    load_optimizer_state,
    read_layout,
    resolve_checkpoint,
)
from nemo_gtp.checkpoint.boxes import flat_range_boxes
from nemo_gtp.checkpoint.io import previous_dir, staging_dir
from nemo_gtp.checkpoint.pieces import RowMap, RowSegment
from nemo_gtp.checkpoint.show import main as inspect_main
from tests.harness.checkpoint import (
    Layout,
    assert_same_state,
    build,
    full_state,
    run_ranks,
    start_ranks,
    train,
)

WORLD = 4
FSMS, RESHARDABLE, DP_ONLY = "fully_sharded_model_space", "fully_reshardable", "dp_reshardable"
# megatron's default fully_reshardable exchange calls .cuda(); its memory-efficient one uses gloo.
OPTIM_METADATA = {
    FSMS: {},
    DP_ONLY: {},
    RESHARDABLE: {"distrib_optim_fully_reshardable_mem_efficient": True},
}


@dataclass(frozen=True)
class Save:
    """One checkpoint written in the save spawn."""

    layout: Layout
    sharding: str = FSMS
    stock: bool = False
    """Written by plain megatron (no nemo_gtp rewrite), as a run without nemo_gtp would."""
    async_save: bool = False
    """Through megatron's AsyncRequest (executed synchronously here), commit as a finalize fn."""


@dataclass(frozen=True)
class Load:
    """One reshard case: load checkpoint ``save`` at ``layout``."""

    save: str
    layout: Layout
    stock: bool = False
    """Load with plain megatron's sharded state dicts (no nemo_gtp rewrite)."""


SAVES = {
    "tp1gtp4": Save(Layout(gtp=4)),
    "tp2gtp2": Save(Layout(tp=2, gtp=2)),
    "tp2dp2": Save(Layout(tp=2), async_save=True),
    "tp1gtp2dp2-ffn72": Save(Layout(gtp=2, ffn=72)),
    "tp2gtp2-reshardable": Save(Layout(tp=2, gtp=2, bucket_size=None), RESHARDABLE),
    "tp2dp2-stock-reshardable": Save(Layout(tp=2, bucket_size=None), RESHARDABLE, stock=True),
    "tp1gtp2dp2-nodistopt": Save(Layout(gtp=2, distopt=False)),
    "tp2gtp2-glu": Save(Layout(tp=2, gtp=2, glu=True)),
    "tp1gtp2dp2-dp-reshardable": Save(Layout(gtp=2), DP_ONLY),
    "tp1gtp4-nobias": Save(Layout(gtp=4, bias=False)),
    "tp1gtp2dp2-shard-replicated": Save(Layout(gtp=2, shard_replicated=True)),
    "tp1cp2gtp2": Save(Layout(gtp=2, cp=2)),  # CP peers: replicas of the GTP shards
    "tp1gtp2dp2-muon": Save(Layout(gtp=2, distopt=False, muon=True)),  # momenta as GTP shards
    # pipeline parallelism: one layer per stage, untied embeddings (the CPU layer's limit)
    "pp2gtp2": Save(Layout(pp=2, gtp=2)),
}
CRASH_TARGET = "crash-target"  # the tp2gtp2 model again, in its own directory
# Resume GTP4 (data-parallel size GTP x DP = 4) without GTP at DP4: same batches per data rank.
RESUME_FROM, RESUME_AT = "tp1gtp4-nobias", Layout(bias=False)

LOADS = {
    # PP (design §3.3): a stage's layers under their global numbers, GTP offsets unchanged
    "pp2gtp2->tp1gtp2dp2": Load("pp2gtp2", Layout(gtp=2)),
    "pp2gtp2->nogtp-dp4": Load("pp2gtp2", Layout()),
    "pp2gtp2->nogtp-pp2dp2": Load("pp2gtp2", Layout(pp=2)),
    "pp2gtp2->nogtp-tp2pp2": Load("pp2gtp2", Layout(tp=2, pp=2)),
    "tp1gtp4->pp2gtp2": Load("tp1gtp4", Layout(pp=2, gtp=2)),
    # Muon (design §1.6): each rank's momentum rows land where a run without GTP keeps them
    "muon-tp1gtp2dp2->nogtp-dp4": Load("tp1gtp2dp2-muon", Layout(distopt=False, muon=True)),
    "muon-tp1gtp2dp2->tp2gtp2": Load(
        "tp1gtp2dp2-muon", Layout(tp=2, gtp=2, distopt=False, muon=True)
    ),
    "tp1cp2gtp2->nogtp-cp2dp2": Load("tp1cp2gtp2", Layout(cp=2)),
    "tp1cp2gtp2->tp1gtp4": Load("tp1cp2gtp2", Layout(gtp=4)),  # CP 2 -> 1
    "tp1gtp4->tp2gtp2": Load("tp1gtp4", Layout(tp=2, gtp=2)),
    "tp2gtp2->tp1gtp2dp2": Load("tp2gtp2", Layout(gtp=2)),
    "tp1gtp4->nogtp-dp4": Load("tp1gtp4", Layout()),
    "nogtp-tp2dp2->tp2gtp2": Load("tp2dp2", Layout(tp=2, gtp=2)),
    "padded-tp1gtp2dp2->tp1gtp4": Load("tp1gtp2dp2-ffn72", Layout(gtp=4, ffn=72)),
    "padded-tp1gtp2dp2->tp2gtp2-pad8": Load("tp1gtp2dp2-ffn72", Layout(tp=2, gtp=2, ffn=72, pad=8)),
    "tp2gtp2->nogtp-tp4": Load("tp2gtp2", Layout(tp=4)),
    "reshardable-tp2gtp2->tp1gtp4": Load("tp2gtp2-reshardable", Layout(gtp=4, bucket_size=None)),
    "reshardable-tp2gtp2->stock-megatron-dp4": Load(
        "tp2gtp2-reshardable", Layout(bucket_size=None), stock=True
    ),
    "stock-megatron-tp2dp2->tp2gtp2": Load(
        "tp2dp2-stock-reshardable", Layout(tp=2, gtp=2, bucket_size=None)
    ),
    "nodistopt-tp1gtp2dp2->tp2gtp2": Load(
        "tp1gtp2dp2-nodistopt", Layout(tp=2, gtp=2, distopt=False)
    ),
    "glu-tp2gtp2->tp1gtp4": Load("tp2gtp2-glu", Layout(gtp=4, glu=True)),
    "glu-tp2gtp2->nogtp-tp4": Load("tp2gtp2-glu", Layout(tp=4, glu=True)),
    # NeMo's default format only reshards DP; GTP peers must still get distinct keys (§3.3).
    "dp-reshardable-tp1gtp2dp2->same": Load("tp1gtp2dp2-dp-reshardable", Layout(gtp=2)),
    # Replicated params' optimizer state over DP x GTP (two chained optimizers) <-> one optimizer.
    "shard-replicated-tp1gtp2dp2->nogtp-tp2dp2": Load("tp1gtp2dp2-shard-replicated", Layout(tp=2)),
    "tp2gtp2->shard-replicated-tp1gtp4": Load("tp2gtp2", Layout(gtp=4, shard_replicated=True)),
    "shard-replicated-tp1gtp2dp2->same-tp2gtp2": Load(
        "tp1gtp2dp2-shard-replicated", Layout(tp=2, gtp=2, shard_replicated=True)
    ),
}


# ---------------------------------------------------------------------------------- rank work
def _stock_request(built, sharding: str, is_loading: bool) -> dict:  # noqa: ANN001
    """Plain megatron's sharded state dicts, as a run without nemo_gtp builds them."""
    model_sd = built.ddp.module.sharded_state_dict()
    if is_loading:
        allocate_state(built.optimizer)  # torch Adam needs its step allocated (CPU only)
    meta = {
        "distrib_optim_sharding_type": sharding,
        "chained_optim_avoid_prefix": True,
        **OPTIM_METADATA[sharding],
    }
    return {
        "model": model_sd,
        "optimizer": built.optimizer.sharded_state_dict(model_sd, is_loading, metadata=meta),
    }


def _save_worker(rank: int, world: int, root: str) -> None:
    from megatron.core import dist_checkpointing

    from nemo_gtp.integrations.megatron.checkpoint import save_gtp_checkpoint

    cache = {}
    for name, save in SAVES.items():
        if save.layout not in cache:
            built = build(save.layout)
            train(built, 2)
            cache = {save.layout: (built, full_state(built))}
        built, reference = cache[save.layout]
        if rank == 0:
            torch.save(reference, f"{root}/{name}.ref.pt")
        path = f"{root}/{name}"
        if save.stock:
            os.makedirs(path, exist_ok=True)
            dist_checkpointing.save(_stock_request(built, save.sharding, False), path)
        else:
            request = save_gtp_checkpoint(
                path,
                built.ddp,
                built.optimizer,
                built.groups,
                sharding_type=save.sharding,
                optimizer_metadata=OPTIM_METADATA[save.sharding],
                async_save=save.async_save,
            )
            if save.async_save:
                assert not os.path.exists(path)  # nothing committed before the request ran
                request.execute_sync()
        if name == "tp2gtp2":
            save_gtp_checkpoint(f"{root}/{CRASH_TARGET}", built.ddp, built.optimizer, built.groups)
        if name == RESUME_FROM:  # keep training: the losses a resumed run must reproduce
            losses = train(built, 2, first_step=2)
            with open(f"{root}/resume.{rank}.json", "w") as f:
                json.dump(losses, f)
            cache = {}


class _DieWhenPickled:
    """Kills its process (SIGKILL) when megatron serializes it during the write phase.

    It first waits until rank 0 wrote ``common.pt`` into the staging directory, so the kill
    lands after some ranks wrote part of the checkpoint, and before this rank wrote its part.
    """

    def __init__(self, staging: str) -> None:
        self.staging = staging

    def __reduce__(self):  # noqa: ANN204
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{self.staging}/common.pt") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def _crash_worker(rank: int, world: int, root: str) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from nemo_gtp.checkpoint import optimizer_sharded_state_dict, save_checkpoint
    from nemo_gtp.integrations.megatron.checkpoint import gtp_sharded_state_dict

    built = build(Layout(gtp=2), seed=99)  # on 2 ranks: a different run, half the spawn cost
    train(built, 3)
    target = f"{root}/{CRASH_TARGET}"
    model_sd = gtp_sharded_state_dict(built.ddp.module, built.groups)
    state = {
        "model": model_sd,
        "optimizer": optimizer_sharded_state_dict(built.optimizer, model_sd),
    }
    if rank == 1:
        state["die"] = ShardedObject(
            "test.die", _DieWhenPickled(str(staging_dir(target))), (1,), (0,), replica_id=0
        )
    save_checkpoint(state, target)
    raise AssertionError("the interrupted save must not complete")


def _load_case(case: Load, root: str) -> int:
    from megatron.core import dist_checkpointing

    from nemo_gtp.integrations.megatron.checkpoint import load_gtp_checkpoint

    sharding = SAVES[case.save].sharding
    built = build(case.layout, seed=4321)  # different init: every value must come from disk
    path = f"{root}/{case.save}"
    if case.stock:
        loaded = dist_checkpointing.load(_stock_request(built, sharding, True), path)
        built.ddp.module.load_state_dict(loaded["model"])
        load_optimizer_state(built.optimizer, loaded["optimizer"])
    else:
        load_gtp_checkpoint(
            path,
            built.ddp,
            built.optimizer,
            built.groups,
            sharding_type=sharding,
            optimizer_metadata=OPTIM_METADATA[sharding],
        )
    return assert_same_state(full_state(built), torch.load(f"{root}/{case.save}.ref.pt"))


def _load_worker(rank: int, world: int, root: str) -> None:
    from nemo_gtp.integrations.megatron.checkpoint import (
        load_gtp_checkpoint,
        save_gtp_checkpoint,
    )

    results = {}

    def record(name: str, fn) -> None:  # noqa: ANN001
        try:
            results[name] = {"ok": True, "value": fn()}
        except Exception as err:  # noqa: BLE001 - reported by the test that owns `name`
            results[name] = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }

    # same TP and PP adjacent: megatron's parallel_state is rebuilt only when they change
    order = sorted(LOADS.items(), key=lambda item: (item[1].layout.tp, item[1].layout.pp))
    for name, case in order:
        record(name, lambda case=case: _load_case(case, root))

    def after_crash() -> int:
        built = build(Layout(gtp=2), seed=4321)
        load_gtp_checkpoint(f"{root}/{CRASH_TARGET}", built.ddp, built.optimizer, built.groups)
        count = assert_same_state(full_state(built), torch.load(f"{root}/tp2gtp2.ref.pt"))
        save_gtp_checkpoint(f"{root}/{CRASH_TARGET}", built.ddp, built.optimizer, built.groups)
        return count

    record("after-crash", after_crash)

    def resume() -> float:
        built = build(RESUME_AT, seed=4321)
        load_gtp_checkpoint(f"{root}/{RESUME_FROM}", built.ddp, built.optimizer, built.groups)
        losses = train(built, 2, first_step=2)
        with open(f"{root}/resume.{rank}.json") as f:
            expected = json.load(f)
        return max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))

    record("resume", resume)

    def mismatch() -> str:
        built = build(Layout(gtp=2, ffn=96))
        try:
            load_gtp_checkpoint(f"{root}/tp1gtp4", built.ddp, built.optimizer, built.groups)
        except CheckpointShapeMismatchError as err:
            return str(err)
        raise AssertionError("loading ffn=80 weights into an ffn=96 model did not fail")

    record("mismatch", mismatch)
    with open(f"{root}/results.{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()


SAVED, CRASHED = "saves.done", "crash.done"  # flag files between the spawns and the fixture
CRASH_WAIT_S = 900  # the crash spawn's imports on a loaded two-core machine, with a wide margin


def _save_then_load_worker(rank: int, world: int, root: str) -> None:
    """Every save; then, once the fixture ran the crash spawn, every load (one process start)."""
    _save_worker(rank, world, root)
    dist.barrier()
    if rank == 0:
        Path(root, SAVED).touch()
    deadline = time.monotonic() + CRASH_WAIT_S
    while not Path(root, CRASHED).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {CRASHED} after {CRASH_WAIT_S} s")
        time.sleep(0.2)
    _load_worker(rank, world, root)


# ----------------------------------------------------------------------------------- fixture
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the two spawns once; returns the root dir, crash observations and per-rank results."""
    root = tmp_path_factory.mktemp("ckpt")
    job = start_ranks(_save_then_load_worker, WORLD, str(root))
    while not (root / SAVED).exists():
        if job.poll():
            raise AssertionError("the save/load spawn ended before its saves were done")
        time.sleep(0.2)
    target = root / CRASH_TARGET
    try:
        before = sorted(p.name for p in target.iterdir())
        crash_error = None
        try:
            run_ranks(_crash_worker, 2, str(root))
        except Exception as err:  # noqa: BLE001 - the expected outcome, inspected by the test
            crash_error = f"{type(err).__name__}: {err}"
        staging = staging_dir(target)
        crash = {
            "error": crash_error,
            "target_files_unchanged": sorted(p.name for p in target.iterdir()) == before,
            "target_layout": read_layout(target).describe(),
            "staging_has_common": (staging / "common.pt").exists(),
            "staging_complete": (staging / "metadata.json").exists(),
        }
    finally:  # the waiting ranks go on to the loads (and end) whatever happened here
        (root / CRASHED).touch()
        job.join()
    results = [json.loads((root / f"results.{r}.json").read_text()) for r in range(WORLD)]
    crash["staging_after_resave"] = staging.exists()
    crash["previous_after_resave"] = previous_dir(target).exists()
    crash["layout_after_resave"] = read_layout(target).describe()
    return {"root": root, "crash": crash, "results": results}


def _outcome(run: dict, name: str) -> list:
    outcomes = [ranks[name] for ranks in run["results"]]
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], f"rank {rank}: {outcome['error']}\n{outcome['traceback']}"
    return [o["value"] for o in outcomes]


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(LOADS))
def test_reshard(run: dict, name: str) -> None:
    counts = _outcome(run, name)
    # 4 tensors (weight, fp32 master, exp_avg, exp_avg_sq) for each of the 29 params; Muon's
    # 8 hidden matrices have one momentum instead of Adam's two moments
    assert counts == [108 if LOADS[name].layout.muon else 116] * WORLD


def test_interrupted_save_keeps_previous_checkpoint(run: dict) -> None:
    crash = run["crash"]
    assert crash["error"] is not None  # the spawn failed: rank 1 was killed mid-save
    assert crash["staging_has_common"] and not crash["staging_complete"]
    assert crash["target_files_unchanged"]
    assert crash["target_layout"].startswith("TP2 x GTP2 x DP1")
    assert _outcome(run, "after-crash") == [116] * WORLD  # still loads, bitwise the old state
    # The next successful save replaces the stale staging directory and commits.
    assert not crash["staging_after_resave"] and not crash["previous_after_resave"]
    assert crash["layout_after_resave"].startswith("TP1 x GTP2 x DP2")


def test_resume_continues_training(run: dict) -> None:
    # Loss of the first step after loading (loaded weights) and of the next one (after an Adam
    # step with the loaded moments) match the run that kept going; GTP vs no GTP only changes
    # summation order (the parity tests' 1e-5).
    assert max(_outcome(run, "resume")) <= 1e-5


def test_shape_mismatch_names_key_and_shapes(run: dict) -> None:
    message = _outcome(run, "mismatch")[0]
    assert (
        "decoder.layers.mlp.linear_fc1.weight: checkpoint (2, 80, 64), model (2, 96, 64)" in message
    ), message


def test_inspect_cli(run: dict, capsys: pytest.CaptureFixture) -> None:
    # In-process: `python -m nemo_gtp.checkpoint.show` runs this `main` (a subprocess would
    # only add ~8 s of imports).
    assert inspect_main([str(run["root"] / "tp2gtp2"), "--filter", "fc1"]) == 0
    out = capsys.readouterr().out
    assert "layout: TP2 x GTP2 x DP1 (PP1, CP1; world 4), pad_for_alignment=16" in out, out
    assert re.search(r"decoder\.layers\.mlp\.linear_fc1\.weight +40 -> 64\n", out), out
    assert re.search(
        r"\n  optimizer\.state\.exp_avg\.decoder\.layers\.mlp\.linear_fc1\.weight +"
        r"\(2, 80, 64\) +torch\.float32\n",
        out,
    ), out
    assert "linear_qkv" not in out, out  # --filter
    assert inspect_main([str(run["root"] / "missing")]) == 2


# -------------------------------------------------------------------- single-process units
def test_flat_range_boxes_tile_every_range() -> None:
    for shape in [(7,), (4, 5), (3, 4, 5)]:
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        flat = full.view(-1)
        for start in range(flat.numel() + 1):
            for stop in range(start, flat.numel() + 1):
                boxes = flat_range_boxes(shape, start, stop)
                assert len(boxes) <= 2 * len(shape) - 1
                assert sum(b.numel for b in boxes) == stop - start
                for box in boxes:
                    index = tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))
                    run_ = flat[start + box.flat_start : start + box.flat_start + box.numel]
                    assert torch.equal(full[index].reshape(-1), run_), (shape, start, stop, box)


def test_row_map_pieces_skip_pad_and_merge_back() -> None:
    # GTP rank 1 of 2 of TP rank 1 of 2: TP-local 40 rows padded to 64 -> rows 32..63, 8 real.
    row_map = RowMap((32, 3), first_row=32, segments=(RowSegment(0, 40, "", (80, 3), (40, 0)),))
    shard = torch.arange(96.0).view(32, 3)
    built = row_map.factory("w", shard, (0, 0, 0)).build()
    (piece,) = built["pieces"].values()
    assert piece.global_offset == (72, 0) and piece.local_shape == (8, 3)
    assert torch.equal(piece.data, shard[:8])
    loaded = {
        "pieces": {k: v.data.clone() for k, v in built["pieces"].items()},
        "plan": built["plan"].unwrap(),
    }
    merged = row_map.factory("w", shard, 0).merge_fn(loaded)
    assert torch.equal(merged[:8], shard[:8]) and not merged[8:].any()
    # A flat range straddling the pad boundary (elements 20..40 = rows 6.67..13.33).
    flat = row_map.factory("w", shard, 0)
    part = flat.build_fn("w", shard.view(-1)[20:40], 0, slice(20, 40))
    offsets = sorted(p.global_offset for p in part["pieces"].values())
    assert offsets == [(78, 2), (79, 0)]
    # A range entirely in the pad still yields one never-written placeholder.
    pad = flat.build_fn("w", shard.view(-1)[30:60], 0, slice(30, 60))
    (placeholder,) = pad["pieces"].values()
    assert placeholder.replica_id != 0 and placeholder.local_shape == (1, 1)


def test_resolve_falls_back_to_set_aside_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(target)
    previous_dir(target).mkdir()
    (previous_dir(target) / "metadata.json").write_text("{}")
    assert resolve_checkpoint(target) == previous_dir(target)
    target.mkdir()
    (target / "metadata.json").write_text("{}")
    assert resolve_checkpoint(target) == target.absolute()

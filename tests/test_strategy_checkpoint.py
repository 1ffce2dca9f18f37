"""Checkpoints through ``GTPMegatronStrategy`` : NeMo's ``torch_dist`` path.

Real ``nl.Trainer`` fits on 4 CPU/gloo ranks, in two launches so the resume really starts in
fresh processes (the first launch is the job that gets killed; it shares its spawn with
``test_strategy.py``'s 4-rank fits):

launch 1
  ``gtp_20``      TP1·GTP2·DP2, 20 steps uninterrupted (the reference curve), then
                  ``trainer.save_checkpoint`` after the fit
  ``gtp_killed``  the same run, NeMo ``ModelCheckpoint`` every 10 steps, stopped after 10
  (both save asynchronously, NeMo's default ``ckpt_async_save=True``; the other runs
  synchronously)
  ``plain_tp1``   plain ``MegatronStrategy`` TP1·DP4, 10 steps, ``ModelCheckpoint`` of the
                  weights (plain megatron cannot describe torch Adam's per-param
                  ``step`` in any distributed-optimizer format; TE/Apex Adam on GPU can)
launch 2
  ``gtp_resume``      ``trainer.fit(ckpt_path=<step 10>)``: steps 10..19 must equal ``gtp_20``'s
  ``gtp4_resume``     the same checkpoint resumed at TP1·GTP4 (weights and Adam state resharded):
                      steps 10..19 within 1e-5 of ``gtp_20``'s
  ``auto_resume``     NeMo's ``AutoResume(resume_if_exists=True)`` (``llm.train``'s restart) of
                      ``auto_killed`` (launch 1: NeMo recipes' ``save_last`` checkpoints, killed
                      after 5 steps): steps 5..19 must equal ``gtp_20``'s
  ``gtp_from_plain``  GTP loads ``plain_tp1``'s checkpoint (weights)
  ``plain_from_gtp``  plain ``MegatronStrategy`` at TP2·DP2 loads ``gtp_killed``'s checkpoint
  ``gtp_from_save``   GTP resumes from ``gtp_20``'s ``trainer.save_checkpoint`` (weights + Adam)
  ``gtp_truncated``   resuming from a copy of the step-10 checkpoint with one data file cut in
                      half fails, naming the checkpoint and the file

Muon (``MuonOptimizerModule``): ``muon_10`` / ``muon_killed`` (after 5 of 10 steps) in launch 1,
``muon_gtp4_resume`` in launch 2.

MoE (dense GTP2, experts EP2·EGTP2): ``moe_10`` / ``moe_killed`` (``SequentialMLP`` experts, killed
after 5 steps) in launch 1, ``moe_resume`` in launch 2; ``grouped_10`` (``TEGroupedMLP`` experts of
the CPU ``GroupedLinear`` stand-ins, built as their EGTP shards by the strategy; NeMo's
``ModelCheckpoint`` every 5 steps, asynchronously: the step-5 write overlaps steps 6..10)
in launch 1, and in launch 2 its step-5 checkpoint resumed at the
same layout (``grouped_resume``) and the ``SequentialMLP`` checkpoint resumed into ``TEGroupedMLP``
experts at EP1·EGTP4 (``grouped_from_seq``). Full weights and optimizer state (``Fit.state_to``)
are recorded at step 5 by the saving runs and right after each load. (Grouped checkpoints loaded
without GTP: ``tests/test_moe_checkpoint.py``, at the megatron level.)

A fit whose ``max_steps`` equals the checkpoint's step restores and trains nothing, so its
weights are exactly what was loaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_gtp.engine import GTPConfig
from tests.harness.shared_launch import shared_launch
from tests.harness.strategy import MOE_MODEL, Fit, pipelined, run_fits

WORLD = 4


def _close(
    got: list[float], want: list[float], what: str, *, first: int = 0, tol: float = 1e-5
) -> None:
    """Each of ``got`` within ``tol`` (relative) of ``want``'s; ``first``: the step number of
    their first entry, for the message."""
    for step, (x, y) in enumerate(zip(got, want, strict=True)):
        assert abs(x - y) <= tol * abs(y), f"{what} step {first + step}: {x} vs {y}"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


_MOE_STRATEGY = {"expert_model_parallel_size": 2, "expert_num_weight_shards": 2}
_GROUPED = {"model_kwargs": MOE_MODEL, "grouped_experts": True}  # TEGroupedMLP stand-ins
PP2 = pipelined(2)  # 4 layers over 2 stages, untied output layer
PP1 = {"model_kwargs": PP2["model_kwargs"]}  # the same model on one stage
ASYNC = {"ckpt_async_save": True}  # NeMo's default; the harness saves synchronously otherwise
PRESHARD = {"gtp_config": GTPConfig(preshard_linears="all")}  # megatron-local linears too
PLAIN_BASE = "plain_ckpts/step=9"  # plain_tp1's save after its 10 steps: LoRA's pretrained model
# a LoRA fine-tune as a requeued job runs it: restarted from its newest adapter checkpoint
LORA_RESTARTS: dict[str, Any] = dict(
    peft="lora",
    restore_from=PLAIN_BASE,
    checkpoint_every=5,
    checkpoint_dir="lora_ckpts",
    save_last=True,
    auto_resume="lora_ckpts",
    strategy_kwargs=ASYNC,
    checkpoint_context=True,  # NeMo's context/: what llm.peft.merge_lora rebuilds the model from
)

# Launch 1 needs no fresh processes: it shares its spawn with test_strategy.py's 4-rank fits.
# Paths are relative to the shared launch's directory.
FIRST_LAUNCH = [
    Fit(
        "gtp_20",
        gtp=2,
        steps=20,
        save_to="gtp_20_saved",
        weights_to="gtp_20.pt",
        strategy_kwargs=ASYNC,
    ),
    Fit(
        "gtp_killed",
        gtp=2,
        steps=20,
        stop_after=10,
        checkpoint_every=10,
        checkpoint_dir="gtp_ckpts",
        weights_to="gtp_killed.pt",
        strategy_kwargs=ASYNC,
    ),
    # NeMo recipes' checkpointing (a -last copy of each save, asynchronous), killed after 5
    Fit(
        "auto_killed",
        gtp=2,
        steps=20,
        stop_after=5,
        checkpoint_every=5,
        checkpoint_dir="auto_ckpts",
        save_last=True,
        strategy_kwargs=ASYNC,
    ),
    # MoE: dense GTP2 + EP2·EGTP2 (SequentialMLP experts), killed after 5 of 10 steps
    Fit("moe_10", gtp=2, steps=10, model_kwargs=MOE_MODEL, strategy_kwargs=_MOE_STRATEGY),
    Fit(
        "moe_killed",
        gtp=2,
        steps=10,
        stop_after=5,
        checkpoint_every=5,
        checkpoint_dir="moe_ckpts",
        model_kwargs=MOE_MODEL,
        strategy_kwargs=_MOE_STRATEGY,
        state_at=5,
        state_to="moe_5.pt",
    ),
    # TEGroupedMLP experts, same layout: NeMo's ModelCheckpoint at steps 5 and 10 (the step-5 one
    # is resumed in fresh processes; saving does not perturb the run, as moe_killed shows)
    Fit(
        "grouped_10",
        gtp=2,
        steps=10,
        checkpoint_every=5,
        checkpoint_dir="grouped_ckpts",
        strategy_kwargs={**_MOE_STRATEGY, **ASYNC},
        state_at=5,
        state_to="grouped_5.pt",
        **_GROUPED,
    ),
    # Muon (design §1.6): TP1·GTP2·DP2, uninterrupted and killed after 5 of 10 steps
    Fit("muon_10", gtp=2, steps=10, distopt=False, muon=True),
    Fit(
        "muon_killed",
        gtp=2,
        steps=10,
        stop_after=5,
        checkpoint_every=5,
        checkpoint_dir="muon_ckpts",
        distopt=False,
        muon=True,
    ),
    # pipeline parallelism: PP2·GTP2, uninterrupted and killed after 5 of 10 steps
    Fit("pp_10", gtp=2, steps=10, **PP2),
    Fit(
        "pp_killed",
        gtp=2,
        steps=10,
        stop_after=5,
        checkpoint_every=5,
        checkpoint_dir="pp_ckpts",
        state_at=5,
        state_to="pp_5.pt",
        **PP2,
    ),
    Fit(
        "plain_tp1",
        steps=10,
        checkpoint_every=10,
        checkpoint_dir="plain_ckpts",
        weights_to="plain.pt",
        strategy_kwargs={"ckpt_save_optimizer": False},
    ),
    # llm.finetune's LoRA, started from plain_tp1's checkpoint as the pretrained model (NeMo's
    # AutoResume(restore_config=...)): plain DP4, GTP2, and GTP2 killed after 5 of 10 steps,
    # saving adapter checkpoints asynchronously with a -last copy through NeMo's PEFT IO
    Fit("lora_base_dp4", peft="lora", restore_from=PLAIN_BASE, weights_to="lora_base_dp4.pt"),
    Fit(
        "lora_base_gtp2",
        gtp=2,
        peft="lora",
        restore_from=PLAIN_BASE,
        weights_to="lora_base_gtp2.pt",
    ),
    Fit("lora_base_killed", gtp=2, stop_after=5, **LORA_RESTARTS),
    # the same LoRA with the linears built as their GTP shards (TE's default on GPUs): the
    # pretrained weights load into shards that exist before NeMo's PEFT runs the model transform
    Fit(
        "lora_base_preshard",
        gtp=2,
        peft="lora",
        restore_from=PLAIN_BASE,
        weights_to="lora_base_preshard.pt",
        strategy_kwargs=PRESHARD,
    ),
]
shared_launch(WORLD).add(FIRST_LAUNCH)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    launch = shared_launch(WORLD)
    out1 = launch.results(tmp_path_factory)
    root: Path = launch.out_dir
    ckpts, plain_ckpts = root / "gtp_ckpts", root / "plain_ckpts"
    saved = sorted(p for p in ckpts.iterdir() if not p.name.startswith("."))
    assert len(saved) == 1, saved  # one ModelCheckpoint save, at step 10
    plain_ckpt = max(plain_ckpts.iterdir())
    moe_saved = [p for p in (root / "moe_ckpts").iterdir() if not p.name.startswith(".")]
    assert len(moe_saved) == 1, moe_saved
    (grouped_saved,) = (root / "grouped_ckpts").glob("step=4*")  # after 5 steps
    (muon_saved,) = [p for p in (root / "muon_ckpts").iterdir() if not p.name.startswith(".")]
    (pp_saved,) = [p for p in (root / "pp_ckpts").iterdir() if not p.name.startswith(".")]
    auto_saved = sorted(p.name for p in (root / "auto_ckpts").iterdir())  # before the restart
    lora_saved = sorted(p.name for p in (root / "lora_ckpts").iterdir())  # before the restarts
    base, lora_ckpts = str(root / PLAIN_BASE), str(root / "lora_ckpts")
    truncated = root / "truncated" / saved[0].name
    shutil.copytree(saved[0], truncated)
    data_files = sorted((truncated / "weights").glob("*.distcp"))
    cut = max(data_files, key=lambda f: f.stat().st_size)
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    second = [  # fresh processes: the resumed job does not share the killed job's
        Fit("gtp_resume", gtp=2, steps=20, resume_from=str(saved[0])),
        Fit("gtp4_resume", gtp=4, steps=20, resume_from=str(saved[0])),
        # restarted as llm.train restarts a requeued job: AutoResume finds the -last save
        # (the same fit as the killed one, saving on into the same directory)
        Fit(
            "auto_resume",
            gtp=2,
            steps=20,
            checkpoint_every=5,
            checkpoint_dir=str(root / "auto_ckpts"),
            save_last=True,
            auto_resume=str(root / "auto_ckpts"),
            strategy_kwargs=ASYNC,
        ),
        Fit(
            "gtp_from_plain",
            gtp=2,
            steps=10,
            resume_from=str(plain_ckpt),
            weights_to=str(root / "gtp_from_plain.pt"),
            strategy_kwargs={"ckpt_load_optimizer": False},
        ),
        Fit(
            "plain_from_gtp",
            tp=2,
            steps=10,
            resume_from=str(saved[0]),
            weights_to=str(root / "plain_from_gtp.pt"),
            strategy_kwargs={"ckpt_load_optimizer": False},
        ),
        Fit(
            "gtp_from_save",
            gtp=2,
            steps=20,
            resume_from=str(root / "gtp_20_saved"),
            weights_to=str(root / "gtp_from_save.pt"),
        ),
        Fit(
            "moe_resume",
            gtp=2,
            steps=10,
            resume_from=str(moe_saved[0]),
            model_kwargs=MOE_MODEL,
            strategy_kwargs=_MOE_STRATEGY,
        ),
        Fit(
            "grouped_resume",
            gtp=2,
            steps=10,
            resume_from=str(grouped_saved),
            strategy_kwargs=_MOE_STRATEGY,
            state_at=5,
            state_to=str(root / "grouped_resume_5.pt"),
            **_GROUPED,
        ),
        Fit(  # SequentialMLP's checkpoint (EP2·EGTP2) into TEGroupedMLP experts at EP1·EGTP4
            "grouped_from_seq",
            gtp=2,
            steps=10,
            resume_from=str(moe_saved[0]),
            strategy_kwargs={"expert_model_parallel_size": 1, "expert_num_weight_shards": 4},
            state_at=5,
            state_to=str(root / "grouped_from_seq_5.pt"),
            **_GROUPED,
        ),
        # Muon's checkpoint (momenta and fp32 params as GTP2 shards) resumed at TP1·GTP4
        Fit(
            "muon_gtp4_resume",
            gtp=4,
            steps=10,
            resume_from=str(muon_saved),
            distopt=False,
            muon=True,
        ),
        # PP2·GTP2's checkpoint resumed on one stage at TP1·GTP2·DP2, and its weights loaded
        # without GTP at PP2·DP2 (plain megatron cannot describe torch Adam's state, above)
        Fit(
            "pp_resume_pp1",
            gtp=2,
            steps=10,
            resume_from=str(pp_saved),
            state_at=5,
            state_to=str(root / "pp_resume_pp1_5.pt"),
            **PP1,
        ),
        Fit(
            "pp_plain_from_gtp",
            steps=6,  # one step: the state is dumped at the train start
            resume_from=str(pp_saved),
            state_at=5,
            state_to=str(root / "pp_plain_from_gtp_5.pt"),
            strategy_kwargs={**PP2["strategy_kwargs"], "ckpt_load_optimizer": False},
            model_kwargs=PP2["model_kwargs"],
        ),
        # LoRA's adapter checkpoint (GTP2, step 5) restarted at GTP4 and without GTP (weights
        # only: plain megatron cannot describe torch Adam's state, above), then at GTP2 as the
        # same job again (saving on into lora_ckpts: it runs after the two that read step 5)
        Fit(
            "lora_base_gtp4_resume",
            gtp=4,
            peft="lora",
            restore_from=base,
            auto_resume=lora_ckpts,
            checkpoint_every=100,  # AutoResume needs a checkpoint callback; it never saves
            checkpoint_dir=str(root / "launch2" / "lora_gtp4_ckpts"),
        ),
        Fit(
            "lora_base_plain_resume",
            peft="lora",
            restore_from=base,
            auto_resume=lora_ckpts,
            checkpoint_every=100,
            checkpoint_dir=str(root / "launch2" / "lora_plain_ckpts"),
            strategy_kwargs={"ckpt_load_optimizer": False},
        ),
        Fit(
            "lora_base_preshard_resume",
            gtp=2,
            peft="lora",
            restore_from=base,
            auto_resume=lora_ckpts,
            checkpoint_every=100,
            checkpoint_dir=str(root / "launch2" / "lora_preshard_ckpts"),
            strategy_kwargs=PRESHARD,
        ),
        Fit(
            "lora_base_resume",
            gtp=2,
            **{
                **LORA_RESTARTS,  # the same job, its paths absolute (this launch's own dir)
                "restore_from": base,
                "checkpoint_dir": lora_ckpts,
                "auto_resume": lora_ckpts,
            },
        ),
        # last: a failed fit leaves the launch going, but nothing after it is worth the risk
        Fit("gtp_truncated", gtp=2, steps=20, resume_from=str(truncated), expect_error=True),
    ]
    (root / "launch2").mkdir()
    out2 = run_fits(second, WORLD, root / "launch2")
    results = {fit.name: out1[fit.name][0] for fit in FIRST_LAUNCH}  # rank 0's view
    results.update({fit["name"]: fit for fit in out2[0]})
    results["gtp_truncated_every_rank"] = [rank[-1] for rank in out2]
    return {
        "root": root,
        "saved": saved[0],
        "plain_ckpt": plain_ckpt,
        "truncated": truncated,
        "auto_saved": auto_saved,
        "lora_saved": lora_saved,
        "cut": cut,
        **results,
    }


def test_resume_continues_the_uninterrupted_curve_exactly(runs: dict[str, Any]) -> None:
    full, resumed = runs["gtp_20"], runs["gtp_resume"]
    assert len(full["losses"]) == 20 and len(resumed["losses"]) == 10
    assert runs["gtp_killed"]["losses"] == full["losses"][:10]
    assert resumed["losses"] == full["losses"][10:], (resumed["losses"], full["losses"][10:])
    assert resumed["grad_norms"] == full["grad_norms"][10:]
    assert resumed["lrs"] == full["lrs"][10:]
    assert resumed["global_step"] == 20
    assert resumed["logged_consumed_samples"] == full["logged_consumed_samples"] == 20 * 8


def test_nemo_autoresume_restarts_from_the_last_checkpoint(runs: dict[str, Any]) -> None:
    """NeMo's recipes save a ``last`` copy of each checkpoint (``save_last=True``, asynchronous)
    and ``llm.train`` restarts a requeued job with ``AutoResume(resume_if_exists=True)``, which
    loads the committed ``*last``: under GTP the restart continues the uninterrupted curve bit
    for bit, and saves on into the same directory."""
    full, resumed = runs["gtp_20"], runs["auto_resume"]
    assert runs["auto_killed"]["losses"] == full["losses"][:5]
    assert runs["auto_saved"] == ["last", "step=4"], runs["auto_saved"]  # Lightning names it
    assert resumed["losses"] == full["losses"][5:], (resumed["losses"], full["losses"][5:])
    assert resumed["grad_norms"] == full["grad_norms"][5:]
    assert resumed["global_step"] == 20
    # the restarted job saved on every 5 steps, and its "last" copy holds its newest save
    ckpts = runs["root"] / "auto_ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["last", "step=14", "step=19", "step=4", "step=9"], names
    for name in names:
        assert (ckpts / name / "weights" / "metadata.json").is_file(), name
        assert not list((ckpts / name).glob(".weights.*")), name
    common = torch.load(ckpts / "last" / "weights" / "common.pt", weights_only=False)
    assert common["global_step"] == 20


def test_moe_resume_continues_the_uninterrupted_curve_exactly(runs: dict[str, Any]) -> None:
    """A MoE GPT at dense GTP2 + EP2·EGTP2 resumed from NeMo's step-5 checkpoint (expert shards,
    expert distributed-optimizer state) continues the uninterrupted run bit for bit."""
    full, resumed = runs["moe_10"], runs["moe_resume"]
    assert len(full["losses"]) == 10 and len(resumed["losses"]) == 5
    assert runs["moe_killed"]["losses"] == full["losses"][:5]
    assert resumed["losses"] == full["losses"][5:], (resumed["losses"], full["losses"][5:])
    assert resumed["grad_norms"] == full["grad_norms"][5:]


def _full_state(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / f"{name}.pt", weights_only=True)


def test_grouped_moe_resume_continues_the_uninterrupted_curve_exactly(
    runs: dict[str, Any],
) -> None:
    """``TEGroupedMLP`` experts (the CPU ``GroupedLinear`` stand-ins), built as their EGTP shards
    by the strategy, resumed by NeMo from its step-5 checkpoint at dense GTP2 + EP2·EGTP2: every
    weight and optimizer state (fp32 master, both Adam moments) equals the saving run's bit for
    bit right after the load, and the resumed curve is the uninterrupted one bit for bit."""
    from tests.harness.checkpoint import assert_same_state

    full, resumed = runs["grouped_10"], runs["grouped_resume"]
    for fit in (full, resumed):  # fc1, fc2 of 2 layers built pre-sharded; 2 dense + 2x2 grouped
        assert (fit["presharded_modules"], fit["gtp_params"]) == (4, 4 + 8)
    assert len(full["losses"]) == 10 and len(resumed["losses"]) == 5
    saved = _full_state(runs["root"], "grouped_5")
    assert {key.split("/")[0] for key in saved} == {"weight", "fp32_param", "exp_avg", "exp_avg_sq"}
    assert assert_same_state(_full_state(runs["root"], "grouped_resume_5"), saved) == len(saved)
    assert resumed["losses"] == full["losses"][5:], (resumed["losses"], full["losses"][5:])
    assert resumed["grad_norms"] == full["grad_norms"][5:]
    assert resumed["global_step"] == 10


def test_moe_resume_into_another_expert_kind_and_layout(runs: dict[str, Any]) -> None:
    """NeMo's checkpoint of ``SequentialMLP`` experts at EP2·EGTP2 resumed into ``TEGroupedMLP``
    experts at EP1·EGTP4: weights and optimizer state bit for bit after the load, the curve within
    1e-5 of the uninterrupted ``SequentialMLP`` run's."""
    from tests.harness.checkpoint import assert_same_state

    root: Path = runs["root"]
    saved = _full_state(root, "moe_5")
    assert assert_same_state(_full_state(root, "grouped_from_seq_5"), saved) == len(saved)
    full, resumed = runs["moe_10"], runs["grouped_from_seq"]
    assert resumed["presharded_modules"] == 4 and len(resumed["losses"]) == 5
    for what in ("losses", "grad_norms"):
        _close(resumed[what], full[what][5:], what, first=5)


def test_resume_at_another_gtp_size(runs: dict[str, Any]) -> None:
    full, resumed = runs["gtp_20"], runs["gtp4_resume"]
    assert len(resumed["losses"]) == 10
    for what in ("losses", "grad_norms"):
        _close(resumed[what], full[what][10:], what, first=10)


def test_muon_resumes_at_another_gtp_size(runs: dict[str, Any]) -> None:
    """Muon + Adam through NeMo's checkpoint: the momenta (GTP2 shards) resharded to GTP4, the
    resumed steps within 1e-5 of the uninterrupted run's (design §1.6 "Muon")."""
    full, resumed = runs["muon_10"], runs["muon_gtp4_resume"]
    assert len(resumed["losses"]) == 5
    for what in ("losses", "grad_norms"):
        _close(resumed[what], full[what][5:], what, first=5)


def test_pipeline_checkpoint_resumes_on_one_stage(runs: dict[str, Any]) -> None:
    """NeMo's checkpoint of PP2·GTP2 (each stage's layers under their global numbers, GTP
    shards at their global offsets) resumed on one stage at TP1·GTP2·DP2: every weight, fp32
    master and Adam moment bit for bit after the load, the resumed steps within 1e-5 of the
    uninterrupted PP2·GTP2 run."""
    from tests.harness.checkpoint import assert_same_state

    full, resumed = runs["pp_10"], runs["pp_resume_pp1"]
    assert runs["pp_killed"]["losses"] == full["losses"][:5]
    saved = _full_state(runs["root"], "pp_5")
    assert {key.split("/")[0] for key in saved} == {"weight", "fp32_param", "exp_avg", "exp_avg_sq"}
    assert assert_same_state(_full_state(runs["root"], "pp_resume_pp1_5"), saved) == len(saved)
    assert len(resumed["losses"]) == 5
    for what in ("losses", "grad_norms"):
        _close(resumed[what], full[what][5:], what, first=5)


def test_pipeline_checkpoint_loads_without_gtp(runs: dict[str, Any]) -> None:
    """The PP2·GTP2 checkpoint's weights loaded by plain ``MegatronStrategy`` at PP2·DP2:
    every weight bit for bit (GTP shards joined at their offsets, pad rows dropped)."""
    saved = _full_state(runs["root"], "pp_5")
    loaded = _full_state(runs["root"], "pp_plain_from_gtp_5")
    weights = {key: value for key, value in saved.items() if key.startswith("weight/")}
    # 4 layers x (2 norms x 2 + qkv, proj, fc1, fc2), 2 embeddings, final norm x 2, output layer
    assert len(weights) == 37
    for key, value in weights.items():
        assert torch.equal(loaded[key], value), key


def test_model_checkpoint_writes_a_committed_torch_dist_checkpoint(runs: dict[str, Any]) -> None:
    """NeMo's ``ModelCheckpoint`` saves, asynchronous ones (committed by NeMo's
    ``AsyncFinalizerCallback`` during the fit or at its end) and synchronous ones alike, leave a
    committed ``weights/`` and no staging directory."""
    saved: Path = runs["saved"]
    assert runs["gtp_killed"]["checkpoint_io"] == "AsyncFinalizableCheckpointIO"
    assert runs["moe_killed"]["checkpoint_io"] == "GTPCheckpointIO"  # synchronous
    for ckpts in ("gtp_ckpts", "grouped_ckpts", "moe_ckpts"):
        for ckpt in (p for p in (runs["root"] / ckpts).iterdir() if not p.name.startswith(".")):
            assert (ckpt / "weights" / "metadata.json").is_file(), ckpt
            assert not list(ckpt.glob(".weights.*")), ckpt  # staging committed, nothing aside
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gtp.checkpoint.show", str(saved / "weights")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "layout: TP1 x GTP2 x DP2" in result.stdout, result.stdout
    # the path +resume= takes (the NeMo checkpoint, weights/ inside) works as it is
    from nemo_gtp.checkpoint.show import describe

    assert describe(saved)["path"] == str((saved / "weights").absolute())


@pytest.mark.parametrize(
    "loader, saver", [("gtp_from_plain", "plain"), ("plain_from_gtp", "gtp_killed")]
)
def test_interop_with_plain_megatron_strategy(
    runs: dict[str, Any], loader: str, saver: str
) -> None:
    root: Path = runs["root"]
    got, want = _weights(root / f"{loader}.pt"), _weights(root / f"{saver}.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), f"{loader}: {name} differs from {saver}'s"


def test_save_checkpoint_after_fit_resumes(runs: dict[str, Any]) -> None:
    """``trainer.save_checkpoint`` after ``trainer.fit`` (NeMo's teardown has run) writes the
    keys of the saves during the fit: weights and Adam state load back unchanged. The save is
    asynchronous (NeMo's default): outside the training loop no NeMo callback would ever commit
    it, so the strategy does (it used to leave only a half-written ``.weights.saving``)."""
    root: Path = runs["root"]
    assert runs["gtp_20"]["checkpoint_io"] == "AsyncFinalizableCheckpointIO"
    assert (root / "gtp_20_saved" / "weights" / "metadata.json").is_file()
    assert not list((root / "gtp_20_saved").glob(".weights.*"))
    got, want = _weights(root / "gtp_from_save.pt"), _weights(root / "gtp_20.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs after the reload"


def test_truncated_checkpoint_names_the_damaged_file(runs: dict[str, Any]) -> None:
    cut: Path = runs["cut"]
    for rank, result in enumerate(runs["gtp_truncated_every_rank"]):
        error = result["error"]
        assert error.startswith("CheckpointIncompleteError"), f"rank {rank}: {error[:2000]}"
        assert str(runs["truncated"] / "weights") in error and "incomplete" in error
        assert f"{cut.name}: {cut.stat().st_size} bytes" in error, error


def test_lora_from_a_pretrained_checkpoint(runs: dict[str, Any]) -> None:
    """``llm.finetune``'s LoRA started from a plain (no-GTP) checkpoint: at TP1·GTP2·DP2 it
    matches plain DP4 (losses, grad norms within 1e-5; adapters within 1e-5 at the end), and the
    frozen base model, loaded into GTP shards, ends as the checkpoint holds it, bit for bit."""
    root: Path = runs["root"]
    assert runs["plain_ckpt"] == root / PLAIN_BASE
    gtp, plain = runs["lora_base_gtp2"], runs["lora_base_dp4"]
    assert gtp["frozen_gtp_params"] == 8 and gtp["checkpoint_io"] == "GTPAdapterIO"
    for what in ("losses", "grad_norms"):
        _close(gtp[what], plain[what], what)
    pretrained = _weights(root / "plain.pt")  # plain_tp1's weights after its 10 steps
    got, want = _weights(root / "lora_base_gtp2.pt"), _weights(root / "lora_base_dp4.pt")
    assert got.keys() == want.keys()
    adapters = [name for name in got if ".adapter." in name]
    assert len(adapters) == 16  # 2 layers x 4 linears x (linear_in, linear_out)
    for name in got:
        if name in adapters:
            scale = want[name].abs().max()
            assert (got[name] - want[name]).abs().max() <= 1e-5 * scale, name
        else:
            assert torch.equal(got[name], pretrained[name]), f"base weight {name} changed"


def test_lora_adapter_checkpoints_commit_atomically_and_resume(runs: dict[str, Any]) -> None:
    """NeMo's PEFT saves only the adapters (and their optimizer state) with an
    ``adapter_metadata.json`` naming the pretrained checkpoint. Under GTP they go through GTP's
    atomic commit, the metadata inside the committed ``weights/`` (NeMo's asynchronous save
    would otherwise write it into a directory the commit replaces). The restarted job
    (``AutoResume``: base first, then adapters) continues the uninterrupted curve bit for bit;
    the same checkpoint resumed at GTP4 stays within 1e-5, and without GTP (weights only) its
    first loss is the GTP run's."""
    from torch.distributed.checkpoint import FileSystemReader

    root: Path = runs["root"]
    full = runs["lora_base_gtp2"]
    assert runs["lora_base_killed"]["losses"] == full["losses"][:5]
    assert runs["lora_saved"] == ["last", "step=4"], runs["lora_saved"]
    step4 = root / "lora_ckpts" / "step=4"
    meta = json.loads((step4 / "weights" / "adapter_metadata.json").read_text())
    assert meta == {"model_ckpt_path": str(root / PLAIN_BASE)}
    keys = FileSystemReader(str(step4 / "weights")).read_metadata().state_dict_metadata
    model_keys = [key for key in keys if not key.startswith("optimizer")]
    assert model_keys and all(".adapter." in key for key in model_keys), model_keys
    assert any(key.startswith("optimizer") for key in keys)
    resumed = runs["lora_base_resume"]
    assert resumed["losses"] == full["losses"][5:], (resumed["losses"], full["losses"][5:])
    assert resumed["grad_norms"] == full["grad_norms"][5:]
    for ckpt in (root / "lora_ckpts").iterdir():  # the restarted job saved on (steps 9, last)
        assert (ckpt / "weights" / "adapter_metadata.json").is_file(), ckpt
        assert not list(ckpt.glob(".weights.*")), ckpt
    for what in ("losses", "grad_norms"):
        _close(runs["lora_base_gtp4_resume"][what], full[what][5:], f"GTP4 {what}", first=5)
    plain = runs["lora_base_plain_resume"]
    assert len(plain["losses"]) == 5
    _close(plain["losses"][:1], full["losses"][5:6], "plain first loss", first=5, tol=1e-6)


def test_lora_restores_and_resumes_into_linears_built_as_shards(runs: dict[str, Any]) -> None:
    """Linears built as their GTP shard (``preshard_linears``; TE's default on GPUs) are GTP
    shards before NeMo's PEFT runs the model transform, when the pretrained weights and, on a
    restart, the base and adapters load: both loads see GTP's description of them (the base
    used to fail on every global shape). Built with the unsharded model's rows (design §3.1
    "Exact init"), they leave the RNG where the sliced build does, so NeMo's LoRA adapters start
    from the same values: the fit is the sliced one's bit for bit, its frozen base ends as the
    checkpoint holds it, and the adapter checkpoint of the sliced run resumes into it
    continuing that run bit for bit."""
    root: Path = runs["root"]
    pre, sliced = runs["lora_base_preshard"], runs["lora_base_gtp2"]
    assert pre["presharded_modules"] > 0 and pre["frozen_gtp_params"] == 8
    assert (pre["losses"], pre["grad_norms"]) == (sliced["losses"], sliced["grad_norms"])
    pretrained = _weights(root / "plain.pt")
    got = _weights(root / "lora_base_preshard.pt")
    for name in pretrained:
        assert torch.equal(got[name], pretrained[name]), f"base weight {name}"
    for name, value in _weights(root / "lora_base_gtp2.pt").items():
        assert torch.equal(got[name], value), f"{name}: not the sliced fit's"
    resumed = runs["lora_base_preshard_resume"]
    assert resumed["losses"] == sliced["losses"][5:], (resumed["losses"], sliced["losses"][5:])


def _merge_lora(rank: int, checkpoint: str, out: str) -> None:
    """NeMo's ``llm.peft.merge_lora`` in a process of its own (no GTP state, no process group of
    the fits), as a user runs it after fine-tuning."""
    from nemo_gtp.cpu.compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm

    llm.peft.merge_lora(lora_checkpoint_path=checkpoint, output_path=out)


def test_lora_adapter_checkpoint_merges_with_nemo(runs: dict[str, Any]) -> None:
    """A GTP fine-tune's adapter checkpoint is what NeMo's ``llm.peft.merge_lora`` expects: its
    ``context/`` names the LoRA (set up as ``llm.finetune`` does, ``strategy.peft.set_peft``),
    and the merge (a plain single-process load of the base, then the adapters) writes each
    linear as base + alpha/dim · B·A, bit for bit the same bf16 arithmetic on the weights the
    GTP run trained (the restarted job's last save continues ``lora_base_gtp2`` bit for bit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from tests.harness.objects import make_peft
    from tests.harness.spawn import start_ranks

    root: Path = runs["root"]
    saved = root / "lora_ckpts" / "step=9"
    assert (saved / "context").is_dir()
    out = root / "lora_merged"
    start_ranks(_merge_lora, (str(saved), str(out)), 1, join=True)
    reader = FileSystemReader(str(out / "weights"))
    sizes = reader.read_metadata().state_dict_metadata
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj")
    linears += ("mlp.linear_fc1", "mlp.linear_fc2")
    merged = {}
    for name in linears:
        key = f"module.decoder.layers.{name}.weight"  # the layers stacked along dim 0
        merged[key] = torch.empty(tuple(sizes[key].size), dtype=torch.bfloat16)
    dcp.load(merged, storage_reader=reader, no_dist=True)
    assert not any(".adapter." in key for key in sizes)
    trained, lora = _weights(root / "lora_base_gtp2.pt"), make_peft("lora")
    for name in linears:
        for layer, got in enumerate(merged[f"module.decoder.layers.{name}.weight"]):
            prefix = f"decoder.layers.{layer}.{name}"
            base, a, b = (
                trained[prefix + suffix].bfloat16()
                for suffix in (".weight", ".adapter.linear_in.weight", ".adapter.linear_out.weight")
            )
            assert torch.equal(got, base + (lora.alpha / lora.dim * b) @ a), prefix
            assert not torch.equal(got, base), f"{prefix}: the adapters added nothing"

"""The recipe loader and the README main job (``nemo_gtp.run ... --compare-baseline``)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gtp.recipes.config import load_recipe
from nemo_gtp.recipes.schema import ddp_average_in_collective

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_overrides_apply_and_typos_are_errors() -> None:
    cfg = load_recipe(TINY, ["trainer.max_steps=7", "strategy.num_weight_shards=4", "+data.seed=3"])
    assert cfg.trainer.max_steps == 7 and cfg.strategy.num_weight_shards == 4
    assert cfg.data.seed == 3
    with pytest.raises(ValueError, match=r"trainer.max_step.*use \+trainer.max_step"):
        load_recipe(TINY, ["trainer.max_step=7"])
    with pytest.raises(ValueError, match="is not key=value"):
        load_recipe(TINY, ["trainer.max_steps"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_keeps_gtp_constraints(path: Path) -> None:
    cfg = load_recipe(str(path))
    assert ddp_average_in_collective(cfg) is False  # GTP forbids it (design §3.2)
    tp = cfg.strategy.get("tensor_model_parallel_size", 1)
    assert cfg.strategy.num_weight_shards % tp == 0


def test_ddp_average_in_collective_follows_gtp() -> None:
    """``ddp.average_in_collective: null`` (the GPU recipes): off under GTP, dense or expert
    (design §3.2), on for a GPU run without GTP (NeMo's recipes' setting: no 1/DP pre-scale),
    off on CPU (gloo has no AVG); a value set by the recipe or an override is kept."""

    def average(recipe: str, *overrides: str) -> bool:
        return ddp_average_in_collective(load_recipe(str(ROOT / "configs" / recipe), overrides))

    assert average("gpt_1b_te.yaml") is False
    assert average("gpt_1b_te.yaml", "strategy.num_weight_shards=1") is True
    off = ("strategy.num_weight_shards=1", "ddp.average_in_collective=false")
    assert average("gpt_1b_te.yaml", *off) is False
    assert average("moe_1b.yaml", "strategy.num_weight_shards=1") is False  # expert GTP
    assert average("moe_1b.yaml", *off[:1], "strategy.expert_num_weight_shards=1") is True
    cpu = ("strategy.num_weight_shards=1", "ddp.average_in_collective=null")
    assert average("tiny_cpu.yaml", *cpu) is False


def test_main_job_gtp_matches_baseline_in_one_launch(tmp_path: Path) -> None:
    """The README's main command, shortened to 5 steps: both fits run and agree to 1e-5; the
    VERDICT line ends the output and names the plot it drew from the runs' TensorBoard logs
    (NeMo's NeMoLogger), which hold loss, step time, exposed GTP communication and memory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = tmp_path / "logs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_gtp.run",
            TINY,
            "trainer.max_steps=5",
            "--compare-baseline",
            "--log-dir",
            str(logs),
            "--plot",
            str(tmp_path / "main_job.png"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # a quiet start: what the run is first (layout, model size, logs), no third-party notices
    first = result.stdout.splitlines()[:2]
    assert first[0].startswith("layout: TP1·GTP2·DP2 on 4 CPU processes (gloo); GPT of ~0.11 M")
    assert first[1].startswith(f"logs: {logs} ")
    assert "pynvml" not in result.stderr and "[NeMo" not in result.stdout + result.stderr
    rows = re.findall(
        r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \| ([\d.e+-]+)$", result.stdout, flags=re.M
    )
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5], result.stdout
    assert max(float(r[3]) for r in rows) <= 1e-5, result.stdout
    assert float(rows[-1][1]) < float(rows[0][1])  # the loss goes down
    assert "GTP (TP1·GTP2)" in result.stdout and "baseline (TP1, no GTP)" in result.stdout
    verdict = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"VERDICT: GTP matches the baseline \(max rel loss diff \S+ over 5 steps, tolerance "
        r"1e-05\); step time GTP/baseline [\d.]+; plot: \S+\.png",
        verdict,
    ), verdict
    png = Path(verdict.rsplit("plot: ", 1)[1])
    assert png.is_file() and png.stat().st_size > 10_000, png  # four panels drawn
    # the VERDICT and the report's line time the same steps with the same numbers
    summary = next(s for s in result.stdout.splitlines() if s.startswith("gtp vs baseline:"))
    ratio = re.search(r"GTP/baseline ([\d.]+);", verdict)[1]
    assert re.search(r"ms = ([\d.]+);", summary)[1] == ratio, (summary, verdict)
    report_line = f"report: python -m nemo_gtp.report {logs / 'gtp'} {logs / 'baseline'} -o {png}"
    assert report_line in result.stdout
    _check_report_of_main_job(logs, rows, tmp_path)


def _check_report_of_main_job(logs: Path, rows: list[tuple[str, ...]], tmp_path: Path) -> None:
    """What ``nemo_gtp.report`` reads back from the main job's TensorBoard logs."""
    from nemo_gtp import report

    gtp, base = report.read_run(logs / "gtp"), report.read_run(logs / "baseline")
    # Lightning logs the metrics of the n-th optimizer step (the table's step n) at step n - 1
    steps = [int(r[0]) - 1 for r in rows]
    for run, column in ((gtp, 1), (base, 2)):
        loss = run.series(*report.LOSS)
        assert [s for s, _ in loss] == steps, run.scalars.keys()
        # the printed table and the logged loss: the same numbers (printed with 5 decimals)
        assert [round(v, 5) for _, v in loss] == [float(r[column]) for r in rows]
        for tags in (report.STEP_TIME, report.MEMORY, report.MODEL_STATE):
            series = run.series(*tags)
            assert [s for s, _ in series] == steps, (run.name, tags)
            assert all(v > 0 for _, v in series)
    exposed = gtp.series(*report.EXPOSED_COMM)
    assert [s for s, _ in exposed] == steps and not base.series(*report.EXPOSED_COMM)
    assert gtp.series("gtp/gather_bytes")[-1][1] > 0
    # GTP2 (optimizer sharded over DP2) holds less than its baseline (optimizer over DP4): the
    # linear weights and their gradients are halved
    assert gtp.series(*report.MODEL_STATE)[-1][1] < 0.8 * base.series(*report.MODEL_STATE)[-1][1]
    png = tmp_path / "report.png"
    assert report.main([str(logs / "gtp"), str(logs / "baseline"), "-o", str(png)]) == 0
    assert png.is_file() and png.stat().st_size > 10_000
    line = report.summary([gtp, base])
    assert re.fullmatch(
        r"gtp vs baseline: median step time [\d.]+ / [\d.]+ ms = [\d.]+; max rel loss diff "
        rf"\S+ over {len(steps)} common steps",
        line,
    ), line
    assert report.max_rel_loss_diff(gtp, base)[0] <= 1e-5
    assert report.main([str(tmp_path / "nothing_here")]) == 2  # a clear error, no traceback


def test_progress_line_times_gtp_waits_only_on_printed_steps(tmp_path: Path) -> None:
    """One line per log_every_n_steps on rank 0: step, loss, step time, tokens/s, exposed share."""
    import contextlib
    import io
    import types

    import torch

    from nemo_gtp.engine.timing import ExposedWaitTimer
    from nemo_gtp.recipes.loader import ProgressLog

    timer = ExposedWaitTimer()
    runtime = types.SimpleNamespace(wait_timer=timer)
    trainer = types.SimpleNamespace(
        global_rank=0,
        global_step=0,
        max_steps=4,
        callbacks=[],
        ckpt_path=None,
        callback_metrics={"reduced_train_loss": torch.tensor(3.5)},
        strategy=types.SimpleNamespace(gtp_runtimes=[runtime]),
    )
    log, out = ProgressLog(tokens_per_step=512, every_n_steps=2), io.StringIO()
    enabled = []
    with contextlib.redirect_stdout(out):
        for _ in range(4):
            log.on_train_batch_start(trainer)
            enabled.append(timer.enabled)
            timer.timed_wait(lambda: None, "gather", torch.device("cpu"))
            trainer.global_step += 1
            log.on_train_batch_end(trainer)
        trainer.global_step = 7
        # resumed: the restored ModelCheckpoint knows the earlier run's save, not reported
        (tmp_path / "step=1" / "weights").mkdir(parents=True)
        earlier = {f"{tmp_path}/step=1.ckpt": 1.0}
        saver = types.SimpleNamespace(best_k_models=earlier, last_model_path="")
        trainer.checkpoint_callbacks = [saver]
        log.on_train_start(trainer)
        # a ModelCheckpoint save shows as the directory NeMo wrote (not Lightning's ".ckpt"),
        # once its weights/ are committed (an asynchronous save's commit comes later)
        saver.best_k_models = {**earlier, f"{tmp_path}/step=3.ckpt": 1.0}
        log.on_fit_end(trainer)  # not committed yet: nothing printed
        (tmp_path / "step=3" / "weights").mkdir(parents=True)
        log.on_fit_end(trainer)
        log.on_fit_end(trainer)  # reported once
    assert enabled == [False, True, False, True] and not timer.enabled
    lines = out.getvalue().splitlines()
    assert lines[3:] == [f"saved checkpoint {tmp_path}/step=3"], lines
    lines = lines[:3]
    assert re.fullmatch(
        r"step 2/4 \| loss 3\.50000 \| [\d.]+ ms \| [\d,]+ tokens/s \| GTP exposed comm [\d.]+%",
        lines[0],
    ), lines[0]
    assert lines[1].startswith("step 4/4 | loss 3.50000")
    assert lines[2] == "resumed at step 7 from None"


def test_pipeline_dtype_reaches_the_strategy() -> None:
    """NeMo copies the strategy's pipeline_dtype into the model config: a recipe's
    model.pipeline_dtype must reach the strategy, as a torch dtype (else megatron's
    "pipeline_dtype must be specified" fires under pipeline parallelism)."""
    import torch

    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.loader import strategy_kwargs
    from nemo_gtp.recipes.validate import validate_recipe

    cfg = load_recipe("configs/tiny_cpu.yaml", ["+model.pipeline_dtype=bfloat16"])
    assert strategy_kwargs(cfg, {"pipeline_dtype": torch.bfloat16})["pipeline_dtype"] is (
        torch.bfloat16
    )
    cfg = load_recipe("configs/tiny_cpu.yaml", ["+strategy.pipeline_dtype=float16"])
    assert strategy_kwargs(cfg, {"pipeline_dtype": torch.bfloat16})["pipeline_dtype"] is (
        torch.float16
    )
    assert "pipeline_dtype" not in strategy_kwargs(load_recipe("configs/tiny_cpu.yaml"), {})
    bad = load_recipe("configs/tiny_cpu.yaml", ["+strategy.pipeline_dtype=bf16"])
    with pytest.raises(ValueError, match="strategy.pipeline_dtype"):
        validate_recipe(bad)


def test_optim_muon_builds_the_muon_module() -> None:
    """``optim.optimizer=muon`` + the ``muon`` section: NeMo's optimizer module with Muon
    (design §1.6); megatron's own otherwise."""
    import torch

    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.loader import optimizer_module
    from nemo_gtp.strategy.muon import MuonOptimizerModule

    muon = ["optim.optimizer=muon", "optim.use_distributed_optimizer=false"]
    extra = ["+muon.ns_dtype=float32", "+muon.momentum=0.9", "+muon.adjust_lr_fn=match_rms_adamw"]
    module = optimizer_module(load_recipe("configs/tiny_cpu.yaml", muon + extra))
    assert isinstance(module, MuonOptimizerModule)
    assert (module.muon.ns_dtype, module.muon.momentum) == (torch.float32, 0.9)
    assert module.muon.adjust_lr_fn == "match_rms_adamw" and module.config.lr == 0.003
    plain = optimizer_module(load_recipe("configs/tiny_cpu.yaml"))
    assert not isinstance(plain, MuonOptimizerModule) and plain.config.optimizer == "adam"


def test_checkpoint_section_saves_nemo_context_unless_told_not_to(tmp_path: Path) -> None:
    """Recipe checkpoints carry NeMo's ``context/`` as NeMo's ``ModelCheckpoint`` does by default
    (``llm.export_ckpt`` and ``llm.peft.merge_lora`` read it); ``checkpoint.context=false`` leaves
    it out. The recipes' tokenizer is recorded for it (NeMo's ``NullTokenizer`` is not)."""
    from nemo_gtp.data.synthetic import ExportableNullTokenizer
    from nemo_gtp.recipes.loader import _model_checkpoint

    section = {"dir": str(tmp_path), "every_n_train_steps": 2}
    default = _model_checkpoint(dict(section))
    off = _model_checkpoint({**section, "context": False})
    assert (default.always_save_context, default.save_context_on_train_end) == (True, True)
    assert (off.always_save_context, off.save_context_on_train_end) == (False, False)
    assert hasattr(ExportableNullTokenizer(7), "__io__")


def test_pipeline_parallel_recipe_runs_with_gtp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe with pipeline parallelism (PP2 x GTP2 on 4 CPU ranks, untied embeddings: tied
    ones are refused on CPU) trains through the CLI and matches its PP2 baseline; the recipe's
    model.pipeline_dtype reaches megatron (it used to fail with "pipeline_dtype must be
    specified"). The CLI's ``main`` runs in this process (the main job above is the
    subprocess launch): its CPU ranks fork from the session's preloaded fork server."""
    from nemo_gtp.run import main

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # what main sets for CPU runs, undone after
    args = [
        "+strategy.pipeline_model_parallel_size=2",
        "+model.pipeline_dtype=float32",
        "+model.share_embeddings_and_output_weights=false",
        "trainer.max_steps=3",
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([TINY, *args, "--compare-baseline", "--plot", str(tmp_path / "pp.png")])
    assert status == 0, out.getvalue()[-4000:]
    assert out.getvalue().strip().splitlines()[-1].startswith("VERDICT: GTP matches the baseline")


def test_requeued_job_resumes_from_its_last_committed_checkpoint_at_another_gtp_size(
    tmp_path: Path,
) -> None:
    """A preempted job rerun with the same command, as the CLI builds it (``build_fit``, NeMo's
    logger): ``+resume=latest`` with no checkpoint yet starts at step 0; the GTP2 run saves every
    3 steps asynchronously (NeMo's default ``ckpt_async_save``). Its step-5 save is then made to
    look killed before its commit (weights still staged, NeMo's unfinished marker beside it).
    The same command at GTP4 in fresh ranks resumes from step 2's checkpoint, the newest
    committed one, continues the uninterrupted curve within 1e-5, and writes step 5 anew. (Without
    nvidia-resiliency-ext the first run failed in NeMo's logger setup; it is now a dependency,
    and refused before launch where it is missing: ``tests/test_bad_inputs.py``.) Both launches
    fork their ranks from the preloaded server."""
    from nemo_gtp.recipes.launch import launch_fits
    from nemo_gtp.recipes.resume import is_committed

    ckpts = tmp_path / "ckpts"
    job = [
        "trainer.max_steps=6",
        f"+checkpoint.dir={ckpts}",
        "+checkpoint.every_n_train_steps=3",
        "strategy.ckpt_async_save=true",
        "+resume=latest",
    ]
    full = launch_fits(TINY, {"save": job}, log_dirs={"save": str(tmp_path / "save")})["save"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step=2", "step=5"]  # nothing staged
    assert all(
        (ckpts / name / "weights" / "metadata.json").is_file() for name in ("step=2", "step=5")
    )
    (ckpts / "step=5" / "weights").rename(ckpts / "step=5" / ".weights.saving")
    (ckpts / "step=5-unfinished").touch()  # NeMo's marker: the save's finalize never ran
    tail = launch_fits(
        TINY,
        {"resume": [*job, "strategy.num_weight_shards=4"]},
        log_dirs={"resume": str(tmp_path / "resume")},
    )["resume"]
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6], full
    assert [r["step"] for r in tail] == [4, 5, 6], tail
    for got, want in zip(tail, full[3:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step=2", "step=5"]
    assert is_committed(ckpts / "step=5")  # NeMo removed the killed save; the rerun wrote it


def test_lora_recipe_from_a_pretrained_checkpoint_matches_its_baseline_and_restarts(
    tmp_path: Path,
) -> None:
    """Fine-tuning as a NeMo user runs it: a pretraining job saves a checkpoint; ``+peft.method=
    lora +restore=<it>`` (NeMo's LoRA on that checkpoint's weights, as ``llm.finetune`` with a
    ``RestoreConfig``) at TP1·GTP2·DP2 saving adapter checkpoints with ``+resume=latest``, and
    the same at DP4 without checkpoints in the same launch. The GTP run is stopped after 2 steps
    and rerun as the same job with 4 at GTP4 (it resumes from its adapter checkpoint, the base
    from the pretrained one): the 4 steps match DP4's to 1e-5 (design §1.1 "Frozen weights").
    NeMo's canonical LoRA (``+peft.method=canonical_lora``) from the same checkpoint matches DP4
    too."""
    from nemo_gtp.recipes.launch import launch_fits

    pretrained, adapters = tmp_path / "pretrain", tmp_path / "lora"
    pretrain = ["trainer.max_steps=3", f"+checkpoint.dir={pretrained}"]
    pre = launch_fits(TINY, {"pretrain": [*pretrain, "+checkpoint.every_n_train_steps=3"]})
    lora = ["+peft.method=lora", "+peft.dim=4", f"+restore={pretrained / 'step=2'}"]
    canonical = ["+peft.method=canonical_lora", "+peft.dim=4", f"+restore={pretrained / 'step=2'}"]
    job = [*lora, f"+checkpoint.dir={adapters}", "+checkpoint.every_n_train_steps=2"]
    gtp4 = "strategy.num_weight_shards=4"
    runs = launch_fits(
        TINY,
        {
            "first": [*job, "+resume=latest", "trainer.max_steps=2"],
            "again": [*job, "+resume=latest", "trainer.max_steps=4", gtp4],
            "base": [*lora, "trainer.max_steps=4", "strategy.num_weight_shards=1"],
            # NeMo's canonical LoRA (separate q / k / v adapters), GTP2 and DP4
            "canonical": [*canonical, "trainer.max_steps=3"],
            "canonical_base": [*canonical, "trainer.max_steps=3", "strategy.num_weight_shards=1"],
        },
    )
    assert [r["step"] for r in runs["first"]] == [1, 2]
    assert [r["step"] for r in runs["again"]] == [3, 4]
    assert (adapters / "step=1" / "weights" / "adapter_metadata.json").is_file()
    # NeMo's context/ names the LoRA, as llm.peft.merge_lora / export_lora read it (the merge
    # itself: tests/test_strategy_checkpoint.py)
    from nemo.collections import llm
    from nemo.lightning import io

    transform = io.load_context(adapters / "step=3" / "context", "model.model_transform")
    assert isinstance(transform, llm.peft.LoRA) and transform.dim == 4, transform
    for got, want in zip(runs["first"] + runs["again"], runs["base"], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)
    assert runs["base"][-1]["loss"] != runs["base"][0]["loss"]  # the adapters trained
    for got, want in zip(runs["canonical"], runs["canonical_base"], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)
    assert runs["canonical"][-1]["loss"] != runs["canonical"][0]["loss"]
    # same first batch: a LoRA (zero adapter output) on fresh weights would repeat this loss
    assert runs["first"][0]["loss"] < pre["pretrain"][0]["loss"], (runs["first"], pre)


def test_pipeline_dtype_defaults_to_the_training_dtype() -> None:
    """Under PP with no pipeline_dtype anywhere the activations between stages travel in the
    training dtype (megatron refuses PP without one); a recipe's value wins; none without PP."""
    import torch

    from nemo_gtp.recipes.config import load_recipe
    from nemo_gtp.recipes.loader import strategy_kwargs

    pp = ["+strategy.pipeline_model_parallel_size=2"]
    cases = [
        (pp, {}, torch.float32),
        (pp + ["precision=bf16-mixed"], {}, torch.bfloat16),
        (pp, {"params_dtype": torch.bfloat16}, torch.bfloat16),
        (pp + ["+strategy.pipeline_dtype=float16"], {}, torch.float16),
        ([], {}, None),
    ]
    for overrides, model_cfg, expected in cases:
        kwargs = strategy_kwargs(load_recipe("configs/tiny_cpu.yaml", overrides), model_cfg)
        assert kwargs.get("pipeline_dtype") == expected, (overrides, model_cfg, kwargs)


def test_leftover_nemo_getattr_proxies_are_dropped() -> None:
    """NeMo's teardown under virtual pipeline parallelism leaves its attribute proxy (a copy:
    a function with the proxy's code) on the model class; teardown_fit removes it, and the
    class falls back to ``nn.Module.__getattr__`` again."""
    import types

    import torch
    from nemo.lightning.megatron_parallel import getattr_proxy

    from nemo_gtp.recipes.launch import drop_leftover_getattr_proxies

    class Chunk(torch.nn.Module):
        pass

    Chunk.__getattr__ = types.FunctionType(getattr_proxy.__code__, getattr_proxy.__globals__)
    assert drop_leftover_getattr_proxies() >= 1
    assert "__getattr__" not in vars(Chunk)
    assert Chunk.__getattr__ is torch.nn.Module.__getattr__


def test_teardown_fit_lets_the_next_fit_choose_its_rng_tracker() -> None:
    """megatron makes its RNG tracker once per process; a fit after teardown_fit must get the
    tracker its own settings ask for (TE's capturable one for CUDA graphs), not the last fit's.
    (CPU torch has no capturable generators: the inference tracker stands for the request.)"""
    from megatron.core.tensor_parallel import random as megatron_random

    from nemo_gtp.recipes.launch import teardown_fit

    megatron_random.initialize_rng_tracker()  # a fit without graphs: the plain tracker
    assert not megatron_random.get_cuda_rng_tracker().is_inference_rng_tracker
    teardown_fit()
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True)  # the next fit's request
    try:
        assert megatron_random.get_cuda_rng_tracker().is_inference_rng_tracker
    finally:
        teardown_fit()


def test_rank_env_sets_the_launch_and_keeps_explicit_defaults() -> None:
    """One local rank's environment: the launch variables always, OMP / NCCL settings only as
    defaults (a value the user exported wins), MASTER_PORT only when asked for."""
    from nemo_gtp.recipes.launch import rank_env

    env = rank_env(1, 2, base={"PATH": "/bin", "RANK": "7"})
    assert env == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    mine = {"OMP_NUM_THREADS": "4", "NCCL_NVLS_ENABLE": "1"}
    env = rank_env(0, 2, nccl=True, master_port=29500, base=mine)
    assert env["OMP_NUM_THREADS"] == "4" and env["NCCL_NVLS_ENABLE"] == "1"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["MASTER_PORT"] == "29500"
    with pytest.raises(ValueError, match="rank must be in"):
        rank_env(2, 2)


def test_a_rank_that_dies_before_writing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that exits before its stderr file exists (e.g. the fork server re-running an
    unguarded script) is reported with its exit status and the likely cause, not as a missing
    file of the launcher's."""
    from nemo_gtp.recipes import launch

    def exits_at_once(spec: str, env: dict[str, str], stderr_path: str):  # noqa: ANN202
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]).wait

    monkeypatch.setattr(launch, "_fork_rank", exits_at_once)
    died = r"rank 0 exited with 3 before it wrote a line.*__main__"
    with pytest.raises(RuntimeError, match=died):
        launch.launch_fits(TINY, {"gtp": []})


@pytest.mark.parametrize(
    "env, first",
    [
        ({}, True),  # the command as typed: Lightning's launcher, local rank 0 of node 0
        ({"LOCAL_RANK": "2"}, False),  # a process Lightning's launcher re-ran
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),  # torchrun
        ({"RANK": "5", "LOCAL_RANK": "1"}, False),
    ],
)
def test_first_process_before_torch_distributed(
    env: dict[str, str], first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's one-per-job work before launch (the resume=latest line, clearing old
    TensorBoard logs) runs in global rank 0 alone, under torchrun and Lightning's launcher."""
    from nemo_gtp.run import is_first_process

    for key in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert is_first_process() is first


def test_quiet_console_sends_lightnings_notices_to_the_log_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a run prints by default: Lightning's (and NeMo's) informational records leave the
    console for the run's log files, warnings stay, known-harmless warnings go; ``--verbose``
    (its environment variable) changes nothing."""
    import logging

    import lightning.pytorch  # noqa: F401  (installs Lightning's console handler)

    from nemo_gtp.recipes.quiet import VERBOSE_ENV, quiet_console

    logger = logging.getLogger("lightning.pytorch")
    console = logging.StreamHandler(io.StringIO())
    logger.addHandler(console)
    child = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    try:
        monkeypatch.setenv(VERBOSE_ENV, "1")
        assert quiet_console(tmp_path) is None
        child.info("GPU available: False, used: False")
        assert "GPU available" in console.stream.getvalue()
        monkeypatch.delenv(VERBOSE_ENV)
        monkeypatch.setenv("RANK", "3")
        path = quiet_console(tmp_path)
        assert path == tmp_path / "lightning_log_globalrank-3.txt"
        console.stream = io.StringIO()
        child.info("TPU available: False, using: 0 TPU cores")
        child.warning('"update_logger_directory" is True. Overwriting tensorboard logger')
        child.warning("a warning worth reading")
        assert console.stream.getvalue() == "a warning worth reading\n"
        assert "TPU available" in path.read_text() and "worth reading" in path.read_text()
    finally:
        logger.removeHandler(console)
        for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "nemo_logger"):
            for handler in list(logging.getLogger(name).handlers):
                if type(handler).__name__ == "_RunLogFile":
                    logging.getLogger(name).removeHandler(handler)
                    handler.close()
                handler.filters = [f for f in handler.filters if "Console" not in type(f).__name__]


def test_the_first_lines_say_layout_model_size_and_logs() -> None:
    """What ``python -m nemo_gtp.run`` prints before the first step (no processes started)."""
    from nemo_gtp.run import check, describe_run

    layout, logs = describe_run(check(TINY, []), Path("runs/tiny_cpu"))
    assert layout == (
        "layout: TP1·GTP2·DP2 on 4 CPU processes (gloo); GPT of ~0.11 M parameters (2 layers, "
        "hidden 64, vocab 128); 30 steps of 16 x 32 tokens"
    )
    assert logs.startswith("logs: runs/tiny_cpu (TensorBoard;") and "--verbose" in logs
    moe = str(ROOT / "configs" / "moe_tiny_cpu.yaml")
    layout, _ = describe_run(check(moe, []), Path("runs/moe"))
    assert layout.startswith("layout: TP1·GTP2·DP2, experts EP2·EGTP2 on 4 CPU processes")
    assert "4 experts, top-2" in layout

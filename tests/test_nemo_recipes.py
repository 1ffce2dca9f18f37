"""NeMo 2's own recipes through GTP: ``with_gtp``, the ``--recipe`` CLI, NeMo-Run launches.

In-process checks first (cheap: NeMo's recipe factories only build configs): what
``with_gtp`` keeps, fixes and rejects for the Llama 3, Nemotron and Mixtral families, the batch
arithmetic, bad CLI input failing before anything is launched, the Slurm sbatch script. Then
two real launches of NeMo's Llama 3 8B recipe scaled down (2 layers, width 64, fp32, CPU/gloo)
on indexed data built here from installed packages' READMEs with a SentencePiece tokenizer
trained here (no network):

- one node through NeMo-Run's ``LocalExecutor`` (torchrun, 2 processes): TP1·GTP2, then the
  same recipe without GTP at DP2 in the same processes; losses (10 steps) and in-fit validation
  (every 5 steps) agree to 1e-5;
- two "nodes" x 1 process: the torchrun command of NeMo-Run's ``SlurmExecutor`` script, run
  as two agents here (``--nnodes 2 --node-rank i``); its losses equal the one-node run's.
(Each process imports NeMo afresh, as torchrun starts it: two per launch keep the suite short;
GTP beside DP > 1 runs in the main job's launch, ``tests/test_recipes.py``.)
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m nemo_gtp.run"

# NeMo's llama3_8b recipe, scaled down for CPU (with --cpu: fp32, gloo, local layer spec).
TINY_LLAMA = [
    "trainer.max_steps=10",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=5",
    "trainer.enable_progress_bar=False",
    # no checkpoints (Lightning's default ModelCheckpoint under llm.train): the test's time
    "trainer.enable_checkpointing=False",
    "trainer.strategy.context_parallel_size=1",
    "model.config.num_layers=2",
    "model.config.hidden_size=64",
    "model.config.ffn_hidden_size=128",
    "model.config.num_attention_heads=4",
    "model.config.num_query_groups=2",
    "model.config.seq_length=32",
    "data.seq_length=32",
    "data.micro_batch_size=2",
    "data.global_batch_size=8",
    "optim.lr_scheduler.warmup_steps=2",
    "log.ckpt=None",
    "log.tensorboard=None",
]


def _recipe(name: str = "llama3_8b", nodes: int = 1, gpus: int = 8) -> Any:
    from nemo.collections import llm

    factory = getattr(llm, name).pretrain_recipe
    return factory(name="t", dir="/tmp/nemo_gtp_t", num_nodes=nodes, num_gpus_per_node=gpus)


# ------------------------------------------------------------------------------- with_gtp
def test_with_gtp_keeps_settings_and_notes_each_fix(caplog: pytest.LogCaptureFixture) -> None:
    import fiddle as fdl

    from nemo_gtp.recipes import with_gtp
    from nemo_gtp.strategy import GTPMegatronStrategy

    recipe = _recipe()
    before = str(recipe)
    with caplog.at_level(logging.WARNING, logger="nemo_gtp.recipes.convert"):
        gtp = with_gtp(recipe, num_weight_shards=4, pad_for_alignment=32)
    assert str(recipe) == before  # a copy: the NeMo recipe is untouched
    strategy = gtp.trainer.strategy
    assert strategy.__fn_or_cls__ is GTPMegatronStrategy and strategy.num_weight_shards == 4
    old = recipe.trainer.strategy
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
                "ckpt_async_save", "ckpt_parallel_load", "gradient_as_bucket_view"):  # fmt: skip
        assert getattr(strategy, key) == getattr(old, key), key
    for key in ("grad_reduce_in_fp32", "overlap_grad_reduce", "check_for_nan_in_grad"):
        assert getattr(strategy.ddp, key) == getattr(old.ddp, key) is True, key
    assert (
        strategy.ddp.average_in_collective is False and strategy.ddp.overlap_param_gather is False
    )
    assert strategy.context_parallel_size == 2  # the recipe's CP2 kept: GTP4 x CP2 on 8 GPUs
    assert str(gtp.optim) == str(recipe.optim) and str(gtp.model) == str(recipe.model)
    notes = [r.getMessage() for r in caplog.records if r.name == "nemo_gtp.recipes.convert"]
    assert len(notes) == 2, notes
    for setting in ("average_in_collective=True -> False", "overlap_param_gather=True -> False"):
        assert any(setting in note for note in notes), (setting, notes)
    built = fdl.build(strategy)  # the strategy's own checks pass
    assert built.gtp_size == 4 and built.gtp_config.pad_for_alignment == 32
    again = with_gtp(gtp, num_weight_shards=2, prefetch_depth=2)  # a GTP recipe re-converted
    assert again.trainer.strategy.num_weight_shards == 2
    assert fdl.build(again.trainer.strategy.gtp_config).pad_for_alignment == 32  # kept
    assert again.trainer.strategy.gtp_config.prefetch_depth == 2


@pytest.mark.parametrize(
    "name, shards, gtp",
    [
        ("nemotron3_8b", 4, 2),
        ("nemotron4_15b", 8, 2),
        ("llama32_1b", 4, 4),
        ("mixtral_8x7b", 1, 1),
        ("mixtral_8x7b", 2, 2),
    ],
)
def test_recipe_families_convert(name: str, shards: int, gtp: int) -> None:
    """Nemotron 3/4 (TP2, TP4 + sequence parallel), Llama 3.2; Mixtral (MoE) with GTP off and
    with dense GTP (experts whole)."""
    import fiddle as fdl

    from nemo_gtp.recipes import with_gtp

    recipe = _recipe(name, nodes=4 if name.startswith("mixtral") else 1)  # Mixtral: EP8 x PP4
    converted = with_gtp(recipe, num_weight_shards=shards)
    strategy = fdl.build(converted.trainer.strategy)
    assert strategy.gtp_size == gtp and strategy.num_weight_shards == shards


def _mutate(path: str, value: Any) -> Any:
    def apply(recipe: Any) -> Any:
        *parents, last = path.split(".")
        target = recipe
        for part in parents:
            target = getattr(target, part)
        setattr(target, last, value)
        return recipe

    return apply


def _mutates(*changes: tuple[str, Any]) -> Any:
    def apply(recipe: Any) -> Any:
        for path, value in changes:
            recipe = _mutate(path, value)(recipe)
        return recipe

    return apply


BAD = [
    ("llama3_8b", 8, {}, _mutate("trainer.strategy.fsdp", "megatron"), "trainer.strategy.fsdp"),
    ("llama3_8b", 8, {}, _mutate("trainer.strategy.ddp", "pytorch"), "trainer.strategy.ddp="),
    (
        "llama3_8b",
        8,
        {},
        _mutate("trainer.strategy.ddp.use_megatron_fsdp", True),
        "use_megatron_fsdp",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutate("trainer.strategy.save_ckpt_format", "zarr"),
        "save_ckpt_format",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutate("model.config.cuda_graph_impl", "local"),
        "per-layer CUDA graphs (model.config.cuda_graph_impl='local', "
        "model.config.cuda_graph_scope='full') need a capturable RNG tracker: "
        "set trainer.strategy.use_te_rng_tracker=true",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutate("model.config.cuda_graph_impl", "transformer_engine"),
        "cuda_graph_impl='transformer_engine'",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutate("trainer.plugins.fp8_param_gather", True),
        "trainer.plugins.fp8_param_gather=True (FP8 primary weights) needs FP8",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutates(("trainer.plugins.fp8", "hybrid"), ("trainer.plugins.fp8_param_gather", True)),
        "trainer.plugins.fp8_param_gather=True (FP8 primary weights, megatron's "
        "fp8_param_gather) with trainer.plugins.fp8_recipe='delayed'",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutates(
            ("trainer.plugins.fp8", "hybrid"),
            ("trainer.plugins.fp8_recipe", "tensorwise"),
            ("trainer.plugins.fp8_param_gather", True),
            ("optim.config.use_distributed_optimizer", False),
        ),
        "needs megatron's distributed optimizer: set optim.config.use_distributed_optimizer",
    ),  # fmt: skip
    (
        "llama3_8b",
        8,
        {},
        _mutate("trainer.plugins.fp8", "e5m2"),
        "trainer.plugins.fp8 must be one of",
    ),  # fmt: skip
    ("llama3_8b", 8, {"prefetch_dept": 2}, None, "did you mean 'prefetch_depth'"),
    ("llama3_8b", 8, {"prefetch_depth": 0}, None, "prefetch_depth"),
    (
        "llama3_8b",
        8,
        {"shard_replicated_params_over_gtp": True},
        _mutate("trainer.strategy.ddp.use_distributed_optimizer", False),
        "use_distributed_optimizer",
    ),  # fmt: skip
    ("llama3_8b", 3, {}, None, "num_weight_shards"),
    ("llama3_8b", 16, {}, None, "trainer.devices x trainer.num_nodes = 8 x 1"),
    (
        "llama3_8b",
        2,
        {},
        _mutate("data.global_batch_size", 98),  # DP x GTP = 2 x 2 (the recipe's CP2 kept)
        "set data.global_batch_size=96",
    ),  # fmt: skip
]


@pytest.mark.parametrize("name, shards, options, change, message", BAD, ids=lambda x: str(x)[:30])
def test_with_gtp_rejects_with_the_setting_named(
    name: str, shards: int, options: dict, change: Any, message: str
) -> None:
    from nemo_gtp.recipes import with_gtp
    from nemo_gtp.recipes.config import RecipeError

    recipe = _recipe(name, nodes=4 if name.startswith("mixtral") else 1)
    if change is not None:
        recipe = change(recipe)
    with pytest.raises(RecipeError, match=re.escape(message)):
        with_gtp(recipe, num_weight_shards=shards, **options)


def test_with_gtp_keeps_fp8_primary_weights_under_tensorwise() -> None:
    """NeMo's ``fp8_param_gather`` with per-tensor current scaling: FP8 primary GTP shards
    (design §1.3 "FP8 primary weights"), kept as the recipe asks."""
    from nemo_gtp.recipes import with_gtp

    recipe = _recipe()
    for key, value in (("fp8", "hybrid"), ("fp8_recipe", "tensorwise"), ("fp8_param_gather", True)):
        setattr(recipe.trainer.plugins, key, value)
    out = with_gtp(recipe, num_weight_shards=4)  # GTP4 x the recipe's CP2
    assert out.trainer.plugins.fp8_param_gather and out.optim.config.use_distributed_optimizer


def test_with_gtp_keeps_per_layer_graphs_with_the_te_rng_tracker() -> None:
    from nemo_gtp.recipes import with_gtp

    recipe = _recipe()
    recipe.model.config.cuda_graph_impl = "local"
    recipe.model.config.cuda_graph_scope = "attn"
    recipe.trainer.strategy.use_te_rng_tracker = True
    out = with_gtp(recipe, num_weight_shards=4)
    assert out.model.config.cuda_graph_impl == "local" and out.trainer.strategy.use_te_rng_tracker


def test_batch_arithmetic_counts_gtp_peers_as_data_ranks() -> None:
    """8 GPUs at TP1·CP2·GTP4 (the recipe's CP2 kept): DP x GTP = 4 ranks eat distinct
    microbatches (the CP peers share theirs), so the global batch must divide by micro x 4 (not
    by micro x DP); GTP8 does not fit 8 GPUs beside CP2, and the error names both settings."""
    from nemo_gtp.recipes import with_gtp
    from nemo_gtp.recipes.config import RecipeError

    recipe = _recipe()
    recipe.data.global_batch_size = 4 * 3
    assert with_gtp(recipe, num_weight_shards=4).data.global_batch_size == 12
    recipe.data.global_batch_size = 2
    with pytest.raises(RecipeError, match=r"micro_batch_size x data-parallel ranks \(DP x GTP"):
        with_gtp(recipe, num_weight_shards=4)
    recipe.data.global_batch_size = 16
    with pytest.raises(RecipeError, match=r"8 x 2 x 1 = 16: change num_weight_shards, cont"):
        with_gtp(recipe, num_weight_shards=8)


# ------------------------------------------------------------------------------- CLI input
@pytest.fixture
def nemo_run_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """NeMo-Run's experiment directory for one test (nothing is written outside it)."""
    import nemo_run as run

    home = tmp_path / "nemo_run"
    old = run.config.get_nemorun_home()
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    yield home
    run.config.set_nemorun_home(old)


CLI_BAD = [
    (
        ["trainer.max_step=10"],
        "Trainer has no parameter 'max_step' (did you mean 'trainer.max_steps'?)",
    ),  # fmt: skip
    (["model.cfg.num_layers=2"], "the recipe has no model.cfg"),
    (["trainer.max_steps=ten"], "override 'trainer.max_steps=ten'"),
    (["model.config.recompute_granularity=full"], "model.config: Using recompute_granularity"),
    (["model.config.num_attention_heads=3"], "num_attention_heads=3 must be a multiple of"),
    (["--num-weight-shards", "3"], "num_weight_shards"),
    (["data.global_batch_size=6"], "data.global_batch_size=6"),
    (["--gtp", "prefetch_dept=2"], "did you mean 'prefetch_depth'"),
    (["--data", "/nonexistent/corpus", "--tokenizer", "byte"], "/nonexistent/corpus.bin"),
    (["--recipe", "llama3_8bb"], "did you mean 'llama3_8b'"),
    (["trainer.devices=2"], "trainer.devices=2 but --devices 4: give --devices 2"),
]


@pytest.mark.parametrize("extra, message", CLI_BAD, ids=lambda x: str(x)[:40])
def test_cli_rejects_bad_input_before_launching(
    extra: list[str], message: str, nemo_run_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nemo_gtp.run import main

    argv = ["--recipe", "llama3_8b", "--num-weight-shards", "2", "--devices", "4", "--cpu"]
    argv += ["--dir", str(nemo_run_home.parent / "exp"), *TINY_LLAMA]
    options = [a for a in extra if a.startswith("--")]
    if "--recipe" in options:
        argv[1] = extra[1]
        extra = []
    elif "--num-weight-shards" in options:
        argv[3] = extra[1]
        extra = []
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{PROG}: error: ") and message in err[-1], err[-3:]
    assert not nemo_run_home.exists()  # no NeMo-Run experiment: nothing was launched


# ------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A SentencePiece tokenizer and indexed data built from installed packages' READMEs,
    through ``python -m nemo_gtp.data``'s entry point."""
    from nemo_gtp.data.__main__ import main
    from tests.harness.corpus import write_package_corpus

    where = tmp_path_factory.mktemp("corpus")
    jsonl = where / "corpus.jsonl"
    assert write_package_corpus(jsonl, max_bytes=200_000) >= 10
    assert main(["tokenizer", "--input", str(jsonl), "--output", str(where / "tok"),
                 "--vocab-size", "512"]) == 0  # fmt: skip
    spec = f"sentencepiece:{where / 'tok.model'}"
    prefix = str(where / "corpus")
    assert main(["build", "--input", str(jsonl), "--output-prefix", prefix,
                 "--tokenizer", spec]) == 0  # fmt: skip
    return {"jsonl": str(jsonl), "tokenizer": spec, "prefix": prefix}


def test_indexed_data_holds_each_document_then_eod(corpus: dict[str, str]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from nemo_gtp.data import load_tokenizer

    tokenizer = load_tokenizer(corpus["tokenizer"])
    texts = [json.loads(line)["text"] for line in Path(corpus["jsonl"]).read_text().splitlines()]
    data = IndexedDataset(corpus["prefix"])
    assert len(data) == len(texts) and len(data.document_indices) == len(texts) + 1
    for i in (0, len(texts) - 1):
        assert data[i].tolist() == [*tokenizer.text_to_ids(texts[i]), tokenizer.eod]
    assert tokenizer.vocab_size == 512 and data[0].dtype.name == "uint16"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["build", "--input", "/nonexistent.jsonl", "--output-prefix", "x", "--tokenizer", "byte"],
         "--input '/nonexistent.jsonl' does not exist"),
        (["build", "--input", "c.jsonl", "--output-prefix", "x", "--tokenizer", "tiktoken:o200k"],
         "unknown kind 'tiktoken'"),
        (["build", "--input", "c.jsonl", "--output-prefix", "x", "--tokenizer", "sentencepiece:no"],
         "python -m nemo_gtp.data tokenizer trains one"),
        (["tokenizer", "--input", "c.jsonl", "--output", "t", "--vocab-size", "100"],
         "--vocab-size=100 is too small"),
    ],
)  # fmt: skip
def test_data_cli_rejects_bad_input(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nemo_gtp.data.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m nemo_gtp.data: error: ") and message in err[-1], err
    assert not list(tmp_path.iterdir())  # no partial x.bin left behind


# ------------------------------------------------------------------------------- launches
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cli(argv: list[str], home: Path) -> tuple[int, str]:
    """``nemo_gtp.run.main`` in this process (NeMo is imported once), NeMo-Run's experiments
    under ``home``; returns the exit status and stdout."""
    import nemo_run as run

    from nemo_gtp.run import main

    old = run.config.get_nemorun_home()
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEMORUN_HOME", str(home))
        mp.setenv("PYTHONPATH", str(ROOT))  # the launched workers import nemo_gtp
        mp.setenv("PATH", os.environ.get("PATH", ""))  # restored: the CLI may add torchrun's
        try:
            # NeMo-Run's local tunnel (invoke) forwards stdin, which pytest's capture refuses
            with open(os.devnull) as devnull, contextlib.redirect_stdout(out):
                mp.setattr(sys, "stdin", devnull)
                status = main(argv)
        finally:
            run.config.set_nemorun_home(old)
    return status, out.getvalue()


def _data_args(corpus: dict[str, str], where: Path) -> list[str]:
    """Indexed data instead of the recipe's mock data; ``data.split`` is a parameter of NeMo's
    ``PreTrainingDataModule`` (the override comes after ``--data`` replaced the data)."""
    data = ["--data", corpus["prefix"], "--tokenizer", corpus["tokenizer"], "data.split=90,5,5"]
    return [*data, "--dir", str(where)]


@pytest.fixture(scope="module")
def one_node(corpus: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """GTP then its baseline in one NeMo-Run LocalExecutor launch (torchrun, 2 processes)."""
    where = tmp_path_factory.mktemp("one_node")
    argv = ["--recipe", "llama3_8b", "--num-weight-shards", "2", "--devices", "2", "--cpu"]
    tiny = [o for o in TINY_LLAMA if o != "log.tensorboard=None"]  # the plot reads TensorBoard
    argv += [*_data_args(corpus, where / "exp"), *tiny, "--compare-baseline"]
    argv += ["--plot", str(where / "plot.png"), "--loss-log", str(where / "gtp.jsonl")]
    status, out = _cli(argv, where / "nemo_run")
    rows = re.findall(r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \| ([\d.e+-]+)$", out, flags=re.M)
    vals = re.findall(r"^validation at step (\d+): GTP ([\d.]+), baseline ([\d.]+)$", out, re.M)
    return {"status": status, "out": out, "rows": rows, "val": vals, "where": where}


def test_llama3_recipe_gtp_matches_dp2_baseline_on_indexed_data(one_node: dict) -> None:
    out = one_node["out"]
    assert one_node["status"] == 0, out[-6000:]
    # a quiet start: the layout and the logs first; Lightning's, NeMo's and torchrun's notices
    # in the log files (NeMo-Run's own experiment lines stay)
    first, second = out.lstrip().splitlines()[:2]
    assert first.startswith("layout: TP1·GTP2·DP1 on 2 CPU processes (gloo); GPT of ~"), first
    assert second.startswith(f"logs: {one_node['where'] / 'exp' / 'llama3_8b_gtp'} "), second
    for noise in ("GPU available:", "Starting elastic_operator", "pynvml package is deprecated"):
        assert noise not in out, noise
    rows = one_node["rows"]
    assert [int(r[0]) for r in rows] == list(range(1, 11)), out[-3000:]
    assert max(float(r[3]) for r in rows) <= 1e-5, out[-3000:]
    assert "GTP (TP1·GTP2)" in out and "baseline (TP1, no GTP)" in out
    assert [int(v[0]) for v in one_node["val"]] == [5, 10], out[-3000:]  # in-fit validation
    for _, gtp, base in one_node["val"]:
        assert abs(float(gtp) - float(base)) <= 1e-5 * abs(float(base))
    assert out.strip().splitlines()[-1].startswith("VERDICT: GTP matches the baseline")
    # each run its own TensorBoard series, both drawn into the plot the last line names
    plot = one_node["where"] / "plot.png"
    assert out.strip().endswith(f"plot: {plot}"), out[-2000:]
    assert plot.stat().st_size > 0
    boards = sorted(p.name for p in (one_node["where"] / "exp" / "tb_logs").iterdir())
    assert boards == ["llama3_8b_gtp", "llama3_8b_gtp_baseline"], boards


@pytest.fixture(scope="module")
def slurm_dryrun(corpus: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``--executor slurm --dryrun`` for 2 nodes x 1 process: the sbatch script, no submit."""
    where = tmp_path_factory.mktemp("two_nodes")
    home = where / "nemo_run"
    argv = ["--recipe", "llama3_8b", "--num-weight-shards", "2", "--nodes", "2", "--devices", "1"]
    argv += ["--cpu", *_data_args(corpus, where / "exp"), *TINY_LLAMA]
    argv += ["--executor", "slurm", "--slurm-account", "acct", "--slurm-partition", "cpu"]
    # the job directory is where NeMo-Run's dryrun writes the task, as on a shared filesystem
    argv += ["--job-dir", str(home / "experiments"), "--loss-log", str(where / "losses.jsonl")]
    argv += ["--dryrun"]
    status, out = _cli(argv, home)
    assert status == 0, out[-4000:]
    (script,) = list(home.glob("experiments/*/*/*_sbatch.sh"))
    return {"where": where, "script": script.read_text(), "out": out}


def test_slurm_executor_script(slurm_dryrun: dict) -> None:
    """NeMo-Run's sbatch for 2 nodes: one torchrun agent per node, 1 process each, the
    rendezvous on the head node, the serialized GTP task (run_recipes over the recipe)."""
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    from nemo_gtp.recipes.sequence import run_recipes

    script = slurm_dryrun["script"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --account=acct",
                 "#SBATCH --partition=cpu", "#SBATCH --gpus-per-node=1",
                 "export TORCH_NCCL_AVOID_RECORD_STREAMS=1"):  # fmt: skip
        assert line in script, line
    command = re.search(r"torchrun .*$", script, flags=re.M).group(0)
    for part in ("--rdzv-endpoint $head_node_ip:29500", "--nnodes 2", "--nproc-per-node 1",
                 "--node-rank $SLURM_NODEID", "-m nemo_run.core.runners.fdl_runner"):  # fmt: skip
        assert part in command, part
    task = ZlibJSONSerializer().deserialize(Path(command.split()[-1]).read_text())
    assert task.__fn_or_cls__ is run_recipes and task.cpu_compat is True
    (recipe,) = [ZlibJSONSerializer().deserialize(text) for text in task.recipes]
    strategy = recipe.trainer.strategy
    assert strategy.__fn_or_cls__.__name__ == "GTPMegatronStrategy"
    assert strategy.num_weight_shards == 2 and recipe.trainer.num_nodes == 2
    assert fdl.build(strategy).gtp_size == 2


def test_two_node_launch_matches_one_node(slurm_dryrun: dict, one_node: dict) -> None:
    """The Slurm script's per-node torchrun command run as two agents here (2 x 1 process,
    ``--nnodes 2 --node-rank i``): the same losses as the one-node launch."""
    from nemo_gtp.recipes.executors import DEFAULT_ENV
    from tests.harness.slurm_nodes import node_commands, run_nodes, sbatch_exports

    script, where = slurm_dryrun["script"], slurm_dryrun["where"]
    env = {**DEFAULT_ENV, **sbatch_exports(script), "PYTHONPATH": str(ROOT)}
    run_nodes(
        node_commands(script, nodes=2, port=_free_port()), env=env, cwd=str(where), timeout=400
    )
    two = _losses(where / "losses.jsonl", "loss")
    one = _losses(one_node["where"] / "gtp.jsonl", "loss")
    assert list(two) == list(range(1, 11)) and one == two  # same layout, same data order
    two_val = _losses(where / "losses.val.jsonl", "val_loss")
    assert list(two_val) == [5, 10]
    assert two_val == _losses(one_node["where"] / "gtp.val.jsonl", "val_loss")


def _losses(path: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, path.read_text().splitlines())}

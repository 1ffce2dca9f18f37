"""The bad-input matrix: every wrong setting fails early with a message naming the setting.

Four entry points, cheapest first: ``GTPConfig`` (a dataclass), recipes and overrides (checked
in the CLI's parent process, no torch), the CLI itself (``nemo_gtp.run.main`` in-process and one
subprocess: exit status 2, one ``error:`` line, no worker started) and the
``GTPMegatronStrategy`` constructor (``ValueError`` before any collective; ``test_strategy.py``
holds the cases it already had, this module adds the rest).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_gtp.engine import GTPConfig
from nemo_gtp.recipes.config import RecipeError, load_recipe
from nemo_gtp.recipes.validate import validate_recipe
from nemo_gtp.run import main, verdict

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")

# ------------------------------------------------------------------------------------ GTPConfig
BAD_GTP_CONFIGS = [
    (dict(gather_backend="nvshmem"), "gather_backend"),
    (dict(preshard_linears="full"), "preshard_linears"),
    (dict(copy_engine_min_tokens=-1), "copy_engine_min_tokens"),
    (dict(prefetch_depth=0), "prefetch_depth"),
    (dict(pad_for_alignment=0), "pad_for_alignment"),
]


@pytest.mark.parametrize("kwargs, name", BAD_GTP_CONFIGS, ids=lambda x: str(x))
def test_bad_gtp_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=f"GTPConfig.{name}"):
        GTPConfig(**kwargs)


# -------------------------------------------------------------------- recipes and overrides
# (overrides on configs/tiny_cpu.yaml: 4 ranks, TP1 x GTP2 x DP2, micro 4, global 16)
BAD_OVERRIDES = [
    (["+trainr.max_steps=3"], "unknown recipe section 'trainr' (did you mean 'trainer'?)"),
    (["+gtp.prefetch=2"], "gtp.prefetch is not a GTPConfig field"),
    (["+gtp.pad_for_alignment_rows=8"], "gtp.pad_for_alignment_rows"),
    (["gtp.pad_for_alignment=x"], "gtp.pad_for_alignment='x' must be an integer"),
    (["gtp.pad_for_alignment=0"], "gtp.pad_for_alignment must be >= 1"),
    (["+gtp.gather_backend=nvshmem"], "gtp.gather_backend"),
    (["+gtp.weight_prefetch=3"], "gtp.weight_prefetch=3 must be true or false"),
    (["+checkpoint.dir=c", "+checkpoint.every=3"], "checkpoint.every is not a checkpoint"),
    (["+checkpoint.dir=c"], "checkpoint.every_n_train_steps is missing"),
    (["+checkpoint.dir=c", "+checkpoint.every_n_train_steps=0"], "every_n_train_steps=0"),
    (
        ["+checkpoint.dir=c", "+checkpoint.every_n_train_steps=2", "+checkpoint.context=maybe"],
        "checkpoint.context='maybe' must be true or false",
    ),
    (["trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer"),
    (["trainer.devices=four"], "trainer.devices='four' must be an integer"),
    (["trainer.devices=0"], "trainer.devices=0 must be >= 1"),
    (["trainer.log_every_n_steps=0.5"], "trainer.log_every_n_steps=0.5"),
    (["strategy.num_weight_shards=two"], "strategy.num_weight_shards='two' must be an integer"),
    (["data.micro_batch_size=1.5"], "data.micro_batch_size=1.5 must be an integer"),
    (["optim.lr=fast"], "optim.lr='fast' must be a number"),
    (["ddp.overlap_grad_reduce=maybe"], "ddp.overlap_grad_reduce='maybe' must be true or false"),
    (["strategy.num_weight_shards=3"], "strategy.num_weight_shards=3 on trainer.devices"),
    (["trainer.devices=3"], "world_size=3 is not divisible"),
    (["strategy.tensor_model_parallel_size=2", "strategy.num_weight_shards=3"], "multiple of"),
    (["+strategy.context_parallel_size=2"], "context_parallel_size=2 with model.layer_spec=local"),
    # pipeline stages (design §1.4 "PP")
    (
        ["+strategy.pipeline_model_parallel_size=2"],
        "+model.share_embeddings_and_output_weights=false",
    ),
    (
        [
            "+strategy.pipeline_model_parallel_size=2",
            "+strategy.virtual_pipeline_model_parallel_size=2",
        ],
        "model.num_layers=2 does not split evenly over 2 pipeline stages x 2 virtual stages",
    ),
    (["+strategy.virtual_pipeline_model_parallel_size=2"], "needs pipeline stages"),
    (
        [
            "+strategy.pipeline_model_parallel_size=2",
            "+strategy.virtual_pipeline_model_parallel_size=2",
            "+model.share_embeddings_and_output_weights=false",
            "model.num_layers=4",
            "data.global_batch_size=8",
        ],
        "microbatches per step, data.global_batch_size=8 gives 1",
    ),
    (["+model.share_embeddings_and_output_weights=maybe"], "share_embeddings_and_output_weights"),
    (["data.global_batch_size=12"], "data.global_batch_size=12 must be a multiple of"),
    (
        ["data.global_batch_size=8"],
        "data.micro_batch_size x data-parallel ranks (DP x GTP = 2 x 2) = 4 x 4 = 16",
    ),
    (["+strategy.save_ckpt_format=zarr"], "strategy.save_ckpt_format='zarr'"),
    (["+strategy.save_ckpt_format=null"], "strategy.save_ckpt_format=None"),
    (["model.layer_spec=tex"], "model.layer_spec='tex' is not supported (did you mean 'te'?)"),
    (["+model.activation_func=swish"], "model.activation_func='swish'"),
    (["model.params_dtype=fp32"], "model.params_dtype='fp32'"),
    (["precision=16"], "precision='16' is not supported"),
    (["data.dataset=arithmetc"], "data.dataset='arithmetc'"),
    (["+resume=/nonexistent/step=9"], "resume='/nonexistent/step=9' does not exist"),
    (["+resume=latest"], "resume=latest continues from the newest checkpoint in checkpoint.dir"),
    (["+peft.dim=8"], "peft.method is missing: add +peft.method=lora"),
    (["+peft.method=dora"], "peft.method='dora' is not supported: NeMo's DoRA reads each"),
    (["+peft.method=canonical_lora", "+peft.target_modules=[linear_qkv]"], "use one of linear_q"),
    (
        ["+peft.method=canonical_lora", "+peft.target_modules=[linear_q,linear_fc1_gate]"],
        "linear_fc1_gate: the halves of a gated MLP's linear_fc1",
    ),
    (["+peft.method=lora", "+peft.rank=8"], "peft.rank is not a PEFT setting"),
    (["+peft.method=lora", "+peft.dim=eight"], "peft.dim"),
    (["+peft.method=lora", "+peft.target_modules=[linear_q]"], "peft.target_modules='linear_q'"),
    (["+restore=/nonexistent/step=9"], "restore='/nonexistent/step=9' does not exist"),
    (["trainer.max_step=7"], "(did you mean 'trainer.max_steps'?)"),  # a typo without +
    (["strategy.num_weight_shard=2"], "(did you mean 'strategy.num_weight_shards'?)"),
    (["tranier.max_steps=2"], "(did you mean 'trainer.max_steps'?)"),
    # +key adds a key: one no class under the section takes is refused before launch
    (["+trainer.max_stepz=3"], "trainer.max_stepz is not an argument of nl.Trainer (did you"),
    (["+strategy.num_weight_shard=2"], "(did you mean strategy.num_weight_shards?)"),
    (["+ddp.overlap_grad_reduc=true"], "(did you mean ddp.overlap_grad_reduce?)"),
    (["+optim.weight_decai=0.1"], "(did you mean optim.weight_decay?)"),
    (["+model.hiden_size=8"], "model.hiden_size is not an argument of llm.GPTConfig"),
    (["+data.seq_lenght=8"], "(did you mean data.seq_length?)"),
    (["+model.seq_length=8"], "model.seq_length comes from data.seq_length"),
    (["+strategy.ddp=pytorch"], "strategy.ddp comes from the ddp section"),
    (["trainer.zzz=2"], "no such key in"),  # nothing close: no guess
    (["trainer.max_steps"], "is not key=value"),
    (["=3"], "has no key"),
    (["trainer.max_steps=[1"], "override 'trainer.max_steps=[1'"),
    # Muon (design §1.6): whole matrices, so megatron's non-distributed optimizer
    (["optim.optimizer=muon"], "set optim.use_distributed_optimizer=false"),
    (["optim.optimizer=adamw"], "optim.optimizer='adamw' is not supported"),
    (["+muon.momentum=0.9"], "the muon section applies only with optim.optimizer=muon"),
    (
        ["optim.optimizer=muon", "optim.use_distributed_optimizer=false", "+muon.steps=3"],
        "muon.steps is not a Muon setting",
    ),
    (
        ["optim.optimizer=muon", "optim.use_distributed_optimizer=false", "+muon.ns_dtype=fp32"],
        "muon.ns_dtype='fp32' is not supported",
    ),
]


MOE_TINY = str(ROOT / "configs" / "moe_tiny_cpu.yaml")
BAD_MOE_OVERRIDES = [
    (["model.num_moe_experts=null"], "model.num_moe_experts is not set"),
    (["model.moe_grouped_gemm=true"], "set model.moe_grouped_gemm=false"),
    (
        [
            "model.layer_spec=te",
            "model.moe_grouped_gemm=true",
            "+model.moe_use_legacy_grouped_gemm=true",
        ],
        "model.moe_use_legacy_grouped_gemm=true builds megatron's legacy GroupedMLP",
    ),
    (["model.num_moe_experts=3"], "model.num_moe_experts=3 must be a multiple of"),
    (["strategy.expert_num_weight_shards=8"], "change expert_num_weight_shards"),
    (
        [
            "strategy.expert_num_weight_shards=null",
            "model.moe_grouped_gemm=true",
            "+checkpoint.dir=c",
            "+checkpoint.every_n_train_steps=5",
        ],
        "grouped-GEMM MoE experts under GTP",
    ),
]


FP8_1B = str(ROOT / "configs" / "gpt_1b_fp8.yaml")
BAD_FP8_OVERRIDES = [
    (["fp8.format=e5m2"], "fp8.format='e5m2' is not supported"),
    (["fp8.recipe=mxfp9"], "fp8.recipe='mxfp9' is not supported (did you mean 'mxfp8'?)"),
    (["+fp8.margin=1"], "fp8.margin is not an fp8 setting"),
    (["fp8.format=null"], "fp8.format is missing"),
    (
        ["fp8.param_gather=true", "fp8.recipe=delayed"],
        "fp8.param_gather=true (FP8 primary weights) with fp8.recipe=delayed is not supported "
        "with GTP",
    ),
    (
        ["fp8.param_gather=true", "optim.use_distributed_optimizer=false"],
        "set optim.use_distributed_optimizer=true",
    ),
    (
        ["fp8.param_gather=true", "ddp.grad_reduce_in_fp32=false"],
        "needs ddp.grad_reduce_in_fp32=true",
    ),
    (
        ["fp8.param_gather=true", "fp8.recipe=blockwise", "model.ffn_hidden_size=8320"],
        "linear_fc1 (8320 rows per tensor-parallel rank) gives GTP shards of 4160 rows at GTP 2 "
        "(gtp.pad_for_alignment=16), which split TE's 128x128 tiles: set "
        "gtp.pad_for_alignment=128",
    ),
    (["precision=32"], "fp8 needs precision: bf16-mixed"),
    (["model.layer_spec=local"], "set model.layer_spec=te"),
    (["cpu_compat=true"], "set cpu_compat=false"),
    (["fp8.param_gather=sure"], "fp8.param_gather='sure' must be true or false"),
]


@pytest.mark.parametrize("overrides, message", BAD_FP8_OVERRIDES, ids=lambda x: str(x))
def test_bad_fp8_recipe_override(overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(FP8_1B, overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    # FP8 primary weights: GTP's own under per-tensor current scaling (design §1.3), TE's
    # without GTP (the baseline of --compare-baseline)
    validate_recipe(load_recipe(FP8_1B, ["fp8.param_gather=true"]))
    validate_recipe(load_recipe(FP8_1B, ["fp8.param_gather=true", "strategy.num_weight_shards=1"]))
    # blockwise FP8 primary shards (whole 128-row tiles): this model's, or with the pad named
    blockwise = ["fp8.param_gather=true", "fp8.recipe=blockwise"]
    validate_recipe(load_recipe(FP8_1B, blockwise))
    wider = ["model.ffn_hidden_size=8320", "gtp.pad_for_alignment=128"]
    validate_recipe(load_recipe(FP8_1B, blockwise + wider))


def test_fp8_primary_resume_passes_the_checks(tmp_path: Path) -> None:
    """FP8 primary GTP shards resume through NeMo (design §3.3 "FP8 primary weights"): a
    recipe with ``fp8.param_gather=true`` and ``resume`` is accepted (it used to be refused)."""
    (tmp_path / "weights").mkdir()
    validate_recipe(load_recipe(FP8_1B, ["fp8.param_gather=true", f"+resume={tmp_path}"]))


@pytest.mark.parametrize("overrides, message", BAD_MOE_OVERRIDES, ids=lambda x: str(x))
def test_bad_moe_recipe_override(overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(MOE_TINY, overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_grouped_experts_with_te_spec_pass_the_checks() -> None:
    """TEGroupedMLP (grouped GEMM on the TE spec) is sharded by expert GTP (design §1.4) and
    checkpoints under it (§3.3 "Routed experts")."""
    grouped = ["model.layer_spec=te", "model.moe_grouped_gemm=true"]
    validate_recipe(load_recipe(MOE_TINY, grouped))
    checkpoint = ["+checkpoint.dir=c", "+checkpoint.every_n_train_steps=5"]
    validate_recipe(load_recipe(MOE_TINY, [*grouped, *checkpoint]))


@pytest.mark.parametrize("overrides, message", BAD_OVERRIDES, ids=lambda x: str(x))
def test_bad_recipe_override(overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(TINY, overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)  # one line


# A value out of range, one per class of setting: refused before launch by recipes.ranges
# (Lightning, megatron, torch or NeMo would refuse it only after the ranks started, or never).
BAD_RANGES = [
    (["trainer.max_steps=-5"], "trainer.max_steps=-5 must be an integer >= 1"),  # steps
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be an integer >= 1"),
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be a number > 0"),  # learning rates
    (["optim.lr=0.0"], "optim.lr=0.0 must be a number > 0"),
    (["+optim.min_lr=0.1"], "optim.min_lr=0.1 is above optim.lr=0.003"),
    (["data.micro_batch_size=0"], "data.micro_batch_size=0 must be >= 1"),  # batch sizes
    (["data.global_batch_size=-16"], "data.global_batch_size=-16 must be >= 1"),
    (["optim.clip_grad=-1.0"], "optim.clip_grad=-1.0 must be a number >= 0"),  # clip values
    (["+trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1 must be a number >= 0"),
    (["model.hidden_dropout=1.0"], "model.hidden_dropout=1.0 must be a number in [0, 1)"),
    (["model.attention_dropout=-0.1"], "model.attention_dropout=-0.1 must be a number in [0, 1)"),
    (["+peft.method=lora", "+peft.dropout=1.5"], "peft.dropout=1.5 must be a number in [0, 1)"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0 must be >= 1"),  # intervals
    (["+trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be an integer >= 1"),
    (
        ["+checkpoint.dir=c", "+checkpoint.every_n_train_steps=100"],
        "checkpoint.every_n_train_steps=100 is longer than trainer.max_steps=30",
    ),
    (["trainer.limit_val_batches=2.5"], "trainer.limit_val_batches=2.5 must be an integer >= 0"),
    (["trainer.num_sanity_val_steps=-2"], "trainer.num_sanity_val_steps=-2 must be an integer"),
    (["+trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be"),
    (["+optim.adam_beta2=1.0"], "optim.adam_beta2=1.0 must be a number in [0, 1)"),  # optimizer
    (["+optim.weight_decay=-0.01"], "optim.weight_decay=-0.01 must be a number >= 0"),
    (["+optim.adam_eps=0"], "optim.adam_eps=0 must be a number > 0"),
    (["optim.optimizer=sgd"], "optim.optimizer=sgd: megatron's distributed optimizer takes only"),
    (["+model.layernorm_epsilon=0"], "model.layernorm_epsilon=0 must be a number > 0"),  # model
    (["+model.normalization=rmsnorm"], "model.normalization='rmsnorm' must be one of LayerNorm"),
    (["+model.position_embedding_type=alibi"], "must be one of learned_absolute, rope"),
    (["+model.recompute_granularity=some"], "must be one of full, selective"),
    (["strategy.process_group_backend=mpi"], "must be one of nccl, gloo"),  # strategy
    (["+trainer.gradient_clip_algorithm=max"], "must be one of norm, value"),
    (["+data.seed=-1"], "data.seed=-1 must be an integer >= 0"),  # data
    (["+data.num_val_samples=-1"], "data.num_val_samples=-1 must be an integer >= 0"),
    (["model.hidden_size=66"], "model.hidden_size=66 must be a multiple of model.num_attention"),
    (["+model.num_query_groups=3"], "model.num_attention_heads=4 must be a multiple of model.num"),
    (["+model.rotary_base=-1"], "model.rotary_base=-1 must be a number > 0"),
    (
        ["optim.optimizer=muon", "optim.use_distributed_optimizer=false", "+muon.momentum=1.0"],
        "muon.momentum=1.0 must be a number in [0, 1)",
    ),  # fmt: skip
]


@pytest.mark.parametrize("overrides, message", BAD_RANGES, ids=lambda x: str(x))
def test_value_out_of_range_is_refused_naming_a_valid_value(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(TINY, overrides))
    assert message in str(err.value) and ": set e.g. " in str(err.value)
    assert "\n" not in str(err.value)


def test_range_rules_name_settings_their_classes_take() -> None:
    """Each rule's key is a keyword of the class its section feeds (read from source, as the
    key checks read them), so no rule guards a misspelt setting."""
    from nemo_gtp.recipes.ranges import RULES
    from nemo_gtp.recipes.schema import MUON_KEYS, PEFT_KEYS
    from nemo_gtp.recipes.signatures import SECTION_CLASSES, section_keywords

    known = {"peft": frozenset(PEFT_KEYS), "muon": frozenset(MUON_KEYS)}
    known |= {section: section_keywords(section) for section in SECTION_CLASSES}
    for key in RULES:
        section, _, name = key.partition(".")
        if section != "scheduler":  # NeMo recipes' optim.lr_scheduler (no YAML section)
            assert name in known[section], key


def test_nemo_recipe_overrides_meet_the_same_rules(capsys: pytest.CaptureFixture[str]) -> None:
    """The NeMo-recipe CLI's check_recipe runs the same rules, naming NeMo-Run's keys; every
    shipped recipe of a few families passes them unchanged. A misspelt override is one line:
    NeMo-Run's own log of it (the whole recipe) is dropped."""
    from nemo_gtp.recipes.nemo_cli import apply_overrides, load_nemo_recipe
    from nemo_gtp.recipes.quiet import quiet_known_warnings
    from nemo_gtp.recipes.ranges import check_nemo_recipe_settings

    quiet_known_warnings()  # as the CLI installs it

    def recipe(name: str = "llama3_8b") -> Any:
        return load_nemo_recipe(name, run_name="t", directory="/tmp", nodes=1, devices=8)

    for name in ("llama3_8b", "mixtral_8x7b", "qwen2_7b", "nemotron4_15b", "gemma3_1b"):
        check_nemo_recipe_settings(recipe(name))
    cases = {
        "trainer.max_steps=-5": "trainer.max_steps=-5 must be an integer >= 1",
        "optim.config.lr=-0.1": "optim.config.lr=-0.1 must be a number > 0",
        "optim.lr_scheduler.warmup_steps=-1": "optim.lr_scheduler.warmup_steps=-1 must be",
        "optim.lr_scheduler.min_lr=0.1": "optim.lr_scheduler.min_lr=0.1 is above optim.config.lr",
        "data.global_batch_size=0": "data.global_batch_size=0 must be an integer >= 1",
        "model.config.hidden_dropout=1.0": "model.config.hidden_dropout=1.0 must be a number in",
        "optim.config.clip_grad=-1": "optim.config.clip_grad=-1.0 must be a number >= 0",
    }
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=re.escape(message)):
            check_nemo_recipe_settings(apply_overrides(recipe(), [override]))
    capsys.readouterr()
    with pytest.raises(RecipeError, match="did you mean 'model.config.num_layers'"):
        apply_overrides(recipe(), ["model.config.num_layrs=2"])
    assert "Error processing argument" not in "".join(capsys.readouterr())


def test_resume_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "step=4" / "weights").mkdir(parents=True)
    (tmp_path / "step=4" / "weights" / "metadata.json").touch()
    with pytest.raises(RecipeError, match=r"is not a checkpoint.*\+resume=.*step=4"):
        validate_recipe(load_recipe(TINY, [f"+resume={tmp_path}"]))
    validate_recipe(load_recipe(TINY, [f"+resume={tmp_path / 'step=4'}"]))  # a checkpoint


def test_resume_latest_picks_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    """``resume=latest`` (a requeued job's restart-from-last): the committed ``step=N`` with the
    largest N, by number, not name; a save killed before its commit (staged weights only, or
    NeMo's unfinished marker still beside it) is passed over; none yet: start at step 0."""
    from nemo_gtp.recipes.resume import latest_checkpoint, resume_path

    save = ["+checkpoint.dir=" + str(tmp_path), "+checkpoint.every_n_train_steps=5"]
    cfg = load_recipe(TINY, [*save, "+resume=latest"])
    validate_recipe(cfg)
    assert latest_checkpoint(tmp_path / "none") is None and resume_path(cfg) is None

    def save(step: int, weights: str = "weights") -> None:
        (tmp_path / f"step={step}" / weights).mkdir(parents=True)
        (tmp_path / f"step={step}" / weights / "metadata.json").touch()  # megatron's, last

    save(4), save(9)
    save(14, ".weights.saving")  # killed while writing
    (tmp_path / "step=17" / "weights").mkdir(parents=True)  # no metadata.json: incomplete
    save(19)
    (tmp_path / "step=19-unfinished").touch()  # NeMo's marker: its finalize never ran
    (tmp_path / "step=99.txt").touch()
    assert resume_path(cfg) == str(tmp_path / "step=9")  # 9 < 14 < 19, and "step=9" > "step=19"
    (tmp_path / "step=19-unfinished").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step=19"
    save(24, ".weights.previous")  # a commit interrupted between its renames: the load's too
    assert latest_checkpoint(tmp_path) == tmp_path / "step=24"
    assert resume_path(load_recipe(TINY, [f"+resume={tmp_path / 'step=4'}"])).endswith("step=4")
    with pytest.raises(RecipeError, match=r"its newest is step=24: use \+resume=.*step=24"):
        validate_recipe(load_recipe(TINY, [f"+resume={tmp_path}"]))


def test_bad_recipe_files(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file 'missing.yaml' not found"):
        load_recipe("missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [unclosed\n")
    with pytest.raises(RecipeError, match="is not valid YAML"):
        load_recipe(str(broken))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a mapping of sections"):
        load_recipe(str(scalar))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_pass_the_checks(path: Path) -> None:
    validate_recipe(load_recipe(str(path)))
    validate_recipe(load_recipe(str(path), ["+model.activation_func=silu"]))


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here"
)
def test_te_recipe_without_te_is_refused_before_launch() -> None:
    """A TE recipe on a machine without TransformerEngine stops before any worker starts (NeMo
    would silently build megatron's local spec instead); the local spec still runs."""
    from nemo_gtp.recipes.validate import check_installed

    te = load_recipe(str(ROOT / "configs" / "gpt_1b_te.yaml"))
    validate_recipe(te)  # a valid recipe
    with pytest.raises(RecipeError, match=r"model\.layer_spec=te needs TransformerEngine"):
        check_installed(te)
    check_installed(
        load_recipe(str(ROOT / "configs" / "gpt_1b_te.yaml"), ["model.layer_spec=local"])
    )


def test_checkpoints_without_nvidia_resiliency_ext_are_refused_before_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``+checkpoint.dir`` needs nvidia-resiliency-ext (NeMo's logger setup imports it for every
    checkpoint callback, after launch); where it is missing the CLI stops first, naming it."""
    import importlib.util

    from nemo_gtp.run import check

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "nvidia_resiliency_ext" else real(name, *a),
    )
    checkpoint = ["+checkpoint.dir=c", "+checkpoint.every_n_train_steps=5"]
    with pytest.raises(RecipeError, match=r"checkpoint\.dir needs nvidia-resiliency-ext"):
        check(TINY, checkpoint)
    check(TINY, [])  # no checkpoints: nothing asked of it


def test_recipe_checks_need_no_torch() -> None:
    """The parent-process checks stay fast: no torch, no NeMo (a fresh interpreter)."""
    code = (
        "import sys; from nemo_gtp.run import check; "
        f"check({TINY!r}, ['strategy.num_weight_shards=4']); "
        "assert 'torch' not in sys.modules and 'nemo' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# ---------------------------------------------------------------------------------------- CLI
BAD_COMMAND_LINES = [
    (["missing.yaml"], "recipe file 'missing.yaml' not found"),
    ([TINY, "trainer.max_steps=abc"], "trainer.max_steps"),
    ([TINY, "+trainr.max_steps=3"], "trainr"),
    ([TINY, "strategy.num_weight_shards=3"], "strategy.num_weight_shards"),
    ([TINY, "data.global_batch_size=12", "--compare-baseline"], "data.global_batch_size"),
    ([TINY, "+resume=nowhere/step=3"], "resume="),
    ([TINY, "trainer.max_steps=-5"], "trainer.max_steps=-5 must be an integer >= 1"),
    ([TINY, "optim.lr=-0.1", "--compare-baseline"], "optim.lr=-0.1 must be a number > 0"),
    ([TINY, "+strategy.save_ckpt_format=zarr", "--compare-baseline"], "save_ckpt_format"),
    (  # both fits would save into (and resume=latest load from) the same directory
        [TINY, "+checkpoint.dir=c", "+checkpoint.every_n_train_steps=2", "--compare-baseline"],
        "--compare-baseline trains two runs from step 0: drop checkpoint",
    ),
]


@pytest.mark.parametrize("argv, message", BAD_COMMAND_LINES, ids=lambda x: str(x)[-40:])
def test_cli_fails_fast_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 10  # no worker launched: that takes far longer
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m nemo_gtp.run: error: "), err
    assert message in lines[0]


def test_cli_subprocess_exit_status_and_help() -> None:
    """As a user runs it: exit 2, one stderr line, no traceback; ``--help`` documents the CLI."""
    cmd = [sys.executable, "-m", "nemo_gtp.run"]
    bad = subprocess.run(
        [*cmd, TINY, "data.micro_batch_size=1.5"], capture_output=True, text=True, cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "python -m nemo_gtp.run: error: data.micro_batch_size=1.5 must be an integer: set e.g. "
        "data.micro_batch_size=2"
    ]
    usage = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert usage.returncode == 0
    for text in (
        "usage: python -m nemo_gtp.run",
        "--compare-baseline",
        "--loss-log",
        "+checkpoint.dir=DIR +checkpoint.every_n_train_steps=N",
        "+resume=",
        "key=value",
        "examples:",
    ):
        assert text in usage.stdout


def test_verdict_line() -> None:
    gtp = [{"step": s, "loss": 4.0 - 0.1 * s, "ms": 10.4} for s in range(1, 11)]
    base = [{"step": s, "loss": 4.0 - 0.1 * s, "ms": 10.0} for s in range(1, 11)]
    ok, line = verdict(gtp, base, "32")
    assert ok and line.startswith("VERDICT: GTP matches the baseline (max rel loss diff 0.0e+00")
    assert line.endswith("step time GTP/baseline 1.04")
    off = [{**r, "loss": r["loss"] * (1 + 1e-3)} for r in gtp]
    ok, line = verdict(off, base, "32")
    assert not ok and "did not match" in line
    ok, _ = verdict(off, base, "bf16-mixed")  # within bf16's tolerance
    assert ok
    ok, line = verdict(gtp[:5], base, "32")
    assert not ok and "steps logged: GTP 5, baseline 10" in line


# --------------------------------------------------------------------- strategy constructor
@pytest.fixture(scope="module")
def strategy_class() -> Any:
    from nemo_gtp import GTPMegatronStrategy

    return GTPMegatronStrategy


# Cases tests/test_strategy.py::INVALID does not already hold.
BAD_STRATEGY_ARGS = [
    (dict(num_weight_shards=2, save_ckpt_format="zarr"), "save_ckpt_format='zarr'"),
    (dict(num_weight_shards=2, save_ckpt_format=None), "save_ckpt_format=None"),
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size"),
    (dict(num_weight_shards=True), "num_weight_shards"),
    (dict(num_weight_shards=2, pipeline_model_parallel_size=0), "pipeline_model_parallel_size"),
    (dict(num_weight_shards=4, tensor_model_parallel_size=3), "num_weight_shards=4"),
    (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size"),
]


@pytest.mark.parametrize("kwargs, match", BAD_STRATEGY_ARGS, ids=lambda x: str(x))
def test_bad_strategy_arguments(strategy_class: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError) as err:
        strategy_class(**kwargs)
    assert match in str(err.value)


def test_section_keywords_read_from_source_equal_the_imported_classes() -> None:
    """The CLI reads what each section's class takes from the installed source (no import);
    the imported classes (their ``__init__`` along the MRO, or their dataclass fields) agree."""
    import dataclasses
    import importlib
    import inspect

    from nemo_gtp.recipes.signatures import (
        LOADER_ADDS,
        LOADER_PASSES,
        SECTION_CLASSES,
        section_keywords,
    )

    for section, (module, name, _) in SECTION_CLASSES.items():
        cls = getattr(importlib.import_module(module), name)
        if dataclasses.is_dataclass(cls):
            keys = {f.name for f in dataclasses.fields(cls)}
        else:
            keys = set()
            for base in cls.__mro__[:-1]:  # not object
                if "__init__" in vars(base):
                    keys |= set(inspect.signature(base.__init__).parameters)
            keys -= {"self", "args", "kwargs"}
        keys = (keys | LOADER_ADDS.get(section, set())) - set(LOADER_PASSES.get(section, {}))
        assert section_keywords(section) == keys, section
    from nemo import lightning as nl

    assert "__init__" not in vars(nl.Trainer)  # NeMo's Trainer takes Lightning's arguments


IGNORED_KEYWORDS = [
    (dict(num_weight_shard=2), "'num_weight_shard' (did you mean 'num_weight_shards'?)"),
    (dict(tensor_model_parralel_size=2), "(did you mean 'tensor_model_parallel_size'?)"),
    (dict(num_weight_shards=2, stattic_graph=True), "'stattic_graph' (did you mean 'static_graph'"),
    (dict(num_weight_shards=2, zzz=1), "'zzz': neither MegatronStrategy"),
]


@pytest.mark.parametrize("kwargs, match", IGNORED_KEYWORDS, ids=lambda x: str(x))
def test_keywords_no_layer_takes_are_refused(
    strategy_class: Any, kwargs: dict[str, Any], match: str
) -> None:
    """MegatronStrategy passes unknown keywords on to torch's DDP, which megatron DDP never
    builds: a typo of a GTP argument would otherwise train without GTP and say nothing."""
    with pytest.raises(TypeError) as err:
        strategy_class(**kwargs)
    assert match in str(err.value)


def test_keywords_for_lightning_or_torch_ddp_still_pass(strategy_class: Any) -> None:
    strategy = strategy_class(num_weight_shards=2, process_group_backend="gloo")  # Lightning's
    assert strategy._process_group_backend == "gloo"
    strategy_class(ddp="pytorch", static_graph=True)  # torch DDP's
    # as NeMo's recipes pass them (a torch DDP keyword; one MegatronStrategy drops)
    strategy_class(num_weight_shards=2, gradient_as_bucket_view=True, ckpt_include_optimizer=True)


def test_zarr_accepted_with_gtp_off(strategy_class: Any) -> None:
    """GTP off is plain MegatronStrategy: its formats are its own business."""
    assert strategy_class(save_ckpt_format="zarr").save_ckpt_format == "zarr"

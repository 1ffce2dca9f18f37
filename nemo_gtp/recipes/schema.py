"""What a YAML recipe may hold: its sections, keys, key types and names, and the small checks
over them that :mod:`nemo_gtp.recipes.validate` and :mod:`nemo_gtp.recipes.validate_layout` share.

Nothing here imports torch or NeMo (the ``gtp`` keys are read from
:class:`~nemo_gtp.engine.config.GTPConfig`, whose module is torch-free), so the CLI refuses a bad
recipe in a second, before any worker starts.

Example::

    check_type("trainer.devices", "four", TYPED["trainer.devices"])
    # RecipeError: trainer.devices='four' must be an integer: set e.g. trainer.devices=2
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from typing import Any

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import layout_dims
from nemo_gtp.recipes.config import RecipeError

SECTIONS = (
    "cpu_compat",
    "precision",
    "trainer",
    "strategy",
    "ddp",
    "gtp",
    "model",
    "data",
    "optim",
    "checkpoint",
    "resume",
    "restore",
    "fp8",
    "muon",
    "peft",
    "faults",
    "callbacks",
)
SCALAR_SECTIONS = ("cpu_compat", "precision", "resume", "restore")
MAPPING_SECTIONS = tuple(s for s in SECTIONS if s not in SCALAR_SECTIONS)
# The muon section (optim.optimizer=muon): MuonConfig's fields (design §1.6 "Muon").
MUON_KEYS = (
    "momentum",
    "nesterov",
    "ns_steps",
    "eps",
    "adjust_lr_fn",
    "ns_dtype",
    "gather_bucket_mb",
    "orthogonalize",
    "lr_mult",
)
MUON_ORTHOGONALIZE = ("owner", "every_rank")
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")
MUON_NS_DTYPES = ("bfloat16", "float32")
OPTIMIZERS = ("adam", "sgd", "muon")
CHECKPOINT_KEYS = ("dir", "every_n_train_steps", "context", "on_save_error", "verify")
# on_save_error: a save that fails (disk full) stops the run, or warns and trains on; verify:
# what a load checks against the commit's manifest (nemo_gtp.checkpoint.manifest)
CHECKPOINT_ON_SAVE_ERROR = ("stop", "warn")
CHECKPOINT_VERIFY = ("checksums", "sizes")
# The faults section (nemo_gtp.strategy.faults): every process group's timeout, and whether a
# SIGTERM saves at the next step boundary (on by default where the recipe saves checkpoints).
FAULTS_KEYS = ("collective_timeout_s", "preemption")
COLLECTIVE_TIMEOUT_S = 300.0  # well under NCCL's 10 and gloo's 30 minutes
# context: NeMo's context/ beside each save (what llm.export_ckpt and llm.peft.merge_lora read)
CHECKPOINT_REQUIRED = ("dir", "every_n_train_steps")
# The peft section: NeMo's llm.peft.LoRA / CanonicalLoRA(dim=, alpha=, dropout=,
# target_modules=), set up as llm.finetune does (design §1.1 "Frozen weights": the frozen base
# linears are the GTP shards). LoRA adapts each fused linear; canonical LoRA gives q, k, v (and
# a gated MLP's up and gate halves) adapters of their own, as Hugging Face models have them.
PEFT_KEYS = ("method", "dim", "alpha", "dropout", "target_modules")
PEFT_TARGETS = {
    "lora": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
    "canonical_lora": (
        "linear_q",
        "linear_k",
        "linear_v",
        "linear_proj",
        "linear_fc1_up",
        "linear_fc1_gate",
        "linear_fc2",
    ),
}
PEFT_METHODS = tuple(PEFT_TARGETS)
GATED_MLP_TARGETS = ("linear_fc1_up", "linear_fc1_gate")  # halves of a gated MLP's linear_fc1
PEFT_REFUSED = {
    "dora": "NeMo's DoRA reads each wrapped linear's whole weight in every forward, which under "
    "GTP is a shard: use peft.method=lora or canonical_lora",
}
# The fp8 section: NeMo's MegatronMixedPrecision(fp8=format, fp8_recipe=recipe,
# fp8_param_gather=param_gather), megatron's names (design §1.3 "FP8 gather", "FP8 primary
# weights").
FP8_KEYS = ("format", "recipe", "param_gather")
LAYER_SPECS = ("te", "local")
PRECISIONS = ("32", "bf16-mixed")
DATASETS = ("arithmetic", "random")
DTYPES = ("float32", "bfloat16", "float16")
# model.activation_func names -> dotted path of the callable (loader.resolve_activation).
ACTIVATIONS = {
    "silu": "torch.nn.functional.silu",
    "gelu": "torch.nn.functional.gelu",
    "relu": "torch.nn.functional.relu",
    "squared_relu": "megatron.core.activations.squared_relu",
}

_INT, _FLOAT, _BOOL, _STR = "an integer", "a number", "true or false", "a string"
# Keys with a known type; "+" in the kind: must also be >= 1.
TYPED: dict[str, str] = {
    "cpu_compat": _BOOL,
    "faults.collective_timeout_s": _FLOAT,
    "faults.preemption": _BOOL,
    "trainer.max_steps": _INT,
    "trainer.devices": _INT + "+",
    "trainer.num_nodes": _INT + "+",
    "trainer.log_every_n_steps": _INT + "+",
    "trainer.num_sanity_val_steps": _INT,
    "trainer.enable_checkpointing": _BOOL,
    "trainer.enable_progress_bar": _BOOL,
    "trainer.use_distributed_sampler": _BOOL,
    "strategy.tensor_model_parallel_size": _INT + "+",
    "strategy.num_weight_shards": _INT + "+",
    "strategy.context_parallel_size": _INT + "+",
    "strategy.pipeline_model_parallel_size": _INT + "+",
    "strategy.virtual_pipeline_model_parallel_size": _INT + "+",
    "strategy.expert_model_parallel_size": _INT + "+",
    "strategy.expert_tensor_parallel_size": _INT + "+",
    "strategy.expert_num_weight_shards": _INT + "+",
    "strategy.num_distributed_optimizer_instances": _INT + "+",
    "strategy.ckpt_async_save": _BOOL,
    "strategy.save_ckpt_format": _STR,
    "strategy.process_group_backend": _STR,
    "ddp.use_distributed_optimizer": _BOOL,
    "ddp.overlap_grad_reduce": _BOOL,
    "ddp.overlap_param_gather": _BOOL,
    "ddp.grad_reduce_in_fp32": _BOOL,
    "ddp.average_in_collective": _BOOL,
    "peft.dim": _INT + "+",
    "peft.alpha": _INT + "+",
    "peft.dropout": _FLOAT,
    "model.num_layers": _INT + "+",
    "model.hidden_size": _INT + "+",
    "model.ffn_hidden_size": _INT + "+",
    "model.num_attention_heads": _INT + "+",
    "model.num_query_groups": _INT + "+",
    "model.hidden_dropout": _FLOAT,
    "model.attention_dropout": _FLOAT,
    "model.gated_linear_unit": _BOOL,
    "model.share_embeddings_and_output_weights": _BOOL,
    "model.add_bias_linear": _BOOL,
    "model.bf16": _BOOL,
    "model.num_moe_experts": _INT + "+",
    "model.moe_router_topk": _INT + "+",
    "model.moe_ffn_hidden_size": _INT + "+",
    "model.moe_grouped_gemm": _BOOL,
    "model.moe_use_legacy_grouped_gemm": _BOOL,
    "model.moe_token_dispatcher_type": _STR,
    "model.moe_aux_loss_coeff": _FLOAT,
    "data.vocab_size": _INT + "+",
    "data.seq_length": _INT + "+",
    "data.micro_batch_size": _INT + "+",
    "data.global_batch_size": _INT + "+",
    "data.num_train_samples": _INT + "+",
    "optim.lr": _FLOAT,
    "optim.min_lr": _FLOAT,
    "optim.weight_decay": _FLOAT,
    "optim.clip_grad": _FLOAT,
    "optim.bf16": _BOOL,
    "optim.use_distributed_optimizer": _BOOL,
    "optim.optimizer": _STR,
    "muon.momentum": _FLOAT,
    "muon.nesterov": _BOOL,
    "muon.ns_steps": _INT + "+",
    "muon.eps": _FLOAT,
    "muon.adjust_lr_fn": _STR,
    "muon.ns_dtype": _STR,
    "muon.gather_bucket_mb": _FLOAT,
    "muon.orthogonalize": _STR,
    "muon.lr_mult": _FLOAT,
    "checkpoint.dir": _STR,
    "checkpoint.every_n_train_steps": _INT + "+",
    "checkpoint.context": _BOOL,
    "checkpoint.on_save_error": _STR,
    "checkpoint.verify": _STR,
    "fp8.format": _STR,
    "fp8.recipe": _STR,
    "fp8.param_gather": _BOOL,
}
_GTP_KINDS = {"int": _INT, "bool": _BOOL, "str": _STR, "float": _FLOAT}
_EXAMPLES = {_INT: "2", _FLOAT: "0.001", _BOOL: "true", _STR: "name"}


def gtp_config_fields() -> dict[str, str]:
    """``GTPConfig`` field name -> expected kind (``"an integer"``, ...)."""
    return {f.name: _GTP_KINDS.get(str(f.type), _STR) for f in dataclasses.fields(GTPConfig)}


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean ...?)`` for the closest of ``choices`` to ``word``, else empty."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _has_kind(value: Any, kind: str) -> bool:
    if kind.startswith(_INT):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == _BOOL:
        return isinstance(value, bool)
    return isinstance(value, str)


def check_type(key: str, value: Any, kind: str) -> None:
    """``key=value`` has the ``kind`` of :data:`TYPED` (a ``+`` kind: also >= 1), else
    :class:`RecipeError` with an example value."""
    if value is None:
        return  # None means the library default wherever a recipe may leave a key unset
    base = kind.rstrip("+")
    if not _has_kind(value, kind):
        raise RecipeError(
            f"{key}={value!r} must be {base}: set e.g. {key}={_EXAMPLES.get(base, '...')}"
        )
    if kind.endswith("+") and value < 1:
        raise RecipeError(f"{key}={value!r} must be >= 1: set e.g. {key}=1")


def importable(module: str) -> bool:
    """Whether ``module`` is installed, without importing it (the checks stay torch-free)."""
    return importlib.util.find_spec(module) is not None


def check_keys(name: str, section: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    """Every key of the ``name`` section is one of ``keys`` (``what`` names such a key)."""
    for key in section:
        if key not in keys:
            raise RecipeError(
                f"{name}.{key} is not {what}{did_you_mean(key, keys)}: known are {', '.join(keys)}"
            )


def one_of(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    """``value`` (of ``key``) is one of ``choices`` (``None``: unset, fine)."""
    if value is not None and value not in choices:
        raise RecipeError(
            f"{key}={value!r} is not supported{did_you_mean(str(value), choices)}: "
            f"use one of {', '.join(choices)}"
        )


def is_cpu_recipe(cfg: Any) -> bool:
    """Whether a recipe (its ``DictConfig`` or plain dict) runs on CPU processes: ``cpu_compat``
    or ``trainer.accelerator: cpu``.

    Example::

        is_cpu_recipe(load_recipe("configs/tiny_cpu.yaml"))   # True
    """
    trainer = cfg.get("trainer") or {}
    return bool(cfg.get("cpu_compat", False)) or trainer.get("accelerator") == "cpu"


def ddp_average_in_collective(cfg: Any) -> bool:
    """The recipe's ``ddp.average_in_collective``; unset (``null``): off under GTP (the mean is
    a pre-scale before a SUM collective, design §3.2) and on CPU (gloo has no AVG), on for a
    GPU run without GTP, as NeMo's recipes run DDP (no 1/DP pre-scale pass over the grad
    buffers), so a baseline is the DDP NeMo users run. A value the recipe sets is kept (on
    under GTP is refused by the strategy, naming the setting).

    Example::

        ddp_average_in_collective(load_recipe("configs/gpt_1b_te.yaml"))  # False: GTP2
    """
    value = (cfg.get("ddp") or {}).get("average_in_collective")
    if value is not None:
        return bool(value)
    gtp_on = layout_dims(cfg.get("strategy") or {}).gtp_enabled  # dense or expert GTP
    return not gtp_on and not is_cpu_recipe(cfg)


def default_layer_spec_name() -> str:
    """The layer spec a recipe without ``model.layer_spec`` gets, as NeMo picks it: ``"te"``
    when TransformerEngine is installed, else ``"local"`` (no import: a spec lookup).

    Example::

        default_layer_spec_name()   # "local" on a CPU machine
    """
    return "te" if importable("transformer_engine") else "local"

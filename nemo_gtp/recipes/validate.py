"""Recipe checks the CLI runs in the parent process, before any worker is launched.

Each check raises :class:`RecipeError` (a ``ValueError``) with one line that names the recipe
key and the fix, so a typo costs a second instead of a multi-process NeMo start-up. Nothing here
imports torch or NeMo: the sizes are :class:`~nemo_gtp.engine.grid.GTPParallelDims`'s and the
``gtp`` keys :class:`~nemo_gtp.engine.config.GTPConfig`'s, both loaded from their (pure-Python)
modules without the ``nemo_gtp.engine`` package, whose ``__init__`` pulls torch.

Example::

    cfg = load_recipe("configs/tiny_cpu.yaml", ["strategy.num_weight_shards=3"])
    validate_recipe(cfg)  # RecipeError: ... change strategy.num_weight_shards or trainer.devices
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.resume import LATEST, latest_checkpoint
from nemo_gtp.recipes.signatures import LOADER_PASSES, SECTION_CLASSES, section_keywords

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
CHECKPOINT_KEYS = ("dir", "every_n_train_steps", "context")
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
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
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
    "fp8.format": _STR,
    "fp8.recipe": _STR,
    "fp8.param_gather": _BOOL,
}
_GTP_KINDS = {"int": _INT, "bool": _BOOL, "str": _STR, "float": _FLOAT}
_EXAMPLES = {_INT: "2", _FLOAT: "0.001", _BOOL: "true", _STR: "name"}


def _engine_module(name: str) -> ModuleType:
    """``nemo_gtp.engine.<name>`` (pure Python), without importing the torch-heavy package."""
    loaded = sys.modules.get(f"nemo_gtp.engine.{name}")
    if loaded is not None:
        return loaded
    alias = f"_nemo_gtp_recipe_check_{name}"
    if alias in sys.modules:
        return sys.modules[alias]
    path = Path(__file__).resolve().parents[1] / "engine" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(alias, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def gtp_config_fields() -> dict[str, str]:
    """``GTPConfig`` field name -> expected kind (``"an integer"``, ...)."""
    config = _engine_module("config").GTPConfig
    return {f.name: _GTP_KINDS.get(str(f.type), _STR) for f in dataclasses.fields(config)}


def _did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
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


def _check_type(key: str, value: Any, kind: str) -> None:
    if value is None:
        return  # None means the library default wherever a recipe may leave a key unset
    base = kind.rstrip("+")
    if not _has_kind(value, kind):
        raise RecipeError(
            f"{key}={value!r} must be {base}: set e.g. {key}={_EXAMPLES.get(base, '...')}"
        )
    if kind.endswith("+") and value < 1:
        raise RecipeError(f"{key}={value!r} must be >= 1: set e.g. {key}=1")


def _plain(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception as err:  # an unresolvable ${...} interpolation
        raise RecipeError(f"recipe: {err}".splitlines()[0]) from None


def validate_recipe(cfg: DictConfig) -> None:
    """Reject what would fail only after the workers started (or would silently do nothing).

    Checks: top-level sections; ``gtp``, ``checkpoint`` and ``fp8`` keys; the types of known keys;
    ``precision``, ``data.dataset``, ``model.layer_spec``, ``model.activation_func`` and dtype
    names; the parallel sizes against the world size (``trainer.devices x trainer.num_nodes``);
    the global batch against micro x (DP x GTP); ``strategy.save_ckpt_format``; ``resume``.
    """
    raw = _plain(cfg)
    for section in raw:
        if section not in SECTIONS:
            raise RecipeError(
                f"unknown recipe section {section!r}{_did_you_mean(section, SECTIONS)}: "
                f"known sections are {', '.join(SECTIONS)}"
            )
    for section in MAPPING_SECTIONS:
        if section in raw and not isinstance(raw[section], dict | type(None)):
            raise RecipeError(f"{section} must be a mapping of keys, got {raw[section]!r}")
    _check_section_keys(raw)
    for key, kind in TYPED.items():
        value = OmegaConf.select(cfg, key, default=None)
        _check_type(key, value, kind)
    _check_gtp_section(raw.get("gtp") or {})
    _check_checkpoint_section(raw.get("checkpoint"))
    _check_muon(raw)
    _check_peft(raw)
    _check_names(raw)
    _check_sizes(raw)
    if raw.get("resume") is not None:
        check_resume(raw["resume"], raw.get("checkpoint"))
    if raw.get("restore") is not None:
        check_resume_path(raw["restore"], key="restore")


TE_MISSING = (
    "model.layer_spec=te needs TransformerEngine, which is not installed here (NeMo would fall "
    "back to megatron's local spec without a word): install it, or set model.layer_spec=local"
)


RESILIENCY_MISSING = (
    "checkpoint.dir needs nvidia-resiliency-ext, which is not installed here (NeMo's logger "
    "setup imports it for every checkpoint callback and fails after launch): pip install "
    "nvidia-resiliency-ext, or drop checkpoint.dir"
)


def check_installed(cfg: DictConfig) -> None:
    """What a recipe asks of this machine's packages, before any worker starts (a recipe that
    is valid can still need what is not installed here: ``validate_recipe`` checks the recipe).

    ``model.layer_spec=te`` needs TransformerEngine: without it NeMo's default spec silently is
    megatron's local one, and a run labelled TE would measure the local spec. ``checkpoint.dir``
    needs ``nvidia-resiliency-ext`` (NeMo's logger setup imports it once a checkpoint callback
    exists; a dependency of this package, but not of NeMo's).

    Example::

        check_installed(load_recipe("configs/gpt_1b_te.yaml"))  # RecipeError on a CPU machine
    """
    spec = OmegaConf.select(cfg, "model.layer_spec", default=None)
    if spec == "te" and default_layer_spec_name() != "te":
        raise RecipeError(TE_MISSING)
    if OmegaConf.select(cfg, "checkpoint.dir", default=None) is not None and not _importable(
        "nvidia_resiliency_ext"
    ):
        raise RecipeError(RESILIENCY_MISSING)


def _importable(module: str) -> bool:
    """Whether ``module`` is installed, without importing it (the checks stay torch-free)."""
    return importlib.util.find_spec(module) is not None


def _check_gtp_section(gtp: dict[str, Any]) -> None:
    fields = gtp_config_fields()
    for key, value in gtp.items():
        if key not in fields:
            raise RecipeError(
                f"gtp.{key} is not a GTPConfig field{_did_you_mean(key, list(fields))}: "
                f"known are {', '.join(fields)}"
            )
        _check_type(f"gtp.{key}", value, fields[key])
    try:
        _engine_module("config").GTPConfig(**gtp)
    except ValueError as err:  # GTPConfig's own value checks name the field
        raise RecipeError(str(err).replace("GTPConfig.", "gtp.")) from None


def _check_muon(raw: dict[str, Any]) -> None:
    """``optim.optimizer=muon`` (Muon for the hidden matrices, Adam for the rest, design §1.6
    "Muon"): megatron's non-distributed optimizer, the ``muon`` section's keys and names; a
    ``muon`` section without it would do nothing."""
    optim, section = raw.get("optim") or {}, raw.get("muon")
    _one_of("optim.optimizer", optim.get("optimizer"), OPTIMIZERS)
    if optim.get("optimizer") != "muon":
        if section is not None:
            raise RecipeError(
                "the muon section applies only with optim.optimizer=muon: set it, or drop muon"
            )
        return
    if optim.get("use_distributed_optimizer"):
        raise RecipeError(
            "optim.optimizer=muon needs whole matrices, which megatron's distributed optimizer "
            "cuts into ranges: set optim.use_distributed_optimizer=false (under GTP each rank "
            "still keeps only its shards' optimizer state)"
        )
    _check_keys("muon", section or {}, MUON_KEYS, "a Muon setting")
    _one_of("muon.adjust_lr_fn", (section or {}).get("adjust_lr_fn"), MUON_ADJUST_LR_FNS)
    _one_of("muon.ns_dtype", (section or {}).get("ns_dtype"), MUON_NS_DTYPES)
    _one_of("muon.orthogonalize", (section or {}).get("orthogonalize"), MUON_ORTHOGONALIZE)


def _check_peft(raw: dict[str, Any]) -> None:
    """The ``peft`` section: NeMo's LoRA, set up as ``llm.finetune`` does; ``restore`` names the
    pretrained checkpoint it starts from, ``checkpoint`` saves the adapters alone (NeMo's PEFT
    checkpoints) and ``resume`` restarts from them."""
    section = raw.get("peft")
    if section is None:
        return
    _check_keys("peft", section, PEFT_KEYS, "a PEFT setting")
    method = section.get("method")
    if method is None:
        raise RecipeError("peft.method is missing: add +peft.method=lora")
    if method in PEFT_REFUSED:
        raise RecipeError(f"peft.method={method!r} is not supported: {PEFT_REFUSED[method]}")
    _one_of("peft.method", method, PEFT_METHODS)
    allowed = PEFT_TARGETS[method]
    targets = section.get("target_modules")
    if targets is not None:
        if not isinstance(targets, list) or not targets:
            raise RecipeError(
                f"peft.target_modules={targets!r} must be a non-empty list of {', '.join(allowed)}"
            )
        for target in targets:
            _one_of("peft.target_modules", target, allowed)
        gated = bool((raw.get("model") or {}).get("gated_linear_unit", False))
        halves = [target for target in targets if target in GATED_MLP_TARGETS]
        if halves and not gated:
            raise RecipeError(
                f"peft.target_modules has {', '.join(halves)}: the halves of a gated MLP's "
                "linear_fc1, and this model's MLP is not gated (model.gated_linear_unit=false); "
                "drop them"
            )


def _check_checkpoint_section(section: Any) -> None:
    if section is None:
        return
    if not isinstance(section, dict):
        raise RecipeError(
            f"checkpoint={section!r} must be a mapping: use +checkpoint.dir=DIR "
            "+checkpoint.every_n_train_steps=N"
        )
    _check_keys("checkpoint", section, CHECKPOINT_KEYS, "a checkpoint setting")
    for key in CHECKPOINT_REQUIRED:
        if key not in section:
            raise RecipeError(f"checkpoint.{key} is missing: add +checkpoint.{key}=...")


def _check_section_keys(raw: dict[str, Any]) -> None:
    """Every key of a section the loader passes to a class is one that class takes (read from
    the installed source, :mod:`nemo_gtp.recipes.signatures`): a typo'd ``+key`` is refused here,
    not by a traceback after NeMo's import."""
    for section, (_, _, target) in SECTION_CLASSES.items():
        values = raw.get(section)
        keys = section_keywords(section) if isinstance(values, dict) else None
        if keys is None:  # no such section, or its class's source is not installed here
            continue
        for key in values:
            source = LOADER_PASSES.get(section, {}).get(key)
            if source is not None:
                raise RecipeError(f"{section}.{key} comes from {source}: drop {section}.{key}")
            if key not in keys:
                close = difflib.get_close_matches(key, sorted(keys), n=1)
                hint = f" (did you mean {section}.{close[0]}?)" if close else ""
                raise RecipeError(f"{section}.{key} is not an argument of {target}{hint}")


def _check_keys(name: str, section: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    """Every key of the ``name`` section is one of ``keys`` (``what`` names such a key)."""
    for key in section:
        if key not in keys:
            raise RecipeError(
                f"{name}.{key} is not {what}{_did_you_mean(key, keys)}: known are {', '.join(keys)}"
            )


def _one_of(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if value is not None and value not in choices:
        raise RecipeError(
            f"{key}={value!r} is not supported{_did_you_mean(str(value), choices)}: "
            f"use one of {', '.join(choices)}"
        )


def _check_names(raw: dict[str, Any]) -> None:
    precision = raw.get("precision")
    _one_of("precision", None if precision is None else str(precision), PRECISIONS)
    _one_of("data.dataset", (raw.get("data") or {}).get("dataset"), DATASETS)
    model = raw.get("model") or {}
    _one_of("model.layer_spec", model.get("layer_spec"), LAYER_SPECS)
    _one_of("model.activation_func", model.get("activation_func"), list(ACTIVATIONS))
    for key in ("params_dtype", "pipeline_dtype"):
        _one_of(f"model.{key}", model.get(key), DTYPES)
    _one_of("strategy.pipeline_dtype", (raw.get("strategy") or {}).get("pipeline_dtype"), DTYPES)


def _check_sizes(raw: dict[str, Any]) -> None:
    """Parallel sizes against the world, and the batch arithmetic (design §3.1)."""
    trainer, strategy = raw.get("trainer") or {}, raw.get("strategy") or {}
    dims_class = _engine_module("grid").GTPParallelDims
    size_keys = (
        "tensor_model_parallel_size",
        "num_weight_shards",
        "context_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "expert_num_weight_shards",
        "num_distributed_optimizer_instances",
    )
    sizes = {k: strategy[k] for k in size_keys if strategy.get(k) is not None}
    try:
        dims = dims_class(world_size=None, **sizes)
    except ValueError as err:
        raise RecipeError(f"strategy: {err}") from None
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    world = devices * nodes
    try:
        dims = dims.with_world_size(world)
    except ValueError as err:
        raise RecipeError(
            f"strategy.num_weight_shards={dims.num_weight_shards} on trainer.devices x "
            f"trainer.num_nodes = {devices} x {nodes} ranks: {err}"
        ) from None
    if dims.gtp_enabled:
        fmt = strategy.get("save_ckpt_format", "torch_dist")
        if fmt != "torch_dist":
            raise RecipeError(
                f"strategy.save_ckpt_format={fmt!r} is not supported with GTP: set "
                "strategy.save_ckpt_format=torch_dist (GTP checkpoints are torch_dist, design §3.3)"
            )
    _check_moe(raw, dims)
    _check_fp8(raw, dims)
    _check_context_parallel(raw, dims)
    _check_pipeline(raw, dims)
    data = raw.get("data") or {}
    micro, batch = data.get("micro_batch_size"), data.get("global_batch_size")
    if micro is None or batch is None:
        return
    ranks = dims.data_parallel_size  # DP x GTP: each eats a distinct microbatch (§3.1)
    if batch % (micro * ranks) != 0:
        raise RecipeError(
            f"data.global_batch_size={batch} must be a multiple of data.micro_batch_size x "
            f"(DP x GTP) = {micro} x {ranks} = {micro * ranks}: set "
            f"data.global_batch_size={max(1, round(batch / (micro * ranks))) * micro * ranks}"
        )


def _check_context_parallel(raw: dict[str, Any], dims: Any) -> None:
    """Context parallelism runs in TransformerEngine's attention only (megatron's local core
    attention refuses it); under GTP the CP peers join the replicate group (design §1.4 "CP")."""
    cp = dims.context_parallel_size
    if cp == 1:
        return
    spec = (raw.get("model") or {}).get("layer_spec") or default_layer_spec_name()
    if spec != "te":
        raise RecipeError(
            f"strategy.context_parallel_size={cp} with model.layer_spec={spec}: megatron runs "
            "context parallelism in TransformerEngine's attention only; set "
            "model.layer_spec=te (GPUs) or strategy.context_parallel_size=1"
        )


def _check_pipeline(raw: dict[str, Any], dims: Any) -> None:
    """Pipeline stages (design §1.4 "PP"): the layers split evenly over PP x VP model chunks; a
    virtual pipeline gets at least PP microbatches per step; on CPU an untied output layer
    (megatron copies a tied embedding to the last stage through CUDA)."""
    strategy, model = raw.get("strategy") or {}, raw.get("model") or {}
    pp, vp = dims.pipeline_model_parallel_size, strategy.get("virtual_pipeline_model_parallel_size")
    if vp is not None and pp == 1:
        raise RecipeError(
            f"strategy.virtual_pipeline_model_parallel_size={vp} needs pipeline stages: set "
            "strategy.pipeline_model_parallel_size > 1 or drop the virtual size"
        )
    if pp == 1:
        return
    layers, chunks = model.get("num_layers"), pp * (vp or 1)
    uneven = any(
        key in model
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
    )
    if layers is not None and layers % chunks and not uneven:
        what = f"{pp} stages" + (f" x {vp} virtual stages" if vp else "")
        raise RecipeError(
            f"model.num_layers={layers} does not split evenly over {what}: set model.num_layers "
            f"to a multiple of {chunks}"
        )
    data = raw.get("data") or {}
    micro, batch, ranks = (
        data.get("micro_batch_size"),
        data.get("global_batch_size"),
        dims.data_parallel_size,
    )
    if vp is not None and micro and batch and batch // (micro * ranks) < pp:
        # megatron's interleaved schedule runs the microbatches in groups of PP per model chunk
        raise RecipeError(
            f"strategy.virtual_pipeline_model_parallel_size={vp} needs at least "
            f"pipeline_model_parallel_size={pp} microbatches per step, data.global_batch_size="
            f"{batch} gives {batch // (micro * ranks)} (micro {micro} x DP x GTP {ranks}): set "
            f"data.global_batch_size={pp * micro * ranks}"
        )
    if is_cpu_recipe(raw) and model.get("share_embeddings_and_output_weights", True):
        raise RecipeError(
            f"strategy.pipeline_model_parallel_size={pp} on CPU needs an untied output layer "
            "(megatron copies the tied embedding to the last stage through CUDA): set "
            "+model.share_embeddings_and_output_weights=false"
        )


def is_cpu_recipe(cfg: Any) -> bool:
    """Whether a recipe (its ``DictConfig`` or plain dict) runs on CPU processes: ``cpu_compat``
    or ``trainer.accelerator: cpu``.

    Example::

        is_cpu_recipe(load_recipe("configs/tiny_cpu.yaml"))   # True
    """
    trainer = cfg.get("trainer") or {}
    return bool(cfg.get("cpu_compat", False)) or trainer.get("accelerator") == "cpu"


def default_layer_spec_name() -> str:
    """The layer spec a recipe without ``model.layer_spec`` gets, as NeMo picks it: ``"te"``
    when TransformerEngine is installed, else ``"local"`` (no import: a spec lookup).

    Example::

        default_layer_spec_name()   # "local" on a CPU machine
    """
    return "te" if _importable("transformer_engine") else "local"


def _check_moe(raw: dict[str, Any], dims: Any) -> None:
    """Expert GTP needs routed experts (``SequentialMLP``, or ``TEGroupedMLP``: grouped GEMM
    with the TE layer spec, not the legacy ``GroupedMLP``); experts divide over EP; the legacy
    ``GroupedMLP`` cannot checkpoint under GTP (design §1.4, §3.3 "Routed experts")."""
    model = raw.get("model") or {}
    experts = model.get("num_moe_experts")
    if dims.egtp > 1 and not experts:
        raise RecipeError(
            f"strategy.expert_num_weight_shards={dims.expert_num_weight_shards} shards routed "
            "experts, but model.num_moe_experts is not set: set model.num_moe_experts or drop "
            "strategy.expert_num_weight_shards"
        )
    if dims.egtp > 1 and model.get("moe_grouped_gemm"):
        spec = model.get("layer_spec") or default_layer_spec_name()
        if spec != "te" or model.get("moe_use_legacy_grouped_gemm"):
            if model.get("moe_use_legacy_grouped_gemm"):
                why = "model.moe_use_legacy_grouped_gemm=true"
            elif model.get("layer_spec"):
                why = f"model.layer_spec={spec}"
            else:
                why = "model.layer_spec unset (local: TransformerEngine is not installed)"
            raise RecipeError(
                f"model.moe_grouped_gemm=true with {why} builds megatron's legacy GroupedMLP, "
                "which expert GTP does not shard: set model.moe_grouped_gemm=false, or "
                "model.layer_spec=te (TEGroupedMLP, TransformerEngine; design §1.4)"
            )
    if experts and experts % dims.expert_model_parallel_size != 0:
        raise RecipeError(
            f"model.num_moe_experts={experts} must be a multiple of "
            f"strategy.expert_model_parallel_size={dims.expert_model_parallel_size}"
        )
    legacy = (
        model.get("moe_use_legacy_grouped_gemm")
        or (model.get("layer_spec") or default_layer_spec_name()) != "te"
    )
    grouped = experts and model.get("moe_grouped_gemm") and legacy
    if grouped and dims.gtp_enabled and (raw.get("checkpoint") or raw.get("resume")):
        raise RecipeError(
            "checkpoint / resume of megatron's legacy grouped-GEMM MoE experts under GTP "
            "(GroupedMLP) is not supported yet: set model.moe_grouped_gemm=false, or "
            "model.layer_spec=te (TEGroupedMLP checkpoints), or drop the checkpoint section "
            "(and resume)"
        )


def _check_fp8(raw: dict[str, Any], dims: Any) -> None:
    """The ``fp8`` section (TE's FP8 GEMMs through NeMo's precision plugin, design §1.3): names,
    what it needs (bf16-mixed, the TE layer spec, GPUs), and what FP8 primary weights
    (``fp8.param_gather``) need under GTP. The GPU's own limits (MXFP8 needs Blackwell) are
    checked on the device."""
    section = raw.get("fp8")
    if section is None:
        return
    _check_keys("fp8", section, FP8_KEYS, "an fp8 setting")
    if section.get("format") is None:
        raise RecipeError("fp8.format is missing: add fp8.format=hybrid (or drop the fp8 section)")
    _one_of("fp8.format", section["format"], FP8_FORMATS)
    _one_of("fp8.recipe", section.get("recipe"), FP8_RECIPES)
    if str(raw.get("precision")) != "bf16-mixed":
        raise RecipeError(
            f"fp8 needs precision: bf16-mixed (TE's FP8 GEMMs run under NeMo's mixed-precision "
            f"plugin), got precision={raw.get('precision')!r}: set precision=bf16-mixed"
        )
    if raw.get("cpu_compat"):
        raise RecipeError(
            "fp8 needs GPUs with TransformerEngine: set cpu_compat=false (or drop the fp8 section)"
        )
    if (raw.get("model") or {}).get("layer_spec") == "local":
        raise RecipeError(
            "fp8 runs TransformerEngine's FP8 GEMMs: set model.layer_spec=te (megatron's local "
            "linears have none)"
        )
    if dims.gtp_enabled and section.get("param_gather"):
        _check_fp8_primary(raw, dims, section)


def _check_fp8_primary(raw: dict[str, Any], dims: Any, section: dict[str, Any]) -> None:
    """``fp8.param_gather=true`` under GTP: FP8 primary GTP shards (design §1.3 "FP8 primary
    weights"): per-tensor current scaling or blockwise scaling, megatron's distributed
    optimizer with fp32 gradient reduction, no routed experts over expert GTP. ``resume`` is
    fine: the strategy re-quantizes the shards from the loaded weights and fp32 mains (design
    §3.3 "FP8 primary weights")."""
    off = "or fp8.param_gather=false (the shards then stay bf16)"
    recipe = section.get("recipe") or "delayed"
    if recipe not in ("tensorwise", "blockwise"):  # engine.fp8.FP8_PRIMARY_RECIPES (no torch here)
        raise RecipeError(
            f"fp8.param_gather=true (FP8 primary weights) with fp8.recipe={recipe} is not "
            f"supported with GTP (its FP8 primary shards use per-tensor current scaling or "
            f"128x128 blockwise scaling): set fp8.recipe=tensorwise or blockwise, {off}"
        )
    if not (raw.get("optim") or {}).get("use_distributed_optimizer"):
        raise RecipeError(
            "fp8.param_gather=true under GTP needs megatron's distributed optimizer (it keeps "
            f"the fp32 masters the FP8 shards are written back from): set "
            f"optim.use_distributed_optimizer=true, {off}"
        )
    if (raw.get("ddp") or {}).get("grad_reduce_in_fp32") is False:
        raise RecipeError(
            "fp8.param_gather=true under GTP needs ddp.grad_reduce_in_fp32=true (megatron DDP "
            f"would allocate the gradient buffer in the shards' float8 dtype), {off}"
        )
    if dims.egtp > 1 and (raw.get("model") or {}).get("num_moe_experts"):
        raise RecipeError(
            "fp8.param_gather=true is not supported for routed experts sharded over expert GTP: "
            f"drop strategy.expert_num_weight_shards (experts whole), {off}"
        )
    if recipe == "blockwise":
        _check_primary_tiles(raw, dims)


TE_TILE = 128  # TE's Float8BlockScaling weight tiles (sharding/te_fp8.TE_TILE; no torch here)


def _check_primary_tiles(raw: dict[str, Any], dims: Any) -> None:
    """Blockwise FP8 primary shards own their tiles (design §1.3 "FP8 primary weights"): every
    transformer linear's GTP shard must be whole 128-row tiles, else the recipe names the
    ``gtp.pad_for_alignment`` that makes it so (the shard rows are the TP-local rows padded to
    ``pad_for_alignment x GTP``, design §1.3 "Padding")."""
    model = raw.get("model") or {}
    hidden, heads = model.get("hidden_size"), model.get("num_attention_heads")
    if not hidden or not heads:
        return
    tp = dims.tensor_model_parallel_size
    kv = model.get("kv_channels") or hidden // heads
    groups = model.get("num_query_groups") or heads
    fc1 = (model.get("ffn_hidden_size") or 4 * hidden) * (
        2 if model.get("gated_linear_unit") else 1
    )
    rows = {
        "linear_qkv": (heads + 2 * groups) * kv // tp,
        "linear_fc1": fc1 // tp,
        "linear_proj and linear_fc2": hidden,
    }
    pad = int((raw.get("gtp") or {}).get("pad_for_alignment", 16))
    unit = pad * dims.gtp
    for name, count in rows.items():
        shard = -(-count // unit) * unit // dims.gtp
        if shard % TE_TILE:
            raise RecipeError(
                f"fp8.recipe=blockwise with fp8.param_gather=true: {name} ({count} rows per "
                f"tensor-parallel rank) gives GTP shards of {shard} rows at GTP {dims.gtp} "
                f"(gtp.pad_for_alignment={pad}), which split TE's {TE_TILE}x{TE_TILE} tiles: "
                f"set gtp.pad_for_alignment={math.lcm(TE_TILE, pad)}"
            )


def check_resume(resume: Any, checkpoint: Any) -> None:
    """``resume`` is ``latest`` (the newest committed checkpoint of ``checkpoint.dir``, none yet:
    step 0; ``nemo_gtp.recipes.resume``), which needs a ``checkpoint`` section to look in and
    save to, or a checkpoint directory (:func:`check_resume_path`)."""
    if str(resume) != LATEST:
        check_resume_path(resume)
    elif not checkpoint:
        raise RecipeError(
            "resume=latest continues from the newest checkpoint in checkpoint.dir, and this "
            "recipe saves none: add +checkpoint.dir=DIR +checkpoint.every_n_train_steps=N"
        )


def check_resume_path(path: Any, key: str = "resume") -> None:
    """``resume`` (or ``restore``, the weights a run starts from) must be a checkpoint
    directory (``<dir>/step=N`` with ``weights/``)."""
    where = Path(str(path))
    if (where / "weights").is_dir() or (where / "metadata.json").is_file():
        return
    hint = ""
    latest = latest_checkpoint(where)
    if latest is not None:
        hint = f" (its newest is {latest.name}: use +{key}={latest})"
    what = "does not exist" if not where.exists() else "is not a checkpoint"
    latest_too = ", or +resume=latest with +checkpoint.dir" if key == "resume" else ""
    raise RecipeError(
        f"{key}={str(path)!r} {what}: give a <checkpoint.dir>/step=N directory with a "
        f"weights/ subdirectory{latest_too}{hint}"
    )

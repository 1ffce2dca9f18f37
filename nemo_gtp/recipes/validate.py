"""Recipe checks the CLI runs in the parent process, before any worker is launched.

Each check raises :class:`RecipeError` (a ``ValueError``) with one line that names the recipe
key and the fix, so a typo costs a second instead of a multi-process NeMo start-up. Nothing here
imports torch or NeMo: what a recipe may hold is :mod:`nemo_gtp.recipes.schema`'s, the layout
(sizes, batch, checkpoint format, CP, PP, experts, FP8) is checked by
:mod:`nemo_gtp.recipes.validate_layout` with the rules of :mod:`nemo_gtp.engine.grid`, and the
``gtp`` keys are :class:`~nemo_gtp.engine.config.GTPConfig`'s (both engine modules torch-free).

Example::

    cfg = load_recipe("configs/tiny_cpu.yaml", ["strategy.num_weight_shards=3"])
    validate_recipe(cfg)  # RecipeError: ... change strategy.num_weight_shards or trainer.devices
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.ranges import check_settings
from nemo_gtp.recipes.resume import LATEST, latest_checkpoint
from nemo_gtp.recipes.schema import (
    ACTIVATIONS,
    CHECKPOINT_KEYS,
    CHECKPOINT_ON_SAVE_ERROR,
    CHECKPOINT_REQUIRED,
    CHECKPOINT_VERIFY,
    DATASETS,
    DTYPES,
    FAULTS_KEYS,
    GATED_MLP_TARGETS,
    LAYER_SPECS,
    MAPPING_SECTIONS,
    MUON_ADJUST_LR_FNS,
    MUON_KEYS,
    MUON_NS_DTYPES,
    MUON_ORTHOGONALIZE,
    OPTIMIZERS,
    PEFT_KEYS,
    PEFT_METHODS,
    PEFT_REFUSED,
    PEFT_TARGETS,
    PRECISIONS,
    SECTIONS,
    TYPED,
    check_keys,
    check_type,
    default_layer_spec_name,
    did_you_mean,
    gtp_config_fields,
    importable,
    one_of,
)
from nemo_gtp.recipes.signatures import LOADER_PASSES, SECTION_CLASSES, section_keywords
from nemo_gtp.recipes.validate_layout import check_layout


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
                f"unknown recipe section {section!r}{did_you_mean(section, SECTIONS)}: "
                f"known sections are {', '.join(SECTIONS)}"
            )
    for section in MAPPING_SECTIONS:
        if section in raw and not isinstance(raw[section], dict | type(None)):
            raise RecipeError(f"{section} must be a mapping of keys, got {raw[section]!r}")
    _check_section_keys(raw)
    for key, kind in TYPED.items():
        value = OmegaConf.select(cfg, key, default=None)
        check_type(key, value, kind)
    check_settings(lambda key: OmegaConf.select(cfg, key, default=None))  # value ranges
    _check_gtp_section(raw.get("gtp") or {})
    _check_checkpoint_section(raw.get("checkpoint"))
    _check_faults(raw.get("faults") or {}, raw.get("callbacks") or {})
    _check_muon(raw)
    _check_peft(raw)
    _check_names(raw)
    check_layout(raw)
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
    if OmegaConf.select(cfg, "checkpoint.dir", default=None) is not None and not importable(
        "nvidia_resiliency_ext"
    ):
        raise RecipeError(RESILIENCY_MISSING)


def _check_gtp_section(gtp: dict[str, Any]) -> None:
    fields = gtp_config_fields()
    for key, value in gtp.items():
        if key not in fields:
            raise RecipeError(
                f"gtp.{key} is not a GTPConfig field{did_you_mean(key, list(fields))}: "
                f"known are {', '.join(fields)}"
            )
        check_type(f"gtp.{key}", value, fields[key])
    try:
        GTPConfig(**gtp)
    except ValueError as err:  # GTPConfig's own value checks name the field
        raise RecipeError(str(err).replace("GTPConfig.", "gtp.")) from None


def _check_muon(raw: dict[str, Any]) -> None:
    """``optim.optimizer=muon`` (Muon for the hidden matrices, Adam for the rest, design §1.6
    "Muon"): megatron's non-distributed optimizer, the ``muon`` section's keys and names; a
    ``muon`` section without it would do nothing."""
    optim, section = raw.get("optim") or {}, raw.get("muon")
    one_of("optim.optimizer", optim.get("optimizer"), OPTIMIZERS)
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
    check_keys("muon", section or {}, MUON_KEYS, "a Muon setting")
    one_of("muon.adjust_lr_fn", (section or {}).get("adjust_lr_fn"), MUON_ADJUST_LR_FNS)
    one_of("muon.ns_dtype", (section or {}).get("ns_dtype"), MUON_NS_DTYPES)
    one_of("muon.orthogonalize", (section or {}).get("orthogonalize"), MUON_ORTHOGONALIZE)


def _check_peft(raw: dict[str, Any]) -> None:
    """The ``peft`` section: NeMo's LoRA, set up as ``llm.finetune`` does; ``restore`` names the
    pretrained checkpoint it starts from, ``checkpoint`` saves the adapters alone (NeMo's PEFT
    checkpoints) and ``resume`` restarts from them."""
    section = raw.get("peft")
    if section is None:
        return
    check_keys("peft", section, PEFT_KEYS, "a PEFT setting")
    method = section.get("method")
    if method is None:
        raise RecipeError("peft.method is missing: add +peft.method=lora")
    if method in PEFT_REFUSED:
        raise RecipeError(f"peft.method={method!r} is not supported: {PEFT_REFUSED[method]}")
    one_of("peft.method", method, PEFT_METHODS)
    allowed = PEFT_TARGETS[method]
    targets = section.get("target_modules")
    if targets is not None:
        if not isinstance(targets, list) or not targets:
            raise RecipeError(
                f"peft.target_modules={targets!r} must be a non-empty list of {', '.join(allowed)}"
            )
        for target in targets:
            one_of("peft.target_modules", target, allowed)
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
    check_keys("checkpoint", section, CHECKPOINT_KEYS, "a checkpoint setting")
    for key in CHECKPOINT_REQUIRED:
        if key not in section:
            raise RecipeError(f"checkpoint.{key} is missing: add +checkpoint.{key}=...")
    for key, choices in (
        ("on_save_error", CHECKPOINT_ON_SAVE_ERROR),
        ("verify", CHECKPOINT_VERIFY),
    ):
        if key in section and section[key] not in choices:
            raise RecipeError(
                f"checkpoint.{key}={section[key]!r}: one of {', '.join(choices)}, e.g. "
                f"+checkpoint.{key}={choices[0]}"
            )


def _check_faults(faults: dict[str, Any], callbacks: dict[str, Any]) -> None:
    """``faults`` keys and values; each ``callbacks.NAME`` a mapping with ``target`` (a Lightning
    callback class by import path, its module installed) and its keyword arguments."""
    check_keys("faults", faults, FAULTS_KEYS, "a faults setting")
    timeout = faults.get("collective_timeout_s")  # its type: TYPED
    if timeout is not None and not timeout > 0:
        raise RecipeError(
            f"faults.collective_timeout_s={timeout!r} must be > 0 seconds: set e.g. "
            "faults.collective_timeout_s=300"
        )
    for name, entry in callbacks.items():
        target = entry.get("target") if isinstance(entry, dict) else None
        module = target.rpartition(".")[0] if isinstance(target, str) else ""
        if not module:
            raise RecipeError(
                f"callbacks.{name} needs target=package.module.Class (a Lightning callback), "
                f"e.g. +callbacks.{name}.target=nemo_gtp.strategy.GTPProgressBar"
            )
        try:
            found = importable(module)
        except ImportError:  # a package on the way is missing
            found = False
        if not found:
            raise RecipeError(f"callbacks.{name}.target={target!r}: module {module} not found")
        if target.endswith(".FaultToleranceCallback") and not os.environ.get(FT_MONITOR_ENV):
            raise RecipeError(FT_REFUSED.format(key=f"callbacks.{name}"))


FT_MONITOR_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by nvidia-resiliency-ext's ft_launcher
FT_REFUSED = (
    "{key}: nvidia-resiliency-ext's FaultToleranceCallback sends its heartbeats to the rank "
    "monitor that its ft_launcher starts beside each rank (FT_RANK_MONITOR_IPC_SOCKET is not "
    "set: it would fail in every rank's setup). Launch the recipe with ft_launcher (as torchrun: "
    "ft_launcher --nproc-per-node N -m nemo_gtp.run RECIPE ...), or drop {key}: "
    "python -m nemo_gtp.run watches the ranks itself (faults.collective_timeout_s)"
)


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


def _check_names(raw: dict[str, Any]) -> None:
    precision = raw.get("precision")
    one_of("precision", None if precision is None else str(precision), PRECISIONS)
    one_of("data.dataset", (raw.get("data") or {}).get("dataset"), DATASETS)
    model = raw.get("model") or {}
    one_of("model.layer_spec", model.get("layer_spec"), LAYER_SPECS)
    one_of("model.activation_func", model.get("activation_func"), list(ACTIVATIONS))
    for key in ("params_dtype", "pipeline_dtype"):
        one_of(f"model.{key}", model.get(key), DTYPES)
    one_of("strategy.pipeline_dtype", (raw.get("strategy") or {}).get("pipeline_dtype"), DTYPES)


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

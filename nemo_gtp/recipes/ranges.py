"""The values each setting the recipe CLIs pass on may take: one rule per setting, both CLIs.

A value out of range (``trainer.max_steps=-5``, ``optim.lr=-0.1``, a dropout of 1.5, an unknown
``model.normalization``) used to be refused by Lightning, megatron, torch or NeMo only after the
ranks had started, as one traceback per rank. :data:`RULES` holds each setting's rule under its
YAML-recipe key; :func:`check_settings` runs them all over a recipe read through a getter, so
``python -m nemo_gtp.run configs/x.yaml`` (:func:`nemo_gtp.recipes.validate.validate_recipe`) and
``python -m nemo_gtp.run --recipe NAME`` (:func:`check_nemo_recipe_settings`, whose keys sit at
``optim.config.lr``, ``model.config.hidden_dropout``, ...) refuse the same values with the same
one line. No torch or NeMo import here.

Example::

    check_setting("trainer.max_steps", -5)
    # RecipeError: trainer.max_steps=-5 must be an integer >= 1 (optimizer steps to train):
    # set e.g. trainer.max_steps=100
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.schema import TYPED


@dataclass(frozen=True)
class Rule:
    """A setting's valid values: ``ok(value)``, said as ``want``, with an ``example`` value."""

    ok: Callable[[Any], bool]
    want: str
    example: str


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(low: float, example: str, why: str = "", *, integer: bool = False) -> Rule:
    """A number (``integer``: an integer) ``>= low``."""
    kind = "an integer" if integer else "a number"
    return Rule(
        lambda v: (_integer(v) if integer else _number(v)) and v >= low,
        f"{kind} >= {low:g}{why}",
        example,
    )


def above(low: float, example: str, why: str = "") -> Rule:
    """A number ``> low``."""
    return Rule(lambda v: _number(v) and v > low, f"a number > {low:g}{why}", example)


def fraction(example: str, why: str = "", *, one: bool = False, zero: bool = True) -> Rule:
    """A number in ``[0, 1)`` (``one``: ``1`` allowed; ``zero=False``: ``0`` refused)."""
    left, right = "[" if zero else "(", "]" if one else ")"
    return Rule(
        lambda v: _number(v) and (v >= 0 if zero else v > 0) and (v <= 1 if one else v < 1),
        f"a number in {left}0, 1{right}{why}",
        example,
    )


def batches_or_fraction(example: str, why: str = "") -> Rule:
    """Lightning's ``limit_*_batches``: a batch count (integer >= 0) or a fraction in [0, 1]."""
    return Rule(
        lambda v: (_integer(v) and v >= 0) or (isinstance(v, float) and 0 <= v <= 1),
        f"an integer >= 0 (batches) or a fraction in [0.0, 1.0]{why}",
        example,
    )


def choice(*names: str) -> Rule:
    """One of ``names``."""
    return Rule(lambda v: v in names, f"one of {', '.join(names)}", names[0])


def _backend(value: object) -> bool:
    """A ``torch.distributed`` backend the strategy can start: ``nccl``, ``gloo``, or a
    ``device:backend`` list of those and ``staged_gloo`` (``nemo_gtp.cpu.staged_gloo``: ranks
    sharing one GPU, the benchmarks' ``--shared-device``)."""
    if value in ("nccl", "gloo"):
        return True
    if not isinstance(value, str) or ":" not in value:
        return False
    pairs = [part.split(":") for part in value.split(",")]
    return all(
        len(pair) == 2 and pair[0] in ("cpu", "cuda") and pair[1] in ("nccl", "gloo", "staged_gloo")
        for pair in pairs
    )


_STEPS = " (optimizer steps to train)"
# Setting (its YAML-recipe key) -> rule. A key of schema.TYPED whose kind ends in "+" (an
# integer >= 1) has that rule without an entry here (rule_for).
RULES: dict[str, Rule] = {
    # Lightning's Trainer
    "trainer.max_steps": at_least(1, "100", _STEPS, integer=True),
    "trainer.min_steps": at_least(0, "0", integer=True),
    "trainer.max_epochs": Rule(
        lambda v: _integer(v) and (v >= 1 or v == -1), "an integer >= 1, or -1 (no limit)", "1"
    ),
    "trainer.min_epochs": at_least(0, "0", integer=True),
    "trainer.val_check_interval": Rule(
        lambda v: (_integer(v) and v >= 1) or (isinstance(v, float) and 0 < v <= 1),
        "an integer >= 1 (steps) or a fraction in (0.0, 1.0]",
        "100",
    ),
    "trainer.check_val_every_n_epoch": at_least(1, "1", integer=True),
    "trainer.limit_train_batches": batches_or_fraction("1.0"),
    "trainer.limit_val_batches": batches_or_fraction("0", " (0: no validation)"),
    "trainer.limit_test_batches": batches_or_fraction("0"),
    "trainer.num_sanity_val_steps": at_least(-1, "0", " (-1: all)", integer=True),
    "trainer.accumulate_grad_batches": at_least(1, "1", integer=True),
    "trainer.gradient_clip_val": at_least(0, "1.0"),
    "trainer.gradient_clip_algorithm": choice("norm", "value"),
    "trainer.fast_dev_run": Rule(
        lambda v: isinstance(v, bool) or (_integer(v) and v >= 0), "true, false or >= 0", "false"
    ),
    "trainer.accelerator": choice("gpu", "cpu", "cuda", "auto"),
    # megatron's OptimizerConfig (torch's Adam / SGD checks, megatron's scaler)
    "optim.lr": above(0, "0.0003", " (the peak learning rate)"),
    "optim.min_lr": at_least(0, "0.00003"),
    "optim.weight_decay": at_least(0, "0.01"),
    "optim.adam_beta1": fraction("0.9"),
    "optim.adam_beta2": fraction("0.95"),
    "optim.adam_eps": above(0, "1e-08"),
    "optim.sgd_momentum": fraction("0.9"),
    "optim.clip_grad": at_least(0, "1.0", " (0: no clipping)"),
    "optim.loss_scale": above(0, "1024"),
    "optim.initial_loss_scale": above(0, "4294967296"),
    "optim.min_loss_scale": above(0, "1.0"),
    "optim.loss_scale_window": at_least(1, "1000"),
    "optim.hysteresis": at_least(1, "2", integer=True),
    # NeMo's lr scheduler (NeMo recipes: optim.lr_scheduler)
    "scheduler.warmup_steps": at_least(0, "2000", integer=True),
    "scheduler.constant_steps": at_least(0, "0", integer=True),
    "scheduler.min_lr": at_least(0, "0.00003"),
    # the model (megatron's TransformerConfig / NeMo's GPTConfig)
    "model.hidden_dropout": fraction("0.0"),
    "model.attention_dropout": fraction("0.0"),
    "model.layernorm_epsilon": above(0, "1e-05"),
    "model.init_method_std": above(0, "0.02"),
    "model.rotary_percent": fraction("1.0", one=True, zero=False),
    "model.rotary_base": Rule(  # Gemma 3: (local, global) bases
        lambda v: all(_number(b) and b > 0 for b in (v if isinstance(v, tuple | list) else [v])),
        "a number > 0 (or one per attention kind)",
        "10000",
    ),
    "model.kv_channels": at_least(1, "64", integer=True),
    "model.normalization": choice("LayerNorm", "RMSNorm"),
    "model.position_embedding_type": choice("learned_absolute", "rope", "none"),
    "model.moe_token_dispatcher_type": choice("allgather", "alltoall", "flex"),
    "model.moe_aux_loss_coeff": at_least(0, "0.01"),
    "model.recompute_granularity": choice("full", "selective"),
    "model.recompute_method": choice("uniform", "block"),
    "model.recompute_num_layers": at_least(1, "1", integer=True),
    # data, strategy, LoRA, Muon
    "data.seed": at_least(0, "1234", integer=True),
    "data.num_val_samples": at_least(0, "1000", integer=True),
    "data.num_test_samples": at_least(0, "1000", integer=True),
    "strategy.process_group_backend": Rule(
        lambda v: _backend(v),
        "one of nccl, gloo (or per device: cpu:gloo,cuda:staged_gloo)",
        "nccl",
    ),
    "peft.dropout": fraction("0.0"),
    "muon.momentum": fraction("0.95"),
    "muon.eps": above(0, "1e-07"),
    "muon.gather_bucket_mb": above(0, "256"),
    "muon.lr_mult": above(0, "1.0"),
}
_AT_LEAST_ONE = at_least(1, "1", integer=True)


def rule_for(key: str) -> Rule | None:
    """The rule of a setting (its YAML-recipe key), or None when any value of its type goes."""
    if key in RULES:
        return RULES[key]
    return _AT_LEAST_ONE if TYPED.get(key, "").endswith("+") else None


def check_setting(key: str, value: Any, name: str | None = None) -> None:
    """``value`` of setting ``key`` is in range, else :class:`RecipeError` naming it as ``name``
    (how the user wrote the key; default ``key``) with a valid value. ``None``: unset, fine."""
    rule = rule_for(key)
    if value is None or rule is None or rule.ok(value):
        return
    name = name or key
    raise RecipeError(f"{name}={value!r} must be {rule.want}: set e.g. {name}={rule.example}")


def check_settings(get: Callable[[str], Any], name: Callable[[str], str] = str) -> None:
    """Every rule over a recipe: ``get(key)`` reads a setting by its YAML key (None: unset),
    ``name(key)`` says how this CLI's user writes it; then the rules across settings (a minimum
    learning rate above the peak, heads not divisible into key/value groups, a hidden size that
    is not a whole number of heads, more routed experts per token than experts, a checkpoint
    interval longer than the run)."""
    keys = list(RULES) + [k for k, kind in TYPED.items() if kind.endswith("+")]
    for key in dict.fromkeys(keys):
        check_setting(key, get(key), name(key))
    lr = get("optim.lr")
    for key in ("optim.min_lr", "scheduler.min_lr"):
        low = get(key)
        if _number(lr) and _number(low) and low > lr:
            raise RecipeError(
                f"{name(key)}={low!r} is above {name('optim.lr')}={lr!r} (the peak learning "
                f"rate, which NeMo's scheduler refuses): set e.g. {name(key)}={lr / 10:g}"
            )
    if get("optim.optimizer") == "sgd" and get("optim.use_distributed_optimizer"):
        raise RecipeError(  # megatron's DistributedOptimizer asserts it in every rank
            f"{name('optim.optimizer')}=sgd: megatron's distributed optimizer takes only adam: "
            f"set e.g. {name('optim.optimizer')}=adam, or {name('optim.use_distributed_optimizer')}"
            "=false (and ddp.use_distributed_optimizer=false)"
        )
    heads, groups = get("model.num_attention_heads"), get("model.num_query_groups")
    if _integer(heads) and _integer(groups) and groups >= 1 and heads % groups:
        raise RecipeError(
            f"{name('model.num_attention_heads')}={heads} must be a multiple of "
            f"{name('model.num_query_groups')}={groups} (each key/value group serves whole "
            f"heads): set e.g. {name('model.num_query_groups')}=1"
        )
    hidden = get("model.hidden_size")
    if _integer(hidden) and _integer(heads) and heads >= 1 and hidden % heads:
        if get("model.kv_channels") is None:  # megatron's head size: hidden / heads
            raise RecipeError(
                f"{name('model.hidden_size')}={hidden} must be a multiple of "
                f"{name('model.num_attention_heads')}={heads} (megatron's head size is their "
                f"quotient): set e.g. {name('model.hidden_size')}={hidden - hidden % heads}, or "
                f"{name('model.kv_channels')}"
            )
    topk, experts = get("model.moe_router_topk"), get("model.num_moe_experts")
    if _integer(topk) and _integer(experts) and topk > experts:
        raise RecipeError(
            f"{name('model.moe_router_topk')}={topk} routes each token to more experts than "
            f"{name('model.num_moe_experts')}={experts}: set e.g. "
            f"{name('model.moe_router_topk')}={min(2, experts)}"
        )
    every, steps = get("checkpoint.every_n_train_steps"), get("trainer.max_steps")
    if _integer(every) and _integer(steps) and every > steps:
        raise RecipeError(
            f"checkpoint.every_n_train_steps={every} is longer than "
            f"{name('trainer.max_steps')}={steps}, so the run would save nothing: set e.g. "
            f"checkpoint.every_n_train_steps={steps}"
        )


# Where a NeMo recipe (``llm.<name>.pretrain_recipe()``) keeps each section of the YAML keys.
NEMO_SECTIONS = {
    "trainer": "trainer",
    "strategy": "trainer.strategy",
    "optim": "optim.config",
    "scheduler": "optim.lr_scheduler",
    "model": "model.config",
    "data": "data",
    "peft": "peft",
}


def check_nemo_recipe_settings(recipe: Any) -> None:
    """:func:`check_settings` over a NeMo recipe (a NeMo-Run ``Partial``), named as its
    overrides name them (``optim.config.lr``), before anything is built or launched.

    Example::

        check_nemo_recipe_settings(recipe)   # in nemo_cli.check_recipe
    """

    def nemo_key(key: str) -> str:
        section, _, rest = key.partition(".")
        return f"{NEMO_SECTIONS.get(section, section)}.{rest}"

    def get(key: str) -> Any:
        if key.split(".")[0] not in NEMO_SECTIONS:
            return None  # sections only the YAML recipes have (muon, checkpoint)
        target = recipe
        for part in nemo_key(key).split("."):
            try:
                target = getattr(target, part)
            except (AttributeError, TypeError, ValueError):
                return None
        return None if callable(target) and not isinstance(target, type) else target

    check_settings(get, nemo_key)

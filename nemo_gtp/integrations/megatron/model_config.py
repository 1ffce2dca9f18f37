"""What GTP requires of a megatron model config: mirrored knobs and refused settings.

One place for both, used by every path that pairs a :class:`GTPConfig` with a model:
``shard_model`` and the pre-sharded constructors (before any weight is sharded),
``make_finalize_model_grads`` (at the first step) and the NeMo strategy (which mirrors instead
of refusing, so the user need not repeat the model's setting).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.fp8 import FP8_PRIMARY, FP8Scaling, check_fp8_training_for_gtp


def mirror_per_token_loss(
    config: GTPConfig | None, model_config: object, *, adopt: bool = False, owner: str = ""
) -> GTPConfig:
    """The ``GTPConfig`` to use with a model whose config is ``model_config`` (design §2.4, §3.2).

    ``GTPConfig.calculate_per_token_loss`` must equal the model config's: it decides whether
    GTP's reduce-scatters and the replicated-grad all-reduce pre-scale by 1/GTP (mean) or SUM
    (per-token loss, megatron divides by the token count later). ``config=None`` gives the
    defaults with the model's setting. A config that disagrees is copied with the model's value
    when ``adopt`` (a trainer that owns both, e.g. ``GTPMegatronStrategy``), else refused with
    ``ValueError`` naming both settings (``owner``, e.g. a runtime's name, is named too). Without a
    model config there is nothing to mirror and ``config`` is returned as given.

    Example::

        config = mirror_per_token_loss(None, model.config)           # defaults, mirrored
        mirror_per_token_loss(GTPConfig(), per_token_model.config)   # ValueError: set them equal
    """
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    if config is None:
        return GTPConfig(calculate_per_token_loss=per_token)
    if config.calculate_per_token_loss == per_token:
        return config
    if adopt:
        return dataclasses.replace(config, calculate_per_token_loss=per_token)
    if model_config is None:
        return config
    of = f" of {owner}" if owner else ""
    raise ValueError(
        f"GTPConfig.calculate_per_token_loss={config.calculate_per_token_loss}{of} but the model "
        f"config has calculate_per_token_loss={per_token}: set them equal (design §3.2)"
    )


def validate_model_config_for_gtp(config: object) -> None:
    """Reject model-config settings GTP cannot honour (raised before any weight is built).

    ``delay_wgrad_compute``: TE's delayed wgrad stores the wgrad GEMM for a later
    ``backward_dw()`` and skips the DistributedWeight ``finalize_group_grads`` call, so a GTP
    weight's gradient would never be reduce-scattered into ``main_grad`` (design §3.1 "The bridge").

    Example::

        validate_model_config_for_gtp(TransformerConfig(..., delay_wgrad_compute=True))  # raises
    """
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError(
            "TransformerConfig.delay_wgrad_compute=True is incompatible with GTP: TE's delayed "
            "wgrad skips the DistributedWeight finalize_group_grads call, so GTP weight "
            "gradients would never reach main_grad. Set delay_wgrad_compute=False"
        )
    check_low_precision_for_gtp(config)


def _value(setting: object) -> object:
    return getattr(setting, "value", setting)  # megatron's Fp8Recipe is a str enum


FP8_CONFIG_KEYS = {
    name: f"TransformerConfig.{name}" for name in ("fp8", "fp8_recipe", "fp8_param", "fp4")
}
"""How :func:`check_low_precision_for_gtp` names the model config's low-precision settings."""


def check_low_precision_for_gtp(config: object) -> str | None:
    """The model config's FP8 / FP4 settings, checked for GTP on this device (design §1.3).

    ``None`` when neither is on; ``"fp8"`` when TE's GEMMs will get FP8 gathers (per-tensor current
    scaling; blockwise, for shards of whole 128-row tiles), ``"training_dtype"`` when TE quantizes
    the gathered weight itself (other recipes), ``"fp8_primary"`` for FP8 primary weights
    (``fp8_param`` with ``fp8_recipe`` "tensorwise" or "blockwise": ``shard_model`` makes the shards
    FP8, design §1.3 "FP8 primary weights"). Raises ``ValueError`` naming the setting for FP8
    primary weights under another recipe or with megatron's bf16 first / last layers, and for
    recipes this GPU cannot run (MXFP8 / NVFP4 below compute capability 10.0): before any weight is
    built or sharded.

    Example::

        check_low_precision_for_gtp(TransformerConfig(..., fp8="hybrid", fp8_recipe="tensorwise"))
    """
    fp8, fp4 = getattr(config, "fp8", None), getattr(config, "fp4", None)
    if fp8 is None and fp4 is None:
        return None
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    kind = check_fp8_training_for_gtp(
        _value(fp8),
        _value(getattr(config, "fp8_recipe", "delayed")),
        _value(fp4),
        _value(getattr(config, "fp4_recipe", "nvfp4")),
        fp8_param=bool(getattr(config, "fp8_param", False)),
        capability=capability,
        keys=FP8_CONFIG_KEYS,
    )
    if kind == FP8_PRIMARY and _bf16_edge_layers(config):
        raise ValueError(
            "TransformerConfig.fp8_param=True with first_last_layers_bf16=True is not supported "
            "with GTP: megatron keeps the weights of the bf16 first / last layers in bf16, but "
            'every shard of a GTP runtime is an FP8 primary weight (design §1.3 "FP8 primary '
            'weights"): set first_last_layers_bf16=False, or fp8_param=False'
        )
    return kind


def _bf16_edge_layers(config: object) -> bool:
    if not getattr(config, "first_last_layers_bf16", False):
        return False
    start = getattr(config, "num_layers_at_start_in_bf16", 1) or 0
    return bool(start or getattr(config, "num_layers_at_end_in_bf16", 1))


def fp8_primary_scaling(config: object) -> FP8Scaling | None:
    """The :class:`FP8Scaling` of the FP8 primary shards a model config asks for, or ``None``.

    megatron's ``fp8_param`` (NeMo's ``fp8_param_gather``) with FP8 on: the weights are FP8
    primary weights in TE's weight format (E4M3 under both ``"e4m3"`` and ``"hybrid"``), design
    §1.3 "FP8 primary weights": per-tensor current scaling (``fp8_recipe="tensorwise"``), or
    TE's ``Float8BlockScaling`` weight tiles (``"blockwise"``: 128x128, power-of-two scales
    unless TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``, as the recipe megatron builds). The
    settings are checked first (:func:`check_low_precision_for_gtp`: other recipes are
    refused, naming the setting).

    Example::

        fp8_primary_scaling(TransformerConfig(..., fp8="hybrid", fp8_recipe="tensorwise",
                                              fp8_param=True))   # FP8Scaling("tensorwise")
    """
    if check_low_precision_for_gtp(config) != FP8_PRIMARY:
        return None
    if _value(getattr(config, "fp8_recipe", None)) == "blockwise":
        return FP8Scaling(
            "blockwise",
            fp8_dtype=torch.float8_e4m3fn,
            block=(128, 128),  # TE's Float8BlockScaling weight tiles (2-D, w_block_scaling_dim=2)
            power_2_scales=os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1",
        )
    return FP8Scaling("tensorwise", fp8_dtype=torch.float8_e4m3fn)

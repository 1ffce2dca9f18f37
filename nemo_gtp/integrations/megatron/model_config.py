"""What GTP requires of a megatron model config: mirrored knobs and refused settings.

One place for both, used by every path that pairs a :class:`GTPConfig` with a model:
``shard_model`` and the pre-sharded constructors (before any weight is sharded),
``make_finalize_model_grads`` (at the first step) and the NeMo strategy (which mirrors instead
of refusing, so the user need not repeat the model's setting).
"""

from __future__ import annotations

import dataclasses

from nemo_gtp.engine.config import GTPConfig


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

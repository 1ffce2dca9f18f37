"""Recipes (layer 3): NeMo 2's own recipes converted to GTP, and this repo's YAML recipes.

``with_gtp(recipe, num_weight_shards=N, **gtp_options)`` takes what NeMo's
``llm.<model>.pretrain_recipe(...)`` returns and gives it ``GTPMegatronStrategy``
(:mod:`nemo_gtp.recipes.convert`); YAML files in ``configs/`` become a trainer, model and data
(:mod:`nemo_gtp.recipes.loader`). Both run through ``python -m nemo_gtp.run``.

Example::

    recipe = with_gtp(llm.llama3_8b.pretrain_recipe(name="gtp", num_gpus_per_node=8), 8)
    run.run(recipe, executor=run.LocalExecutor(ntasks_per_node=8, launcher="torchrun"))
"""

from typing import Any

from nemo_gtp.recipes.config import load_recipe


def build_fit(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    """See :func:`nemo_gtp.recipes.loader.build_fit` (imported lazily: it pulls in NeMo)."""
    from nemo_gtp.recipes.loader import build_fit as _build_fit

    return _build_fit(*args, **kwargs)


def with_gtp(recipe: Any, num_weight_shards: int, **kwargs: Any) -> Any:
    """See :func:`nemo_gtp.recipes.convert.with_gtp` (imported lazily: it pulls in NeMo)."""
    from nemo_gtp.recipes.convert import with_gtp as _with_gtp

    return _with_gtp(recipe, num_weight_shards, **kwargs)


def __getattr__(name: str) -> Any:
    """``SyntheticGPTDataModule`` / ``ArithmeticGPTDataModule``, imported on first use (NeMo)."""
    if name in ("ArithmeticGPTDataModule", "SyntheticGPTDataModule"):
        from nemo_gtp.recipes import data

        return getattr(data, name)
    raise AttributeError(f"module 'nemo_gtp.recipes' has no attribute {name!r}")


__all__ = [
    "ArithmeticGPTDataModule",
    "SyntheticGPTDataModule",
    "build_fit",
    "load_recipe",
    "with_gtp",
]

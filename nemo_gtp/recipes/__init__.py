"""NeMo-style recipes: YAML files in ``configs/`` turned into a trainer, model and data (layer 3).

Example::

    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=50 strategy.num_weight_shards=4
"""

from typing import Any

from nemo_gtp.recipes.config import load_recipe


def build_fit(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    """See :func:`nemo_gtp.recipes.loader.build_fit` (imported lazily: it pulls in NeMo)."""
    from nemo_gtp.recipes.loader import build_fit as _build_fit

    return _build_fit(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """``SyntheticGPTDataModule`` / ``ArithmeticGPTDataModule``, imported on first use (NeMo)."""
    if name in ("ArithmeticGPTDataModule", "SyntheticGPTDataModule"):
        from nemo_gtp.recipes import data

        return getattr(data, name)
    raise AttributeError(f"module 'nemo_gtp.recipes' has no attribute {name!r}")


__all__ = ["ArithmeticGPTDataModule", "SyntheticGPTDataModule", "build_fit", "load_recipe"]

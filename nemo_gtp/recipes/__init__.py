"""NeMo-style recipes: YAML files in ``configs/`` turned into a trainer, model and data (layer 3).

Example::

    python -m nemo_gtp.run configs/tiny_cpu.yaml trainer.max_steps=50 strategy.num_weight_shards=4
"""

from nemo_gtp.recipes.loader import build_fit, load_recipe

__all__ = ["build_fit", "load_recipe"]

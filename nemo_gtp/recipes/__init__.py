"""Recipes (layer 3): NeMo 2's own recipes converted to GTP, and this repo's YAML recipes.

``with_gtp(recipe, num_weight_shards=N, **gtp_options)`` takes what NeMo's
``llm.<model>.pretrain_recipe(...)`` returns and gives it ``GTPMegatronStrategy``
(:mod:`nemo_gtp.recipes.convert`); YAML files in ``configs/`` become a trainer, model and data
(:mod:`nemo_gtp.recipes.loader`). Both run through ``python -m nemo_gtp.run``.

Example::

    recipe = with_gtp(llm.llama3_8b.pretrain_recipe(name="gtp", num_gpus_per_node=8), 8)
    run.run(recipe, executor=run.LocalExecutor(ntasks_per_node=8, launcher="torchrun"))
"""

from nemo_gtp.lazy import lazy_exports
from nemo_gtp.recipes.config import load_recipe

# Imported on first use: each pulls in NeMo.
_EXPORTS = {
    "build_fit": "nemo_gtp.recipes.loader",
    "with_gtp": "nemo_gtp.recipes.convert",
    "ArithmeticGPTDataModule": "nemo_gtp.data.synthetic",
    "SyntheticGPTDataModule": "nemo_gtp.data.synthetic",
}

__all__ = [
    "ArithmeticGPTDataModule",
    "SyntheticGPTDataModule",
    "build_fit",
    "load_recipe",
    "with_gtp",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

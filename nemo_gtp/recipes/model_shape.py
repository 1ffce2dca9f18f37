"""The model sizes of NeMo's own recipe, read from its config: no model, no process, no device.

``python -m nemo_gtp.plan --recipe llama3_70b`` plans NeMo's ``llm.llama3_70b.pretrain_recipe()``
through :func:`nemo_recipe_model_sizes`; ``nemo_gtp.plan.model_from_nemo_recipe`` wraps it
into a ``ModelShape``. Overrides are NeMo-Run's, as on ``python -m nemo_gtp.run --recipe``.

Example::

    sizes = nemo_recipe_model_sizes("llama3_8b", ["model.config.num_layers=2"])
    sizes["layers"], sizes["hidden"], sizes["vocab"], sizes["seq"]   # 2, 4096, 128256, 8192
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

from nemo_gtp.recipes.config import RecipeError
from nemo_gtp.recipes.convert import config_arg
from nemo_gtp.recipes.model_size import moe_sizes
from nemo_gtp.recipes.nemo_cli import apply_overrides, load_nemo_recipe

# The tokenizer's vocabulary of the model families whose NeMo config leaves ``vocab_size``
# unset (NeMo then takes it from the tokenizer at build time; the recipes' mock data would use
# GPT-2's): the first config class in the MRO whose name starts with a prefix decides.
FAMILY_VOCAB = (
    ("Llama4", 202048),
    ("Llama3", 128256),
    ("Llama31", 128256),
    ("Llama32", 128256),
    ("Llama33", 128256),
    ("Llama2", 32000),
    ("MistralNemo", 131072),
    ("MistralSmall3", 131072),
    ("Mistral", 32768),
    ("Mixtral", 32000),
    ("Nemotron", 256000),
    ("Gemma", 256000),
    ("Starcoder", 49152),
    ("Baichuan2", 125696),
    ("ChatGLM", 65024),
    ("DeepSeekV3", 129280),
    ("DeepSeekV2", 102400),
)


def nemo_recipe_model_sizes(name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The sizes of ``nemo.collections.llm.recipes.<name>.pretrain_recipe()``'s model config
    after NeMo-Run ``key=value`` ``overrides``, as ``ModelShape`` keyword arguments (``layers``,
    ``hidden``, ``ffn``, ``heads``, ``vocab``, ``seq``, ``query_groups``, ``gated``,
    ``tied_embeddings``, ``experts``, ``softmax_fp32``). :class:`RecipeError` naming the recipe
    or the override; ``vocab`` is the config's ``vocab_size``, else the family's tokenizer
    (:data:`FAMILY_VOCAB`), else an error asking for ``model.config.vocab_size=N``."""
    recipe = load_nemo_recipe(
        name, run_name="plan", directory=tempfile.gettempdir(), nodes=1, devices=8
    )
    apply_overrides(recipe, list(overrides))
    return recipe_model_sizes(recipe, f"--recipe {name!r}")


def recipe_model_sizes(recipe: Any, label: str = "the recipe") -> dict[str, Any]:
    """:func:`nemo_recipe_model_sizes` of a NeMo recipe already built (a ``run.Partial``);
    ``label`` names it in errors. Example: ``recipe_model_sizes(recipe)["layers"]``."""
    name = label
    config = config_arg(config_arg(recipe, "model"), "config")
    if config is None or config_arg(config, "hidden_size") is None:
        raise RecipeError(f"{name}: its model has no GPT config (model.config)")

    def get(key: str, default: Any = None) -> Any:
        value = config_arg(config, key, default)
        return default if value is None else value

    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    vocab = get("vocab_size") or _family_vocab(config)
    if not vocab:
        raise RecipeError(
            f"{name}: its model config sets no vocab_size and its family's tokenizer "
            "is not known here: add model.config.vocab_size=N"
        )
    seq = config_arg(config_arg(recipe, "data"), "seq_length") or get("seq_length", 2048)
    return {
        "layers": int(get("num_layers")),
        "hidden": hidden,
        "ffn": int(get("ffn_hidden_size", 4 * hidden)),
        "heads": heads,
        "vocab": int(vocab),
        "seq": int(seq),
        "query_groups": get("num_query_groups"),
        "gated": bool(get("gated_linear_unit", False)),
        "tied_embeddings": bool(get("share_embeddings_and_output_weights", False)),
        "softmax_fp32": bool(get("attention_softmax_in_fp32", False)),
        **moe_sizes(get, int(get("num_layers"))),
    }


def _family_vocab(config: Any) -> int | None:
    cls = getattr(config, "__fn_or_cls__", type(config))
    for klass in getattr(cls, "__mro__", (cls,)):
        for prefix, vocab in sorted(FAMILY_VOCAB, key=lambda item: -len(item[0])):
            if klass.__name__.startswith(prefix):
                return vocab
    return None

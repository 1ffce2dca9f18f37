"""NeMo's ``PreTrainingDataModule`` over indexed data, as a recipe's ``data`` (a ``run.Config``).

Example::

    recipe = llm.llama3_8b.pretrain_recipe(name="run", dir="/tmp/run", num_nodes=1)
    recipe.data = pretraining_data("data/corpus", "sentencepiece:data/tok.model", like=recipe.data)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_gtp.data.tokenizers import tokenizer_config

# What a recipe's data keeps when its MockDataModule is replaced (the batch arithmetic).
KEPT = ("seq_length", "micro_batch_size", "global_batch_size", "rampup_batch_size")


def check_indexed_prefix(prefix: str, where: str = "--data") -> str:
    """``prefix`` as an absolute path whose ``.bin`` and ``.idx`` exist, else ``ValueError``.

    Example::

        check_indexed_prefix("data/corpus")  # "/abs/data/corpus" when both files exist
    """
    missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
    if missing:
        raise ValueError(
            f"{where} {prefix!r}: {' and '.join(prefix + s for s in missing)} not found (build "
            "them with python -m nemo_gtp.data build --output-prefix PREFIX ...)"
        )
    return str(Path(prefix).absolute())


def pretraining_data(
    prefix: str | list[str], tokenizer: str, like: Any = None, **kwargs: Any
) -> Any:
    """``run.Config(PreTrainingDataModule)`` reading the indexed dataset(s) at ``prefix``.

    ``tokenizer`` is the spec the data was built with (:mod:`nemo_gtp.data.tokenizers`);
    ``like`` (e.g. the recipe's ``MockDataModule`` config) gives the sequence length and batch
    sizes; ``kwargs`` go to ``PreTrainingDataModule`` (e.g. ``split="98,1,1"``,
    ``create_attention_mask=True`` for the local layer spec). A list of prefixes blends them
    (megatron's ``[weight, prefix, ...]`` form works too). Example: the module docstring.
    """
    import nemo_run as run
    from nemo.collections.llm.gpt.data.pre_training import PreTrainingDataModule

    prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
    paths = [p if is_blend_weight(p) else check_indexed_prefix(str(p)) for p in prefixes]
    settings: dict[str, Any] = {}
    if like is not None:
        for key in KEPT:
            value = getattr(like, key, None)
            if value is not None:
                settings[key] = value
    settings.update(kwargs)
    return run.Config(
        PreTrainingDataModule, paths=paths, tokenizer=tokenizer_config(tokenizer), **settings
    )


def is_blend_weight(item: Any) -> bool:
    """Whether ``item`` of a prefix list is a blend weight (megatron's ``[weight, prefix, ...]``
    form), not a prefix: anything ``float()`` takes.

    Example::

        [is_blend_weight(p) for p in ["0.3", "data/a", 0.7, "data/b"]]  # [True, False, True, False]
    """
    try:
        float(item)
    except (TypeError, ValueError):
        return False
    return True

"""Tokenizers by spec string, for the indexed-data builder and for recipes (NeMo's classes).

A spec names a NeMo tokenizer that loads offline:

=============================  ===============================================================
``sentencepiece:PATH.model``   ``SentencePieceTokenizer(model_path=PATH.model)``; e.g. one
                               :func:`train_sentencepiece` wrote
``huggingface:NAME_OR_DIR``    ``AutoTokenizer(pretrained_model_name=NAME_OR_DIR)``: a local
                               directory (``tokenizer.json`` ...) offline, a hub name online
``byte``                       ``ByteLevelTokenizer()``: UTF-8 bytes, no file needed
=============================  ===============================================================

The builder and the recipe must use the same spec: token ids in ``.bin`` mean nothing to another
tokenizer. Example::

    tokenizer = load_tokenizer("sentencepiece:data/tok.model")
    recipe.data.tokenizer = tokenizer_config("sentencepiece:data/tok.model")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_gtp.data.corpus import read_documents

KINDS = ("sentencepiece", "huggingface", "byte")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"kind:location"`` -> ``(kind, location)``; ``ValueError`` naming ``--tokenizer``.

    Example::

        parse_spec("sentencepiece:tok.model")  # ("sentencepiece", "tok.model")
    """
    kind, _, location = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(
            f"--tokenizer {spec!r}: unknown kind {kind!r}, use sentencepiece:PATH.model, "
            "huggingface:NAME_OR_DIR or byte"
        )
    if kind == "byte":
        if location:
            raise ValueError(f"--tokenizer {spec!r}: 'byte' takes no location")
        return kind, None
    if not location:
        raise ValueError(f"--tokenizer {spec!r}: give the location, e.g. {kind}:PATH")
    if kind == "sentencepiece" and not Path(location).is_file():
        raise ValueError(
            f"--tokenizer {spec!r}: {location} does not exist (python -m nemo_gtp.data tokenizer "
            "trains one)"
        )
    return kind, str(Path(location).absolute()) if Path(location).exists() else location


def tokenizer_config(spec: str) -> Any:
    """The NeMo tokenizer of ``spec`` as a ``run.Config`` (a recipe's ``data.tokenizer``).

    Example::

        recipe.data.tokenizer = tokenizer_config("huggingface:/models/llama3/tokenizer")
    """
    import nemo_run as run

    kind, location = parse_spec(spec)
    if kind == "sentencepiece":
        from nemo.collections.common.tokenizers.sentencepiece_tokenizer import (
            SentencePieceTokenizer,
        )

        return run.Config(SentencePieceTokenizer, model_path=location)
    if kind == "huggingface":
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

        return run.Config(AutoTokenizer, pretrained_model_name=location)
    from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer

    return run.Config(ByteLevelTokenizer)


def load_tokenizer(spec: str) -> Any:
    """The NeMo tokenizer of ``spec``, built (``TokenizerSpec``: ``text_to_ids``, ``eod``).

    Example::

        load_tokenizer("byte").text_to_ids("GTP")  # [71, 84, 80]
    """
    import fiddle as fdl

    return fdl.build(tokenizer_config(spec))


def train_sentencepiece(
    inputs: list[str] | tuple[str, ...],
    output_prefix: str,
    vocab_size: int = 8000,
    json_key: str = "text",
    max_lines: int = 2_000_000,
) -> str:
    """Train a SentencePiece BPE tokenizer on a local corpus (offline); returns ``PREFIX.model``.

    Byte fallback (any UTF-8 text encodes, no unknown tokens) and the ids megatron's GPT dataset
    needs: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (the end-of-document token), ``<pad>`` 3. It
    trains on the corpus's non-empty lines (at most ``max_lines``, sampled). Example::

        model = train_sentencepiece(["corpus.jsonl"], "data/tok", vocab_size=8000)
        spec = f"sentencepiece:{model}"
    """
    import sentencepiece

    if vocab_size < 260:
        raise ValueError(
            f"--vocab-size={vocab_size} is too small: byte fallback needs 256 byte tokens plus the "
            "4 special ones (use >= 260)"
        )
    lines = (
        line
        for text in read_documents(inputs, json_key)
        for line in text.splitlines()
        if line.strip()
    )
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_prefix=output_prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        input_sentence_size=max_lines,
        shuffle_input_sentence=True,
        num_threads=1,
        minloglevel=2,
    )
    return f"{output_prefix}.model"

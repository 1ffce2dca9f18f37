"""Real pre-training data for NeMo recipes: megatron indexed datasets (``.bin`` / ``.idx``).

``python -m nemo_gtp.data`` builds them from a local corpus with a real tokenizer, offline:

``tokenizer``
    trains a SentencePiece (BPE, byte fallback) tokenizer on the corpus
    (:func:`~nemo_gtp.data.tokenizers.train_sentencepiece`), for when no tokenizer file is at hand.
``build``
    tokenizes every document (one per JSONL line, or one per text file), appends the end-of-document
    token and writes ``<prefix>.bin`` / ``<prefix>.idx`` with megatron-core's
    ``IndexedDatasetBuilder`` (:func:`~nemo_gtp.data.indexed.build_indexed_dataset`).

Tokenizers are named by a spec string (:mod:`nemo_gtp.data.tokenizers`):
``sentencepiece:PATH.model``, ``huggingface:NAME_OR_DIR`` (a local directory offline) or ``byte``.
NeMo's ``PreTrainingDataModule`` reads the result (:func:`~nemo_gtp.data.module.pretraining_data`
puts it into a recipe). Example::

    python -m nemo_gtp.data tokenizer --input corpus.jsonl --output data/tok --vocab-size 8000
    python -m nemo_gtp.data build --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer sentencepiece:data/tok.model
    python -m nemo_gtp.run --recipe llama3_8b --num-weight-shards 8 \\
        --data data/corpus --tokenizer sentencepiece:data/tok.model
"""

from nemo_gtp.lazy import lazy_exports

# Imported on first use: most pull in NeMo or megatron-core.
_EXPORTS = {
    "read_documents": "nemo_gtp.data.corpus",
    "build_indexed_dataset": "nemo_gtp.data.indexed",
    "train_sentencepiece": "nemo_gtp.data.tokenizers",
    "load_tokenizer": "nemo_gtp.data.tokenizers",
    "tokenizer_config": "nemo_gtp.data.tokenizers",
    "pretraining_data": "nemo_gtp.data.module",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

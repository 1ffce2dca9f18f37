"""Write megatron indexed datasets (``<prefix>.bin`` / ``<prefix>.idx``) from a local corpus.

Each document is tokenized, the tokenizer's end-of-document id appended (megatron's GPT dataset
packs documents back to back and needs the boundary), and written as one sequence and one
document with megatron-core's ``IndexedDatasetBuilder``, in the smallest dtype that holds the
vocabulary. Example::

    stats = build_indexed_dataset(["corpus.jsonl"], "data/corpus",
                                  load_tokenizer("sentencepiece:data/tok.model"))
    stats  # {"documents": 812, "tokens": 1_204_331, "prefix": "data/corpus"}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_gtp.data.corpus import read_documents


def build_indexed_dataset(
    inputs: list[str] | tuple[str, ...],
    output_prefix: str,
    tokenizer: Any,
    json_key: str = "text",
    append_eod: bool = True,
) -> dict[str, Any]:
    """Tokenize every document of ``inputs`` into ``output_prefix``.bin/.idx.

    ``tokenizer`` is a NeMo ``TokenizerSpec`` (:func:`nemo_gtp.data.tokenizers.load_tokenizer`).
    Returns the number of documents and tokens written. Raises ``ValueError`` when an input is
    missing or malformed or the corpus holds no document (an empty ``.bin`` would fail only at
    training time); the partial ``.bin`` is removed first.
    """
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    eod = tokenizer.eod if append_eod else None
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    documents = tokens = 0
    try:
        for text in read_documents(inputs, json_key):
            ids = list(tokenizer.text_to_ids(text))
            if eod is not None:
                ids.append(eod)
            if not ids:
                continue
            builder.add_item(torch.from_numpy(numpy.asarray(ids, dtype=numpy.int64)))
            builder.end_document()
            documents += 1
            tokens += len(ids)
        if documents == 0:
            raise ValueError(f"--input {list(inputs)}: no non-empty document found")
    except BaseException:  # a missing input, a bad line, no document: no partial .bin left
        builder.data_file.close()
        Path(get_bin_path(prefix)).unlink(missing_ok=True)
        raise
    builder.finalize(get_idx_path(prefix))
    return {"documents": documents, "tokens": tokens, "prefix": prefix, "dtype": dtype.__name__}

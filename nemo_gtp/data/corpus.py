"""Documents of a local corpus: JSONL lines or whole text files (no torch, no NeMo).

Example::

    for text in read_documents(["corpus.jsonl", "notes.txt"], json_key="text"):
        ...
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json")


def read_documents(paths: list[str] | tuple[str, ...], json_key: str = "text") -> Iterator[str]:
    """Every document of ``paths``, in order, empty ones skipped.

    A ``.jsonl`` / ``.json`` file holds one JSON object per line whose ``json_key`` is the text
    (megatron's preprocessing format); any other file is one document. A directory is read
    recursively, files sorted by path. Raises ``ValueError`` naming the file and line of a
    malformed JSON line or a missing key.
    """
    for path in paths:
        where = Path(path)
        if where.is_dir():
            files = sorted(p for p in where.rglob("*") if p.is_file())
        elif where.is_file():
            files = [where]
        else:
            raise ValueError(f"--input {path!r} does not exist")
        for file in files:
            if file.suffix in JSONL_SUFFIXES:
                yield from _jsonl_documents(file, json_key)
            else:
                text = file.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    yield text


def _jsonl_documents(file: Path, json_key: str) -> Iterator[str]:
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: not a JSON line ({err.msg})") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(
                    f"{file}:{number}: no {json_key!r} key (set --json-key to the text field)"
                )
            text = str(record[json_key])
            if text.strip():
                yield text

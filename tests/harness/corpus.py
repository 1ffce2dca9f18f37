"""A small English corpus from text shipped inside installed packages (offline, deterministic).

Each document is the long description in an installed distribution's ``METADATA`` (its README),
distributions sorted by name, so the same environment always gives the same corpus. The tests
train a tokenizer and build indexed data from it without any download. Example::

    write_package_corpus("corpus.jsonl", max_bytes=400_000)  # -> number of documents
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path


def package_documents(min_chars: int = 400) -> list[tuple[str, str]]:
    """``(distribution name, README text)`` of every installed distribution that has one.

    Example::

        name, text = package_documents()[0]
    """
    seen, out = set(), []
    dists = sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or "")
    for dist in dists:
        name = dist.metadata["Name"]
        if not name or name in seen:
            continue
        seen.add(name)
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if isinstance(body, str) and len(body.strip()) >= min_chars:
            out.append((name, body.strip()))
    return out


def write_package_corpus(path: str | Path, max_bytes: int = 400_000) -> int:
    """Write up to ``max_bytes`` of package READMEs as JSONL (``{"text": ...}`` per line);
    returns the number of documents. Example: the module docstring."""
    written = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for _, text in package_documents():
            if size >= max_bytes:
                break
            line = json.dumps({"text": text[: max_bytes - size]}) + "\n"
            out.write(line)
            size += len(line)
            written += 1
    if written == 0:
        raise RuntimeError("no installed distribution has a README in its METADATA")
    return written

"""The house rules that `lint-imports` does not see: small files and classes, public seams.

The import contracts (layers, a torch-only engine, the product apart from ``tests`` and
``bench``, no circle between files) are pyproject's ``[tool.importlinter]``, run by ``.ci/run``.
These read the product's source as text; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PRODUCT = Path(__file__).resolve().parent.parent / "nemo_gtp"
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400
SOURCES = sorted(PRODUCT.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PRODUCT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_product_files_and_classes_stay_small() -> None:
    """No product file over 600 lines, no class over 400: split along the seams instead."""
    too_big = []
    for path in SOURCES:
        text = path.read_text()
        name = path.relative_to(PRODUCT.parent)
        if (lines := text.count("\n")) > MAX_FILE_LINES:
            too_big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                if (size := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                    too_big.append(f"{name}: class {node.name}, {size} lines")
    assert not too_big, "\n".join(too_big)


def test_product_modules_share_only_public_names() -> None:
    """No ``from nemo_gtp.x import _private`` between modules: what modules share is public."""
    crossings = []
    for path in SOURCES:
        here = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level:
                continue
            source = node.module or ""
            if not source.startswith("nemo_gtp") or source == here:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    crossings.append(f"{here}: from {source} import {alias.name}")
    assert not crossings, "\n".join(crossings)

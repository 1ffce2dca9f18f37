"""``bench/`` as a maintained tool: the runner's stages and what every script says about itself.

Read as text (nothing imported, nothing launched): ``bench/gpu_stages.sh`` parses, lists every
stage it defines, and each stage has a function; every script of the package opens its
docstring with the question it answers and how its ranks talk (``bench/README.md``'s labels).
``CHECK=1 bash bench/gpu_stages.sh all`` parses every stage's command lines (slow: not here).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
RUNNER = BENCH / "gpu_stages.sh"
LIBRARIES = {"__init__.py", "common.py", "sync_sites.py"}  # imported by the scripts, not run
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in LIBRARIES)


def test_runner_parses_and_lists_every_stage() -> None:
    """Every stage in the runner's table has its ``stage_<name>`` function and a --list row."""
    subprocess.run(["bash", "-n", str(RUNNER)], check=True)
    listed = subprocess.run(
        ["bash", str(RUNNER), "--list"], check=True, capture_output=True, text=True
    ).stdout.splitlines()[1:]
    text = RUNNER.read_text()
    table = re.findall(r"^\s+\[(\w+)\]=", text, flags=re.M)
    functions = set(re.findall(r"^stage_(\w+)\(\)", text, flags=re.M))
    assert [line.split()[0] for line in listed] == table
    assert set(table) == functions
    for line in listed:  # how its ranks talk, as the README labels them
        assert line.split()[1] in ("NCCL", "shared", "fake"), line


def test_runner_refuses_an_unknown_stage() -> None:
    done = subprocess.run(["bash", str(RUNNER), "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown stage nope" in done.stdout


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_says_its_question_and_how_ranks_talk(path: Path) -> None:
    """Each script's docstring: a title line, then the question and its ranks (or, for the
    offline tools, what each subcommand answers), and a ``__main__`` entry for ``python -m``."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc, f"{path.name}: no module docstring"
    if path.name != "tools.py":
        assert "\nQuestion: " in doc and "\nRanks: " in doc, path.name
    assert 'if __name__ == "__main__":' in path.read_text(), path.name

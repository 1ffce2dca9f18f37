"""Which checkpoint a recipe resumes from: ``resume: DIR/step=N``, or ``resume: latest``.

``latest`` is the restart-from-last of a requeued job (NeMo's ``AutoResume(resume_if_exists=True,
resume_ignore_no_checkpoint=True)``, which NeMo's own recipes use): the same command, run again
after a preemption, continues from the newest *committed* checkpoint in ``checkpoint.dir``, and
starts at step 0 when there is none yet. Committed means what a load can trust (design §3.3
"Atomic commit"): a complete ``weights/`` exists (GTP's strategy writes a save into
``.weights.saving`` and renames it only once every rank's data is on disk) and NeMo's
``<name>-unfinished`` marker beside it is gone (``ModelCheckpoint`` removes it after the save's
finalize). A job killed in the middle of a save leaves that save uncommitted, so the one before
it is picked; NeMo's ``ModelCheckpoint`` deletes the leftover when the resumed fit sets up.

No torch here: the CLI resolves and checks ``resume`` before any process is launched.

Example::

    latest_checkpoint("ckpts")            # Path("ckpts/step=9"), or None before the first save
    resume_path({"resume": "latest", "checkpoint": {"dir": "ckpts", ...}})   # "ckpts/step=9"
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

LATEST = "latest"
UNFINISHED_SUFFIX = "-unfinished"  # NeMo's ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX
_STEP = re.compile(r"step=(\d+)")


def is_committed(checkpoint: Path) -> bool:
    """True when ``checkpoint`` (a ``<dir>/step=N`` directory) holds a complete save: megatron's
    ``metadata.json`` (written last) in ``weights/``, or in the ``.weights.previous`` that a
    commit interrupted between its two renames set aside (the load falls back to it)."""
    marker = checkpoint.with_name(checkpoint.name + UNFINISHED_SUFFIX)
    weights = [checkpoint / name / "metadata.json" for name in ("weights", ".weights.previous")]
    return any(path.is_file() for path in weights) and not marker.exists()


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The committed ``step=N`` checkpoint of ``directory`` with the largest N (None if none).

    Ordered by the step in the name, not by modification time: a copied or restored directory
    keeps its order. Example: ``latest_checkpoint("ckpts")`` -> ``Path("ckpts/step=9")``.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = []
    for path in root.iterdir():
        match = _STEP.fullmatch(path.name)
        if match and path.is_dir() and is_committed(path):
            steps.append((int(match.group(1)), path))
    return max(steps)[1] if steps else None


def resume_path(cfg: Any) -> str | None:
    """The checkpoint a recipe resumes from: its ``resume`` value, or with ``resume: latest``
    the newest committed one in ``checkpoint.dir`` (None: start at step 0).

    ``cfg``: the recipe (a ``DictConfig`` or a plain mapping). Example::

        Fit(trainer, model, data, ckpt_path=resume_path(cfg))
    """
    resume = cfg.get("resume")
    if resume is None:
        return None
    if str(resume) != LATEST:
        return str(resume)
    latest = latest_checkpoint(cfg["checkpoint"]["dir"])  # validate_recipe: it has one
    return None if latest is None else str(latest)

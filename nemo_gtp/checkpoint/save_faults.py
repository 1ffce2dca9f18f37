"""A save that fails (a full disk, an unwritable file system) fails on every rank alike.

[Note: failed saves]
megatron's ``torch_dist`` save agrees on a failure of the data writers (each rank's workers
report to rank 0, which broadcasts the verdict), but rank 0's own writes inside it,
``common.pt`` before the data and DCP's ``.metadata`` and ``metadata.json`` after, raise on rank
0 alone while the other ranks wait in the next collective: a full disk would hang the job.
:func:`install_deferred_errors` wraps those three writes: an ``OSError`` while writing into a
staging directory (``.<name>.saving``, :func:`nemo_gtp.checkpoint.io.staging_dir`) is recorded,
not raised, so every rank reaches the commit, where rank 0 reports it (:func:`take_deferred`)
and every rank raises :class:`CheckpointSaveError` together. Writes anywhere else are left
alone.
"""

from __future__ import annotations

import errno
import functools
import re
from pathlib import Path
from typing import Any

ON_SAVE_ERROR = ("stop", "warn")

_deferred: dict[str, list[str]] = {}
_installed = False
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed; raised on every rank alike. Nothing was committed under its
    name, the staging directory is removed, earlier checkpoints are untouched.

    Attributes: ``checkpoint_dir`` (the save's target), ``reason`` (one line: the rank, the
    errno and the file where known), ``previous`` (the newest committed checkpoint, or None).
    """

    def __init__(self, checkpoint_dir: Path, reason: str, previous: Path | None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.reason = reason
        self.previous = previous
        kept = (
            f"the last committed checkpoint {previous} is intact"
            if previous is not None
            else "no earlier checkpoint was committed"
        )
        super().__init__(f"saving checkpoint {checkpoint_dir} failed: {reason}; {kept}")


def describe_error(err: BaseException) -> str:
    """One line for a failed write: ``ENOSPC [Errno 28] No space left on device: 'PATH'``.

    Follows ``__cause__`` / ``__context__`` to an ``OSError``; megatron's write failures arrive
    as text (exceptions lose their cause when pickled between ranks), whose ``[Errno N]`` is
    named too. A ``CheckpointException`` (torch DCP): the first failing rank's error, and the
    other failing ranks.
    """
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        (rank, failure), *others = sorted(failures.items())
        exc = failure[0] if isinstance(failure, tuple) else failure
        also = f" (and on rank {', '.join(str(r) for r, _ in others)})" if others else ""
        return f"rank {rank}: {describe_error(exc)}{also}"
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno is not None:
            name = errno.errorcode.get(cause.errno, str(cause.errno))
            return f"{name} {cause}"
        cause = cause.__cause__ or cause.__context__
    text = " ".join(str(err).split()) or type(err).__name__
    text = text.removeprefix("Worker failure: ")  # megatron's wrapper of a writer's error
    match = _ERRNO_TEXT.search(text)
    if match and int(match.group(1)) in errno.errorcode:
        return f"{errno.errorcode[int(match.group(1))]} {text}"
    return f"{type(err).__name__}: {text}"


def is_staging(directory: str | Path) -> bool:
    """True for a staging directory of :func:`nemo_gtp.checkpoint.io.save_checkpoint`."""
    name = Path(directory).name
    return name.startswith(".") and name.endswith(".saving")


def _defer(directory: Any, err: OSError) -> bool:
    if directory is None or not is_staging(str(directory)):
        return False
    key = str(Path(str(directory)).absolute())
    _deferred.setdefault(key, []).append(f"rank 0: {describe_error(err)}")
    return True


def take_deferred(staging: str | Path) -> list[str]:
    """The write errors recorded for ``staging`` on this rank (cleared)."""
    return _deferred.pop(str(Path(staging).absolute()), [])


def install_deferred_errors() -> None:
    """Wrap megatron's three rank-0 writes of a save (``common.pt``, DCP's ``.metadata``,
    ``metadata.json``) so an ``OSError`` into a staging directory is recorded for the commit
    instead of raised on rank 0 alone (see the module note). Idempotent."""
    global _installed
    if _installed:
        return
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    save_common = TorchCommonSaveStrategy.save_common

    @functools.wraps(save_common)
    def deferred_save_common(self: Any, common_state_dict: Any, checkpoint_dir: Any) -> None:
        try:
            save_common(self, common_state_dict, checkpoint_dir)
        except OSError as err:
            if not _defer(checkpoint_dir, err):
                raise

    finish = FileSystemWriterAsync.finish

    @functools.wraps(finish)
    def deferred_finish(self: Any, metadata: Any, results: Any) -> None:
        try:
            finish(self, metadata, results)
        except OSError as err:
            if not _defer(getattr(self, "path", None), err):
                raise

    save_config = serialization.save_config

    @functools.wraps(save_config)
    def deferred_save_config(config: Any, checkpoint_dir: Any) -> None:
        try:
            save_config(config, checkpoint_dir)
        except OSError as err:
            if not _defer(checkpoint_dir, err):
                raise

    TorchCommonSaveStrategy.save_common = deferred_save_common
    FileSystemWriterAsync.finish = deferred_finish
    serialization.save_config = deferred_save_config  # looked up by name when a save ends
    _installed = True

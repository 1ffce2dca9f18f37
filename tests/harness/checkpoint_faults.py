"""A Lightning callback that fills the disk during one checkpoint save of a recipe run, through
the recipe's ``callbacks`` section::

    +callbacks.disk.target=tests.harness.checkpoint_faults.FillDiskAtSave +callbacks.disk.save=2

At the ``save``-th save of the fit (1-based, counted in ``on_save_checkpoint``, which Lightning
calls on every rank just before the strategy saves), megatron's ``torch_dist`` data writer on
rank ``rank`` (None: every rank) stores half of its first write into a file matching ``file``
and then raises ``OSError(errno)``, as a file system that fills up mid-save does. The fault sits
in the writer module's ``open`` (looked up at call time), so the writer processes megatron forks
for the save, synchronous or asynchronous, inherit it; the other saves write normally. Only
files in a staging directory (``.<name>.saving``) are touched.
"""

from __future__ import annotations

import builtins
import errno as errno_codes
import fnmatch
import functools
import importlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class _FillingDisk:
    """A file whose first write stores half its bytes and then fails with ``code``."""

    def __init__(self, stream: Any, code: int) -> None:
        self._stream, self._code = stream, code

    def write(self, data: Any) -> int:
        part = data[: len(data) // 2] if isinstance(data, str) else memoryview(data).cast("B")
        self._stream.write(part[: len(part) // 2] if not isinstance(data, str) else part)
        self._stream.flush()
        raise OSError(self._code, os.strerror(self._code), self._stream.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _FillingDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.close()


def _filling_open(
    code: int, pattern: str, file: Any, mode: str = "r", *args: Any, **kw: Any
) -> Any:
    stream = builtins.open(file, mode, *args, **kw)
    path = Path(str(file))
    staged = path.parent.name.startswith(".") and path.parent.name.endswith(".saving")
    if "w" in mode and staged and fnmatch.fnmatch(path.name, pattern):
        return _FillingDisk(stream, code)
    return stream


WRITERS = {
    "filesystem_async": "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "core": "megatron.core.dist_checkpointing.core",  # metadata.json, rank 0
}


class FillDiskAtSave(pl.Callback):
    """See the module docstring. ``errno``: a name of the ``errno`` module (``ENOSPC``,
    ``EDQUOT``, ``EROFS``, ...); ``module``: whose ``open`` fails, a key of :data:`WRITERS`
    (``core``: megatron's ``metadata.json``, which rank 0 alone writes). ``snapshot_to``: global
    rank 0 first copies the checkpoint directory there (everything committed before the
    fault). ``warnings_to``: rank 0 appends each ``CheckpointSaveWarning`` there, one a line."""

    def __init__(
        self,
        save: int,
        rank: int | None = None,
        errno: str = "ENOSPC",
        file: str = "*.distcp",
        module: str = "filesystem_async",
        snapshot_to: str | None = None,
        warnings_to: str | None = None,
    ) -> None:
        self.save, self.rank, self.file = save, rank, file
        self.code = getattr(errno_codes, errno)
        self.writer = WRITERS[module]  # a name: NeMo serializes the callbacks with the trainer
        self.snapshot_to, self.warnings_to = snapshot_to, warnings_to
        self.saves = 0

    def setup(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.warnings_to is None or trainer.global_rank != 0:
            return
        from nemo_gtp.checkpoint.io import CheckpointSaveWarning

        shown, path = warnings.showwarning, self.warnings_to

        def record(message: Any, category: type, *rest: Any, **kw: Any) -> None:
            if issubclass(category, CheckpointSaveWarning):
                with open(path, "a") as f:
                    f.write(" ".join(str(message).split()) + "\n")
            shown(message, category, *rest, **kw)

        self._shown = shown  # put back at teardown: the next fit of the process has its own
        warnings.showwarning = record

    @property
    def module(self) -> Any:
        """The writer module whose ``open`` fails."""
        return importlib.import_module(self.writer)

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.saves += 1
        if self.saves != self.save:
            self.module.__dict__.pop("open", None)
            return
        if self.snapshot_to is not None and trainer.global_rank == 0:
            shutil.copytree(trainer.checkpoint_callback.dirpath, self.snapshot_to)
        if self.rank in (None, trainer.global_rank):
            self.module.open = functools.partial(_filling_open, self.code, self.file)

    def teardown(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.module.__dict__.pop("open", None)
        if getattr(self, "_shown", None) is not None:
            warnings.showwarning, self._shown = self._shown, None

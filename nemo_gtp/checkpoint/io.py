"""Atomic save and shape-checked load of megatron distributed checkpoints (design §1.8).

[Note: commit protocol]
Every rank writes into a staging directory next to the target (``.<name>.saving``). Only after
megatron's save returned on every rank (its last step, ``metadata.json``, is written by rank 0
after a barrier) does rank 0 commit with two atomic renames::

    <name>            -> .<name>.previous      (only if a checkpoint is already there)
    .<name>.saving    -> <name>
    rm -r .<name>.previous

An interrupted save therefore never touches ``<name>``: a crash before the commit leaves only a
stale staging directory (deleted by the next save), a crash between the two renames leaves the
last good checkpoint in ``.<name>.previous``, which :func:`resolve_checkpoint` falls back to.
The directory is assumed to be on a file system every rank sees (as megatron's save assumes).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from torch.distributed.checkpoint.api import CheckpointException

from nemo_gtp.checkpoint.layout import LAYOUT_KEY, CheckpointLayout

_COMPLETE_MARKER = "metadata.json"  # megatron writes it last


class CheckpointShapeMismatchError(ValueError):
    """The model's tensors do not have the global shapes stored in the checkpoint."""


class CheckpointIncompleteError(RuntimeError):
    """A checkpoint's data files are shorter than (or missing from) what its metadata records.

    Attributes:
        checkpoint_dir: the checkpoint's weights directory.
        damaged: ``{file name: (bytes on disk or None if missing, bytes the metadata needs)}``.
    """

    def __init__(
        self, checkpoint_dir: str | Path, damaged: dict[str, tuple[int | None, int]]
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.damaged = damaged
        lines = [
            f"  {name}: "
            + ("missing" if have is None else f"{have} bytes")
            + f", the metadata needs {need}"
            for name, (have, need) in sorted(damaged.items())
        ]
        super().__init__(
            f"checkpoint {self.checkpoint_dir} is incomplete (truncated or partly copied): "
            f"{len(damaged)} data file(s) hold less than its metadata records:\n"
            + "\n".join(lines)
            + "\nResume from another checkpoint, or copy these files again; loading with "
            "ckpt_load_strictness=False does not repair missing tensor data."
        )


def damaged_files(checkpoint_dir: str | Path) -> dict[str, tuple[int | None, int]]:
    """Data files of a ``torch_dist`` checkpoint shorter than its metadata says (local, cheap).

    Reads only torch DCP's ``.metadata`` (where each tensor's bytes lie: file, offset, length)
    and the files' sizes. Returns ``{file name: (size on disk or None, size needed)}``, empty
    for an intact checkpoint or a directory that is not a ``torch_dist`` checkpoint.

    Example::

        damaged_files("ckpts/step=10/weights")  # {"__1_0.distcp": (4096, 53248)}
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(checkpoint_dir)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception:  # noqa: BLE001 - no readable metadata: nothing to compare against
        return {}
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    damaged: dict[str, tuple[int | None, int]] = {}
    for name, need in needed.items():
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < need:
            damaged[name] = (have, need)
    return damaged


def raise_if_incomplete(checkpoint_dir: str | Path, error: BaseException) -> None:
    """Re-raise a failed load's ``error`` as :class:`CheckpointIncompleteError` when data files
    of ``checkpoint_dir`` are truncated or missing (megatron's own error names neither the
    checkpoint nor the file); return otherwise, so the caller re-raises ``error`` itself."""
    damaged = damaged_files(checkpoint_dir)
    if damaged:
        raise CheckpointIncompleteError(checkpoint_dir, damaged) from error


def staging_dir(checkpoint_dir: str | Path) -> Path:
    """Where :func:`save_checkpoint` writes before the commit."""
    final = Path(checkpoint_dir).absolute()
    return final.parent / f".{final.name}.saving"


def previous_dir(checkpoint_dir: str | Path) -> Path:
    """Where the replaced checkpoint sits for the instant between the two commit renames."""
    final = Path(checkpoint_dir).absolute()
    return final.parent / f".{final.name}.previous"


def is_complete(path: Path) -> bool:
    """True for a directory holding a finished megatron distributed checkpoint."""
    return (path / _COMPLETE_MARKER).is_file()


def resolve_checkpoint(checkpoint_dir: str | Path) -> Path:
    """The committed checkpoint at ``checkpoint_dir`` (or the one a crashed commit set aside)."""
    final = Path(checkpoint_dir).absolute()
    for candidate in (final, previous_dir(final)):
        if is_complete(candidate):
            return candidate
    raise FileNotFoundError(f"no complete checkpoint at {final}")


def save_checkpoint(
    state_dict: dict[str, Any],
    checkpoint_dir: str | Path,
    *,
    layout: CheckpointLayout | None = None,
    sharded_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_save: bool = False,
    content_metadata: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> AsyncRequest | None:
    """Save a sharded state dict in megatron's ``torch_dist`` format, committed atomically.

    Collective over the default process group. ``layout`` is stored in the common state under
    :data:`~nemo_gtp.checkpoint.layout.LAYOUT_KEY` (``state_dict`` is modified: megatron's save
    also applies its factories in place). ``content_metadata`` is megatron's (NeMo stores its
    ``sharded_state_dict_metadata`` there and reads it back before loading). ``extra_files``
    (``{name: text}``) are written by rank 0 into the staged directory before the commit, so
    they appear together with the weights or not at all (NeMo's PEFT adapter metadata). With
    ``async_save`` megatron's ``AsyncRequest`` is returned with the commit appended to its
    finalize functions (they run on every rank once the writes finished); schedule it as
    megatron's async queue or NeMo would.

    Example::

        save_checkpoint({"model": model_sd, "optimizer": optim_sd}, "ckpt/step100",
                        layout=checkpoint_layout(model_sd, groups))
    """
    final = Path(checkpoint_dir).absolute()
    staging = staging_dir(final)
    if dist.get_rank() == 0:
        if staging.exists():  # left behind by an interrupted save
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    dist.barrier()
    if layout is not None:
        state_dict[LAYOUT_KEY] = layout.to_dict()
    request = dist_checkpointing.save(
        state_dict,
        str(staging),
        sharded_strategy=sharded_strategy,
        validate_access_integrity=validate_access_integrity,
        async_sharded_save=async_save,
        content_metadata=content_metadata,
    )
    extra = dict(extra_files or {})
    if async_save:
        request.add_finalize_fn(lambda: _commit_everywhere(staging, final, extra))
        return request
    _commit_everywhere(staging, final, extra)
    return None


def _commit_everywhere(staging: Path, final: Path, extra_files: dict[str, str]) -> None:
    """Rank 0 commits once every rank is done; every rank learns the outcome."""
    dist.barrier()  # megatron's save ends with rank 0's marker; now every rank's files exist
    error = None
    if dist.get_rank() == 0:
        try:
            for name, text in extra_files.items():
                (staging / name).write_text(text)
            _commit(staging, final)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(err).__name__}: {err}"
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"committing checkpoint {final} failed on rank 0: {outcome[0]}")


def _commit(staging: Path, final: Path) -> None:
    if not is_complete(staging):
        raise RuntimeError(f"refusing to commit {staging}: it has no {_COMPLETE_MARKER}")
    previous = previous_dir(final)
    if previous.exists():
        # Either a finished commit that crashed before deleting it, or the only good copy after
        # a crash between the renames; `staging` is complete, so it supersedes both.
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path, *, strict: Any = None
) -> dict[str, Any]:
    """Load ``sharded_state_dict`` from a committed checkpoint, checking global shapes first.

    Collective. Raises :class:`CheckpointShapeMismatchError` (on every rank) naming each key
    whose global shape in the checkpoint differs from the model's, and
    :class:`CheckpointIncompleteError` naming the truncated or missing data files when the load
    fails on them. The stored layout is removed
    from the returned state dict (read it with :func:`~nemo_gtp.checkpoint.layout.read_layout`).
    """
    path = resolve_checkpoint(checkpoint_dir)
    check_global_shapes(sharded_state_dict, path)
    kwargs = {} if strict is None else {"strict": strict}
    try:
        loaded = dist_checkpointing.load(sharded_state_dict, str(path), **kwargs)
    except (Exception, CheckpointException) as err:  # the latter is no Exception
        raise_if_incomplete(path, err)
        raise
    loaded.pop(LAYOUT_KEY, None)
    return loaded


def check_global_shapes(sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
    """Raise :class:`CheckpointShapeMismatchError` if any tensor's global shape differs.

    Collective (the verdict is agreed by all ranks, so none proceeds into a load the others
    abandoned). Keys missing from the checkpoint are left to megatron's strict-load handling.
    """
    stored = {
        k: tuple(v.global_shape)
        for k, v in dist_checkpointing.load_tensors_metadata(str(checkpoint_dir)).items()
    }
    problems = {}
    for tensor in _expected_tensors(sharded_state_dict):
        have = stored.get(tensor.key)
        want = tuple(tensor.global_shape)
        if have is not None and have != want and not tensor.allow_shape_mismatch:
            problems[tensor.key] = (have, want)
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, problems)
    for other in every:
        problems.update(other)
    if problems:
        lines = [
            f"  {key}: checkpoint {have}, model {want}"
            for key, (have, want) in sorted(problems.items())
        ]
        raise CheckpointShapeMismatchError(
            f"checkpoint {checkpoint_dir} does not match the model ({len(problems)} tensors "
            "with a different global shape):\n" + "\n".join(lines)
        )


def _expected_tensors(sharded_state_dict: dict[str, Any]) -> list[ShardedTensor]:
    out = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            out.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    return out

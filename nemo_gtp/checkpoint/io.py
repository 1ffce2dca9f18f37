"""Atomic save and shape-checked load of megatron distributed checkpoints (design §1.8).

[Note: commit protocol]
Every rank writes into a staging directory next to the target (``.<name>.saving``). Only after
megatron's save returned on every rank (its last step, ``metadata.json``, is written by rank 0
after a barrier) does rank 0 commit with two atomic renames::

    <name>            -> .<name>.previous      (only if a checkpoint is already there)
    .<name>.saving    -> <name>
    rm -r .<name>.previous

Just before the renames rank 0 writes ``manifest.json`` into the staged directory: every file's
size and CRC-32, hashed by the rank that wrote it (:mod:`nemo_gtp.checkpoint.manifest`), which
:func:`load_checkpoint` checks first. A save that fails writing (a full disk) fails on every rank
alike, commits nothing and removes its staging directory ([Note: failed saves] in
:mod:`nemo_gtp.checkpoint.save_faults`).

An interrupted save therefore never touches ``<name>``: a crash before the commit leaves only a
stale staging directory (deleted by the next save), a crash between the two renames leaves the
last good checkpoint in ``.<name>.previous``, which :func:`resolve_checkpoint` falls back to.
The directory is assumed to be on a file system every rank sees (as megatron's save assumes).
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from torch.distributed.checkpoint.api import CheckpointException

from nemo_gtp.checkpoint.layout import LAYOUT_KEY, CheckpointLayout
from nemo_gtp.checkpoint.manifest import (
    CheckpointIncompleteError,
    checkpoint_files,
    checks_checksums,
    owner_rank,
    previous_committed,
    record_files,
    verify_checkpoint,
    write_manifest,
)
from nemo_gtp.checkpoint.save_faults import (
    ON_SAVE_ERROR,
    CheckpointSaveError,
    describe_error,
    install_deferred_errors,
    take_deferred,
)

_COMPLETE_MARKER = "metadata.json"  # megatron writes it last


@dataclass(frozen=True)
class CheckpointSafety:
    """What a failed save does and what a load checks (the recipe keys
    ``checkpoint.on_save_error`` and ``checkpoint.verify``).

    ``on_save_error``: ``"stop"`` raises :class:`~nemo_gtp.checkpoint.save_faults.
    CheckpointSaveError` on every rank, ``"warn"`` warns and trains on (the next save tries
    again). ``verify``: ``"sizes"`` checks each file's size against the commit's manifest (a
    ``stat`` per file), ``"checksums"`` its CRC-32 too (reads every file once, spread over the
    ranks). Example: ``CheckpointSafety(on_save_error="warn", verify="checksums")``.
    """

    on_save_error: str = "stop"
    verify: str = "sizes"

    def __post_init__(self) -> None:
        if self.on_save_error not in ON_SAVE_ERROR:
            raise ValueError(
                f"on_save_error={self.on_save_error!r}: one of {', '.join(ON_SAVE_ERROR)}"
            )
        checks_checksums(self.verify)

    @classmethod
    def from_recipe(cls, section: dict[str, Any] | None) -> CheckpointSafety:
        """A recipe's ``checkpoint`` section (None: no section) with the recipes' defaults:
        stop on a failed save, checksums verified at a resume or restore (a load reads every
        file once more; the check is spread over the ranks). Example::

            CheckpointSafety.from_recipe({"dir": "ckpts", "on_save_error": "warn"})
        """
        section = section or {}
        return cls(
            on_save_error=section.get("on_save_error", "stop"),
            verify=section.get("verify", "checksums"),
        )


class CheckpointShapeMismatchError(ValueError):
    """The model's tensors do not have the global shapes stored in the checkpoint."""


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
        previous = previous_committed(checkpoint_dir)
        raise CheckpointIncompleteError(checkpoint_dir, damaged, previous) from error


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
    on_save_error: str = "stop",
) -> AsyncRequest | None:
    """Save a sharded state dict in megatron's ``torch_dist`` format, committed atomically.

    Collective over the default process group. ``layout`` is stored in the common state under
    :data:`~nemo_gtp.checkpoint.layout.LAYOUT_KEY` (``state_dict`` is modified: megatron's save
    also applies its factories in place). ``content_metadata`` is megatron's (NeMo stores its
    ``sharded_state_dict_metadata`` there and reads it back before loading). ``extra_files``
    (``{name: text}``) are written by rank 0 into the staged directory before the commit, so
    they appear together with the weights or not at all (NeMo's PEFT adapter metadata). The
    commit writes the manifest (every file's size and CRC-32, :mod:`nemo_gtp.checkpoint.manifest`)
    that loads verify. With ``async_save`` megatron's ``AsyncRequest`` is returned with the
    commit as its finalize step (run on every rank once the writes finished); schedule it as
    megatron's async queue or NeMo would.

    A save that fails writing (a full disk: the [Note: failed saves] of
    :mod:`nemo_gtp.checkpoint.save_faults`) commits nothing and removes its staging directory;
    ``on_save_error="stop"`` raises :class:`~nemo_gtp.checkpoint.save_faults.CheckpointSaveError`
    on every rank, ``"warn"`` warns on rank 0 (:class:`CheckpointSaveWarning`) and returns (the
    next save tries again).

    Example::

        save_checkpoint({"model": model_sd, "optimizer": optim_sd}, "ckpt/step100",
                        layout=checkpoint_layout(model_sd, groups))
    """
    if on_save_error not in ON_SAVE_ERROR:
        raise ValueError(f"on_save_error={on_save_error!r}: one of {', '.join(ON_SAVE_ERROR)}")
    final = Path(checkpoint_dir).absolute()
    staging = staging_dir(final)
    install_deferred_errors()
    error = None
    if dist.get_rank() == 0:
        try:
            if staging.exists():  # left behind by an interrupted save
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        except OSError as err:
            error = f"rank 0: {describe_error(err)}"
    error = _agree(error)  # also the barrier: the directory exists before any rank writes
    if error is not None:
        return _failed(staging, final, error, on_save_error, async_save)
    if layout is not None:
        state_dict[LAYOUT_KEY] = layout.to_dict()
    try:
        request = dist_checkpointing.save(
            state_dict,
            str(staging),
            sharded_strategy=sharded_strategy,
            validate_access_integrity=validate_access_integrity,
            async_sharded_save=async_save,
            content_metadata=content_metadata,
        )
    except CheckpointException as err:  # a writer failed: megatron raised it on every rank
        return _failed(staging, final, _agree(describe_error(err)), on_save_error, async_save)
    extra = dict(extra_files or {})
    if async_save:
        steps = list(request.finalize_fns)  # DCP's metadata, then metadata.json
        request.finalize_fns[:] = [
            functools.partial(_finish_and_commit, steps, staging, final, extra, on_save_error)
        ]
        return request
    _commit_everywhere(staging, final, extra, on_save_error)
    return None


class CheckpointSaveWarning(UserWarning):
    """A failed save under ``on_save_error="warn"``: training went on without it."""


def _agree(error: str | None) -> str | None:
    """Every rank's error (or None) gathered: the first one, the same on every rank; those
    that name an errno first (megatron raises its writers' failure with the details on rank 0
    only)."""
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    found = [e for e in every if e]
    found.sort(key=lambda e: "[Errno" not in e)
    return found[0] if found else None


def _failed(
    staging: Path, final: Path, reason: str, on_save_error: str, async_save: bool = False
) -> AsyncRequest | None:
    """After an agreed failure (every rank is here): drop the staging directory, then raise or
    warn. Returns what the save returns (an empty async request for an asynchronous one)."""
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()  # no rank leaves before the staging directory is gone
    error = CheckpointSaveError(_nemo_dir(final), reason, previous_committed(final))
    if on_save_error == "stop":
        raise error
    if dist.get_rank() == 0:
        warnings.warn(
            f"{error}. Training continues (checkpoint.on_save_error=warn); the next save tries "
            "again.",
            CheckpointSaveWarning,
            stacklevel=2,
        )
    return AsyncRequest(None, (), []) if async_save else None


def _nemo_dir(final: Path) -> Path:
    """The directory a user names: NeMo's ``step=N`` for its ``step=N/weights``."""
    return final.parent if final.name == "weights" else final


def _finish_and_commit(
    steps: list, staging: Path, final: Path, extra: dict[str, str], on_save_error: str
) -> None:
    """An asynchronous save's finalize step: megatron's own, then the commit (every rank)."""
    try:
        for step in steps:
            step()
    except CheckpointException as err:  # raised on every rank (megatron broadcasts it)
        _failed(staging, final, _agree(describe_error(err)), on_save_error)
        return
    _commit_everywhere(staging, final, extra, on_save_error)


def _commit_everywhere(
    staging: Path, final: Path, extra_files: dict[str, str], on_save_error: str = "stop"
) -> None:
    """Every rank hashes the files it wrote, rank 0 writes the manifest and commits; every rank
    learns the outcome (see [Note: the manifest] of :mod:`nemo_gtp.checkpoint.manifest`)."""
    error = None
    if dist.get_rank() == 0:
        deferred = take_deferred(staging)
        try:
            if deferred:
                error = "; ".join(deferred)
            for name, text in extra_files.items():
                (staging / name).write_text(text)
        except OSError as err:
            error = f"rank 0: {describe_error(err)}"
    dist.barrier()  # megatron's save ends with rank 0's marker; now every rank's files exist
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = [n for n in checkpoint_files(staging) if owner_rank(n, world) == rank]
        share: Any = record_files(staging, mine)
    except OSError as err:
        share = f"rank {rank}: hashing {staging}: {describe_error(err)}"
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, share)
    if dist.get_rank() == 0 and error is None:
        error = next((s for s in shares if isinstance(s, str)), None)
        try:
            if error is None:
                records = {k: v for s in shares for k, v in s.items()}
                missing = sorted(set(checkpoint_files(staging)) - set(records))
                if missing:
                    raise RuntimeError(f"no rank hashed {', '.join(missing)}")
                write_manifest(staging, records)
                _commit(staging, final)
        except OSError as err:
            error = f"rank 0: {describe_error(err)}"
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = f"rank 0: {type(err).__name__}: {err}"
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        _failed(staging, final, outcome[0], on_save_error)


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
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | Path,
    *,
    strict: Any = None,
    verify: str = "sizes",
) -> dict[str, Any]:
    """Load ``sharded_state_dict`` from a committed checkpoint, checking global shapes first.

    Collective. The files are checked against the manifest of the commit first (``verify``:
    ``"sizes"`` or ``"checksums"``, :func:`~nemo_gtp.checkpoint.manifest.verify_checkpoint`:
    :class:`~nemo_gtp.checkpoint.manifest.CheckpointCorruptError` names the file). Raises
    :class:`CheckpointShapeMismatchError` (on every rank) naming each key whose global shape in
    the checkpoint differs from the model's, and :class:`CheckpointIncompleteError` naming the
    truncated or missing data files of a checkpoint without a manifest when the load fails on
    them. The stored layout is removed from the returned state dict (read it with
    :func:`~nemo_gtp.checkpoint.layout.read_layout`).
    """
    path = resolve_checkpoint(checkpoint_dir)
    verify_checkpoint(path, checksums=checks_checksums(verify), shared=True)
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

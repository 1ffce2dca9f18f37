"""Distributed checkpoints of GTP models: layout-independent, atomic, inspectable (§1.8, §3.3).

Format level (megatron ``dist_checkpointing`` objects; no model knowledge):

- :mod:`~nemo_gtp.checkpoint.pieces`: :class:`RowMap`, a local tensor (a GTP shard, a flat
  optimizer slice) described as pieces of the unpadded global; :mod:`~nemo_gtp.checkpoint.boxes`
  cuts flat ranges into rectangles.
- :mod:`~nemo_gtp.checkpoint.io`: :func:`save_checkpoint` (staging dir + commit rename) and
  :func:`load_checkpoint` (global shapes checked first, :class:`CheckpointShapeMismatchError`;
  truncated data files named by :class:`CheckpointIncompleteError`); :class:`CheckpointSafety`.
- :mod:`~nemo_gtp.checkpoint.manifest`: the commit's per-file sizes and CRC-32, verified before
  a load (:class:`CheckpointCorruptError` names the file).
- :mod:`~nemo_gtp.checkpoint.save_faults`: a failed save fails on every rank alike
  (:class:`CheckpointSaveError`).
- :mod:`~nemo_gtp.checkpoint.optimizer`: distributed-optimizer format choice and load helpers.
- :mod:`~nemo_gtp.checkpoint.layout`: :class:`CheckpointLayout`, stored in the common state.
- ``python -m nemo_gtp.checkpoint.show <dir>``: print layout, keys and global shapes.

The model side (which entries are GTP shards, replica ids) is
:mod:`nemo_gtp.integrations.megatron.checkpoint`.
"""

from nemo_gtp.checkpoint.io import (
    CheckpointIncompleteError,
    CheckpointSafety,
    CheckpointShapeMismatchError,
    check_global_shapes,
    damaged_files,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from nemo_gtp.checkpoint.layout import LAYOUT_KEY, CheckpointLayout, read_layout
from nemo_gtp.checkpoint.manifest import CheckpointCorruptError, verify_checkpoint
from nemo_gtp.checkpoint.optimizer import (
    DEFAULT_SHARDING_TYPE,
    allocate_state,
    load_optimizer_state,
    optimizer_sharded_state_dict,
)
from nemo_gtp.checkpoint.pieces import RowMap, RowSegment
from nemo_gtp.checkpoint.save_faults import CheckpointSaveError

__all__ = [
    "DEFAULT_SHARDING_TYPE",
    "LAYOUT_KEY",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "CheckpointLayout",
    "CheckpointSafety",
    "CheckpointSaveError",
    "CheckpointShapeMismatchError",
    "RowMap",
    "RowSegment",
    "allocate_state",
    "check_global_shapes",
    "damaged_files",
    "load_checkpoint",
    "load_optimizer_state",
    "optimizer_sharded_state_dict",
    "read_layout",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

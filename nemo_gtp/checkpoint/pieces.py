"""A local tensor described to DCP as rectangular pieces of its *unpadded* global (design §3.3).

[Note: why the unpadded global]
Megatron-LM describes a GTP weight by its padded global plus ``allow_shape_mismatch``. With TP > 1
that global is not the model's weight: every TP rank pads its own slice at the tail, so pad rows
sit *between* TP slices and a run without GTP (no pad) or with another TP size reads shifted rows.
Here every local tensor is mapped row by row onto the global the model has without GTP (megatron's
own key, shape and offsets), and pad rows are simply not described. Consequences:

- a checkpoint's tensors do not depend on TP, GTP, DP or ``pad_for_alignment``: any layout loads
  any other, and runs without GTP read GTP checkpoints (and vice versa) with megatron's own
  sharded state dict for the weights;
- no ``allow_shape_mismatch`` is needed, so a real model-shape mismatch still fails loudly;
- the price is uneven chunks (the last GTP shards hold fewer real rows, or none), which megatron
  0.15 on torch >= 2.6 supports (``axis_fragmentations=None``; DCP validates coverage at save).

A flat range (the distributed optimizer's slice of a param) is cut into boxes
(:mod:`nemo_gtp.checkpoint.boxes`), each box split at segment boundaries and clipped at the pad.
On load the pieces are merged back into the local tensor's shape with zeros in the pad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedTensor,
    ShardedTensorFactory,
)

from nemo_gtp.checkpoint.boxes import flat_range_boxes


@dataclass(frozen=True)
class RowSegment:
    """TP-local rows ``[local_start, local_stop)`` stored contiguously in one global tensor.

    A plain weight has one segment; megatron's SwiGLU ``linear_fc1`` has two (gate rows and up
    rows go to different halves of the global).
    """

    local_start: int
    local_stop: int
    key_suffix: str
    """Appended to the key (megatron's ``singleton_local_shards`` SwiGLU uses ``_w``/``_v``)."""
    global_shape: tuple[int, ...]
    """Global shape, prepended axes (e.g. megatron's layer axis) included."""
    global_offset: tuple[int, ...]
    """Global index of TP-local row ``local_start`` (element 0 of every other axis)."""


@dataclass(frozen=True)
class RowMap:
    """Where every row of a local tensor lives in the checkpoint.

    Example (GTP rank 1 of 2 holding rows 48..95 of a 72-row TP-local weight padded to 96)::

        RowMap(local_shape=(48, 64), first_row=48,
               segments=(RowSegment(0, 72, "", (72, 64), (0, 0)),))
    """

    local_shape: tuple[int, ...]
    """Shape of the local tensor (for a GTP shard: ``(padded_dim0 / GTP, ...)``)."""
    first_row: int
    """TP-local row of local row 0 (``gtp_rank * shard_dim0``; 0 without GTP)."""
    segments: tuple[RowSegment, ...]
    """Cover the TP-local logical rows; rows past the last segment are pad."""
    allow_shape_mismatch: bool = False

    def __post_init__(self) -> None:
        rows = 0
        for seg in self.segments:
            if seg.local_start != rows or seg.local_stop <= seg.local_start:
                raise ValueError(f"row segments must tile [0, rows) in order: {self.segments}")
            rows = seg.local_stop

    def factory(self, key: str, data: torch.Tensor, replica_id: ReplicaId) -> ShardedTensorFactory:
        """A factory for ``data`` megatron's optimizers can re-key, re-target and flatten.

        The factory's ``data`` is ``data`` itself, so megatron's optimizers still find a param's
        entry by identity (``fully_sharded_model_space``, ``fully_reshardable`` and the
        non-distributed optimizers ``replace`` key, data, replica_id and flattened_range).
        """
        return ShardedTensorFactory(key, data, self._build, _merge, replica_id)

    def _build(
        self, key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: slice | None
    ) -> dict:
        if flattened_range is None:
            start, stop = 0, math.prod(self.local_shape)
            flat = data.detach().reshape(-1)  # a view for the (contiguous) params and states
        else:
            start, stop = flattened_range.start, flattened_range.stop
            flat = data.detach()
        pieces, entries = {}, []
        for box in flat_range_boxes(self.local_shape, start, stop):
            row = self.first_row + box.offset[0]
            for seg in self.segments:
                lo, hi = max(row, seg.local_start), min(row + box.shape[0], seg.local_stop)
                if lo >= hi:
                    continue
                shape = (hi - lo, *box.shape[1:])
                begin = box.flat_start + (lo - row) * box.row_numel
                prepend = len(seg.global_shape) - len(shape)
                offset = list(seg.global_offset)
                offset[prepend] += lo - seg.local_start
                for axis in range(1, len(shape)):
                    offset[prepend + axis] += box.offset[axis]
                # Prepended axes are folded into the piece (size-1 dims) rather than declared
                # with prepend_axis_num: megatron's chunked (uneven) DCP path needs that, and the
                # stored chunks are identical to megatron's regular ones.
                local = (1,) * prepend + shape
                name = str(len(pieces))
                pieces[name] = ShardedTensor(
                    key + seg.key_suffix,
                    flat[begin : begin + math.prod(shape)].view(local),
                    flat.dtype,
                    local,
                    seg.global_shape,
                    tuple(offset),
                    None,
                    replica_id,
                    allow_shape_mismatch=self.allow_shape_mismatch,
                )
                entries.append((name, begin, math.prod(shape)))
        if not pieces:
            pieces["placeholder"] = self._placeholder(key, flat, replica_id)
        out_shape = self.local_shape if flattened_range is None else (stop - start,)
        return {"pieces": pieces, "plan": LocalNonpersistentObject((out_shape, entries))}

    def _placeholder(self, key: str, flat: torch.Tensor, replica_id: ReplicaId) -> ShardedTensor:
        """A one-element, never-written stand-in for a range that is all pad.

        megatron's load merge needs every factory to produce at least one loaded tensor; a
        non-main replica_id keeps it out of the checkpoint, and the merge ignores it.
        """
        seg = self.segments[0]
        ones = (1,) * len(seg.global_shape)
        rid = (1, *replica_id) if isinstance(replica_id, tuple) else (1, replica_id)
        return ShardedTensor(
            key + seg.key_suffix,
            torch.zeros(ones, dtype=flat.dtype, device=flat.device),
            flat.dtype,
            ones,
            seg.global_shape,
            (0,) * len(ones),
            None,
            rid,
            allow_shape_mismatch=self.allow_shape_mismatch,
        )


def _merge(loaded: dict) -> torch.Tensor:
    """Inverse of :meth:`RowMap._build`: the local tensor, zeros in the pad."""
    out_shape, entries = loaded["plan"]
    pieces = loaded["pieces"]
    some = next(iter(pieces.values()))
    out = torch.zeros(math.prod(out_shape), dtype=some.dtype, device=some.device)
    for name, begin, numel in entries:
        out[begin : begin + numel] = pieces[name].reshape(-1)
    return out.view(out_shape)

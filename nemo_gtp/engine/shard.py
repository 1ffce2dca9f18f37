"""``ShardSpec``: how a TP-local weight is cut along dim 0 over the GTP group (design §1.3, §1.4).

The geometry every other engine module shares (the param, the FP8 shards, the runtime's
buffers): which rows a rank holds, how many pad rows the tail carries, and which of a shard's
rows hold weight. Pure data and torch slicing, no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ShardSpec:
    """How a TP-local weight is cut along dim 0 over the GTP group (design §1.3, §1.4).

    Example::

        spec = ShardSpec.for_weight((72, 64), gtp_size=2, gtp_rank=1, pad_for_alignment=16)
        spec.padded_dim0, spec.shard_dim0, spec.pad_length   # (96, 48, 24)
    """

    logical_shape: tuple[int, ...]
    gtp_size: int
    gtp_rank: int
    padded_dim0: int

    @classmethod
    def for_weight(
        cls,
        shape: tuple[int, ...] | torch.Size,
        gtp_size: int,
        gtp_rank: int,
        pad_for_alignment: int,
    ) -> ShardSpec:
        """Spec for a TP-local weight of ``shape``, padding dim 0 to ``pad * gtp`` rows."""
        if len(shape) < 1 or shape[0] < 1:
            raise ValueError(f"cannot GTP-shard a weight of shape {tuple(shape)}")
        unit = pad_for_alignment * gtp_size
        padded = math.ceil(shape[0] / unit) * unit
        return cls(tuple(shape), gtp_size, gtp_rank, padded)

    @property
    def shard_dim0(self) -> int:
        """Rows of every rank's shard (pad included)."""
        return self.padded_dim0 // self.gtp_size

    @property
    def pad_length(self) -> int:
        """Zero rows appended at the tail of the TP-local weight."""
        return self.padded_dim0 - self.logical_shape[0]

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of this rank's shard."""
        return (self.shard_dim0, *self.logical_shape[1:])

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """Shape of the all-gathered (padded) weight and of the wgrad scratch."""
        return (self.padded_dim0, *self.logical_shape[1:])

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard of the TP-local ``full`` weight (a new tensor)."""
        if tuple(full.shape) != self.logical_shape:
            raise ValueError(
                f"weight shape {tuple(full.shape)} does not match spec {self.logical_shape}"
            )
        padded = F.pad(full.detach(), (0, 0) * (full.dim() - 1) + (0, self.pad_length))
        start = self.gtp_rank * self.shard_dim0
        return padded[start : start + self.shard_dim0].clone()

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The logical (unpadded) view of a gathered weight or wgrad scratch: ``gathered``
        itself when nothing is padded (no view op on the per-weight hot path)."""
        if self.padded_dim0 == self.logical_shape[0]:
            return gathered
        return gathered[: self.logical_shape[0]]


def real_rows(spec: ShardSpec | None, rows: int) -> int:
    """Rows of a ``rows``-row shard that hold weight: the rest are the tail pad of design §1.3
    (all ``rows`` without a spec, e.g. a full-tensor reference).

    Example::

        spec = ShardSpec.for_weight((72, 64), gtp_size=2, gtp_rank=1, pad_for_alignment=16)
        real_rows(spec, spec.shard_dim0)   # 24: rows 48..71 of the weight, then 24 pad rows
    """
    if spec is None:
        return rows
    start = spec.gtp_rank * spec.shard_dim0
    return max(0, min(rows, spec.logical_shape[0] - start))

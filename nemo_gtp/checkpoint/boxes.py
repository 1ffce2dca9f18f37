"""Cut a flat element range of an N-D tensor into rectangular boxes (design §3.3 "Optimizer state").

megatron's distributed optimizer hands every rank a *flat* range of each parameter (its slice of
the DDP bucket), which in general starts and ends mid-row. DCP stores rectangular chunks, so a
flat range is described as at most ``2·ndim − 1`` boxes: a partial leading row, a block of whole
rows, a partial trailing row (recursively along the trailing axes). Every box is one contiguous
run of the flat order, which is what lets a box's data be a plain view of the flat buffer.

Example::

    flat_range_boxes((4, 5), 3, 17)
    # [Box(offset=(0, 3), shape=(1, 2), flat_start=0),
    #  Box(offset=(1, 0), shape=(2, 5), flat_start=2),
    #  Box(offset=(3, 0), shape=(1, 2), flat_start=12)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor that is also one contiguous run of its flat order."""

    offset: tuple[int, ...]
    """Index of the box's first element in the tensor."""
    shape: tuple[int, ...]
    """Extent along every axis."""
    flat_start: int
    """Position of the box's first element, relative to the start of the flat range."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per index of axis 0 (a sub-range of axis 0 is again one contiguous run)."""
        return math.prod(self.shape[1:])


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes tiling flat elements ``[start, stop)`` of a row-major tensor of ``shape``, in order."""
    if not shape or not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {tuple(shape)}")
    boxes, flat = [], 0
    for offset, extent in _cut(tuple(shape), start, stop, ()):
        boxes.append(Box(offset, extent, flat))
        flat += math.prod(extent)
    return boxes


def _cut(
    shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offset, shape) of the boxes of ``[start, stop)`` in the sub-tensor at index ``prefix``."""
    if start == stop:
        return []
    if len(shape) == 1:
        return [(prefix + (start,), (1,) * len(prefix) + (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = -(-start // inner), stop // inner  # the whole rows are [first, last)
    if first > last:  # inside a single row
        row = start // inner
        return _cut(shape[1:], start - row * inner, stop - row * inner, prefix + (row,))
    out = []
    if start < first * inner:  # partial leading row
        out += _cut(shape[1:], start - (first - 1) * inner, inner, prefix + (first - 1,))
    if last > first:
        ones = (1,) * len(prefix)
        out.append((prefix + (first,) + (0,) * (len(shape) - 1), (*ones, last - first, *shape[1:])))
    if stop > last * inner:  # partial trailing row
        out += _cut(shape[1:], 0, stop - last * inner, prefix + (last,))
    return out

"""The consumer's own quantization of a training-dtype protocol gather, redone for its backward
(design §1.3 "Consumer-quantized backward").

A consumer that quantizes the full weight it is handed in its forward (TransformerEngine under FP8
autocast, whenever the runtime gathers the training dtype: delayed scaling, blockwise shards that
split a tile, ``GTPConfig.fp8_gather=False``, ...) keeps that quantized weight for its backward
GEMMs when the weight is its own. A GTP weight is gathered again for the backward instead, and the
consumer's backward may then need the same quantized form, which it does not make itself (TE
multiplies a training-dtype weight with an FP8 gradient in its dgrad GEMM and fails). The runtime
therefore asks the consumer, at each forward protocol consume in the training dtype, for a *note*
per weight (how its forward quantizes, e.g. its quantizer and that forward's scale), keeps it on the
param, and at the backward consume hands the re-gathered weight and its note back to the consumer,
whose result is what the backward GEMMs receive.

The consumer is abstract here (pure torch); TE's lives in ``nemo_gtp.integrations``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from nemo_gtp.engine.param import GTPShardedParam


class ConsumerQuantize(Protocol):
    """What a runtime asks the consumer that quantizes its training-dtype gathers (set as
    ``GTPRuntime.consumer_quantize``; design §1.3 "Consumer-quantized backward").

    ``forward_notes`` is asked at every forward protocol consume gathered in the training dtype
    (whatever the grad mode), once per weight group, with the group's members in order (a
    group of one for an ungrouped weight): one note per member, or ``None`` when this forward
    does not quantize (e.g. outside FP8 autocast), in which case the backward gets the training
    dtype as before. ``backward(param, note, full)`` turns the backward gather ``full`` of a
    weight whose forward left a note into what the backward GEMMs receive.

    Example (the pure-torch consumer shape of the tests)::

        class Rounding:
            def forward_notes(self, members): return [8.0] * len(members)   # a scale each
            def backward(self, param, note, full): return (full * note).round() / note

        runtime.consumer_quantize = Rounding()
    """

    def forward_notes(self, members: tuple[GTPShardedParam, ...]) -> Sequence[Any] | None:
        """One note per member for its backward consume; None: this forward does not quantize."""

    def backward(self, param: GTPShardedParam, note: Any, full: torch.Tensor) -> torch.Tensor:
        """What the backward GEMMs receive for ``full``, ``param`` gathered again."""

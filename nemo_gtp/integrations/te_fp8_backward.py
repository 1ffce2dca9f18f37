"""TransformerEngine's FP8 backward for GTP weights gathered in the training dtype (design §1.3
"Consumer-quantized backward").

Under FP8 autocast, a TE ``Linear`` / ``LayerNormLinear`` / ``GroupedLinear`` whose weight is a
:class:`GTPShardedParam` gathered in the training dtype (every FP8 case but the FP8 gather:
delayed scaling, megatron's default ``fp8_recipe``; MXFP8; blockwise where a shard's rows are
not whole 128-row tiles; ``GTPConfig.fp8_gather`` off) quantizes the gathered weight in its
forward with the module's weight quantizer, but does not keep the result for a distributed
weight, and its backward uses what ``materialize_group_for_backward`` returns as is.
``LayerNormLinear`` and ``GroupedLinear`` then run the dgrad GEMM with a bf16 weight against an
FP8 grad output, which cuBLAS refuses;
``Linear`` quantizes again with the module's quantizer, whose delayed-scaling scale TE has
already updated at the autocast exit (no longer the forward's).

:class:`TEWeightQuantize` is the runtime's ``ConsumerQuantize`` for them. At each forward
consume it notes whether the module runs in FP8 (``module.fp8``, set by TE before the
autograd forward) and with which weight quantizers (``module._get_weight_quantizers()``, the
ones TE's forward quantizes with, one per weight of a ``GroupedLinear``); for delayed scaling
(TE's ``Float8Quantizer``) it also copies that forward's scale into the weight's own buffer.
The backward consume quantizes the gathered weight with them, row- and column-wise as TE
quantizes a weight of its own (its per-tensor FP8 cast cannot write the column-wise copy
alone), and hands TE the column-wise usage only (what the dgrad GEMM reads: on Hopper the
transpose; the row-wise data is dropped at once), row-wise too when the recipe's
``backward_override`` dequantizes the weight. The result equals the column-wise part of what
TE saves for a weight of its own: current-scaling, blockwise and MXFP8 quantization is a
function of the full weight, and delayed scaling uses the forward's scale, with a scratch amax
(the module's amax history is not written by the backward).

Limitations: the quantizer allocates the quantized tensor at every backward consume (as TE's
own re-quantize does); a captured CUDA graph replays from the graph's private pool, but the
buffers are not the runtime's stable ones. A weight's note is that of its latest forward: with
several forward passes in flight before their backwards (pipeline schedules), delayed scaling
quantizes with the latest forward's scale; with TE's weight caching across microbatches
(``is_first_microbatch``) the forward of a later microbatch reuses the first one's FP8 weight
while the backward uses the scale of its own forward. TE's debug quantizers are not handled.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from nemo_gtp.engine.param import GTPShardedParam


class TEWeightState:
    """What :class:`TEWeightQuantize` keeps on one TE weight (``param.gtp_state.consumer``).

    - ``module``: the TE module, weakly (asked for its FP8 state and weight quantizers);
    - ``quantizer``: the module's weight quantizer of the weight's last FP8 forward;
    - ``rowwise``: whether the backward needs the row-wise data too;
    - ``delayed``: under delayed scaling, the backward's quantizer over this weight's copy of the
      forward's scale and a scratch amax (made once per module quantizer); else None.
    """

    __slots__ = ("module", "quantizer", "rowwise", "delayed")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        self.quantizer: Any = None
        self.rowwise = False
        self.delayed: Any = None


def attach_te_weight_states(module: torch.nn.Module) -> int:
    """Give every GTP weight of TE ``module`` its :class:`TEWeightState`; returns how many.

    Example::

        attach_te_weight_states(layer.self_attention.linear_qkv)   # 1 (a GroupedLinear: N)
    """
    count = 0
    for param in module._parameters.values():
        if isinstance(param, GTPShardedParam):
            param.gtp_state.consumer = TEWeightState(module)
            count += 1
    return count


class TEWeightQuantize:
    """The runtime's ``ConsumerQuantize`` for TE linears (module docstring).

    ``delayed_quantizer`` is TE's delayed-scaling quantizer class (``Float8Quantizer``, imported
    when not given; the CPU tests pass a stand-in with its constructor and attributes).

    Example::

        runtime.consumer_quantize = TEWeightQuantize()
        with te.autocast(recipe=DelayedScaling()):
            loss = model(x).sum()
        loss.backward()            # TE's dgrad GEMMs get FP8 weights, the forward's scale
    """

    def __init__(self, delayed_quantizer: type | None = None) -> None:
        if delayed_quantizer is None:
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

            delayed_quantizer = Float8Quantizer
        self._delayed = delayed_quantizer

    def forward_notes(self, members: tuple[GTPShardedParam, ...]) -> Sequence[Any] | None:
        """The members' states, noted with this forward's quantizers; None outside FP8."""
        leader = members[0].gtp_state.consumer
        module = leader.module() if leader is not None else None
        if module is None or not module.fp8:
            return None
        quantizers = module._get_weight_quantizers()
        recipe = module.fp8_meta.get("recipe")
        rowwise = getattr(recipe, "backward_override", None) is not None
        notes = []
        for member, quantizer in zip(members, quantizers):
            state = member.gtp_state.consumer
            if quantizer is None or state is None:
                return None
            notes.append(self._note(state, quantizer, rowwise))
        return notes

    def _note(self, state: TEWeightState, quantizer: Any, rowwise: bool) -> TEWeightState:
        if isinstance(quantizer, self._delayed):
            delayed = state.delayed
            if delayed is None or state.quantizer is not quantizer:
                with torch.inference_mode(False):  # outlives an evaluation that made it
                    delayed = state.delayed = self._delayed(
                        torch.empty_like(quantizer.scale),
                        torch.zeros_like(quantizer.amax),
                        quantizer.dtype,
                    )
                delayed.internal = quantizer.internal
            # The scale this forward quantizes with; TE updates the module's at autocast exit.
            delayed.scale.copy_(quantizer.scale)
        else:
            state.delayed = None
        state.quantizer, state.rowwise = quantizer, rowwise
        return state

    def backward(self, param: GTPShardedParam, note: TEWeightState, full: torch.Tensor) -> Any:
        """``full`` quantized as its forward was, with the usages TE's backward GEMMs read."""
        quantizer = note.delayed if note.delayed is not None else note.quantizer
        usage = (quantizer.rowwise_usage, quantizer.columnwise_usage)
        # Both usages, as TE quantizes a weight of its own (TE's per-tensor FP8 cast cannot
        # write the column-wise copy alone); the row-wise data is dropped unless read.
        quantizer.set_usage(rowwise=True, columnwise=True)
        try:
            out = quantizer(full)
        finally:
            quantizer.set_usage(rowwise=usage[0], columnwise=usage[1])
        if not note.rowwise:
            out.update_usage(rowwise_usage=False)
        return out


def install_te_weight_quantize(runtime: object) -> bool:
    """Make ``runtime`` quantize TE's backward weights as their forward did (module docstring).

    Returns False (nothing installed) when TransformerEngine cannot be imported.

    Example::

        install_te_weight_quantize(model.gtp_runtime)
    """
    try:
        consumer = TEWeightQuantize()
    except ImportError:
        return False
    runtime.consumer_quantize = consumer
    return True

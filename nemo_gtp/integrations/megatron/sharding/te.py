"""TransformerEngine linears under GTP, through TE's DistributedWeight protocol (design §1.5, §3.1).

TE (>= 2.19) stays GTP-agnostic: a TE linear whose weight is a :class:`GTPShardedParam` asks it
for the full weight before each GEMM (``materialize_group_for_forward/_backward``) and hands it
the full wgrad (``finalize_group_grads``; with ``fuse_wgrad_accumulation`` the wgrad GEMM writes
straight into ``grad_buffer()``). What this module adds around that bridge:

- which megatron TE wrappers opt in (:func:`te_parallel_linear_kinds`, and the grouped-expert
  ones :func:`te_grouped_linear_kinds`; the spec rewrite builds them pre-sharded,
  ``shard_model`` slices any built full),
- the grad mode (and GEMM row count, for ``gather_backend="auto"``) of the module call,
  recorded for the runtime, and TE's fused wgrad accumulation into the runtime's scratch
  (:func:`adopt_te_linear`, :func:`record_grad_mode`): TE
  materializes inside its autograd ``forward``, where grad mode is always off, so the runtime
  could not otherwise tell that a backward follows (the chain tail's hand-over prefetch, §1.1),
- what TE's FP8 backward of a weight gathered in the training dtype needs, on the weights
  (``nemo_gtp.integrations.te_fp8_backward``; design §1.3 "Consumer-quantized backward"),
- one warning naming the TE modules GTP leaves unsharded (:func:`warn_unsharded_te_modules`),
- TE linears built as GTP shards stay plain tensors inside TE's FP8 param init (megatron's
  ``fp8_param``): ``shard_model`` makes them GTP's own FP8 primary shards instead
  (:func:`plain_weight_init`; design §1.3 "FP8 primary weights").

TransformerEngine is never imported here unless asked (``import_te=True``) or already loaded:
without TE there can be no TE module in the model.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch

from nemo_gtp.integrations.te_fp8_backward import attach_te_weight_states
from nemo_gtp.integrations.te_grad_mode import drop_grad_mode_hooks, record_grad_mode

__all__ = [  # the grad-mode hook lives in nemo_gtp.integrations.te_grad_mode (no megatron import)
    "adopt_te_linear",
    "drop_grad_mode_hooks",
    "plain_weight_init",
    "record_grad_mode",
    "set_te_activation_dtype",
    "te_fp8_param_init",
    "te_grouped_linear_kinds",
    "te_parallel_linear_kinds",
    "warn_unsharded_te_modules",
]


def te_parallel_linear_kinds(*, import_te: bool = False) -> dict[type, bool]:
    """megatron's TE parallel-linear wrappers GTP shards, mapped to "TP splits out_features".

    Empty when TransformerEngine is not installed (or, with ``import_te=False``, not loaded).
    Base ``TELinear`` (``parallel_mode="duplicated"``) is deliberately absent: it stays full
    (design §1.5).
    """
    if not import_te and "transformer_engine" not in sys.modules:
        return {}
    try:
        from megatron.core.extensions import transformer_engine as mte
    except ImportError:
        return {}
    if not getattr(mte, "HAVE_TE", False):
        return {}
    return {
        mte.TEColumnParallelLinear: True,
        mte.TELayerNormColumnParallelLinear: True,
        mte.TERowParallelLinear: False,
    }


def te_grouped_linear_kinds(*, import_te: bool = False) -> dict[type, bool]:
    """megatron's TE grouped-expert wrappers (``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2``)
    mapped to "expert TP splits out_features"; built pre-sharded over expert GTP (design §3.1
    "Exact init"). Empty without TE, as :func:`te_parallel_linear_kinds`.
    """
    if not te_parallel_linear_kinds(import_te=import_te):
        return {}
    from megatron.core.extensions import transformer_engine as mte

    column = getattr(mte, "TEColumnParallelGroupedLinear", None)
    row = getattr(mte, "TERowParallelGroupedLinear", None)
    if not (isinstance(column, type) and isinstance(row, type)):
        return {}
    return {column: True, row: False}


def te_fp8_param_init() -> bool:
    """Whether TE's FP8 param init (``quantized_model_init``, megatron's ``fp8_param``) is on:
    a TE module built now would hold its weights as TE ``Float8Tensor``s. False without TE."""
    if "transformer_engine" not in sys.modules:
        return False
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return bool(FP8GlobalStateManager.with_fp8_parameters())


@contextlib.contextmanager
def plain_weight_init() -> Iterator[bool]:
    """Build TE linears with plain weights inside TE's FP8 param init (design §1.3 "FP8 primary
    weights"); yields whether that init was on.

    megatron builds every transformer layer inside TE's ``quantized_model_init`` when
    ``fp8_param`` is set, so a TE linear would quantize its weight into a ``Float8Tensor`` at
    construction. A linear built as its GTP shard must stay a plain training-dtype tensor: GTP
    makes it its own FP8 primary shard after ``shard_model`` registered it, with the scale of
    the full weight agreed over the GTP group (``make_fp8_primary``). A no-op when TE is not
    loaded or its FP8 param init is off.

    Example::

        with plain_weight_init():
            layer = TEColumnParallelLinear(...)   # plain weight, whatever megatron's fp8_param
    """
    if not te_fp8_param_init():
        yield False
        return
    from transformer_engine.pytorch.quantization import quantized_model_init

    with quantized_model_init(enabled=False):
        yield True


def set_te_activation_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Tell TE ``module`` its activation dtype: ``dtype``, the training dtype of its FP8
    primary GTP shard (design §1.3 "FP8 primary weights").

    Outside torch autocast TE checks, once per input dtype, that every param of the module has
    the input's dtype (``set_activation_dtype``). TE's own FP8 params pass, since a
    ``Float8Tensor`` reports its nominal dtype; an FP8 primary shard's storage dtype is float8.
    With the module's activation dtype already the training dtype TE skips that check for
    inputs of the training dtype (the shard's GEMM runs in it: TE gets the gathered weight as a
    ``Float8Tensor`` of that nominal dtype, or dequantized to it); an input of another dtype is
    still checked (and refused, as for a training-dtype weight).

    Example::

        set_te_activation_dtype(layer.linear_qkv, torch.bfloat16)
    """
    setter = getattr(module, "fast_setattr", None)  # TE's plain-attribute setter
    if setter is not None:
        setter("activation_dtype", dtype)
    else:
        module.activation_dtype = dtype


def _unsharded_te_types() -> tuple[type, ...]:
    """TE modules holding linear weights the DistributedWeight protocol does not reach."""
    if "transformer_engine" not in sys.modules:
        return ()
    import transformer_engine.pytorch as te

    types: list[type] = [te.LayerNormMLP]
    fused = getattr(
        sys.modules.get("megatron.core.extensions.transformer_engine"), "TEFusedMLP", None
    )
    if isinstance(fused, type):
        types.append(fused)
    return tuple(types)


def warn_unsharded_te_modules(model: torch.nn.Module) -> list[str]:
    """Warn once, naming every TE ``LayerNormMLP`` / op-fuser MLP that stays unsharded.

    TE's protocol is wired into ``Linear``, ``LayerNormLinear`` and ``GroupedLinear`` only; a
    ``LayerNormMLP`` keeps its fc1/fc2 weights full on every GTP peer (correct, replicated, but
    without GTP's memory saving). Returns the module names.
    """
    types = _unsharded_te_types()
    names = [name for name, m in model.named_modules() if types and isinstance(m, types)]
    if names:
        warnings.warn(
            f"GTP leaves {len(names)} TransformerEngine module(s) unsharded, since TE's "
            f"DistributedWeight protocol does not cover LayerNormMLP / fused-op MLPs: "
            f"{', '.join(names)}. Build them as TELayerNormColumnParallelLinear + "
            "TERowParallelLinear (megatron's default TE layer spec) to shard them",
            stacklevel=3,
        )
    return names


def adopt_te_linear(module: torch.nn.Module) -> None:
    """Prepare a TE linear whose weight is now a GTP shard for the protocol (design §3.1 "The
    bridge"): record its grad mode per call, keep what its FP8 backward needs on its weights
    (:func:`attach_te_weight_states`), and switch on TE's fused wgrad accumulation, so its wgrad
    GEMM writes into the runtime's reduce-scatter scratch (``grad_buffer()``) instead of a tensor
    that ``finalize_group_grads`` then copies.

    TE reads ``fuse_wgrad_accumulation`` from the module at each forward; for a distributed
    weight it never accumulates into the buffer (it overwrites), so the pooled scratch needs no
    zeroing. Example::

        adopt_te_linear(layer.self_attention.linear_qkv)
    """
    record_grad_mode(module)
    attach_te_weight_states(module)  # its FP8 backward (design §1.3 "Consumer-quantized ...")
    if hasattr(module, "fuse_wgrad_accumulation"):
        module.fuse_wgrad_accumulation = True

"""The grad mode of a TransformerEngine linear's call, recorded for GTP (design §3.1 "The bridge").

TE materializes a distributed weight inside its autograd ``forward``, where grad mode is always
off, so the runtime could not otherwise tell that a backward follows: the chain tail's hand-over
prefetch of the first backward gather (design §1.1) depends on it. :func:`record_grad_mode`
registers a forward pre-hook on the TE module that notes the grad mode on its GTP weight (a
``GroupedLinear``'s on ``weight0``, the leader TE materializes the group through), and, until
the runtime's first gather, the GEMM rows ``gather_backend="auto"`` decides on.

The hook removes itself at its first call after the chain is linked unless its weight is where
the forward chain hands over to the backward (``GTPRuntime.needs_forward_grad_mode``): anywhere
else the grad mode changes no decision, and a module without hooks is called on torch's fast
path (design §3.1 "Host cost per weight"). Pure torch: no TE or megatron import.
"""

from __future__ import annotations

import torch

from nemo_gtp.engine.param import GTPShardedParam


def _record(module: torch.nn.Module, args: tuple) -> None:
    # A GroupedLinear's leader (weights[0], design §3.4) is its first expert's weight.
    params = module._parameters
    weight = params.get("weight", params.get("weight0"))
    if not isinstance(weight, GTPShardedParam):
        return
    state = weight.gtp_state
    state.forward_grad_enabled = torch.is_grad_enabled()
    runtime = state.runtime() if state.runtime is not None else None
    if runtime is None:
        return
    if runtime.gather_backend is None:  # the rows decide gather_backend="auto" at the 1st gather
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.dim() > 0:
            # Rows of TE's GEMM; under sequence parallelism TE gathers the sequence first. A
            # GroupedLinear splits its rows over its experts' GEMMs (on average).
            tp = getattr(module, "tp_size", 1) if getattr(module, "sequence_parallel", False) else 1
            gemms = max(1, int(getattr(module, "num_gemms", 1) or 1))
            runtime.note_tokens(x.numel() // x.shape[-1] * tp // gemms)
    elif not runtime.needs_forward_grad_mode(weight):
        # Linked, and not where the forward chain hands over to the backward: the grad mode is
        # never read again for this weight. Without a hook left, torch calls the module on its
        # fast path (a module with hooks costs ~10 µs more per call; design §3.1 "Host cost").
        handle = getattr(module, "_gtp_grad_mode_hook", None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
            module._gtp_grad_mode_hook = True  # never added again


def record_grad_mode(module: torch.nn.Module) -> None:
    """Record the grad mode of each call of TE ``module`` on its GTP weight (module doc).

    Example::

        record_grad_mode(layer.self_attention.linear_qkv)   # once, after its weight is sharded
    """
    if not getattr(module, "_gtp_grad_mode_hook", None):
        module._gtp_grad_mode_hook = module.register_forward_pre_hook(_record)


def drop_grad_mode_hooks(module: torch.nn.Module) -> None:
    """Remove :func:`record_grad_mode`'s hooks under ``module`` (a layer megatron captures as a
    CUDA graph: its replay refuses modules with forward pre-hooks, and a captured layer's chain
    hands nothing over to the backward, so the grad mode is not needed there)."""
    for child in module.modules():
        handle = getattr(child, "_gtp_grad_mode_hook", None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
            child._gtp_grad_mode_hook = True  # never added again

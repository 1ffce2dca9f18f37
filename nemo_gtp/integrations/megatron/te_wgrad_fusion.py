"""TE's fused wgrad accumulation for the linears megatron's DDP owns, without apex.

megatron-core ties TE's ``fuse_wgrad_accumulation`` to ``gradient_accumulation_fusion``, which
megatron's own output layer (``ColumnParallelLinear``) refuses without apex's
``fused_weight_gradient_mlp_cuda``. Left off, every TE linear returns its wgrad as a tensor of
the weight's dtype that DDP's hook then adds into ``main_grad``: a wgrad-sized temporary and one
more kernel per weight per micro-batch (7.9 ms of a 98.5 ms step on the 1B TE recipe, one
H100), and a rounding to bf16 before the fp32 add. TE needs no apex to accumulate into
``main_grad`` from the GEMM itself; :func:`fuse_te_wgrad_accumulation` switches that on for the
TE modules whose trainable weights carry megatron's ``main_grad``. GTP's own shards are left to
GTP (``adopt_te_linear`` already writes their wgrads into the runtime's scratch), and megatron's
own linears stay unfused.
"""

from __future__ import annotations

import torch

from nemo_gtp.engine.param import is_gtp_param


def fuse_te_wgrad_accumulation(model: torch.nn.Module) -> list[str]:
    """Switch on TE's ``fuse_wgrad_accumulation`` for every TE module of ``model`` whose
    trainable parameters all have a ``main_grad`` (megatron's DDP gives them one) and none is a
    GTP shard; returns the names of the modules switched (empty: nothing to fuse).

    TE reads the flag at each forward, so call it after DDP is built and before the first
    training step (before any CUDA graph is captured). Example::

        ddp = DistributedDataParallel(config, ddp_config, model)
        fuse_te_wgrad_accumulation(ddp)  # ['module.decoder.layers.0.mlp.linear_fc1', ...]
    """
    switched = []
    for name, module in model.named_modules():
        if getattr(module, "fuse_wgrad_accumulation", True):  # not TE, or fused already
            continue
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params and all(hasattr(p, "main_grad") and not is_gtp_param(p) for p in params):
            module.fuse_wgrad_accumulation = True
            switched.append(name)
    return switched

"""GTP in NeMo's evaluation loops: validation inside fit, ``trainer.validate`` / ``test`` outside.

Forward-only passes (megatron's forward-only schedule: no backward, no ``finalize_model_grads``)
gather each GTP weight for its forward GEMM only: the layers see grad mode off, so a consume
asks for no backward hand-over (``will_backward`` False), no wgrad is made and nothing is
reduce-scattered. ``GTPDrainCallback`` drains before the loop (no training prefetch is consumed
by it) and the strategy drains after it (nothing of it is in flight when training resumes).
A first forward-only pass (a sanity check, or a ``trainer.validate`` before any fit) observes
and commits the prefetch chain like a training forward (design §3.4): the order is the same.

Outside fit, NeMo's ``MegatronStrategy.setup`` broadcasts every parameter from data-parallel
rank 0 over megatron's data-parallel group (no DDP wrapper has synchronized them). With GTP that
group is DP x GTP: the broadcast would hand every GTP peer rank 0's shard. The strategy keeps
the shards (:func:`keep_shards`, right after the model transform shards them) and afterwards
puts them back and broadcasts them over the replicate group, DP without GTP
(:meth:`KeptShards.restore`), which is what NeMo's broadcast means for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_gtp.engine import GTPShardedParam, is_gtp_param


@dataclass
class KeptShards:
    """Copies of a model's GTP shards, taken before NeMo's non-fit parameter broadcast."""

    params: list[GTPShardedParam]
    copies: list[torch.Tensor]

    def restore(self, replicate: dist.ProcessGroup) -> None:
        """Put every shard back, then broadcast it from the replicate group's first rank
        (collective over ``replicate``; call on every rank)."""
        src = dist.get_global_rank(replicate, 0)
        with torch.no_grad():
            for param, copy in zip(self.params, self.copies, strict=True):
                param.data.copy_(copy)
                if dist.get_world_size(replicate) > 1:
                    dist.broadcast(param.data, src=src, group=replicate)
        self.params, self.copies = [], []


def keep_shards(modules: Iterable[torch.nn.Module]) -> KeptShards:
    """Copy every GTP shard of ``modules`` (each parameter once).

    Example::

        kept = keep_shards(megatron_parallel)   # after sharding, before NeMo's broadcast
        ...                                     # MegatronStrategy.setup broadcasts over DP x GTP
        kept.restore(groups.replicate)
    """
    params: dict[int, GTPShardedParam] = {}
    for module in modules:
        for param in module.parameters():
            if is_gtp_param(param):
                params.setdefault(id(param), param)
    kept = list(params.values())
    return KeptShards(kept, [p.detach().clone() for p in kept])

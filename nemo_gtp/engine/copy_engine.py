"""SM-free all-gather: copy-engine pulls of peers' shards from symmetric memory (issue 5).

NCCL's all-gather kernels run on SMs and compete with the GEMMs they are meant to hide behind.
Weights change only at the optimizer step, so every GTP shard of a runtime is mirrored once per
step into one ``torch.distributed._symmetric_memory`` buffer; a gather is then ``g - 1``
device-to-device copies of the peers' mirrors (CUDA copy engines over NVLink, no SMs) on a side
stream, plus the local shard.

[Note: mirror refresh protocol]
The mirror is stale after every optimizer step. Two signals say so: the runtime's ``drain()``
(the fence every step passes before the optimizer runs) calls :meth:`mark_stale`, and a param's
autograd version counter moves when an optimizer writes it in place. The version counter alone
is not enough: megatron's mixed-precision optimizers write the bf16 params through ``.data``
(``model_param.data.copy_(main_param)``), which bumps no version counter. The first gather after
either signal refreshes the whole mirror, on the current stream: (1) join the side stream (my
pulls of the old mirrors are done), (2) device barrier "everyone finished reading", (3) copy
every shard into the mirror, (4) device barrier "every mirror is current". Every GTP peer drains
and updates its shards in the same step, so all peers take the refresh at the same gather.
Cost: one extra shard-sized copy of the weights per rank (1/GTP of the model) and two device
barriers per step.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nemo_gtp.engine.collectives import CommHandle

_ALIGN = 256


def copy_engine_available(group: dist.ProcessGroup, device: torch.device) -> bool:
    """This rank's half of the check: CUDA, NCCL and symmetric memory importable.

    Whether every peer is on this host is settled by :func:`agree_on_copy_engine`.
    """
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def host_id() -> int:
    """A 63-bit id of this host (equal on every process of one machine)."""
    digest = hashlib.sha1(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def decide_copy_engine(
    hosts: Sequence[int], tokens: Sequence[int], *, required: bool, min_tokens: int
) -> bool:
    """The ``gather_backend`` choice from every GTP peer's (host id, tokens per GEMM).

    ``required`` (``"copy_engine"``) raises when the peers span hosts; ``"auto"`` picks the copy
    engine only on one host and when the smallest token count reaches ``min_tokens``.

    Example::

        decide_copy_engine([7, 7], [8192, 8192], required=False, min_tokens=4096)  # True
    """
    one_host = len(set(hosts)) == 1
    if required:
        if not one_host:
            raise RuntimeError(
                "GTPConfig.gather_backend='copy_engine' needs every GTP peer on one host "
                f"(symmetric memory), but the GTP group spans {len(set(hosts))} hosts: use "
                "gather_backend='nccl' or 'auto'"
            )
        return True
    return one_host and min(tokens) >= min_tokens


def agree_on_copy_engine(
    group: dist.ProcessGroup, device: torch.device, tokens: int, *, required: bool,
    min_tokens: int,
) -> bool:
    """Collective over ``group``: every peer gets the same :func:`decide_copy_engine` answer.

    Called once, at a runtime's first gather (every peer reaches it at the same point), and
    only where :func:`copy_engine_available` holds, i.e. on NCCL: one tiny all-gather and a host
    sync, outside the steady state.
    """
    mine = torch.tensor([host_id(), tokens], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size(group), 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    hosts, counts = zip(*everyone.tolist())
    return decide_copy_engine(hosts, counts, required=required, min_tokens=min_tokens)


class _EventWork:
    """A dist.Work stand-in: waiting makes the current stream wait on a recorded event."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class SymmetricShardMirror:
    """Mirrors of every shard of one runtime in one symmetric-memory buffer; pulls on a side stream.

    Example::

        mirror = SymmetricShardMirror(runtime.params, runtime.group)
        handle = mirror.gather(buffer, param)   # async; handle.wait() orders the consumer
    """

    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if not params:
            raise ValueError("SymmetricShardMirror needs at least one param")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        device = params[0].device
        offsets, total = {}, 0
        for param in params:
            offsets[id(param)] = total
            nbytes = param.numel() * param.element_size()
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self._buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, group)
        self._params = list(params)
        self._local: dict[int, torch.Tensor] = {}
        self._peers: dict[int, list[torch.Tensor]] = {}
        for param in params:
            offset = offsets[id(param)]
            assert offset % param.element_size() == 0
            views = [
                self._handle.get_buffer(
                    peer, tuple(param.shape), param.dtype,
                    storage_offset=offset // param.element_size(),
                )
                for peer in range(self.size)
            ]
            self._peers[id(param)] = views
            self._local[id(param)] = views[self.rank]
        self._versions: dict[int, int] = {id(p): -1 for p in params}
        self._stale = True
        self.stream = torch.cuda.Stream(device=device)
        self._device_index = device.index if device.index is not None else (
            torch.cuda.current_device())
        self.refreshes = 0

    def mark_stale(self) -> None:
        """The weights may have changed (optimizer step, load): the next gather refreshes."""
        self._stale = True

    def _refresh_if_stale(self, param: torch.Tensor) -> None:
        if not self._stale and param._version == self._versions[id(param)]:
            return
        current = torch.cuda.current_stream(self._device_index)
        current.wait_stream(self.stream)
        self._handle.barrier(channel=0)
        torch._foreach_copy_([self._local[id(p)] for p in self._params],
                             [p.detach() for p in self._params])
        for p in self._params:
            self._versions[id(p)] = p._version
        self._stale = False
        self._handle.barrier(channel=1)
        self.refreshes += 1

    def close(self) -> None:
        """Collective: wait until no peer still pulls from this mirror, then let it be freed."""
        torch.cuda.current_stream().wait_stream(self.stream)
        self._handle.barrier(channel=0)
        torch.cuda.current_stream().synchronize()
        self._peers.clear()
        self._local.clear()

    def gather(self, output: torch.Tensor, param: torch.Tensor) -> CommHandle:
        """Pull every peer's mirror of ``param`` into ``output`` (rank order along dim 0)."""
        self._refresh_if_stale(param)
        current = torch.cuda.current_stream(self._device_index)
        # The output buffer's previous readers and the refresh are enqueued before the pulls.
        self.stream.wait_stream(current)
        rows = param.shape[0]
        # set_stream rather than the torch.cuda.stream() context: this runs 2x per weight per
        # step, and small steps are host-bound (bench host profile).
        torch.cuda.set_stream(self.stream)
        try:
            for peer, source in enumerate(self._peers[id(param)]):
                target = output[peer * rows : (peer + 1) * rows]
                target.copy_(param.detach() if peer == self.rank else source, non_blocking=True)
        finally:
            torch.cuda.set_stream(current)
        return CommHandle(_EventWork(self.stream.record_event()))

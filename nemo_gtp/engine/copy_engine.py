"""SM-free all-gather: copy-engine pulls of peers' shards from symmetric memory (design §3.1
"Overlap design").

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
                "gather_backend='process_group' or 'auto'"
            )
        return True
    return one_host and min(tokens) >= min_tokens


def agree_on_copy_engine(
    group: dist.ProcessGroup,
    device: torch.device,
    tokens: int,
    *,
    required: bool,
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


class CudaStreamOps:
    """The few stream/event operations of a copy-engine gather, at C++ cost.

    ``torch.cuda.current_stream()`` and ``Stream.wait_stream`` build Python objects and new
    events on every call; a gather needs four such operations per weight, twice per step. Here
    the current stream is looked up by id in a small cache of ``Stream`` objects and events are
    recorded / waited on through the event base class (no device context, no allocation).
    """

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._get_current = torch._C._cuda_getCurrentStream
        self._set_current = torch._C._cuda_setStream
        self.record = torch._C._CudaEventBase.record  # (event, stream)
        self.wait = torch._C._CudaEventBase.wait  # (event, stream): stream waits for event

    def current(self) -> torch.cuda.Stream:
        """The current stream of this device (a cached ``Stream`` object)."""
        stream_id, device_index, device_type = self._get_current(self.device_index)
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        return stream

    def make_current(self, stream: torch.cuda.Stream) -> None:
        """``torch.cuda.set_stream(stream)`` without the wrapper."""
        self._set_current(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )


class EventWork:
    """A ``dist.Work`` stand-in for one gather slot: waiting makes the current stream wait on
    the slot's (reused) event, recorded after the pulls."""

    __slots__ = ("event", "ops")

    def __init__(self, ops: CudaStreamOps) -> None:
        self.ops = ops
        self.event = torch.cuda.Event()

    def wait(self) -> None:
        self.ops.wait(self.event, self.ops.current())


class SymmetricShardMirror:
    """Mirrors of every shard of one runtime in one symmetric-memory buffer; pulls on a side stream.

    Example::

        mirror = SymmetricShardMirror(runtime.params, runtime.group)
        plan = mirror.pull_plan(buffer, param)        # once per (buffer, param)
        work = mirror.pull(plan, param, EventWork(mirror.ops))   # async; work.wait() orders
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
                    peer,
                    tuple(param.shape),
                    param.dtype,
                    storage_offset=offset // param.element_size(),
                )
                for peer in range(self.size)
            ]
            self._peers[id(param)] = views
            self._local[id(param)] = views[self.rank]
        self._versions: dict[int, int] = {id(p): -1 for p in params}
        self._stale = True
        self.stream = torch.cuda.Stream(device=device)
        self._device_index = (
            device.index if device.index is not None else (torch.cuda.current_device())
        )
        self.ops = CudaStreamOps(self._device_index)
        self._fence = torch.cuda.Event()  # "pulls start after what the compute stream issued"
        self.refreshes = 0

    def mark_stale(self) -> None:
        """The weights may have changed (optimizer step, load): the next gather refreshes."""
        self._stale = True

    def _refresh(self) -> None:
        current = self.ops.current()
        current.wait_stream(self.stream)
        self._handle.barrier(channel=0)
        torch._foreach_copy_(
            [self._local[id(p)] for p in self._params], [p.detach() for p in self._params]
        )
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

    def pull_plan(
        self, output: torch.Tensor, param: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(destination rows of output, source mirror)`` per GTP peer, in rank order.

        The local rows come from this rank's own mirror, which is current after the refresh.
        """
        rows = param.shape[0]
        return [
            (output[peer * rows : (peer + 1) * rows], source)
            for peer, source in enumerate(self._peers[id(param)])
        ]

    def pull(
        self, plan: list[tuple[torch.Tensor, torch.Tensor]], param: torch.Tensor, work: EventWork
    ) -> EventWork:
        """Pull every peer's mirror per ``plan`` on the side stream; ``work.wait()`` orders the
        consumer after the pulls."""
        if self._stale or param._version != self._versions[id(param)]:
            self._refresh()
        ops = self.ops
        current = ops.current()
        # The output buffer's previous readers and the refresh are enqueued before the pulls.
        ops.record(self._fence, current)
        ops.wait(self._fence, self.stream)
        ops.make_current(self.stream)
        try:
            for target, source in plan:
                target.copy_(source, non_blocking=True)
        finally:
            ops.make_current(current)
        ops.record(work.event, self.stream)
        return work

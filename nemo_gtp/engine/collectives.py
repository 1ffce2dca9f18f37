"""The GTP collectives: weight all-gather and wgrad reduce-scatter (design §1.1, §2.5).

One code path for gloo (CPU) and NCCL (CUDA): ``torch.distributed`` ops issued with
``async_op=True`` run on the backend's own thread (gloo) or stream (NCCL) and overlap the
caller's compute until :meth:`CommHandle.wait`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases (the GPU machine's
# 2.11) only have the old names. Same semantics either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13): one flat gather of
every rank's tensor into ``out`` along dim 0 (e.g. the sequence gather of ``engine.linear``)."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13): sum over the
group, this rank's dim-0 slice into ``out``."""


class CommHandle:
    """An issued collective; :meth:`wait` completes it and runs its epilogue once.

    Example::

        handle = reduce_scatter_wgrad(out, wgrad, group, async_op=True, fp32_recv=recv)
        ...            # overlapped compute
        handle.wait()  # out holds this rank's slice of the sum (the epilogue's FP32 sum ran)
    """

    __slots__ = ("_work", "_epilogue", "done")

    def __init__(self, work: dist.Work | None, epilogue: Callable[[], None] | None = None) -> None:
        self._work = work
        self._epilogue = epilogue
        self.done = False

    def wait(self) -> None:
        """Block until the collective completed (on CUDA: make the current stream wait)."""
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self.done = True


def reduce_scatter_wgrad(
    output: torch.Tensor,
    scratch: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool,
    fp32_recv: torch.Tensor | None = None,
    average: bool = False,
) -> CommHandle:
    """Sum ``scratch`` over ``group`` and leave this rank's dim-0 slice in ``output``.

    With ``fp32_recv`` (a buffer shaped like ``scratch``) the sum is the FP32-accumulation
    variant (§2.5): an all-to-all moves every peer's slice here, then one local FP32 sum and a
    single downcast replace the ring's per-hop roundings. Same bytes on the wire.
    ``average`` divides by the group size inside the collective (NCCL's AVG).
    """
    if fp32_recv is None:
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = reduce_scatter_single(output, scratch, op=op, group=group, async_op=async_op)
        return CommHandle(work if async_op else None)
    size = dist.get_world_size(group)
    work = dist.all_to_all_single(fp32_recv, scratch, group=group, async_op=async_op)

    def accumulate() -> None:
        peers = fp32_recv.view(size, *output.shape)
        output.copy_(peers.sum(dim=0, dtype=torch.float32))

    handle = CommHandle(work if async_op else None, accumulate)
    if not async_op:
        handle.wait()
    return handle


class GroupCollectives:
    """The GTP collectives of one process group, issued straight on the ``ProcessGroup``.

    ``torch.distributed``'s Python wrappers re-validate tensors, look up the group and build an
    options object on every call: tens of microseconds per collective, paid ~3 times per weight
    per step (forward gather, backward gather, wgrad reduce-scatter), which made small steps
    host-bound. Here the bound C++ methods and their options are resolved once; each call is one
    C++ dispatch returning the backend's ``Work``. Inputs must be contiguous (GTP shards and
    pooled buffers are). Works for NCCL and gloo.

    Example::

        ops = GroupCollectives(groups.gtp)
        work = ops.all_gather(gathered, shard)      # async; work.wait() completes it
        work = ops.reduce_scatter(shard_out, wgrad, average=False)
        work = ops.all_gather_coalesced([full_a, full_b], [shard_a, shard_b])
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        # torch >= 2.13 names them all_gather_single / reduce_scatter_single.
        self._all_gather = getattr(group, "all_gather_single", None) or group._allgather_base
        self._reduce_scatter = (
            getattr(group, "reduce_scatter_single", None) or group._reduce_scatter_base
        )
        self._all_gather_coalesced = group.allgather_into_tensor_coalesced
        self._reduce_scatter_coalesced = group.reduce_scatter_tensor_coalesced
        self._ag_options = c10d.AllgatherOptions()
        self._rs_options = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            options = c10d.ReduceScatterOptions()
            options.reduceOp = op
            self._rs_options[op == dist.ReduceOp.AVG] = options
        for options in (self._ag_options, *self._rs_options.values()):
            if hasattr(options, "asyncOp"):
                options.asyncOp = True

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> dist.Work:
        """Async all-gather of every rank's dim-0 ``shard`` into ``output`` (rank order)."""
        return self._all_gather(output, shard, self._ag_options)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, *, average: bool
    ) -> dist.Work:
        """Async reduce-scatter (SUM, or the backend's AVG) of ``full`` into ``output``."""
        return self._reduce_scatter(output, full, self._rs_options[average])

    def all_gather_coalesced(
        self, outputs: list[torch.Tensor], shards: list[torch.Tensor]
    ) -> dist.Work:
        """:meth:`all_gather` of several tensors as one collective (one NCCL group launch)."""
        return self._all_gather_coalesced(outputs, shards, self._ag_options)

    def reduce_scatter_coalesced(
        self, outputs: list[torch.Tensor], fulls: list[torch.Tensor], *, average: bool
    ) -> dist.Work:
        """:meth:`reduce_scatter` of several tensors as one collective."""
        return self._reduce_scatter_coalesced(outputs, fulls, self._rs_options[average])


FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def quiet_flight_recorder() -> str | None:
    """Turn torch's NCCL flight recorder off by default for a GTP run; returns a note to log.

    The flight recorder (on by default, 2000 entries) captures the Python stack of every NCCL
    collective. DDP issues a few bucket collectives per step; GTP issues three per weight per
    step, and under NeMo's call depth each capture cost ~150 µs of host time (2xH200, 1B
    recipe at 2k tokens per GPU: 288 collectives, ~40 ms per step, the GPU idle meanwhile;
    ``bench/results``). The recorder is a process-wide singleton that reads its size once, when
    the first NCCL process group is created: so this sets ``TORCH_FR_BUFFER_SIZE=0`` (and its
    older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``, which ProcessGroupNCCL reads itself) only if
    neither variable is set and ``torch.distributed`` is not initialized yet; otherwise it
    returns advice. An explicit setting always wins (set it to keep the recorder for hang
    debugging).

    Example::

        note = quiet_flight_recorder()   # before torch.distributed.init_process_group
    """
    if any(key in os.environ for key in FLIGHT_RECORDER_ENV):
        return None
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "nccl":
            return None
        return (
            "GTP: torch's NCCL flight recorder is on and records a Python stack for each of "
            "GTP's ~3 collectives per weight per step (host-bound small steps); set "
            "TORCH_FR_BUFFER_SIZE=0 before torch.distributed initializes to turn it off"
        )
    for key in FLIGHT_RECORDER_ENV:  # the recorder reads the new name, ProcessGroupNCCL the old
        os.environ[key] = "0"
    return (
        "GTP: TORCH_FR_BUFFER_SIZE=0 (torch's NCCL flight recorder off: it records a Python "
        "stack per collective, ~3 per weight per step under GTP); set it to keep the recorder"
    )

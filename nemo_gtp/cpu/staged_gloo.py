"""``staged_gloo``: a ``torch.distributed`` backend that runs CUDA collectives through host memory.

Two ranks on one GPU cannot share NCCL (it refuses two ranks on one device), yet the GPU-only
paths (TransformerEngine linears, FP8, grouped experts, GTP through NeMo on TE) need a real
multi-rank world to be checked for numerics. This backend gives them one: every collective
synchronizes the current CUDA stream, copies its CUDA inputs to the host, runs the matching gloo
collective there, copies the results back into the CUDA outputs (on the current stream) and
returns an already completed ``Work``. Slow and synchronous, but it moves the same values as
NCCL would, so losses and grad norms of a world on one GPU are those of the same world on
several (step times are not).

Register it once per process (importing this module does), then name it for CUDA tensors:

    import nemo_gtp.cpu.staged_gloo as staged_gloo

    dist.init_process_group(staged_gloo.BACKEND, store=store, rank=rank, world_size=2)
    # BACKEND == "cpu:gloo,cuda:staged_gloo"; dist.new_group(ranks) inherits it, so megatron's,
    # NeMo's and GTP's groups all stage.

How it plugs in (torch 2.11 and 2.13): a c10d ``Backend`` cannot be subclassed in Python, a
``ProcessGroup`` can (as torch's own threaded test group does). torch takes a ``ProcessGroup``
that a registered backend's creator returns as the whole group, so :class:`StagedGlooGroup`
receives the group's CPU tensors as well: they take the same staging path (a host copy), which
is how the CPU tests exercise it. Every method torch's Python API, megatron-core's DDP and
distributed optimizer (``_coalescing_manager``: ``allreduce_coalesced``,
``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``), GTP's
``GroupCollectives`` (bound methods called straight on the group, old and new names) and the
object collectives of ``torch.distributed.checkpoint`` call is here, under both names where
torch 2.13 renamed it. Not covered: ``ReduceOp.PREMUL_SUM`` (its factor is not readable from
Python: refused), ``recv_anysource``, and C++ callers of the single-tensor collectives that
the ``ProcessGroup`` trampoline does not forward to Python (functional collectives, DTensor).

Reductions run in the tensor's dtype on gloo, except 16-bit and 8-bit floats, which are summed
in fp32 and rounded once (for two ranks the same value as NCCL's sum); ``AVG`` is a ``SUM``
divided by the group size (gloo has no ``AVG``). Data movement (gathers, broadcasts,
all-to-all, point-to-point) moves bytes, so any dtype (FP8 included) goes through unchanged.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ProcessGroupGloo,
    ScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

BACKEND_NAME = "staged_gloo"
"""The registered backend name (``init_process_group(backend=...)`` / ``new_group``)."""

BACKEND = f"cpu:gloo,cuda:{BACKEND_NAME}"
"""The backend string for a world whose CUDA collectives stage through the host."""

_HALF_FLOATS = (torch.float16, torch.bfloat16)
# Reductions gloo runs in another dtype: (dtype sent, how the result comes back).
_REDUCE_AS = {torch.bool: torch.uint8, **{d: torch.float32 for d in _HALF_FLOATS}}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _REDUCE_AS[getattr(torch, _name)] = torch.float32


def _reduce_kind(op: object) -> object:
    """The ``RedOpType`` of a ``ReduceOp`` (options carry a ``ReduceOp``, callers either)."""
    return getattr(op, "op", op)


def _gloo_reduce_op(op: object) -> tuple[dist.ReduceOp, bool]:
    """(the op gloo runs, whether to divide by the group size after it)."""
    kind = _reduce_kind(op)
    if kind == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    if kind == getattr(dist.ReduceOp, "PREMUL_SUM", None):
        raise NotImplementedError(
            f"{BACKEND_NAME}: ReduceOp.PREMUL_SUM is not supported (its scale factor is not "
            "readable from Python); use SUM and scale the tensor, or the nccl backend"
        )
    return (op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(kind)), False


def _done(result: list[torch.Tensor]) -> dist.Work:
    """A completed ``Work``: ``wait()`` returns at once, ``get_future()`` holds ``result``."""
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _PendingWork(dist.Work):
    """A point-to-point ``Work`` finished at :meth:`wait` (a blocking send could deadlock two
    ranks that both send before they receive)."""

    def __init__(self, finish: Callable[[], None], result: list[torch.Tensor]) -> None:
        super().__init__()
        self._finish: Callable[[], None] | None = finish
        self._result = result

    def wait(self, timeout: object = None) -> bool:
        """Complete the transfer (a receive then copies into its output)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` ran."""
        return self._finish is None

    def get_future(self) -> Future:
        """A future completed with the transfer's tensors (waits for it first)."""
        self.wait()
        future: Future = Future()
        future.set_result(self._result)
        return future


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` once its producers on the current stream are done."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
        return tensor.detach().to("cpu").contiguous()
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _host_empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device="cpu")


def _from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst`` (any device, any layout) = ``host``; on CUDA a copy on the current stream, which
    returns once it is done (a pageable host source)."""
    # detach: collectives write their outputs outside autograd (torch's own groups do too).
    dst.detach().copy_(host.reshape(dst.shape))


def _as_bytes(host: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of a contiguous host tensor (gloo moves any dtype as bytes)."""
    return host.reshape(-1).view(torch.uint8)


def _bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class StagedGlooGroup(dist.ProcessGroup):
    """A process group whose collectives stage every tensor through host memory over gloo.

    Created by ``torch.distributed`` for groups on :data:`BACKEND` (see the module docstring);
    it owns one gloo group over the same ranks. Every collective runs to completion before it
    returns (so ``async_op=True`` overlaps nothing) and its ``Work`` is already completed.

    Example::

        group = dist.new_group([0, 1], backend=BACKEND)
        dist.all_reduce(cuda_tensor, op=dist.ReduceOp.AVG, group=group)  # SUM on gloo, / 2
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        # The store is this group's own (torch prefixes it with the group name and the device).
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        # One collective at a time per group: two threads of a rank (the autograd engine's and
        # the main one) must not interleave their gloo calls.
        self._lock = threading.RLock()
        self._p2p_pending: list[_PendingWork] | None = None  # inside _start_coalescing

    # ---------------------------------------------------------------- identity
    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        """The backend name, ``staged_gloo`` (``ProcessGroup.name()``)."""
        return BACKEND_NAME

    def size(self) -> int:
        """Number of ranks in the group."""
        return self._size

    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def __repr__(self) -> str:
        return f"StagedGlooGroup(rank={self._rank}, size={self._size})"

    def shutdown(self) -> None:
        """Release the gloo group (``destroy_process_group``)."""
        shutdown = getattr(self._gloo, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---------------------------------------------------------------- helpers
    def _reduce_host(self, host: torch.Tensor, op: object) -> torch.Tensor:
        """All-reduce a contiguous host tensor over gloo; returns the result (same dtype)."""
        gloo_op, divide = _gloo_reduce_op(op)
        wire = host.to(_REDUCE_AS[host.dtype]) if host.dtype in _REDUCE_AS else host
        options = AllreduceOptions()
        options.reduceOp = gloo_op
        self._gloo.allreduce([wire], options).wait()
        if divide:
            if wire.is_floating_point():
                wire.div_(self._size)
            else:
                wire.floor_divide_(self._size)
        if wire is host:
            return host
        if host.dtype == torch.bool:
            return wire != 0
        return wire.to(host.dtype)

    def _gather_bytes(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's bytes of host tensor ``shard``, concatenated in rank order."""
        data = _as_bytes(shard)
        out = torch.empty(self._size * data.numel(), dtype=torch.uint8)
        self._gloo.allgather([list(out.chunk(self._size))], [data], AllgatherOptions()).wait()
        return out

    # ---------------------------------------------------------------- all-reduce
    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None
    ) -> dist.Work:
        """All-reduce each tensor in place (``opts.reduceOp``; AVG = SUM / size)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        with self._lock:
            for tensor in tensors:
                _from_host(tensor, self._reduce_host(_to_host(tensor), op))
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """:meth:`allreduce` of several tensors (any dtypes) as one call."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        options = AllreduceOptions()
        options.reduceOp = op
        return self.allreduce(tensors, options)

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Reduce to ``opts.rootRank`` (the others' tensors are left as they were)."""
        with self._lock:
            for tensor in tensors:
                result = self._reduce_host(_to_host(tensor), opts.reduceOp)
                if self._rank == opts.rootRank:
                    _from_host(tensor, result)
        return _done(list(tensors))

    # ---------------------------------------------------------------- all-gather
    def allgather(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        """``output_lists[i][r]`` = rank r's ``inputs[i]`` (``dist.all_gather``)."""
        with self._lock:
            for outputs, tensor in zip(output_lists, inputs, strict=True):
                gathered = self._gather_bytes(_to_host(tensor))
                for out, chunk in zip(outputs, gathered.chunk(self._size), strict=True):
                    _from_host(out, chunk.view(out.dtype))
        return _done([t for outputs in output_lists for t in outputs])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` = rank r's ``inputs[i]``."""
        with self._lock:
            for i, tensor in enumerate(inputs):
                gathered = self._gather_bytes(_to_host(tensor)).chunk(self._size)
                for r in range(self._size):
                    out = output_lists[r][i]
                    _from_host(out, gathered[r].view(out.dtype))
        return _done([t for outputs in output_lists for t in outputs])

    def all_gather_single(
        self, output: torch.Tensor, shard: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        """Every rank's ``shard`` into ``output`` in rank order (``all_gather_into_tensor``)."""
        if _bytes_of(output) != self._size * _bytes_of(shard):
            raise ValueError(
                f"{BACKEND_NAME} all-gather: output has {_bytes_of(output)} bytes, expected "
                f"{self._size} x {_bytes_of(shard)} (group size x input)"
            )
        with self._lock:
            _from_host(output, self._gather_bytes(_to_host(shard)).view(output.dtype))
        return _done([output])

    _allgather_base = all_gather_single  # torch < 2.13's name

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        shards: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        """:meth:`all_gather_single` of several (output, shard) pairs, each in its own dtype."""
        with self._lock:
            for output, shard in zip(outputs, shards, strict=True):
                self.all_gather_single(output, shard)
        return _done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # torch < 2.13's name

    # ---------------------------------------------------------------- reduce-scatter
    def _reduce_scatter_flat(
        self, output: torch.Tensor, flat: torch.Tensor, offset: int, op: object
    ) -> None:
        """All-reduce host ``flat``, then copy this rank's ``output.numel()`` elements from
        ``offset`` into ``output``."""
        reduced = self._reduce_host(flat, op)
        _from_host(output, reduced[offset : offset + output.numel()])

    def reduce_scatter_single(
        self, output: torch.Tensor, full: torch.Tensor, opts: object = None
    ) -> dist.Work:
        """This rank's dim-0 slice of the reduction of ``full`` (``reduce_scatter_tensor``).
        ``output`` may alias ``full`` (megatron's buffers do): ``full`` is copied first."""
        if full.numel() != self._size * output.numel():
            raise ValueError(
                f"{BACKEND_NAME} reduce-scatter: input has {full.numel()} elements, expected "
                f"{self._size} x {output.numel()} (group size x output)"
            )
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        with self._lock:
            flat = _to_host(full).reshape(-1)
            self._reduce_scatter_flat(output, flat, self._rank * output.numel(), op)
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single  # torch < 2.13's name

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], fulls: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        """:meth:`reduce_scatter_single` of several (output, input) pairs."""
        with self._lock:
            for output, full in zip(outputs, fulls, strict=True):
                self.reduce_scatter_single(output, full, opts)
        return _done(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch < 2.13's name

    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: object = None,
    ) -> dist.Work:
        """``outputs[i]`` = the reduction over ranks of their ``input_lists[i][rank]``."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        with self._lock:
            for output, pieces in zip(outputs, input_lists, strict=True):
                flat = torch.cat([_to_host(p).reshape(-1) for p in pieces])
                offset = sum(p.numel() for p in pieces[: self._rank])
                self._reduce_scatter_flat(output, flat, offset, op)
        return _done(list(outputs))

    # ---------------------------------------------------------------- all-to-all
    def _all_to_all_bytes(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        recv = torch.empty(sum(recv_counts), dtype=torch.uint8)
        self._gloo.alltoall_base(recv, send, recv_counts, send_counts, AllToAllOptions()).wait()
        return recv

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 (torch's parameter name)
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: object = None,
    ) -> dist.Work:
        """``dist.all_to_all_single``: dim-0 splits (equal when the sizes are empty)."""
        with self._lock:
            host = _to_host(input)
            send_counts = _split_bytes(host, input_split_sizes, self._size)
            recv_counts = _split_bytes(output, output_split_sizes, self._size)
            recv = self._all_to_all_bytes(_as_bytes(host), send_counts, recv_counts)
            _from_host(output, recv.view(output.dtype))
        return _done([output])

    alltoall_base = all_to_all_single  # torch < 2.13's name

    def alltoall(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """``dist.all_to_all``: ``outputs[r]`` = rank r's ``inputs[rank]``."""
        with self._lock:
            hosts = [_as_bytes(_to_host(t)) for t in inputs]
            recv = self._all_to_all_bytes(
                torch.cat(hosts), [h.numel() for h in hosts], [_bytes_of(t) for t in outputs]
            )
            for out, piece in zip(outputs, recv.split([_bytes_of(t) for t in outputs])):
                _from_host(out, piece.view(out.dtype))
        return _done(list(outputs))

    # ---------------------------------------------------------------- broadcast, gather, scatter
    def broadcast(
        self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist.Work:
        """Every tensor from ``opts.rootRank`` (``opts.rootTensor`` indexes ``tensors``)."""
        root = opts.rootRank if opts is not None else 0
        with self._lock:
            for tensor in tensors:
                host = _to_host(tensor) if self._rank == root else _host_empty(tensor)
                options = BroadcastOptions()
                options.rootRank = root
                self._gloo.broadcast([_as_bytes(host)], options).wait()
                if self._rank != root:
                    _from_host(tensor, host)
        return _done(list(tensors))

    def gather(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: GatherOptions | None = None,
    ) -> dist.Work:
        """``dist.gather``: the root's ``output_lists[0][r]`` = rank r's ``inputs[0]``."""
        root = opts.rootRank
        with self._lock:
            host = _to_host(inputs[0])
            outs = [[_as_bytes(_host_empty(t)) for t in output_lists[0]]] if output_lists else []
            options = GatherOptions()
            options.rootRank = root
            self._gloo.gather(outs, [_as_bytes(host)], options).wait()
            if outs:
                for out, data in zip(output_lists[0], outs[0], strict=True):
                    _from_host(out, data.view(out.dtype))
        return _done([t for outputs in output_lists for t in outputs])

    def scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> dist.Work:
        """``dist.scatter``: ``outputs[0]`` = the root's ``input_lists[0][rank]``."""
        root = opts.rootRank
        with self._lock:
            recv = _host_empty(outputs[0])
            sends = [[_as_bytes(_to_host(t)) for t in input_lists[0]]] if input_lists else []
            options = ScatterOptions()
            options.rootRank = root
            self._gloo.scatter([_as_bytes(recv)], sends, options).wait()
            _from_host(outputs[0], recv)
        return _done(list(outputs))

    # ---------------------------------------------------------------- barrier, p2p, coalescing
    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:
        """Wait for every rank of the group (host-side; CUDA work is not synchronized)."""
        with self._lock:
            self._gloo.barrier(BarrierOptions()).wait()
        return _done([])

    monitored_barrier = barrier

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Post a send of ``tensors`` (staged now) to group rank ``dst``; done at ``wait()``."""
        with self._lock:
            hosts = [_as_bytes(_to_host(t)) for t in tensors]
            work = self._gloo.send(hosts, dst, tag)
        return self._pending(lambda: work.wait(), list(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Post a receive from group rank ``src``; ``wait()`` copies into ``tensors``."""
        with self._lock:
            hosts = [_host_empty(t) for t in tensors]
            work = self._gloo.recv([_as_bytes(h) for h in hosts], src, tag)

        def finish() -> None:
            work.wait()
            for tensor, host in zip(tensors, hosts, strict=True):
                _from_host(tensor, host)

        return self._pending(finish, list(tensors))

    def _pending(self, finish: Callable[[], None], result: list[torch.Tensor]) -> dist.Work:
        work = _PendingWork(finish, result)
        if self._p2p_pending is not None:
            self._p2p_pending.append(work)
        return work

    def _start_coalescing(self, device: torch.device) -> None:
        """Collect point-to-point works until :meth:`_end_coalescing` (``batch_isend_irecv``);
        collectives inside run at once."""
        self._p2p_pending = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        """One ``Work`` that completes every send / receive posted since the start."""
        pending, self._p2p_pending = self._p2p_pending or [], None

        def finish() -> None:
            for work in pending:
                work.wait()

        return _PendingWork(finish, [])


def _split_bytes(tensor: torch.Tensor, splits: Sequence[int], size: int) -> list[int]:
    """Byte counts per peer of ``tensor`` cut along dim 0 at ``splits`` (even when empty; a
    list, or the numpy array megatron's MoE dispatcher passes on GPUs)."""
    row = _bytes_of(tensor) // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0
    if splits is None or len(splits) == 0:
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise ValueError(
                f"{BACKEND_NAME} all-to-all: dim 0 ({tuple(tensor.shape)}) must split evenly "
                f"over {size} ranks when no split sizes are given"
            )
        return [_bytes_of(tensor) // size] * size
    return [int(s) * row for s in splits]


def _create(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> StagedGlooGroup:
    return StagedGlooGroup(store, rank, size, timeout)


def register() -> str:
    """Register ``staged_gloo`` with ``torch.distributed`` (idempotent); returns :data:`BACKEND`.

    Example::

        backend = register()   # "cpu:gloo,cuda:staged_gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    """
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cuda"])
    return BACKEND


def rank_backend(shared_device: bool, on_gpu: bool, local_rank: int) -> tuple[str, int | None]:
    """``(process-group backend, CUDA device index or None for the CPU)`` of a launch's local
    rank: NCCL on ``cuda:<local_rank>``, gloo on the CPU, or with ``shared_device`` this
    backend with every rank on ``cuda:0`` (on the CPU without a GPU: the one-GPU launches' CPU
    dry runs).

    Example::

        rank_backend(True, True, 1)    # ("cpu:gloo,cuda:staged_gloo", 0)
        rank_backend(False, True, 1)   # ("nccl", 1)
    """
    if shared_device:
        return BACKEND, 0 if on_gpu else None
    return ("nccl", local_rank) if on_gpu else ("gloo", None)


def world_on_gpu(backend: str | None = None) -> bool:
    """Whether a world on ``backend`` (default: the default group's) computes on CUDA: NCCL, or
    this backend where CUDA is present (ranks sharing a GPU). Plain gloo, and this backend on a
    CPU-only torch (the CPU dry runs of the one-GPU launches), compute on the CPU.

    Example::

        device = f"cuda:{torch.cuda.current_device()}" if world_on_gpu() else "cpu"
    """
    backend = dist.get_backend() if backend is None else backend
    return backend == "nccl" or (BACKEND_NAME in backend and torch.cuda.is_available())


register()

"""``GTPRuntime``: the one object per model that drives every GTP weight (seed §1.1, §3.1, §3.4).

It owns what the seed keeps in process-global state — chain cursors and link tables, the
gathered-weight cache, the wgrad pool, the pending reduce-scatters, statistics — so several GTP
models can live (and die) in one process without ever linking to each other (the §3.4 hazard
table, designed away). Params refer back to it weakly; the model holds it strongly.

[Note: lifecycle of one weight in one step]
1. forward ``materialize(FWD)``: wait the prefetched gather (or gather synchronously on the cold
   start / chain head), then issue the async gather of ``next_w`` *before* the GEMM runs.
2. forward GEMM, then ``release(FWD)``: the buffer returns to the cache.
3. backward ``materialize(BWD)``: as 1, prefetching ``prev_w``; dgrad GEMM; ``release(BWD)``.
4. wgrad GEMM into pooled scratch; ``reduce_scatter_wgrad``: pre-scale, issue the async
   reduce-scatter, then finalize every earlier one (one-step deferral): wait, add into
   ``main_grad``, fire DDP's grad-ready hook. The chain head reduces synchronously.
5. ``drain()`` (the fence before anything reads ``main_grad``): finalize what is still pending
   and complete any unconsumed prefetch.

Correctness never depends on the observed order: a weight whose gather was not prefetched is
gathered synchronously, and a prefetch whose buffer is still held is skipped.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter, deque
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from nemo_gtp.engine.buffers import BufferKey, GTPWeightCache, WgradPool
from nemo_gtp.engine.collectives import all_gather_shard, reduce_scatter_wgrad
from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.copy_engine import (
    SymmetricShardMirror,
    agree_on_copy_engine,
    copy_engine_available,
)
from nemo_gtp.engine.param import (
    Direction,
    GatherState,
    GTPShardedParam,
    ReduceScatterState,
    ShardSpec,
    carry_param_attributes,
)
from nemo_gtp.engine.timing import ExposedWaitTimer


class ChainId(enum.Enum):
    """Prefetch chains; ``prev_w``/``next_w`` only ever link params of the same chain (§1.2)."""

    UNGRAPHED = "ungraphed"
    """Weights that run eagerly (every weight until CUDA-graph capture is wired in)."""
    GRAPHED = "graphed"
    """Weights inside captured CUDA graphs; never linked to eager weights (§1.2)."""
    EXPERT_FC1 = "grouped_fc1_ungraphed"
    """Routed-expert fc1 weights, one block ahead (§3.4 grouped-expert chains; reserved)."""
    EXPERT_FC2 = "grouped_fc2_ungraphed"
    """Routed-expert fc2 weights, one block ahead (§3.4 grouped-expert chains; reserved)."""


class GatherBackend(enum.Enum):
    """How a runtime all-gathers its shards (``GTPConfig.gather_backend`` once resolved)."""

    NCCL = "nccl"
    """``torch.distributed`` all-gather: NCCL kernels on SMs (gloo threads on CPU)."""
    COPY_ENGINE = "copy_engine"
    """Copy-engine pulls of the peers' shards from symmetric memory (no SMs; one host, CUDA)."""


class ChainPhase(enum.Enum):
    """Lifecycle of one chain's link table (seed §3.4 "Linking (lazily, on the first forward)")."""

    OBSERVING = "observing"
    """First forward: consumes are appended to the order; nothing is prefetched yet."""
    LINKED = "linked"
    """The order is committed; every consume prefetches its neighbour."""


class Chain:
    """The observed forward order of one chain's weights (a doubly linked list by position)."""

    def __init__(self, chain_id: ChainId) -> None:
        self.chain_id = chain_id
        self.phase = ChainPhase.OBSERVING
        self.order: list[GTPShardedParam] = []
        self._position: dict[int, int] = {}

    def observe(self, param: GTPShardedParam, direction: Direction) -> bool:
        """Record a consume during the first pass; True when this consume committed the order.

        The pass ends at the first backward consume, or when a forward consume repeats a weight
        (the next forward started, or a weight is used twice: either way the order is known).
        """
        if direction is Direction.BWD or id(param) in self._position:
            self.phase = ChainPhase.LINKED
            self._assign_parities()
            return True
        self._position[id(param)] = len(self.order)
        self.order.append(param)
        return False

    def _assign_parities(self) -> None:
        """Chain neighbours with the same buffer shape get alternating parities (seed §3.1).

        One-step-ahead keeps a weight and its neighbour live at once; different parities give
        them different cache keys, so a prefetch never lands in the buffer its neighbour's GEMM
        reads.
        """
        previous = None
        for param in self.order:
            same = previous is not None and (
                previous.gtp_spec.gathered_shape == param.gtp_spec.gathered_shape
                and previous.dtype == param.dtype
            )
            param.gtp_state.parity = 1 - previous.gtp_state.parity if same else 0
            previous = param

    def neighbour(self, param: GTPShardedParam, direction: Direction) -> GTPShardedParam | None:
        """``next_w`` (forward) or ``prev_w`` (backward) of ``param``; None at the ends."""
        pos = self._position.get(id(param))
        if pos is None:
            return None
        pos += 1 if direction is Direction.FWD else -1
        return self.order[pos] if 0 <= pos < len(self.order) else None

    def is_head(self, param: GTPShardedParam) -> bool:
        """True for the first weight in forward order (the last reduce-scatter of a backward)."""
        return bool(self.order) and self.order[0] is param


@dataclass
class CommStats:
    """Counters of GTP communication since the last :meth:`reset` (read by the metrics callback)."""

    gathers: int = 0
    prefetches: int = 0
    prefetch_skipped: int = 0
    gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    fallback_allocations: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, 0)


class GTPRuntime:
    """Per-model driver of every :class:`GTPShardedParam` (seed §1.1, §3.1).

    Example::

        runtime = GTPRuntime(groups.gtp, GTPConfig())
        shard = runtime.shard_parameter(linear, "weight", name="fc1.weight")
        ...                      # forward / backward through nemo_gtp.engine.linear
        runtime.drain()          # before the optimizer reads main_grad
    """

    def __init__(
        self, group: dist.ProcessGroup, config: GTPConfig | None = None, *, name: str = "model"
    ) -> None:
        self.group = group
        self.config = config or GTPConfig()
        self.name = name
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._nccl = dist.get_backend(group) == "nccl"
        self._mirror: SymmetricShardMirror | None = None
        self.gather_backend: GatherBackend | None = None  # resolved at the first gather
        self.tokens_per_gemm = 0
        # A second communicator over the same ranks for the reduce-scatters (see GTPConfig).
        self._rs_group = group
        if self.config.separate_reduce_scatter_group and self.size > 1:
            self._rs_group = dist.new_group(
                dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                use_local_synchronization=True,
            )
        self.params: list[GTPShardedParam] = []
        self.chains = {cid: Chain(cid) for cid in ChainId}
        self.weight_cache = GTPWeightCache()
        self.wgrad_pool = WgradPool()
        self.stats = CommStats()
        self.wait_timer = ExposedWaitTimer()
        self.trace: list[tuple[str, str, str]] | None = None
        self.live_buffers: Counter[ChainId] = Counter()
        self.max_live_buffers: Counter[ChainId] = Counter()
        self._pending_rs: deque[GTPShardedParam] = deque()
        # TE protocol: the last weight materialized per (chain, direction), released at the next.
        self._protocol_last: dict[tuple[ChainId, Direction], GTPShardedParam] = {}
        self._protocol_scratch: dict[int, torch.Tensor] = {}

    # ----------------------------------------------------------------- construction
    def shard_parameter(
        self, module: torch.nn.Module, attr: str, name: str,
        chain_id: ChainId = ChainId.UNGRAPHED,
    ) -> GTPShardedParam:
        """Replace ``module.<attr>`` by its GTP shard, registered with this runtime.

        The full TP-local weight is sliced (so the GTP model starts identical to the non-GTP
        one); every attribute megatron set on the old param (``tensor_model_parallel``,
        ``partition_dim``, ...) is carried over.
        """
        old = getattr(module, attr)
        spec = ShardSpec.for_weight(old.shape, self.size, self.rank, self.config.pad_for_alignment)
        param = GTPShardedParam(spec.shard(old), old.requires_grad, spec=spec)
        carry_param_attributes(old, param)
        module._parameters[attr] = param
        self.register(param, name, chain_id)
        return param

    def register(
        self, param: GTPShardedParam, name: str, chain_id: ChainId = ChainId.UNGRAPHED
    ) -> None:
        """Make this runtime the owner of ``param`` (joins ``chain_id`` on its first consume)."""
        state = param.gtp_state
        if state.runtime is not None and state.runtime() is not None:
            raise ValueError(f"{param!r} is already registered with a GTPRuntime")
        if param.gtp_spec.gtp_size != self.size:
            raise ValueError(
                f"{name}: shard spec is for GTP size {param.gtp_spec.gtp_size}, runtime group "
                f"has {self.size} ranks"
            )
        state.name, state.chain_id = name, chain_id
        state.runtime = weakref.ref(self)
        self.params.append(param)

    # ----------------------------------------------------------------- all-gather side
    def materialize(
        self, param: GTPShardedParam, direction: Direction, *, will_backward: bool = False
    ) -> torch.Tensor:
        """The full (unpadded) TP-local weight for a GEMM; prefetches the neighbour first.

        ``will_backward`` (forward only) lets the chain tail hand over to the backward by
        prefetching its own backward gather.
        """
        state = param.gtp_state
        chain = self.chains[state.chain_id]
        if chain.phase is ChainPhase.OBSERVING:
            chain.observe(param, direction)
        slot = state.gather[direction]
        if slot.state is GatherState.NONE:
            self._issue_gather(param, direction, async_op=False)
        if slot.state is GatherState.ASYNC_WAIT:
            self.wait_timer.timed_wait(slot.handle.wait, "gather", param.device,
                                       state.name)
            slot.state = GatherState.DATA_READY
        if self.config.weight_prefetch and chain.phase is ChainPhase.LINKED:
            self.prefetch_neighbour(param, direction, will_backward=will_backward)
        return param.gtp_spec.unpad(slot.buffer)

    def prefetch_neighbour(
        self, param: GTPShardedParam, direction: Direction, *, will_backward: bool = False
    ) -> None:
        """Issue the async gather the next consume in ``direction`` will need (seed §3.1 table)."""
        chain = self.chains[param.gtp_state.chain_id]
        neighbour = chain.neighbour(param, direction)
        if neighbour is not None:
            self._prefetch(neighbour, direction)
        elif direction is Direction.FWD and will_backward:
            self._prefetch(param, Direction.BWD)

    def release(self, param: GTPShardedParam, direction: Direction) -> None:
        """Return ``param``'s gathered buffer for ``direction`` to the cache."""
        slot = param.gtp_state.gather[direction]
        if slot.state is GatherState.NONE:
            return
        if slot.state is GatherState.ASYNC_WAIT:
            slot.handle.wait()
        self.weight_cache.release(slot.key, slot)
        self.live_buffers[param.gtp_state.chain_id] -= 1
        slot.state, slot.handle, slot.buffer, slot.key = GatherState.NONE, None, None, None

    def _prefetch(self, param: GTPShardedParam, direction: Direction) -> None:
        if param.gtp_state.gather[direction].state is GatherState.NONE:
            if self._issue_gather(param, direction, async_op=True):
                self.stats.prefetches += 1
            else:
                self.stats.prefetch_skipped += 1

    def _issue_gather(
        self, param: GTPShardedParam, direction: Direction, *, async_op: bool
    ) -> bool:
        slot = param.gtp_state.gather[direction]
        key = self._buffer_key(param, direction)
        buffer = self.weight_cache.acquire(key, slot)
        if buffer is None:
            if async_op:
                return False
            # Only reachable when the observed order mispredicts; correctness first.
            buffer = torch.empty(key.shape, dtype=key.dtype, device=key.device)
            self.stats.fallback_allocations += 1
        slot.buffer, slot.key = buffer, key
        if self._use_copy_engine(param):
            slot.handle = self._mirror.gather(buffer, param)
        else:
            slot.handle = all_gather_shard(buffer, param.data, self.group, async_op=True)
        slot.state = GatherState.ASYNC_WAIT
        chain_id = param.gtp_state.chain_id
        self.live_buffers[chain_id] += 1
        self.max_live_buffers[chain_id] = max(
            self.max_live_buffers[chain_id], self.live_buffers[chain_id]
        )
        self.stats.gathers += 1
        self.stats.gather_bytes += buffer.numel() * buffer.element_size() * (self.size - 1) // (
            self.size
        )
        self.record("ag_issue_async" if async_op else "ag_issue_sync", param, direction)
        return True

    def _use_copy_engine(self, param: GTPShardedParam) -> bool:
        if self.gather_backend is None:
            self.gather_backend = self._resolve_gather_backend(param.device)
        return self.gather_backend is GatherBackend.COPY_ENGINE

    def _resolve_gather_backend(self, device: torch.device) -> GatherBackend:
        """``GTPConfig.gather_backend`` made concrete, once, at the first gather.

        Every GTP peer reaches its first gather at the same point of the same program, so the
        agreement (and the symmetric-memory rendezvous that follows) are collective-safe here.
        """
        requested = self.config.gather_backend
        if requested == "nccl":
            return GatherBackend.NCCL
        if not copy_engine_available(self.group, device):
            if requested == "copy_engine":
                raise RuntimeError(
                    "GTPConfig.gather_backend='copy_engine' needs CUDA, NCCL and "
                    "torch.distributed._symmetric_memory: use gather_backend='nccl'"
                )
            return GatherBackend.NCCL
        if not agree_on_copy_engine(
            self.group, device, self.tokens_per_gemm, required=requested == "copy_engine",
            min_tokens=self.config.copy_engine_min_tokens,
        ):
            return GatherBackend.NCCL
        self._mirror = SymmetricShardMirror(self.params, self.group)
        return GatherBackend.COPY_ENGINE

    def note_tokens(self, tokens: int) -> None:
        """Rows of the GEMMs about to run (read by gather_backend='auto' at the first gather)."""
        self.tokens_per_gemm = tokens

    def reset_gather_backend(self) -> None:
        """Decide ``gather_backend`` again at the next gather (e.g. after a sequence-length change).

        Call on every GTP peer at the same step boundary; drains first. The next gather is then
        collective again (agreement, and the mirror's rendezvous if the copy engine is chosen).
        """
        self.drain()
        if self._mirror is not None:
            self._mirror.close()
        self.gather_backend, self._mirror = None, None

    def _buffer_key(self, param: GTPShardedParam, direction: Direction) -> BufferKey:
        state = param.gtp_state
        return BufferKey(
            param.gtp_spec.gathered_shape, param.dtype, param.device, state.chain_id.value,
            direction.value, state.parity,
        )

    def materialize_for_protocol(
        self, param: GTPShardedParam, direction: Direction
    ) -> torch.Tensor:
        """:meth:`materialize` for TE's DistributedWeight protocol (see the param's Note)."""
        key = (param.gtp_state.chain_id, direction)
        previous = self._protocol_last.pop(key, None)
        if previous is not None and previous is not param:
            self.release(previous, direction)
        will_backward = torch.is_grad_enabled() or param.gtp_state.forward_grad_enabled
        full = self.materialize(param, direction, will_backward=will_backward)
        self._protocol_last[key] = param
        # An alias of the gathered buffer carrying the param's requires_grad: TE 2.20's
        # LayerNormLinear reads requires_grad from the tensor it is handed (not from the param)
        # to decide whether to keep its input and compute the wgrad at all.
        return full.detach().requires_grad_(param.requires_grad)

    # ----------------------------------------------------------------- reduce-scatter side
    def wgrad_scratch(self, param: GTPShardedParam) -> torch.Tensor:
        """A pooled full-size wgrad buffer (dtype of ``main_grad``); pad rows already zero."""
        dtype = param.main_grad.dtype if hasattr(param, "main_grad") else param.dtype
        scratch = self.wgrad_pool.get(param.gtp_spec.gathered_shape, dtype, param.device)
        if param.gtp_spec.pad_length:
            scratch[param.gtp_spec.logical_shape[0] :].zero_()
        return scratch

    def protocol_grad_buffer(self, param: GTPShardedParam) -> torch.Tensor:
        """Logical (unpadded) view of a pooled scratch for TE's fused wgrad GEMM."""
        scratch = self._protocol_scratch.get(id(param))
        if scratch is None:
            scratch = self._protocol_scratch[id(param)] = self.wgrad_scratch(param)
        return param.gtp_spec.unpad(scratch)

    def reduce_scatter_foreign_wgrad(self, param: GTPShardedParam, wgrad: torch.Tensor) -> None:
        """Reduce-scatter a full logical-shape wgrad produced outside this runtime (e.g. TE).

        ``wgrad`` is either the view :meth:`protocol_grad_buffer` handed out (no copy) or any
        tensor of the logical shape (copied into pooled scratch, pad rows zero).
        """
        spec = param.gtp_spec
        if tuple(wgrad.shape) != spec.logical_shape:
            raise ValueError(
                f"{param.gtp_state.name}: wgrad shape {tuple(wgrad.shape)} != logical weight "
                f"shape {spec.logical_shape}"
            )
        scratch = self._protocol_scratch.pop(id(param), None)
        if scratch is None or scratch.data_ptr() != wgrad.data_ptr():
            if scratch is not None:
                self.wgrad_pool.put(scratch)
            scratch = self.wgrad_scratch(param)
            spec.unpad(scratch).copy_(wgrad)
        self.reduce_scatter_wgrad(param, scratch)

    def reduce_scatter_wgrad(self, param: GTPShardedParam, scratch: torch.Tensor) -> None:
        """Reduce-scatter ``scratch`` (from :meth:`wgrad_scratch`) into ``param``'s main_grad.

        Scaling per the seed's §3.2 table: MEAN (1/GTP pre-scale) unless
        ``calculate_per_token_loss`` or ``shard_replicated_params_over_gtp``
        (:attr:`GTPConfig.sums_over_gtp`: SUM). Async with one-step-deferred finalize, except the
        chain head (and everything when ``async_reduction`` is off), which is synchronous.
        """
        rs = param.gtp_state.reduce_scatter
        if rs.state is not ReduceScatterState.NONE:  # same weight twice in one backward
            self._finalize(param)
        spec = param.gtp_spec
        output = self.wgrad_pool.get(spec.shard_shape, scratch.dtype, scratch.device)
        recv = None
        if self.config.reduce_scatter_with_fp32_accumulation and self.size > 2:
            recv = self.wgrad_pool.get(spec.gathered_shape, scratch.dtype, scratch.device)
        # MEAN: NCCL averages inside the reduce-scatter kernel; elsewhere a 1/GTP pre-scale.
        average = not self.config.sums_over_gtp and recv is None and self._nccl
        if not self.config.sums_over_gtp and not average:
            scratch.mul_(1.0 / self.size)
        chain = self.chains[param.gtp_state.chain_id]
        sync = not self.config.async_reduction or chain.is_head(param)
        rs.handle = reduce_scatter_wgrad(
            output, scratch, self._rs_group, async_op=True, fp32_recv=recv, average=average
        )
        rs.state, rs.scratch, rs.output, rs.recv = (
            ReduceScatterState.ASYNC_WAIT, scratch, output, recv
        )
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += scratch.numel() * scratch.element_size() * (
            self.size - 1
        ) // self.size
        self.record("rs_issue_sync" if sync else "rs_issue_async", param, Direction.BWD)
        while self._pending_rs:  # the one-step-deferred finalize of the previous weight(s)
            self._finalize(self._pending_rs.popleft())
        if sync:
            self._finalize(param)
        else:
            self._pending_rs.append(param)

    def _finalize(self, param: GTPShardedParam) -> None:
        state = param.gtp_state
        rs = state.reduce_scatter
        self.wait_timer.timed_wait(rs.handle.wait, "reduce_scatter", param.device, state.name)
        rs.state = ReduceScatterState.DATA_READY
        if hasattr(param, "main_grad"):
            param.main_grad.add_(rs.output)
        elif param.grad is None:
            param.grad = rs.output.to(param.dtype, copy=True)
        else:
            param.grad.add_(rs.output)
        for buffer in (rs.scratch, rs.output, rs.recv):
            if buffer is not None:
                self.wgrad_pool.put(buffer)
        rs.state, rs.handle, rs.scratch, rs.output, rs.recv = (
            ReduceScatterState.NONE, None, None, None, None
        )
        self.record("finalize", param, Direction.BWD)
        if state.grad_ready_hook is not None:
            state.grad_ready_hook()

    # ----------------------------------------------------------------- fences
    def drain_reduce_scatters(self) -> None:
        """Finalize every pending reduce-scatter (the fence before main_grad is read)."""
        while self._pending_rs:
            self._finalize(self._pending_rs.popleft())

    def drain_gathers(self) -> None:
        """Complete and release every outstanding gather (e.g. an unconsumed prefetch)."""
        self._protocol_last.clear()
        for param in self.params:
            for direction in Direction:
                self.release(param, direction)

    def drain(self) -> None:
        """Both fences: no GTP communication is in flight afterwards.

        Also the step boundary: the optimizer may write the shards next (megatron's bf16 path
        does so through ``.data``, invisibly to version counters), so the copy-engine mirror is
        marked stale here and refreshed by the next gather.
        """
        self.drain_reduce_scatters()
        self.drain_gathers()
        if self._mirror is not None:
            self._mirror.mark_stale()

    # ----------------------------------------------------------------- introspection
    def enable_trace(self) -> list[tuple[str, str, str]]:
        """Start recording ``(event, param name, direction)`` tuples; returns the list."""
        self.trace = []
        return self.trace

    def record(self, event: str, param: GTPShardedParam, direction: Direction) -> None:
        if self.trace is not None:
            self.trace.append((event, param.gtp_state.name, direction.value))


def runtimes_of(*modules: torch.nn.Module) -> list[GTPRuntime]:
    """The live :class:`GTPRuntime` objects owning the GTP weights of ``modules`` (in order).

    Shards built pre-sharded but not yet registered (a layer spec rewritten by
    ``gtp_layer_spec``, before ``shard_model`` ran) have no runtime yet and are skipped.

    Example::

        for runtime in runtimes_of(model):
            runtime.drain()
    """
    found: dict[int, GTPRuntime] = {}
    for module in modules:
        for param in module.parameters():
            if isinstance(param, GTPShardedParam):
                ref = param.gtp_state.runtime
                runtime = ref() if ref is not None else None
                if runtime is not None:
                    found.setdefault(id(runtime), runtime)
    return list(found.values())

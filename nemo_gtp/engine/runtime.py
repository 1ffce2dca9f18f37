"""``GTPRuntime``: the one object per model that drives every GTP weight (design §1.1, §3.1, §3.4).

It owns what Megatron-LM's GTP keeps in process-global state — chain cursors and link tables, the
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

import weakref
from dataclasses import dataclass, fields

import torch

from nemo_gtp.engine.chain import Chain, ChainId, ChainPhase, WeightGroup, coalescing_units
from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.fp8_gather import FP8GatherSide
from nemo_gtp.engine.gather import GatherBackend, GatherSide
from nemo_gtp.engine.graph_segments import GraphSegments
from nemo_gtp.engine.grid import GTPGroups, WeightAxis
from nemo_gtp.engine.param import GTPShardedParam, carry_param_attributes
from nemo_gtp.engine.protocol import ProtocolSide
from nemo_gtp.engine.reduce_scatter import ReduceScatterSide
from nemo_gtp.engine.shard import ShardSpec
from nemo_gtp.engine.slots import Direction, GatherState, ReduceScatterState
from nemo_gtp.engine.timing import ExposedWaitTimer

_NONE = GatherState.NONE


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
    fp8_gathers: int = 0
    """Gathers that moved FP8 bytes (design §1.3 "FP8 gather"); counted in ``gathers`` too."""
    fp8_quantizes: int = 0
    """Refreshes of the FP8 shard copies: one amax all-reduce each (once per step)."""
    format_regathers: int = 0
    """Prefetched gathers dropped because the consume wanted the other format (FP8 vs the
    training dtype), e.g. at the edge of an FP8 region: time only, never results."""
    gather_collectives: int = 0
    """All-gather calls issued (a coalesced gather of a unit counts once; ``gathers`` counts
    weights)."""
    reduce_scatter_collectives: int = 0
    """Reduce-scatter calls issued (a unit's coalesced one counts once)."""

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, 0)


__all__ = [  # chain and gather names live in their modules; re-exported for the runtime's users
    "Chain",
    "ChainId",
    "ChainPhase",
    "CommStats",
    "GatherBackend",
    "GTPRuntime",
    "WeightGroup",
    "coalescing_units",
    "runtimes_of",
]


class GTPRuntime(GatherSide, FP8GatherSide, ProtocolSide, ReduceScatterSide, GraphSegments):
    """Per-model driver of every :class:`GTPShardedParam` (design §1.1, §3.1).

    Example::

        groups = GTPParallelDims(world_size=2, num_weight_shards=2).build()
        runtime = GTPRuntime(groups, GTPConfig())    # axis=WeightAxis.EXPERT: the EGTP group
        shard = runtime.shard_parameter(linear, "weight", name="fc1.weight")
        ...                      # forward / backward through nemo_gtp.engine.linear
        runtime.drain()          # before the optimizer reads main_grad

    [Note: the steady-state hot path]
    A step costs every weight three collectives and their waits; the Python around them is kept
    to attribute reads: slots carry their chain links, cache slot and byte counts (set when the
    chain order is committed and at the first gather), collectives go straight to the process
    group (:class:`~nemo_gtp.engine.collectives.GroupCollectives`), pooled buffers come from
    per-weight free lists, and nothing is allocated or looked up by key after the first step.

    [Note: the runtime's parts]
    One object per model owns every piece of GTP state (chains, caches, pools, pending
    collectives, statistics); its methods come from one class per concern, each in its own
    module and each setting up the state it owns (its ``setup_*`` method) from ``__init__``:
    :class:`~nemo_gtp.engine.gather.GatherSide` (consumes, prefetches, gather backends),
    :class:`~nemo_gtp.engine.fp8_gather.FP8GatherSide` (FP8 gathers and FP8 primary shards),
    :class:`~nemo_gtp.engine.protocol.ProtocolSide` (TE's DistributedWeight protocol),
    :class:`~nemo_gtp.engine.reduce_scatter.ReduceScatterSide` (reduce-scatters and their
    deferred finalize) and :class:`~nemo_gtp.engine.graph_segments.GraphSegments` (CUDA-graph
    segments, grad guard, wgrad ring). They share the runtime's attributes, so the hot path
    stays attribute reads on one object. What one part offers another is public, and each
    part's docstring lists what it offers and what it uses; a private name stays in the module
    that sets it.
    """

    def __init__(
        self,
        groups: GTPGroups,
        config: GTPConfig | None = None,
        *,
        name: str = "model",
        axis: WeightAxis = WeightAxis.DENSE,
    ) -> None:
        if not isinstance(groups, GTPGroups):
            raise TypeError(
                "GTPRuntime takes the GTPGroups it shards over (GTPParallelDims(...).build() or "
                f"initialize_gtp_parallel(...)), got {type(groups).__name__}"
            )
        self.groups = groups
        self.config = config or GTPConfig()
        self.name = name
        # The one place the weight axis enters: a routed-expert runtime (design §1.4) drives the
        # EGTP group exactly as a dense one drives the GTP group.
        self.axis = axis
        self.group, self.size, self.rank = groups.weight_axis(axis)
        self.params: list[GTPShardedParam] = []
        unit_bytes = self.config.coalesce_mb * 2**20
        self.weight_groups: list[WeightGroup] = []  # register_group's, design §3.4
        self.chains = {
            cid: Chain(cid, self.config.prefetch_depth, unit_bytes, self.weight_groups)
            for cid in ChainId
        }
        self.stats = CommStats()
        self.wait_timer = ExposedWaitTimer()
        self.trace: list[tuple[str, str, str]] | None = None
        self.builds = 0
        """Python-side chain building and binding done so far: order commits, recompute links,
        cache and pool bindings, the gather-backend decision. Constant once every weight ran a
        linked forward and backward (the state a CUDA-graph capture must start from)."""
        self.setup_gather_side()
        self.setup_fp8_gather_side()
        self.setup_reduce_scatter_side()  # collective with separate_reduce_scatter_group
        self.setup_protocol_side()
        self.setup_graph_segments()

    # ----------------------------------------------------------------- construction
    def shard_parameter(
        self,
        module: torch.nn.Module,
        attr: str,
        name: str,
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
        state.name, state.chain_id, state.chain = name, chain_id, self.chains[chain_id]
        state.runtime = weakref.ref(self)
        index = len(self.params)
        state.fwd.index = state.bwd.index = index
        self.params.append(param)

    def register_group(
        self, params: list[GTPShardedParam] | tuple[GTPShardedParam, ...], *, together: bool
    ) -> WeightGroup:
        """Make registered ``params`` one weight group: one coalescing unit of its own, so one
        collective per direction gathers them and one reduce-scatters their wgrads, a whole
        unit ahead of use on their chain (design §3.4 "Grouped-expert chains").

        ``together=True``: TransformerEngine hands the group to ``params[0]`` (its
        ``GroupedLinear``): ``materialize_group_for_forward`` / ``_backward`` of the leader
        return every member's weight and its ``finalize_group_grads`` takes every wgrad.
        Register before the group's chain is linked (before its first backward consume).

        Example::

            fc1 = [runtime.shard_parameter(grouped, f"weight{i}", f"fc1.weight{i}",
                                           ChainId.EXPERT_FC1) for i in range(grouped.num_gemms)]
            runtime.register_group(fc1, together=True)
        """
        params = tuple(params)
        if not params:
            raise ValueError("a weight group needs at least one weight")
        chain = params[0].gtp_state.chain
        for param in params:
            state = param.gtp_state
            if state.runtime is None or state.runtime() is not self:
                raise ValueError(f"{param!r} is not registered with this GTPRuntime")
            if state.group >= 0:
                raise ValueError(f"{state.name} already belongs to a weight group")
            if state.chain is not chain:
                raise ValueError(
                    f"a weight group lives on one chain: {state.name} is on "
                    f"{state.chain_id.value}, {params[0].gtp_state.name} on {chain.chain_id.value}"
                )
        if chain.phase is not ChainPhase.OBSERVING:
            raise ValueError(
                f"chain {chain.chain_id.value} is already linked: register weight groups before "
                "the first training step"
            )
        group = WeightGroup(params, together)
        for param in params:
            param.gtp_state.group = len(self.weight_groups)
        self.weight_groups.append(group)
        return group

    def group_of(self, param: GTPShardedParam) -> WeightGroup | None:
        """The :class:`WeightGroup` ``param`` belongs to, or None."""
        index = param.gtp_state.group
        return self.weight_groups[index] if index >= 0 else None

    @property
    def live_buffers(self) -> dict[ChainId, int]:
        """Gathered buffers currently held, per chain."""
        return {cid: chain.live for cid, chain in self.chains.items()}

    @property
    def max_live_buffers(self) -> dict[ChainId, int]:
        """Most gathered buffers held at once, per chain (one-step-ahead: at most 2)."""
        return {cid: chain.max_live for cid, chain in self.chains.items()}

    # ----------------------------------------------------------------- fences
    def drain(self) -> None:
        """Both fences: no GTP communication is in flight afterwards.

        Also the step boundary: the optimizer may write the shards next (megatron's bf16 path
        does so through ``.data``, invisibly to version counters), so the copy-engine mirror and
        the FP8 shard copies are marked stale here and refreshed by the next gather.
        """
        self.drain_reduce_scatters()
        self.drain_gathers()
        for chain in self.chains.values():  # a recompute order seen in this step is now known
            if chain.recompute_order and chain.recompute_phase is ChainPhase.OBSERVING:
                chain.commit_recompute()
                self.builds += 1
        if self.shard_mirror is not None:
            self.shard_mirror.mark_stale()
        self.fp8_shards.mark_stale()

    # ----------------------------------------------------------------- introspection
    def outstanding(self) -> dict[str, int]:
        """What a :meth:`drain` would still complete: ``gathers`` issued or held (either
        direction) and ``reduce_scatters`` not finalized; both 0 when nothing is in flight.

        Example::

            runtime.drain()
            assert runtime.outstanding() == {"gathers": 0, "reduce_scatters": 0}
        """
        gathers = reduce_scatters = 0
        for param in self.params:
            state = param.gtp_state
            gathers += (state.fwd.state is not _NONE) + (state.bwd.state is not _NONE)
            reduce_scatters += state.rs.state is not ReduceScatterState.NONE
        return {"gathers": gathers, "reduce_scatters": reduce_scatters}

    def enable_trace(self) -> list[tuple[str, str, str]]:
        """Start recording ``(event, param name, direction)`` tuples; returns the list."""
        self.trace = []
        return self.trace

    def record(self, event: str, param: GTPShardedParam, direction: Direction | str) -> None:
        """Append ``(event, param name, direction)`` to the trace, when tracing (direction
        ``"rc"``: a gather of the activation-recompute forward)."""
        if self.trace is not None:
            label = direction if isinstance(direction, str) else direction.value
            self.trace.append((event, param.gtp_state.name, label))


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

"""The reduce-scatter side of a :class:`~nemo_gtp.engine.runtime.GTPRuntime` (design §1.1,
§3.1, §3.2).

Mixed into ``GTPRuntime``: everything between a weight's full wgrad and its shard's
``main_grad``. The wgrad is written into pooled scratch (:meth:`ReduceScatterSide.wgrad_scratch`;
TE's fused wgrad GEMM writes :meth:`ReduceScatterSide.protocol_grad_buffer`), pre-scaled for the
MEAN of design §3.2, staged until the rest of its coalescing unit arrives, and reduce-scattered
asynchronously; the finalize (wait, add into ``main_grad``, DDP's grad-ready hook) of each
reduce-scatter runs at the next issue of its chain: the one-step deferral. A chain head
reduces synchronously, and :meth:`ReduceScatterSide.drain_reduce_scatters` is the fence before
anything reads ``main_grad``.

[Note: the finalize order] (design §3.2 ordering invariant, §3.5)
A weight's grad-ready hook fires only after its reduced shard was added into ``main_grad``
(DDP's bucket collective reads it next); a unit's adds are one multi-tensor add, then the hooks
in order. Under the grad guard of a CUDA-graph warmup the hooks stay silent and the first
finalize of each weight backs up its gradient; while a capture records its hook plan, every
finalize is noted (:class:`~nemo_gtp.engine.graph_segments.GraphSegments`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_gtp.engine.buffers import WgradPool
from nemo_gtp.engine.chain import Chain
from nemo_gtp.engine.collectives import GroupCollectives, reduce_scatter_wgrad
from nemo_gtp.engine.param import GTPShardedParam
from nemo_gtp.engine.slots import Direction, ReduceScatterState, SharedWork

__all__ = ["ReduceScatterSide"]

_BWD = Direction.BWD
_RS_NONE, _RS_STAGED = ReduceScatterState.NONE, ReduceScatterState.STAGED


class ReduceScatterSide:
    """The reduce-scatter side of a ``GTPRuntime``: wgrad scratch, the reduce-scatters and
    their one-step-deferred finalize into ``main_grad`` (design §3.1, §3.2).

    Part of the runtime, split off by concern, not a class of its own: it owns the state
    :meth:`setup_reduce_scatter_side` sets up and the per-chain staged and pending lists
    (:class:`~nemo_gtp.engine.chain.Chain`); the wgrad ring's carry and the grad guard it
    consults are the graph segments' (:class:`~nemo_gtp.engine.graph_segments.GraphSegments`).

    Offers the other parts: ``finalize_reduce_scatters``, ``flush_staged``,
    ``reduce_scatter_staged``, ``fp32_accumulation``, ``drain_reduce_scatters``,
    ``reduce_scatter_foreign_wgrad``, ``setup_reduce_scatter_side``. Uses from the other parts:
    ``ring_carry``, ``carry_staged``, ``reduce_scatter_carry``, ``guarded_grads``,
    ``back_up_grad``, ``recorded_finalizes`` (graph segments).

    Example::

        scratch = runtime.wgrad_scratch(param)      # pooled, pad rows zero
        torch.matmul(grad_out.t(), x, out=param.gtp_spec.unpad(scratch))
        runtime.reduce_scatter_wgrad(param, scratch)
        runtime.drain()                             # before the optimizer reads main_grad
    """

    def setup_reduce_scatter_side(self) -> None:
        """The reduce-scatter side's state: its communicator, the scaling of design §3.2 and the
        wgrad pool (called once, from ``GTPRuntime.__init__``). Collective when
        ``separate_reduce_scatter_group`` makes a communicator."""
        # Backends whose reduce-scatter takes ReduceOp.AVG: NCCL, and torch's fake backend (it
        # moves nothing; taking NCCL's path keeps a fake world's host cost the NCCL run's).
        self._nccl = dist.get_backend(self.group) in ("nccl", "fake")
        # A second communicator over the same ranks for the reduce-scatters (see GTPConfig).
        self._rs_group = self.group
        if self.config.separate_reduce_scatter_group and self.size > 1:
            self._rs_group = dist.new_group(
                dist.get_process_group_ranks(self.group),
                backend=dist.get_backend(self.group),
                use_local_synchronization=True,
            )
        self._rs_ops = GroupCollectives(self._rs_group)
        self.fp32_accumulation = self.config.reduce_scatter_with_fp32_accumulation and self.size > 2
        """Whether reduce-scatters receive into fp32 buffers (``GTPConfig``'s
        ``reduce_scatter_with_fp32_accumulation`` at GTP > 2): each wgrad then reduces alone,
        never staged into a unit or the wgrad ring."""
        # MEAN (design §3.2): NCCL averages inside the reduce-scatter; elsewhere (gloo, staged
        # gloo) a 1/GTP pre-scale.
        self._average_in_collective = (
            not self.config.sums_over_gtp and self._nccl and not self.fp32_accumulation
        )
        self._prescale = (
            None if self.config.sums_over_gtp or self._average_in_collective else 1.0 / self.size
        )
        self.wgrad_pool = WgradPool()

    def _bind_pools(self, param: GTPShardedParam, dtype: torch.dtype) -> None:
        self.builds += 1
        spec, rs = param.gtp_spec, param.gtp_state.rs
        rs.scratch_pool = self.wgrad_pool.free_list(
            spec.gathered_shape,
            dtype,
            param.device,
            zero_from=spec.logical_shape[0],
            ring=param.gtp_state.ring,
        )
        rs.output_pool = self.wgrad_pool.free_list(spec.shard_shape, dtype, param.device)
        rs.recv_pool = self.wgrad_pool.free_list(spec.gathered_shape, dtype, param.device)
        numel = spec.padded_dim0 * math.prod(spec.logical_shape[1:])
        rs.nbytes = numel * dtype.itemsize * (self.size - 1) // self.size

    def wgrad_scratch(self, param: GTPShardedParam) -> torch.Tensor:
        """A pooled full-size wgrad buffer (dtype of ``main_grad``); pad rows are zero."""
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            dtype = main_grad.dtype
        else:  # an FP8 primary shard's gradient is in its training dtype
            dtype = param.training_dtype
        pool = param.gtp_state.rs.scratch_pool
        if pool is None or pool.dtype is not dtype:
            self._bind_pools(param, dtype)
            pool = param.gtp_state.rs.scratch_pool
        return pool.get()

    def protocol_grad_buffer(self, param: GTPShardedParam) -> torch.Tensor:
        """Logical (unpadded) view of a pooled scratch for TE's fused wgrad GEMM."""
        state = param.gtp_state
        if state.protocol_scratch is None:
            state.protocol_scratch = self.wgrad_scratch(param)
        return param.gtp_spec.unpad(state.protocol_scratch)

    def reduce_scatter_foreign_wgrad(self, param: GTPShardedParam, wgrad: torch.Tensor) -> None:
        """Reduce-scatter a full logical-shape wgrad produced outside this runtime (e.g. TE).

        ``wgrad`` is either the view :meth:`protocol_grad_buffer` handed out (no copy) or any
        tensor of the logical shape (copied into pooled scratch, pad rows zero).
        """
        spec, state = param.gtp_spec, param.gtp_state
        if wgrad.shape != spec.logical_shape:
            raise ValueError(
                f"{state.name}: wgrad shape {tuple(wgrad.shape)} != logical weight "
                f"shape {spec.logical_shape}"
            )
        scratch, state.protocol_scratch = state.protocol_scratch, None
        if scratch is None or scratch.data_ptr() != wgrad.data_ptr():
            if scratch is not None:
                state.rs.scratch_pool.put(scratch)
            scratch = self.wgrad_scratch(param)
            spec.unpad(scratch).copy_(wgrad)
        self.reduce_scatter_wgrad(param, scratch)

    def reduce_scatter_wgrad(self, param: GTPShardedParam, scratch: torch.Tensor) -> None:
        """Reduce-scatter ``scratch`` (from :meth:`wgrad_scratch`) into ``param``'s main_grad.

        Scaling per design §3.2: MEAN (1/GTP pre-scale, or NCCL's AVG) unless
        ``calculate_per_token_loss`` or ``shard_replicated_params_over_gtp``
        (:attr:`GTPConfig.sums_over_gtp`: SUM). Async with one-step-deferred finalize, except the
        chain head (and everything when ``async_reduction`` is off), which is synchronous.
        """
        state = param.gtp_state
        rs, chain = state.rs, state.chain
        if self.ring_carry and (
            rs.state is _RS_STAGED or self.ring_carry[0].gtp_state.segment != state.segment
        ):
            self.reduce_scatter_carry()  # the next graph's first wgrad (or the same weight again)
        if rs.state is not _RS_NONE:  # same weight twice in one backward
            if rs.state is _RS_STAGED:
                self.flush_staged(chain)
            self.finalize_reduce_scatters((param,))
            chain.pending_rs[:] = [p for p in chain.pending_rs if p is not param]
        unit = state.rs_unit
        staged = chain.staged
        if staged and (unit is None or staged[0].gtp_state.rs_unit is not unit):
            self.flush_staged(chain)  # a unit whose other wgrads never came (or out of order)
        if self._prescale is not None:
            scratch.mul_(self._prescale)
        if unit is not None and not self.fp32_accumulation:
            rs.staged(scratch)
            staged.append(param)
            if len(staged) == len(unit):
                if state.ring >= 0:  # the segment's head unit: reduced in the next graph
                    self.carry_staged(chain)
                else:
                    self.flush_staged(chain)
            return
        if state.ring >= 0:
            rs.staged(scratch)
            staged.append(param)
            self.carry_staged(chain)
            return
        output = rs.output_pool.get()
        if self.fp32_accumulation:
            recv = rs.recv_pool.get()
            work = reduce_scatter_wgrad(
                output, scratch, self._rs_group, async_op=True, fp32_recv=recv
            )
        else:
            recv = None
            work = self._rs_ops.reduce_scatter(output, scratch, average=self._average_in_collective)
        self.stats.reduce_scatter_collectives += 1
        rs.issued(work, scratch, output, recv)
        self._after_reduce_scatter(
            chain, (param,), state.is_head or not self.config.async_reduction
        )

    def flush_staged(self, chain: Chain) -> None:
        """Reduce-scatter the staged wgrads of ``chain``'s unit in one collective."""
        params = tuple(chain.staged)
        chain.staged.clear()
        if params:
            self.reduce_scatter_staged(params)

    def reduce_scatter_staged(self, params: tuple[GTPShardedParam, ...]) -> None:
        """One collective over ``params``' staged wgrads (a coalescing unit, or a carry)."""
        outputs = [p.gtp_state.rs.output_pool.get() for p in params]
        scratches = [p.gtp_state.rs.scratch for p in params]
        average = self._average_in_collective
        if len(params) == 1:
            work = self._rs_ops.reduce_scatter(outputs[0], scratches[0], average=average)
        else:
            work = self._rs_ops.reduce_scatter_coalesced(outputs, scratches, average=average)
        self.stats.reduce_scatter_collectives += 1
        shared = SharedWork()
        shared.work = work
        for param, output, scratch in zip(params, outputs, scratches):
            param.gtp_state.rs.issued(shared, scratch, output, None)
        # A head reduces synchronously (nothing follows it in its chain or graph), unless it
        # is a carried head: then it is the next graph's, finalized by that graph's drain.
        sync = not self.config.async_reduction or any(
            p.gtp_state.is_head and p.gtp_state.ring < 0 for p in params
        )
        self._after_reduce_scatter(params[0].gtp_state.chain, params, sync)

    def _after_reduce_scatter(
        self, chain: Chain, params: tuple[GTPShardedParam, ...], sync: bool
    ) -> None:
        """Count and trace the reduce-scatter just issued for ``params``, finalize the previous
        one of ``chain`` (the one-step deferral), and finalize these at once when ``sync``."""
        stats = self.stats
        stats.reduce_scatters += len(params)
        for param in params:
            stats.reduce_scatter_bytes += param.gtp_state.rs.nbytes  # set with its pools
        if self.trace is not None:
            for param in params:
                self.record("rs_issue_sync" if sync else "rs_issue_async", param, _BWD)
        pending = chain.pending_rs
        if pending:  # the one-step-deferred finalize of the previous weight(s) or unit
            self.finalize_reduce_scatters(pending)
            pending.clear()
        if sync:
            self.finalize_reduce_scatters(params)
        else:
            pending.extend(params)

    def finalize_reduce_scatters(
        self, params: list[GTPShardedParam] | tuple[GTPShardedParam, ...]
    ) -> None:
        """Finalize the reduce-scatters of ``params`` (one weight, or a unit): wait, add each
        reduced shard into ``main_grad`` (one multi-tensor add for all of them: one launch per
        unit, not per weight; ``.grad`` without DDP), return the buffers, fire DDP's grad-ready
        hooks — each hook after its weight's add, none under the grad guard (design §3.5)."""
        main_grads, outputs = [], []
        timed = self.wait_timer.enabled
        guard, recording = self.guarded_grads, self.recorded_finalizes
        for param in params:
            state = param.gtp_state
            rs = state.rs
            if timed:
                self.wait_timer.timed_wait(rs.complete, "reduce_scatter", param.device, state.name)
            else:
                rs.complete()
            main_grad = getattr(param, "main_grad", None)
            if guard is not None and id(param) not in guard:
                self.back_up_grad(param, main_grad)
            if recording is not None:
                recording.append(param)
            if main_grad is not None:
                main_grads.append(main_grad)
                outputs.append(rs.output)
            elif param.grad is None:
                param.grad = rs.output.to(param.dtype, copy=True)
            else:
                param.grad.add_(rs.output)
        if len(main_grads) == 1:
            main_grads[0].add_(outputs[0])
        elif main_grads:
            torch._foreach_add_(main_grads, outputs)
        for param in params:
            state = param.gtp_state
            state.rs.finished()
            if self.trace is not None:
                self.record("finalize", param, _BWD)
            if state.grad_ready_hook is not None and guard is None:
                state.grad_ready_hook()

    def drain_reduce_scatters(self) -> None:
        """Finalize every pending reduce-scatter (the fence before main_grad is read)."""
        for chain in self.chains.values():  # ChainId order: the same on every GTP peer
            self.flush_staged(chain)
        if self.ring_carry:
            self.reduce_scatter_carry()
        for chain in self.chains.values():
            pending, chain.pending_rs = chain.pending_rs, []
            if pending:
                self.finalize_reduce_scatters(pending)

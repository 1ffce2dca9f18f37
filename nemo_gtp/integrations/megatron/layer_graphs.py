"""GTP under megatron-core's per-layer CUDA graphs (``cuda_graph_impl="local"``; design §3.5).

megatron-core 0.15's ``CudaGraphManager`` captures every transformer layer (``TransformerLayer``,
``MambaLayer``) whole, as one forward and one backward graph: the scope ``"attn"`` selects a
part of the layer only for TransformerEngine's graph helper, so under the local implementation
``"full"`` and ``"attn"`` capture the same thing. Its life cycle, and what GTP adds at each point:

==================================  ===============================================================
megatron                            GTP
==================================  ===============================================================
model built, one manager per layer  :func:`split_graph_chains`: each captured layer's GTP weights
                                    become one segment of the GRAPHED chain; the rest stay eager
step 1, eager (records the order)   the layer's forward is wrapped (:class:`LayerGraphBoundary`):
                                    its forward ends with ``end_graph_forward``, its backward with
                                    the two-stage ``end_graph_backward`` (an autograd node on the
                                    layer's input), so nothing crosses a layer boundary
``create_cudagraphs`` after the     per layer: warmup iterations (forward + backward) under
step's ``finalize_model_grads``     ``GTPRuntime.grad_guard``, then capture; nothing in flight on
                                    entry or exit of a capture (but the wgrad ring's carried head
                                    unit between backward captures), no allocation and no
                                    exposed-wait timing inside; a backward capture records the
                                    layer's manual hook plan (:class:`GTPCudaGraphRunner`)
later steps: graph replay           after each replayed backward the layer's grad-ready hooks fire
                                    (the manual hook plan, :class:`GTPCudaGraphManager`)
==================================  ===============================================================

The classes are megatron's, specialised by subclassing; an existing manager (and each runner it
creates) has its class replaced, since building a manager again would change the process's
current CUDA stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudagraphGlobalRecord

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.graph_rules import layer_graph_scope
from nemo_gtp.engine.param import GTPStateError, is_gtp_param
from nemo_gtp.engine.runtime import GTPRuntime
from nemo_gtp.integrations.megatron.graph_replay import LeanCudaGraphManager, LeanCudaGraphRunner
from nemo_gtp.integrations.te_grad_mode import drop_grad_mode_hooks

MIN_LAYER_GRAPH_WARMUP_STEPS = 2
"""Warmup iterations megatron runs per layer before capturing it (``cuda_graph_warmup_steps``):
the first binds the layer's forward buffers after the chain was linked in step 1, the second
runs the steady state once, so the capture allocates and builds nothing."""

_BOUNDARY = "_gtp_graph_boundary"


def check_layer_graph_settings(model_config: Any, gtp_config: GTPConfig, *, moe: bool) -> GTPConfig:
    """Refuse what per-layer graphs cannot capture under GTP; the config a graph can replay.

    Raised before anything is sharded, each naming the setting: routed experts (their token
    dispatch syncs with the host: not capturable), fewer than
    :data:`MIN_LAYER_GRAPH_WARMUP_STEPS` warmup iterations, and the copy-engine gather (its
    mirror refresh is decided on the host every step). ``gather_backend="auto"`` becomes
    ``"process_group"``.

    Example::

        gtp_config = check_layer_graph_settings(gpt.config, GTPConfig(), moe=False)
    """
    scope = layer_graph_scope(model_config)
    if moe:
        raise ValueError(
            f"per-layer CUDA graphs (cuda_graph_impl='local', cuda_graph_scope={scope!r}) of a "
            "GTP model with routed experts (num_moe_experts) are not supported: the experts' "
            "token dispatch is not capturable; use cuda_graph_impl='none' or a dense model"
        )
    warmup = getattr(model_config, "cuda_graph_warmup_steps", 0) or 0
    if warmup < MIN_LAYER_GRAPH_WARMUP_STEPS:
        raise ValueError(
            f"cuda_graph_warmup_steps={warmup}: GTP needs at least "
            f"{MIN_LAYER_GRAPH_WARMUP_STEPS} warmup iterations before a layer is captured "
            "(the first binds its buffers, the second runs the steady state; design §3.5)"
        )
    if gtp_config.gather_backend == "copy_engine":
        raise ValueError(
            "GTPConfig.gather_backend='copy_engine' cannot be captured in a CUDA graph: use "
            "gather_backend='process_group' (or 'auto'), or cuda_graph_impl='none'"
        )
    if gtp_config.gather_backend == "auto":
        return dataclasses.replace(gtp_config, gather_backend="process_group")
    return gtp_config


def captured_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules megatron's local per-layer graphs capture in training, in model order.

    Every ``GraphableMegatronModule`` but the ``TransformerBlock`` (whose manager serves only
    full-iteration inference): transformer and Mamba layers, each captured whole.
    """
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, GraphableMegatronModule) and not isinstance(module, TransformerBlock)
    ]


def split_graph_chains(model: torch.nn.Module, runtime: GTPRuntime) -> list[str]:
    """Give each captured layer's GTP weights their own graph segment (design §3.5 item 1).

    Weights outside every captured layer (a sharded output layer, say) stay on the eager chain.
    Returns the captured layers' names, index = segment.

    Example::

        split_graph_chains(gpt, gpt.gtp_runtime)   # ["decoder.layers.0", "decoder.layers.1"]
    """
    owned = {id(p) for p in runtime.params}
    layers = captured_layers(model)
    segments = [
        [p for p in layer.parameters() if is_gtp_param(p) and id(p) in owned] for _, layer in layers
    ]
    runtime.assign_graph_segments(segments)
    return [name for name, _ in layers]


class _SegmentEnd(torch.autograd.Function):
    """Identity on a captured layer's input; its backward runs when the layer's is complete."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, boundary: LayerGraphBoundary) -> torch.Tensor:  # type: ignore[override]
        ctx.boundary = boundary
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.boundary.end_backward()
        return grad, None


class LayerGraphBoundary:
    """The GTP side of one captured layer: its segment and what runs at the graph's edges.

    Example::

        boundary = LayerGraphBoundary(runtime, segment=0, name="decoder.layers.0")
        with boundary.capturing(backward=False): ...   # megatron's warmup + forward capture
    """

    def __init__(self, runtime: GTPRuntime, segment: int, name: str) -> None:
        self._runtime = weakref.ref(runtime)  # the model holds the runtime; we hold the model's
        self.segment = segment
        self.name = name

    @property
    def runtime(self) -> GTPRuntime:
        """The runtime owning this layer's GTP weights."""
        runtime = self._runtime()
        if runtime is None:
            raise RuntimeError(f"{self.name}: its GTP runtime was dropped")
        return runtime

    def wrap_input(self, hidden: Any) -> Any:
        """The layer's input through :class:`_SegmentEnd` when a backward will follow."""
        if isinstance(hidden, torch.Tensor) and torch.is_grad_enabled() and hidden.requires_grad:
            return _SegmentEnd.apply(hidden, self)
        return hidden

    def end_forward(self) -> None:
        """The layer's forward returned (inside its forward graph when capturing)."""
        self.runtime.end_graph_forward(self.segment)

    def end_backward(self) -> None:
        """The layer's backward reached its input (inside its backward graph when capturing)."""
        self.runtime.end_graph_backward(self.segment)

    def fire_after_backward(self, output: Any) -> None:
        """Fire this layer's grad-ready hooks right after ``output``'s backward node ran.

        ``output``: what a replayed layer returned; its first tensor's ``grad_fn`` is megatron's
        replay node, whose backward replays the backward graph. A node post-hook runs right
        after it (design §3.5 item 5: the manual hook plan).
        """
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        node = next(
            (t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None),
            None,
        )
        if node is None:  # no backward follows: nothing to announce
            return
        runtime_ref, segment = self._runtime, self.segment

        def after_replay(grad_inputs: Any, grad_outputs: Any) -> None:
            runtime = runtime_ref()
            if runtime is not None:
                runtime.fire_graph_hooks(segment)

        node.register_hook(after_replay)

    def check_quiet(self, when: str, *, carry: bool = False) -> None:
        """``GTPStateError`` unless no GTP collective of the runtime is in flight (``carry``:
        but for the head unit of the wgrad ring, which waits for the next graph)."""
        runtime = self.runtime
        outstanding = runtime.outstanding()
        if carry:
            outstanding["reduce_scatters"] -= runtime.carried
        if any(outstanding.values()):
            raise GTPStateError(
                f"{self.name}: GTP communication in flight {when} its CUDA-graph capture "
                f"({outstanding}): a chain crossed the graph boundary (design §3.5)"
            )

    @contextlib.contextmanager
    def capturing(self, *, backward: bool) -> Iterator[None]:
        """Around one of megatron's ``create_fwd_graph`` / ``create_bwd_graph`` calls.

        Nothing may be in flight on entry or exit (each graph is self-contained; between
        backward captures the wgrad ring's carried head unit waits, not in flight); exposed-wait
        timing is off (timing events cannot be captured). The forward call (eager warmup
        iterations, then the forward capture) runs under ``GTPRuntime.grad_guard``; the backward
        capture records the layer's manual hook plan.
        """
        runtime = self.runtime
        self.check_quiet("before", carry=backward)
        timing, runtime.wait_timer.enabled = runtime.wait_timer.enabled, False
        try:
            if backward:
                with runtime.recording_graph_hooks(self.segment):
                    yield
            else:
                with runtime.grad_guard():
                    yield
        finally:
            runtime.wait_timer.enabled = timing
        self.check_quiet("after", carry=backward)


def _graphed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A captured layer's forward, with the GTP graph boundary on both of its edges."""
    boundary: LayerGraphBoundary = getattr(self, _BOUNDARY)
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = boundary.wrap_input(kwargs["hidden_states"])
    elif args:
        args = (boundary.wrap_input(args[0]), *args[1:])
    out = type(self).forward(self, *args, **kwargs)
    boundary.end_forward()
    return out


class GTPCudaGraphRunner(LeanCudaGraphRunner):
    """megatron's runner (one layer's forward + backward graph) with GTP's capture checks,
    replayed as :class:`~nemo_gtp.integrations.megatron.graph_replay.LeanCudaGraphRunner`."""

    def create_fwd_graph(self, args: Any, kwargs: Any, clone_inputs: bool = True) -> None:
        """megatron's warmup + forward capture, under the layer's grad guard."""
        with getattr(self.base_module, _BOUNDARY).capturing(backward=False):
            super().create_fwd_graph(args, kwargs, clone_inputs=clone_inputs)

    def create_bwd_graph(self, static_grad_outputs: Any = None) -> None:
        """megatron's backward capture (no kernel runs: nothing to guard; the finalizes it
        captures are the layer's manual hook plan)."""
        with getattr(self.base_module, _BOUNDARY).capturing(backward=True):
            super().create_bwd_graph(static_grad_outputs)


class GTPCudaGraphManager(LeanCudaGraphManager):
    """megatron's per-layer graph manager (its lean replay); fires the GTP grad-ready hooks
    after each replay, and its runners are :class:`GTPCudaGraphRunner`."""

    runner_class = GTPCudaGraphRunner

    def __call__(self, megatron_module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """megatron's call; a replayed training step gets the manual hook plan."""
        replay = (
            _CudagraphGlobalRecord.cudagraph_created and self.training and torch.is_grad_enabled()
        )
        out = super().__call__(megatron_module, args, kwargs)
        if replay:
            getattr(megatron_module, _BOUNDARY).fire_after_backward(out)
        return out


def install_layer_graphs(model: torch.nn.Module, runtime: GTPRuntime) -> list[str]:
    """Split ``runtime``'s chains by captured layer and put the GTP boundary on every layer.

    Call once, after the weights are registered and before the first forward (``shard_model``
    does it when the model config asks for local per-layer graphs). Layers whose manager exists
    (built on CUDA with ``cuda_graph_impl="local"``) get the GTP manager; without one (a model
    built with graphs off) the layers still run the segmented schedule eagerly, which is what
    the CPU tests drive. Returns the captured layers' names, index = segment.

    Example::

        install_layer_graphs(gpt, shard_model(gpt, groups, gtp_config))
    """
    names = split_graph_chains(model, runtime)
    for segment, (name, layer) in enumerate(captured_layers(model)):
        setattr(layer, _BOUNDARY, LayerGraphBoundary(runtime, segment, name))
        drop_grad_mode_hooks(layer)
        layer.forward = types.MethodType(_graphed_forward, layer)
        manager = getattr(layer, "cudagraph_manager", None)
        if manager is not None and type(manager) in (CudaGraphManager, LeanCudaGraphManager):
            manager.__class__ = GTPCudaGraphManager
    return names


def reset_layer_graphs() -> None:
    """Forget megatron's per-layer graphs (process-global state) between two fits.

    megatron keeps whether graphs were created, the capture record and the shared memory
    pool as class attributes; left set, the next model's layers would try to replay graphs they
    never captured.
    """
    _CudagraphGlobalRecord.cudagraph_created = False
    _CudagraphGlobalRecord.cudagraph_record = []
    _CudagraphGlobalRecord.cudagraph_inference_record = []
    CudaGraphManager.global_mempool = None
    CudaGraphManager.fwd_mempools = None
    CudaGraphManager.bwd_mempool = None


def release_live_cuda_graphs() -> int:
    """Reset every CUDA graph still alive in this process; returns how many.

    A captured graph holds the NCCL kernels of the collectives captured in it (GTP's gathers and
    reduce-scatters inside per-layer graphs) and with them their communicator; destroying the
    process group while such a graph lives waited forever on 2xH200 (NCCL's communicator
    teardown with graph-captured work, a known torch / NCCL limitation), and references to the
    graphs can outlive the model (megatron's runners, autograd closures), so dropping our own
    references is not enough. Call at the end of a fit, before ``destroy_process_group``: the
    graphs are never replayed again (the next fit captures its own).

    Example::

        release_live_cuda_graphs()
        torch.distributed.destroy_process_group()
    """
    import gc

    if not torch.cuda.is_available():
        return 0
    graphs = cuda_graphs_among(gc.get_objects())
    for graph in graphs:
        graph.reset()
    return len(graphs)


def cuda_graphs_among(objects: list[object]) -> list[torch.cuda.CUDAGraph]:
    """The ``torch.cuda.CUDAGraph`` objects among ``objects``, by their type alone: an
    ``isinstance`` check would also ask an object for its ``__class__``, which some lazy-import
    proxies answer by raising (NeMo's TE placeholders on a machine without TransformerEngine
    raise ``ImportError`` for any attribute).

    Example::

        cuda_graphs_among(gc.get_objects())   # every graph this process still holds
    """
    graph = torch.cuda.CUDAGraph
    return [obj for obj in objects if issubclass(type(obj), graph)]

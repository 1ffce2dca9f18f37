"""megatron's per-layer CUDA-graph replay with its per-call bookkeeping done once (design §3.5).

After capture, megatron-core 0.15 replays a layer's graphs from Python on every call
(``CudaGraphManager.__call__``), and around the replay it walks the layer's modules for their
parameters three times in the forward and twice in the backward, checks every argument against
the capture twice through fresh ``ArgMetadata`` objects (each check imports two modules and
builds a set of types), and flattens the arguments with ``tree_flatten``. On the 1B recipe that
bookkeeping is ~4 of the ~29 ms the host takes to queue a graphed forward and backward (about
40 % of the step's host time under cProfile), on VMs where the graphed step is host-bound.

The lean classes replay the same graphs with the same inputs, the same autograd node and the
same DDP pre-forward hooks; what changes is only how the host finds them:

- a layer's parameters and modules are listed once per runner (the parameters a graph was
  captured with are the ones it replays: it holds their addresses);
- the arguments are compared with the capture's without building anything, and only a call
  that compares equal takes the lean path: a match here implies megatron's (same types, tensor
  shapes, dtypes and devices, equal values), anything else — a mismatch, a type megatron
  refuses, a registered pytree — goes to megatron's own check and its error message;
- the graph's input tensors are picked from the arguments directly (their structure was just
  compared with the capture's, which megatron flattened).

GTP's graph classes (:mod:`nemo_gtp.integrations.megatron.layer_graphs`) build on these, and
:func:`use_lean_replay` gives every other captured layer the lean manager, so a GTP model and
its non-GTP baseline replay alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.cuda_graphs import (
    CudaGraphManager,
    _CudagraphGlobalRecord,
    _CudagraphReplayNode,
    _CudaGraphRunner,
    _GraphStatus,
)
from torch.utils._pytree import SUPPORTED_NODES

_PLAIN = (type(None), bool, int, str, float)
"""Non-tensor argument types megatron's graphs take by value (its ``_check_supported_type``, less
the inference contexts, which a training replay never gets)."""


def _same_layout(value: torch.Tensor, captured: Any) -> bool:
    """A tensor against a captured tensor, or megatron's ``ArgMetadata`` of one (both have
    ``shape``, ``dtype`` and ``device``): what megatron compares of tensors."""
    return (
        value.shape == captured.shape
        and value.dtype == captured.dtype
        and value.device == captured.device
    )


def _same_value(value: Any, captured: Any) -> bool:
    """``value`` may replay where ``captured`` was captured (megatron's rule, or stricter)."""
    kind = type(value)
    if kind is not type(captured):
        return False
    if kind is torch.Tensor:
        return _same_layout(value, captured)
    if kind in _PLAIN:
        return value == captured
    if dataclasses.is_dataclass(value) and kind not in SUPPORTED_NODES:
        return all(
            _same_field(getattr(value, f.name), getattr(captured, f.name))
            for f in dataclasses.fields(captured)
        )
    return False


def _same_field(value: Any, captured: Any) -> bool:
    """A dataclass field: megatron compares it as an argument of its own, one level deep."""
    return not dataclasses.is_dataclass(value) and _same_value(value, captured)


def _same_as_meta(value: Any, meta: Any) -> bool:
    """``value`` against megatron's ``ArgMetadata`` of the captured argument."""
    if meta.type is torch.Tensor:
        return type(value) is torch.Tensor and _same_layout(value, meta)
    return not issubclass(meta.type, torch.Tensor) and _same_value(value, meta.value)


def matches_capture(runner: _CudaGraphRunner, args: tuple, kwargs: dict) -> bool:
    """Whether ``runner``'s graphs can replay ``args`` / ``kwargs`` with no check failing.

    True implies megatron's ``get_mismatch_errors`` finds nothing; False says only "ask
    megatron" (it may still accept, e.g. two different dataclass types with equal fields).

    Example::

        if not matches_capture(runner, args, kwargs):
            runner.get_mismatch_errors(args, kwargs)   # megatron's messages
    """
    arg_metas = runner.fwd_graph_input_arg_metas
    kwarg_metas = runner.fwd_graph_input_kwarg_metas
    if len(args) != len(arg_metas) or len(kwargs) != len(kwarg_metas):
        return False
    for value, meta in zip(args, arg_metas):
        if not _same_as_meta(value, meta):
            return False
    for key, value in kwargs.items():
        meta = kwarg_metas.get(key)
        if meta is None or not _same_as_meta(value, meta):
            return False
    return True


def replay_inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a replay copies into the graph's inputs, for arguments
    :func:`matches_capture` accepted: megatron's ``get_tensors`` (each tensor, each dataclass's
    tensor fields, in order) without its flattening and type checks, which the match made.

    Example::

        replay_inputs((hidden,), {"attention_mask": None, "rotary_pos_emb": rope})  # [hidden, rope]
    """
    tensors = []
    for value in (*args, *kwargs.values()):
        if type(value) is torch.Tensor:
            tensors.append(value)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                field = getattr(value, f.name)
                if torch.is_tensor(field):
                    tensors.append(field)
    return tensors


class LeanCudaGraphRunner(_CudaGraphRunner):
    """megatron's runner (one layer's forward + backward graph) replayed with less host work."""

    def graph_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The layer's parameters, listed once: those its graphs were captured with."""
        params = self.__dict__.get("_graph_params")
        if params is None:
            params = self.__dict__["_graph_params"] = tuple(self.base_module.parameters())
        return params

    def replay_graph_capture(self, is_first_microbatch: bool, args: Any, kwargs: Any) -> Any:
        """megatron's replay; arguments it would not accept go to megatron's own path."""
        if not matches_capture(self, args, kwargs):
            return super().replay_graph_capture(is_first_microbatch, args, kwargs)
        return self.replay_matched(is_first_microbatch, args, kwargs)

    def replay_matched(self, is_first_microbatch: bool, args: Any, kwargs: Any) -> Any:
        """megatron's replay of arguments :func:`matches_capture` accepted (not checked again)."""
        inputs = replay_inputs(args, kwargs)
        out = list(
            _CudagraphReplayNode.apply(self, is_first_microbatch, *inputs, *self.graph_params())
        )
        if torch.is_tensor(self.fwd_graph_outputs):
            self.fwd_graph_outputs = [self.fwd_graph_outputs]
        return tuple(out.pop(0) if torch.is_tensor(o) else o for o in self.fwd_graph_outputs)

    def get_input_grads_with_dummy_flags(self) -> tuple[tuple, list[bool]]:
        """megatron's: the backward graph's input grads, and under ``gradient_accumulation_fusion``
        a dummy wgrad (fresh, of the weight's shape) for each weight whose grad the graph
        already added to ``main_grad``."""
        grads = self.static_grad_inputs
        if not self.fuse_wgrad_accumulation:
            return grads, [False] * len(grads)
        params = self.graph_params()
        num_dgrads = len(grads) - len(params)
        out, dummy = list(grads[:num_dgrads]), [False] * num_dgrads
        for param, wgrad in zip(params, grads[num_dgrads:]):
            is_dummy = getattr(param, "grad_added_to_main_grad", False)
            if is_dummy:
                make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
                device = torch.cuda.current_device()
                wgrad = make(param.main_grad.shape, dtype=param.dtype, device=device)
            out.append(wgrad)
            dummy.append(is_dummy)
        return tuple(out), dummy


class LeanCudaGraphManager(CudaGraphManager):
    """megatron's per-layer graph manager whose training replays skip the per-call walks."""

    runner_class: type[_CudaGraphRunner] = LeanCudaGraphRunner
    """What a runner this manager creates becomes."""

    def _layer_parts(self, layer: torch.nn.Module) -> tuple[tuple, tuple]:
        """``layer``'s parameters and the modules whose DDP pre-forward hooks a replay calls
        (the layer itself, then every module in it, as megatron does), listed once."""
        parts = self.__dict__.get("_lean_parts")
        if parts is None or parts[0] is not layer:
            modules = (layer, *layer.modules())
            parts = self.__dict__["_lean_parts"] = (layer, tuple(layer.parameters()), modules)
        return parts[1], parts[2]

    def _ready_runner(self, args: tuple, kwargs: dict) -> _CudaGraphRunner | None:
        """The first runner ready for a forward whose capture ``args`` / ``kwargs`` match."""
        if not self.reuse_cudagraphs:
            return None
        for runner in self.cudagraph_runners:
            if runner.status == _GraphStatus.FWD_READY and matches_capture(runner, args, kwargs):
                return runner
        return None

    def __call__(self, megatron_module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """megatron's call; a training replay with the layer's lists made once."""
        if not (
            _CudagraphGlobalRecord.cudagraph_created and self.training and torch.is_grad_enabled()
        ):
            return super().__call__(megatron_module, args, kwargs)
        if self.is_first_microbatch and hasattr(megatron_module, "set_is_first_microbatch"):
            megatron_module.set_is_first_microbatch()
        params, modules = self._layer_parts(megatron_module)
        for param in params:  # megatron touches each (apex's param-sync hooks fire on it)
            param.data_ptr()
        for module in modules:
            if module._forward_pre_hooks:
                self.call_ddp_preforward_hook(module)
        runner = self._ready_runner(args, kwargs)
        if runner is not None:  # matched: replayed without checking the arguments again
            out = runner.replay_matched(self.is_first_microbatch, args, kwargs)
        else:  # megatron's lookup, and its checks, decide
            runner = self.get_cudagraph_runner(megatron_module, args, kwargs)
            out = runner.replay_graph_capture(self.is_first_microbatch, args, kwargs)
        runner.status = _GraphStatus.BWD_READY
        return out

    def get_cudagraph_runner(self, megatron_module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """megatron's runner lookup; a new runner becomes a :attr:`runner_class`."""
        return self._made_lean(super().get_cudagraph_runner(megatron_module, args, kwargs))

    def _made_lean(self, runner: _CudaGraphRunner) -> _CudaGraphRunner:
        """``runner``, a :attr:`runner_class` if it was megatron's own."""
        if type(runner) is _CudaGraphRunner:
            runner.__class__ = self.runner_class
        return runner


def use_lean_replay(model: torch.nn.Module) -> int:
    """Give every layer of ``model`` that has megatron's own graph manager the lean one.

    Call before the first training step (runners are made on the first forward); GTP's layers
    already have a lean manager (``install_layer_graphs``). Returns how many layers changed.

    Example::

        use_lean_replay(gpt)   # 24 on the 1B recipe with cuda_graph_impl="local"
    """
    changed = 0
    for module in model.modules():
        manager = getattr(module, "cudagraph_manager", None)
        if manager is not None and type(manager) is CudaGraphManager:
            manager.__class__ = LeanCudaGraphManager
            for runner in manager.cudagraph_runners:  # made before (a model that trained)
                manager._made_lean(runner)
            changed += 1
    return changed

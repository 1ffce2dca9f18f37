"""The patch machinery of :mod:`nemo_gtp.cpu.compat`: the registry every patch family adds
itself to, the record that puts each replaced attribute back, and the host stand-ins the patches
install (a ``torch`` whose factories map CUDA devices to the CPU, CUDA type names for one call,
no-op CUDA streams). Nothing is patched on import.

Example::

    @register("megatron/core/foo.py:bar")
    def _patch_bar(patcher: Patcher) -> None:
        # its docstring's first line is the patch's summary
        install_host_torch(patcher, "megatron.core.foo")
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

CPU = torch.device("cpu")
"""The device every CUDA device spec maps to."""
_MISSING = object()


# --------------------------------------------------------------------------------------------
# Patch bookkeeping
# --------------------------------------------------------------------------------------------


class Patcher:
    """Records every attribute a patch replaces so that it can be put back."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, attr: str, value: Any) -> None:
        """Replace ``target.attr`` with ``value`` and remember the original."""
        original = vars(target).get(attr, _MISSING)
        self._undo.append((target, attr, original))
        setattr(target, attr, value)

    def undo(self) -> None:
        """Restore the originals in reverse order."""
        while self._undo:
            target, attr, original = self._undo.pop()
            if original is _MISSING:
                delattr(target, attr)
            else:
                setattr(target, attr, original)


@dataclass(frozen=True)
class PatchInfo:
    """One registered patch: its name (what it does), the code it patches, and whether it
    needs NeMo."""

    name: str
    site: str
    nemo: bool
    apply: Callable[[Patcher], None]

    @property
    def summary(self) -> str:
        """First line of the patch function's docstring."""
        doc = self.apply.__doc__ or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


REGISTRY: dict[str, PatchInfo] = {}
"""Every patch by name, in registration order (the order ``enable_cpu_compat`` applies them)."""


def register(
    site: str, *, nemo: bool = False
) -> Callable[[Callable[[Patcher], None]], Callable[[Patcher], None]]:
    """Decorator: add a ``_patch_<name>(patcher)`` function to :data:`REGISTRY` as patch
    ``<name>`` of ``site`` (``nemo``: applied only with the NeMo patches); the example in the
    module docstring."""

    def decorator(fn: Callable[[Patcher], None]) -> Callable[[Patcher], None]:
        name = fn.__name__.removeprefix("_patch_")
        REGISTRY[name] = PatchInfo(name=name, site=site, nemo=nemo, apply=fn)
        return fn

    return decorator


class PatchState:
    """Whether compat is on: the :class:`Patcher` of the active patches (``None``: off) and
    their names, in the order they were applied."""

    patcher: Patcher | None = None
    active: list[str] = []


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def _host_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an int)
    to the CPU device; anything else is returned unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return CPU
    if isinstance(device, str) and device.split(":", 1)[0] == "cuda":
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


class StagedHostTensor(torch.Tensor):
    """A CPU tensor that stays on the CPU when code asks to move it to CUDA.

    Returned in place of pinned staging tensors (``nemo_strategy_logging``,
    ``nemo_sampler_logging``) and used for batch tensors in :func:`cpu_gpt_data_step`.
    ``.cuda()``, ``.to("cuda")`` and ``.pin_memory()`` return a plain ``torch.Tensor`` on the
    CPU; every other operation returns plain tensors too, because ``__torch_function__`` is
    disabled for this subclass.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._plain()

    def pin_memory(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._plain()

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        args = tuple(
            _host_device(a) if isinstance(a, str | int | torch.device) else a for a in args
        )
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        return torch.Tensor.to(self._plain(), *args, **kwargs)


_FACTORY_NAMES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange")


def _host_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a torch factory function so that a CUDA ``device=`` becomes cpu and
    ``pin_memory=True`` yields a :class:`StagedHostTensor` instead of pinned memory."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        staged = bool(kwargs.pop("pin_memory", False))
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        out = factory(*args, **kwargs)
        return out.as_subclass(StagedHostTensor) if staged else out

    return wrapper


class CudaToCpuTorch(types.ModuleType):
    """Stand-in for the ``torch`` module inside one patched module (the ``*_cuda_tensors``,
    ``schedule_token_counter`` and ``nemo_*_logging`` patches).

    Every attribute is forwarded to the real ``torch``; only the factory functions in
    ``_FACTORY_NAMES`` are wrapped by :func:`_host_factory`.
    """

    def __init__(self, patched_module: str) -> None:
        super().__init__("torch", f"torch as seen by {patched_module} (cpu_compat)")
        for name in _FACTORY_NAMES:
            setattr(self, name, _host_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def install_host_torch(patcher: Patcher, module_name: str) -> None:
    """Replace the global name ``torch`` inside ``module_name`` with a
    :class:`CudaToCpuTorch`."""
    module = importlib.import_module(module_name)
    if getattr(module, "torch", None) is not torch:
        raise RuntimeError(f"{module_name}.torch is not the torch module; cannot patch it")
    patcher.set(module, "torch", CudaToCpuTorch(module_name))


_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _type_with_cuda_names(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type`` that reports a CPU tensor as ``torch.cuda.<X>Tensor`` when called with
    no arguments; any conversion call is passed through unchanged."""
    if dtype is not None or args or kwargs:
        return _ORIGINAL_TENSOR_TYPE(self, dtype, *args, **kwargs)
    name = _ORIGINAL_TENSOR_TYPE(self)
    if self.device.type == "cpu" and name.startswith("torch.") and name.count(".") == 1:
        return "torch.cuda." + name.removeprefix("torch.")
    return name


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """For the duration of the block, ``Tensor.type()`` reports CUDA type names
    (``clip_grad_type_check``, ``distopt_type_dispatch``)."""
    previous = torch.Tensor.__dict__.get("type", _MISSING)
    torch.Tensor.type = _type_with_cuda_names  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if previous is _MISSING:
            del torch.Tensor.type
        else:
            torch.Tensor.type = previous  # type: ignore[method-assign]


def under_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that it runs while ``Tensor.type()`` reports CUDA type names
    (``clip_grad_type_check``, ``distopt_type_dispatch``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


class HostStream:
    """Stand-in for ``torch.cuda.Stream`` (``cuda_stream_shims``). CPU work is synchronous, so
    every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = CPU

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""
        return None

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""
        return None

    def record_event(self, event: Any = None) -> Any:
        """The event given (nothing is recorded)."""
        return event

    def synchronize(self) -> None:
        """Nothing to wait for."""
        return None

    def query(self) -> bool:
        """Always done."""
        return True


def host_stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    """Stand-in for ``torch.cuda.stream(s)`` (``cuda_stream_shims``): a null context."""
    return contextlib.nullcontext()


def host_current_stream(device: Any = None) -> HostStream:
    """Stand-in for ``torch.cuda.current_stream``/``default_stream`` (``cuda_stream_shims``)."""
    return HostStream()


def host_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` (``cuda_stream_shims``): nothing to wait for."""
    return None


def host_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` (``current_device_cpu``): the CPU device."""
    return CPU

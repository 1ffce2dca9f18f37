"""NeMo's DDP wrapping, made GTP-aware without copying ``MegatronParallel.init_ddp``.

``MegatronParallel.init_ddp`` (NeMo 2.7.3) wraps each model chunk in the module-level class
``nemo.lightning.megatron_parallel.DDP`` and passes no ``pg_collection``, so megatron DDP would
reduce over megatron's data-parallel group (DP x GTP) and route GTP weights' grad-ready hooks
through autograd. :func:`nemo_ddp_class` swaps that name for the duration of one ``init_ddp``
call with a subclass that mixes in :class:`GTPDDPMixin` (design §3.2 point 3) and injects the GTP
``ProcessGroupCollection`` (DDP reduces over the GTP-excluded replicate group). Everything else
NeMo does around the wrap (side stream, bucketing rules, getattr proxy, no_sync funcs) stays
NeMo's. The subclass is a subclass of NeMo's ``DDP``, so NeMo's later ``isinstance(..., DDP)``
checks keep passing after the name is restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from megatron.core.process_groups_config import ProcessGroupCollection
from nemo.lightning import megatron_parallel

from nemo_gtp.integrations.megatron import GTPDDPMixin

_NEMO_DDP = megatron_parallel.DDP  # captured before any swap


class GTPNeMoDDP(GTPDDPMixin, _NEMO_DDP):
    """NeMo's ``DDP`` with GTP grad-ready routing and the GTP process groups.

    Use :func:`gtp_ddp_class` to bind the process groups; NeMo constructs it as
    ``DDP(config, ddp_config, module, data_parallel_group=..., disable_bucketing=...)`` and its
    ``DDP.__init__`` drops the keyword arguments megatron-core 0.15 no longer takes.
    """

    _gtp_pg_collection: ProcessGroupCollection | None = None

    def __init__(self, config: Any, ddp_config: Any, module: Any, *args: Any, **kwargs: Any):
        if type(self)._gtp_pg_collection is None:
            raise TypeError("use gtp_ddp_class(pg_collection) to bind the GTP process groups")
        kwargs["pg_collection"] = type(self)._gtp_pg_collection
        super().__init__(config, ddp_config, module, *args, **kwargs)

    def __getattr__(self, item: str) -> Any:
        # NeMo's DDP.__getattr__ resolves ``super(self.__class__, self)``, which recurses forever
        # on any subclass; same semantics here (module attributes first, then the wrapped
        # module's), anchored on NeMo's class instead of ``self.__class__``.
        try:
            return super(_NEMO_DDP, self).__getattr__(item)
        except AttributeError:
            if item == "module":
                raise
            return getattr(self.module, item)


def gtp_ddp_class(pg_collection: ProcessGroupCollection) -> type[GTPNeMoDDP]:
    """A :class:`GTPNeMoDDP` subclass bound to ``pg_collection`` (one per strategy).

    Example::

        with nemo_ddp_class(gtp_ddp_class(gtp_process_groups(groups))):
            megatron_parallel.init_model_parallel()
    """
    return type("BoundGTPNeMoDDP", (GTPNeMoDDP,), {"_gtp_pg_collection": pg_collection})


@contextlib.contextmanager
def nemo_ddp_class(cls: type) -> Iterator[None]:
    """Make NeMo's ``MegatronParallel.init_ddp`` wrap with ``cls`` inside the block."""
    if not issubclass(cls, _NEMO_DDP):
        raise TypeError(f"{cls!r} must subclass nemo.lightning.megatron_parallel.DDP")
    original = megatron_parallel.DDP
    megatron_parallel.DDP = cls
    try:
        yield
    finally:
        megatron_parallel.DDP = original

"""NeMo's optimizer setup, made GTP-aware: inject the GTP ``ProcessGroupCollection``.

NeMo 2.7.3's ``nemo.lightning._strategy_lib.setup_megatron_optimizer`` calls
``megatron.core.optimizer.get_megatron_optimizer(config, chunks, ..., use_gloo_process_groups=...)``
without ``pg_collection``, so the distributed optimizer would shard its state over megatron's
data-parallel group (DP x GTP) and compute the grad norm over TP x PP only. Under GTP both must
come from :func:`nemo_gtp.integrations.megatron.gtp_process_groups` (design §3.2: the optimizer
shards over the GTP-excluded replicate group; the model-parallel group includes GTP).

NeMo imports the function from ``megatron.core.optimizer`` at call time, so
:func:`megatron_optimizer_pg_collection` replaces that attribute only while the strategy sets up
its optimizers. Gloo groups are turned off because megatron would derive them from its own
data-parallel group, which is the wrong one under GTP. The optimizer it returns gets its
per-tensor copies planned once (:func:`~nemo_gtp.integrations.megatron.optimizer_copies.
plan_optimizer_copies`): a GTP rank owns twice the tensors of a DP rank's distributed optimizer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import megatron.core.optimizer as mcore_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_gtp.integrations.megatron.optimizer_copies import plan_optimizer_copies


@contextlib.contextmanager
def megatron_optimizer_pg_collection(pg_collection: ProcessGroupCollection) -> Iterator[None]:
    """Inside the block, ``get_megatron_optimizer`` uses ``pg_collection`` and no gloo groups.

    Example::

        with megatron_optimizer_pg_collection(gtp_process_groups(groups)):
            strategy_setup_optimizers(trainer)   # NeMo -> setup_megatron_optimizer
    """
    original = mcore_optimizer.get_megatron_optimizer

    @functools.wraps(original)
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        kwargs["pg_collection"] = pg_collection
        kwargs["use_gloo_process_groups"] = False
        optimizer = original(*args, **kwargs)
        plan_optimizer_copies(optimizer)  # its per-tensor copies, exact (design §3.2)
        return optimizer

    # what a builder that replaces this one inside the block must use too (MuonOptimizerModule)
    get_megatron_optimizer.gtp_pg_collection = pg_collection
    mcore_optimizer.get_megatron_optimizer = get_megatron_optimizer
    try:
        yield
    finally:
        mcore_optimizer.get_megatron_optimizer = original

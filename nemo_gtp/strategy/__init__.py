"""The NeMo / Lightning layer of GTP (design §2.1, §2.3): strategy, callbacks, NeMo fixes.

Importing this package imports NeMo and Lightning; ``nemo_gtp.engine`` never does.
"""

# The data module lives in nemo_gtp.data; re-exported here too, where strategy users find it.
from nemo_gtp.data.synthetic import SyntheticGPTDataModule
from nemo_gtp.strategy.accounting import MemoryFootprint, memory_footprint
from nemo_gtp.strategy.callbacks import (
    GTPDrainCallback,
    GTPMetricsCallback,
    GTPProgressBar,
    gtp_runtimes,
)
from nemo_gtp.strategy.cuda_graphs import cuda_graphs_enabled, enforce_cuda_graph_warmup
from nemo_gtp.strategy.megatron_strategy import GTPMegatronStrategy, gtp_banner
from nemo_gtp.strategy.step_syncs import SyncFreeGradClip, SyncFreeLogging

__all__ = [
    "GTPDrainCallback",
    "GTPMegatronStrategy",
    "GTPMetricsCallback",
    "GTPProgressBar",
    "MemoryFootprint",
    "SyncFreeGradClip",
    "SyncFreeLogging",
    "SyntheticGPTDataModule",
    "cuda_graphs_enabled",
    "enforce_cuda_graph_warmup",
    "gtp_banner",
    "gtp_runtimes",
    "memory_footprint",
]

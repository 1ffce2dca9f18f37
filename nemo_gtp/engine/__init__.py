"""The GTP engine: pure torch, no NeMo or Lightning (design §1.1, §3.1, §3.4).

Public surface: the rank grid (:class:`GTPParallelDims`, :class:`GTPGroups`), the sharded param
(:class:`GTPShardedParam`, :class:`ShardSpec`), the per-model driver (:class:`GTPRuntime`), the
knobs (:class:`GTPConfig`) and the autograd path for plain linears (:func:`gtp_linear`,
:func:`shard_linear`).
"""

from nemo_gtp.engine.config import GTPConfig
from nemo_gtp.engine.grid import GTPGroups, GTPParallelDims, WeightAxis
from nemo_gtp.engine.linear import TPComm, gtp_linear, shard_linear
from nemo_gtp.engine.param import (
    Direction,
    GatherState,
    GTPShardedParam,
    GTPStateError,
    ReduceScatterState,
    ShardSpec,
    is_gtp_param,
)
from nemo_gtp.engine.runtime import ChainId, ChainPhase, CommStats, GTPRuntime, runtimes_of

__all__ = [
    "ChainId",
    "ChainPhase",
    "CommStats",
    "Direction",
    "GTPConfig",
    "GTPGroups",
    "GTPParallelDims",
    "GTPRuntime",
    "GTPShardedParam",
    "GTPStateError",
    "GatherState",
    "ReduceScatterState",
    "ShardSpec",
    "TPComm",
    "WeightAxis",
    "gtp_linear",
    "is_gtp_param",
    "runtimes_of",
    "shard_linear",
]

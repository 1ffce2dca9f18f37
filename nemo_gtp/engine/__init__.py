"""The GTP engine: pure torch, no NeMo or Lightning (design §1.1, §3.1, §3.4).

Public surface: the rank grid (:class:`GTPParallelDims`, :class:`GTPGroups`), the sharded param
(:class:`GTPShardedParam`, :class:`ShardSpec`), the per-model driver (:class:`GTPRuntime`), the
knobs (:class:`GTPConfig`) and the autograd path for plain linears (:func:`gtp_linear`,
:func:`shard_linear`).
"""

from nemo_gtp.lazy import lazy_exports

_EXPORTS = {
    "GTPConfig": "nemo_gtp.engine.config",
    "GTPGroups": "nemo_gtp.engine.grid",
    "GTPParallelDims": "nemo_gtp.engine.grid",
    "WeightAxis": "nemo_gtp.engine.grid",
    "TPComm": "nemo_gtp.engine.linear",
    "gtp_linear": "nemo_gtp.engine.linear",
    "shard_linear": "nemo_gtp.engine.linear",
    "Direction": "nemo_gtp.engine.slots",
    "GatherState": "nemo_gtp.engine.slots",
    "GTPShardedParam": "nemo_gtp.engine.param",
    "GTPStateError": "nemo_gtp.engine.slots",
    "ReduceScatterState": "nemo_gtp.engine.slots",
    "ShardSpec": "nemo_gtp.engine.shard",
    "is_gtp_param": "nemo_gtp.engine.param",
    "ChainId": "nemo_gtp.engine.runtime",
    "ChainPhase": "nemo_gtp.engine.runtime",
    "CommStats": "nemo_gtp.engine.runtime",
    "GTPRuntime": "nemo_gtp.engine.runtime",
    "runtimes_of": "nemo_gtp.engine.runtime",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""Generalized Tensor Parallelism (GTP) for NeMo 2 / Lightning and megatron-core.

``nemo_gtp.engine`` (pure torch) and ``nemo_gtp.integrations.megatron`` import no NeMo. The
NeMo-facing names below are imported lazily, on first attribute access, so ``import
nemo_gtp.engine`` stays free of NeMo / Lightning.

Example::

    from nemo_gtp import GTPMegatronStrategy     # imports nemo_gtp.strategy (and NeMo) here
    weights = nemo_gtp.full_state_dict(trainer.strategy)  # GTP shards gathered (collective)
"""

from nemo_gtp.lazy import lazy_exports

_EXPORTS = {
    "GTPMegatronStrategy": "nemo_gtp.strategy",
    "GTPDrainCallback": "nemo_gtp.strategy",
    "GTPMetricsCallback": "nemo_gtp.strategy",
    "GTPProgressBar": "nemo_gtp.strategy",
    "SyncFreeGradClip": "nemo_gtp.strategy",
    "SyncFreeLogging": "nemo_gtp.strategy",
    "SyntheticGPTDataModule": "nemo_gtp.data.synthetic",
    "MuonOptimizerModule": "nemo_gtp.strategy.muon",
    # megatron-core only: usable without NeMo
    "MuonConfig": "nemo_gtp.integrations.megatron.muon",
    "full_state_dict": "nemo_gtp.integrations.megatron.export",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

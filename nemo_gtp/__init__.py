"""Generalized Tensor Parallelism (GTP) for NeMo 2 / Lightning and megatron-core.

``nemo_gtp.engine`` (pure torch) and ``nemo_gtp.integrations.megatron`` import no NeMo. The
NeMo-facing names below are imported lazily, on first attribute access, so ``import
nemo_gtp.engine`` stays free of NeMo / Lightning.

Example::

    from nemo_gtp import GTPMegatronStrategy     # imports nemo_gtp.strategy (and NeMo) here
    weights = nemo_gtp.full_state_dict(trainer.strategy)  # GTP shards gathered (collective)
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GTPMegatronStrategy": "nemo_gtp.strategy",
    "GTPDrainCallback": "nemo_gtp.strategy",
    "GTPMetricsCallback": "nemo_gtp.strategy",
    "GTPProgressBar": "nemo_gtp.strategy",
    "SyntheticGPTDataModule": "nemo_gtp.recipes.data",
    "MuonOptimizerModule": "nemo_gtp.strategy.muon",
    # megatron-core only: usable without NeMo
    "MuonConfig": "nemo_gtp.integrations.megatron.muon",
    "full_state_dict": "nemo_gtp.integrations.megatron.export",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_gtp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

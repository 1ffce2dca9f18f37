"""The callbacks a recipe's ``faults`` and ``callbacks`` sections ask for.

``faults`` (:mod:`nemo_gtp.strategy.faults`): ``collective_timeout_s`` (every process group's
timeout), ``preemption`` (a ``SIGTERM`` saves at the next step boundary); megatron's
``ddp.check_for_nan_in_grad`` names the first non-finite gradient. ``callbacks``: any Lightning
callback by import path, e.g. ``+callbacks.bar.target=nemo_gtp.strategy.GTPProgressBar``.

Example::

    trainer = nl.Trainer(..., callbacks=fault_callbacks(load_recipe("configs/tiny_cpu.yaml")))
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def _plain(section: Any) -> dict[str, Any]:
    return dict(OmegaConf.to_container(section, resolve=True)) if section is not None else {}


def fault_callbacks(cfg: DictConfig) -> list[Any]:
    """The callbacks of the recipe's ``faults`` section and its ``callbacks`` section.

    Every process group's timeout (``faults.collective_timeout_s``, default
    :data:`~nemo_gtp.recipes.schema.COLLECTIVE_TIMEOUT_S`); with a ``checkpoint`` section,
    a ``SIGTERM`` saves at the next step boundary and stops (``faults.preemption``, default
    true); ``ddp.check_for_nan_in_grad: true`` stops at the step a reduced gradient is not
    finite, naming the parameter (:mod:`nemo_gtp.strategy.faults`). Then each
    ``callbacks.NAME`` (``target``: a callback class by import path, the other keys its
    arguments), e.g. ``+callbacks.bar.target=nemo_gtp.strategy.GTPProgressBar``.
    """
    import importlib

    from nemo_gtp.recipes.schema import COLLECTIVE_TIMEOUT_S
    from nemo_gtp.strategy.faults import CollectiveTimeout, GTPPreemption, NonFiniteGradCheck

    faults = _plain(cfg.get("faults"))
    made: list[Any] = [CollectiveTimeout(faults.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S))]
    if cfg.get("checkpoint") and faults.get("preemption", True):
        made.append(GTPPreemption())
    if cfg.get("ddp", {}).get("check_for_nan_in_grad", False):
        made.append(NonFiniteGradCheck())
    for entry in _plain(cfg.get("callbacks")).values():
        module, _, name = entry.pop("target").rpartition(".")
        made.append(getattr(importlib.import_module(module), name)(**entry))
    return made

"""megatron optimizer state for GTP checkpoints (design §3.3 "Optimizer state").

Nothing here is GTP-specific: the model sharded state dict (made GTP-aware by
:func:`nemo_gtp.integrations.megatron.checkpoint.make_gtp_sharded_state_dict`) already carries
the layout-independent description every optimizer state copies. What remains is choosing the
distributed optimizer's format and making sure a fresh optimizer has state to load into.

Distributed-optimizer formats with GTP:

- ``fully_sharded_model_space`` (default): every rank describes its flat slice of each param;
  reshardable across TP, GTP, DP and padding, with runs without GTP too when they also build
  their state dicts through nemo_gtp (megatron's own writer stores this format per layout).
- ``fully_reshardable``: gathers each param's state over the replicate group first; same
  reshardability, and interchangeable with plain megatron (no nemo_gtp) in both directions.
- ``dp_reshardable`` (NeMo's default): bucket buffers keyed ``dp_group_idx`` = the rank in the
  TP x GTP x PP model-parallel group (``gtp_process_groups`` passes that group), so GTP peers never
  collide, but only DP may change between save and load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_SHARDING_TYPE = "fully_sharded_model_space"


def optimizer_sharded_state_dict(
    optimizer: Any,
    model_sharded_state_dict: dict,
    *,
    is_loading: bool = False,
    sharding_type: str = DEFAULT_SHARDING_TYPE,
    metadata: dict | None = None,
) -> dict:
    """``optimizer.sharded_state_dict`` in ``sharding_type`` (used by distributed optimizers).

    ``model_sharded_state_dict`` must be the GTP-aware one of the same model. With
    ``is_loading=True`` the optimizer state is allocated first (see :func:`allocate_state`).
    ``chained_optim_avoid_prefix`` defaults to True so keys do not depend on how many optimizers
    megatron chained.
    """
    if is_loading:
        allocate_state(optimizer)
    meta = {
        "chained_optim_avoid_prefix": True,
        **(metadata or {}),
        "distrib_optim_sharding_type": sharding_type,
    }
    with torch_adam_step_hidden(optimizer):
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=meta)


def allocate_state(optimizer: Any) -> None:
    """Give every parameter of a not-yet-stepped megatron optimizer its (zero) state.

    megatron describes existing state tensors to the checkpoint, and its optimizers' own
    ``init_state_fn`` skips torch Adam's ``step`` (TE/Apex keep it per group), without which the
    distributed optimizer cannot even build its state dict. Params that already have state keep it.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if all(len(inner.state[p]) > 0 for p in params):
            continue
        init = getattr(opt, "init_state_fn", None)
        if init is not None:
            init(inner, getattr(opt, "config", None))
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in params:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer: Any, loaded: dict) -> None:
    """``optimizer.load_state_dict(loaded)``, robust to torch's Adam and fp32 params.

    - :func:`torch_adam_step_hidden` during the load;
    - ``no_grad``: megatron's ``dp_reshardable`` load copies in place into fp32 master weights
      that are views of the (grad-requiring) params;
    - megatron's distributed optimizer hands every param the *same* restored ``step`` tensor,
      which torch's Adam then increments in place once per param (wrong bias correction from the
      first step after a resume); each param gets its own copy.
    """
    loaded = rechain_loaded_state(optimizer, loaded)
    with torch_adam_step_hidden(optimizer), torch.no_grad():
        optimizer.load_state_dict(loaded)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")  # megatron's group identity, less MoE's


def rechain_loaded_state(optimizer: Any, loaded: dict) -> Any:
    """A loaded optimizer state in the shape ``optimizer`` expects, whatever chain saved it.

    megatron's ``ChainedOptimizer`` saves ``{0: state_0, 1: state_1, ...}`` for several
    optimizers and one plain state for a single one. ``GTPConfig.shard_replicated_params_over_gtp``
    chains two (replicated params, GTP shards), a run without it or without GTP one. The
    per-param tensors are requested (and loaded) in this run's structure already; only the
    common part, read back in the saver's structure, must be re-dealt: each param group of this
    run takes the saved group with the same ``wd_mult`` / ``lr_mult`` / ``is_decoupled_lr`` (the
    learning-rate schedule and step are shared by all of them), keeping its own
    ``is_expert_parallel``. Same chain on both sides: ``loaded`` is returned unchanged.
    """
    subs = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if not isinstance(loaded, dict):
        return loaded
    top = {k: v for k, v in loaded.items() if not isinstance(k, int)}
    mine = [loaded.get(i, {}) for i in range(len(subs))] if len(subs) > 1 else [top]
    if all("optimizer" in part for part in mine):
        return loaded
    saved = (
        [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
        if len(subs) == 1
        else [top]
    )
    saved = [part for part in saved if isinstance(part, dict) and "optimizer" in part]
    if not saved:
        return loaded
    groups = [g for part in saved for g in part["optimizer"]["param_groups"]]
    out = []
    for sub, part in zip(subs, mine, strict=True):
        inner = getattr(sub, "optimizer", None)
        own_groups = inner.state_dict()["param_groups"] if inner is not None else []
        dealt = []
        for own in own_groups:
            match = next((g for g in groups if _group_id(g) == _group_id(own)), None)
            if match is None:
                raise ValueError(
                    f"the checkpoint's optimizer state has no param group like this run's "
                    f"{dict(zip(_GROUP_KEYS, _group_id(own)))}: load the weights only "
                    "(MegatronStrategy(ckpt_load_optimizer=False))"
                )
            dealt.append({**match, "is_expert_parallel": own.get("is_expert_parallel", False)})
        common = {k: v for k, v in saved[0].items() if k not in part}
        out.append(
            {**common, **part, "optimizer": {**saved[0]["optimizer"], "param_groups": dealt}}
        )
    return out[0] if len(subs) == 1 else dict(enumerate(out))


def _group_id(group: dict) -> tuple:
    """A param group's identity, reading NeMo's ``pre_`` spellings too."""
    return tuple(group.get(key, group.get(f"pre_{key}")) for key in _GROUP_KEYS)


@contextlib.contextmanager
def torch_adam_step_hidden(optimizer: Any) -> Iterator[None]:
    """Hide torch Adam's per-param ``step`` from megatron's distributed-optimizer state views.

    megatron 0.15's distributed optimizer treats every per-param state entry as a tensor shaped
    like the param's range. TransformerEngine's and Apex's Adam keep ``step`` per group, torch's
    own Adam (used when neither is installed, e.g. on CPU) keeps a 0-dim tensor per param, so
    ``dp_reshardable`` fails to save (shape assert) and every format fails to load
    (``KeyError: 'step'``). Inside this context the state views leave ``step`` out and a load
    keeps the live ``step`` (which megatron restores from the param groups just before).
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        get = getattr(opt, "_get_main_param_and_optimizer_states", None)
        put = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if (
            get is None
            or put is None
            or not isinstance(
                getattr(opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW)
            )
        ):
            continue

        def get_without_step(model_param, _get=get):  # noqa: ANN001, ANN202
            return {k: v for k, v in _get(model_param).items() if k != "step"}

        def put_keeping_step(model_param, tensors, _get=get, _put=put):  # noqa: ANN001, ANN202
            live = _get(model_param)
            if "step" in live and "step" not in tensors:
                tensors = {**tensors, "step": live["step"]}
            return _put(model_param, tensors)

        opt._get_main_param_and_optimizer_states = get_without_step
        opt._set_main_param_and_optimizer_states = put_keeping_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._get_main_param_and_optimizer_states
            del opt._set_main_param_and_optimizer_states

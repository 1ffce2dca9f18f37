"""The parity oracle: GTP at (TP=t, GTP=g, DP=d) reproduces non-GTP (TP=t, DP=g*d).

megatron-core GPTModel (local spec), megatron DDP and optimizer, fp32, same global batch:
losses, every gradient (gathered to full), grad norms and the weights after 10 optimizer steps
agree within 1e-5 relative.

One spawn per world size (process start + imports dominate on CPU); every case of a world size,
and the DDP group check, runs in it (module fixtures ``two_ranks`` / ``four_ranks``).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from nemo_gtp.testing.cpu_compat import enable_cpu_compat
from nemo_gtp.testing.gpt_harness import Run, assert_parity, gtp_groups, rel_err, train
from nemo_gtp.testing.spawn import Outcome, case_values, run_cases

# GTPConfig knobs that only act on GTP shards: a run without GTP (the reference) ignores them.
_GTP_ONLY = {
    "pad": Run.pad,
    "fp32_accum": Run.fp32_accum,
    "gather_backend": Run.gather_backend,
    "ce_min_tokens": Run.ce_min_tokens,
    "separate_rs": Run.separate_rs,
    "coalesce_mb": Run.coalesce_mb,
}


def _reference_run(case: Run) -> Run:
    """The non-GTP run ``case`` must reproduce (GTP-only knobs at their defaults)."""
    return dataclasses.replace(case, gtp=1, **_GTP_ONLY)


def _setup(rank: int, world: int) -> None:
    # First, not inside the first train(): an import there keeps a frame chain alive, and with
    # it the locals of whoever called the import (the first model, otherwise). megatron only:
    # these tests never need NeMo's patches (importing NeMo costs ~7 s CPU per rank).
    enable_cpu_compat(nemo=False)


_REFERENCES: dict[Run, dict] = {}


def _parity_case(rank: int, world: int, case: Run) -> float:
    """Train ``case`` and its reference (each reference once per process); check parity."""
    reference_run = _reference_run(case)
    if reference_run not in _REFERENCES:
        _REFERENCES[reference_run] = train(reference_run)
    reference = _REFERENCES[reference_run]
    result = train(case)
    runtime = result["runtime"]
    assert runtime is not None and len(runtime.params) == 8  # qkv, proj, fc1, fc2 x 2
    assert runtime.stats.fallback_allocations == 0
    assert runtime.stats.prefetches > 0
    # Live gathered buffers per chain: one-step-ahead keeps 2; a recompute forward inside the
    # backward prefetches the next recomputed weight beside them (one more).
    recomputed = {"full_uniform": 8, "full_block": 4, "selective_mlp": 4}.get(case.recompute, 0)
    units = [len(unit) for unit in next(iter(runtime.chains.values())).units]
    walk = units + units[::-1]  # a unit and the next one consumed (2 without coalescing)
    live = max(a + b for a, b in zip(walk, walk[1:]))
    assert units == ([4, 4] if case.coalesce_mb else [1] * 8), units
    assert max(runtime.max_live_buffers.values()) <= live + bool(recomputed)
    if recomputed:  # the recompute chain was observed (GTP weights re-run), linked and used
        chain = next(iter(runtime.chains.values()))
        assert len(chain.recompute_order) == recomputed
        assert chain.recompute_phase.value == "linked"
    try:
        worst = assert_parity(result, reference)
    except AssertionError as err:
        raise AssertionError(f"{case}: {err}") from None
    print(f"[parity] rank {rank} {case}: max rel err {worst:.2e}", flush=True)
    if case.shard_replicated:
        _check_replicated_state_sharded(case, result, reference)
    # Nothing outlives the model: weights, grad buffers and optimizer state are freed once
    # the training objects are dropped (DDP's GTP grad-ready hook holds only weak refs).
    runtime_ref = weakref.ref(runtime)
    del result, runtime
    gc.collect()
    assert runtime_ref() is None, f"{case}: the GTP model outlived every reference to it"
    return worst


def _check_replicated_state_sharded(case: Run, result: dict, reference: dict) -> None:
    """shard_replicated_params_over_gtp: each rank holds 1/(DP x GTP) of the Adam state, like
    the run without GTP at DP x GTP (bucket padding aside), not the replicated params in full."""
    held, ref_held = result["optimizer_state_numel"], reference["optimizer_state_numel"]
    assert abs(held / ref_held - 1) < 0.05, (
        f"{case}: {held} Adam elements per rank vs {ref_held} without GTP"
    )


CASES_2 = [
    Run(gtp=2),  # TP1·GTP2
    Run(gtp=2, per_token=True),  # per-token loss (SUM)
    Run(gtp=2, ffn=72, hidden=48, pad=16),  # padded shapes
    Run(gtp=2, distopt=True, overlap_grad_reduce=False),  # distributed optimizer, sync DDP
    Run(gtp=2, distopt=True, shard_replicated=True),  # replicated params over DP x GTP
    Run(gtp=2, recompute="full_uniform"),  # activation recompute: every layer re-run
    Run(gtp=2, recompute="full_block", distopt=True),  # first layer re-run
    Run(gtp=2, recompute="selective"),  # core attention re-run (no GTP weight)
    Run(gtp=2, recompute="selective_mlp"),  # the MLPs re-run: fc1 and fc2 re-gathered
    Run(gtp=2, coalesce_mb=0.125),  # one collective per layer and direction
    Run(gtp=2, coalesce_mb=0.125, recompute="full_uniform", distopt=True),
]
CASES_4 = [  # same TP adjacent: megatron's parallel_state is rebuilt only when TP changes
    Run(gtp=2),
    Run(gtp=2, distopt=True, per_token=True),  # TP1·GTP2·DP2
    Run(gtp=2, distopt=True, shard_replicated=True),  # ... replicated over DP x GTP
    Run(gtp=4),
    Run(gtp=4, fp32_accum=True),
    Run(gtp=4, ffn=72, pad=1),  # TP1·GTP4
    Run(gtp=4, distopt=True, fp32_accum=True, shard_replicated=True),
    Run(gtp=2, distopt=True, per_token=True, coalesce_mb=0.125, separate_rs=True),
    Run(tp=2, gtp=2),
    Run(tp=2, gtp=2, per_token=True, distopt=True),  # TP2·GTP2
    Run(tp=2, gtp=2, per_token=True, distopt=True, shard_replicated=True),
    Run(tp=2, gtp=2, coalesce_mb=0.0625, distopt=True),  # TP2: a layer's shards are halved
]


def _wrong_data_group_worker(rank: int, world: int) -> None:
    """DDP built with process groups that do not match the model's GTPConfig is refused."""
    import pytest
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from nemo_gtp.engine import GTPConfig, GTPRuntime, shard_linear
    from nemo_gtp.integrations.megatron import GTPDistributedDataParallel, gtp_process_groups

    groups = gtp_groups(Run(gtp=2))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    for over_gtp in (False, True):
        config = GTPConfig(shard_replicated_params_over_gtp=over_gtp)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32))
        runtime = GTPRuntime(groups, config)  # params hold their runtime weakly
        shard_linear(model[0], runtime, "0.weight")
        wrong = gtp_process_groups(groups, GTPConfig(shard_replicated_params_over_gtp=not over_gtp))
        with pytest.raises(ValueError, match=f"shard_replicated_params_over_gtp={over_gtp}"):
            GTPDistributedDataParallel(None, ddp_config, model, pg_collection=wrong)
        if not over_gtp:  # no pg_collection: megatron's data group (DP x GTP) would be used
            with pytest.raises(ValueError, match="gtp_process_groups"):
                GTPDistributedDataParallel(None, ddp_config, model)


def _full_state_dict_case(rank: int, world: int, case: Run) -> int:
    """``nemo_gtp.full_state_dict`` of a GTP model equals ``state_dict()`` of the same model
    built without GTP: bit for bit right after the build (identical init), within the parity
    tolerance after training (same keys, shapes and dtypes throughout)."""
    import torch

    from nemo_gtp import full_state_dict
    from nemo_gtp.integrations.megatron import unwrapped_module
    from nemo_gtp.testing.gpt_harness import build, train_built

    reference_run = _reference_run(case)
    reference, sharded = build(reference_run), build(case)
    assert len(sharded["model"].gtp_runtime.params) == 8

    def compare(exact: bool) -> int:
        want = unwrapped_module(reference["ddp"]).state_dict()
        got = full_state_dict(sharded["ddp"])  # through the DDP (and Float16Module) wrappers
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        for key, value in want.items():
            if not isinstance(value, torch.Tensor):
                continue
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
            if exact:
                assert torch.equal(got[key], value), f"{case}: {key} differs after the build"
            else:
                err = rel_err(got[key], value)  # the parity metric (Adam amplifies single ulps)
                assert err <= 1e-5, f"{case}: {key} after training: rel err {err:.2e}"
        return len(want)

    compare(exact=True)
    train_built(reference, reference_run)
    train_built(sharded, case)
    return compare(exact=False)


# TP2 first: the parity cases end at TP2 (megatron's state is rebuilt only when TP changes).
FULL_STATE_DICT_CASES_4 = [
    Run(tp=2, gtp=2, steps=3),  # TP2·GTP2
    Run(gtp=2, steps=3),  # TP1·GTP2·DP2
]


def _cases(runs: list[Run]) -> list:
    return [("setup", _setup, ()), *((f"parity {run}", _parity_case, (run,)) for run in runs)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    cases = _cases(CASES_2) + [("wrong data group", _wrong_data_group_worker, ())]
    return run_cases(cases, 2, tmp_path_factory.mktemp("parity2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    cases = _cases(CASES_4) + [
        (f"full_state_dict {run}", _full_state_dict_case, (run,)) for run in FULL_STATE_DICT_CASES_4
    ]
    return run_cases(cases, 4, tmp_path_factory.mktemp("parity4"))


def _check_all(outcomes: dict[str, list[Outcome]], runs: list[Run]) -> None:
    case_values(outcomes["setup"])
    for run in runs:
        case_values(outcomes[f"parity {run}"])


def test_parity_two_ranks(two_ranks: dict[str, list[Outcome]]) -> None:
    _check_all(two_ranks, CASES_2)


def test_ddp_refuses_groups_that_do_not_match_the_gtp_config(
    two_ranks: dict[str, list[Outcome]],
) -> None:
    case_values(two_ranks["wrong data group"])


def test_parity_four_ranks(four_ranks: dict[str, list[Outcome]]) -> None:
    _check_all(four_ranks, CASES_4)


def test_full_state_dict_equals_the_model_without_gtp(four_ranks: dict[str, list[Outcome]]) -> None:
    for run in FULL_STATE_DICT_CASES_4:
        assert all(n > 0 for n in case_values(four_ranks[f"full_state_dict {run}"]))

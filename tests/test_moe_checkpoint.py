"""Checkpoints of MoE models under expert GTP (design §3.3 "Routed experts").

A MoE GPT (megatron ``SequentialMLP`` experts) trained two steps at EP2·EGTP2 (distributed Adam)
is saved, then loaded into freshly built models at other layouts: the same one, EP2 without
expert GTP (expert DP2), EP1·EGTP4, and EP2·EGTP2 with dense GTP2. Every full weight (expert
ones gathered over EGTP and EP, keyed by global expert id) must equal the saved one bit for bit,
and two more training steps must reproduce the uninterrupted run's losses: bitwise at the same
layout, within the 1e-5 parity tolerance at the others (which sum in another order). One 4-rank
spawn runs every case.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from nemo_gtp.testing.gpt_harness import Run
from nemo_gtp.testing.spawn import Outcome, case_values, run_cases

SAVED = Run(experts=4, topk=2, hidden=32, ffn=64, moe_ffn=48, steps=2, distopt=True, ep=2, egtp=2)
LOADS = {
    "ep2-egtp2": SAVED,
    "ep2-egtp1": dataclasses.replace(SAVED, egtp=1),  # plain MoE at EP2, expert DP2
    "ep1-egtp4": dataclasses.replace(SAVED, ep=1, egtp=4),
    "gtp2-ep2-egtp2": dataclasses.replace(SAVED, gtp=2),  # dense GTP2 too: both axes shard
}
_STATE: dict[str, object] = {}


def _full_weights(setup: dict, run: Run) -> dict:
    """Every weight gathered to full, local expert indices turned into global ones."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_gtp import full_state_dict

    first = parallel_state.get_expert_model_parallel_rank() * (run.experts // run.ep)
    local = {
        re.sub(
            r"local_experts\.(\d+)\.", lambda m: f"experts.{first + int(m.group(1))}.", key
        ): value
        for key, value in full_state_dict(setup["ddp"]).items()
        if isinstance(value, torch.Tensor) and not key.endswith("_extra_state")
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    merged: dict = {}
    for part in every:
        for key, value in part.items():
            assert key not in merged or torch.equal(merged[key], value), f"replicas differ: {key}"
            merged[key] = value
    return merged


def _save_case(rank: int, world: int, root: str) -> int:
    from nemo_gtp.integrations.megatron.checkpoint import save_gtp_checkpoint
    from nemo_gtp.testing.cpu_compat import enable_cpu_compat
    from nemo_gtp.testing.gpt_harness import build, train_built

    enable_cpu_compat(nemo=False)
    setup = build(SAVED)
    train_built(setup, SAVED)
    _STATE["weights"] = _full_weights(setup, SAVED)
    save_gtp_checkpoint(root, setup["ddp"], setup["optimizer"], setup["groups"])
    _STATE["losses"] = train_built(setup, SAVED, first_step=SAVED.steps)["losses"]
    return len(_STATE["weights"])


def _load_case(rank: int, world: int, root: str, run: Run) -> float:
    import torch

    from nemo_gtp.integrations.megatron.checkpoint import load_gtp_checkpoint
    from nemo_gtp.testing.gpt_harness import build, rel_err, train_built

    setup = build(run)
    load_gtp_checkpoint(root, setup["ddp"], setup["optimizer"], setup["groups"])
    want, got = _STATE["weights"], _full_weights(setup, run)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key}: loaded weight differs from the saved one"
    losses = train_built(setup, run, first_step=SAVED.steps)["losses"]
    flat = [x for step in losses for x in step]
    expected = [x for step in _STATE["losses"] for x in step]
    if run == SAVED:
        assert flat == expected, f"resumed {flat} vs uninterrupted {expected}"
    worst = max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(flat, expected))
    assert worst <= 1e-5, f"resumed losses off by {worst:.2e} relative"
    return worst


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    out = tmp_path_factory.mktemp("moeckpt")
    root = str(out / "ckpt")
    cases = [
        ("save", _save_case, (root,)),
        *((f"load {name}", _load_case, (root, run)) for name, run in LOADS.items()),
    ]
    return run_cases(cases, 4, out)


def test_save_at_ep2_egtp2(four_ranks: dict[str, list[Outcome]]) -> None:
    assert all(n > 0 for n in case_values(four_ranks["save"]))


@pytest.mark.parametrize("name", list(LOADS))
def test_load_reshards_experts_and_resumes(four_ranks: dict[str, list[Outcome]], name: str) -> None:
    case_values(four_ranks["save"])
    assert all(err <= 1e-5 for err in case_values(four_ranks[f"load {name}"]))

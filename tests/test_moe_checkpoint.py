"""Checkpoints of MoE models under expert GTP (design §3.3 "Routed experts").

A MoE GPT (megatron ``SequentialMLP`` experts, built as their EGTP shards) trained two steps at
EP2·EGTP2 (distributed Adam) is saved, then loaded into freshly built models at other layouts:
the same one, EP2 without any GTP (expert DP2), EP1·EGTP4 (experts built full and sliced), and
EP2·EGTP2 with dense GTP2. Every full weight and every
optimizer state (expert ones gathered over EGTP and EP, keyed by global expert id) must equal
the saved one bit for bit, and two more training steps must reproduce the uninterrupted run's
losses: bitwise at the same layout, within the 1e-5 parity tolerance at the others (which sum in
another order).

The same for ``TEGroupedMLP`` experts (one TE ``GroupedLinear`` weight per expert; on CPU its
stand-in, ``tests.harness.te_grouped``; gated fc1), built as their EGTP shards: saved at
EP1·EGTP2, loaded without any GTP (EP1, expert DP4), that model saved again and loaded back at
EP1·EGTP2 (bitwise resume of the uninterrupted run), loaded at EP2·EGTP2 with dense GTP2, and the
``SequentialMLP`` checkpoint loaded into a ``TEGroupedMLP`` model (megatron gives both the same
per-expert keys). One 4-rank spawn runs every case.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.harness.gpt import Run
from tests.harness.spawn import Outcome, case_values, run_cases

# SequentialMLP experts built as their EGTP shards (the strategy's route: design §3.1 "Exact
# expert init"); one load builds them full and slices them (preshard_linears="none"'s route)
SAVED = Run(
    experts=4,
    topk=2,
    hidden=32,
    ffn=64,
    moe_ffn=48,
    steps=2,
    distopt=True,
    ep=2,
    egtp=2,
    preshard_experts=True,
)
LOADS = {
    "ep2-egtp2": SAVED,
    "ep2-egtp1": dataclasses.replace(SAVED, egtp=1),  # plain MoE at EP2, expert DP2: no GTP
    "ep1-egtp4": dataclasses.replace(SAVED, ep=1, egtp=4, preshard_experts=False),  # sliced
    "gtp2-ep2-egtp2": dataclasses.replace(SAVED, gtp=2),  # dense GTP2 too: both axes shard
}
_STATE: dict[str, object] = {}


# gated fc1: megatron stores each expert's [gate; up] rows through its SwiGLU factory
GROUPED = dataclasses.replace(SAVED, ep=1, grouped=True, presharded=True, glu=True)
GROUPED_LOADS = {
    "grouped ep1 no-gtp": dataclasses.replace(GROUPED, egtp=1, presharded=False),
    "grouped gtp2-ep2-egtp2": dataclasses.replace(GROUPED, ep=2, gtp=2),
}


def _state(setup: dict) -> dict:
    """Every weight and optimizer state, full, experts by global id (``moe_full_state``)."""
    from tests.harness.checkpoint import moe_full_state

    return moe_full_state(setup["ddp"], setup["optimizer"])


def _save_case(rank: int, world: int, root: str, run: Run = SAVED, key: str = "seq") -> int:
    from nemo_gtp.cpu.compat import enable_cpu_compat
    from nemo_gtp.integrations.megatron.checkpoint import save_gtp_checkpoint
    from tests.harness.gpt import build, train_built

    enable_cpu_compat(nemo=False)
    setup = build(run)
    train_built(setup, run)
    _STATE[key] = _state(setup)
    save_gtp_checkpoint(root, setup["ddp"], setup["optimizer"], setup["groups"])
    _STATE[f"{key} losses"] = train_built(setup, run, first_step=run.steps)["losses"]
    return len(_STATE[key])


def _load_case(
    rank: int,
    world: int,
    root: str,
    run: Run,
    key: str = "seq",
    resave: str | None = None,
    bitwise: bool | None = None,
) -> float:
    """Load ``root`` into ``run``'s fresh model: every weight and optimizer state equals the
    saved ``key`` run's bit for bit; optionally save it again to ``resave``; then two more
    steps reproduce the saved run's (bitwise at its layout, or when ``bitwise``)."""
    import torch

    from nemo_gtp.integrations.megatron.checkpoint import load_gtp_checkpoint, save_gtp_checkpoint
    from tests.harness.checkpoint import assert_same_state
    from tests.harness.gpt import build, rel_err, train_built

    setup = build(run)
    load_gtp_checkpoint(root, setup["ddp"], setup["optimizer"], setup["groups"])
    assert assert_same_state(_state(setup), _STATE[key]) > 0
    if resave is not None:
        save_gtp_checkpoint(resave, setup["ddp"], setup["optimizer"], setup["groups"])
    losses = train_built(setup, run, first_step=SAVED.steps)["losses"]
    flat = [x for step in losses for x in step]
    expected = [x for step in _STATE[f"{key} losses"] for x in step]
    if bitwise or run in (SAVED, GROUPED):
        assert flat == expected, f"resumed {flat} vs uninterrupted {expected}"
    worst = max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(flat, expected))
    assert worst <= 1e-5, f"resumed losses off by {worst:.2e} relative"
    return worst


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    out = tmp_path_factory.mktemp("moeckpt")
    root, grouped, plain = (str(out / name) for name in ("ckpt", "grouped", "grouped_plain"))
    cases = [
        ("save", _save_case, (root,)),
        *((f"load {name}", _load_case, (root, run)) for name, run in LOADS.items()),
        ("grouped save", _save_case, (grouped, GROUPED, "grouped")),
        (
            "load grouped ep1 no-gtp",
            _load_case,
            (grouped, GROUPED_LOADS["grouped ep1 no-gtp"], "grouped", plain),
        ),
        ("load grouped back", _load_case, (plain, GROUPED, "grouped", None, True)),
        (
            "load grouped gtp2-ep2-egtp2",
            _load_case,
            (grouped, GROUPED_LOADS["grouped gtp2-ep2-egtp2"], "grouped"),
        ),
        (
            "load sequential into grouped",
            _load_case,
            (root, dataclasses.replace(SAVED, grouped=True, presharded=True), "seq", None),
        ),
    ]
    return run_cases(cases, 4, out)


def test_save_at_ep2_egtp2(four_ranks: dict[str, list[Outcome]]) -> None:
    assert all(n > 0 for n in case_values(four_ranks["save"]))


@pytest.mark.parametrize("name", list(LOADS))
def test_load_reshards_experts_and_resumes(four_ranks: dict[str, list[Outcome]], name: str) -> None:
    case_values(four_ranks["save"])
    assert all(err <= 1e-5 for err in case_values(four_ranks[f"load {name}"]))


@pytest.mark.parametrize(
    "name",
    ["grouped ep1 no-gtp", "grouped back", "grouped gtp2-ep2-egtp2", "sequential into grouped"],
)
def test_grouped_experts_checkpoint_reshards(
    four_ranks: dict[str, list[Outcome]], name: str
) -> None:
    """``TEGroupedMLP`` experts: EP1·EGTP2 -> no GTP -> EP1·EGTP2 (bitwise resume), -> GTP2·EP2·
    EGTP2, and a ``SequentialMLP`` checkpoint into ``TEGroupedMLP``; weights and optimizer state
    bit for bit."""
    assert all(n > 0 for n in case_values(four_ranks["grouped save"]))
    assert all(err <= 1e-5 for err in case_values(four_ranks[f"load {name}"]))

"""Muon on GTP shards (design §1.6 "Muon"): the engine optimizer, real gloo collectives.

At GTP size 1 :class:`GTPMuon` is ``torch.optim.Muon`` bit for bit; on two GTP ranks a weight's
rows after a step equal the rows of the same step on the whole weight, bit for bit (padded
shapes too), with one all-gather per GTP group and step. Parity on megatron's GPTModel is in
``tests/test_parity_gpt.py`` (``optimizer="muon"`` cases), through NeMo in
``tests/test_strategy.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime
from nemo_gtp.engine.muon import GTPMuon, adjusted_lr, assign_owners, newton_schulz
from tests.harness.spawn import case_values, run_cases

SHAPES = [(40, 16), (24, 48), (32, 32)]  # tall (padded under GTP2 at pad 16), wide, square


def _weights(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False},
        {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
        {"momentum": 0.9, "ns_steps": 3},
    ],
)
def test_gtp_size_one_is_torch_muon(options: dict) -> None:
    """Without shards (and bf16 Newton–Schulz) the update is torch's Muon, bit for bit."""
    ours = [torch.nn.Parameter(w) for w in _weights(0)]
    theirs = [torch.nn.Parameter(w.clone()) for w in _weights(0)]
    mine = GTPMuon(ours, lr=0.02, **options)
    reference = torch.optim.Muon(theirs, lr=0.02, **options)
    for step in range(3):
        for params in (ours, theirs):
            for param, grad in zip(params, _grads(step)):
                param.grad = grad.clone()
        mine.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"


def test_newton_schulz_orthogonalizes_and_keeps_its_input() -> None:
    update = torch.randn(24, 48, generator=torch.Generator().manual_seed(3))
    before = update.clone()
    ortho = newton_schulz(update, steps=10, dtype=torch.float32)
    assert torch.equal(update, before)  # fp32 in, fp32 iterations: no in-place normalize
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.5 and singular.max() < 1.5, singular  # ~orthogonal rows
    assert newton_schulz(update.T, dtype=torch.float32).shape == (48, 24)
    assert adjusted_lr(0.02, None, (4096, 1024)) == pytest.approx(0.04)
    assert adjusted_lr(0.02, "match_rms_adamw", (16, 64)) == pytest.approx(0.032)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="2D params only"):
        GTPMuon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        GTPMuon([torch.nn.Parameter(torch.zeros(4, 4))], adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="orthogonalize"):
        GTPMuon([torch.nn.Parameter(torch.zeros(4, 4))], orthogonalize="rank0")
    from megatron.core.optimizer import OptimizerConfig

    from nemo_gtp.integrations.megatron.muon import MuonConfig, check_muon_config

    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        check_muon_config(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True))
    with pytest.raises(ValueError, match="ns_steps"):
        MuonConfig(ns_steps=0)
    with pytest.raises(ValueError, match="lr_mult"):
        MuonConfig(lr_mult=0.0)


def test_param_groups_split_muon_from_adam() -> None:
    """Muon takes the 2D weights but the embedding tables and the output layer, in every
    megatron group (kept even when empty), with its lr multiplier on top of the group's."""
    from nemo_gtp.integrations.megatron.muon import split_param_groups

    fc1, bias, table, head = (
        torch.nn.Parameter(torch.zeros(s)) for s in ((8, 4), (8,), (9, 4), (9, 4))
    )
    head.is_embedding_or_output_parameter = True
    groups = [
        {"params": [fc1, table, head], "wd_mult": 1.0, "lr_mult": 2.0},
        {"params": [bias], "wd_mult": 0.0, "lr_mult": 1.0},
    ]
    muon, adam = split_param_groups(groups, {id(table)}, lr_mult=10.0)
    assert [g["params"] for g in muon] == [[fc1], []]
    assert [g["params"] for g in adam] == [[table, head], [bias]]
    assert [g["lr_mult"] for g in muon] == [20.0, 10.0] and [g["lr_mult"] for g in adam] == [2, 1]
    assert [g["wd_mult"] for g in muon] == [1.0, 0.0]


def _shards_worker(
    rank: int, world: int, ns_dtype: torch.dtype, bucket_mb: float = 256.0, mode: str = "owner"
) -> int:
    """Two GTP ranks step their shards; every row equals the whole-weight step's, bitwise.
    Returns the collectives issued per step (``owner``: two all-to-alls per bucket;
    ``every_rank``: one all-gather)."""
    groups = GTPParallelDims(world_size=world, num_weight_shards=world).build()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=16))
    whole = [torch.nn.Parameter(w) for w in _weights(0)]
    shards = []
    for index, weight in enumerate(_weights(0)):
        holder = torch.nn.Module()
        holder.weight = torch.nn.Parameter(weight)
        shards.append(runtime.shard_parameter(holder, "weight", f"w{index}"))
    plain = torch.nn.Parameter(torch.ones(8, 8))  # a whole matrix beside the shards
    mine = GTPMuon(
        [*shards, plain],
        lr=0.02,
        ns_dtype=ns_dtype,
        gather_bucket_mb=bucket_mb,
        orthogonalize=mode,
    )
    reference = GTPMuon(whole, lr=0.02, ns_dtype=ns_dtype)
    gathers = []
    name = "all_to_all_single" if mode == "owner" else "all_gather_into_tensor"
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        for step in range(3):
            for shard, param, grad in zip(shards, whole, _grads(step)):
                param.grad = grad
                shard.grad = shard.gtp_spec.shard(grad)
            plain.grad = torch.full((8, 8), 0.5)
            mine.step()
            reference.step()
            for shard, param in zip(shards, whole):
                expected = shard.gtp_spec.shard(param.detach())
                assert torch.equal(shard.detach(), expected), (
                    f"step {step} {shard.gtp_state.name}: max diff "
                    f"{(shard.detach() - expected).abs().max()}"
                )
    finally:
        setattr(dist, name, original)
    assert shards[0].gtp_spec.pad_length > 0  # the tall weight is padded under GTP2
    return len(gathers) // 3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cases = []
    for mode in ("owner", "every_rank"):
        cases += [
            (f"fp32 {mode}", _shards_worker, (torch.float32, 256.0, mode)),
            (f"bf16 {mode}", _shards_worker, (torch.bfloat16, 256.0, mode)),
            # buckets of at most 6 KiB gathered (fp32 padded wholes: 4, 6 and 4 KiB): each
            # weight alone (a rank owning nothing in it), the next bucket in flight
            (f"buckets {mode}", _shards_worker, (torch.float32, 6 / 1024, mode)),
        ]
    return run_cases(cases, 2, tmp_path_factory.mktemp("muon"))


@pytest.mark.parametrize("mode, per_bucket", [("owner", 2), ("every_rank", 1)])
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_shards_step_as_the_whole_weight(
    two_ranks: dict, ns_dtype: str, mode: str, per_bucket: int
) -> None:
    """One bucket: one all-gather (every rank orthogonalizes), or two all-to-alls (shards to
    the owner, rows back)."""
    assert case_values(two_ranks[f"{ns_dtype} {mode}"]) == [per_bucket] * 2


@pytest.mark.parametrize("mode, per_bucket", [("owner", 2), ("every_rank", 1)])
def test_collectives_in_buckets(two_ranks: dict, mode: str, per_bucket: int) -> None:
    assert case_values(two_ranks[f"buckets {mode}"]) == [3 * per_bucket] * 2


def test_owners_balance_newton_schulz_work() -> None:
    """The largest matrix first, each to the least loaded rank; shapes alone decide."""
    assert assign_owners([(4096, 1024), (1024, 1024), (1024, 1024)], 2) == [0, 1, 1]
    assert assign_owners([(64, 64)] * 4, 2) == [0, 1, 0, 1]
    assert assign_owners([(64, 64)], 4) == [0]
    assert assign_owners([(1024, 4096), (4096, 1024)], 2) == [0, 1]  # the same cost either way


def test_recipe_checks_know_muons_settings() -> None:
    """The recipe checks run without torch, so they list Muon's settings themselves: the
    ``muon`` section's keys are ``MuonConfig``'s fields (but the coefficient tuple, which a
    recipe does not set), its names the engine's."""
    import dataclasses

    from nemo_gtp.engine.muon import ADJUST_LR_FNS, ORTHOGONALIZE
    from nemo_gtp.integrations.megatron.muon import MuonConfig
    from nemo_gtp.recipes import validate

    fields = {f.name for f in dataclasses.fields(MuonConfig)} - {"ns_coefficients"}
    assert set(validate.MUON_KEYS) == fields
    assert set(validate.MUON_ORTHOGONALIZE) == set(ORTHOGONALIZE)
    assert set(validate.MUON_ADJUST_LR_FNS) == {fn for fn in ADJUST_LR_FNS if fn is not None}

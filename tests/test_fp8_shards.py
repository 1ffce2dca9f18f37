"""FP8 GTP shards (engine plumbing, design §1.3): scale agreement, blockwise shards, gathers and
the in-place optimizer write-back, on real gloo collectives.

One 4-rank spawn runs every distributed case (module fixture ``four_ranks``): each case runs
once with the whole world as the GTP group (GTP 4) and once with two GTP groups of 2 ranks
holding different weights (GTP 2; the scale must agree within a group, not across groups). The
oracle is the quantization of the full (padded) weight on one rank, compared bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_gtp.engine.fp8 import (
    FP8_PRIMARY,
    GATHER_FP8,
    GATHER_TRAINING_DTYPE,
    FP8Scaling,
    FP8Shard,
    ScalingKind,
    all_gather_fp8,
    block_pad_for_alignment,
    check_block_alignment,
    check_fp8_training_for_gtp,
    check_low_precision_recipe,
    dense_gather_nbytes,
    quantize_into,
    quantize_shard,
    scale_from_amax,
)
from nemo_gtp.engine.fp8_gather import FP8Gathered
from nemo_gtp.engine.param import Direction, GTPShardedParam, ShardSpec
from tests.harness.spawn import Outcome, case_values, run_cases

PAD_GARBAGE = 1.0e4  # written into master pad rows: must reach neither amax nor data


# ------------------------------------------------------------------------------ helpers
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparisons, NaN-safe)."""
    return t.contiguous().view(torch.uint8)


def _assert_same(a: FP8Shard, b: FP8Shard, what: str) -> None:
    assert torch.equal(_bits(a.data), _bits(b.data)), f"{what}: FP8 data differs"
    assert torch.equal(_bits(a.scale_inv), _bits(b.scale_inv)), f"{what}: scale_inv differs"


def _gtp_group(rank: int, world: int, gtp: int) -> tuple[dist.ProcessGroup, int, int]:
    """(group, rank in it, index of the group): consecutive ranks, every rank builds all."""
    groups = [dist.new_group(list(range(s, s + gtp))) for s in range(0, world, gtp)]
    return groups[rank // gtp], rank % gtp, rank // gtp


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator)
    weight[seed % shape[0], seed % shape[1]] = 7.5 + seed  # one clear amax, on some rank
    return weight


def _master_shard(full: torch.Tensor, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
    """This rank's master shard with garbage in its pad rows (quantize must ignore them)."""
    shard = spec.shard(full).to(dtype)
    start = spec.gtp_rank * spec.shard_dim0
    real = max(0, min(spec.shard_dim0, spec.logical_shape[0] - start))
    shard[real:] = PAD_GARBAGE
    return shard


def _reference(full: torch.Tensor, spec: ShardSpec, scaling: FP8Scaling) -> FP8Shard:
    """The oracle: the padded full weight quantized on one rank (no collective)."""
    padded = F.pad(full, (0, 0, 0, spec.pad_length))
    return quantize_shard(padded, scaling)


def _gather_and_check(
    shard: FP8Shard, full: torch.Tensor, spec: ShardSpec, group, async_op: bool
) -> FP8Shard:
    gathered = shard.empty_gathered(spec.gtp_size)
    handle = all_gather_fp8(shard, gathered, group, async_op=async_op)
    handle.wait()
    ref = _reference(full, spec, shard.scaling)
    _assert_same(gathered, ref, "gathered vs full-tensor quantization")
    pad = gathered.data[spec.logical_shape[0] :]
    assert not _bits(pad).any(), "pad rows of the gathered weight are not zero"
    return gathered


# ------------------------------------------------------------------------------ workers
def _tensorwise_worker(rank: int, world: int, gtp: int, shape, pad: int, dtype) -> dict:
    """Per-tensor current scaling: one agreed scale; gather == full quantization, bit exact."""
    group, gtp_rank, index = _gtp_group(rank, world, gtp)
    full = _weight(shape, seed=10 + index).to(dtype).float()
    spec = ShardSpec.for_weight(shape, gtp, gtp_rank, pad)
    results = {}
    for fp8_dtype, options in [
        (torch.float8_e4m3fn, {}),
        (torch.float8_e5m2, {}),
        (torch.float8_e4m3fn, {"power_2_scales": True, "epsilon": 1e-3}),
    ]:
        scaling = FP8Scaling("tensorwise", fp8_dtype=fp8_dtype, **options)
        shard = quantize_shard(_master_shard(full, spec, dtype), scaling, group, spec=spec)
        assert shard.amax.item() == full.abs().max().item(), "amax is not the global real amax"
        expected = scale_from_amax(full.abs().max().reshape(1), scaling)
        assert torch.equal(shard.scale, expected) and torch.equal(shard.scale_inv, 1 / expected)
        for async_op in (False, True):
            gathered = _gather_and_check(shard, full, spec, group, async_op)
        # Independent of quantize_shard: the textbook formula on the full weight.
        m = torch.finfo(fp8_dtype).max
        textbook = (full * expected).clamp(-m, m).to(fp8_dtype)
        assert torch.equal(_bits(spec.unpad(gathered.data)), _bits(textbook))
        results[f"{fp8_dtype} {options}"] = shard.scale.item()
    return results


def _delayed_worker(rank: int, world: int, gtp: int) -> None:
    """Delayed scaling: the shard's own scale is used; the recorded amax is GTP-global."""
    group, gtp_rank, index = _gtp_group(rank, world, gtp)
    full = _weight((50, 24), seed=20 + index)
    spec = ShardSpec.for_weight(full.shape, gtp, gtp_rank, 4)
    scaling = FP8Scaling("delayed", margin=1)
    shard = FP8Shard.empty(spec.shard_shape, scaling)
    history_amax = torch.tensor([6.0])  # e.g. the max of an amax history, same on every peer
    shard.scale.copy_(scale_from_amax(history_amax, scaling, previous=shard.scale))
    assert torch.equal(shard.scale, torch.tensor([448.0]) / 6.0 / 2.0)
    quantize_into(_master_shard(full, spec, torch.float32), shard, group, spec=spec)
    assert shard.amax.item() == full.abs().max().item()
    gathered = shard.empty_gathered(gtp)
    all_gather_fp8(shard, gathered, group)
    m = scaling.fp8_max
    textbook = (F.pad(full, (0, 0, 0, spec.pad_length)) * shard.scale).clamp(-m, m)
    assert torch.equal(_bits(gathered.data), _bits(textbook.to(scaling.fp8_dtype)))
    # Zero amax keeps the previous scale under delayed scaling (1 under current scaling).
    kept = scale_from_amax(torch.zeros(1), scaling, previous=torch.tensor([3.0]))
    assert kept.item() == 3.0 and scale_from_amax(torch.zeros(1), scaling).item() == 1.0


def _blockwise_worker(rank: int, world: int, gtp: int, shape, block, pad: int) -> None:
    """Blockwise: local per-block scales; gathered (data, scale_inv) == full quantization."""
    group, gtp_rank, index = _gtp_group(rank, world, gtp)
    full = _weight(shape, seed=30 + index)
    full[: block[0]] *= 1e-3  # blocks of very different ranges
    spec = ShardSpec.for_weight(shape, gtp, gtp_rank, pad)
    check_block_alignment(spec, block, pad)
    scaling = FP8Scaling("blockwise", block=block)
    shard = quantize_shard(_master_shard(full, spec, torch.float32), scaling, spec=spec)
    gathered = _gather_and_check(shard, full, spec, group, async_op=gtp_rank % 2 == 0)
    assert gathered.scale is None and gathered.amax is None
    # Independent oracle: block by block with the textbook formula (power-of-two scales).
    padded = F.pad(full, (0, 0, 0, spec.pad_length))
    for i in range(0, padded.shape[0], block[0]):
        for j in range(0, padded.shape[1], block[1]):
            tile = padded[i : i + block[0], j : j + block[1]]
            amax = tile.abs().max()
            # 2**floor(log2(448 / amax)), the fp32 quotient's exponent read exactly by frexp.
            quotient = (torch.tensor(448.0) / amax).item()
            scale = 1.0 if amax == 0 else 2.0 ** (math.frexp(quotient)[1] - 1)
            got = gathered.scale_inv[i // block[0], j // block[1]].item()
            assert got == 1.0 / float(scale), (i, j, got, scale)
            want = (tile * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(
                _bits(gathered.data[i : i + block[0], j : j + block[1]]), _bits(want)
            )


def _write_back_worker(rank: int, world: int, gtp: int, kind: str) -> None:
    """Optimizer write-back: same tensors (addresses) re-filled; equals a fresh quantization."""
    group, gtp_rank, index = _gtp_group(rank, world, gtp)
    full = _weight((256, 96), seed=40 + index)
    block = (64, 32)
    spec = ShardSpec.for_weight(full.shape, gtp, gtp_rank, block_pad_for_alignment(block[0], 16))
    scaling = FP8Scaling(kind, block=block)
    master = torch.nn.Parameter(spec.shard(full))
    fp8 = quantize_shard(master.detach(), scaling, group, spec=spec)
    gathered = fp8.empty_gathered(gtp)
    all_gather_fp8(fp8, gathered, group)
    tensors = [fp8.data, fp8.scale, fp8.scale_inv, fp8.amax, gathered.data, gathered.scale_inv]
    addresses = [t.data_ptr() for t in tensors]
    optimizer = torch.optim.Adam([master], lr=0.5)
    for step in range(2):
        master.grad = torch.randn(master.shape, generator=torch.Generator().manual_seed(step))
        optimizer.step()
        quantize_into(master.detach(), fp8, group, spec=spec)
        all_gather_fp8(fp8, gathered, group)
        assert [t.data_ptr() for t in tensors] == addresses, "write-back reallocated a tensor"
        fresh = quantize_shard(master.detach(), scaling, group, spec=spec)
        _assert_same(fp8, fresh, f"write-back step {step}")
        assert torch.equal(fp8.scale, fresh.scale) and torch.equal(fp8.amax, fresh.amax)
        # The gathered buffer equals the full updated weight quantized on one rank.
        shards = [torch.empty_like(master) for _ in range(gtp)]
        dist.all_gather(shards, master.detach(), group=group)
        new_full = torch.cat(shards)[: full.shape[0]]
        _assert_same(gathered, _reference(new_full, spec, scaling), f"gather after step {step}")


def _bad_buffer_worker(rank: int, world: int) -> str:
    """A wrong gather buffer fails on every rank before the collective (no hang, no mismatch)."""
    shard = quantize_shard(torch.randn(8, 16), FP8Scaling())
    wrong = FP8Shard.empty((8 * world + 1, 16), FP8Scaling())
    with pytest.raises(ValueError, match="empty_gathered"):
        all_gather_fp8(shard, wrong, dist.group.WORLD)
    with pytest.raises(ValueError, match="gathered blockwise"):
        gathered = quantize_shard(torch.randn(8, 16), FP8Scaling("blockwise", block=(4, 4)))
        quantize_into(torch.randn(32, 16), gathered.empty_gathered(4))
    dist.barrier()  # still in step
    return "ok"


class _Consumer:
    """A pure-torch stand-in for TE's FP8 consumer (``QuantizedGather``): asks for FP8 per
    weight, fills the column-wise copy as TE's transpose kernel would, and hands back the
    dequantized weight; records what it was given."""

    transpose_for_backward = True

    def __init__(self, scaling: FP8Scaling) -> None:
        self.scaling = scaling
        self.dense: set[str] = set()  # weights whose forward runs in the training dtype
        self.seen: dict[tuple[str, str], FP8Gathered] = {}

    def forward_scaling(self, param: GTPShardedParam) -> FP8Scaling | None:
        return None if param.gtp_state.name in self.dense else FP8Scaling(**self.scaling_args)

    @property
    def scaling_args(self) -> dict:
        return {
            "kind": self.scaling.kind,
            "fp8_dtype": self.scaling.fp8_dtype,
            "power_2_scales": self.scaling.power_2_scales,
            "block": self.scaling.block,
        }

    def wrap(self, param: GTPShardedParam, direction: Direction, gathered: FP8Gathered):
        if gathered.transpose is not None:
            gathered.transpose.copy_(gathered.data.t())
        if gathered.columnwise_scale_inv is not None:  # blockwise: the transposed scale grid
            grid, target = gathered.scale_inv.t(), gathered.columnwise_scale_inv
            h, w = min(grid.shape[0], target.shape[0]), min(grid.shape[1], target.shape[1])
            target[:h, :w].copy_(grid[:h, :w])
        self.seen[(param.gtp_state.name, direction.value)] = gathered
        return gathered.dequantize(param.dtype)


RUNTIME_SHAPES = [(72, 64), (40, 48), (20, 64), (72, 64)]  # GTP 4: (20, 64) is one rank's rows


def _blockwise_reference(full: torch.Tensor, spec, scaling: FP8Scaling) -> FP8Shard:
    """The full weight quantized blockwise on one rank, its rows padded as the shards are."""
    padded = torch.zeros(spec.gathered_shape, dtype=torch.float32)
    padded[: full.shape[0]] = full.float()
    return quantize_shard(padded, scaling)


def _full_reference(full: torch.Tensor, spec, scaling: FP8Scaling) -> tuple[FP8Shard, int]:
    """The full weight quantized on one rank (blockwise: its rows padded as the shards are, so
    its tiles are the shards' tiles) and the number of real rows."""
    if scaling.kind is ScalingKind.BLOCKWISE:
        return _blockwise_reference(full, spec, scaling), full.shape[0]
    return quantize_shard(full.float(), scaling), full.shape[0]


def _check_gathered_view(got: FP8Gathered, ref: FP8Shard, rows: int, what: str) -> None:
    """A gathered FP8 view vs the one-rank reference: rows, and the scales (blockwise: in the
    padded, gather-ready layout)."""
    from nemo_gtp.engine.fp8_gather import padded_scale_shape

    if ref.scaling.kind is not ScalingKind.BLOCKWISE:
        _assert_same(FP8Shard(got.data, got.scale_inv, None, None, ref.scaling), ref, what)
        return
    assert torch.equal(_bits(got.data), _bits(ref.data[:rows])), f"{what}: FP8 rows"
    want = torch.zeros(padded_scale_shape(rows, got.data.shape[1], ref.scaling))
    want[:, : ref.scale_inv.shape[1]] = ref.scale_inv[: want.shape[0]]
    assert torch.equal(got.scale_inv, want), f"{what}: tile scales (padded layout)"


def _runtime_worker(
    rank: int, world: int, gtp: int, coalesce_mb: float, kind: str = "tensorwise"
) -> dict:
    """The runtime's FP8 gather through the protocol: bytes on the wire, bit-exact gathered
    weights, scales and transposes, one refresh per step (one amax all-reduce per tensor;
    blockwise: none, the block scales travel with the rows), stable buffers, format edges."""
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime
    from nemo_gtp.engine.fp8_gather import padded_scale_shape

    groups = GTPParallelDims(world_size=world, num_weight_shards=gtp).build()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=8, coalesce_mb=coalesce_mb))
    modules, fulls = [], []
    for i, shape in enumerate(RUNTIME_SHAPES):
        module = torch.nn.Module()
        full = _weight(shape, seed=40 + i).to(torch.bfloat16)
        module.weight = torch.nn.Parameter(full.clone())
        runtime.shard_parameter(module, "weight", f"w{i}")
        modules.append(module)
        fulls.append(full)
    params = [m.weight for m in modules]
    blockwise = kind == "blockwise"
    scaling = FP8Scaling(kind, block=(8, 16)) if blockwise else FP8Scaling(kind)
    consumer = _Consumer(scaling)

    def check(i: int, direction: str, out: torch.Tensor) -> None:
        """At the consume: the buffer is reused by later gathers of the same ticket."""
        name = params[i].gtp_state.name
        if name in consumer.dense or runtime.quantized_gather is None:
            assert torch.equal(out, fulls[i]), f"{name} {direction}: dense gather"
            return
        got = consumer.seen[(name, direction)]
        # cuBLAS refuses FP8 GEMMs whose scale pointer is not 16-byte aligned
        assert got.scale_inv.data_ptr() % 16 == 0, f"{name}: scale_inv not 16-byte aligned"
        # rows and scales vs the (blockwise: padded) full weight quantized on one rank
        ref, rows = _full_reference(fulls[i], params[i].gtp_spec, scaling)
        cols = fulls[i].shape[1]
        _check_gathered_view(got, ref, rows, name)
        assert torch.equal(out, ref.dequantize(torch.bfloat16)[:rows])
        if direction == "bwd":
            assert torch.equal(_bits(got.transpose), _bits(ref.data[:rows].t())), name
            if blockwise:
                assert got.columnwise_scale_inv.shape == padded_scale_shape(cols, rows, scaling)
        else:
            assert got.transpose is None and got.columnwise_scale_inv is None

    def step(drain: bool = True) -> dict:
        runtime.stats.reset()
        for i, p in enumerate(params):
            check(i, "fwd", p.materialize_group_for_forward()[0])
        for i, p in reversed(list(enumerate(params))):
            check(i, "bwd", p.materialize_group_for_backward()[0])
            p.finalize_group_grads(torch.zeros(p.gtp_spec.logical_shape, dtype=p.dtype))
        if drain:
            runtime.drain()
        else:  # the fences that do not mark the FP8 shards stale
            runtime.drain_reduce_scatters()
            runtime.drain_gathers()
        return dict(vars(runtime.stats))

    def update(i: int, factor: float) -> None:  # the optimizer: .data, invisible to versions
        params[i].data.mul_(factor)
        fulls[i] = (fulls[i].float() * factor).to(torch.bfloat16)

    # 1) training dtype: no consumer
    bf16 = step()
    assert bf16["fp8_gathers"] == 0
    # 2) FP8: same gathers, half the bytes; one amax all-reduce for all weights
    runtime.quantized_gather = consumer
    with torch.inference_mode():  # a first FP8 use in evaluation: buffers usable in training
        for i, p in enumerate(params):
            check(i, "fwd", p.materialize_group_for_forward()[0])
    runtime.drain()
    first = step()
    n = len(params)
    assert first["gathers"] == bf16["gathers"] == 2 * n and first["fp8_gathers"] == 2 * n
    scale_bytes = 0  # blockwise: the padded block scales travel too (4 bytes each)
    if blockwise:
        for p in params:
            shape = padded_scale_shape(*p.gtp_spec.gathered_shape, scaling)
            scale_bytes += 2 * (shape[0] * shape[1] * 4 * (gtp - 1) // gtp)
    assert 2 * (first["gather_bytes"] - scale_bytes) == bf16["gather_bytes"], (first, bf16)
    assert first["fp8_quantizes"] == 1 and first["fallback_allocations"] == 0
    # 3) steady state: weights change between steps, nothing is allocated, addresses stay
    allocations = runtime.weight_cache.allocations
    views = dict(consumer.seen)
    ptrs = {
        k: (v.data.data_ptr(), v.transpose is not None and v.transpose.data_ptr())
        for k, v in views.items()
    }
    for factor in (1.5, -0.25):
        update(1, factor)
        stats = step()
        assert stats["fp8_quantizes"] == 1 and stats["format_regathers"] == 0
        assert stats["gather_bytes"] == first["gather_bytes"]
    assert runtime.weight_cache.allocations == allocations
    for key, view in consumer.seen.items():
        assert view is views[key], f"{key}: the gathered view was rebuilt"
        transpose = view.transpose is not None and view.transpose.data_ptr()
        assert (view.data.data_ptr(), transpose) == ptrs[key]
    # 3b) a consume whose buffer another owner holds (a mispredicted order): gathered into a
    #     fallback buffer (rows, and blockwise their own scale buffer), the same bits
    held = params[0].gtp_state.fwd.cache
    intruder = object()
    assert held.try_acquire(intruder)
    runtime.stats.reset()
    check(0, "fwd", params[0].materialize_group_for_forward()[0])
    assert runtime.stats.fallback_allocations == 1
    held.release(intruder)
    runtime.drain()
    # 4) without a drain the FP8 shards are reused; a weight changed in place (its version
    #    counter moved) is quantized again
    step(drain=False)
    assert step(drain=False)["fp8_quantizes"] == 0
    with torch.no_grad():
        params[2].mul_(2.0)
    fulls[2] = (fulls[2].float() * 2.0).to(torch.bfloat16)
    assert step()["fp8_quantizes"] == 1
    # 5) the edge of an FP8 region: one weight runs in the training dtype
    consumer.dense = {"w1"}
    edge = step()
    assert edge["format_regathers"] > 0 and edge["fp8_gathers"] >= 2 * (n - 1)
    consumer.dense = set()
    step()
    # 6) a recipe the runtime does not gather: refused before any collective
    with pytest.raises(NotImplementedError, match="delayed"):
        runtime.materialize(params[0], Direction.FWD, fp8=FP8Scaling("delayed"))
    assert runtime.outstanding() == {"gathers": 0, "reduce_scatters": 0}
    return {
        "bytes": first["gather_bytes"] - scale_bytes,
        "bf16_bytes": bf16["gather_bytes"],
        "scale_bytes": scale_bytes,
    }


PRIMARY_SHAPES = [(72, 64), (40, 48), (20, 64)]  # GTP 4: (20, 64) is one rank's rows


def _primary_scaling(kind: str) -> FP8Scaling:
    """The FP8 primary cases' recipe: blockwise with small tiles (the shards' rows whole tiles
    at pad 8; 3 tile columns of a 48-wide weight exercise the padded scale layout)."""
    return FP8Scaling(kind, block=(8, 16)) if kind == "blockwise" else FP8Scaling(kind)


def _primary_runtime(
    world: int,
    gtp: int,
    dtype: torch.dtype,
    shapes,
    coalesce_mb: float = 0.0,
    factor: float = 1.0,
    kind: str = "tensorwise",
):
    """A runtime whose shards are FP8 primary weights (every rank builds the same fulls)."""
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime
    from nemo_gtp.engine.fp8_primary import make_fp8_primary

    groups = GTPParallelDims(world_size=world, num_weight_shards=gtp).build()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=8, coalesce_mb=coalesce_mb))
    fulls, params = [], []
    for i, shape in enumerate(shapes):
        module = torch.nn.Module()
        full = (_weight(shape, seed=60 + i) * factor).to(dtype)
        module.weight = torch.nn.Parameter(full.clone())
        runtime.shard_parameter(module, "weight", f"w{i}")
        params.append(module.weight)
        fulls.append(full)
    make_fp8_primary(runtime, _primary_scaling(kind))
    return groups, runtime, params, fulls


def _dp_slices(param, groups, whole: int | None = None) -> tuple[int, int]:
    """This replicate rank's flat slice of ``param``'s shard (megatron's distributed optimizer
    splits it over the replicate group); ``whole``: that replicate rank holds all of it."""
    size, rank = dist.get_world_size(groups.replicate), dist.get_rank(groups.replicate)
    n = param.numel()
    if whole is not None:
        return (0, n) if rank == whole else (0, 0)
    per = n // size
    return rank * per, (n if rank == size - 1 else (rank + 1) * per)


def _param_all_gather(param, groups, start: int, end: int) -> None:
    """megatron's param all-gather of the FP8 bytes over the replicate group (emulated)."""
    flat = param.detach().view(-1).view(torch.uint8)
    pieces = [torch.zeros_like(flat) for _ in range(dist.get_world_size(groups.replicate))]
    mine = torch.zeros_like(flat)
    mine[start:end] = flat[start:end]
    dist.all_gather(pieces, mine, group=groups.replicate)
    flat.copy_(torch.stack(pieces).sum(0, dtype=torch.uint8))  # disjoint slices: a sum is a cat


def _primary_worker(
    rank: int, world: int, gtp: int, coalesce_mb: float, kind: str = "tensorwise"
) -> dict:
    """FP8 primary shards: the runtime gathers their own bytes (no refresh cast), bit-exact vs
    the full weight quantized on one rank; the write-back from DP-sliced masters (amax agreed
    over replicate x GTP; blockwise: a tile's over the replicate group) gives the same bytes as
    quantizing the full master on one rank, also when it works through a slice in pieces."""
    from nemo_gtp.engine import fp8_write_back

    default = fp8_write_back.WRITE_BACK_CHUNK_ELEMENTS
    fp8_write_back.WRITE_BACK_CHUNK_ELEMENTS = 200  # every slice in several pieces (GTP 2 and 4)
    try:
        return _primary_checks(world, gtp, coalesce_mb, kind)
    finally:
        fp8_write_back.WRITE_BACK_CHUNK_ELEMENTS = default


def _primary_checks(world: int, gtp: int, coalesce_mb: float, kind: str) -> dict:
    from nemo_gtp.engine import gtp_linear
    from nemo_gtp.engine.fp8_gather import padded_scale_shape
    from nemo_gtp.engine.fp8_primary import (
        dequantize_fp8_primary,
        fp8_primary_init_value,
        is_fp8_primary,
        write_back_fp8_primary,
    )

    groups, runtime, params, fulls = _primary_runtime(
        world, gtp, torch.bfloat16, PRIMARY_SHAPES, coalesce_mb, kind=kind
    )
    scaling = _primary_scaling(kind)
    blockwise = scaling.kind is ScalingKind.BLOCKWISE
    for param, full in zip(params, fulls):
        spec = param.gtp_spec
        assert is_fp8_primary(param) and param.dtype == torch.float8_e4m3fn
        assert torch.equal(fp8_primary_init_value(param), spec.shard(full))
        ref, rows = _full_reference(full, spec, scaling)
        if blockwise:  # this shard's tiles, in the gather-ready layout
            tiles = spec.shard_dim0 // scaling.block[0]
            mine = ref.scale_inv[spec.gtp_rank * tiles : (spec.gtp_rank + 1) * tiles]
            assert torch.equal(param.gtp_state.fp8.scale_inv, mine), "tile scales"
            wire = param.gtp_state.fp8_scale_wire
            assert wire.shape == padded_scale_shape(*param.shape, scaling)
            assert not wire[:, mine.shape[1] :].any(), "pad columns"
            start = spec.gtp_rank * spec.shard_dim0
            want = ref.dequantize(torch.bfloat16)[start : start + spec.shard_dim0]
        else:
            assert torch.equal(param.gtp_state.fp8.scale_inv, ref.scale_inv), "scale not agreed"
            want = spec.shard(ref.dequantize(torch.bfloat16))  # pad rows: zero
        assert torch.equal(dequantize_fp8_primary(param), want)
    consumer = _Consumer(scaling)
    runtime.quantized_gather = consumer

    def step() -> dict:
        runtime.stats.reset()
        for p in params:
            p.materialize_group_for_forward()
        for p in reversed(params):
            p.materialize_group_for_backward()
            p.finalize_group_grads(torch.zeros(p.gtp_spec.logical_shape, dtype=torch.bfloat16))
        runtime.drain()
        return dict(vars(runtime.stats))

    def check_gathered(masters_full: list[torch.Tensor]) -> None:
        for param, full in zip(params, masters_full):
            ref, rows = _full_reference(full.to(torch.bfloat16), param.gtp_spec, scaling)
            for direction in ("fwd", "bwd"):
                got = consumer.seen[(param.gtp_state.name, direction)]
                assert got.scale_inv.data_ptr() % 16 == 0
                _check_gathered_view(got, ref, rows, f"{param.gtp_state.name} {direction}")

    for param in params:  # DDP's main_grad (training dtype)
        param.main_grad = torch.zeros(param.shape, dtype=torch.bfloat16)
    first = step()
    check_gathered(fulls)
    bf16_bytes = sum(dense_gather_nbytes(p.shape, torch.bfloat16, gtp) for p in params) * 2
    scale_bytes = 0  # blockwise: the padded tile scales travel beside the rows (4 bytes each)
    if blockwise:
        for p in params:
            shape = padded_scale_shape(*p.gtp_spec.gathered_shape, scaling)
            scale_bytes += 2 * (shape[0] * shape[1] * 4 * (gtp - 1) // gtp)
    assert 2 * (first["gather_bytes"] - scale_bytes) == bf16_bytes, (first, bf16_bytes)
    assert first["fp8_quantizes"] == 0 and first["fp8_gathers"] == first["gathers"]
    allocations = runtime.weight_cache.allocations
    ptrs = {k: v.data.data_ptr() for k, v in consumer.seen.items()}
    # outside the consumer's FP8 region (megatron's bf16 layers, evaluation without FP8) its
    # GEMM gets the dequantized weight in the training dtype, and so does the backward
    dense = params[1]
    consumer.dense.add(dense.gtp_state.name)
    ref1, rows1 = _full_reference(fulls[1], dense.gtp_spec, scaling)
    want = ref1.dequantize(torch.bfloat16)[:rows1]
    for got in (dense.materialize_group_for_forward(), dense.materialize_group_for_backward()):
        assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want)
    dense.finalize_group_grads(torch.zeros(dense.gtp_spec.logical_shape, dtype=torch.bfloat16))
    consumer.dense.clear()
    runtime.drain()
    # the autograd path (megatron-local linears): the dequantized gathered weight
    x = torch.randn(3, fulls[1].shape[1], dtype=torch.bfloat16)
    y = gtp_linear(x, params[1])
    assert torch.equal(y, x @ want.t())
    runtime.drain()
    # the optimizer write-back: fp32 masters sliced over the replicate group (one param held
    # whole by replicate rank 0, None elsewhere), amax over replicate then GTP
    masters_full = [
        (f.float() * 1.7 + 0.01 * _weight(f.shape, seed=80 + i)) for i, f in enumerate(fulls)
    ]
    masters_full[0][3, 5] = 200.0  # the amax sits on one GTP rank's rows only
    # blockwise at GTP 2: row 21 is in the tile of rows 16-23 that the two replicate ranks'
    # slices split (at row 20): its amax must be agreed over the replicate group
    masters_full[0][21, 2] = -150.0
    masters, offsets, ranges = [], [], []
    for i, (param, full) in enumerate(zip(params, masters_full)):
        shard = param.gtp_spec.shard(full).reshape(-1).clone()
        shard[_real(param) :] = PAD_GARBAGE
        start, end = _dp_slices(param, groups, whole=0 if i == 2 else None)
        masters.append(shard[start:end] if end > start else None)
        offsets.append(start if end > start else None)
        ranges.append((start, end))
    write_back_fp8_primary(params, masters, offsets, groups.replicate)
    for param, (start, end) in zip(params, ranges):
        _param_all_gather(param, groups, start, end)
    step()
    check_gathered(masters_full)
    assert runtime.weight_cache.allocations == allocations
    assert {k: v.data.data_ptr() for k, v in consumer.seen.items()} == ptrs
    # bad input: named before any collective
    with pytest.raises(ValueError, match="outside the shard"):
        write_back_fp8_primary(params[:1], [torch.zeros(5)], [params[0].numel()])
    if blockwise:
        return {"scale": None}
    return {"scale": params[0].gtp_state.fp8.scale_inv.item()}


def _primary_training_worker(rank: int, world: int, gtp: int, kind: str = "tensorwise") -> dict:
    """Three optimizer steps of a two-layer MLP whose weights are FP8 primary GTP shards
    (gtp_linear, fp32 masters sliced over the replicate group, SGD, write-back, param gather)
    against the same MLP without GTP on one rank: the weights it multiplies with are its fp32
    masters quantized whole, the same global batch."""
    from nemo_gtp.engine import gtp_linear
    from nemo_gtp.engine.fp8_primary import fp8_primary_init_value, write_back_fp8_primary

    shapes = [(48, 32), (20, 48)]
    groups, runtime, params, fulls = _primary_runtime(
        world, gtp, torch.float32, shapes, factor=0.2, kind=kind
    )
    scaling, lr, micro = _primary_scaling(kind), 0.05, 3

    def quantized(master: torch.Tensor, param) -> tuple[FP8Shard, int]:
        return _full_reference(master, param.gtp_spec, scaling)

    data = torch.randn(world, micro, 32, generator=torch.Generator().manual_seed(7))
    target = torch.randn(world, micro, 20, generator=torch.Generator().manual_seed(8))
    me = dist.get_rank(groups.data)
    masters, offsets, ranges = [], [], []
    for param in params:
        param.main_grad = torch.zeros(param.shape)
        start, end = _dp_slices(param, groups)
        flat = fp8_primary_init_value(param).float().reshape(-1)
        masters.append(torch.nn.Parameter(flat[start:end].clone()))
        offsets.append(start)
        ranges.append((start, end))
    optimizer = torch.optim.SGD(masters, lr=lr)
    ref_masters = [f.clone() for f in fulls]
    losses, ref_losses = [], []
    assert runtime.fp8_write_back_plan is None, "make_fp8_primary kept its one-off plan"
    plans = []  # held, so a rebuilt plan could not reuse an earlier one's id
    for _ in range(4):
        # GTP: this rank's microbatch; grads reduce-scattered (MEAN) over GTP, averaged over DP
        hidden = torch.relu(gtp_linear(data[me], params[0]))
        loss = F.mse_loss(gtp_linear(hidden, params[1]), target[me])
        loss.backward()
        runtime.drain()
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.data)
        losses.append(total.item() / world)
        for param, master, (start, end) in zip(params, masters, ranges):
            dist.all_reduce(param.main_grad, group=groups.replicate)
            master.grad = param.main_grad.reshape(-1)[start:end] / dist.get_world_size(
                groups.replicate
            )
        optimizer.step()
        write_back_fp8_primary(params, list(masters), offsets, groups.replicate)
        plans.append(runtime.fp8_write_back_plan)  # planned at the first step, then reused
        for param, (start, end) in zip(params, ranges):
            _param_all_gather(param, groups, start, end)
            param.main_grad.zero_()
        # the reference: the full fp32 masters quantized on one rank, the whole global batch
        weights = []
        for m, param in zip(ref_masters, params):
            ref, rows = quantized(m, param)
            weights.append(ref.dequantize()[:rows].requires_grad_())
        per_micro = [
            F.mse_loss(torch.relu(data[i] @ weights[0].t()) @ weights[1].t(), target[i])
            for i in range(world)
        ]
        ref_loss = torch.stack(per_micro).mean()
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        for m, w in zip(ref_masters, weights):
            m.sub_(lr * w.grad)
    # the FP8 weights after the last step, gathered, vs the reference masters quantized whole
    steps = []
    for param, ref in zip(params, ref_masters):
        spec = param.gtp_spec
        shards = [torch.empty_like(param).view(torch.uint8) for _ in range(gtp)]
        dist.all_gather(shards, param.detach().view(torch.uint8), group=groups.gtp)
        rows = spec.logical_shape[0]
        got = torch.cat(shards).view(param.dtype)[:rows]
        want, _ = quantized(ref, param)
        if scaling.kind is ScalingKind.BLOCKWISE:
            tiles = spec.shard_dim0 // scaling.block[0]
            mine = want.scale_inv[spec.gtp_rank * tiles : (spec.gtp_rank + 1) * tiles]
            assert torch.equal(param.gtp_state.fp8.scale_inv, mine), "tile scales differ"
        else:
            assert torch.equal(param.gtp_state.fp8.scale_inv, want.scale_inv), "scale differs"
        differ = (got.float() != want.data[:rows].float()).sum().item()
        steps.append(differ)
    # full_state_dict: the dequantized full weights, as the model without GTP holds them
    from nemo_gtp import full_state_dict

    holder = torch.nn.Module()
    for i, param in enumerate(params):
        setattr(holder, f"l{i}", torch.nn.Module())
        getattr(holder, f"l{i}").weight = param
    exported = full_state_dict(holder)
    dequantized = []
    for i, ref in enumerate(ref_masters):
        full, rows = quantized(ref, params[i])
        want = full.dequantize(params[i].gtp_state.fp8_primary_dtype)[:rows]
        got = exported[f"l{i}.weight"]
        dequantized.append(got.dtype == want.dtype and torch.equal(got, want))
    # other master tensors (twice the values) get a plan of their own, which reads them: the
    # same FP8 codes, every scale_inv of a nonzero amax doubled (exact: powers of two)
    codes = [param.detach().view(torch.uint8).clone() for param in params]
    scale_invs = [param.gtp_state.fp8.scale_inv.clone() for param in params]
    amaxes = [param.gtp_state.fp8.amax.clone() for param in params]  # zero: scale_inv stays 1
    doubled = [2 * master.detach() for master in masters]
    write_back_fp8_primary(params, doubled, offsets, groups.replicate)
    for param, (start, end) in zip(params, ranges):
        _param_all_gather(param, groups, start, end)
    rereads = [
        torch.equal(param.detach().view(torch.uint8), code)
        and torch.equal(param.gtp_state.fp8.scale_inv, torch.where(amax > 0, 2 * inv, inv))
        for param, code, inv, amax in zip(params, codes, scale_invs, amaxes)
    ]
    return {
        "rereads": rereads,
        "losses": losses,
        "ref_losses": ref_losses,
        "differing": steps,
        "exported_dequantized": dequantized,
        "write_back_plans": len({id(plan) for plan in plans}),
    }


def _real(param) -> int:
    """Elements of the shard's real rows (flat), design §1.3 pad rows after them."""
    spec = param.gtp_spec
    rows = max(0, min(spec.shard_dim0, spec.logical_shape[0] - spec.gtp_rank * spec.shard_dim0))
    return rows * (param.numel() // param.shape[0])


TENSORWISE = [
    ((75, 40), 16, torch.float32),  # pad 53 rows at GTP 4, 21 at GTP 2
    ((20, 40), 16, torch.bfloat16),  # GTP 4: ranks 2 and 3 hold only pad rows
]
RUNTIME_COALESCE = (0.0, 1.0)  # one weight per collective; all four weights in one unit
BLOCKWISE = [
    ((300, 200), (128, 128), 128),  # partial last column block; pad rows in the last blocks
    ((70, 300), (1, 128), 16),  # TE's 1x128: any shard rows work
    ((90, 40), (8, 16), 8),
]


def _cases() -> list:
    cases = [("bad buffer", _bad_buffer_worker, ())]
    for gtp in (2, 4):
        for i, (shape, pad, dtype) in enumerate(TENSORWISE):
            cases.append((f"tensorwise {gtp} {i}", _tensorwise_worker, (gtp, shape, pad, dtype)))
        cases.append((f"delayed {gtp}", _delayed_worker, (gtp,)))
        for i, (shape, block, pad) in enumerate(BLOCKWISE):
            cases.append((f"blockwise {gtp} {i}", _blockwise_worker, (gtp, shape, block, pad)))
        for kind in ("tensorwise", "blockwise"):
            cases.append((f"write-back {gtp} {kind}", _write_back_worker, (gtp, kind)))
    for gtp in (2, 4):  # last: a failure here stops no other case
        for coalesce_mb in RUNTIME_COALESCE:
            cases.append((f"runtime {gtp} {coalesce_mb}", _runtime_worker, (gtp, coalesce_mb)))
            cases.append(
                (
                    f"runtime blockwise {gtp} {coalesce_mb}",
                    _runtime_worker,
                    (gtp, coalesce_mb, "blockwise"),
                )
            )
        for kind in ("tensorwise", "blockwise"):
            coalesce = 1.0 if gtp == 2 else 0.0
            cases.append((f"primary {gtp} {kind}", _primary_worker, (gtp, coalesce, kind)))
            cases.append((f"primary training {gtp} {kind}", _primary_training_worker, (gtp, kind)))
    return cases


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcome]]:
    """Every distributed case of this module in one 4-rank spawn."""
    return run_cases(_cases(), 4, tmp_path_factory.mktemp("fp8_shards"))


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("i", range(len(TENSORWISE)))
def test_tensorwise_scale_agreement(four_ranks: dict, gtp: int, i: int) -> None:
    scales = case_values(four_ranks[f"tensorwise {gtp} {i}"])
    for start in range(0, 4, gtp):  # one scale per GTP group; the GTP-2 groups differ
        assert all(s == scales[start] for s in scales[start : start + gtp])
    if gtp == 2:
        assert scales[0] != scales[2]


@pytest.mark.parametrize("gtp", [2, 4])
def test_delayed_scaling(four_ranks: dict, gtp: int) -> None:
    case_values(four_ranks[f"delayed {gtp}"])


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("i", range(len(BLOCKWISE)))
def test_blockwise_gather_bit_exact(four_ranks: dict, gtp: int, i: int) -> None:
    case_values(four_ranks[f"blockwise {gtp} {i}"])


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("kind", ["tensorwise", "blockwise"])
def test_write_back_in_place(four_ranks: dict, gtp: int, kind: str) -> None:
    case_values(four_ranks[f"write-back {gtp} {kind}"])


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("coalesce_mb", RUNTIME_COALESCE)
def test_runtime_fp8_gather(four_ranks: dict, gtp: int, coalesce_mb: float) -> None:
    """GTPRuntime gathers FP8 bytes for a quantized consumer (design §1.3 "FP8 gather")."""
    values = case_values(four_ranks[f"runtime {gtp} {coalesce_mb}"])
    assert all(2 * v["bytes"] == v["bf16_bytes"] for v in values)


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("coalesce_mb", RUNTIME_COALESCE)
def test_runtime_blockwise_fp8_gather(four_ranks: dict, gtp: int, coalesce_mb: float) -> None:
    """Blockwise FP8 gathers (design §1.3 "FP8 gather"): each rank quantizes its own blocks,
    rows and padded block scales gathered in one collective, bit for bit the full weight's
    blockwise quantization; the rows' bytes are half of bf16's, the scales come on top."""
    values = case_values(four_ranks[f"runtime blockwise {gtp} {coalesce_mb}"])
    assert all(2 * v["bytes"] == v["bf16_bytes"] and v["scale_bytes"] > 0 for v in values)


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("kind", ["tensorwise", "blockwise"])
def test_fp8_primary_gather_and_write_back(four_ranks: dict, gtp: int, kind: str) -> None:
    """FP8 primary shards (design §1.3 "FP8 primary weights"): gathered as they are (blockwise:
    with their tile scales), written back from DP-sliced fp32 masters with one scale over
    replicate x GTP (blockwise: one per tile, over the replicate group)."""
    scales = [v["scale"] for v in case_values(four_ranks[f"primary {gtp} {kind}"])]
    assert len(set(scales)) == 1


@pytest.mark.parametrize("gtp", [2, 4])
@pytest.mark.parametrize("kind", ["tensorwise", "blockwise"])
def test_fp8_primary_training_matches_full_weight(four_ranks: dict, gtp: int, kind: str) -> None:
    """Optimizer steps with FP8 primary GTP shards (GTP x DP = 4) reproduce the run without
    GTP whose weights are its full masters quantized on one rank; ``full_state_dict`` exports
    them as those quantized masters' values."""
    for value in case_values(four_ranks[f"primary training {gtp} {kind}"]):
        for got, want in zip(value["losses"], value["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (value["losses"], value["ref_losses"])
        assert value["differing"] == [0, 0], value["differing"]
        # nemo_gtp.full_state_dict returns them dequantized (not raw FP8 codes), bit for bit
        assert value["exported_dequantized"] == [True, True]
        # the write-back is planned at the first step and that plan serves every later one
        assert value["write_back_plans"] == 1, value["write_back_plans"]
        assert value["rereads"] == [True, True], value["rereads"]


def test_fp8_primary_unsupported_recipe_named() -> None:
    """Delayed FP8 primary shards are refused naming fp8_recipe (before any collective: no
    runtime needed)."""
    from nemo_gtp.engine.fp8_primary import make_fp8_primary

    with pytest.raises(NotImplementedError, match="fp8_recipe='delayed'"):
        make_fp8_primary(None, FP8Scaling("delayed"))


def test_bad_gather_buffer(four_ranks: dict) -> None:
    assert case_values(four_ranks["bad buffer"]) == ["ok"] * 4


# --------------------------------------------------------------------- single-process tests
def test_blockwise_refresh_skips_shards_that_split_blocks() -> None:
    """The blockwise FP8 refresh quantizes every shard of whole blocks (no collective) and
    leaves a shard whose rows would split a block alone: its consumer gathers it in the
    training dtype (TE's, for a shard that is not whole 128-row tiles)."""
    from nemo_gtp.engine import GTPShardedParam, ShardSpec
    from nemo_gtp.engine.fp8_gather import FP8ShardCache

    params = []
    for rows in (32, 24):  # 2 blocks of 16 rows; 1.5 blocks
        spec = ShardSpec.for_weight((rows, 40), 1, 0, 1)
        params.append(GTPShardedParam(_weight((rows, 40), seed=rows), False, spec=spec))
    scaling = FP8Scaling("blockwise", block=(16, 16))
    FP8ShardCache().refresh(params, scaling, None)
    whole, split = params
    ref = quantize_shard(whole.detach().float(), scaling)
    assert torch.equal(_bits(whole.gtp_state.fp8.data), _bits(ref.data))
    assert whole.gtp_state.fp8_scale_wire.shape == (2, 4)  # 3 column blocks, padded to 4
    assert torch.equal(whole.gtp_state.fp8_scale_wire[:, :3], ref.scale_inv)
    assert split.gtp_state.fp8 is None


def test_block_alignment_check() -> None:
    """Which pad_for_alignment blockwise shards need, and the error naming it."""
    assert block_pad_for_alignment(128, 16) == 128
    assert block_pad_for_alignment(1, 16) == 16
    assert block_pad_for_alignment(48, 32) == 96
    spec = ShardSpec.for_weight((300, 256), gtp_size=2, gtp_rank=0, pad_for_alignment=16)
    with pytest.raises(ValueError, match=r"GTPConfig\.pad_for_alignment=128"):
        check_block_alignment(spec, (128, 128), 16)
    check_block_alignment(spec, (1, 128), 16)  # 1x128 blocks never split
    aligned = ShardSpec.for_weight((300, 256), 2, 0, block_pad_for_alignment(128, 16))
    check_block_alignment(aligned, (128, 128), 16)
    with pytest.raises(ValueError, match="pad_for_alignment"):
        FP8Shard.empty(spec.shard_shape, FP8Scaling("blockwise"))


def test_gather_bytes_half_of_bf16() -> None:
    """An FP8 gather moves half the bytes of a BF16 one (plus block scales for blockwise)."""
    shape = (256, 512)
    tensorwise = FP8Shard.empty(shape, FP8Scaling("tensorwise"))
    bf16 = dense_gather_nbytes(shape, torch.bfloat16, 4)
    assert 2 * tensorwise.gather_nbytes(4) == bf16 == 3 * 256 * 512 * 2
    blockwise = FP8Shard.empty(shape, FP8Scaling("blockwise"))
    assert blockwise.gather_nbytes(4) == bf16 // 2 + 3 * 2 * 4 * 4  # 2x4 fp32 block scales
    assert FP8Shard.empty(shape, FP8Scaling("blockwise", block=(1, 128))).gather_nbytes(2) == (
        256 * 512 + 256 * 4 * 4
    )


def test_scale_formula_edges() -> None:
    """TE's current-scaling edge cases: zero / inf amax, tiny amax, epsilon, power of two."""
    scaling = FP8Scaling()
    amax = torch.tensor([2.0, 0.0, float("inf"), 1e-44, 3.0])
    scale = scale_from_amax(amax, scaling)
    fmax = torch.finfo(torch.float32).max
    assert scale.tolist() == [224.0, 1.0, 1.0, fmax, torch.tensor(448.0 / 3.0).item()]
    assert scale_from_amax(amax, FP8Scaling(epsilon=1.0)).tolist()[:2] == [224.0, 448.0]
    pow2 = scale_from_amax(amax, FP8Scaling(power_2_scales=True)).tolist()
    assert pow2 == [128.0, 1.0, 1.0, 2.0**127, 128.0]
    assert scale_from_amax(torch.tensor([1.0]), FP8Scaling(fp8_dtype=torch.float8_e5m2)) == 57344
    assert FP8Scaling("blockwise").power_2_scales and not FP8Scaling().power_2_scales


def test_dequantize_round_trip() -> None:
    """dequantize() is within FP8's relative precision of the master (E4M3: 2**-4)."""
    master = torch.randn(64, 96)
    for scaling in (FP8Scaling(), FP8Scaling("blockwise", block=(16, 32))):
        back = quantize_shard(master, scaling).dequantize()
        assert torch.allclose(back, master, rtol=2**-4, atol=master.abs().max().item() * 2**-9)


def test_bad_scaling_settings() -> None:
    with pytest.raises(ValueError, match="fp8_recipe"):
        FP8Scaling("mxfp8")
    with pytest.raises(ValueError, match="fp8_dtype"):
        FP8Scaling(fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        FP8Shard.empty((4, 4, 4), FP8Scaling("blockwise", block=(1, 4)))
    with pytest.raises(ValueError, match="master shard"):
        quantize_into(torch.zeros(4, 4, dtype=torch.int32), FP8Shard.empty((4, 4), FP8Scaling()))


HOPPER, BLACKWELL, AMPERE, ADA = (9, 0), (10, 0), (8, 0), (8, 9)


@pytest.mark.parametrize(
    "kwargs, capability, match",
    [
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, HOPPER, "fp8_recipe='mxfp8'.*10.0"),
        ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, None, "fp8_recipe='mxfp8'.*a CPU"),
        ({"fp8": None, "fp4": "e2m1"}, HOPPER, "fp4='e2m1'.*10.0"),
        ({"fp8": None, "fp4": "e2m1"}, None, "fp4='e2m1'.*a CPU"),
        ({"fp8": "e4m3", "fp4": "e2m1", "fp4_recipe": "mx"}, BLACKWELL, "fp4_recipe"),
        ({"fp8": "e4m3", "fp8_recipe": "tensorwise"}, AMPERE, "fp8='e4m3'.*8.9"),
        ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, ADA, "fp8_recipe='blockwise'.*9.0"),
        ({"fp8": "e4m3", "fp8_recipe": "custom"}, HOPPER, "fp8_recipe must be one of"),
        ({"fp8": "e5m2"}, HOPPER, "fp8 must be one of"),
    ],
)
def test_recipe_rejected(kwargs: dict, capability, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_low_precision_recipe(capability=capability, **kwargs)


def test_recipe_accepted() -> None:
    assert check_low_precision_recipe(None, capability=HOPPER) is None  # FP8 off
    for recipe in ("delayed", "tensorwise", "blockwise"):
        for capability in (HOPPER, BLACKWELL, None):
            kind = check_low_precision_recipe("e4m3", recipe, capability=capability)
            assert kind is ScalingKind(recipe)
    assert check_low_precision_recipe("hybrid", "tensorwise", capability=ADA) is (
        ScalingKind.TENSORWISE
    )
    # Supported hardware, shards not implemented yet: a clear NotImplementedError.
    with pytest.raises(NotImplementedError, match="MXFP8"):
        check_low_precision_recipe("e4m3", "mxfp8", capability=BLACKWELL)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        check_low_precision_recipe(None, fp4="e2m1", capability=BLACKWELL)


@pytest.mark.parametrize(
    "kwargs, capability, match",
    [
        ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, HOPPER, "fp8_recipe='mxfp8'.*10.0.*9.0"),
        ({"fp8": None, "fp4": "e2m1"}, HOPPER, "fp4='e2m1'.*10.0"),
        ({"fp8": "e4m3", "fp8_param": True}, None, "fp8_param=True.*'delayed'.*tensorwise"),
        (
            {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True},
            BLACKWELL,
            "fp8_param=True.*'mxfp8' is not supported with GTP",
        ),
        ({"fp8": None, "fp4": "e2m1", "fp8_param": True}, BLACKWELL, "fp8_param=True.*fp4="),
        ({"fp8": "e4m3", "fp8_recipe": "tensorwise"}, AMPERE, "fp8='e4m3'.*8.9"),
        ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, ADA, "blockwise'.*9.0"),
        ({"fp8": "e5m2"}, None, "fp8 must be one of"),
        ({"fp8": "e4m3", "fp8_recipe": "current"}, None, "fp8_recipe must be one of"),
    ],
)
def test_fp8_training_rejected(kwargs: dict, capability, match: str) -> None:
    """FP8 compute under GTP: what this stack cannot run, with the setting named."""
    with pytest.raises(ValueError, match=match):
        check_fp8_training_for_gtp(capability=capability, **kwargs)
    keys = {"fp8_recipe": "fp8.recipe", "fp8": "fp8.format", "fp8_param": "fp8.param_gather"}
    with pytest.raises(ValueError, match=r"fp8\.(recipe|format|param_gather)|fp4"):
        check_fp8_training_for_gtp(capability=capability, keys=keys, **kwargs)


def test_fp8_training_gather_format() -> None:
    """Which gather a GTP run gets: FP8 bytes for per-tensor current scaling and blockwise,
    else bf16."""
    assert check_fp8_training_for_gtp(None, capability=HOPPER) is None
    assert check_fp8_training_for_gtp("hybrid", "tensorwise", capability=HOPPER) == GATHER_FP8
    assert check_fp8_training_for_gtp("e4m3", "blockwise", capability=HOPPER) == GATHER_FP8
    assert check_fp8_training_for_gtp("e4m3", "delayed", capability=HOPPER) == (
        GATHER_TRAINING_DTYPE
    )
    # Blackwell (or an unknown device: the launcher) may run MXFP8 / NVFP4; bf16 is gathered
    for capability in (BLACKWELL, None):
        assert check_fp8_training_for_gtp("e4m3", "mxfp8", capability=capability) == (
            GATHER_TRAINING_DTYPE
        )
        assert check_fp8_training_for_gtp(None, fp4="e2m1", capability=capability) == (
            GATHER_TRAINING_DTYPE
        )
    # FP8 primary weights are a GTP question only when FP8 is on; per-tensor current scaling
    # and blockwise: the shards are FP8 (design §1.3 "FP8 primary weights")
    assert check_fp8_training_for_gtp(None, fp8_param=True) is None
    for capability in (HOPPER, None):
        for recipe in ("tensorwise", "blockwise"):
            assert check_fp8_training_for_gtp(
                "hybrid", recipe, fp8_param=True, capability=capability
            ) == (FP8_PRIMARY)


def test_fp8_primary_megatron_ddp_settings_named() -> None:
    """megatron DDP with FP8 primary shards: grad_reduce_in_fp32 and the distributed optimizer
    required, each refusal naming its setting (design §1.3 "The megatron hook"); the hooks
    leave every other tensor to megatron (a CPU tensor is no FP8 param; no FP8 params: no-op)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from megatron.core.optimizer import distrib_optimizer

    from nemo_gtp.integrations.megatron.fp8_primary import (
        check_fp8_primary_ddp,
        fp8_primary_hooks_installed,
        install_fp8_primary_hooks,
    )

    ok = dict(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    check_fp8_primary_ddp(DistributedDataParallelConfig(**ok))
    for key in ok:
        with pytest.raises(ValueError, match=f"{key}=True"):
            check_fp8_primary_ddp(DistributedDataParallelConfig(**{**ok, key: False}))
    install_fp8_primary_hooks()
    install_fp8_primary_hooks()  # idempotent: wrapped once
    assert fp8_primary_hooks_installed()
    original = distrib_optimizer.is_float8tensor._nemo_gtp_fp8_primary
    assert not hasattr(original, "_nemo_gtp_fp8_primary")
    assert not buffers.is_float8tensor(torch.zeros(2))
    distrib_optimizer.quantize_param_shard([], [], [], None)

"""FP8 under GTP on 2 GPUs: GTP2 vs DP2 (TE's FP8 path): FP8 gathers, TE quantizing bf16 gathers.

Question: Does FP8 under GTP (FP8 gathers, consumer-quantized bf16 gathers, FP8 primary shards)
track TE's own FP8 path on loss and match TE's quantizer bit for bit?

Ranks: NCCL, one rank per GPU (``torchrun``); ``--shared-device``: both ranks on one GPU through
the staged gloo backend; ``--cpu-smoke``: gloo with TE stand-ins.

    torchrun --nproc-per-node 2 -m bench.gpu_fp8_check --out bench/results/fp8_check

A small megatron-core GPT with the TransformerEngine layer spec (bf16 weights, Float16Module,
GTP-aware DDP, distributed Adam), trained from the same initial weights on the same batches
under TE's FP8 autocast (megatron ``fp8="hybrid"``), in these modes:

- ``fp8_dp2``: TP1·DP2, per-tensor current scaling (``fp8_recipe="tensorwise"``), TE's own
  FP8 path (the reference of the tensorwise modes);
- ``fp8_gtp2``: TP1·GTP2, linears built as shards; the runtime gathers the FP8 copy of the
  shards and TE gets ``Float8Tensor`` weights (design §1.3 "FP8 gather");
- ``fp8_gtp2_bf16_gather``: as ``fp8_gtp2`` with ``GTPConfig(fp8_gather=False)``: bf16 is
  gathered, TE quantizes the gathered weight in its forward, and the backward gather is
  quantized as the forward was by GTP's TE consumer (design §1.3 "Consumer-quantized
  backward"; without it TE's dgrad GEMM gets a bf16 weight and an FP8 grad: cuBLAS error);
- ``fp8delayed_dp2`` / ``fp8delayed_gtp2``: megatron's default ``fp8_recipe="delayed"``
  (TE's ``DelayedScaling``), DP2 and GTP2 (bf16 gathers, the backward quantized with the
  forward's scale);
- ``fp8block_dp2`` / ``fp8block_gtp2``: ``fp8_recipe="blockwise"`` (TE's Float8BlockScaling,
  Hopper; 128x128 weight tiles): GTP2 gathers FP8 rows and tile scales (each rank quantizes
  its own tiles) and TE gets a ``Float8BlockwiseQTensor``; ``fp8block_gtp2_bf16_gather``:
  bf16 gathers, TE quantizes the gathered weight, the backward as above;
- ``bf16_gtp2``: TP1·GTP2 without FP8 (the bf16 gather's bytes per step);
- ``fp8param_dp2`` / ``fp8param_gtp2``: per-tensor current scaling with megatron's
  ``fp8_param`` (FP8 primary weights; megatron builds the layers inside TE's FP8 param init):
  DP2 on TE's own ``Float8Tensor`` params (their kept init values pointed at the loaded
  weights), GTP2 with the TE linears built plain as shards and made GTP's FP8 primary shards by
  ``shard_model`` (design §1.3 "FP8 primary weights");
- ``fp8blockparam_dp2`` / ``fp8blockparam_gtp2``: the same with ``fp8_recipe="blockwise"``:
  DP2 on TE's own ``Float8BlockwiseQTensor`` params, GTP2 on FP8 primary shards that own their
  128x128 tiles (after training, ``block_primary_checks``: what GTP hands TE vs TE's
  ``Float8BlockQuantizer`` on the full fp32 masters, bit for bit);
- ``fp8_dp2_split`` / ``fp8block_dp2_split`` / ``bf16_dp2_split``: the DP2 twin again with
  every micro-batch run as two halves (same samples, loss and weights; every wgrad sums in
  another order, as GTP2's per-micro-batch reduce-scatters do): the noise floor printed beside
  the judged pair; ``bf16_dp2`` the bf16 twin; ``*_dp2_rebucket``: DP2 with 1M-element grad
  buckets (only the grad norm's partial sums round differently: a lower bound).

Checks (``checks`` in the JSON): after ``fp8_gtp2`` trained, every GTP weight's gathered
``Float8Tensor`` (forward) and its column-wise copy (backward) against TE's own
``Float8CurrentScalingQuantizer`` applied to the full weight, bit for bit; the gathered buffers'
addresses and the weight cache's allocation count over the steady-state steps; FP8 shard
refreshes (amax all-reduces) and FP8 gathers per step. After ``fp8block_gtp2``: every GTP
weight's gathered ``Float8BlockwiseQTensor`` (row-wise data and tile scales forward, column-wise
data and scales backward) against TE's ``Float8BlockQuantizer`` on the full weight, bit for bit,
and every gather FP8.

For the bf16-gather FP8 modes (``fp8_gtp2_bf16_gather``, ``fp8delayed_gtp2``,
``fp8block_gtp2_bf16_gather``), after
training: every GTP weight's backward materialization under the module's last FP8 state
against TE's own quantizer (the module's weight quantizer, with the noted forward scale under
delayed scaling) applied row- and column-wise to the full weight, as TE does for a weight of
its own: the column-wise data (Hopper: the transpose) and ``scale_inv`` bit for bit, no
row-wise data handed over; and how many backward consumes were quantized per step.

Before the modes, ``fp8_primary`` (engine level, GTP2, also under ``--cpu-smoke``): three bf16
weights made FP8 primary GTP shards (``make_fp8_primary``), gathered as they are and handed to TE
by GTP's TE consumer, then an optimizer write-back from fp32 masters
(``write_back_fp8_primary``) and the gathers again: each gathered ``Float8Tensor``'s data,
``scale_inv`` and column-wise copy against TE's ``Float8CurrentScalingQuantizer`` on the full
(bf16-rounded) weight, bit for bit; no refresh cast; half the bf16 bytes. Then
``megatron_fp8_primary`` (also under ``--cpu-smoke``): the harness's GPT (megatron-local
linears, fp32) with FP8 primary GTP shards trained 3 steps by megatron DDP and the distributed
optimizer at GTP2 vs DP2 whose linear weights are megatron's FP8 params emulated on full
weights: losses and weights within 1e-5, every shard's bytes and scale exactly its fp32 main
slice quantized with the whole master's scale (bit-identical FP8 weights vs the reference are
reported, not judged). After ``fp8param_gtp2`` trained: every GTP shard an FP8 primary
weight (float8, fp32 masters, each shard exactly its masters rounded to bf16 and quantized with
the whole master's scale), no refresh cast, every gather FP8, TE handed a ``Float8Tensor`` for
every weight in both directions.

Success: ``summary.md`` says PASS on each line: |loss diff| fp8_gtp2 vs fp8_dp2,
fp8_gtp2_bf16_gather vs fp8_dp2, fp8delayed_gtp2 vs fp8delayed_dp2, fp8block_gtp2 vs
fp8block_dp2 and fp8param_gtp2 vs fp8param_dp2 <= 0.02 on every step, the fp8param_gtp2 line,
gathered bytes fp8_gtp2 / bf16_gtp2 = 0.50 (+-3 %), bit-exact gathered weights and
transposes, one FP8 refresh per step, no allocation after the second step, the bf16-gather
FP8 modes' backward weights bit-exact and quantized at every backward consume. Beside the
fixed loss bound of a pair whose noise-floor twin ran (``*_dp2_split``), a second line says
whether the pair stays within its reference's own spread (reported next to the bound, which
it does not replace). Step times are reported, not judged. ``--modes a,b`` runs a subset (a
line whose modes did not run says "not measured"). Writes ``fp8_check.json`` and
``summary.md`` under ``--out`` (also on a failure or at the ``--deadline``: never hangs past
it).

One GPU: ``--shared-device`` (same torchrun line, ``--nproc-per-node 2``) puts every local rank
on ``cuda:0`` and the process group on ``nemo_gtp.cpu.staged_gloo`` (collectives staged
through host memory over gloo; megatron's and GTP's groups inherit it). Losses, bytes, bit
checks, refresh and allocation counts keep their meaning (peak GiB is each rank's own
allocator); step times do not, and GTP sees a non-NCCL group (MEAN as a 1/2 pre-scale, no
copy-engine gather)::

    torchrun --nproc-per-node 2 -m bench.gpu_fp8_check --shared-device --out /tmp/fp8_1gpu

``--cpu-smoke`` (2 gloo processes, no TE): the same script with the megatron-local spec in bf16
(modes ``bf16_dp2`` / ``bf16_gtp2``, and ``fp8param_gtp2``: ``fp8_param`` makes the local
linears' shards FP8 primary, judged without its DP twin), plus the runtime's FP8 gather
through a pure-torch consumer on a few GTP linears (bytes, bit checks, refreshes) and the
bf16-gather FP8 backward through GTP's TE consumer on stand-ins of TE's FP8 linear
(``te_backward_bit_checks`` on them): the plumbing, not TE. ``--cpu-smoke --shared-device``: the
same on the staged backend.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

CUDA = torch.cuda.is_available() and "--cpu-smoke" not in sys.argv
DEVICE = "cuda" if CUDA else "cpu"
NOISE_BUCKET = 1_000_000
MODES = {  # mode -> (gtp, megatron fp8_recipe or None: bf16 compute, GTPConfig.fp8_gather
    #          [, megatron fp8_param: FP8 primary weights[, DDP bucket size[, parts per
    #          micro-batch]]])
    "fp8_dp2": (1, "tensorwise", True),
    "fp8_gtp2": (2, "tensorwise", True),
    "fp8_gtp2_bf16_gather": (2, "tensorwise", False),
    "fp8delayed_dp2": (1, "delayed", True),
    "fp8delayed_gtp2": (2, "delayed", True),
    "fp8block_dp2": (1, "blockwise", True),
    "fp8block_gtp2": (2, "blockwise", True),
    "fp8block_gtp2_bf16_gather": (2, "blockwise", False),
    "bf16_gtp2": (2, None, True),
    "fp8param_dp2": (1, "tensorwise", True, True),
    "fp8param_gtp2": (2, "tensorwise", True, True),
    "fp8blockparam_dp2": (1, "blockwise", True, True),
    "fp8blockparam_gtp2": (2, "blockwise", True, True),
    "bf16_dp2": (1, None, True),
    # DP2 again with megatron's grads in 1M-element buckets: each rank's grad shard, so the
    # grad norm's partial sums, round differently (a uniform scale of every grad, which Adam
    # all but cancels: a lower bound of the noise)
    "fp8_dp2_rebucket": (1, "tensorwise", True, False, NOISE_BUCKET),
    "fp8block_dp2_rebucket": (1, "blockwise", True, False, NOISE_BUCKET),
    # the noise floor of a loss comparison: DP2 again with every micro-batch run as two halves
    # (same samples, weights and recipe; every wgrad sums in another order, as GTP2's per
    # micro-batch reduce-scatters do)
    "fp8_dp2_split": (1, "tensorwise", True, False, None, 2),
    "fp8block_dp2_split": (1, "blockwise", True, False, None, 2),
    "bf16_dp2_split": (1, None, True, False, None, 2),
}
SMOKE_MODES = {
    "bf16_dp2": (1, None, True),
    "bf16_dp2_split": (1, None, True, False, None, 2),
    "bf16_gtp2": (2, None, True),
    "fp8param_gtp2": (2, "tensorwise", True, True),  # CPU: no TE, the GTP side's plumbing
}
PAIRS = [  # (GTP mode, its twin); loss pairs judged at <= LOSS_TOLERANCE
    ("fp8_gtp2", "fp8_dp2"),
    ("fp8_gtp2_bf16_gather", "fp8_dp2"),
    ("fp8delayed_gtp2", "fp8delayed_dp2"),
    ("fp8block_gtp2", "fp8block_dp2"),
    ("fp8param_gtp2", "fp8param_dp2"),
    ("fp8blockparam_gtp2", "fp8blockparam_dp2"),
    ("fp8_gtp2", "fp8_gtp2_bf16_gather"),
    ("bf16_gtp2", "bf16_dp2"),
    ("fp8block_gtp2_bf16_gather", "fp8block_dp2"),
]
JUDGED_PAIRS = PAIRS[:6]
NOISE_PAIRS = {  # a judged pair -> the twin run again differently rounded (reported beside it)
    ("fp8_gtp2", "fp8_dp2"): ("fp8_dp2_split", "fp8_dp2"),
    ("fp8block_gtp2", "fp8block_dp2"): ("fp8block_dp2_split", "fp8block_dp2"),
}
PAIRS += [
    *NOISE_PAIRS.values(),
    ("fp8_dp2_rebucket", "fp8_dp2"),
    ("fp8block_dp2_rebucket", "fp8block_dp2"),
    ("bf16_dp2_split", "bf16_dp2"),
]
LOSS_TOLERANCE = 0.02
GROWTH_STEPS = (1, 2, 3, 5, 10, 20, 30, 40, 50)  # the steps whose loss difference compare() keeps
BWD_QUANTIZED_MODES = ("fp8_gtp2_bf16_gather", "fp8delayed_gtp2", "fp8block_gtp2_bf16_gather")
RESULT: dict = {}


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _write(args: argparse.Namespace) -> None:
    """JSON + markdown summary (rank 0), whatever has been measured so far."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_check.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary_markdown(RESULT))


def _watchdog(args: argparse.Namespace) -> None:
    """Past ``--deadline`` seconds: record it, write what exists, end the process (no hang)."""

    def fire() -> None:
        RESULT.setdefault("errors", []).append(f"deadline of {args.deadline} s exceeded")
        try:
            _write(args)
        finally:
            os._exit(3)

    timer = threading.Timer(args.deadline, fire)
    timer.daemon = True
    timer.start()


# ---------------------------------------------------------------------------------- training
def fp8_config(config: object, recipe: str = "tensorwise") -> object:
    """The model config under TE's FP8 autocast (hybrid: E4M3 forward) with megatron's
    ``fp8_recipe`` (``"tensorwise"``: per-tensor current scaling; ``"delayed"``;
    ``"blockwise"``: TE's Float8BlockScaling, 1x128 / 128x128 blocks, Hopper)."""
    return dataclasses.replace(config, fp8="hybrid", fp8_recipe=recipe)


def _te_init_values(model: torch.nn.Module, reference: dict) -> int:
    """Point TE's FP8 params' kept init values (the distributed optimizer's master seeds) at
    the loaded reference weights: TE kept its constructor's values, GTP's FP8 primary shards
    keep the loaded ones. Returns how many TE FP8 params it found."""
    found = 0
    for name, param in model.named_parameters():
        if getattr(param, "_high_precision_init_val", None) is not None:
            param._high_precision_init_val = reference[name].detach().to(torch.bfloat16).cpu()
            found += 1
    return found


def run_mode(
    args: argparse.Namespace,
    mode: str,
    gtp: int,
    fp8: str | None,
    fp8_gather: bool,
    fp8_param: bool = False,
    bucket_size: int | None = None,
    microbatch_split: int = 1,
) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from bench.bench_gpt import model_config, seed_model_parallel
    from bench.te_gpt_nccl import (
        forward_backward_step,
        layer_spec,
        reference_weights,
        wrap_for_training,
    )
    from nemo_gtp.engine import GTPConfig
    from nemo_gtp.integrations.megatron import gtp_layer_spec, shard_model
    from tests.harness.gpt import Run, gtp_groups, load_full_weights

    kind = "te" if CUDA else "local"
    groups = gtp_groups(Run(gtp=gtp))
    config = model_config(args)
    if fp8:
        config = fp8_config(config, fp8)
    if fp8_param:  # megatron builds the layers inside TE's FP8 param init (design §1.3)
        config = dataclasses.replace(config, fp8_param=True)
    reference = reference_weights(args, kind, False)
    gtp_config = GTPConfig(fp8_gather=fp8_gather)
    spec = layer_spec(kind)
    if gtp > 1 and kind == "te":
        spec = gtp_layer_spec(spec, groups, gtp_config)
    seed_model_parallel(DEVICE, 4321)
    model = GPTModel(config, spec, args.vocab, args.seq).to(DEVICE)
    load_full_weights(model, reference)
    te_fp8_params = _te_init_values(model, reference) if fp8_param else 0
    model = Float16Module(config, model)
    runtime = shard_model(model, groups, gtp_config) if gtp > 1 else None
    for module in model.modules():  # TE's fused wgrad accumulation (megatron's fusion)
        if kind == "te" and hasattr(module, "fuse_wgrad_accumulation"):
            module.fuse_wgrad_accumulation = True
    ddp, optimizer = wrap_for_training(config, model, groups, args.lr, bucket_size)
    run_args = argparse.Namespace(**{**vars(args), "microbatch_split": microbatch_split})
    data_rank = parallel_state.get_data_parallel_rank()
    forward_backward = get_forward_backward_func()
    record: dict = dict(mode=mode, gtp=gtp, fp8=fp8, fp8_gather=fp8_gather, losses=[], norms=[])
    record["fp8_param"], record["te_fp8_params"] = fp8_param, te_fp8_params
    consumer = None if runtime is None else runtime.quantized_gather
    record["consumer"] = type(consumer).__name__ if consumer is not None else None
    addresses: dict[tuple, set] = {}
    if consumer is not None:  # every Float8Tensor handed to TE: its buffer addresses
        wrap = consumer.wrap

        def recording_wrap(param, direction, gathered):  # noqa: ANN001, ANN202
            tensor = wrap(param, direction, gathered)
            transpose = None if gathered.transpose is None else gathered.transpose.data_ptr()
            key = (param.gtp_state.name, direction.value)
            addresses.setdefault(key, set()).add((gathered.data.data_ptr(), transpose))
            return tensor

        consumer.wrap = recording_wrap
    bwd_quantizes = [0]
    requant = None if runtime is None else runtime.consumer_quantize
    record["consumer_quantize"] = type(requant).__name__ if requant is not None else None
    if requant is not None:  # backward consumes handed TE a quantized weight (bf16 gathers)
        backward = requant.backward

        def counting_backward(param, note, full):  # noqa: ANN001, ANN202
            bwd_quantizes[0] += 1
            return backward(param, note, full)

        requant.backward = counting_backward
    times, stats, allocations = [], [], []
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        if step == 2:
            addresses.clear()  # the steady state: from the third step on
        if runtime is not None:
            runtime.stats.reset()
        bwd_quantizes[0] = 0
        _sync()
        start = time.perf_counter()
        reduced = forward_backward_step(run_args, ddp, optimizer, forward_backward, step, data_rank)
        if args.lr_warmup:  # every mode the same schedule: lr * min(1, (step + 1) / warmup)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / args.lr_warmup)
        _, grad_norm, _ = optimizer.step()
        _sync()
        times.append(time.perf_counter() - start)
        if runtime is not None:
            stats.append(dict(vars(runtime.stats), backward_quantizes=bwd_quantizes[0]))
            allocations.append(runtime.weight_cache.allocations)
        loss = torch.stack([r["lm loss"] for r in reduced]).sum()
        dist.all_reduce(loss)
        tokens = args.mbs * args.seq * args.microbatches * dist.get_world_size()
        record["losses"].append(float(loss) / tokens)
        record["norms"].append(float(grad_norm))
    timed = times[args.timing_from :] or times
    record["step_ms_median"] = 1000 * statistics.median(timed)
    record["microbatches"] = args.microbatches
    record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    if runtime is not None:
        steady = stats[args.timing_from :] or stats
        record["per_step"] = {k: statistics.mean(s[k] for s in steady) for k in steady[0]}
        record["gtp_weights"] = len(runtime.params)
        record["te_weights"] = sum(p.gtp_state.consumer is not None for p in runtime.params)
        record["allocations_after_step2"] = allocations[-1] - allocations[min(1, len(stats) - 1)]
        record["fp8_refreshes_per_step"] = sorted({s["fp8_quantizes"] for s in stats[1:]})
        record["buffer_addresses_stable"] = all(len(v) == 1 for v in addresses.values())
        record["wrapped_gathers"] = len(addresses)
    if fp8_param and runtime is not None:
        try:
            record["fp8_primary"] = fp8_primary_state(runtime, ddp, optimizer)
        except Exception:  # noqa: BLE001 - record, go on
            record["fp8_primary"] = {"error": traceback.format_exc()}
    if mode == "fp8_gtp2" and CUDA:
        try:
            record["bit_checks"] = te_bit_checks(model, runtime, args)
        except Exception:  # noqa: BLE001 - record, go on
            record["bit_checks"] = {"error": traceback.format_exc()}
    if mode == "fp8blockparam_gtp2" and CUDA:
        try:
            record["block_primary_checks"] = te_block_primary_checks(runtime)
        except Exception:  # noqa: BLE001 - record, go on
            record["block_primary_checks"] = {"error": traceback.format_exc()}
    if mode == "fp8block_gtp2" and CUDA:
        try:
            record["block_bit_checks"] = te_block_bit_checks(runtime)
        except Exception:  # noqa: BLE001 - record, go on
            record["block_bit_checks"] = {"error": traceback.format_exc()}
    if mode in BWD_QUANTIZED_MODES and CUDA:
        try:
            record["backward_bit_checks"] = te_backward_bit_checks(runtime)
        except Exception:  # noqa: BLE001 - record, go on
            record["backward_bit_checks"] = {"error": traceback.format_exc()}
    del model, ddp, optimizer, runtime
    config.finalize_model_grads_func = None
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return record


def fp8_primary_state(runtime: object, ddp: object, optimizer: object) -> dict:
    """What megatron's ``fp8_param`` made of the GTP shards (design §1.3 "FP8 primary
    weights"): their dtypes, the training dtype, the masters' dtype, the TE linears among them,
    and the shards that are not exactly their fp32 main slices (rounded to the training dtype)
    quantized with the whole master's scale (collective)."""
    from nemo_gtp.engine.fp8_primary import is_fp8_primary
    from tests.harness.gpt import fp8_primary_write_back_errors

    params = runtime.params
    return {
        "shards": len(params),
        "all_fp8_primary": all(is_fp8_primary(p) for p in params),
        "shard_dtypes": sorted({str(p.dtype) for p in params}),
        "training_dtypes": sorted({str(p.gtp_state.fp8_primary_dtype) for p in params}),
        "master_dtypes": sorted(
            {str(p.main_param.dtype) for p in params if getattr(p, "main_param", None) is not None}
        ),
        "write_back_errors": fp8_primary_write_back_errors({"ddp": ddp, "optimizer": optimizer}),
    }


def full_weight(
    param: torch.Tensor, runtime: object, shard: torch.Tensor | None = None
) -> torch.Tensor:
    """``param``'s full (unpadded) weight, its GTP shards (or every rank's ``shard`` of the
    param's shape) gathered over the runtime's group (collective): what the bit checks quantize
    with TE's own quantizer."""
    shard = param.detach() if shard is None else shard
    shards = [torch.empty_like(shard) for _ in range(runtime.size)]
    dist.all_gather(shards, shard.contiguous(), group=runtime.group)
    return param.gtp_spec.unpad(torch.cat(shards)).contiguous()


def te_bit_checks(model: torch.nn.Module, runtime: object, args: argparse.Namespace) -> dict:
    """Every GTP weight's gathered Float8Tensor vs TE's quantizer on the full weight (bits)."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Float8CurrentScaling, Format
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from nemo_gtp.engine.param import Direction

    runtime.drain()
    out = {"weights": 0, "data_equal": 0, "scale_inv_equal": 0, "transpose_equal": 0}
    mismatched: list[str] = []
    recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)
    for param in runtime.params:
        full = full_weight(param, runtime)
        quantizer = Float8CurrentScalingQuantizer(
            tex.DType.kFloat8E4M3, full.device, rowwise=True, columnwise=True
        )
        ref = quantizer(full)
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            fwd = runtime.materialize_group_for_protocol(param, Direction.FWD)[0]
            data, scale_inv = fwd._data.clone(), fwd._scale_inv.clone()
            bwd = runtime.materialize_group_for_protocol(param, Direction.BWD)[0]
            bwd.update_usage(columnwise_usage=True)  # what TE's dgrad asks for
            transpose = None if bwd._transpose is None else bwd._transpose.clone()
        runtime.drain()
        name = param.gtp_state.name
        out["weights"] += 1
        ok = torch.equal(data, ref._data)
        out["data_equal"] += ok
        ok_scale = torch.equal(scale_inv.view(torch.int32), ref._scale_inv.view(torch.int32))
        out["scale_inv_equal"] += ok_scale
        ref_t = ref._transpose if ref._transpose is not None else ref._data.t().contiguous()
        ok_t = transpose is not None and torch.equal(transpose, ref_t)
        out["transpose_equal"] += ok_t
        if not (ok and ok_scale and ok_t):
            mismatched.append(name)
    out["mismatched"] = mismatched[:10]
    out["all_equal"] = not mismatched
    return out


def te_block_bit_checks(runtime: object, full_of=None) -> dict:  # noqa: ANN001
    """Every GTP weight's gathered ``Float8BlockwiseQTensor`` (blockwise FP8 gather, design §1.3)
    vs TE's ``Float8BlockQuantizer`` (128x128 tiles, row- and column-wise) on the full weight:
    row-wise data and tile scales from the forward hand-out, column-wise data and scales from
    the backward one, bit for bit (the scales' valid region: TE pads them to 4 columns).
    ``full_of(param, runtime)``: the full weight TE quantizes (default :func:`full_weight`;
    FP8 primary shards: :func:`full_master`, their fp32 masters rounded to bf16)."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Float8BlockScaling
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    from nemo_gtp.engine.param import Direction

    full_of = full_of or full_weight
    runtime.drain()
    out = {"weights": 0, "rowwise_equal": 0, "columnwise_equal": 0, "fp8_handed": 0}
    mismatched: list[str] = []
    recipe = Float8BlockScaling()
    for param in runtime.params:
        full = full_of(param, runtime)
        quantizer = Float8BlockQuantizer(
            tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2
        )
        ref = quantizer(full)
        rows, cols = full.shape
        rb, cb = -(-rows // 128), -(-cols // 128)
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            fwd = runtime.materialize_group_for_protocol(param, Direction.FWD)[0]
            handed = type(fwd).__name__ == "Float8BlockwiseQTensor"
            row = (fwd._rowwise_data.clone(), fwd._rowwise_scale_inv[:rb, :cb].clone())
            bwd = runtime.materialize_group_for_protocol(param, Direction.BWD)[0]
            bwd.update_usage(columnwise_usage=True)  # what TE's dgrad asks for
            col = (bwd._columnwise_data.clone(), bwd._columnwise_scale_inv[:cb, :rb].clone())
        runtime.drain()
        out["weights"] += 1
        out["fp8_handed"] += handed
        ok_row = torch.equal(row[0], ref._rowwise_data) and torch.equal(
            row[1].view(torch.int32), ref._rowwise_scale_inv[:rb, :cb].view(torch.int32)
        )
        ok_col = torch.equal(col[0], ref._columnwise_data) and torch.equal(
            col[1].view(torch.int32), ref._columnwise_scale_inv[:cb, :rb].view(torch.int32)
        )
        out["rowwise_equal"] += ok_row
        out["columnwise_equal"] += ok_col
        if not (handed and ok_row and ok_col):
            mismatched.append(param.gtp_state.name)
    out["mismatched"] = mismatched[:10]
    out["all_equal"] = not mismatched
    return out


def full_master(param: torch.Tensor, runtime: object) -> torch.Tensor:
    """An FP8 primary shard's full (unpadded) weight as its write-back saw it: the fp32 main
    params gathered over GTP (DP 1: each rank's main is its whole shard), rounded to bf16 as TE
    and the write-back round them (collective)."""
    main = param.main_param.detach().view(param.shape).to(param.gtp_state.fp8_primary_dtype)
    return full_weight(param, runtime, main)


def te_block_primary_checks(runtime: object) -> dict:
    """Blockwise FP8 primary shards (design §1.3 "FP8 primary weights") after training: what
    GTP's write-back made of the fp32 masters, gathered and handed to TE, vs TE's
    ``Float8BlockQuantizer`` on the full masters (rounded to bf16), bit for bit, rows and tile
    scales forward, the column-wise copy backward."""
    return te_block_bit_checks(runtime, full_of=full_master)


def te_backward_bit_checks(runtime: object, delayed_quantizer: type | None = None) -> dict:
    """Every GTP weight's backward materialization after a forward one, under its TE module's
    last FP8 state (bf16 gathers: TE quantized the forward, GTP's consumer the backward), vs
    the module's weight quantizer (delayed scaling: with the noted forward scale, a scratch
    amax) applied row- and column-wise to the full weight, as TE quantizes a weight of its own:
    column-wise data and scale_inv bit for bit, no row-wise data handed over.
    ``delayed_quantizer``: TE's ``Float8Quantizer`` unless given (the CPU smoke's stand-in)."""
    from nemo_gtp.engine.param import Direction

    if delayed_quantizer is None:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        delayed_quantizer = Float8Quantizer
    runtime.drain()
    out = {"weights": 0, "noted": 0, "columnwise_equal": 0, "scale_inv_equal": 0, "rowwise": 0}
    mismatched: list[str] = []
    for param in runtime.params:
        name = param.gtp_state.name
        if param.gtp_state.consumer is None:  # not a TE linear (megatron's output layer)
            continue
        out["weights"] += 1
        full = full_weight(param, runtime)
        param.gtp_state.forward_grad_enabled = True  # a training forward: the note is taken
        with torch.no_grad():
            runtime.materialize_group_for_protocol(param, Direction.FWD)
            note = param.gtp_state.quantize_note
            if note is None:
                runtime.drain()
                mismatched.append(f"{name}: no FP8 note (module not in FP8?)")
                continue
            out["noted"] += 1
            if note.delayed is not None:
                quantizer = delayed_quantizer(
                    note.delayed.scale.clone(),
                    torch.zeros_like(note.delayed.amax),
                    note.delayed.dtype,
                    rowwise=True,
                    columnwise=True,
                )
            else:
                quantizer = note.quantizer
                usage = (quantizer.rowwise_usage, quantizer.columnwise_usage)
                quantizer.set_usage(rowwise=True, columnwise=True)
            ref = quantizer(full)
            if note.delayed is None:
                quantizer.set_usage(rowwise=usage[0], columnwise=usage[1])
            got = runtime.materialize_group_for_protocol(param, Direction.BWD)[0]
            got.update_usage(columnwise_usage=True)  # what TE's dgrad asks for
            got_col = got._transpose if got._transpose is not None else got._data
            ref_col = ref._transpose if ref._transpose is not None else ref._data
            ok = got_col is not None and torch.equal(got_col, ref_col)
            ok_scale = torch.equal(
                got._scale_inv.view(torch.int32), ref._scale_inv.view(torch.int32)
            )
            if note.delayed is not None:  # the noted scale is the module's at the forward
                ok_scale &= torch.equal(note.delayed.scale, note.quantizer.scale)
            rowwise = got._transpose is not None and got._data is not None
        runtime.drain()
        out["columnwise_equal"] += ok
        out["scale_inv_equal"] += ok_scale
        out["rowwise"] += rowwise
        if not (ok and ok_scale) or rowwise:
            mismatched.append(name)
    out["mismatched"] = mismatched[:10]
    out["all_equal"] = not mismatched and out["noted"] == out["weights"]
    return out


# ----------------------------------------------------------------------------- CPU plumbing
def _three_gtp2_weights(device: str) -> tuple:
    """A GTP2 runtime over three bf16 weights (one with padded shards): (runtime, sharded
    params, the full weights)."""
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime

    groups = GTPParallelDims(world_size=dist.get_world_size(), num_weight_shards=2).build()
    runtime = GTPRuntime(groups, GTPConfig())
    torch.manual_seed(0)
    params, fulls = [], []
    for i, shape in enumerate([(96, 64), (200, 64), (64, 192)]):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16, device=device))
        fulls.append(module.weight.detach().clone())
        params.append(runtime.shard_parameter(module, "weight", f"w{i}"))
    return runtime, params, fulls


def cpu_fp8_gather_check() -> dict:
    """The runtime's FP8 gather through a pure-torch consumer (no TE): bytes and bits."""
    from nemo_gtp.engine.fp8 import FP8Scaling, quantize_shard

    class Consumer:
        transpose_for_backward = True

        def forward_scaling(self, param):  # noqa: ANN001, ANN202
            return FP8Scaling("tensorwise")

        def wrap(self, param, direction, gathered):  # noqa: ANN001, ANN202
            if gathered.transpose is not None:
                gathered.transpose.copy_(gathered.data.t())
            return gathered

    runtime, params, fulls = _three_gtp2_weights("cpu")
    result: dict = {"bit_exact": True}
    for label, consumer in (("bf16", None), ("fp8", Consumer())):
        runtime.quantized_gather = consumer
        runtime.stats.reset()
        for backward in (False, True):
            for i in reversed(range(len(params))) if backward else range(len(params)):
                param = params[i]
                if backward:
                    got = param.materialize_group_for_backward()[0]
                else:
                    got = param.materialize_group_for_forward()[0]
                if consumer is None:
                    continue
                ref = quantize_shard(fulls[i].float(), FP8Scaling())
                same = torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
                if backward:
                    expected = ref.data.t().contiguous().view(torch.uint8)
                    same &= torch.equal(got.transpose.view(torch.uint8), expected)
                result["bit_exact"] &= bool(same)
        runtime.drain()
        result[f"{label}_gather_bytes"] = runtime.stats.gather_bytes
        result[f"{label}_refreshes"] = runtime.stats.fp8_quantizes
    result["bytes_ratio"] = result["fp8_gather_bytes"] / result["bf16_gather_bytes"]
    return result


def fp8_primary_check() -> dict:
    """FP8 primary GTP shards (design §1.3 "FP8 primary weights"), engine level, GTP2: the
    shards made FP8 (``make_fp8_primary``), gathered as they are (no refresh cast) and, on a
    GPU, handed to TE as ``Float8Tensor`` by GTP's TE consumer; then an optimizer write-back
    from fp32 masters (``write_back_fp8_primary``) and the gathers again. Every gathered
    weight against the full weight quantized on one rank (TE's ``Float8CurrentScalingQuantizer``
    on a GPU, the engine's on a CPU), bit for bit, forward data and ``scale_inv``; the backward
    column-wise copy on a GPU."""
    from nemo_gtp.engine.fp8 import FP8Scaling, quantize_shard
    from nemo_gtp.engine.fp8_primary import make_fp8_primary, write_back_fp8_primary

    runtime, params, fulls = _three_gtp2_weights(DEVICE)
    make_fp8_primary(runtime, FP8Scaling("tensorwise"))
    for param in params:
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=DEVICE)
    if CUDA:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

        from nemo_gtp.integrations.megatron.sharding.te_fp8 import install_te_fp8_gather

        install_te_fp8_gather(runtime)

        def reference(full: torch.Tensor) -> tuple:
            q = Float8CurrentScalingQuantizer(
                tex.DType.kFloat8E4M3, full.device, rowwise=True, columnwise=True
            )(full)
            t = q._transpose if q._transpose is not None else q._data.t().contiguous()
            return q._data.view(torch.uint8), q._scale_inv, t.view(torch.uint8)

        def parts(got: object) -> tuple:
            t = getattr(got, "_transpose", None)
            return got._data.view(torch.uint8), got._scale_inv, t

    else:

        def reference(full: torch.Tensor) -> tuple:
            q = quantize_shard(full.float(), FP8Scaling())
            return q.data.view(torch.uint8), q.scale_inv, None

        def parts(got: object) -> tuple:  # no consumer: the dequantized weight
            return None, None, None

    result: dict = {"bit_exact": True, "weights": 0, "refreshes": 0}

    def fp8_region() -> object:
        """TE's FP8 autocast (current scaling): outside one, TE's GEMM is not FP8 and an FP8
        primary shard is handed dequantized (as TE dequantizes its own FP8 params there)."""
        if not CUDA:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling

        return te.fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling())

    def check(masters: list[torch.Tensor], label: str) -> None:
        runtime.stats.reset()
        for i, param in enumerate(params):
            ref_data, ref_scale_inv, ref_t = reference(masters[i].to(torch.bfloat16))
            with fp8_region():
                got = param.materialize_group_for_forward()[0]
            data, scale_inv, _ = parts(got)
            if data is None:  # CPU: the dequantized FP8 rows against the dequantized reference
                want = quantize_shard(masters[i].to(torch.bfloat16).float(), FP8Scaling())
                same = torch.equal(got, want.dequantize(torch.bfloat16))
            else:
                same = torch.equal(data, ref_data) and torch.equal(
                    scale_inv.view(torch.int32), ref_scale_inv.view(torch.int32)
                )
            bwd = param.materialize_group_for_backward()[0]
            if CUDA:
                bwd.update_usage(columnwise_usage=True)  # what TE's dgrad asks for
                t = parts(bwd)[2]
                same = same and t is not None and torch.equal(t.view(torch.uint8), ref_t)
            runtime.drain()
            result["bit_exact"] &= bool(same)
            result["weights"] += 1
            if not same:
                result.setdefault("mismatched", []).append(f"{label} w{i}")
        result["refreshes"] += runtime.stats.fp8_quantizes
        result[f"{label}_gather_bytes"] = runtime.stats.gather_bytes

    check([f.float() for f in fulls], "init")
    masters_full = [f.float() * 1.5 + 0.01 for f in fulls]  # the optimizer's new fp32 masters
    shard_masters = [p.gtp_spec.shard(m).reshape(-1) for p, m in zip(params, masters_full)]
    write_back_fp8_primary(params, shard_masters, [0] * len(params))  # every rank its whole shard
    check(masters_full, "after_write_back")
    # fwd + bwd gathers; a bf16 gather receives (GTP-1)/GTP of the padded weight: one shard
    bf16 = sum(p.numel() for p in params) * 2 * 2
    result["bytes_ratio"] = result["init_gather_bytes"] / bf16
    return result


def megatron_fp8_primary_check() -> dict:
    """FP8 primary GTP shards through megatron DDP and the distributed optimizer (design §1.3
    "The megatron hook"): the harness's GPT (megatron-local linears, fp32) at TP1·GTP2 vs DP2,
    3 steps, the reference's linear weights megatron's FP8 params emulated on full weights. On
    GPUs the real path: TE installed (megatron's own ``is_float8tensor``), NCCL's coalesced
    param all-gather of the ``uint8`` and fp32 buckets, the shards' ``type()`` on CUDA."""
    from tests.harness.gpt import (
        Run,
        build,
        fp8_primary_write_back_errors,
        rel_err,
        train,
        train_built,
    )

    run = Run(gtp=2, distopt=True, fp8_primary=True, steps=3)
    ref = train(dataclasses.replace(run, gtp=1))
    setup = build(run)
    got = train_built(setup, run)
    pairs = zip(sum(got["losses"], []), sum(ref["losses"], []), strict=True)
    names = got["fp8_primary"]
    return {
        "fp8_weights": len(names),
        "same_fp8_weights": names == ref["fp8_primary"],
        "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in pairs),
        "max_rel_weight_err": max(rel_err(got["weights"][n], ref["weights"][n]) for n in names),
        "bit_identical_fp8_weights": sum(
            torch.equal(got["weights"][n], ref["weights"][n]) for n in names
        ),
        "write_back_errors": fp8_primary_write_back_errors(setup),
        "refreshes": got["runtime"].stats.fp8_quantizes,
    }


def cpu_backward_quantize_check() -> dict:
    """The bf16-gather FP8 backward through GTP's TE consumer on stand-ins of TE's FP8
    ``LayerNormLinear`` (no TE, ``tests.harness.te_fp8_stand_in``): two steps of a current-
    and a delayed-scaling linear at GTP2 vs the same linears unsharded (outputs and dgrads
    bit for bit), then :func:`te_backward_bit_checks` on the GTP runtime."""
    from nemo_gtp.engine import GTPConfig, GTPParallelDims, GTPRuntime
    from nemo_gtp.integrations.te_fp8_backward import TEWeightQuantize, attach_te_weight_states
    from tests.harness.te_fp8_stand_in import (
        StandInCurrentQuantizer,
        StandInDelayedQuantizer,
        StandInTELinear,
    )

    groups = GTPParallelDims(world_size=dist.get_world_size(), num_weight_shards=2).build()
    runtime = GTPRuntime(groups, GTPConfig(pad_for_alignment=16))
    runtime.consumer_quantize = TEWeightQuantize(delayed_quantizer=StandInDelayedQuantizer)
    pairs = []
    for i, kind in enumerate(("current", "delayed")):
        torch.manual_seed(i)
        if kind == "current":
            quantizers = [StandInCurrentQuantizer(), StandInCurrentQuantizer()]
        else:
            quantizers = [
                StandInDelayedQuantizer(torch.tensor(8.0), torch.zeros(1), "e4m3") for _ in range(2)
            ]
        plain, sharded = (StandInTELinear(64, 72, q) for q in quantizers)
        sharded.load_state_dict(plain.state_dict())
        weight = runtime.shard_parameter(sharded, "weight", f"{kind}.weight")
        weight.main_grad = torch.zeros_like(weight)
        attach_te_weight_states(sharded)
        weight.gtp_state.forward_grad_enabled = True  # what TE's grad-mode hook records
        plain.fp8 = sharded.fp8 = True
        pairs.append((plain, sharded))
    equal = True
    for step in range(2):
        torch.manual_seed(100 + step)
        x, dy = torch.randn(8, 64), torch.randn(8, 72)
        for plain, sharded in pairs:
            outs = []
            for module in (plain, sharded):
                xi = x.clone().requires_grad_()
                y = module(xi)
                module.autocast_exit()
                y.backward(dy)
                outs.append((y.detach(), xi.grad))
            equal &= all(torch.equal(a, b) for a, b in zip(*outs))
        runtime.drain()
    result = {"outputs_and_dgrads_equal": bool(equal)}
    result["bit_checks"] = te_backward_bit_checks(runtime, StandInDelayedQuantizer)
    result["ok"] = equal and result["bit_checks"]["all_equal"]
    return result


# ------------------------------------------------------------------------------- reporting
def compare(a: dict, b: dict) -> dict:
    """Two runs' losses and grad norms step by step: the largest loss difference, where the two
    first differ (a loss after step k reflects the weights of k-1 updates; a grad norm differs
    at step 1 when only the reduction order differs), and how the difference grows (the same
    growth in a pair and in its reference's noise twin: the divergence is the trajectory's, not
    the pair's, design §2.5)."""
    n = min(len(a["losses"]), len(b["losses"]))
    diffs = [abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n])]
    norms = list(zip(a.get("norms", [])[:n], b.get("norms", [])[:n]))
    return dict(
        steps=n,
        max_abs_loss_diff=max(diffs),
        max_at_step=1 + diffs.index(max(diffs)),
        first_loss_diff_step=next((i + 1 for i, d in enumerate(diffs) if d > 0), None),
        first_norm_diff_step=next((i + 1 for i, (x, y) in enumerate(norms) if x != y), None),
        loss_diff_at={s: float(f"{diffs[s - 1]:.3g}") for s in GROWTH_STEPS if s <= n},
        final_losses=(a["losses"][n - 1], b["losses"][n - 1]),
        step_time_ratio=a["step_ms_median"] / b["step_ms_median"],
    )


def verdicts(result: dict) -> list[tuple[str, bool | None, str]]:
    """``(check, passed, detail)``; ``None``: not measured."""
    records, comparisons = result.get("records", {}), result.get("comparisons", {})
    out: list[tuple[str, bool | None, str]] = []
    for a, b in JUDGED_PAIRS:
        c = comparisons.get(f"{a} vs {b}")
        detail = "" if c is None else f"{c['max_abs_loss_diff']:.3g} over {c['steps']} steps"
        if c is None and records.get(a, {}).get("error"):
            detail = f"{a} failed"
        if c is None and records.get(b, {}).get("error"):
            detail = f"{b} failed"
        twin = NOISE_PAIRS.get((a, b))
        noise = comparisons.get(f"{twin[0]} vs {twin[1]}") if twin else None
        if c is not None and noise is not None:
            detail += f" (noise floor, {b} in half micro-batches: {noise['max_abs_loss_diff']:.3g})"
        passed = None if c is None else c["max_abs_loss_diff"] <= LOSS_TOLERANCE
        if c is None and detail:  # a mode of the pair ran and failed
            passed = False
        out.append((f"loss: {a} vs {b}, max abs diff <= {LOSS_TOLERANCE}", passed, detail))
        if c is not None and noise is not None:  # reported beside the fixed bound, not for it
            within = c["max_abs_loss_diff"] <= noise["max_abs_loss_diff"]
            out.append((f"loss: {a} vs {b} within {b}'s own noise floor", within, detail))
    ratio = result.get("gather_bytes_ratio")
    out.append(
        (
            "gathered bytes per step: fp8_gtp2 / bf16_gtp2 = 0.50 +- 3 %",
            None if ratio is None else abs(ratio - 0.5) <= 0.015,
            "" if ratio is None else f"{ratio:.4f}",
        )
    )
    fp8 = records.get("fp8_gtp2", {})
    bits = fp8.get("bit_checks") or result.get("cpu_fp8_gather")
    ok = None if not bits else "error" not in bits and bits.get("all_equal", bits.get("bit_exact"))
    reference = "TE's quantizer" if fp8.get("bit_checks") else "the engine's quantizer (CPU)"
    check = f"gathered FP8 weights and transposes bit-exact vs {reference} on the full weight"
    out.append((check, ok, str(bits)))
    refreshes = fp8.get("fp8_refreshes_per_step")
    out.append(
        (
            "one FP8 refresh (amax all-reduce) per step",
            None if refreshes is None else refreshes == [1],
            str(refreshes),
        )
    )
    stable = fp8.get("allocations_after_step2")
    out.append(
        (
            "no gather-buffer allocation after step 2, stable buffer addresses",
            None if stable is None else stable == 0 and fp8.get("buffer_addresses_stable"),
            f"allocations {stable}, addresses stable {fp8.get('buffer_addresses_stable')}",
        )
    )
    primary = result.get("fp8_primary")
    if primary is not None:
        out.append(
            (
                "FP8 primary GTP shards: gathered (TE Float8Tensor, transpose) bit-exact vs the "
                "full weight quantized, before and after write-back; no refresh; bytes 0.50",
                bool(primary.get("bit_exact"))
                and primary.get("refreshes") == 0
                and abs(primary.get("bytes_ratio", 0) - 0.5) < 0.015,
                str(primary)[-300:],
            )
        )
    hook = result.get("megatron_fp8_primary")
    if hook is not None:
        out.append(
            (
                "FP8 primary GTP shards under megatron DDP + distributed optimizer (GPT, fp32, "
                "GTP2 vs DP2): losses and weights <= 1e-5 rel, write-back exact vs the masters",
                "error" not in hook
                and hook.get("fp8_weights") == 8
                and hook.get("same_fp8_weights")
                and hook.get("max_rel_loss_diff", 1) <= 1e-5
                and hook.get("max_rel_weight_err", 1) <= 1e-5
                and hook.get("write_back_errors") == []
                and hook.get("refreshes") == 0,
                str(hook)[-300:],
            )
        )
    for name in ("fp8param_gtp2", "fp8blockparam_gtp2"):
        param = records.get(name)
        if param is None:
            continue
        state, per = param.get("fp8_primary") or {}, param.get("per_step", {})
        gathers_fp8 = bool(per) and per.get("fp8_gathers") == per.get("gathers") > 0
        te_ok = not CUDA or param.get("wrapped_gathers") == 2 * param.get("te_weights", -1)
        tensor = "Float8BlockwiseQTensor" if "block" in name else "Float8Tensor"
        out.append(
            (
                f"{name} (megatron fp8_param, TE linears): every GTP shard an FP8 primary "
                "weight (float8, fp32 masters), written back exactly; every gather FP8 with no "
                f"refresh cast; TE handed a {tensor} for every weight and direction",
                None
                if not state and not param.get("error")
                else "error" not in state
                and state.get("all_fp8_primary") is True
                and state.get("shard_dtypes") == ["torch.float8_e4m3fn"]
                and state.get("master_dtypes") == ["torch.float32"]
                and state.get("write_back_errors") == []
                and param.get("fp8_refreshes_per_step") == [0]
                and gathers_fp8
                and te_ok,
                f"{str(state)[-160:]} refreshes {param.get('fp8_refreshes_per_step')} "
                f"per-step gathers {per.get('gathers')} fp8 {per.get('fp8_gathers')} wrapped "
                f"{param.get('wrapped_gathers')} TE weights {param.get('te_weights')} "
                f"{(param.get('error') or '').strip()[-160:]}",
            )
        )
    cpu = result.get("cpu_backward_quantize")
    if cpu is not None:
        out.append(
            (
                "bf16-gather FP8 backward through GTP's TE consumer on TE stand-ins (CPU)",
                bool(cpu.get("ok")),
                str(cpu)[-200:],
            )
        )
    primary = records.get("fp8blockparam_gtp2", {}).get("block_primary_checks")
    out.append(
        (
            "fp8blockparam_gtp2: FP8 primary shards' gathered Float8BlockwiseQTensor rows, tile "
            "scales and column-wise copy bit-exact vs TE's Float8BlockQuantizer on the full "
            "fp32 masters (rounded to bf16)",
            None if not primary else "error" not in primary and primary.get("all_equal"),
            str(primary)[:200] if primary else "",
        )
    )
    block = records.get("fp8block_gtp2", {})
    bits = block.get("block_bit_checks")
    out.append(
        (
            "fp8block_gtp2: gathered Float8BlockwiseQTensor rows, tile scales and column-wise "
            "copy bit-exact vs TE's Float8BlockQuantizer on the full weight",
            None if not bits else "error" not in bits and bits.get("all_equal"),
            str(bits)[:200] if bits else "",
        )
    )
    per = block.get("per_step", {})
    out.append(
        (
            "fp8block_gtp2: every gather FP8 (blockwise FP8 gather)",
            None if not per else per.get("fp8_gathers") == per.get("gathers") > 0,
            f"{per.get('fp8_gathers')} of {per.get('gathers')} per step" if per else "",
        )
    )
    for mode in BWD_QUANTIZED_MODES:
        record = records.get(mode, {})
        bits = record.get("backward_bit_checks")
        ok = None if not bits else "error" not in bits and bits.get("all_equal")
        out.append(
            (
                f"{mode}: backward weights bit-exact vs TE's quantizer, column-wise only",
                ok if bits or not record.get("error") else False,
                str(bits) if bits else (record.get("error") or "").strip()[-200:],
            )
        )
        per = record.get("per_step", {}).get("backward_quantizes")
        want = record.get("te_weights", 0) * record.get("microbatches", 0)
        out.append(
            (
                f"{mode}: every backward consume quantized (TE weights x microbatches a step)",
                None if per is None else per == want,
                f"{per} per step, expected {want}",
            )
        )
    return out


def summary_markdown(result: dict) -> str:
    lines = ["# FP8 gather under GTP: GTP2 vs DP2", ""]
    lines.append(
        f"device: {result.get('device')}, torch {result.get('torch')}, TE {result.get('te')}"
    )
    if result.get("shared_device"):
        lines += ["", SHARED_DEVICE_NOTE]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for name, ok, detail in verdicts(result):
        mark = "not measured" if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"| {name} | {mark} | {detail[:200]} |")
    lines += ["", "| mode | final loss | step ms (median) | gather MiB/step | peak GiB | error |"]
    lines.append("|---|---|---|---|---|---|")
    for mode, r in result.get("records", {}).items():
        per = r.get("per_step", {})
        mib = per.get("gather_bytes", 0) / 2**20
        loss = r["losses"][-1] if r.get("losses") else float("nan")
        error = (r.get("error") or "").strip().splitlines()[-1:] or [""]
        lines.append(
            f"| {mode} | {loss:.4f} | {r.get('step_ms_median', float('nan')):.1f} | {mib:.1f} | "
            f"{r.get('peak_gib', 0):.2f} | {error[0][:120]} |"
        )
    lines += ["", "comparisons:", ""]
    for name, c in result.get("comparisons", {}).items():
        lines.append(f"- {name}: {json.dumps(c)}")
    for error in result.get("errors", []):
        lines.append(f"- error: {error}")
    return "\n".join(lines) + "\n"


SHARED_DEVICE_NOTE = (
    "**--shared-device**: every rank on cuda:0 (the CPU under --cpu-smoke), collectives staged "
    "through host memory over gloo (staged_gloo): step ms mean nothing; losses, bytes, bits, "
    "counts and each rank's own peak GiB hold."
)


def world_plan(shared_device: bool, local_rank: int, cuda: bool = CUDA) -> tuple[str, int | None]:
    """``(process-group backend, CUDA device index or None)`` of a torchrun process:
    NCCL on ``cuda:<LOCAL_RANK>``, gloo on CPU, or under ``--shared-device`` the staged backend
    with every local rank on ``cuda:0`` (on the CPU with ``--cpu-smoke``).

    Example::

        world_plan(True, 1, cuda=True)  # ("cpu:gloo,cuda:staged_gloo", 0)
    """
    from nemo_gtp.cpu.staged_gloo import rank_backend  # importing registers the backend

    return rank_backend(shared_device, cuda, local_rank)


# ------------------------------------------------------------------------- --probe-gemm
# Find out why a TransformerEngine GEMM refuses its operands (GPU diagnostic, no fix).
#
# ``install()`` wraps ``general_gemm`` where TE's linear modules call it. When a call raises, the
# probe records every operand (type, shape, strides, storage offset, the address modulo 256 of
# its data / transpose / scale_inv, dtypes, usages) and retries the same call with one change
# at a time (a fresh copy of ``_scale_inv``; of ``_data``; of ``_transpose``; all three), and
# records which retry succeeds: the first one that does names the operand cuBLAS refused. The
# original error is raised again afterwards, so the run fails as it would have.
#
GEMM_FINDINGS: list[dict] = []
GEMM_SUCCESSES: list[dict] = []  # the first calls that worked (a reference for the failing ones)
_GEMM_FIELDS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data")


def _gemm_describe(value: object) -> object:
    if not isinstance(value, torch.Tensor):
        return repr(value)[:80]
    out = {"type": type(value).__name__, "shape": list(value.shape)}
    parts = {name: getattr(value, name, None) for name in _GEMM_FIELDS}
    parts = {k: v for k, v in parts.items() if isinstance(v, torch.Tensor)}
    if not parts:
        parts = {"self": value}
    for name, t in parts.items():
        out[name] = {
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "dtype": str(t.dtype),
            "ptr_mod_256": t.data_ptr() % 256,
            "contiguous": t.is_contiguous(),
        }
    for flag in ("_transpose_invalid", "_fp8_dtype"):
        if hasattr(value, flag):
            out[flag] = str(getattr(value, flag))
    quantizer = getattr(value, "_quantizer", None)
    if quantizer is not None:
        out["quantizer"] = {
            "type": type(quantizer).__name__,
            "rowwise": getattr(quantizer, "rowwise_usage", None),
            "columnwise": getattr(quantizer, "columnwise_usage", None),
        }
    return out


def _gemm_with_copy(value: object, names: tuple[str, ...]) -> object:
    """``value`` with fresh copies of the named fields (same object: restored by the caller)."""
    for name in names:
        t = getattr(value, name, None)
        if isinstance(t, torch.Tensor):
            setattr(value, name, t.clone())
    return value


def _gemm_probe(gemm, args: tuple, kwargs: dict, error: Exception) -> dict:  # noqa: ANN001
    finding = {
        "error": str(error).splitlines()[0][:300],
        "where": traceback.format_stack(limit=6)[-4].strip()[:300],
        "args": [_gemm_describe(a) for a in args[:2]],
        "out": _gemm_describe(kwargs.get("out")),
        "kwargs": {k: repr(v)[:60] for k, v in kwargs.items() if k != "out"},
        "retries": {},
    }
    quantized = [a for a in args[:2] if isinstance(a, torch.Tensor) and hasattr(a, "_scale_inv")]
    for label, names in (
        ("copy _scale_inv", ("_scale_inv",)),
        ("copy _data", ("_data",)),
        ("copy _transpose", ("_transpose",)),
        ("copy all", ("_scale_inv", "_data", "_transpose")),
    ):
        saved = [{n: getattr(a, n, None) for n in names} for a in quantized]
        try:
            for a in quantized:
                _gemm_with_copy(a, names)
            gemm(*args, **kwargs)
            finding["retries"][label] = "ok"
        except Exception as retry_error:  # noqa: BLE001 - recorded
            finding["retries"][label] = str(retry_error).splitlines()[0][-120:]
        finally:
            for a, fields in zip(quantized, saved):
                for n, t in fields.items():
                    setattr(a, n, t)
    return finding


def install_gemm_probe(limit: int = 4) -> None:
    """Wrap ``general_gemm`` in TE's linear modules (idempotent)."""
    import transformer_engine.pytorch.module.grouped_linear as grouped
    import transformer_engine.pytorch.module.layernorm_linear as ln_linear
    import transformer_engine.pytorch.module.layernorm_mlp as ln_mlp
    import transformer_engine.pytorch.module.linear as linear

    for module in (linear, ln_linear, ln_mlp, grouped):
        gemm = getattr(module, "general_gemm", None)
        if gemm is None or getattr(gemm, "_probe", False):
            continue

        def wrapped(*args, _gemm=gemm, **kwargs):  # noqa: ANN002, ANN003, ANN202
            try:
                out = _gemm(*args, **kwargs)
            except RuntimeError as error:
                if len(GEMM_FINDINGS) < limit:
                    torch.cuda.synchronize()
                    GEMM_FINDINGS.append(_gemm_probe(_gemm, args, kwargs, error))
                raise
            if len(GEMM_SUCCESSES) < limit:
                GEMM_SUCCESSES.append({"args": [_gemm_describe(a) for a in args[:2]]})
            return out

        wrapped._probe = True
        module.general_gemm = wrapped


def main() -> None:
    from bench.te_gpt_nccl import add_run_args

    parser = argparse.ArgumentParser()
    add_run_args(parser, layers=4, hidden=1024, heads=8, steps=30, timing_from=5)
    parser.add_argument("--modes", default=None, help="comma-separated; default: all")
    parser.add_argument("--deadline", type=float, default=110.0, help="seconds, then exit 3")
    parser.add_argument("--out", default="fp8_check_out")
    parser.add_argument(
        "--lr-warmup",
        type=int,
        default=0,
        help="linear learning-rate warmup over this many steps, as NeMo's recipes have "
        "(0: the constant --lr)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo, local spec, no TE")
    parser.add_argument(
        "--shared-device",
        action="store_true",
        help="every local rank on cuda:0 (one GPU), collectives staged through host memory over "
        "gloo (backend staged_gloo): numerics only",
    )
    parser.add_argument(
        "--probe-gemm",
        action="store_true",
        help="record the operands of a failing TE GEMM and which copied operand makes it run "
        "(gemm_probe in the JSON)",
    )
    args = parser.parse_args()
    _watchdog(args)
    backend, device_index = world_plan(args.shared_device, int(os.environ.get("LOCAL_RANK", 0)))
    if CUDA:
        # fp32 GEMMs in full fp32 (TF32 off), as in every parity check: a difference left is
        # the run's own rounding, not TF32's (TE's fp32 GEMMs read cuBLAS's variable, not
        # torch's flags; set before the first handle)
        os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
        torch.cuda.set_device(device_index)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat()
        args.layers, args.hidden, args.heads, args.vocab, args.seq = 2, 64, 4, 256, 32
        args.steps, args.timing_from = min(args.steps, 4), 1
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(30, args.deadline / 2)))
    RESULT.update(
        args=vars(args),
        device=torch.cuda.get_device_name() if CUDA else "cpu (smoke)",
        shared_device=args.shared_device,
        backend=backend,
        torch=torch.__version__,
        nvidia_tf32_override=os.environ.get("NVIDIA_TF32_OVERRIDE"),
        world=dist.get_world_size(),
        records={},
        comparisons={},
        errors=[],
    )
    try:
        import transformer_engine

        RESULT["te"] = transformer_engine.__version__
    except ImportError:
        RESULT["te"] = None
    if args.probe_gemm and CUDA:
        install_gemm_probe()
        RESULT["gemm_probe"] = {"failures": GEMM_FINDINGS, "first_successes": GEMM_SUCCESSES}
    modes = MODES if CUDA else SMOKE_MODES
    selected = args.modes.split(",") if args.modes else list(modes)
    if not CUDA:
        try:
            RESULT["cpu_fp8_gather"] = cpu_fp8_gather_check()
        except Exception:  # noqa: BLE001
            RESULT["errors"].append(traceback.format_exc())
        try:
            RESULT["cpu_backward_quantize"] = cpu_backward_quantize_check()
        except Exception:  # noqa: BLE001
            RESULT["cpu_backward_quantize"] = {"ok": False, "error": traceback.format_exc()}
    try:
        RESULT["fp8_primary"] = fp8_primary_check()
    except Exception:  # noqa: BLE001
        RESULT["fp8_primary"] = {"bit_exact": False, "error": traceback.format_exc()}
    try:
        RESULT["megatron_fp8_primary"] = megatron_fp8_primary_check()
    except Exception:  # noqa: BLE001
        RESULT["megatron_fp8_primary"] = {"error": traceback.format_exc()}
    _write(args)
    for mode in selected:
        try:
            record = run_mode(args, mode, *modes[mode])
        except Exception:  # noqa: BLE001 - record and go on with the next mode
            record = {"mode": mode, "error": traceback.format_exc()}
        RESULT["records"][mode] = record
        if dist.get_rank() == 0:
            brief = {k: v for k, v in record.items() if k not in ("losses", "norms")}
            print(f"[fp8-check] {mode}: {json.dumps(brief, default=str)}", flush=True)
        _write(args)
    records = RESULT["records"]
    for a, b in PAIRS:
        if records.get(a, {}).get("losses") and records.get(b, {}).get("losses"):
            RESULT["comparisons"][f"{a} vs {b}"] = compare(records[a], records[b])
    fp8_bytes = records.get("fp8_gtp2", {}).get("per_step", {}).get("gather_bytes")
    bf16_bytes = records.get("bf16_gtp2", {}).get("per_step", {}).get("gather_bytes")
    if fp8_bytes and bf16_bytes:
        RESULT["gather_bytes_ratio"] = fp8_bytes / bf16_bytes
    elif not CUDA and "cpu_fp8_gather" in RESULT:
        RESULT["gather_bytes_ratio"] = RESULT["cpu_fp8_gather"]["bytes_ratio"]
    _write(args)
    if dist.get_rank() == 0:
        print(summary_markdown(RESULT), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

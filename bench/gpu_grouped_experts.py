"""Routed experts built as their EGTP2 shards, on 2 GPUs (design §3.1, §3.3): TEGroupedMLP (TE
``GroupedLinear``) and SequentialMLP with TE's linears.

Question: Do routed experts built as their EGTP shards on real TE start from the unsharded
weights, keep half the build memory, train like the unsharded model and checkpoint across
layouts?

Ranks: NCCL, one rank per GPU (self-spawning); ``--shared-device``: both ranks on one GPU through
the staged gloo backend; ``--cpu-smoke``: gloo with TE stand-ins.

Checks, each recorded on its own (a failing one does not stop the next):

- ``init_memory``: two ``TEGroupedMLP`` blocks (megatron's TE wrappers, built on the GPU from
  megatron's CUDA RNG tracker) built full and built pre-sharded at EGTP2 (``gtp_layer_spec``)
  from the same seed: every shard equals its rows of the full weights bit for bit (design §3.1
  "Exact init"), the pre-sharded build keeps half the expert bytes and peaks at that plus
  one expert's weight (``torch.cuda.max_memory_allocated`` around each build), the full build
  at every expert's full weight;
- ``parity``: megatron's MoE GPT (``tests.harness.gpt``, TEGroupedMLP experts) at EP1·EGTP2 built
  pre-sharded from the seed of the run without GTP (nothing copied in) reproduces that run
  (losses, grad norms, grads, weights; fp32, TF32 off, 1e-5);
- ``checkpoint``: that model saved at EP1·EGTP2 after 2 steps (distributed optimizer) loads into
  the run without GTP (EP1, expert DP2) with every weight and optimizer state bit for bit, is
  saved again there and loads back at EP1·EGTP2, bit for bit again;
- ``seq_init_memory``: as ``init_memory`` for two ``SequentialMLP`` blocks whose experts are
  megatron's ``TEColumnParallelLinear`` / ``TERowParallelLinear`` (``is_expert``, TE's
  ``reset_parameters`` in the expert RNG tracker's stream; the local linears in ``--cpu-smoke``):
  shards equal the full build's rows bit for bit, every RNG stream (the CUDA generator and
  megatron's tracker) ends where the full build leaves it, half the expert bytes kept, peak that
  plus one expert linear's weight;
- ``seq_parity``: megatron's MoE GPT with the TE layer spec without grouped GEMM
  (``SequentialMLP`` of TE linears) at EP1·EGTP2, experts built pre-sharded through the
  strategy's route (``preshard_config_layer_spec``) from the seed of the run without GTP,
  reproduces that run (fp32, TF32 off, 1e-5).

On the 2-GPU machine, from the repository root (about 1 minute; the script spawns its 2 ranks
itself and ends them after ``--timeout`` seconds)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    PYTHONPATH=/tmp/te:/tmp/site:$PWD timeout 115 python -m bench.gpu_grouped_experts \
        --timeout 110 --out /tmp/gpu_grouped_experts

On a machine with ONE GPU, ``--shared-device`` runs both ranks on ``cuda:0``, their
collectives staged through host memory over gloo (``nemo_gtp.cpu.staged_gloo``, backend
``cpu:gloo,cuda:staged_gloo``; every megatron / GTP sub-group inherits it)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TORCH_FR_BUFFER_SIZE=0
    PYTHONPATH=/tmp/te:/tmp/site:$PWD timeout 145 python -m bench.gpu_grouped_experts \
        --shared-device --timeout 140 --out /tmp/gpu_grouped_experts_1gpu

Every check keeps its meaning there: the parities and checkpoints compare values (the staged
collectives move the same values as NCCL; GTP sees a non-NCCL group, so it averages by a 1/2
pre-scale instead of inside the reduce-scatter, as on gloo), and the build-memory checks read
``torch.cuda.max_memory_allocated`` / ``memory_allocated``, which count this process's own
caching allocator only (the other rank's allocations on the same GPU are not in them, and
the staged collectives allocate no GPU scratch of their own). Not checked that way: NCCL
itself and the copy-engine gather; the ``seconds`` of each check mean nothing.

Here, on CPU (gloo, TE's stand-in, the same checks on tiny sizes; about 1 minute; add
``--shared-device`` to run them through the staged backend)::

    PYTHONPATH=$PWD python -m bench.gpu_grouped_experts --cpu-smoke --out /tmp/gpu_grouped_smoke

Writes ``gpu_grouped_experts.json`` and ``.md`` to ``--out`` after every check; the launch is
bounded by ``--timeout`` seconds. Success: exit 0, the last line ``[gpu_grouped_experts] ok:
<out>/gpu_grouped_experts.md``, every check ``ok`` in the markdown (and ``te: true`` in the JSON
on GPUs: TransformerEngine's classes ran, not the stand-in). Run as ``python -m
bench.gpu_grouped_experts`` from the repository root, so this checkout's ``nemo_gtp`` comes first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHECKS = ("init_memory", "parity", "checkpoint", "seq_init_memory", "seq_parity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--local-experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-ffn", type=int, default=2816)
    parser.add_argument("--timeout", type=float, default=110.0, help="whole launch, seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, TE's stand-in")
    parser.add_argument(
        "--shared-device",
        action="store_true",
        help="both ranks on cuda:0 (one GPU), collectives staged through host memory over gloo "
        "(backend staged_gloo); with --cpu-smoke: the staged backend on CPU",
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.local_experts, args.hidden, args.moe_ffn = 3, 32, 64
    for check in args.checks.split(","):
        if check not in CHECKS:
            parser.error(f"--checks: unknown check {check!r} (known: {', '.join(CHECKS)})")
    return args


# --------------------------------------------------------------------------------- checks
def _seed(device: str) -> None:
    torch.manual_seed(1234)
    if device == "cpu":
        from nemo_gtp.cpu.compat import model_parallel_cpu_manual_seed

        model_parallel_cpu_manual_seed(1234)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _expert_config(args: argparse.Namespace, on_gpu: bool) -> Any:
    """The two-block expert config both build checks use (fp32, no biases)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_moe_experts=args.local_experts,
        moe_ffn_hidden_size=args.moe_ffn,
        use_cpu_initialization=not on_gpu,  # on GPUs: built and initialized on the device
        params_dtype=torch.float32,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _compare_builds(full_build: tuple, presharded_build: tuple, scratch: int) -> dict:
    """A full and a pre-sharded build of the same experts, each ``(modules, peak bytes, kept
    bytes)``: the pre-sharded shards must equal the full build's rows bit for bit, keep half the
    expert bytes and peak at that plus ``scratch`` (one expert's full weight at a time)."""
    from nemo_gtp.engine import is_gtp_param

    full, full_peak, full_kept = full_build
    pre, peak, kept = presharded_build
    weights = sum(p.numel() * p.element_size() for p in full.parameters())
    want = full.state_dict()
    mismatched = [
        name
        for name, param in pre.named_parameters()
        if not (is_gtp_param(param) and torch.equal(param.data, param.gtp_spec.shard(want[name])))
    ]
    # bytes a build keeps besides the expert weights (TE's own small tensors), and slack for
    # the caching allocator's rounding
    extras, slack = max(0, full_kept - weights), 1 << 20
    ok = not mismatched and full_peak >= weights
    ok = ok and kept <= weights // 2 + extras + slack
    ok = ok and peak <= weights // 2 + scratch + extras + slack
    return dict(
        ok=ok,
        expert_bytes_full=weights,
        full_build_peak=full_peak,
        full_build_kept=full_kept,
        presharded_build_kept=kept,
        presharded_build_peak=peak,
        peak_over_full=round(peak / weights, 4),
        shards_equal_full_rows=not mismatched,
        mismatched=mismatched[:5],
    )


def check_init_memory(args: argparse.Namespace, device: str) -> dict:
    """Full vs pre-sharded build of two TEGroupedMLP blocks (see the module docstring)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from nemo_gtp.engine import GTPConfig
    from nemo_gtp.integrations.megatron import gtp_layer_spec, gtp_process_groups
    from tests.harness.gpt import Run, grouped_linear_kinds, gtp_groups
    from tests.harness.memory import allocation_peak

    on_gpu = device != "cpu"
    groups = gtp_groups(Run(egtp=2))
    pgs = gtp_process_groups(groups)
    local, hidden, ffn = args.local_experts, args.hidden, args.moe_ffn
    config = _expert_config(args, on_gpu)
    kinds = grouped_linear_kinds(on_gpu)
    fc1, fc2 = sorted(kinds, key=lambda cls: not kinds[cls])
    submodules = MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    presharded = gtp_layer_spec(
        submodules, groups, GTPConfig(pad_for_alignment=16), grouped_kinds=kinds
    )

    def build(spec: Any) -> torch.nn.ModuleList:
        _seed(device)
        return torch.nn.ModuleList(
            TEGroupedMLP(local, config, spec, pg_collection=pgs) for _ in range(2)
        )

    full, full_peak, full_kept = allocation_peak(lambda: build(submodules), device)
    pre, peak, kept = allocation_peak(lambda: build(presharded), device)
    one_expert = ffn * hidden * 4
    return dict(
        **_compare_builds((full, full_peak, full_kept), (pre, peak, kept), one_expert),
        te=fc1.__module__.startswith("megatron.core.extensions"),
        one_expert_bytes=one_expert,
    )


def _rng_states(device: str) -> list[torch.Tensor]:
    """The generator a build draws from and every state of megatron's RNG tracker."""
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker().get_states()
    generator = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    return [generator.clone(), *(tracker[name].cpu().clone() for name in sorted(tracker))]


def check_seq_init_memory(args: argparse.Namespace, device: str) -> dict:
    """Full vs pre-sharded build of two SequentialMLP blocks (see the module docstring)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from nemo_gtp.engine import GTPConfig
    from nemo_gtp.integrations.megatron import gtp_layer_spec, gtp_process_groups
    from nemo_gtp.integrations.megatron.sharding import te_parallel_linear_kinds
    from tests.harness.gpt import Run, gtp_groups
    from tests.harness.memory import allocation_peak

    on_gpu = device != "cpu"
    groups = gtp_groups(Run(egtp=2))
    pgs = gtp_process_groups(groups)
    local, hidden, ffn = args.local_experts, args.hidden, args.moe_ffn
    config = _expert_config(args, on_gpu)
    kinds = te_parallel_linear_kinds(import_te=True) if on_gpu else {}
    te = [cls for cls in kinds if cls.__name__ in ("TEColumnParallelLinear", "TERowParallelLinear")]
    fc1, fc2 = sorted(te, key=lambda cls: not kinds[cls]) or (
        ColumnParallelLinear,
        RowParallelLinear,
    )
    submodules = MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    spec = ModuleSpec(module=SequentialMLP, submodules=submodules)
    presharded = gtp_layer_spec(spec, groups, GTPConfig(pad_for_alignment=16)).submodules

    def build(subs: Any) -> tuple[Any, int, int]:
        _seed(device)
        return allocation_peak(
            lambda: torch.nn.ModuleList(
                SequentialMLP(local, config, subs, pg_collection=pgs) for _ in range(2)
            ),
            device,
        )

    full, full_peak, full_kept = build(submodules)
    after_full = _rng_states(device)
    pre, peak, kept = build(presharded)
    same_rng = all(torch.equal(a, b) for a, b in zip(_rng_states(device), after_full))
    one_linear = ffn * hidden * 4
    # megatron's CPU initialization (--cpu-smoke) also holds its master at shard size
    scratch = one_linear + (0 if on_gpu else one_linear // 2)
    verdict = _compare_builds((full, full_peak, full_kept), (pre, peak, kept), scratch)
    return dict(
        verdict,
        ok=verdict["ok"] and same_rng,
        te=fc1.__module__.startswith("megatron.core.extensions"),
        one_linear_bytes=one_linear,
        rng_streams_unchanged=same_rng,
    )


def check_seq_parity(args: argparse.Namespace, device: str) -> dict:
    """GPT with SequentialMLP experts (TE linears on GPUs): EP1·EGTP2, experts built
    pre-sharded, vs the run without GTP."""
    from tests.harness.gpt import Run, build, train, train_built

    fields = {**RUN_FIELDS, "grouped": False, "spec": "local" if device == "cpu" else "te"}
    base = Run(steps=4, **fields)
    reference = train(base)
    repeat = train(base) if device != "cpu" else None
    case = dataclasses.replace(base, egtp=2, preshard_experts=True)
    setup = build(case)
    # the experts' linears as built: GTPExpertTEColumnParallelLinear ... on GPUs
    built = sorted(
        {type(m).__name__ for m in setup["model"].modules() if type(m).__name__[:9] == "GTPExpert"}
    )
    result = train_built(setup, case)
    judged = judged_parity(result, reference, repeat)
    te = device == "cpu" or all("TE" in name for name in built)
    ok = judged["ok"] and len(built) == 2 and te
    return dict(judged, ok=ok, expert_classes=built, losses=result["losses"])


RUN_FIELDS = dict(experts=4, topk=2, hidden=64, ffn=128, moe_ffn=96, grouped=True)


def judged_parity(result: dict, reference: dict, repeat: dict | None) -> dict:
    """GTP vs the reference at fp32's 1e-5, or within twice the reference's own run-to-run
    spread where a second reference run differs (TE's fp32 LayerNorm backward and grouped GEMM
    are not bit-deterministic on GPUs; on CPU the runs repeat exactly)."""
    from tests.harness.gpt import assert_parity

    worst = assert_parity(result, reference, tol=float("inf"))
    floor = 0.0 if repeat is None else assert_parity(repeat, reference, tol=float("inf"))
    tol = max(1e-5, 2 * floor)
    return dict(ok=worst <= tol, max_rel_err=worst, noise_floor=floor, tolerance=tol)


def check_parity(args: argparse.Namespace, device: str) -> dict:
    """GPT with TEGroupedMLP experts: EP1·EGTP2 built pre-sharded vs the run without GTP."""
    from tests.harness.gpt import Run, train

    base = Run(steps=4, **RUN_FIELDS)
    reference = train(base)
    repeat = train(base) if device != "cpu" else None
    result = train(dataclasses.replace(base, egtp=2, presharded=True))
    return dict(judged_parity(result, reference, repeat), losses=result["losses"])


def check_checkpoint(args: argparse.Namespace, device: str, root: str) -> dict:
    """EP1·EGTP2 -> no GTP -> EP1·EGTP2, weights and optimizer state bit for bit."""
    from nemo_gtp.integrations.megatron import load_gtp_checkpoint, save_gtp_checkpoint
    from tests.harness.checkpoint import moe_full_state
    from tests.harness.gpt import Run, build, train_built

    saved = Run(steps=2, distopt=True, egtp=2, presharded=True, **RUN_FIELDS)
    setup = build(saved)
    train_built(setup, saved)
    want = moe_full_state(setup["ddp"], setup["optimizer"])
    first, second = os.path.join(root, "egtp2"), os.path.join(root, "plain")
    save_gtp_checkpoint(first, setup["ddp"], setup["optimizer"], setup["groups"])
    records = {}
    for name, run, source, resave in (
        ("egtp2->plain", dataclasses.replace(saved, egtp=1, presharded=False), first, second),
        ("plain->egtp2", saved, second, None),
    ):
        target = build(run)
        load_gtp_checkpoint(source, target["ddp"], target["optimizer"], target["groups"])
        got = moe_full_state(target["ddp"], target["optimizer"])
        differ = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
        records[name] = dict(tensors=len(want), bit_identical=not differ, differ=differ[:5])
        if resave is not None:
            save_gtp_checkpoint(resave, target["ddp"], target["optimizer"], target["groups"])
    return dict(ok=all(r["bit_identical"] for r in records.values()), **records)


# ------------------------------------------------------------------------------- report
def write(args: argparse.Namespace, records: dict, device: str) -> None:
    """``gpu_grouped_experts.json`` and ``.md`` under ``--out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = all(records.get(c, {}).get("ok") for c in args.checks.split(","))
    result = dict(
        ok=ok,
        device=device,
        shared_device=args.shared_device,
        torch=torch.__version__,
        checks=records,
    )
    (out / "gpu_grouped_experts.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# Routed experts pre-sharded over EGTP2 ({device})", ""]
    if args.shared_device:
        lines += [SHARED_DEVICE_NOTE, ""]
    lines += ["| check | result | details |", "|---|---|---|"]
    for name, rec in records.items():
        if "error" in rec:
            detail = rec["error"].splitlines()[0][:160]
        else:
            detail = ", ".join(f"{k}={v}" for k, v in rec.items() if k not in ("ok", "losses"))
        lines.append(f"| {name} | {'ok' if rec.get('ok') else 'FAILED'} | {detail[:400]} |")
    (out / "gpu_grouped_experts.md").write_text("\n".join(lines) + "\n")


SHARED_DEVICE_NOTE = (
    "**--shared-device**: both ranks on one device (cuda:0; the CPU with --cpu-smoke), "
    "collectives staged through host memory over gloo (staged_gloo). Values are those of two "
    "GPUs; the memory figures count each rank's own allocator (per process), so they hold too; "
    "`seconds` mean nothing."
)


# ------------------------------------------------------------------------------- processes
def world_plan(rank: int, args: argparse.Namespace) -> tuple[str, str]:
    """``(backend, device)`` of ``rank``: gloo on CPU (``--cpu-smoke``), NCCL on ``cuda:<rank>``,
    or under ``--shared-device`` the staged backend on ``cuda:0`` (on CPU with ``--cpu-smoke``).

    Example::

        world_plan(1, parse_args(["--out", "o", "--shared-device"]))
        # ("cpu:gloo,cuda:staged_gloo", "cuda:0")
    """
    from nemo_gtp.cpu.staged_gloo import rank_backend  # importing registers the backend

    backend, index = rank_backend(args.shared_device, not args.cpu_smoke, rank)
    return backend, "cpu" if index is None else f"cuda:{index}"


def init_world(rank: int, world: int, args: argparse.Namespace, store_path: str) -> str:
    """Join the ``world``-rank group of :func:`world_plan` through a file store; the device."""
    backend, device = world_plan(rank, args)
    # under --shared-device every rank is local rank 0 of its own "node" (as bench_nemo.py's)
    local_rank = 0 if args.shared_device else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        backend,
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(30.0, args.timeout / 2)),
        # NCCL binds its communicator to the device at once; the staged group needs no binding
        **({"device_id": torch.device(device)} if backend == "nccl" else {}),
    )
    return device


def worker(rank: int, world: int, args: argparse.Namespace, store_path: str, root: str) -> None:
    """One rank: every check in turn; rank 0 writes the results after each."""
    cpu = args.cpu_smoke
    if cpu:
        torch.set_num_threads(1)
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat(nemo=False)
    device = init_world(rank, world, args, store_path)
    records: dict[str, dict] = {}
    try:
        for name in args.checks.split(","):
            start = time.monotonic()
            try:
                if name == "init_memory":
                    records[name] = check_init_memory(args, device)
                elif name == "parity":
                    records[name] = check_parity(args, device)
                elif name == "checkpoint":
                    records[name] = check_checkpoint(args, device, root)
                elif name == "seq_init_memory":
                    records[name] = check_seq_init_memory(args, device)
                else:
                    records[name] = check_seq_parity(args, device)
            except Exception as err:  # noqa: BLE001 - recorded; the next check runs
                records[name] = {"ok": False, "error": f"{err!r}\n{traceback.format_exc()}"}
                print(f"[rank {rank}] {name} failed: {err!r}", flush=True)
            records[name]["seconds"] = round(time.monotonic() - start, 1)
            if rank == 0:
                write(args, records, "cpu" if cpu else torch.cuda.get_device_name())
                print(f"[gpu_grouped_experts] {name}: ok={records[name]['ok']}", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn 2 ranks, bound the launch by ``--timeout``; exit 0 when every check passed."""
    args = parse_args(argv)
    world = 2
    gpus = 1 if args.shared_device else world
    if not args.cpu_smoke and torch.cuda.device_count() < gpus:
        hint = "" if args.shared_device else " (one GPU: --shared-device)"
        print(f"needs {gpus} GPU(s), found {torch.cuda.device_count()}{hint}", file=sys.stderr)
        return 2
    if args.shared_device:
        print(
            f"[gpu_grouped_experts] --shared-device: {world} ranks on "
            f"{'the CPU' if args.cpu_smoke else 'cuda:0'}, collectives staged through the host "
            "(staged_gloo)",
            flush=True,
        )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # TF32 off in cuBLAS itself: TE's fp32 GEMMs ignore torch's allow_tf32 flags. With TF32 the
    # GPT parity read 9.9e-5 / 4.2e-5 (2xH200) against fp32's 1e-5; without it 3.1e-7 / 3.5e-7
    # (1xH200, --shared-device): the gap was TF32 rounding, not GTP.
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    from tests.harness.spawn import spawn_bounded

    work = tempfile.mkdtemp(prefix="gpu_grouped_experts_")
    failed = spawn_bounded(
        worker,
        (world, args, os.path.join(work, "store"), os.path.join(work, "ckpt")),
        world,
        args.timeout,
    )
    if failed is not None:
        print(f"[gpu_grouped_experts] {failed}", file=sys.stderr)
    result_file = Path(args.out) / "gpu_grouped_experts.json"
    written_ok = result_file.exists() and json.loads(result_file.read_text())["ok"]
    ok = written_ok and (failed is None or failed.startswith("timed out"))
    summary = Path(args.out) / "gpu_grouped_experts.md"
    print(f"[gpu_grouped_experts] {'ok' if ok else 'FAILED'}: {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Per-layer CUDA graphs under GTP on 2 GPUs: graphed GTP2 vs eager GTP2 vs DP2 (design §3.5).

Question: Do per-layer CUDA graphs under GTP replay bit for bit what eager GTP computes, and what
do they save in step time?

Ranks: NCCL, one rank per GPU (self-spawning); ``--cpu-smoke``: the same code on CPU/gloo.

Trains megatron-core's GPTModel (local layer spec; same init and data in every mode; built by
``tests.harness.gpt.build``) with megatron's own schedule
(``forward_backward_no_pipelining``: the step-1 recording, the per-layer capture after its
``finalize_model_grads``, replays from step 2), megatron DDP with overlapped bucket reductions
and the distributed optimizer, in these modes:

- ``dp2_eager``  / ``dp2_full``: no GTP, eager / megatron's per-layer graphs (the baselines);
- ``gtp2_eager``: GTP2, eager;
- ``gtp2_full`` / ``gtp2_attn``: GTP2 with ``cuda_graph_impl="local"`` and ``cuda_graph_scope``
  ``"full"`` / ``"attn"`` (megatron-core 0.15 captures whole layers for both);
- ``gtp2_full_ring``: ``gtp2_full`` with ``GTPConfig.graph_wgrad_ring_size=2`` (a layer's head
  reduce-scatter runs in the next layer's graph).

and compares per-step loss and grad norm (fp32 by default, TF32 off: the parity oracle's
1e-5; ``--bf16``: 2e-2) of each graphed GTP2 mode against ``gtp2_eager`` (step 1, eager in
both, must be bit-identical) and against ``dp2_full``, and ``gtp2_eager`` against
``dp2_eager``; plus the median step time of each mode and whether megatron really replayed
(graphs created, GTP's Python gather count per replayed step 0).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    python -m bench.gpu_layer_graphs --out results_dir          # spawns its 2 ranks itself
    python -m bench.gpu_layer_graphs --cpu-smoke --out /tmp/x   # the same code on CPU / gloo

Writes ``gpu_layer_graphs.json`` and ``gpu_layer_graphs.md`` to ``--out`` after every mode (a
mode that fails is recorded with its error and the next one runs); the whole launch is bounded
by ``--timeout`` seconds. Success: every check in the markdown reads ``ok``. On CPU nothing is
captured (no CUDA graphs): ``--cpu-smoke`` runs the segmented GTP schedule eagerly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tests.harness.spawn import spawn_bounded

if TYPE_CHECKING:
    from tests.harness.gpt import Run

MODES = {  # name -> (GTP size, cuda_graph_scope or "" for eager, graph_wgrad_ring_size)
    "dp2_eager": (1, "", 0),
    "dp2_full": (1, "full", 0),
    "gtp2_eager": (2, "", 0),
    "gtp2_full": (2, "full", 0),
    "gtp2_attn": (2, "attn", 0),
    "gtp2_full_ring": (2, "full", 2),
}
CHECKS = [  # (mode, reference, what)
    ("gtp2_full", "gtp2_eager", "graphed GTP2 (full) = eager GTP2"),
    ("gtp2_attn", "gtp2_eager", "graphed GTP2 (attn) = eager GTP2"),
    ("gtp2_full_ring", "gtp2_eager", "graphed GTP2 (full, wgrad ring) = eager GTP2"),
    ("gtp2_eager", "dp2_eager", "eager GTP2 = eager DP2 (parity oracle)"),
    ("gtp2_full", "dp2_full", "graphed GTP2 = graphed DP2"),
    ("dp2_full", "dp2_eager", "graphed DP2 = eager DP2 (megatron alone)"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timing-from", type=int, default=3, help="first step in the median")
    parser.add_argument("--coalesce-mb", type=float, default=192.0)
    parser.add_argument("--bf16", action="store_true", help="bf16 params (tolerance 2e-2)")
    parser.add_argument(
        "--spec",
        choices=("local", "te"),
        default="local",
        help="layer spec: megatron-local linears, or TransformerEngine's (GPU only; TE's RNG "
        "tracker, TE linears sliced to GTP shards by shard_model so every mode starts equal)",
    )
    parser.add_argument("--timeout", type=float, default=150.0, help="whole launch, seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny model")
    args = parser.parse_args(argv)
    if args.cpu_smoke and args.spec == "te":
        parser.error("--spec te needs TransformerEngine on GPUs: not with --cpu-smoke")
    if args.cpu_smoke:
        args.layers, args.hidden, args.ffn, args.heads = 2, 64, 128, 4
        args.vocab, args.seq, args.steps, args.timing_from = 128, 16, 4, 1
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r} (known: {', '.join(MODES)})")
    return args


# ------------------------------------------------------------------------------- one mode
def harness_run(args: argparse.Namespace, gtp: int, scope: str, ring: int) -> Run:
    """One mode as the GPT harness's :class:`Run`: this benchmark's sizes, megatron DDP with
    overlapped reductions in megatron's default buckets and the distributed optimizer."""
    from tests.harness.gpt import Run  # megatron: imported by the ranks only

    return Run(
        gtp=gtp,
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        bf16=args.bf16,
        spec=args.spec,
        lr=3e-4,
        distopt=True,
        bucket_size=None,
        coalesce_mb=args.coalesce_mb,
        gather_backend="process_group",
        graph_scope=scope,
        graph_ring=ring,
        capturable_rng=True,  # the same RNG tracker kind in eager and graphed modes
    )


def build(args: argparse.Namespace, gtp: int, scope: str, ring: int) -> dict:
    """GPT, GTP (if ``gtp`` > 1), DDP and optimizer for one mode, on this rank (the harness's
    :func:`~tests.harness.gpt.build`; the same initial weights in every mode)."""
    from nemo_gtp.integrations.megatron.layer_graphs import reset_layer_graphs
    from tests.harness.gpt import build as build_gpt

    reset_layer_graphs()  # the previous mode's graphs are process-global in megatron
    setup = build_gpt(harness_run(args, gtp, scope, ring))
    setup["runtime"] = getattr(setup["model"], "gtp_runtime", None) if gtp > 1 else None
    return setup


def batch(args: argparse.Namespace, step: int, microbatch: int, rank: int, device: str) -> dict:
    """One micro-batch; the same for a data rank in every mode (DP2 and GTP2: 2 data ranks)."""
    gen = torch.Generator().manual_seed(100_000 * step + 100 * microbatch + rank)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=gen)
    out = dict(
        tokens=tokens[:, :-1],
        labels=tokens[:, 1:],
        position_ids=torch.arange(args.seq).expand(args.mbs, args.seq),
    )
    if device == "cpu":  # on CUDA megatron builds the causal mask itself
        out["attention_mask"] = torch.triu(
            torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1
        )
    return {k: v.to(device) for k, v in out.items()}


def forward_step(data_iterator, model):  # noqa: ANN001, ANN201
    """megatron's forward-step contract: output and a loss function of it."""
    data = next(data_iterator)
    output = model(
        data["tokens"], data["position_ids"], data.get("attention_mask"), labels=data["labels"]
    )

    def loss_func(per_token: torch.Tensor):  # noqa: ANN202
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def graphs_created(model: torch.nn.Module) -> int:
    """How many per-layer forward graphs megatron captured for ``model`` (0: eager)."""
    return sum(
        runner.fwd_graph is not None
        for module in model.modules()
        for runner in getattr(getattr(module, "cudagraph_manager", None), "cudagraph_runners", [])
    )


def run_mode(args: argparse.Namespace, name: str, device: str) -> dict:
    """Train one mode; per-step loss (mean over data ranks), grad norm, step time."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gtp, scope, ring = MODES[name]
    setup = build(args, gtp, scope, ring)
    ddp, optimizer, runtime = setup["ddp"], setup["optimizer"], setup["runtime"]
    data_rank = parallel_state.get_data_parallel_rank()
    data_group = parallel_state.get_data_parallel_group()
    forward_backward = get_forward_backward_func()
    record = {"mode": name, "gtp": gtp, "scope": scope or None, "ring": ring}
    record.update(losses=[], grad_norms=[])
    record.update(step_s=[], python_gathers=[], builds=[])
    cuda = device != "cpu"
    for step in range(args.steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([batch(args, step, m, data_rank, device) for m in range(args.microbatches)])
        if runtime is not None:
            runtime.stats.reset()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=args.microbatches,
            seq_length=args.seq,
            micro_batch_size=args.mbs,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        record["step_s"].append(time.perf_counter() - start)
        loss = torch.stack([r["lm loss"] for r in reduced]).mean().reshape(1)
        dist.all_reduce(loss, group=data_group)
        record["losses"].append(float(loss) / dist.get_world_size(data_group))
        record["grad_norms"].append(float(grad_norm))
        record["python_gathers"].append(runtime.stats.gathers if runtime is not None else None)
        record["builds"].append(runtime.builds if runtime is not None else None)
    timed = record["step_s"][args.timing_from :] or record["step_s"]
    record["median_step_ms"] = 1000 * statistics.median(timed)
    record["graphs_created"] = graphs_created(ddp.module) if cuda and scope else 0
    if runtime is not None:
        record["segments"] = len(runtime.segments)
        record["fallback_allocations"] = runtime.stats.fallback_allocations
    del setup, ddp, optimizer, runtime
    return record


# ------------------------------------------------------------------------------- report
def rel(a: float, b: float) -> float:
    """|a - b| / |b| (0 when both are 0; inf for a NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


def compare(result: dict, reference: dict, tol: float) -> dict:
    """Per-step loss and grad-norm agreement of two modes."""
    steps = min(len(result["losses"]), len(reference["losses"]))
    loss = max((rel(result["losses"][i], reference["losses"][i]) for i in range(steps)), default=0)
    norm = max(
        (rel(result["grad_norms"][i], reference["grad_norms"][i]) for i in range(steps)), default=0
    )
    first = steps > 0 and result["losses"][0] == reference["losses"][0]
    return dict(
        steps=steps,
        max_rel_loss=loss,
        max_rel_grad_norm=norm,
        step1_loss_identical=first,
        ok=steps > 0 and loss <= tol and norm <= tol,
    )


def report(args: argparse.Namespace, records: dict[str, dict], device: str) -> dict:
    """The checks and the step-time table (JSON-able)."""
    tol = 2e-2 if args.bf16 else 1e-5
    checks = []
    for mode, ref, what in CHECKS:
        if mode in records and ref in records:
            a, b = records[mode], records[ref]
            if "error" in a or "error" in b:
                checks.append(dict(check=what, mode=mode, reference=ref, ok=False, error=True))
                continue
            checks.append(dict(check=what, mode=mode, reference=ref, **compare(a, b, tol)))
    for name, rec in records.items():
        if "error" in rec or not rec.get("scope") or device == "cpu":
            continue
        replayed = rec["graphs_created"] >= args.layers and rec.get("segments", args.layers) > 0
        if rec["gtp"] > 1:  # GTP's Python ran no gather once the layers replay
            replayed = replayed and all(g == 0 for g in rec["python_gathers"][1:])
        checks.append(dict(check=f"{name} replays captured layers", mode=name, ok=replayed))
    return dict(
        device=device,
        tolerance=tol,
        args=vars(args),
        checks=checks,
        ok=all(c["ok"] for c in checks) and all("error" not in r for r in records.values()),
        records=records,
    )


def write(args: argparse.Namespace, result: dict) -> None:
    """``gpu_layer_graphs.json`` and ``gpu_layer_graphs.md`` under ``--out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_layer_graphs.json").write_text(json.dumps(result, indent=1, default=str))
    records = result["records"]
    lines = [
        "# Per-layer CUDA graphs under GTP (2 ranks)",
        "",
        f"`{' '.join(sys.argv)}` on {result['device']}, "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}; GPT {args.layers} layers, "
        f"hidden {args.hidden}, ffn {args.ffn}, seq {args.seq}, micro-batch {args.mbs} x "
        f"{args.microbatches}, {'bf16' if args.bf16 else 'fp32 (TF32 off)'}, {args.spec} spec, "
        f"{args.steps} steps; "
        f"tolerance {result['tolerance']:g}. Overall: **{'ok' if result['ok'] else 'FAILED'}**",
        "",
        "| mode | median step (ms) | vs dp2_eager | final loss | graphs | error |",
        "|---|---|---|---|---|---|",
    ]
    base = records.get("dp2_eager", {}).get("median_step_ms")
    for name, rec in records.items():
        if "error" in rec:
            lines.append(f"| {name} | | | | | {rec['error'].splitlines()[0][:120]} |")
            continue
        ratio = f"{rec['median_step_ms'] / base:.2f}" if base else ""
        lines.append(
            f"| {name} | {rec['median_step_ms']:.1f} | {ratio} | {rec['losses'][-1]:.6f} | "
            f"{rec['graphs_created']} | |"
        )
    lines += ["", "| check | result | max rel loss | max rel grad norm | step 1 identical |"]
    lines += ["|---|---|---|---|---|"]
    for check in result["checks"]:
        lines.append(
            f"| {check['check']} | {'ok' if check['ok'] else 'FAILED'} | "
            f"{check.get('max_rel_loss', ''):.3g} | {check.get('max_rel_grad_norm', ''):.3g} | "
            f"{check.get('step1_loss_identical', '')} |"
            if "max_rel_loss" in check
            else f"| {check['check']} | {'ok' if check['ok'] else 'FAILED'} | | | |"
        )
    (out / "gpu_layer_graphs.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------- processes
def worker(rank: int, world: int, args: argparse.Namespace, store_path: str) -> None:
    """One rank: every mode in turn; rank 0 writes the results after each."""
    cpu = args.cpu_smoke
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if cpu:
        torch.set_num_threads(1)
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat(nemo=False)
        device = "cpu"
    else:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = f"cuda:{rank}"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(30.0, args.timeout / 2)),
        **({} if cpu else {"device_id": torch.device(device)}),
    )
    records: dict[str, dict] = {}
    try:
        for name in args.modes.split(","):
            try:
                records[name] = run_mode(args, name, device)
            except Exception as err:  # noqa: BLE001 - recorded; the next mode runs
                records[name] = {"mode": name, "error": f"{err!r}\n{traceback.format_exc()}"}
                print(f"[rank {rank}] {name} failed: {err!r}", flush=True)
            if rank == 0:
                write(args, report(args, records, device))
                rec = records[name]
                summary = rec.get("error", "").splitlines()[:1] or [
                    f"{rec['median_step_ms']:.1f} ms/step, loss {rec['losses'][-1]:.5f}"
                ]
                print(f"[gpu_layer_graphs] {name}: {summary[0]}", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn 2 ranks, bound the launch by ``--timeout``; exit 0 when every check passed."""
    args = parse_args(argv)
    world = 2
    if not args.cpu_smoke and torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    store_dir = tempfile.mkdtemp(prefix="gpu_layer_graphs_")
    failed = spawn_bounded(
        worker, (world, args, os.path.join(store_dir, "store")), world, args.timeout
    )
    if failed is not None:
        print(f"[gpu_layer_graphs] {failed}", file=sys.stderr)
    result_file = Path(args.out) / "gpu_layer_graphs.json"
    written_ok = result_file.exists() and json.loads(result_file.read_text())["ok"]
    if written_ok and failed is not None and failed.startswith("timed out"):
        # every check ran and passed; the ranks were still tearing down (2xH200: NCCL's
        # process-group teardown outlived a 115 s deadline once)
        print("[gpu_layer_graphs] the deadline fired after the result was written", file=sys.stderr)
        failed = None
    ok = written_ok and failed is None
    summary = Path(args.out) / "gpu_layer_graphs.md"
    print(f"[gpu_layer_graphs] {'ok' if ok else 'FAILED'}: {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

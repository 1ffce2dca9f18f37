"""Host cost of a NeMo step on one device: rank 0 of a world whose collectives are no-ops.

Question: Is a host-bound GTP step GTP's own Python? The NeMo step's host time without
communication, on one device (the one-GPU performance regression check).

Ranks: fake: rank 0 of a fake process group (collectives return at once and move nothing), on one
GPU or CPU; never an NCCL figure.

A GTP step that is host-bound costs its Python and launch work, not its communication. This runs
the NeMo path (recipe → ``GTPMegatronStrategy`` → ``nl.Trainer``) as rank 0 of a world of
``--world`` ranks on torch's *fake* process-group backend: every collective returns at once and
moves nothing, everything else (megatron, TE, GTP's chains, streams, events, the optimizer) is
real. Numbers are meaningless (gathered rows stay uninitialized); step times are not: on one
GPU (or on CPU) GTP2 vs DP2 at the same per-rank shapes gives the host time GTP adds per step,
and a cProfile dump (``host_profile_<mode>.pstats``) says where — without a second GPU
(``python -m bench.tools pstats-diff`` diffs two dumps, packed into ``host_profiles.tgz``).
NCCL's own launch cost, and anything that waits on a peer, is what this cannot see;
``bench.bench_nemo`` measures the real thing on ≥ 2 GPUs. One fake-world cost falls on GTP's
side only (its ratios are upper bounds): torch's fake backend copies every all-gather input
into its output (a copy kernel per tensor and rank, where NCCL launches one kernel per
collective); the ``%nocopy`` twin of a GTP mode issues its collectives without them (a lower
bound). The "inside GTP" timer (``--timer``) also falls on GTP's side: ratio runs take
``--timer none``; ``--kernels`` profiles the device side (time per kernel kind per step).

    python -m bench.host_fake --modes dp2_te,gtp2_te --tokens 2048 --repeat 3 --out results/hf
    python -m bench.host_fake --modes dp2_cpu,gtp2_cpu --out /tmp/host_fake   # CPU, tiny GPT
    python -m bench.host_fake --modes dp2_te,gtp2_te,gtp2_te%general%flatten --repeat 3 ...

A mode's ``%name`` suffixes (:data:`PATCHES`) restore an earlier host path in its process, so
old and new code run interleaved in one launch; ``%te`` instead times TE's own entry points
and C++ functions beside GTP's, in a DP2 and a GTP2 mode alike
(``--modes dp2_te%te,gtp2_te%te``: the same TE call's host µs in both fits, TE's GEMMs per
variant in ``gemm_variants``).

Per mode (one process each; ``--one-process``: every fit in one process, NeMo and TE
imported once, megatron's and NeMo's process-global state torn down between fits, ``--budget``
seconds after which no fit is started): median step wall time and median host time to issue
forward + backward (batch start → before the optimizer step, no device sync), over ``--steps``
steps after ``--warmup``; model FLOPs per step, TFLOP/s and MFU against the device's dense peak
(``bench.common.gpt_flops``; none off known GPUs), peak memory; CPU time per thread and Python
GC time over those steps; then ``--free-steps`` free-running steps (no sync of this script's
between the window's edges: the mean step and MFU a training loop gets, the host queueing
ahead until the stack's own syncs; ``--sync-sites`` names those syncs by Python site); then
``--profile`` steps under cProfile. Hosts are noisy (the same DP2
fit moved by up to 30 % between launches on a shared VM): ``--repeat N`` runs the modes N times
interleaved, and the table gives each GTP mode's ratio to its DP2 twin and each ``@model.*``
override's ratio to the recipe's own settings per repeat, and their median. ``--also
4096:MODES`` adds modes at their own tokens per GPU:

    python -m bench.host_fake --one-process --repeat 3 --modes dp2_te@eager,dp2_te@layergraph \
        --tokens 4096 --also 4096:dp2_te@layergraph@model.bias_dropout_fusion=false --out hf
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from bench.common import ROOT, mfu_text, module_argv, with_root
from bench.sync_sites import HostReads, SyncSites

CPU_SHAPE = [  # a host-bound tiny GPT: many small layers (CPU, fp32)
    "model.num_layers=24",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "data.seq_length=16",
    "data.micro_batch_size=1",
    "data.global_batch_size=2",
]


def _patch_general_consume() -> None:
    """``%general``: every TE protocol consume on the general path (the one-frame dense consume
    of design §3.1 "Host cost per weight" off), to measure what it saves in one launch."""
    from nemo_gtp.engine.runtime import GTPRuntime

    GTPRuntime._dense_consume = lambda self, param, state, direction: None


def _patch_flatten_allreduce() -> None:
    """``%flatten``: the replicated params' GTP all-reduce as it was before 2026-12-02 (flatten,
    all-reduce, unflatten, one copy back per param) instead of in place and coalesced."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from nemo_gtp.integrations.megatron import finalize

    def flatten_allreduce(model_chunks, group, *, per_token, experts=False, params=None):  # noqa: ANN001, ANN202
        size = dist.get_world_size(group)
        if size == 1:
            return
        if params is None:
            params = finalize.replicated_params(model_chunks, experts=experts)
        for grads in finalize.main_grads_by_dtype(params).values():
            flat = _flatten_dense_tensors(grads)
            if not per_token:
                flat.mul_(1.0 / size)
            dist.all_reduce(flat, group=group)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)

    finalize.allreduce_replicated_grads = flatten_allreduce


def _patch_te_columnwise() -> None:
    """``%tecolumnwise``: the blockwise backward hand-out as it was before 2026-12-03 (TE's
    ``_create_columnwise`` per hand-out: its checks, shapes and slices every call) instead of the
    column-wise plan kept per gathered buffer."""
    import torch

    from nemo_gtp.integrations.megatron.sharding import te_fp8

    def wrap_blocks(self, param, direction, gathered):  # noqa: ANN001, ANN202
        hand_out = gathered.consumer
        if hand_out is None:
            hand_out = gathered.consumer = self._block_hand_out(param, direction, gathered)
        tensor = hand_out.tensor
        tensor._rowwise_data = gathered.data.view(torch.uint8)
        tensor._rowwise_scale_inv = gathered.scale_inv
        if direction is te_fp8.Direction.BWD and gathered.transpose is not None:
            tensor._columnwise_data = gathered.transpose.view(torch.uint8)
            tensor._columnwise_scale_inv = gathered.columnwise_scale_inv
            tensor._create_columnwise()
        else:
            tensor._columnwise_data = tensor._columnwise_scale_inv = None
        return tensor

    te_fp8.TEFP8Gather._wrap_blocks = wrap_blocks


def _patch_count_bails() -> None:
    """``%why``: count, per reason, the TE protocol consumes the one-frame dense consume hands
    to the general path (printed as ``DENSE_BAILS {...}`` at exit)."""
    import atexit
    import collections
    import json as _json

    from nemo_gtp.engine import runtime as rt
    from nemo_gtp.engine.chain import ChainPhase
    from nemo_gtp.engine.gather import backward_task_id
    from nemo_gtp.engine.param import Direction

    reasons: collections.Counter = collections.Counter()
    dense = rt.GTPRuntime._dense_consume

    def why(self, param, state, direction) -> str:  # noqa: ANN001
        # GTPRuntime._dense_consume's conditions, in its order, each named (kept in step with it
        # by hand: a diagnostic adds no branch to the hot path)
        policy = self.quantized_gather
        if self.fp8_primary is not None:
            return "fp8_primary"
        if self.trace is not None:
            return "trace"
        if self.wait_timer.enabled:
            return "wait_timer"
        if direction is Direction.FWD:
            if backward_task_id() != -1:
                return "recompute"
            if policy is not None and policy.forward_scaling(param) is not None:
                return "fp8 gather"
            slot = state.fwd
        else:
            if self.ring_carry:
                return "carry"
            if state.quantize_note is not None:
                return "quantize_note"
            if policy is not None and state.fp8_forward is not None:
                return "fp8 gather"
            slot = state.bwd
        if slot.fmt is not None:
            return "slot.fmt"
        return "other"

    def counted(self, param, state, direction):  # noqa: ANN001, ANN202
        out = dense(self, param, state, direction)
        reasons["taken" if out is not None else why(self, param, state, direction)] += 1
        return out

    def not_linked(self, param, direction):  # noqa: ANN001, ANN202
        state = param.gtp_state
        if not (state.group < 0 and state.chain.phase is ChainPhase.LINKED):
            reasons[f"not linked / grouped ({state.chain.phase.name})"] += 1
        return general(self, param, direction)

    general = rt.GTPRuntime.materialize_group_for_protocol
    rt.GTPRuntime._dense_consume = counted
    rt.GTPRuntime.materialize_group_for_protocol = not_linked
    atexit.register(lambda: print("DENSE_BAILS " + _json.dumps(dict(reasons)), flush=True))


GEMM_VARIANTS: dict | None = None
"""``%te``: host ns and calls per TE GEMM variant (layouts, output, accumulate, operand kinds and
alignment), over the timed window; None when not measured."""


def _patch_gemm_variants() -> None:
    """``%te``: count TE's ``generic_gemm`` calls per variant into :data:`GEMM_VARIANTS`."""
    global GEMM_VARIANTS
    from bench.common import te_extension

    tex = te_extension()
    if tex is None:  # no TE (CPU): nothing to count
        return
    GEMM_VARIANTS = {}
    gemm, clock, variants = tex.generic_gemm, time.perf_counter_ns, GEMM_VARIANTS

    def operand(t) -> str:  # noqa: ANN001
        if not hasattr(t, "data_ptr"):
            return type(t).__name__
        return (
            f"{type(t).__name__}:{str(t.dtype)[6:]}:{tuple(t.shape)}:"
            f"{'c' if t.is_contiguous() else 'nc'}:a{t.data_ptr() % 256}"
        )

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = clock()
        try:
            return gemm(*args, **kwargs)
        finally:
            spent = clock() - start
            a, transa, b, transb, out = args[:5]
            key = (
                f"{'T' if transa else 'N'}{'T' if transb else 'N'} A={operand(a)} "
                f"B={operand(b)} out={operand(out) if out is not None else None} "
                f"out_dtype={args[6]} grad={args[11]} acc={args[14]}"
            )
            entry = variants.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += spent

    tex.generic_gemm = timed


_NAMES_COPIED = ("all_gather", "reduce_scatter", "all_gather_coalesced", "reduce_scatter_coalesced")


def set_no_copy(on: bool) -> None:
    """``%nocopy`` on or off for the next fit: GTP's collectives (``GroupCollectives``) issue one
    C++ call each on the fake group (an all-reduce of a one-element tensor: no kernel, no copy)
    instead of the fake backend's all-gather / reduce-scatter, which copy every input into its
    output (a copy kernel per tensor and rank: 2 per gathered weight at world 2, where NCCL
    launches one kernel per collective). Bounds from below what the fake world's copies add to
    GTP's side. Set per fit (``--one-process`` runs it beside unpatched fits); off restores
    the methods themselves, so an unpatched fit pays no wrapper."""
    import torch

    from nemo_gtp.engine.collectives import GroupCollectives

    originals = _ORIGINALS.setdefault(
        GroupCollectives, {name: vars(GroupCollectives)[name] for name in _NAMES_COPIED}
    )
    if not on:
        for name, method in originals.items():
            setattr(GroupCollectives, name, method)
        return
    token: dict = {}

    def issue_nothing(self, outputs, inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        device = (outputs[0] if isinstance(outputs, list) else outputs).device
        one = token.get(device)
        if one is None:
            one = token[device] = [torch.zeros(1, device=device)]
        return self.group.allreduce(one)

    for name in _NAMES_COPIED:
        setattr(GroupCollectives, name, issue_nothing)


def set_syncs_restored(patches: list[str]) -> None:
    """``%logsync`` / ``%clipsync`` for the next fit: the recipe's ``SyncFreeLogging`` /
    ``SyncFreeGradClip`` does nothing, so NeMo's logging and loss reduction (a Python number
    logged: a blocking copy; each ``prog_bar`` metric read back at every step's end; each
    microbatch's token count read after the backward) / megatron's grad-norm read sync the host
    with the device as on plain NeMo. Set per fit, beside unpatched fits."""
    from nemo_gtp.strategy.step_syncs import SyncFreeGradClip, SyncFreeLogging

    for patch, callback in (("logsync", SyncFreeLogging), ("clipsync", SyncFreeGradClip)):
        original = _ORIGINALS.setdefault(callback, vars(callback)["on_train_start"])
        callback.on_train_start = (lambda *args: None) if patch in patches else original


def set_megatron_replay(on: bool) -> None:
    """``%megatronreplay`` on or off for the next fit: per-layer graphs replay through
    megatron's own ``CudaGraphManager.__call__`` and runner methods (their per-call module
    walks and argument checks) instead of the strategy's lean ones
    (``nemo_gtp.integrations.megatron.graph_replay``). Set per fit, beside unpatched fits."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudaGraphRunner

    from nemo_gtp.integrations.megatron.graph_replay import (
        LeanCudaGraphManager,
        LeanCudaGraphRunner,
    )

    for lean, megatron, names in (
        (LeanCudaGraphManager, CudaGraphManager, ("__call__",)),
        (LeanCudaGraphRunner, _CudaGraphRunner, _LEAN_RUNNER_METHODS),
    ):
        originals = _ORIGINALS.setdefault(lean, {name: vars(lean)[name] for name in names})
        for name in names:
            setattr(lean, name, vars(megatron)[name] if on else originals[name])


_LEAN_RUNNER_METHODS = ("replay_graph_capture", "get_input_grads_with_dummy_flags")

_ORIGINALS: dict = {}
"""What the per-fit patches replace, by class (or callback): set once, restored from here."""


PATCHES = {
    "nocopy": lambda: set_no_copy(True),
    "general": _patch_general_consume,
    "flatten": _patch_flatten_allreduce,
    "why": _patch_count_bails,
    "te": _patch_gemm_variants,
    "tecolumnwise": _patch_te_columnwise,
    "logsync": lambda: set_syncs_restored(["logsync"]),
    "clipsync": lambda: set_syncs_restored(["clipsync"]),
    "megatronreplay": lambda: set_megatron_replay(True),
}
"""Mode suffixes ``%name`` (e.g. ``gtp2_te%general%flatten``): an earlier host path restored in
that mode's process, so old and new run interleaved in one launch (same machine, same hour), or
something counted (``%why``) or timed (``%te``) without changing the path."""

PER_FIT = {"nocopy", "logsync", "clipsync", "megatronreplay"}
"""Patches toggled per fit (so ``--one-process`` runs them beside unpatched fits)."""

TIMED_ALIKE = {"te"}
"""Suffixes a GTP mode's DP2 twin carries too (:func:`_baseline`): what they time is compared
call by call across the pair; every other suffix is GTP2's own."""


def _resolve(mode: str, tokens: int) -> tuple[str, list[str]]:
    """``mode``'s recipe and overrides (``bench.bench_nemo``'s modes and ``@`` modifiers) at
    ``tokens`` per GPU; the CPU modes (``dp2_cpu`` / ``gtp2_cpu``) at :data:`CPU_SHAPE`, a
    host-bound tiny GPT (a mode's own ``@model.*`` wins)."""
    from bench.bench_nemo import CPU_CONFIGS, resolve_mode, token_overrides

    mode = mode.split("#")[0].split("%")[0]  # repeat k of a mode (--repeat), host-path patches
    config, overrides, _ = resolve_mode(mode)
    if config in CPU_CONFIGS:
        return config, [*CPU_SHAPE, *overrides]
    return config, [*overrides, *token_overrides(tokens)]


def _init_fake_world(world: int) -> None:
    """Whoever initializes ``torch.distributed`` (the strategy) gets rank 0 of ``world`` on
    torch's fake backend; megatron's gloo / NCCL sub-groups become fake ones too."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    init, new_group = dist.init_process_group, dist.new_group

    def fake_init(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        init("fake", store=FakeStore(), rank=0, world_size=world)

    def fake_new_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = fake_init, fake_new_group


_GC_TIME = {"s": 0.0, "start": 0.0, "runs": [0, 0, 0]}
"""Python's cyclic collector over the current fit's timed window (``gc.callbacks``)."""

_PROCESS: dict = {}
"""What one process sets up once for all its fits: the fake world's patch and the host timer."""


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_TIME["start"] = time.perf_counter()
    else:
        _GC_TIME["s"] += time.perf_counter() - _GC_TIME["start"]
        _GC_TIME["runs"][info["generation"]] += 1


class _NoTimer:
    """``--timer none``: the timer's interface, timing nothing."""

    category: dict = {}

    def snapshot(self) -> dict:
        return {}

    def per_step(self, before: dict, after: dict, steps: int) -> dict:
        return {}


def _process_setup(world: int, patches: list[str], timer_kind: str = "outer") -> object:
    """Once per process: rank 0 of a fake ``world``, the GC clock, the host timer (before any
    model is built: TE's pre-hooks bind then), the mode's host-path ``patches`` and the imports
    frozen out of the collector's scans (``freeze_imports``, as the product's launcher); the timer.

    ``timer_kind`` (``--timer``): ``outer`` wraps GTP's entry points only
    (``bench.common.OUTER_ENTRIES``: the "inside GTP" total, ~300 wrapped calls per step of the
    1B recipe at ~2.5 µs each, on GTP's side only); ``fine`` adds the split inside them
    (``in.*``, ~2,000 more); ``none`` wraps nothing — the ratio runs' setting, as any wrapper
    falls on GTP's side only and moves the GTP/DP ratio."""
    if _PROCESS:
        return _PROCESS["timer"]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    _init_fake_world(world)  # every fit's init_process_group: a fresh fake group
    gc.callbacks.append(_on_gc)
    from bench.common import GTP_ENTRIES, OUTER_ENTRIES, GTPHostTimer, te_entries

    entries = {"fine": GTP_ENTRIES, "outer": OUTER_ENTRIES, "none": ()}[timer_kind] + (
        te_entries() if "te" in patches else ()
    )
    timer = GTPHostTimer.install(entries) if entries else _NoTimer()
    if "te" in patches:
        wrapped = sum(c.startswith(("te.", "tex.")) for c in timer.category.values())
        print(f"TE_ENTRIES wrapped {wrapped}", flush=True)
    for patch in patches:
        if patch not in PER_FIT:
            PATCHES[patch]()
    from nemo_gtp.recipes.launch import freeze_imports

    # as the product's launcher does: else the first full collection in a process scans every
    # object the imports made (a 0.7 s pause seen inside one DP2 fit's timed window on an H100)
    freeze_imports()
    _PROCESS["timer"] = timer
    return timer


def _patches(mode: str) -> list[str]:
    return mode.split("#")[0].split("%")[1:]


KERNEL_KINDS = (
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|fused_attn|cudnn|attn", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("copy / fill", re.compile(r"memcpy|memset|copy|fill", re.I)),
    ("norm", re.compile(r"norm", re.I)),
)
"""``--kernels``: each kernel's kind, the first pattern its name matches (else "other")."""


def kernel_summary(averages: list, steps: int, top: int = 25) -> dict:
    """Device ms and launches per step, by kind (:data:`KERNEL_KINDS`) and for the ``top``
    kernels, from torch.profiler's ``key_averages()`` over ``steps`` steps. Kernels on
    overlapping streams add up (``busy_ms`` may exceed the step on a device that overlaps)."""
    kernels = []
    for avg in averages:
        us = getattr(avg, "self_device_time_total", None)
        if us is None:
            us = getattr(avg, "self_cuda_time_total", 0)
        if us > 0:
            kernels.append((avg.key, avg.count, us))
    kernels.sort(key=lambda k: -k[2])
    kinds: dict[str, list[float]] = {}
    for name, count, us in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        entry = kinds.setdefault(kind, [0.0, 0.0])
        entry[0] += us / 1e3 / steps
        entry[1] += count / steps
    return {
        "busy_ms": round(sum(us for _, _, us in kernels) / 1e3 / steps, 2),
        "launches": round(sum(count for _, count, _ in kernels) / steps, 1),
        "kinds": {k: [round(ms, 2), round(n, 1)] for k, (ms, n) in sorted(kinds.items())},
        "top": [
            [name[:120], round(count / steps, 1), round(us / 1e3 / steps, 3)]
            for name, count, us in kernels[:top]
        ],
    }


def _kernel_text(summary: dict) -> str:
    lines = [
        f"device busy {summary['busy_ms']} ms/step, {summary['launches']} kernels/step",
        "",
        "| kind | ms/step | kernels/step |",
        "|---|---|---|",
        *(f"| {k} | {ms} | {n} |" for k, (ms, n) in summary["kinds"].items()),
        "",
        "| kernel | calls/step | ms/step |",
        "|---|---|---|",
        *(f"| `{name}` | {n} | {ms} |" for name, n, ms in summary["top"]),
    ]
    return "\n".join(lines) + "\n"


LIVE_MODULES = (
    "torch.autograd",
    "torch._C",
    "torch.cuda",
    "nemo_gtp",
    "megatron",
    "transformer_engine",
    "nemo.lightning",
    "lightning",
    "builtins.function",
    "builtins.method",
    "functools",
)
"""``--leftover-sites``: the modules whose object types are counted among what outlived a fit."""


def external_holders(targets: list, objects: list) -> list:
    """What keeps ``targets`` alive: a path from Python's roots, or the holders C++ keeps.

    Walks the referent graph from ``sys.modules`` and the locals of every thread's frames
    (this thread's from the caller's caller on: call it from the function holding
    ``objects``). A target reached that way gets its path (types, root first). Otherwise every
    object that refers to a target through objects Python cannot reach, and whose reference
    count exceeds the references the collector sees, is held from C++ (an autograd node's
    hook, a mode stack, an extension): each as [extra references, type, a short repr].
    """
    import gc
    import threading
    from collections import deque

    here = threading.get_ident()
    tops = [f for ident, f in sys._current_frames().items() if ident != here]
    tops.append(sys._getframe(2))  # not this call, nor its caller (whose locals list targets)
    # a running frame does not show its locals to the collector: each one's locals, as a dict
    roots: list = [sys.modules]
    for frame in tops:
        while frame is not None:
            roots.append(frame.f_locals)
            frame = frame.f_back
    parent: dict[int, int] = {id(r): 0 for r in roots}
    parent[id(objects)] = parent[id(targets)] = 0  # never walked through
    by_id = {id(r): r for r in roots}
    queue = deque(roots)
    while queue:
        o = queue.popleft()
        for r in gc.get_referents(o):
            if gc.is_tracked(r) and id(r) not in parent:
                parent[id(r)] = id(o)
                by_id[id(r)] = r
                queue.append(r)
    reached = [t for t in targets if id(t) in parent and parent[id(t)]]
    if reached:
        path, oid = [], id(reached[0])
        while oid:
            o = by_id[oid]
            keys = ",".join(str(k) for k in list(o)[:3]) if isinstance(o, dict) else ""
            path.append(f"{type(o).__module__}.{type(o).__qualname__}({keys})")
            oid = parent[oid]
        return [["python path", " -> ".join(reversed(path))]]
    del by_id
    unreached = {id(o): o for o in objects if id(o) not in parent}
    seen_refs: Counter = Counter()
    referrers: dict[int, list[int]] = {}
    for o in objects:
        for r in gc.get_referents(o):
            if id(r) in unreached:
                seen_refs[id(r)] += 1
                referrers.setdefault(id(r), []).append(id(o))
    holders, frontier = {id(t) for t in targets}, [id(t) for t in targets]
    while frontier:
        for rid in referrers.get(frontier.pop(), ()):
            if rid not in holders:
                holders.add(rid)
                frontier.append(rid)
    found = []
    for oid in holders:
        # a tensor: its C++ owners show in ``_use_count`` instead
        o = unreached.get(oid)
        if o is None or isinstance(o, torch_tensor_type()):
            continue
        # getrefcount's own argument, ``o``, ``objects`` and ``unreached`` hold one each
        extra = sys.getrefcount(o) - 4 - seen_refs[oid]
        if extra > 0:
            found.append([extra, f"{type(o).__module__}.{type(o).__qualname__}", repr(o)[:160]])
    found.sort(key=lambda f: f[1])
    return [["held only from C++, objects above the targets", len(holders)], *found[:60]]


def torch_tensor_type() -> type:
    """``torch.Tensor`` (imported late: ``host_fake``'s parent process never imports torch)."""
    import torch

    return torch.Tensor


LEFTOVER_REPORT_BYTES = 2**28
"""``--leftover-sites``: a fit finding more than this allocated at its start reports where."""


def python_holders(top: int = 6, depth: int = 5) -> dict:
    """The live CUDA tensor objects (every one the collector tracks, whoever holds it: their
    GiB, and for the ``top`` largest a chain of referrer types ``depth`` deep, which ends where
    only C++ holds one, e.g. as a parameter's ``.grad``) and the referrer chains of the live
    objects of :data:`HOLDER_TYPES`."""
    import gc

    import torch

    objects = gc.get_objects()
    tensors = [
        o
        for o in objects
        if issubclass(type(o), torch.Tensor) and o.device.type == "cuda"  # type: no lazy proxies
    ]
    storages: dict[int, tuple[int, int]] = {}  # by address: (bytes, index into tensors)
    for i, t in enumerate(tensors):
        try:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), i)
        except RuntimeError:  # a tensor without storage (FakeTensor, functional wrappers)
            continue
    largest = sorted(storages.values(), reverse=True)[:top]
    chains = [
        [
            round(nbytes / 2**30, 3),
            list(tensors[index].shape),
            referrer_chain(tensors[index], depth, skip=tensors),
        ]
        for nbytes, index in largest
    ]
    owners = {}  # the first live object of each type that owns a fit's state, and its holders
    for obj in objects:
        name = type(obj).__name__
        if name in HOLDER_TYPES and name not in owners:
            owners[name] = referrer_chain(obj, 12, skip=objects)
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    params = [o for o in objects if type(o).__name__ == "GTPShardedParam"]
    return {
        "gib": round(sum(n for n, _ in storages.values()) / 2**30, 3),
        "tensors": len(tensors),
        "largest": chains,
        "owners": owners,
        # what kinds of objects outlived the fit (autograd contexts show as ``...Backward``)
        "live_types": [
            [n, name] for name, n in counts.most_common() if name.startswith(LIVE_MODULES)
        ][:60],
        # C++ references to the GTP weights' tensors (an autograd node, a saved variable)
        "gtp_param_use_counts": dict(Counter(p._use_count() for p in params)),
        "gtp_params_with_grad": sum(p.grad is not None for p in params),
        "external_holders": external_holders(params, objects),
        # one live GTP weight's direct referrers (every one, not only the first)
        "gtp_param_referrers": sorted(
            f"{type(r).__module__}.{type(r).__qualname__}"
            for r in gc.get_referrers(params[0])
            if r is not objects and type(r).__name__ != "frame"
        )
        if params
        else [],
    }


HOLDER_TYPES = frozenset(
    {
        "GTPRuntime",
        "GTPShardedParam",
        "GTPDistributedDataParallel",
        "DistributedDataParallel",
        "GPTModel",
        "Trainer",
        "DistributedOptimizer",
        "ChainedOptimizer",
        "FusedAdam",
    }
)
"""``--leftover-sites``: the types whose live instances after a teardown mean a fit's state is
still held (their referrer chains are reported)."""


def referrer_chain(obj: object, depth: int, skip: object = None) -> str:
    """``type(referrer) <- type(its referrer) ...``, ``depth`` steps up from ``obj``, each the
    first referrer that is not a frame, a list (unless only lists refer) or ``skip`` (a
    ``dict``'s first keys shown)."""
    import gc

    chain = []
    for _ in range(depth):
        found = [r for r in gc.get_referrers(obj) if r is not skip]
        referrers = [r for r in found if type(r).__name__ not in ("frame", "list")]
        lists = [r for r in found if type(r).__name__ == "list" and len(r) < 1000]
        del found
        candidates = referrers or lists  # gc.get_objects()'s own big lists are skipped
        if not candidates:
            chain.append("<none: held from C++ or a frame>")
            break
        obj = candidates[0]
        del referrers, lists, candidates
        keys = ",".join(str(k) for k in list(obj)[:4]) if isinstance(obj, dict) else ""
        chain.append(f"{type(obj).__module__}.{type(obj).__qualname__}({keys})")
    return " <- ".join(chain)


def _fit(spec: dict, timer: object) -> dict:
    """One fit of ``spec``'s mode on the fake world; its record."""
    import lightning.pytorch as pl
    import torch

    from bench.bench_nemo import thread_cpu_per_step, thread_cpu_seconds
    from bench.common import mfu_fields
    from nemo_gtp.recipes.loader import LossLog, build_fit, load_recipe

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warmup, steps, profiled = spec["warmup"], spec["steps"], spec["profile"]
    # the free-running window: no sync of this script's between its edges
    free = spec.get("free_steps", 0)
    free_start, free_end = warmup + steps, warmup + steps + free
    sites = None  # --sync-sites: the device's syncs on a GPU, the host reads on CPU
    if spec.get("sync_sites") and free:
        sites = SyncSites() if cuda else HostReads()
    set_no_copy("nocopy" in _patches(spec["mode"]))
    set_syncs_restored(_patches(spec["mode"]))
    set_megatron_replay("megatronreplay" in _patches(spec["mode"]))
    kernels = bool(spec.get("kernels")) and profiled and cuda
    # outside the callback: NeMo deep-copies callbacks
    if kernels:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.enable, prof.disable = prof.start, prof.stop
    else:
        prof = cProfile.Profile()

    class _Times(pl.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.issue: list[float] = []
            self.free: list[float] = []  # the free window's starts to starts, ms
            self._start = 0.0

        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            step = trainer.global_step
            if free and free_start < step < free_end:  # the free window runs on
                now = time.perf_counter()
                self.free.append(1000 * (now - self._start))
                self._start = now
                return
            sync()
            if free and step == free_end:
                self.free.append(1000 * (time.perf_counter() - self._start))
                if sites:
                    sites.stop()
            if free and step == free_start and sites:
                sites.start()
            if trainer.global_step == warmup:
                self.threads = thread_cpu_seconds()
                _GC_TIME.update(s=0.0, runs=[0, 0, 0])
                self.timer_start = timer.snapshot()
                if GEMM_VARIANTS is not None:
                    GEMM_VARIANTS.clear()
            if trainer.global_step == warmup + steps:
                self.threads = thread_cpu_per_step(self.threads, thread_cpu_seconds(), steps)
                self.gc = {
                    "ms_per_step": round(1000 * _GC_TIME["s"] / steps, 2),
                    "collections_per_generation": list(_GC_TIME["runs"]),
                }
                self.inside = timer.per_step(self.timer_start, timer.snapshot(), steps)
                self.gemms = {  # per step: calls, µs per call
                    key: [round(n / steps, 1), round(ns / n / 1e3, 2)]
                    for key, (n, ns) in sorted((GEMM_VARIANTS or {}).items())
                }
            if trainer.global_step == free_end and profiled:
                prof.enable()
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            self.issue.append(1000 * (time.perf_counter() - self._start))

        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if free and free_start < trainer.global_step <= free_end:
                return  # a free-running step: the next start times it
            sync()
            self.wall.append(1000 * (time.perf_counter() - self._start))
            if trainer.global_step == free_end + profiled:
                prof.disable()

    config, overrides = _resolve(spec["mode"], spec["tokens"])
    cfg = load_recipe(
        str(ROOT / config),
        [
            *overrides,
            "trainer.devices=1",  # one device; Lightning's world = nodes x devices
            f"+trainer.num_nodes={spec['world']}",
            # one step past the window at least: its start closes the window's records
            f"trainer.max_steps={free_end + max(profiled, 1)}",
        ],
    )
    times = _Times()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated() if cuda else 0  # what earlier fits left allocated
    diagnostics = {}  # --leftover-sites / --losses: what is left, and LossLog's peak
    if spec.get("leftover_sites") and leftover > LEFTOVER_REPORT_BYTES:
        from bench.common import live_by_site

        sites = live_by_site(torch.cuda.memory._snapshot())[:8]
        diagnostics = {
            "leftover_sites": [[round(b / 2**30, 3), site] for b, site in sites],
            "leftover_python_holders": python_holders(),
        }
    out = Path(spec["out"])
    name = spec["file_stem"]
    loss_log = out / f"losses_{name}.jsonl"
    log_losses = bool(spec.get("losses") or spec.get("leftover_sites"))  # reads every loss
    started = time.perf_counter()
    build_fit(cfg, callbacks=[times, LossLog(str(loss_log))] if log_losses else [times]).run()
    fit_s = time.perf_counter() - started
    if log_losses:  # the product's fit-own peak, beside this script's
        last = json.loads(loss_log.read_text().splitlines()[-1])
        diagnostics["losslog_peak_gib"] = last.get("peak_gib")
    kernel_record = {}
    if kernels:
        kernel_record = {"kernels": kernel_summary(prof.key_averages(), profiled)}
        (out / f"kernels_{name}.md").write_text(_kernel_text(kernel_record["kernels"]))
    elif profiled:
        prof.dump_stats(str(out / f"host_profile_{name}.pstats"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        (out / f"host_profile_{name}.txt").write_text(text.getvalue())
    window = slice(warmup, warmup + steps)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    step_ms = statistics.median(times.wall[window])
    free_record = {}
    if free:  # what a user's loop gets: the window's time over its steps
        free_ms = sum(times.free) / free
        free_record = {
            "free_step_ms": round(free_ms, 3),
            "free_step_ms_median": round(statistics.median(times.free), 3),
            "free_mfu": mfu_fields(cfg, spec["world"], free_ms, device)["mfu"],
        }
        if sites:
            free_record["sync_sites_per_step"] = sites.per_step(free)
    return {
        "mode": spec["mode"],
        "tokens_per_gpu": spec["tokens"],
        "world": spec["world"],
        "ranks": "fake process group, " + ("one GPU" if cuda else "CPU"),
        "device": device,
        "step_ms": round(step_ms, 3),
        "issue_ms": round(statistics.median(times.issue[window]), 3),
        **mfu_fields(cfg, spec["world"], step_ms, device),
        **free_record,
        "peak_gib": round((torch.cuda.max_memory_allocated() - leftover) / 2**30, 2)
        if cuda
        else None,
        # what earlier fits of this process left allocated (the peak is above it)
        "leftover_gib": round(leftover / 2**30, 2) if cuda else None,
        **diagnostics,
        "fit_s": round(fit_s, 1),
        "profiled_steps": profiled,
        "thread_cpu_ms_per_step": times.threads,
        "python_gc": times.gc,
        "host_inside": times.inside,
        **({"gemm_variants": times.gemms} if GEMM_VARIANTS is not None else {}),
        **kernel_record,
    }


def _rank_main(spec: dict) -> dict:
    """Per-process mode: this process runs ``spec``'s one fit."""
    return _fit(
        spec, _process_setup(spec["world"], _patches(spec["mode"]), spec.get("timer", "outer"))
    )


def _one_process_main(specs: list[dict], budget_s: float, fit_timeout_s: float = 0) -> None:
    """``--one-process``: every fit of ``specs`` in this process, one after another, megatron's
    and NeMo's process-global state torn down in between (``teardown_fit``: parallel state,
    the microbatch calculator, RNG tracker, CUDA graphs, the fake process group; the next fit's
    strategy inits a fresh fake group). One ``RECORD`` line per fit. A fit that fails is
    recorded; if the device is unusable after it the process exits (the parent starts a fresh
    one for the rest). ``budget_s`` (from process start, import included; 0: none): no fit is
    started that the mean fit so far says would end past it (``SKIPPED`` lines).
    ``fit_timeout_s`` (0: none): a fit (teardown included) running longer dumps every thread's
    stack and ends the process (the parent records it and goes on in a fresh one)."""
    import faulthandler

    import torch

    from nemo_gtp.recipes.launch import teardown_fit

    timer = _process_setup(specs[0]["world"], [], specs[0].get("timer", "outer"))
    if specs[0].get("leftover_sites") and torch.cuda.is_available():
        from bench.common import start_recording

        start_recording()  # every fit's allocations, so a leftover names where it came from
    # NeMo's imports before the first fit: an import made inside a fit (modelopt's `pulp`) keeps
    # its ImportError's traceback, and with it that fit's frames and model, for good
    import nemo.collections.llm  # noqa: F401
    import nemo.lightning  # noqa: F401

    durations: list[float] = []
    for i, spec in enumerate(specs):
        elapsed = time.perf_counter() - _T0
        if budget_s and durations and elapsed + statistics.mean(durations) > budget_s:
            for rest in specs[i:]:
                print(f"SKIPPED {json.dumps(rest['mode'])} {rest['tokens']}", flush=True)
            return
        print(f"FIT {i}", flush=True)
        started = time.perf_counter()
        if fit_timeout_s:
            faulthandler.dump_traceback_later(fit_timeout_s, exit=True)
        try:
            record = _fit(spec, timer)
        except Exception as err:  # record and go on: one broken mode must not hide the rest
            import traceback

            traceback.print_exc()
            record = {
                "mode": spec["mode"],
                "tokens_per_gpu": spec["tokens"],
                "error": f"{type(err).__name__}: {err}"[:600],
            }
        print("RECORD " + json.dumps(record), flush=True)
        durations.append(time.perf_counter() - started)
        try:
            teardown_fit()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as err:  # a poisoned context (a failed capture): a fresh process
            print(f"DEVICE_LOST after {spec['mode']}: {type(err).__name__}: {err}", flush=True)
            sys.exit(3)
        finally:
            faulthandler.cancel_dump_traceback_later()


_T0 = time.perf_counter()


def _plan(args: argparse.Namespace) -> list[dict]:
    """Every fit in launch order: per repeat k, the ``--modes`` at each of ``--tokens``, then
    each ``--also TOKENS:MODES`` group; ``mode#k`` names repeat k > 0 (interleaved repeats)."""
    from bench.bench_nemo import file_stem

    groups = [(int(t), args.modes.split(",")) for t in args.tokens.split(",")]
    for item in args.also or ():
        tokens, _, modes = item.partition(":")
        groups += [(int(t), modes.split(",")) for t in tokens.split("+")]
    specs = []
    for k in range(args.repeat):
        for tokens, modes in groups:
            for base in modes:
                mode = base if k == 0 else f"{base}#{k}"
                specs.append(
                    dict(
                        mode=mode,
                        file_stem=file_stem(f"{mode}_{tokens}"),  # log and profile names
                        tokens=tokens,
                        world=args.world,
                        warmup=args.warmup,
                        steps=args.steps,
                        profile=args.profile,
                        timer=args.timer,
                        kernels=args.kernels,
                        free_steps=args.free_steps,
                        sync_sites=args.sync_sites,
                        leftover_sites=args.leftover_sites,
                        losses=args.losses,
                        out=str(Path(args.out).resolve()),
                    )
                )
    return specs


def dry_run(specs: list[dict]) -> int:
    """Check each fit's recipe as the fit would load it (``validate_recipe``: keys, types,
    layout; not what needs a GPU or TE) and print the plan; 1 when any fails."""
    from nemo_gtp.recipes.config import RecipeError, load_recipe
    from nemo_gtp.recipes.validate import validate_recipe

    failed = 0
    for spec in specs:
        config, overrides = _resolve(spec["mode"], spec["tokens"])
        try:
            validate_recipe(
                load_recipe(
                    str(ROOT / config),
                    [*overrides, "trainer.devices=1", f"+trainer.num_nodes={spec['world']}"],
                )
            )
            verdict = "ok"
        except (RecipeError, ValueError) as err:
            failed, verdict = failed + 1, f"FAILED: {err}"
        print(f"{spec['mode']} @ {spec['tokens']}: {config} {verdict}")
    print(f"{len(specs)} fits, {failed} refused")
    return 1 if failed else 0


def _stub(spec: dict) -> dict:
    return {"mode": spec["mode"], "tokens_per_gpu": spec["tokens"]}


def _run_child(
    argv: list[str], log: Path, on_record: Callable[[dict], None], started: list[int] | None = None
) -> int:
    """Run a child ``python -m bench.host_fake`` with ``argv``, its output into ``log``, each
    ``RECORD`` line handed to ``on_record`` as it comes, each ``FIT <i>`` (fit i starts)
    appended to ``started``; the exit status."""
    with open(log, "a") as f:
        proc = subprocess.Popen(
            module_argv("bench.host_fake", *argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # one intra-op thread per rank, as bench_nemo's ranks have
            env=with_root({"OMP_NUM_THREADS": "1", **os.environ}),
        )
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if line.startswith("RECORD "):
                on_record(json.loads(line[7:]))
            elif line.startswith("FIT ") and started is not None:
                started.append(int(line.split()[1]))
        return proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="dp2_te,gtp2_te")
    parser.add_argument("--tokens", default="2048")
    parser.add_argument(
        "--also",
        action="append",
        help="TOKENS:MODES, more modes at their own tokens per GPU (e.g. 4096:dp2_te@x=1,...; "
        "TOKENS may be 2048+4096); repeatable",
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--free-steps",
        type=int,
        default=20,
        help="after the --steps window (a sync before and after each step: step and issue "
        "times), this many steps with no sync of this script's but at their edges: "
        "free_step_ms (their mean) and free_mfu are what a training loop gets, the host "
        "queueing ahead up to the stack's own syncs; 0: none",
    )
    parser.add_argument(
        "--sync-sites",
        action="store_true",
        help="count the synchronizing CUDA calls of the free-running steps by Python site "
        "(torch's sync debug mode; on CPU the host reads of device values, each a sync on a "
        "GPU: bench.sync_sites): sync_sites_per_step",
    )
    parser.add_argument("--profile", type=int, default=3, help="steps under cProfile")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the modes this many times, interleaved"
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="every fit in one process (NeMo/TE imported once; state torn down between fits); "
        "default: a process per fit. Host-path patches (%%name) need a process per fit",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0,
        help="--one-process: seconds (import included) after which no fit is started that "
        "would likely end past it; 0: no limit",
    )
    parser.add_argument(
        "--fit-timeout",
        type=float,
        default=0,
        help="--one-process: seconds one fit may take before its process is ended (every "
        "thread's stack in the log) and the rest go on in a fresh one; 0: no limit",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every fit's recipe (the CLI's checks) and print the plan; run nothing",
    )
    parser.add_argument(
        "--timer",
        choices=("outer", "fine", "none"),
        default="outer",
        help="'inside GTP' host timer: outer (GTP's entry points), fine (also the calls inside "
        "them: where a consume's time goes), none. Its ~2.5 µs per wrapped call falls on GTP's "
        "side only: ratio runs take none",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="the --profile steps under torch.profiler instead of cProfile: device time per "
        "kernel and per kind (GEMM, attention, optimizer, copies, ...) per step",
    )
    parser.add_argument(
        "--leftover-sites",
        action="store_true",
        help="--one-process on a GPU: record every CUDA allocation's Python stack (slows the "
        "host: not for timing) and, where a fit finds more than 0.25 GiB left by the fits "
        "before it, record the allocation sites of what is left (leftover_sites)",
    )
    parser.add_argument(
        "--losses",
        action="store_true",
        help="every fit writes its per-step losses (and fit-own peak) to losses_<fit>.jsonl "
        "(LossLog: reads the loss every step, a host sync: not for timing)",
    )
    parser.add_argument(
        "--fits-per-process",
        type=int,
        default=4,
        help="--one-process: a fresh process after this many fits (each fit returns its GPU "
        "memory at teardown; a fresh process bounds what process-wide caches and the Python "
        "heap gather)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank-main", help=argparse.SUPPRESS)
    parser.add_argument("--fits", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        print("RECORD " + json.dumps(_rank_main(json.loads(args.rank_main))), flush=True)
        return 0
    if args.fits:
        _one_process_main(json.loads(Path(args.fits).read_text()), args.budget, args.fit_timeout)
        return 0
    specs = _plan(args)
    if args.one_process and any(set(_patches(s["mode"])) - PER_FIT for s in specs):
        parser.error(
            "--one-process: host-path patches (%name) change the process; drop them "
            f"(only {', '.join(sorted(PER_FIT))} is set per fit)"
        )
    if args.dry_run:
        return dry_run(specs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def keep(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        # after every fit: a launch cut short by its time limit keeps what it measured
        (out / "host_fake.json").write_text(json.dumps(records, indent=1))

    if args.one_process:
        started, rest, round_ = time.perf_counter(), specs, 0
        while rest:  # a process per --fits-per-process fits, or after one that took it down
            chunk = rest[: max(args.fits_per_process, 1)]
            fits = out / f"fits_{round_}.json"
            fits.write_text(json.dumps(chunk))
            budget = max(args.budget - (time.perf_counter() - started), 1) if args.budget else 0
            before, begun = len(records), []
            code = _run_child(
                [
                    *("--out", str(out), "--fits", str(fits), "--budget", str(budget)),
                    *("--fit-timeout", str(args.fit_timeout)),
                ],
                out / "host_fake_one_process.log",
                keep,
                begun,
            )
            last = begun[-1] if begun else -1
            if code == 0:
                if len(begun) < len(chunk):  # the budget stopped it
                    break
                done = len(chunk)
            elif last < 0:  # it died before its first fit: a fresh one would too
                for spec in rest:
                    keep(
                        {
                            "mode": spec["mode"],
                            "tokens_per_gpu": spec["tokens"],
                            "error": f"not run: process exit {code} before its first fit",
                        }
                    )
                break
            else:
                if len(records) - before <= last:  # the child died in fit `last`: it failed
                    keep(
                        {
                            "mode": chunk[last]["mode"],
                            "tokens_per_gpu": chunk[last]["tokens"],
                            "error": f"process exit {code}, see host_fake_one_process.log",
                        }
                    )
                done = last + 1
            rest, round_ = rest[done:], round_ + 1
            # the rest in a fresh process, if the budget still has room for its imports
            if rest and args.budget and args.budget - (time.perf_counter() - started) < 150:
                break
        ran = {(r["mode"], r["tokens_per_gpu"]) for r in records}
        for spec in specs:  # what the budget (or a lost process) left out, said so
            if (spec["mode"], spec["tokens"]) not in ran:
                keep({**_stub(spec), "error": "not run: --budget spent (or its process lost)"})
    else:
        for spec in specs:
            log = out / f"{spec['file_stem']}.log"
            log.unlink(missing_ok=True)
            before = len(records)
            code = _run_child(["--out", str(out), "--rank-main", json.dumps(spec)], log, keep)
            if code and len(records) > before:
                records[-1]["error"] = f"exit {code}, see {log.name}"
            elif len(records) == before:
                keep(
                    {
                        "mode": spec["mode"],
                        "tokens_per_gpu": spec["tokens"],
                        "error": f"exit {code}, see {log.name}",
                    }
                )
    profiles = sorted(out.glob("host_profile_*"))
    with tarfile.open(out / "host_profiles.tgz", "w:gz") as tar:  # one file to fetch
        for path in profiles:
            tar.add(path, arcname=path.name)
    for path in profiles:
        path.unlink()
    table = _table(records)
    (out / "host_fake.md").write_text(table)
    print(table)
    return 0


def _baseline(mode: str) -> str | None:
    """``gtp2_te@layergraph#1`` -> ``dp2_te@layergraph#1``: the same mode without GTP."""
    name, _, repeat = mode.partition("#")
    base, *patches = name.split("%")  # the DP2 mode of the same repeat, timed alike
    name = "".join([base, *(f"%{p}" for p in patches if p in TIMED_ALIKE)])
    twin = "dp2" + name[len("gtp2") :] if name.startswith("gtp2") else None
    return f"{twin}#{repeat}" if twin and repeat else twin


def _recipe_twin(mode: str) -> str | None:
    """``dp2_te@layergraph@model.bias_dropout_fusion=false#1`` -> ``dp2_te@layergraph#1``: the
    same mode with the recipe's own model settings (None: the mode overrides none)."""
    name, _, repeat = mode.partition("#")
    base, *knobs = name.split("@")
    if not any(k.startswith("model.") for k in knobs):
        return None
    twin = "@".join([base, *(k for k in knobs if not k.startswith("model."))])
    return f"{twin}#{repeat}" if repeat else twin


def label(records: list[dict]) -> str:
    """How the ranks of ``records`` talked, for every table: never an NCCL figure."""
    devices = sorted({r["device"] for r in records if r.get("device")})
    where = "CPU" if devices in ([], ["cpu"]) else f"one GPU ({', '.join(devices)})"
    return (
        f"Ranks: fake process group, {where}: rank 0 of a fake world, collectives move "
        "nothing (host time without communication; not an NCCL result)."
    )


def _table(records: list[dict]) -> str:
    """Step and host-issue time per mode with MFU and peak memory, each GTP mode against its
    DP2 twin of the same repeat, each ``@model.*`` override against the recipe's own settings
    of the same repeat, and per mode the median of those ratios and the ratio of the summed
    steps (a noisy host moves single pairs by ±0.2×: the two together say more than either)."""
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in records}
    lines = [
        label(records),
        "",
        "| mode | tokens/GPU | step ms | MFU | free-running ms | its MFU | TFLOP/s | peak GiB "
        "| host issue ms (fwd+bwd) | inside GTP ms | optimizer ms | vs DP2 (step) "
        "| vs recipe (step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in records:
        cells = []
        for what, twin_mode in (("DP2", _baseline(r["mode"])), ("recipe", _recipe_twin(r["mode"]))):
            twin = by.get((twin_mode, r["tokens_per_gpu"]))
            if twin and "step_ms" in r and "step_ms" in twin:
                cells.append(f"{r['step_ms'] / twin['step_ms']:.3f}×")
                key = (what, r["mode"].split("#")[0], r["tokens_per_gpu"])
                ratios.setdefault(key, []).append((r["step_ms"], twin["step_ms"]))
            else:
                cells.append("")
        inside = r.get("host_inside", {})
        lines.append(
            f"| {r['mode']} | {r['tokens_per_gpu']} | {r.get('step_ms', r.get('error'))} | "
            f"{mfu_text(r)} | {r.get('free_step_ms', '')} | "
            f"{mfu_text({'mfu': r.get('free_mfu')})} | {r.get('tflops_per_gpu') or ''} | "
            f"{'' if r.get('peak_gib') is None else r['peak_gib']} | "
            f"{r.get('issue_ms', '')} | {inside.get('gtp_ms', '')} | "
            f"{inside.get('optimizer_ms', '')} | {cells[0]} | {cells[1]} |"
        )
    for (what, mode, tokens), pairs in ratios.items():
        values = [step / twin for step, twin in pairs]
        summed = sum(step for step, _ in pairs) / sum(twin for _, twin in pairs)
        lines.append(
            f"\n{mode} at {tokens}: median {statistics.median(values):.3f}× {what} over "
            f"{len(values)} interleaved pair(s) ({', '.join(f'{v:.3f}' for v in values)}; "
            f"summed steps {summed:.3f}×)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""The benchmarks' model FLOPs and MFU, how ``bench.host_fake`` plans and labels its fits, and
what its ``--leftover-sites`` and ``--sync-sites`` diagnostics report.

In-process and cheap: no fit runs here (``python -m bench.host_fake --modes dp2_cpu,gtp2_cpu
[--one-process]`` runs the real thing on CPU).
"""

from __future__ import annotations

import argparse
import warnings

import pytest

from bench.bench_nemo import _eager_twins, resolve_mode, shared_device_refusal
from bench.common import (
    ROOT,
    gpt_flops,
    live_by_site,
    mfu,
    mfu_fields,
    peak_tflops,
    recipe_flops_per_gpu,
)
from bench.host_fake import (
    CPU_SHAPE,
    _baseline,
    _plan,
    _recipe_twin,
    _resolve,
    _table,
    external_holders,
    kernel_summary,
    label,
)
from bench.sync_sites import SYNC_MESSAGE, HostReads, SyncSites
from nemo_gtp.recipes.config import load_recipe

GPT_1B = dict(  # configs/gpt_1b_te.yaml's shape
    num_layers=24,
    hidden_size=2048,
    ffn_hidden_size=8192,
    num_attention_heads=16,
    vocab_size=32000,
)


def test_gpt_flops_pins_the_1b_recipe_by_hand() -> None:
    """Per token: 12 L h q (1 + g/a + s/2h) attention, 12 L h f MLP, 6 h V logits (h 2048,
    q 2048, g = a, s 2048, f 8192, V 32000: already a multiple of 128)."""
    L, h, s, f, V = 24, 2048, 2048, 8192, 32000
    per_token = 12 * L * h * h * (1 + 1 + s / (2 * h)) + 12 * L * h * f + 6 * h * V
    assert gpt_flops(GPT_1B, s, 2) == pytest.approx(2 * s * per_token, rel=1e-12)
    assert gpt_flops(GPT_1B, s, 2) == pytest.approx(33.7713e12, rel=1e-5)  # 4096 tokens


def test_gpt_flops_counts_gqa_gated_mlp_moe_and_pads_the_vocabulary() -> None:
    base = gpt_flops(GPT_1B, 1024, 1)
    h, L, s = 2048, 24, 1024
    gqa = gpt_flops({**GPT_1B, "num_query_groups": 4}, s, 1)
    assert base - gqa == pytest.approx(s * 12 * L * h * h * (1 - 4 / 16))
    gated = gpt_flops({**GPT_1B, "gated_linear_unit": True}, s, 1)
    assert gated - base == pytest.approx(s * 12 * L * h * 8192 * 0.5)
    moe = {**GPT_1B, "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2048}
    assert gpt_flops(moe, s, 1) - base == pytest.approx(s * 12 * L * h * (2 * 2048 - 8192))
    padded = gpt_flops({**GPT_1B, "vocab_size": 32001}, s, 1)  # 32001 -> 32128
    assert padded - base == pytest.approx(s * 6 * h * 128)


def test_recipe_flops_split_the_global_batch_over_the_world() -> None:
    """4k tokens per GPU on two GPUs (micro-batch 2 x 2048, global batch 4): each GPU does half
    of the global batch's FLOPs, GTP or DP alike."""
    cfg = load_recipe(str(ROOT / "configs" / "gpt_1b_te.yaml"))
    per_gpu = recipe_flops_per_gpu(cfg, 2)
    assert per_gpu == pytest.approx(gpt_flops(GPT_1B, 2048, 4) / 2)
    assert per_gpu == pytest.approx(33.7713e12, rel=1e-5)


def test_peak_and_mfu_only_for_known_devices() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", fp8=True) == 1979.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("cpu") is None and peak_tflops("NVIDIA RTX 9000") is None
    assert mfu(989e12 * 0.1, 100.0, 989.0) == pytest.approx(1.0)
    assert mfu(1e12, 100.0, None) is None
    cfg = load_recipe(str(ROOT / "configs" / "gpt_1b_te.yaml"))
    fields = mfu_fields(cfg, 2, 80.0, "NVIDIA H100 80GB HBM3")
    assert fields["mfu"] == pytest.approx(33.7713e12 / 0.08 / 989e12, abs=1e-4)
    assert fields["peak_tflops"] == 989.0
    fp8 = mfu_fields(load_recipe(str(ROOT / "configs" / "gpt_1b_fp8.yaml")), 2, 80.0, "NVIDIA H200")
    assert fp8["peak_tflops"] == 1979.0  # an FP8 recipe against the FP8 peak
    assert mfu_fields(cfg, 2, 80.0, "cpu")["mfu"] is None


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        modes="dp2_te@eager,gtp2_te@eager",
        tokens="4096",
        also=["2048+4096:dp2_te@graph", "4096:dp2_te@layergraph@model.bias_dropout_fusion=false"],
        repeat=2,
        world=2,
        warmup=5,
        steps=10,
        profile=0,
        timer="none",
        kernels=False,
        leftover_sites=False,
        free_steps=20,
        sync_sites=False,
        losses=False,
        out="/tmp/x",
    )
    return argparse.Namespace(**{**base, **kw})


def test_host_fake_plan_interleaves_repeats_over_every_group() -> None:
    plan = [(s["mode"], s["tokens"]) for s in _plan(_args())]
    one = [
        ("dp2_te@eager", 4096),
        ("gtp2_te@eager", 4096),
        ("dp2_te@graph", 2048),
        ("dp2_te@graph", 4096),
        ("dp2_te@layergraph@model.bias_dropout_fusion=false", 4096),
    ]
    assert plan == one + [(f"{m}#1", t) for m, t in one]


def test_host_fake_twins_and_label() -> None:
    assert _baseline("gtp2_te@layergraph#1") == "dp2_te@layergraph#1"
    assert _recipe_twin("dp2_te@layergraph@model.bias_dropout_fusion=false#2") == (
        "dp2_te@layergraph#2"
    )
    assert _recipe_twin("dp2_te@layergraph") is None
    unfused = "dp2_te@layergraph@model.bias_dropout_fusion=false"

    def record(mode: str, step_ms: float, **extra: float) -> dict:
        return dict(mode=mode, tokens_per_gpu=4096, step_ms=step_ms, device="NVIDIA H200", **extra)

    records = [
        record("dp2_te@layergraph", 100.0),
        record(unfused, 110.0, mfu=0.3, free_step_ms=80.0, free_mfu=0.4125),
    ]
    table = _table(records)
    assert table.startswith("Ranks: fake process group, one GPU (NVIDIA H200)")
    assert "| 30.0 % | 80.0 | 41.2 % |" in table and "1.100×" in table
    records += [record("dp2_te@layergraph#1", 200.0), record(f"{unfused}#1", 200.0)]
    # pairs 1.1 and 1.0: median 1.05, summed steps 310 / 300
    assert (
        "median 1.050× recipe over 2 interleaved pair(s) (1.100, 1.000; summed steps "
        "1.033×)" in _table(records)
    )
    assert label([dict(device="cpu")]).startswith("Ranks: fake process group, CPU")


def test_eager_modifier_turns_a_graphed_recipe_eager() -> None:
    """The GPU recipes are graphed: ``@eager`` turns graphs off (and goes to the baseline), a
    graphed mode's eager twin is its ``@eager`` mode, and ``--shared-device`` accepts it."""
    _, overrides, baseline = resolve_mode("gtp2_te@eager")
    assert "+model.cuda_graph_impl=none" in overrides and baseline == "dp2_te@eager"
    assert _eager_twins("gtp2_te@graph") == ["gtp2_te@eager"]  # the recipe itself is graphed
    assert _eager_twins("gtp2_local@graph") == ["gtp2_local@eager", "gtp2_local"]
    assert _eager_twins("gtp2_te@eager") == []
    assert shared_device_refusal("gtp2_te@eager") is None
    assert "drop @layergraph" in shared_device_refusal("gtp2_te@layergraph")


def test_host_fake_modes_take_bench_nemos_modifiers() -> None:
    """A CPU mode at the host-bound tiny shape, its own ``@model.*`` after it (so it wins); a
    GPU mode with its modifiers and tokens per GPU."""
    config, overrides = _resolve("gtp2_cpu@model.num_layers=4@coalesce_mb=1#1", 2048)
    assert config == "configs/tiny_cpu.yaml"
    assert overrides == [*CPU_SHAPE, "+model.num_layers=4", "+gtp.coalesce_mb=1"]
    config, overrides = _resolve("dp2_te@graph", 4096)
    assert config == "configs/gpt_1b_te.yaml"
    assert "+model.cuda_graph_scope=full_iteration" in overrides
    assert overrides[-2:] == ["data.micro_batch_size=2", "data.global_batch_size=4"]


def test_bench_nemo_rows_and_repeat_medians_carry_mfu() -> None:
    from bench.bench_nemo import _repeat_summary

    records = [
        dict(mode="dp2_te", tokens_per_gpu=4096, step_ms=100.0, mfu=0.4),
        dict(mode="dp2_te#1", tokens_per_gpu=4096, step_ms=80.0, mfu=0.5),
    ]
    assert "| dp2_te | 4096 | 2 | 90.0 | 44.4 % |" in _repeat_summary(records)


def test_kernel_summary_groups_device_time_by_kind() -> None:
    """``host_fake --kernels``: torch.profiler's averages per step, by kind, host events out."""
    from types import SimpleNamespace as Avg

    averages = [
        Avg(key="sm90_xmma_gemm_bf16", count=300, self_device_time_total=150_000.0),
        Avg(key="flash_fwd_kernel", count=72, self_device_time_total=30_000.0),
        Avg(key="multi_tensor_apply_kernel<AdamFunctor>", count=6, self_device_time_total=9_000.0),
        Avg(key="Memcpy DtoD (Device -> Device)", count=30, self_device_time_total=3_000.0),
        Avg(key="cudaLaunchKernel", count=900, self_device_time_total=0.0),  # host-side API
        Avg(key="vectorized_elementwise_kernel", count=600, self_device_time_total=6_000.0),
    ]
    summary = kernel_summary(averages, steps=3, top=2)
    assert summary["busy_ms"] == 66.0 and summary["launches"] == 336.0
    assert summary["kinds"] == {
        "attention": [10.0, 24.0],
        "copy / fill": [1.0, 10.0],
        "gemm": [50.0, 100.0],
        "optimizer": [3.0, 2.0],
        "other": [2.0, 200.0],
    }
    assert [row[0] for row in summary["top"]] == ["sm90_xmma_gemm_bf16", "flash_fwd_kernel"]


def test_leftover_sites_name_where_what_is_still_allocated_came_from() -> None:
    """``host_fake --leftover-sites``: the blocks still allocated, summed by the innermost
    megatron / nemo_gtp / bench frame of their allocation; a CUDA graph pool's are marked."""

    def block(size_mib: int, path: str = "", state: str = "active_allocated") -> dict:
        frames = [dict(filename="/x/torch/nn/functional.py", line=1, name="linear")]
        frames += [dict(filename=f"/x/{path}", line=9, name="fn")] if path else []
        return dict(state=state, size=size_mib * 2**20, frames=frames)

    mib, gtp, megatron = 2**20, "nemo_gtp/engine/a.py", "megatron/core/g.py"
    snapshot = {
        "segments": [
            {
                "segment_pool_id": (0, 0),
                "blocks": [block(3, gtp), block(1024, state="inactive"), block(1, gtp)],
            },
            {
                "segment_pool_id": (1, 7),
                "blocks": [block(5, megatron), block(1, state="active_awaiting_free")],
            },
        ]
    }
    assert live_by_site(snapshot) == [
        (5 * mib, "core/g.py:9 fn [graph pool]"),
        (4 * mib, "engine/a.py:9 fn"),
    ]
    assert all(spec["leftover_sites"] for spec in _plan(_args(leftover_sites=True)))


def test_external_holders_names_a_python_path_or_what_only_cpp_holds() -> None:
    """``host_fake --leftover-sites``: a weight in a reference cycle held through a closure that
    only C++ keeps (here autograd's saved-tensor hook stack) is reported with that closure; one
    a module keeps gets its path from ``sys.modules``."""
    import gc
    import sys
    import types
    import weakref

    import torch

    def probe(ref: weakref.ref) -> list:
        objects = gc.get_objects()
        return external_holders([ref()], objects)

    class State:
        pass

    def build() -> weakref.ref:
        weight = torch.nn.Parameter(torch.zeros(2))
        state = State()
        state.weights, weight.state = (weight,), state

        def pack(tensor: torch.Tensor) -> tuple:
            return tensor, state

        # autograd's own stack, which only C++ holds (what saved_tensors_hooks pushes)
        torch._C._autograd._push_saved_tensors_default_hooks(pack, lambda packed: packed[0])
        return weakref.ref(weight)

    ref = build()
    try:
        gc.collect()
        found = probe(ref)
        assert found[0][0].startswith("held only from C++"), found
        assert any(kind == "builtins.function" and "pack" in text for _, kind, text in found[1:])
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    gc.collect()
    assert ref() is None  # the hook stack was its only holder
    module = types.ModuleType("holder_for_test")
    module.keep = [torch.nn.Parameter(torch.zeros(2))]
    sys.modules[module.__name__] = module
    try:
        path = probe(weakref.ref(module.keep[0]))
        assert path[0][0] == "python path" and path[0][1].endswith("torch.nn.parameter.Parameter()")
    finally:
        del sys.modules[module.__name__]


def test_sync_sites_count_torchs_sync_warnings_by_python_site() -> None:
    """``host_fake --sync-sites``: each warning torch's sync debug mode raises (its text, fed
    here on CPU) is counted under the stack that made it; other warnings pass through, and
    after ``stop`` nothing more is counted."""

    def read_the_loss() -> None:  # stands in for a `.item()` in the step
        warnings.warn(f"called a {SYNC_MESSAGE}", UserWarning, stacklevel=1)

    sites = SyncSites(depth=2)
    sites.start()
    for _ in range(4):
        read_the_loss()
    with pytest.warns(DeprecationWarning, match="not a sync"):
        warnings.warn("not a sync", DeprecationWarning, stacklevel=1)
    sites.stop()
    with pytest.warns(UserWarning, match=SYNC_MESSAGE):  # shown again, not counted
        read_the_loss()
    [[per_step, site]] = sites.per_step(2)
    assert per_step == 2.0
    assert site.startswith("tests/test_bench_mfu.py:") and "read_the_loss <" in site
    assert "test_sync_sites_count_torchs_sync_warnings_by_python_site" in site


def test_host_reads_count_what_reads_device_values_on_the_host() -> None:
    """``HostReads`` (a GPU step's host syncs, seen on CPU): ``.item()`` / ``bool()`` /
    ``float()`` and boolean-mask indexing are counted by their line; arithmetic, backward and
    writes into a tensor are not."""
    import torch

    weight = torch.randn(8, requires_grad=True)
    with HostReads(depth=1) as reads:
        loss = (weight * 2).sum()
        loss.backward()
        flags = torch.zeros(2)
        flags[0] = ~torch.isfinite(loss)  # a device write: no read
        found = flags.any().item()  # 1
        if bool(torch.isfinite(loss)) and float(loss) == loss.item():  # 3
            weight[weight > 0]  # 1
    assert found is False
    lines = sorted(int(site.split(":")[1].split()[0]) for _, site in reads.per_step(1))
    assert len(lines) == 3 and sum(n for n, _ in reads.per_step(1)) == 5

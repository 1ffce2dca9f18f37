"""Hugging Face weights in and out of a GTP fine-tune: NeMo's own import and export, on CPU.

A tiny ``LlamaForCausalLM`` and a tiny ``MixtralForCausalLM`` (4 experts, top-2) are built here
with ``transformers`` (no download: :mod:`tests.harness.hf`, random weights and norms, a
word-level tokenizer) and NeMo's ``llm.import_ckpt`` turns each into a NeMo checkpoint. A
fine-tune restores it (``RestoreConfig``, as ``llm.finetune`` starts) and trains 4 steps at
TP1·GTP2 (Mixtral: and EGTP2, its routed experts sharded too) on 2 CPU/gloo ranks with the
attention frozen (``linear_qkv``, ``linear_proj`` and the input norms: GTP shards that no step
changes); its losses and grad norms are those of the same fine-tune without GTP. NeMo's
``ModelCheckpoint`` saves it with its ``context/`` and NeMo's ``llm.export_ckpt(target="hf")``
exports it in a process of its own. Then, with ``transformers``:

- the exported model's logits equal the fine-tuned NeMo model's (its GTP forward, fp32) to 1e-5
  of their largest magnitude;
- the frozen weights (q, k, v, o projections and input norms) are bit for bit the imported
  Hugging Face ones: import, GTP sharding, training, the gather of the export and the un-fusing
  of q/k/v lose nothing; every trained weight moved.

The fine-tunes are fits of the suite's shared 2-rank launch; the imports run before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.shared_launch import shared_launch
from tests.harness.spawn import start_ranks
from tests.harness.strategy import Fit

FROZEN = ("self_attention.linear_qkv", "self_attention.linear_proj", "input_layernorm")
KINDS = ("llama", "mixtral")


def _fits(kind: str) -> tuple[Fit, Fit]:
    """The GTP2 fine-tune of ``kind``'s import (Mixtral: EGTP2 for the routed experts too) and
    the same fine-tune without GTP (DP2), whose losses are the oracle. At 2 ranks each step is
    2 microbatches, so the frozen chain head (layer 1's linear_qkv) makes the first trained
    unit the one whose reduce-scatter must not outlive its microbatch."""
    model = {"llama": kind == "llama", "mixtral": kind == "mixtral"}
    common = dict(steps=4, restore_from=f"hf_{kind}_nemo", freeze=FROZEN, **model)
    # Mixtral's exporter saves the checkpoint's tokenizer: the imported Hugging Face one
    expert = {"strategy_kwargs": {"expert_num_weight_shards": 2}} if kind == "mixtral" else {}
    if kind == "mixtral":
        common["tokenizer_dir"] = f"hf_{kind}"
    gtp = Fit(
        f"hf_{kind}_gtp2_finetune",
        gtp=2,
        checkpoint_every=4,
        checkpoint_dir=f"hf_{kind}_ft_ckpts",
        checkpoint_context=True,
        logits_to=f"hf_{kind}_ft_logits.pt",
        **expert,
        **common,
    )
    return gtp, Fit(f"hf_{kind}_base_finetune", **common)


def _import(out_dir: Path) -> None:
    """The Hugging Face models, then NeMo's import of each (before the launch's fits start)."""
    from tests.harness.hf import import_llama, make_tiny_llama, make_tiny_mixtral

    for kind, make in (("llama", make_tiny_llama), ("mixtral", make_tiny_mixtral)):
        hf, nemo = out_dir / f"hf_{kind}", out_dir / f"hf_{kind}_nemo"
        make(hf)
        start_ranks(import_llama, (str(hf), str(nemo), kind == "mixtral"), 1, join=True)


shared_launch(2).add([fit for kind in KINDS for fit in _fits(kind)], prepare=_import)


def _export(rank: int, checkpoint: str, out: str) -> None:
    """NeMo's ``llm.export_ckpt`` in a process of its own, as a user would run it."""
    del rank
    from nemo_gtp.cpu.compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm

    llm.export_ckpt(path=checkpoint, target="hf", output_path=out)


@pytest.fixture(scope="module", params=KINDS)
def roundtrip(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kind = request.param
    gtp_fit, base_fit = _fits(kind)
    launch = shared_launch(2)
    results = launch.results(tmp_path_factory)
    root: Path = launch.out_dir
    where = root / gtp_fit.checkpoint_dir
    saved = [p for p in where.iterdir() if not p.name.startswith(".")]
    assert len(saved) == 1, saved
    out = root / f"hf_{kind}_export"
    start_ranks(_export, (str(saved[0]), str(out)), 1, join=True)
    nemo = torch.load(root / gtp_fit.logits_to, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(input_ids=nemo["tokens"]).logits
    return {
        "kind": kind,
        "results": results[gtp_fit.name],
        "base": results[base_fit.name],
        "nemo_logits": nemo["logits"],
        "hf_logits": hf_logits,
        "imported": load_file(root / f"hf_{kind}" / "model.safetensors"),
        "exported": load_file(out / "model.safetensors"),
    }


def test_finetune_ran_under_gtp_with_frozen_shards(roundtrip: dict[str, Any]) -> None:
    for result in roundtrip["results"]:
        assert result["global_step"] == 4
        # 2 layers x (qkv, proj, fc1, fc2) sharded (Mixtral: x 4 experts' fc1 and fc2 on the
        # expert runtime); the attention's 2 x 2 frozen
        experts = 2 * 4 * 2 if roundtrip["kind"] == "mixtral" else 0
        assert result["gtp_params"] == 8 - (4 if experts else 0) + experts
        assert result["frozen_gtp_params"] == 4
        assert result["gtp_runtimes"] == (2 if experts else 1)


def test_finetune_matches_the_run_without_gtp(roundtrip: dict[str, Any]) -> None:
    for gtp, base in zip(roundtrip["results"], roundtrip["base"], strict=True):
        assert gtp["num_microbatches"] == base["num_microbatches"] == 2
        assert base["gtp_params"] == 0
        for key in ("losses", "grad_norms"):
            assert len(gtp[key]) == 4
            for a, b in zip(gtp[key], base[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (key, gtp[key], base[key])


def test_exported_logits_equal_the_nemo_models(roundtrip: dict[str, Any]) -> None:
    nemo, hf = roundtrip["nemo_logits"], roundtrip["hf_logits"]
    assert nemo.shape == hf.shape == (2, 16, 128) and nemo.dtype == hf.dtype == torch.float32
    scale = nemo.abs().max()
    assert (hf - nemo).abs().max() <= 1e-5 * scale, float((hf - nemo).abs().max() / scale)


def test_untouched_weights_are_the_imported_ones_bit_for_bit(roundtrip: dict[str, Any]) -> None:
    imported, exported = roundtrip["imported"], roundtrip["exported"]
    assert sorted(imported) == sorted(exported)
    frozen = ("q_proj", "k_proj", "v_proj", "o_proj", "input_layernorm")
    untouched = [name for name in imported if any(part in name for part in frozen)]
    assert len(untouched) == 5 * 2
    for name in untouched:
        assert exported[name].dtype == imported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], imported[name]), name
    for name in sorted(set(imported) - set(untouched)):  # MLP, norms, embeddings: trained
        assert not torch.equal(exported[name], imported[name]), name

"""Hugging Face weights in and out of a GTP fine-tune: NeMo's own import and export, on CPU.

A tiny ``LlamaForCausalLM`` is built here with ``transformers`` (no download:
:func:`tests.harness.hf.make_tiny_llama`, random weights and norms, a word-level tokenizer) and
NeMo's ``llm.import_ckpt`` turns it into a NeMo checkpoint. A fine-tune restores it
(``RestoreConfig``, as ``llm.finetune`` starts) and trains 4 steps at TP1·GTP2 on 2 CPU/gloo
ranks (the losses and grad norms those of the same fine-tune without GTP) with the attention
frozen (``linear_qkv``, ``linear_proj`` and the input norms: GTP shards
that no step changes); NeMo's ``ModelCheckpoint`` saves it with its ``context/`` and NeMo's
``llm.export_ckpt(target="hf")`` exports it in a process of its own. Then, with
``transformers``:

- the exported model's logits equal the fine-tuned NeMo model's (its GTP forward, fp32) to 1e-5;
- the frozen weights (q, k, v, o projections and input norms) are bit for bit the imported
  Hugging Face ones: import, GTP sharding, training, the gather of the export and the un-fusing
  of q/k/v lose nothing; every trained weight moved.

The fine-tune is one fit of the suite's shared 2-rank launch; the import runs before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.spawn import start_ranks
from tests.harness.strategy import Fit, shared_launch

HF_DIR, NEMO_DIR = "hf_llama", "hf_llama_nemo"
FROZEN = ("self_attention.linear_qkv", "self_attention.linear_proj", "input_layernorm")
FIT = Fit(
    "hf_llama_gtp2_finetune",
    llama=True,
    gtp=2,
    steps=4,
    restore_from=NEMO_DIR,
    freeze=FROZEN,
    checkpoint_every=4,
    checkpoint_dir="hf_llama_ft_ckpts",
    checkpoint_context=True,
    logits_to="hf_llama_ft_logits.pt",
)

# The same fine-tune without GTP (DP2): its losses are the oracle. At 2 ranks each step is 2
# microbatches, so the frozen chain head (layer 1's linear_qkv) makes the first trained unit
# the one whose reduce-scatter must not outlive its microbatch.
BASE = Fit("hf_llama_base_finetune", llama=True, steps=4, restore_from=NEMO_DIR, freeze=FROZEN)


def _import(out_dir: Path) -> None:
    """The Hugging Face model, then NeMo's import of it (before the launch's fits start)."""
    from tests.harness.hf import import_llama, make_tiny_llama

    make_tiny_llama(out_dir / HF_DIR)
    start_ranks(import_llama, (str(out_dir / HF_DIR), str(out_dir / NEMO_DIR)), 1, join=True)


shared_launch(2).add([FIT, BASE], prepare=_import)


def _export(rank: int, checkpoint: str, out: str) -> None:
    """NeMo's ``llm.export_ckpt`` in a process of its own, as a user would run it."""
    del rank
    from nemo_gtp.cpu.compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm

    llm.export_ckpt(path=checkpoint, target="hf", output_path=out)


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    launch = shared_launch(2)
    results = launch.results(tmp_path_factory)[FIT.name]
    base = launch.results(tmp_path_factory)[BASE.name]
    root: Path = launch.out_dir
    saved = [p for p in (root / FIT.checkpoint_dir).iterdir() if not p.name.startswith(".")]
    assert len(saved) == 1, saved
    out = root / "hf_llama_export"
    start_ranks(_export, (str(saved[0]), str(out)), 1, join=True)
    nemo = torch.load(root / FIT.logits_to, weights_only=True)
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(input_ids=nemo["tokens"]).logits
    return {
        "results": results,
        "base": base,
        "nemo_logits": nemo["logits"],
        "hf_logits": hf_logits,
        "imported": load_file(root / HF_DIR / "model.safetensors"),
        "exported": load_file(out / "model.safetensors"),
    }


def test_finetune_ran_under_gtp_with_frozen_shards(roundtrip: dict[str, Any]) -> None:
    for result in roundtrip["results"]:
        assert result["global_step"] == FIT.steps
        # 2 layers x (qkv, proj, fc1, fc2) sharded; the attention's 2 x 2 frozen
        assert result["gtp_params"] == 8 and result["frozen_gtp_params"] == 4


def test_finetune_matches_the_run_without_gtp(roundtrip: dict[str, Any]) -> None:
    for gtp, base in zip(roundtrip["results"], roundtrip["base"], strict=True):
        assert gtp["num_microbatches"] == base["num_microbatches"] == 2
        assert base["gtp_params"] == 0
        for key in ("losses", "grad_norms"):
            assert len(gtp[key]) == FIT.steps
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

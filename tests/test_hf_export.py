"""NeMo's own Hugging Face export (``llm.export_ckpt(target="hf")``) of a GTP checkpoint.

A tiny ``llm.LlamaModel`` (Llama 3 shape: GQA with 2 query groups, SwiGLU, untied output layer)
trains 4 steps at TP1·GTP2 on 2 CPU/gloo ranks and NeMo's ``ModelCheckpoint`` saves it with its
``context/``; then NeMo's registered exporter (``HFLlamaExporter``) converts the checkpoint in
a process of its own (a plain, non-GTP single-rank load). Every exported tensor must equal the
trained full weights (``nemo_gtp.full_state_dict``), un-fused here independently of the
exporter: q/k/v out of megatron's per-query-group interleaved ``linear_qkv``, gate/up out of
``linear_fc1``.
Exact: the model trains and exports in fp32.

Then fine-tuning: NeMo's LoRA and its canonical LoRA on that checkpoint (``RestoreConfig``, as
``llm.finetune`` starts) at TP1·GTP2, each adapter checkpoint exported by NeMo's
``llm.peft.export_lora`` to Hugging Face PEFT's format (``HFLlamaPEFTExporter``): every adapter
matrix must equal the trained one, the fused ``linear_qkv`` / ``linear_fc1`` adapters of LoRA
un-fused here independently.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.shared_launch import shared_launch
from tests.harness.spawn import start_ranks
from tests.harness.strategy import Fit

HEADS, GROUPS, HIDDEN, LAYERS = 4, 2, 64, 2
FIT = Fit(
    "llama_gtp2_export",
    llama=True,
    gtp=2,
    steps=4,
    checkpoint_every=4,
    checkpoint_dir="llama_ckpts",
    checkpoint_context=True,
    weights_to="llama_gtp2.pt",
)
LORA_FIT = Fit(
    "llama_gtp2_lora",
    llama=True,
    gtp=2,
    steps=4,
    peft="lora",
    restore_from="llama_ckpts/step=3",  # FIT's save, earlier in the same launch
    checkpoint_every=4,
    checkpoint_dir="llama_lora_ckpts",
    checkpoint_context=True,
    weights_to="llama_gtp2_lora.pt",
)
# NeMo's canonical LoRA (q, k, v adapters of their own; the harness's targets leave linear_fc1 out)
CANONICAL_FIT = dataclasses.replace(
    LORA_FIT,
    name="llama_gtp2_canonical",
    peft="canonical_lora",
    checkpoint_dir="llama_canonical_ckpts",
    weights_to="llama_gtp2_canonical.pt",
)
shared_launch(2).add([FIT, LORA_FIT, CANONICAL_FIT])


def _export(rank: int, checkpoint: str, out: str, lora: bool = False) -> None:
    """NeMo's exporter in a process of its own (forked from the preloaded fork server: no GTP
    state, no process group of the fit), as a user's ``llm.export_ckpt`` (``lora``:
    ``llm.peft.export_lora``) would run."""
    from nemo_gtp.cpu.compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm

    if lora:
        llm.peft.export_lora(lora_checkpoint_path=checkpoint, output_path=out)
    else:
        llm.export_ckpt(path=checkpoint, target="hf", output_path=out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    launch = shared_launch(2)
    results = launch.results(tmp_path_factory)[FIT.name]
    root: Path = launch.out_dir
    saved = sorted(p for p in (root / "llama_ckpts").iterdir() if not p.name.startswith("."))
    assert len(saved) == 1, saved
    assert (saved[0] / "context").is_dir()
    out, lora_out = root / "llama_hf", root / "llama_hf_lora"
    start_ranks(_export, (str(saved[0]), str(out)), 1, join=True)
    lora_saved = root / "llama_lora_ckpts" / "step=3"
    start_ranks(_export, (str(lora_saved), str(lora_out), True), 1, join=True)
    canonical_out = root / "llama_hf_canonical"
    canonical_saved = root / "llama_canonical_ckpts" / "step=3"
    start_ranks(_export, (str(canonical_saved), str(canonical_out), True), 1, join=True)
    from safetensors.torch import load_file

    return {
        "results": results,
        "trained": torch.load(root / FIT.weights_to, weights_only=True),
        "hf": load_file(out / "model.safetensors"),
        "config": (out / "config.json").read_text(),
        "lora_trained": torch.load(root / LORA_FIT.weights_to, weights_only=True),
        "lora_hf": load_file(lora_out / "adapter_model.safetensors"),
        "lora_config": json.loads((lora_out / "adapter_config.json").read_text()),
        "canonical_trained": torch.load(root / CANONICAL_FIT.weights_to, weights_only=True),
        "canonical_hf": load_file(canonical_out / "adapter_model.safetensors"),
    }


def _expected_hf(trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face Llama state dict of ``trained`` (megatron names, full tensors)."""
    head_dim = HIDDEN // HEADS
    per_group = HEADS // GROUPS
    out = {
        "model.embed_tokens.weight": trained["embedding.word_embeddings.weight"],
        "lm_head.weight": trained["output_layer.weight"],
        "model.norm.weight": trained["decoder.final_layernorm.weight"],
    }
    for i in range(LAYERS):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        # linear_qkv rows: per query group, its query heads, then one key and one value head
        qkv = trained[src + "self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(GROUPS, per_group + 2, head_dim, HIDDEN)
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, HIDDEN)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, HIDDEN)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, HIDDEN)
        out[dst + "self_attn.o_proj.weight"] = trained[src + "self_attention.linear_proj.weight"]
        gate, up = trained[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = trained[src + "mlp.linear_fc2.weight"]
        out[dst + "input_layernorm.weight"] = trained[
            src + "self_attention.linear_qkv.layer_norm_weight"
        ]
        out[dst + "post_attention_layernorm.weight"] = trained[
            src + "mlp.linear_fc1.layer_norm_weight"
        ]
    return out


def test_gtp_run_trained_and_saved(exported: dict[str, Any]) -> None:
    results = exported["results"]
    assert all(r["gtp_params"] > 0 for r in results)  # GTP really sharded the weights
    assert results[0]["global_step"] == FIT.steps
    assert len(exported["trained"]) == 3 + 6 * LAYERS


def test_exported_hf_weights_equal_trained(exported: dict[str, Any]) -> None:
    hf, expected = exported["hf"], _expected_hf(exported["trained"])
    assert sorted(hf) == sorted(expected)
    for name, tensor in expected.items():
        assert hf[name].dtype == torch.float32, name
        assert torch.equal(hf[name], tensor), name
    assert '"num_key_value_heads": 2' in exported["config"]


def _qkv_rows(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v rows of megatron's ``linear_qkv`` rows (per query group: its query heads, then
    one key and one value head); the trailing dims as they are."""
    head_dim, per_group = HIDDEN // HEADS, HEADS // GROUPS
    grouped = fused.reshape(GROUPS, per_group + 2, head_dim, -1)
    cols = fused.shape[-1]
    q = grouped[:, :per_group].reshape(-1, cols)
    return q, grouped[:, per_group].reshape(-1, cols), grouped[:, per_group + 1].reshape(-1, cols)


def test_exported_lora_adapters_equal_trained(exported: dict[str, Any]) -> None:
    """``llm.peft.export_lora`` of the GTP2 LoRA fine-tune's adapter checkpoint: Hugging Face
    PEFT's A (``lora_A``) and B (``lora_B``) of each projection equal the trained adapters; the
    fused ones un-fused as megatron lays them out (one A shared by q/k/v and by gate/up)."""
    trained, hf = exported["lora_trained"], exported["lora_hf"]
    expected = {}
    for i in range(LAYERS):
        src, dst = f"decoder.layers.{i}.", f"base_model.model.model.layers.{i}."

        def adapter(name: str, side: str, src: str = src) -> torch.Tensor:
            return trained[f"{src}{name}.adapter.linear_{side}.weight"]

        qkv_a, fc1_a = adapter("self_attention.linear_qkv", "in"), adapter("mlp.linear_fc1", "in")
        proj = [adapter("self_attention.linear_proj", side) for side in ("in", "out")]
        fc2 = [adapter("mlp.linear_fc2", side) for side in ("in", "out")]
        q, k, v = _qkv_rows(adapter("self_attention.linear_qkv", "out"))
        gate, up = adapter("mlp.linear_fc1", "out").chunk(2, dim=0)
        for name, a, b in (
            ("self_attn.q_proj", qkv_a, q),
            ("self_attn.k_proj", qkv_a, k),
            ("self_attn.v_proj", qkv_a, v),
            ("self_attn.o_proj", *proj),
            ("mlp.gate_proj", fc1_a, gate),
            ("mlp.up_proj", fc1_a, up),
            ("mlp.down_proj", *fc2),
        ):
            expected[f"{dst}{name}.lora_A.weight"] = a
            expected[f"{dst}{name}.lora_B.weight"] = b
    assert sorted(hf) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(hf[name], tensor), name
    assert any(tensor.any() for name, tensor in hf.items() if "lora_B" in name)  # trained
    config = exported["lora_config"]
    assert (config["r"], config["lora_alpha"]) == (4, 8), config


def test_exported_canonical_lora_adapters_equal_trained(exported: dict[str, Any]) -> None:
    """``llm.peft.export_lora`` of a GTP2 canonical LoRA fine-tune: q, k and v have adapters of
    their own, which are Hugging Face PEFT's q_proj / k_proj / v_proj A and B as trained."""
    trained, hf = exported["canonical_trained"], exported["canonical_hf"]
    expected = {}
    for i in range(LAYERS):
        src, dst = f"decoder.layers.{i}.", f"base_model.model.model.layers.{i}."
        for name, hf_name in (
            ("self_attention.linear_qkv.adapter.adapter_q", "self_attn.q_proj"),
            ("self_attention.linear_qkv.adapter.adapter_k", "self_attn.k_proj"),
            ("self_attention.linear_qkv.adapter.adapter_v", "self_attn.v_proj"),
            ("self_attention.linear_proj.adapter", "self_attn.o_proj"),
            ("mlp.linear_fc2.adapter", "mlp.down_proj"),
        ):
            for side, lora in (("in", "A"), ("out", "B")):
                expected[f"{dst}{hf_name}.lora_{lora}.weight"] = trained[
                    f"{src}{name}.linear_{side}.weight"
                ]
    assert sorted(hf) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(hf[name], tensor), name
    assert any(tensor.any() for name, tensor in hf.items() if "lora_B" in name)  # trained

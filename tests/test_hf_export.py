"""NeMo's own Hugging Face export (``llm.export_ckpt(target="hf")``) of a GTP checkpoint.

A tiny ``llm.LlamaModel`` (Llama 3 shape: GQA with 2 query groups, SwiGLU, untied output layer)
trains 4 steps at TP1·GTP2 on 2 CPU/gloo ranks and NeMo's ``ModelCheckpoint`` saves it with its
``context/``; then NeMo's registered exporter (``HFLlamaExporter``) converts the checkpoint in
a process of its own (a plain, non-GTP single-rank load). Every exported tensor must equal the
trained full weights (``nemo_gtp.full_state_dict``), un-fused here independently of the
exporter: q/k/v out of megatron's per-query-group interleaved ``linear_qkv``, gate/up out of
``linear_fc1``.
Exact: the model trains and exports in fp32.

On CPU the model uses megatron's local layer spec (no Transformer Engine) under
``harness_objects.te_named_local_layer_spec``, whose ``state_dict()`` names the norms as the
Transformer Engine spec does, the names NeMo's exporter maps from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_gtp.testing.spawn import start_ranks
from nemo_gtp.testing.strategy_harness import Fit, shared_launch

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
shared_launch(2).add([FIT])


def _export(rank: int, checkpoint: str, out: str) -> None:
    """NeMo's exporter in a process of its own (forked from the preloaded fork server: no GTP
    state, no process group of the fit), as a user's ``llm.export_ckpt`` would run."""
    from nemo_gtp.testing.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    from nemo.collections import llm

    llm.export_ckpt(path=checkpoint, target="hf", output_path=out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    launch = shared_launch(2)
    results = launch.results(tmp_path_factory)[FIT.name]
    root: Path = launch.out_dir
    saved = sorted(p for p in (root / "llama_ckpts").iterdir() if not p.name.startswith("."))
    assert len(saved) == 1, saved
    assert (saved[0] / "context").is_dir()
    out = root / "llama_hf"
    start_ranks(_export, (str(saved[0]), str(out)), 1, join=True)
    from safetensors.torch import load_file

    return {
        "results": results,
        "trained": torch.load(root / FIT.weights_to, weights_only=True),
        "hf": load_file(out / "model.safetensors"),
        "config": (out / "config.json").read_text(),
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

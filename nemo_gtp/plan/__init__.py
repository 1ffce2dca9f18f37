"""Which layout fits: per-GPU memory of a GPT under TP × GTP × DP, before launching anything.

``--pipeline-parallel PP`` plans TP × PP × GTP × DP layouts (each GPU its stage's layers; the
first stage keeps PP microbatches' activations in flight under 1F1B, the last the logits).

``python -m nemo_gtp.plan --recipe llama31_405b --gpus 128 --gpu-memory-gib 80 --flash-attention``
lists every candidate layout (TP × GTP × DP, activation recompute on/off,
``shard_replicated_params_over_gtp``) with its per-GPU bytes split into weights, gradients,
optimizer state, GTP gather buffers and activations, marks which fit, and recommends the one
expected fastest among those that fit: no activation recompute first (it re-runs the forward),
then fewest weight shards (every shard costs three collectives per weight per step), then TP
inside a node over GTP.

The byte model (design §1.7, §3.1 "Buffer / memory management", §3.2) assumes megatron's
mixed-precision distributed optimizer: bf16 (or fp32) model weights, a ``main_grad`` of the
``grad_dtype``, fp32 master weights and two fp32 Adam moments sharded over the replicate group
(DP) — for the params GTP leaves whole over DP × GTP with ``shard_replicated_params_over_gtp``;
``--optimizer muon``: Muon's non-distributed state instead (:func:`estimate`). MoE models
(Mixtral, DeepSeek, Qwen MoE) are planned at every EP × EGTP too, their routed experts split
over EP × TP × EGTP (:func:`estimate` says what is counted how).
Activations follow megatron's per-layer estimate (sequence parallelism with TP > 1):
``s·b·h·(34 + 5·a·s/h)`` bytes per layer (less without dropout, without the attention-score
term under flash attention), divided by TP, or only the layer inputs (``2·s·b·h``)
plus one layer's full activations under full recompute. It is an estimate, not a measurement:
``overhead_gib`` stands for the CUDA context, NCCL buffers and allocator slack.

Example::

    model = ModelShape(layers=24, hidden=2048, ffn=8192, heads=16, vocab=32000, seq=2048)
    plans = plan_layouts(model, gpus=2, gpu_memory_gib=141, tokens_per_gpu=4096)
    best = recommend(plans)          # ValueError naming the shortfall when nothing fits
"""

from nemo_gtp.plan.cli import main, model_from_nemo_recipe, model_from_recipe
from nemo_gtp.plan.layouts import candidate_layouts, plan_layouts, recommend, table, why
from nemo_gtp.plan.memory import estimate
from nemo_gtp.plan.shapes import GIB, Layout, ModelShape, Plan

__all__ = [
    "GIB",
    "Layout",
    "ModelShape",
    "Plan",
    "candidate_layouts",
    "estimate",
    "main",
    "model_from_nemo_recipe",
    "model_from_recipe",
    "plan_layouts",
    "recommend",
    "table",
    "why",
]

#!/usr/bin/env bash
# NeMo's model families on CPU: each family's own recipe (llm.<name>.pretrain_recipe), shrunk to
# 2 tiny layers, trained on 2 CPU processes with GTP2 (EGTP2 for routed experts), then without
# GTP, ending in one VERDICT line (the same shrinking overrides as tests/test_families.py).
#   bash examples/families.sh llama31_8b        # one family
#   bash examples/families.sh                   # every family, one after another
# Gemma 2 / 3 and Llama 4 build TransformerEngine-only layers: --cpu refuses them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TINY="trainer.max_steps=10 trainer.limit_val_batches=0 trainer.num_sanity_val_steps=0 trainer.log_every_n_steps=1 trainer.enable_progress_bar=False trainer.enable_checkpointing=False trainer.strategy.tensor_model_parallel_size=1 trainer.strategy.pipeline_model_parallel_size=1 trainer.strategy.virtual_pipeline_model_parallel_size=None trainer.strategy.sequence_parallel=False log.ckpt=None log.tensorboard=None model.config.num_layers=2 model.config.hidden_size=64 model.config.ffn_hidden_size=128 model.config.num_attention_heads=4 model.config.kv_channels=16 model.config.vocab_size=512 model.config.seq_length=32 data.seq_length=32 data.micro_batch_size=2 data.global_batch_size=8 optim.lr_scheduler.warmup_steps=2"
MOE="trainer.strategy.expert_model_parallel_size=1 model.config.num_moe_experts=4 model.config.moe_router_topk=2 model.config.moe_ffn_hidden_size=48 model.config.moe_grouped_gemm=False model.config.moe_token_dispatcher_type=allgather"
RUN="$PY -m nemo_gtp.run --cpu --devices 2 --num-weight-shards 2 --tokenizer byte --compare-baseline"
FAMILIES="llama3_8b llama31_8b llama32_1b mixtral_8x7b qwen25_500m qwen3_600m qwen3_30b_a3b nemotron3_4b gemma_2b deepseek_v2_lite"
run_family() {
  case "$1" in
  llama3_8b) $RUN --recipe llama3_8b $TINY model.config.num_query_groups=2 ;;
  llama31_8b) $RUN --recipe llama31_8b $TINY model.config.num_query_groups=2 ;;
  llama32_1b) $RUN --recipe llama32_1b $TINY model.config.num_query_groups=2 ;;
  mixtral_8x7b) $RUN --recipe mixtral_8x7b --expert-num-weight-shards 2 $TINY $MOE model.config.num_query_groups=2 model.config.ffn_hidden_size=48 ;;
  qwen25_500m) $RUN --recipe qwen25_500m $TINY model.config.num_query_groups=2 ;;
  qwen3_600m) $RUN --recipe qwen3_600m $TINY model.config.num_query_groups=2 ;;
  qwen3_30b_a3b) $RUN --recipe qwen3_30b_a3b --expert-num-weight-shards 2 $TINY $MOE model.config.num_query_groups=2 ;;
  nemotron3_4b) $RUN --recipe nemotron3_4b $TINY model.config.num_query_groups=2 ;;
  gemma_2b) $RUN --recipe gemma_2b $TINY model.config.num_query_groups=1 ;;
  deepseek_v2_lite) $RUN --recipe deepseek_v2_lite --expert-num-weight-shards 2 $TINY $MOE model.config.num_query_groups=4 'model.config.moe_layer_freq=[0,1]' model.config.moe_shared_expert_intermediate_size=64 model.config.moe_shared_expert_overlap=False model.config.kv_lora_rank=32 model.config.qk_head_dim=16 model.config.qk_pos_emb_head_dim=8 model.config.v_head_dim=16 ;;
  *) echo "unknown family $1 (one of: $FAMILIES)" >&2; return 2 ;;
  esac
}
for family in ${@:-$FAMILIES}; do
  run_family "$family"
done

# Blockwise FP8 primary weights (megatron fp8_param + fp8_recipe=blockwise; new this session):
# GTP2 on GTP's FP8 primary shards that own their 128x128 tiles vs DP2 on TE's own
# Float8BlockwiseQTensor params, 50 steps at lr 1e-4 with a 10-step warmup, two ranks on one
# GPU; then what GTP hands TE vs TE's Float8BlockQuantizer on the full fp32 masters (bits).
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh; mkdir -p $OUT/r2
timeout 400 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 385 \
  --modes fp8blockparam_gtp2,fp8blockparam_dp2 --lr 1e-4 --steps 50 --lr-warmup 10 \
  --out $OUT/r2 2>&1 | grep -v Warn | grep -E "fp8blockparam|PASS|FAIL|Error|error" | head -30

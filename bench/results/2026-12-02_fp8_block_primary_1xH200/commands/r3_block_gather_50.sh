# Blockwise FP8 *gathers* (bf16 shards, FP8 rows + tile scales on the wire) over 50 steps at lr
# 1e-4 with a 10-step warmup: GTP2 vs DP2 on TE's own blockwise path, and DP2's split twin
# (its noise floor), two ranks on one GPU.
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh; mkdir -p $OUT/r3
timeout 500 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 485 \
  --modes fp8block_gtp2,fp8block_dp2,fp8block_dp2_split --lr 1e-4 --steps 50 --lr-warmup 10 \
  --out $OUT/r3 2>&1 | grep -v Warn | tail -14

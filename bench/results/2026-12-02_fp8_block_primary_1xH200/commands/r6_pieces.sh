# After the write-back was changed to work through each master slice in pieces, in two passes
# (amax, then the cast; no fp32 copy of every slice held at once), on a second machine: blockwise
# and per-tensor FP8 primary weights again, GTP2 vs DP2 on TE's own FP8 params, 20 steps at lr
# 1e-4 with a 10-step warmup, two ranks on one GPU, with the bit checks of r2.
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh; mkdir -p $OUT/r6
timeout 300 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 285 \
  --modes fp8blockparam_gtp2,fp8blockparam_dp2,fp8param_gtp2,fp8param_dp2 --lr 1e-4 --steps 20 \
  --lr-warmup 10 --out $OUT/r6 2>&1 | grep -v Warn | grep -E "\| (loss: fp8.*param|fp8.*param_gtp2|FP8 primary)" | cut -c1-260

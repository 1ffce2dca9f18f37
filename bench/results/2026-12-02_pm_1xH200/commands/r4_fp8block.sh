# Blockwise FP8 (bf16 gathers, TE quantizes the gathered weight): GTP2 vs DP2 over 50 steps at
# lr 1e-4 and the noise floor (DP2 again, grads in 1M-element buckets), two ranks sharing
# cuda:0 (staged collectives; step times meaningless).
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
timeout 560 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 550 \
  --modes fp8block_dp2,fp8block_gtp2,fp8block_dp2_rebucket --lr 1e-4 --steps 50 \
  --out $OUT/r4 2>&1 | grep -v Warn | tail -12
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)

# The noise floor of the blockwise FP8 loss check (r4: GTP2 vs DP2 0.0545, DP2 re-bucketed
# 0.00086 — a uniform grad scale Adam cancels): DP2 with every micro-batch in two halves (same
# samples, each wgrad summed in another order), and the bf16 pair with its own split twin; 50
# steps, lr 1e-4, two ranks sharing cuda:0.
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
timeout 570 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 560 \
  --modes fp8block_dp2,fp8block_dp2_split,bf16_dp2,bf16_gtp2,bf16_dp2_split --lr 1e-4 --steps 50 \
  --out $OUT/r5 2>&1 | grep -v Warn | tail -14
(cd $OUT && tar czf r5.tgz r5 && rm -rf r5)

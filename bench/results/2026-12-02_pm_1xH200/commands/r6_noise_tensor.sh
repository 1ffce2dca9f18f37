# The same for per-tensor current scaling with FP8 gathers: GTP2 vs DP2 and DP2's split twin.
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
timeout 570 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 560 \
  --modes fp8_dp2,fp8_gtp2,fp8_dp2_split --lr 1e-4 --steps 50 \
  --out $OUT/r6 2>&1 | grep -v Warn | tail -14
(cd $OUT && tar czf r6.tgz r6 && rm -rf r6)

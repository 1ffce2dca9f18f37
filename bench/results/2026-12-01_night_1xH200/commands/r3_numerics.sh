# Grouped experts on real TE with TF32 off (is the fp32 parity miss TF32?), then blockwise FP8.
set -u
source bench/results/2026-12-01_night_1xH200/commands/env.sh
O=$OUT/r3; mkdir -p $O
NVIDIA_TF32_OVERRIDE=0 timeout 170 python3 bench/gpu_grouped_experts.py --shared-device --timeout 165 \
  --out $O/grouped_notf32 2>&1 | grep -v Warn | tail -8
timeout 200 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 190 \
  --modes fp8block_dp2,fp8block_gtp2 --lr 1e-4 --steps 12 --out $O/fp8block 2>&1 | grep -v Warn | tail -8
(cd $OUT && tar czf r3.tgz r3 && rm -rf r3)

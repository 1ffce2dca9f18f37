# The blockwise hand-out after the review's mend (f14633a: _wrap_blocks decides the column-wise
# copy from its plan alone), never run on a GPU before: what GTP hands TE (rows, tile scales,
# column-wise copy) vs TE's Float8BlockQuantizer on the full weight, FP8 primary blockwise and
# blockwise FP8 gathers, plus the per-tensor modes, two ranks on one GPU (staged backend)
set -u
source bench/results/2026-12-03_harness_1xH200/commands/env.sh; mkdir -p $OUT/r3
timeout 250 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 240 \
  --modes fp8blockparam_gtp2,fp8block_gtp2,fp8param_gtp2,fp8_gtp2 --lr 1e-4 --lr-warmup 10 \
  --steps 10 --out $OUT/r3/bits 2>&1 | grep -v Warn | grep -E "FP8|PASS|FAIL|rror" | cut -c1-240

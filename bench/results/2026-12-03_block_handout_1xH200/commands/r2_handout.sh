# The blockwise backward hand-out planned once per gathered buffer (te_fp8._BlockHandOut: TE's
# transpose kernel + one scale copy per hand-out, instead of TE's _create_columnwise per call):
# (a) bits: what GTP hands TE (rows, tile scales, column-wise copy) vs TE's Float8BlockQuantizer
#     on the full weight, FP8 primary blockwise and blockwise FP8 gathers, two ranks on one GPU;
# (b) host: fake 2-rank world, full 1B blockwise FP8-primary recipe at 4k tokens per GPU, the new
#     hand-out vs the old one (%tecolumnwise) interleaved twice, beside DP2; cProfile of 3 steps.
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh; mkdir -p $OUT/r2
timeout 160 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 150 \
  --modes fp8blockparam_gtp2,fp8block_gtp2 --lr 1e-4 --lr-warmup 10 --steps 10 \
  --out $OUT/r2/bits 2>&1 | grep -v Warn | grep -E "FP8|PASS|FAIL|rror" | cut -c1-240
timeout 400 python3 bench/host_fake.py --modes \
  dp2_fp8blockparam,gtp2_fp8blockparam,gtp2_fp8blockparam%tecolumnwise --tokens 4096 --repeat 2 \
  --profile 3 --steps 12 --out $OUT/r2/host 2>&1 | grep -E "^\||rror" | cut -c1-300

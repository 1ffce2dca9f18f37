# Where the blockwise FP8 primary recipe's peak memory comes from: the full 1B recipe through
# the strategy, two ranks on one GPU, rank 0's allocations recorded per fit (bench_nemo
# --memory-trace): the bf16 twin, blockwise FP8 gathers and blockwise FP8 primary weights.
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh; mkdir -p $OUT/r3
timeout 420 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --memory-trace --modes gtp2_te,gtp2_fp8block,gtp2_fp8blockparam --fit-timeout 200 \
  --out $OUT/r3 2>&1 | grep -E "GATHER|\| gtp2|Error|error" | cut -c1-300
head -12 $OUT/r3/memory_peak_*.txt

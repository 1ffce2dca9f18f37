# Gathered bytes of blockwise FP8 gathers on the full 1B recipe through the strategy (the bf16
# twin, gtp2_te, is r4's 2304.0 MiB per step), two ranks on one GPU.
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh; mkdir -p $OUT/r7
timeout 150 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --modes "gtp2_fp8@fp8.recipe=blockwise" --fit-timeout 140 --out $OUT/r7 2>&1 | tail -3

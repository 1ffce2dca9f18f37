# r5 again after the write-back change (full 1B recipe, gtp2_te vs gtp2_fp8blockparam): bytes,
# and rank 0's allocator peak.
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh; mkdir -p $OUT/r7
timeout 330 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --modes gtp2_te,gtp2_fp8blockparam --fit-timeout 150 --out $OUT/r7 2>&1 \
  | grep -E "GATHER|Error|error" | cut -c1-400; grep -E "^\| gtp2" $OUT/r7/bench_nemo.md | cut -d'|' -f2,7,13

# Gathered bytes of blockwise FP8 primary shards on the full 1B recipe through the strategy vs
# the bf16 GTP2 twin (gtp2_te), one launch, two ranks on one GPU: the GATHER BYTES line.
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh; mkdir -p $OUT/r5
timeout 330 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --modes gtp2_te,gtp2_fp8blockparam --fit-timeout 150 --out $OUT/r5 2>&1 \
  | grep -E "GATHER|PARITY|Error|error" | cut -c1-400

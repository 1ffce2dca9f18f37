# After the two changes of this round (coalescing units counted in the training dtype; the
# write-back planned once per runtime, engine/fp8_write_back.py), one machine, one call:
# (a) the FP8 primary numerics again (two ranks on one GPU, 10 steps): bit checks of what GTP
#     hands TE vs TE's quantizers on the full fp32 masters, write-back exact;
# (b) the full 1B blockwise FP8 primary recipe's peak with the allocation trace (r3's twin);
# (c) the write-back's host µs per weight (fake world, 96 weights);
# (d) r4's fake-world step time pair for blockwise FP8 primary (once: the device time left).
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh; mkdir -p $OUT/r5
timeout 150 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 140 \
  --modes fp8blockparam_gtp2,fp8param_gtp2 --lr 1e-4 --lr-warmup 10 --steps 10 \
  --out $OUT/r5/fp8param 2>&1 | grep -v Warn | grep -E "FP8 primary|PASS|FAIL|rror" | cut -c1-240
timeout 150 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --memory-trace --modes gtp2_fp8blockparam --fit-timeout 140 --out $OUT/r5/memory \
  2>&1 | grep -E "GATHER|\| gtp2|Error|error" | cut -c1-300
head -8 $OUT/r5/memory/memory_peak_*.txt
timeout 40 python3 -W ignore bench/write_back_host.py --device cuda --weights 96 | tee $OUT/r5/write_back_host.jsonl
timeout 150 python3 bench/host_fake.py --modes dp2_fp8blockparam,gtp2_fp8blockparam \
  --tokens 4096 --repeat 1 --profile 0 --steps 12 --out $OUT/r5/host 2>&1 | grep -E "^\||rror" | cut -c1-300

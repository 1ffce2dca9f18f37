# Step time without communication (rank 0 of a fake 2-rank world, one GPU): blockwise and
# per-tensor FP8 primary weights, GTP2 vs DP2 on the full 1B FP8 recipe at 4k tokens per GPU,
# twice interleaved: what GTP's write-back and FP8 hand-outs cost against megatron's
# quantize_param_shard and TE's own FP8 params (host_inside: ms per step inside GTP's entry
# points and the optimizer).
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh; mkdir -p $OUT/r4
timeout 420 python3 bench/host_fake.py --modes \
  dp2_fp8blockparam,gtp2_fp8blockparam,dp2_fp8param,gtp2_fp8param --tokens 4096 --repeat 2 \
  --profile 0 --steps 12 --out $OUT/r4 2>&1 | grep -E "^\||rror" | cut -c1-300

# Blockwise FP8 (TE's Float8BlockScaling: bf16 gathers, TE quantizes the gathered weight) GTP2 vs
# DP2 and DP2's split twin (its noise floor), 50 steps at lr 1e-4 with a 10-step linear warmup
# (as NeMo's recipes train), two ranks on one GPU.
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh; mkdir -p $OUT/r5
timeout 430 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 415 \
  --modes fp8block_dp2,fp8block_gtp2,fp8block_dp2_split --lr 1e-4 --steps 50 --lr-warmup 10 \
  --out $OUT/r5 2>&1 | grep -v Warn | tail -14

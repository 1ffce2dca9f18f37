# The GPU re-run of the last write-back change (amax from the unrounded fp32 master, fewer ops;
# CPU-verified only until now): stage fp8param of gpu_pending.sh on one GPU (two ranks sharing
# cuda:0, numerics): FP8 primary per-tensor and blockwise, megatron GPT vs TE's own FP8 params,
# bit checks vs TE's quantizers, then the NeMo 1B FP8 recipe (4-layer cut) through the strategy.
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh
ONE_GPU=1 OUT=$OUT/r2 bash bench/gpu_pending.sh fp8param
